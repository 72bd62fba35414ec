"""The Llama example (examples/llama/) beside DeepSpeed running transformers' own LlamaForCausalLM: the same
Hugging Face folder (a random ~100M-parameter Llama made here by transformers), token file, data order and
ds_config.json, 2 ranks on this machine, stages 0 and 3.

    make bench-deepspeed            (or: .venv/bin/python bench/deepspeed/llama_side_by_side.py [--steps N])

Writes llama_results.json and llama_results.md next to this file. With --sequence-parallel 2: both split each row
over the 2 ranks (`sequence_parallel_size`; DeepSpeed-Ulysses through its Hugging Face path), stages 1 and 3, into
llama_results_sp2.json and .md. With --experts N (--top-k K): a Mixtral by transformers (N experts, top K,
router_aux_loss_coef 0.02, output_router_logits on), DeepSpeed running transformers' MixtralForCausalLM under its
engine (its AutoEP needs transformers 5 and a GPU), zerorun at E = 1 and at --expert-parallel 2, stages 2 and 3,
into llama_results_moe.json and .md."""
import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "../.."))
ZR = os.path.join(ROOT, "target/release/zerorun")
LLAMA = os.path.join(ROOT, "target/release/examples/llama")
VENV_BIN = os.path.join(ROOT, ".venv/bin")
CASES = {"stage0": {"stage": 0}, "stage3": {"stage": 3}}


def config(zero, batch, micro):
    return {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        # torch_adam: DeepSpeed's CPU path without offload is torch.optim.AdamW (FusedAdam needs CUDA).
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": zero,
    }


def make_model(out, a):
    """A random Llama by transformers (seeded), saved as from the hub, and random token rows."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                 num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=2048,
                 tie_word_embeddings=False)
    if a.experts:
        c = MixtralConfig(**shape, num_local_experts=a.experts, num_experts_per_tok=a.top_k, router_aux_loss_coef=0.02,
                          output_router_logits=True, sliding_window=None)
        model = MixtralForCausalLM(c)
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape))
    model.save_pretrained(out)
    rows = torch.randint(0, a.vocab, (64, a.seq + 1), generator=torch.Generator().manual_seed(1))
    save_file({"tokens": rows}, os.path.join(out, "tokens.safetensors"))
    return sum(p.numel() for p in model.parameters())


def parse(text):
    losses = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^(?:\[rank 0\] )?step (\d+) loss ([-\d.eE+naif]+)", text, re.M)}
    median = re.search(r"median_step_s ([\d.eE+-]+)", text)
    rss = [int(m.group(1)) for m in re.finditer(r"peak_rss_bytes (\d+)", text)]
    return losses, float(median.group(1)) if median else None, rss


def run(cmd, env, log):
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    open(log, "w").write(p.stdout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])}... failed ({p.returncode}); see {log}:\n" + "\n".join(p.stdout.splitlines()[-15:]))
    return p.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="train_batch_size (2 ranks, 2 per rank)")
    ap.add_argument("--sequence-parallel", type=int, default=1)
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--top-k", type=int, default=2)
    a = ap.parse_args()
    sp = a.sequence_parallel
    # (name, zero section, zerorun's extra flags); a case whose zero section repeats the previous one's reuses
    # DeepSpeed's run (zerorun's expert parallelism has no DeepSpeed counterpart on the CPU).
    if a.experts:
        cases = [(f"moe_stage{st}{tag}", {"stage": st}, flags) for st in (2, 3)
                 for tag, flags in (("", []), ("_ep2", ["--expert-parallel", "2"]))]
        suffix = "_moe"
    elif sp == 1:
        cases = [(name, zero, []) for name, zero in CASES.items()]
        suffix = ""
    else:
        cases = [(f"sp{sp}_stage1", {"stage": 1}, []), (f"sp{sp}_stage3", {"stage": 3}, [])]
        suffix = f"_sp{sp}"
    work = os.path.join(a.out, "work", "llama")
    os.makedirs(work, exist_ok=True)
    model_dir = os.path.join(work, "model")
    params = make_model(model_dir, a)
    data = os.path.join(model_dir, "tokens.safetensors")
    env = dict(os.environ, DS_ACCELERATOR="cpu", PATH=VENV_BIN + ":" + os.environ.get("PATH", ""), OMP_NUM_THREADS="1")
    rows = []
    ds, last_zero = None, None
    for i, (name, zero, flags) in enumerate(cases):
        cfg = os.path.join(work, f"{name}.json")
        # With sequence parallelism the 2 ranks are one data-parallel rank: the micro-batch is the whole batch.
        c = config(zero, a.batch, a.batch // 2 * sp)
        if sp > 1:
            c["sequence_parallel_size"] = sp
        json.dump(c, open(cfg, "w"), indent=2)
        zr = run([ZR, "launch", "--nproc-per-node", "2", "--", LLAMA, "--config", cfg, "--hf", model_dir, "--data", data,
                  "--steps", str(a.steps)] + flags, env, os.path.join(work, f"{name}.zerorun.log"))
        if zero != last_zero:
            last_zero = zero
            ds = run([os.path.join(VENV_BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(29650 + i),
                  os.path.join(HERE, "llama_deepspeed.py"), "--config", cfg, "--hf", model_dir, "--data", data,
                      "--steps", str(a.steps), "--sequence-parallel", str(sp)], env, os.path.join(work, f"{name}.deepspeed.log"))
        zl, zt, zrss = parse(zr)
        dl, dt, drss = parse(ds)
        steps = sorted(set(zl) & set(dl))
        row = {
            "case": name, "steps": len(steps),
            "max_loss_rel_diff": max(abs(zl[s] - dl[s]) / abs(dl[s]) for s in steps),
            "final_loss_zerorun": zl.get(a.steps), "final_loss_deepspeed": dl.get(a.steps),
            "median_step_s_zerorun": zt, "median_step_s_deepspeed": dt, "step_time_ratio": zt / dt,
            "peak_rss_zerorun": zrss, "peak_rss_deepspeed": drss, "peak_rss_ratio": max(zrss) / max(drss),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    model = {"experts": a.experts, "top_k": a.top_k, "layers": a.layers, "hidden": a.hidden, "ffn": a.ffn, "heads": a.heads, "kv_heads": a.kv_heads,
             "vocab": a.vocab, "seq": a.seq, "params": params, "train_batch_size": a.batch}
    json.dump({"steps": a.steps, "ranks": 2, "model": model, "rows": rows}, open(os.path.join(a.out, f"llama_results{suffix}.json"), "w"), indent=2)
    kind = f"Mixtral ({a.experts} experts, top {a.top_k}, aux loss 0.02)" if a.experts else "Llama"
    md = [f"{kind} {a.layers} layers, hidden {a.hidden}, {a.heads} heads ({a.kv_heads} kv), vocab {a.vocab}, {params / 1e6:.1f}M parameters, "
          f"sequence {a.seq}{f' split over {sp} ranks' if sp > 1 else ''}, global batch {a.batch}, 2 ranks, {a.steps} steps, fp32", "",
          "| case | max loss rel. diff | step time zerorun / DeepSpeed | peak RSS per rank zerorun / DeepSpeed |", "|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['case']} | {r['max_loss_rel_diff']:.1e} | {r['median_step_s_zerorun']:.2f} s / {r['median_step_s_deepspeed']:.2f} s = "
                  f"{r['step_time_ratio']:.2f} | {max(r['peak_rss_zerorun']) / 2**20:.0f} MiB / {max(r['peak_rss_deepspeed']) / 2**20:.0f} MiB = {r['peak_rss_ratio']:.2f} |")
    open(os.path.join(a.out, f"llama_results{suffix}.md"), "w").write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
