"""zerorun vs DeepSpeed on the same GPT, data order, initial weights and ds_config.json, 2 ranks on this machine.

    make bench-deepspeed            (or: .venv/bin/python bench/deepspeed/side_by_side.py [--steps N] [--cases a,b])

For each case a ds_config.json is written once and given to both unchanged. zerorun runs the tch example under
`zerorun launch`; DeepSpeed runs gpt_deepspeed.py under its own launcher (DS_ACCELERATOR=cpu, gloo). Both print
per-step losses, the median step time after two warm-up steps and every rank's peak RSS, and save their final
parameters. Writes results.json and results.md next to this file."""
import argparse
import json
import os
import re
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "../.."))
ZR = os.path.join(ROOT, "target/release/zerorun")
GPT = os.path.join(ROOT, "target/release/examples/gpt")
VENV_BIN = os.path.join(ROOT, ".venv/bin")

CASES = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3},
    "stage2_cpu_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "stage3_cpu_offload": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    # bf16 (not in the default list: DeepSpeed's CPU bf16 path is checked case by case, see README)
    "stage2_bf16": {"stage": 2, "bf16": True},
    # bf16 with gradients reduced in fp32 by both (DeepSpeed's bf16 optimizer and zerorun otherwise differ in the
    # reduction dtype only).
    "stage2_bf16_fp32_comm": {"stage": 2, "bf16": True, "comm": "fp32"},
}
DEFAULT_CASES = ["stage0", "stage1", "stage2", "stage3", "stage2_cpu_offload", "stage3_cpu_offload"]


def config(zero, offload, batch=16):
    zero = dict(zero)
    bf16 = zero.pop("bf16", False)
    comm = zero.pop("comm", None)
    # torch_adam: DeepSpeed's plain (non-offload) CPU path is torch.optim.AdamW (FusedAdam needs CUDA); with
    # offload DeepSpeed requires its CPU Adam, so the flag is left out there. zerorun reads both forms.
    params = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    if not offload:
        params["torch_adam"] = True
    return {
        "train_batch_size": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": params},
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        **({"communication_data_type": comm} if comm else {}),
    }


def load_safetensors(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8 : 8 + n])
    data = b[8 + n :]
    out = {}
    for k, m in header.items():
        if k == "__metadata__":
            continue
        s, e = m["data_offsets"]
        out[k] = struct.unpack(f"<{(e - s) // 4}f", data[s:e])
    return out


def parse(text):
    losses = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^(?:\[rank 0\] )?step (\d+) loss ([-\d.eE+naif]+)", text, re.M)}
    median = re.search(r"median_step_s ([\d.eE+-]+)", text)
    rss = [int(m.group(1)) for m in re.finditer(r"peak_rss_bytes (\d+)", text)]
    return losses, float(median.group(1)) if median else None, rss


def run(cmd, env, log):
    t = time.time()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    open(log, "w").write(p.stdout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])}... failed ({p.returncode}); see {log}:\n" + "\n".join(p.stdout.splitlines()[-15:]))
    return p.stdout, time.time() - t


def prepare(out, shape, batch, name):
    """The work folder under `out`, both runs' environment, and the initial weights made once from the tch model of
    `shape` (0 steps, saved by name to `work/{name}.safetensors`; DeepSpeed loads the same file): (work, env, init
    path, parameter count)."""
    work = os.path.join(out, "work")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", PATH=VENV_BIN + ":" + os.environ.get("PATH", ""), OMP_NUM_THREADS="1")
    init = os.path.join(work, f"{name}.safetensors")
    first_cfg = os.path.join(work, f"{name}.json")
    json.dump(config({"stage": 0}, False, batch), open(first_cfg, "w"))
    run([GPT, "--config", first_cfg, "--steps", "0", "--save-final", init] + shape, env, os.path.join(work, f"{name}.log"))
    return work, env, init, sum(len(v) for v in load_safetensors(init).values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, from {', '.join(CASES)}")
    ap.add_argument("--out", default=HERE, help="where results.json, results.md and work/ go")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="train_batch_size")
    a = ap.parse_args()
    shape = ["--layers", str(a.layers), "--embd", str(a.embd), "--heads", str(a.heads), "--block", str(a.block)]
    work, env, init, params = prepare(a.out, shape, a.batch, "init")
    rows = []
    for name in a.cases.split(","):
        zero = CASES[name]
        offload = "offload_optimizer" in zero
        cfg_path = os.path.join(work, f"{name}.json")
        json.dump(config(zero, offload, a.batch), open(cfg_path, "w"), indent=2)
        zr_final, ds_final = os.path.join(work, f"{name}.zerorun.safetensors"), os.path.join(work, f"{name}.deepspeed.safetensors")
        zr_out, _ = run([ZR, "launch", "--nproc-per-node", "2", "--", GPT, "--config", cfg_path, "--steps", str(a.steps), "--init", init, "--save-final", zr_final] + shape, env, os.path.join(work, f"{name}.zerorun.log"))
        ds_cmd = [os.path.join(VENV_BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(29600 + len(rows)), os.path.join(HERE, "gpt_deepspeed.py"),
                  "--config", cfg_path, "--steps", str(a.steps), "--init", init, "--save-final", ds_final] + shape
        ds_out, _ = run(ds_cmd, env, os.path.join(work, f"{name}.deepspeed.log"))
        zl, zt, zr = parse(zr_out)
        dl, dt, dr = parse(ds_out)
        steps = sorted(set(zl) & set(dl))
        loss_rel = max((abs(zl[s] - dl[s]) / max(abs(dl[s]), 1e-12) for s in steps), default=float("nan"))
        zp, dp = load_safetensors(zr_final), load_safetensors(ds_final)
        param_rel = max(max(abs(x - y) for x, y in zip(zp[k], dp[k])) / max(max(abs(y) for y in dp[k]), 1e-6) for k in dp)
        row = {
            "case": name, "steps": len(steps),
            "final_loss_zerorun": zl.get(a.steps), "final_loss_deepspeed": dl.get(a.steps),
            "max_loss_rel_diff": loss_rel, "param_max_rel_diff": param_rel,
            "median_step_s_zerorun": zt, "median_step_s_deepspeed": dt, "step_time_ratio": zt / dt if zt and dt else None,
            "peak_rss_zerorun": zr, "peak_rss_deepspeed": dr,
            "peak_rss_ratio": max(zr) / max(dr) if zr and dr else None,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    model = {"layers": a.layers, "embd": a.embd, "heads": a.heads, "block": a.block, "params": params, "train_batch_size": a.batch}
    json.dump({"steps": a.steps, "ranks": 2, "model": model, "rows": rows}, open(os.path.join(a.out, "results.json"), "w"), indent=2)
    md = [f"GPT {a.layers} blocks, width {a.embd}, {params} parameters, global batch {a.batch}, 2 ranks, {a.steps} steps", "","| case | max loss rel. diff | param max rel. diff | step time zerorun / DeepSpeed | peak RSS per rank zerorun / DeepSpeed |", "|---|---|---|---|---|"]
    for r in rows:
        md.append(
            f"| {r['case']} | {r['max_loss_rel_diff']:.1e} | {r['param_max_rel_diff']:.1e} | "
            f"{r['median_step_s_zerorun'] * 1e3:.1f} ms / {r['median_step_s_deepspeed'] * 1e3:.1f} ms = {r['step_time_ratio']:.2f} | "
            f"{max(r['peak_rss_zerorun']) / 2**20:.0f} MiB / {max(r['peak_rss_deepspeed']) / 2**20:.0f} MiB = {r['peak_rss_ratio']:.2f} |"
        )
    open(os.path.join(a.out, "results.md"), "w").write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
