"""zerorun's pipeline vs DeepSpeed's PipelineModule on the same GPT, data order, initial weights and ds_config.json:
2 stages on 2 ranks, ZeRO 0 and 1, 4 and 8 micro-batches a step.

    .venv/bin/python bench/deepspeed/pipeline_side_by_side.py [--steps N] [--layers 6 --embd 256]

zerorun runs `examples/gpt --pipeline-stages 2` under `zerorun launch`; DeepSpeed runs gpt_deepspeed.py
--pipeline-stages 2 under its launcher (DS_ACCELERATOR=cpu, gloo). Both cut by parameters (each one's default) and
print the cut; each prints per-step losses, the median step after two warm-up steps and every rank's peak RSS.
Writes pipeline_results.json and pipeline_results.md next to this file."""
import argparse
import json
import os
import sys

from side_by_side import GPT, HERE, VENV_BIN, ZR, config, load_safetensors, parse, prepare, run

CASES = [(zero, gas) for zero in (0, 1) for gas in (4, 8)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="train_batch_size (one data-parallel replica)")
    ap.add_argument("--cases", help="comma-separated zero:micro-batches, e.g. 0:4,1:8 (default: all four)")
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--clip", action="store_true", help="gradient_clipping 1.0 (the losses then differ: see below)")
    a = ap.parse_args()
    cases = [tuple(int(v) for v in c.split(":")) for c in a.cases.split(",")] if a.cases else CASES
    shape = ["--layers", str(a.layers), "--embd", str(a.embd), "--heads", str(a.heads), "--block", str(a.block)]
    work, env, init, params = prepare(a.out, shape, a.batch, "pipe_init")
    rows = []
    for zero, gas in cases:
        name = f"zero{zero}_mb{gas}"
        cfg = config({"stage": zero}, False, a.batch)
        cfg["gradient_accumulation_steps"] = gas
        cfg["train_micro_batch_size_per_gpu"] = a.batch // gas
        # No clipping: DeepSpeed's pipeline clips each stage by that stage's own gradient norm (its norm is reduced
        # over the data-parallel and tensor-parallel groups, not the pipe group), so with clipping its losses
        # leave the one-process model's from step 2, where zerorun's (the norm agreed over every stage) stay on it.
        cfg["gradient_clipping"] = 0.0 if not a.clip else 1.0
        cfg_path = os.path.join(work, f"pipe_{name}.json")
        json.dump(cfg, open(cfg_path, "w"), indent=2)
        zr_final, ds_final = (os.path.join(work, f"pipe_{name}.{who}.safetensors") for who in ("zerorun", "deepspeed"))
        zr_out, _ = run([ZR, "launch", "--nproc-per-node", "2", "--", GPT, "--pipeline-stages", "2", "--config", cfg_path,
                         "--steps", str(a.steps), "--init", init, "--save-final", zr_final] + shape, env, os.path.join(work, f"pipe_{name}.zerorun.log"))
        ds_cmd = [os.path.join(VENV_BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(29700 + len(rows)),
                  os.path.join(HERE, "gpt_deepspeed.py"), "--pipeline-stages", "2", "--config", cfg_path, "--steps", str(a.steps),
                  "--init", init, "--save-final", ds_final] + shape
        ds_out, _ = run(ds_cmd, env, os.path.join(work, f"pipe_{name}.deepspeed.log"))
        zl, zt, zr = parse(zr_out)
        dl, dt, dr = parse(ds_out)
        steps = sorted(set(zl) & set(dl))
        loss_diff = max((abs(zl[s] - dl[s]) for s in steps), default=float("nan"))
        zp, dp = load_safetensors(zr_final), load_safetensors(ds_final)
        assert set(zp) == set(dp), f"parameter names differ: {sorted(set(zp) ^ set(dp))[:5]}"
        param_diff = max(max(abs(x - y) for x, y in zip(zp[k], dp[k])) for k in dp)
        row = {
            "case": name, "zero_stage": zero, "micro_batches": gas, "steps": len(steps),
            "final_loss_zerorun": zl.get(a.steps), "final_loss_deepspeed": dl.get(a.steps),
            "max_loss_abs_diff": loss_diff, "param_max_abs_diff": param_diff,
            "median_step_s_zerorun": zt, "median_step_s_deepspeed": dt, "step_time_ratio": zt / dt,
            "peak_rss_zerorun": zr, "peak_rss_deepspeed": dr, "peak_rss_ratio": max(zr) / max(dr),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    model = {"layers": a.layers, "embd": a.embd, "heads": a.heads, "block": a.block, "params": params, "train_batch_size": a.batch}
    json.dump({"steps": a.steps, "ranks": 2, "stages": 2, "model": model, "rows": rows}, open(os.path.join(a.out, "pipeline_results.json"), "w"), indent=2)
    md = [f"GPT {a.layers} x {a.embd}, {params} parameters, global batch {a.batch}, 2 pipeline stages on 2 ranks, {a.steps} steps", "",
          "| ZeRO | micro-batches | max loss diff | max parameter diff | step time zerorun / DeepSpeed | peak RSS per rank zerorun / DeepSpeed |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['zero_stage']} | {r['micro_batches']} | {r['max_loss_abs_diff']:.1e} | {r['param_max_abs_diff']:.1e} | "
                  f"{r['median_step_s_zerorun'] * 1e3:.1f} ms / {r['median_step_s_deepspeed'] * 1e3:.1f} ms = {r['step_time_ratio']:.2f} | "
                  f"{max(r['peak_rss_zerorun']) / 2**20:.0f} MiB / {max(r['peak_rss_deepspeed']) / 2**20:.0f} MiB = {r['peak_rss_ratio']:.2f} |")
    open(os.path.join(a.out, "pipeline_results.md"), "w").write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
