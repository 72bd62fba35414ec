"""Activations of the example GPT, measured in PyTorch: the bytes autograd keeps for backward at the end of forward
(saved-tensor hooks, each storage counted once, the parameters left out), for the model twin of
examples/support/gpt_model.rs (bench/deepspeed/gpt_deepspeed.py), with and without recomputing every block
(torch.utils.checkpoint). Prints one JSON line per case, beside `zerorun estimate --micro-batch`'s numbers:

    .venv/bin/python bench/activations/saved_tensors.py --zerorun target/release/zerorun
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import types

import torch
import torch.utils.checkpoint as checkpoint

sys.modules.setdefault("deepspeed", types.ModuleType("deepspeed"))  # the twin's module imports it; not used here
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "deepspeed"))
from gpt_deepspeed import Gpt  # noqa: E402


def saved_bytes(model, idx, recompute):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        t = idx.shape[1]
        x = model.tok(idx) + model.pos(torch.arange(t))
        for b in model.blocks:
            x = checkpoint.checkpoint(b, x, use_reentrant=False) if recompute else b(x)
        logits = model.head(model.ln_f(x))
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), idx.view(-1))
    total = sum(seen.values())
    loss.backward()
    return total


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--zerorun", default="target/release/zerorun")
    a.add_argument("--micro-batch", type=int, default=12)
    a.add_argument("--block", type=int, default=64)
    a.add_argument("--vocab", type=int, default=65)
    args = a.parse_args()
    torch.manual_seed(0)
    for layers, embd, heads in [(4, 256, 4), (8, 512, 8), (12, 768, 12)]:
        model = Gpt(args.vocab, args.block, layers, heads, embd)
        idx = torch.randint(0, args.vocab, (args.micro_batch, args.block))
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"layers": layers, "hidden": embd, "heads": heads, "vocab": args.vocab, "seq_len": args.block}, f)
        for recompute in (False, True):
            measured = saved_bytes(model, idx, recompute)
            cmd = [args.zerorun, "estimate", "--model", f.name, "--micro-batch", str(args.micro_batch), "--json"]
            cmd += ["--activation-checkpointing"] if recompute else []
            est = json.loads(subprocess.check_output(cmd))["activations"]["end_of_forward_bytes"]
            print(json.dumps({"layers": layers, "hidden": embd, "heads": heads, "seq_len": args.block,
                              "micro_batch": args.micro_batch, "activation_checkpointing": recompute,
                              "measured_bytes": measured, "estimated_bytes": est, "error": est / measured - 1}))
        os.unlink(f.name)


if __name__ == "__main__":
    main()
