"""The example MLP (examples/mlp.rs: `layers.0` ... `layers.{L-1}`, exact GELU between them, mean-squared error)
in PyTorch, trained with DeepSpeed on the same data, data order, initial weights and ds_config.json as
`target/release/examples/mlp --data D --init I`. Rank 0 prints what the tch example prints under `zerorun launch`:
`[rank 0] step N loss X time T ms` per optimizer step (the loss a mean over ranks), which is what
`zerorun bench cluster --launcher torchrun` reads. Run under torchrun (gloo, DS_ACCELERATOR=cpu):

    torchrun --nproc-per-node 2 mlp_deepspeed.py --config C --data D --init I --in 1024 --hidden 4096 --layers 5 --out 8
"""
import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

import deepspeed

# The examples' splitmix64 (a step's samples depend only on (seed, step)) and the end of a rank.
from gpt_deepspeed import Rng, leave


class Mlp(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dims[i], dims[i + 1]) for i in range(len(dims) - 1)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = F.gelu(x)
        return x


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in", dest="input", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--out", type=int, default=4)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    data = load_file(a.data)
    x, y = data["x"].float(), data["y"].float()
    dims = [a.input] + [a.hidden] * (a.layers - 1) + [a.out]
    model = Mlp(dims)
    init = load_file(a.init)
    names = set(dict(model.named_parameters()))
    assert names == set(init), f"--init names differ: {sorted(names ^ set(init))[:5]}"
    model.load_state_dict(init, strict=True)
    cfg = json.load(open(a.config))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    train = engine.train_batch_size()
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    samples = x.shape[0]
    for step in range(a.steps):
        started = time.perf_counter()
        rng = Rng(a.seed, step)
        order = [rng.next() % samples for _ in range(train)]
        losses = []
        for m in range(gas):
            first = (m * world + rank) * micro
            idx = torch.tensor(order[first : first + micro], dtype=torch.int64)
            loss = F.mse_loss(engine(x.index_select(0, idx)).float(), y.index_select(0, idx))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        mean = torch.tensor([sum(losses) / len(losses)], dtype=torch.float32)
        torch.distributed.all_reduce(mean)
        ms = (time.perf_counter() - started) * 1e3
        if rank == 0:
            print(f"[rank 0] step {step + 1} loss {mean.item() / world:.6f} time {ms:.0f} ms", flush=True)
    leave()


if __name__ == "__main__":
    main()
