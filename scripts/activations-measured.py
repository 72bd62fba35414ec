#!/usr/bin/env python3
"""zerorun's measured activations (the memory report's `activations` at the end of forward, counted by the
counting allocator) against `zerorun estimate`'s count, for the example GPT at three sizes, with and without
activation checkpointing (stage 3, 2 ranks, block 64, micro-batch 12, fp32). Release binaries:

    cargo build --release --bins --example gpt && python3 scripts/activations-measured.py
"""
import json
import os
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZERORUN = os.path.join(ROOT, "target/release/zerorun")
GPT = os.path.join(ROOT, "target/release/examples/gpt")
BLOCK, MICRO = 64, 12
with open(os.path.join(ROOT, "examples/data/shakespeare.txt"), encoding="utf-8") as _f:
    VOCAB = len(set(_f.read()))  # the corpus's characters, as examples/support/gpt_model.rs counts them


def measured(layers, embd, heads, checkpointing, work):
    config = os.path.join(work, "zero3.json")
    with open(config, "w") as f:
        json.dump({"train_batch_size": 2 * MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                   "zero_optimization": {"stage": 3}}, f)
    report = os.path.join(work, f"r{layers}-{checkpointing}")
    cmd = [ZERORUN, "launch", "--nproc-per-node", "2", "--memory-report", report, "--", GPT, "--config", config,
           "--layers", str(layers), "--embd", str(embd), "--heads", str(heads), "--block", str(BLOCK), "--steps", "2"]
    if checkpointing:
        cmd.append("--activation-checkpointing")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    with open(os.path.join(report, "memory_rank0.json")) as f:
        r = json.load(f)
    forward = [e for e in r["events"] if e["event"] == "forward"]
    return forward[-1]["categories"]["activations"]


def estimated(layers, embd, heads, checkpointing, work):
    model = os.path.join(work, "gpt.json")
    with open(model, "w") as f:
        json.dump({"layers": layers, "hidden": embd, "heads": heads, "vocab": VOCAB, "seq_len": BLOCK}, f)
    cmd = [ZERORUN, "estimate", "--model", model, "--micro-batch", str(MICRO), "--json"]
    if checkpointing:
        cmd.append("--activation-checkpointing")
    return json.loads(subprocess.check_output(cmd))["activations"]["end_of_forward_bytes"]


def main():
    print("| GPT | checkpointing | measured (zerorun report) | `zerorun estimate` | error |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for layers, embd, heads in [(4, 256, 4), (8, 512, 8), (12, 768, 12)]:
            for checkpointing in (False, True):
                m = measured(layers, embd, heads, checkpointing, work)
                e = estimated(layers, embd, heads, checkpointing, work)
                print(f"| {layers} x {embd}, {heads} heads | {'every unit' if checkpointing else 'no'} | "
                      f"{m:,} B | {e:,} B | {100 * (e - m) / m:+.2f}% |", flush=True)


if __name__ == "__main__":
    main()
