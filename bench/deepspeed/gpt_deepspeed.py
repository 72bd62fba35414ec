"""The example GPT (examples/support/gpt_model.rs) in PyTorch, trained with DeepSpeed on the same data order,
initial weights and ds_config.json as `target/release/examples/gpt`. Prints what the tch example prints:
`step N loss X` per optimizer step (mean over ranks) and `median_step_s T` on rank 0, and `peak_rss_bytes B` on
every rank. Run under DeepSpeed's launcher:  deepspeed --num_gpus 2 gpt_deepspeed.py --config C --steps N ..."""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import deepspeed


class Block(nn.Module):
    def __init__(self, e, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(e)
        self.attn_q = nn.Linear(e, e)
        self.attn_k = nn.Linear(e, e, bias=False)
        self.attn_v = nn.Linear(e, e)
        self.attn_proj = nn.Linear(e, e)
        self.ln2 = nn.LayerNorm(e)
        self.fc = nn.Linear(e, 4 * e)
        self.proj = nn.Linear(4 * e, e)
        self.heads = heads

    def attention(self, x):
        b, t, c = x.shape
        hs = c // self.heads
        split = lambda l: l(x).view(b, t, self.heads, hs).transpose(1, 2)
        q, k, v = split(self.attn_q), split(self.attn_k), split(self.attn_v)
        att = q.matmul(k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1, dtype=torch.float)
        y = att.to(v.dtype).matmul(v).transpose(1, 2).contiguous().view(b, t, c)
        return self.attn_proj(y)

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        h = F.gelu(self.fc(self.ln2(x)))
        return x + self.proj(h)


class Gpt(nn.Module):
    def __init__(self, vocab, block, layers, heads, embd):
        super().__init__()
        self.tok = nn.Embedding(vocab, embd)
        self.pos = nn.Embedding(block, embd)
        self.blocks = nn.ModuleList([Block(embd, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(embd)
        self.head = nn.Linear(embd, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


MASK = (1 << 64) - 1


class Rng:
    """splitmix64, as examples/support/mod.rs: batches depend only on (seed, step)."""

    def __init__(self, seed, stream):
        # Both hashed into the state, as Rng::new does (a state of seed ^ stream x increment made consecutive
        # streams the same draws one place apart).
        s, t = Rng.__new__(Rng), Rng.__new__(Rng)
        s.s, t.s = seed & MASK, (stream ^ 0xD1B54A32D192ED03) & MASK
        u = t.next()
        self.s = s.next() ^ (((u << 29) | (u >> 35)) & MASK)

    def next(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & MASK
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)


class Embed(nn.Module):
    """The pipeline's first layer: the token and position embeddings (examples/support/gpt_model.rs's "embed")."""

    def __init__(self, vocab, block, embd):
        super().__init__()
        self.tok = nn.Embedding(vocab, embd)
        self.pos = nn.Embedding(block, embd)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))


class Head(nn.Module):
    """The pipeline's last layer: the final norm and the head."""

    def __init__(self, vocab, embd):
        super().__init__()
        self.ln_f = nn.LayerNorm(embd)
        self.head = nn.Linear(embd, vocab)

    def forward(self, x):
        return self.head(self.ln_f(x))


def pipeline_layers(vocab, block, layers, heads, embd):
    """The GPT as DeepSpeed's PipelineModule takes it, with the whole model's parameter name of each of its
    parameters (PipelineModule names them `{layer}.{name}`)."""
    modules = [Embed(vocab, block, embd)] + [Block(embd, heads) for _ in range(layers)] + [Head(vocab, embd)]
    names = {}
    for i, m in enumerate(modules):
        for n, _ in m.named_parameters():
            names[f"{i}.{n}"] = n if i == 0 or i == len(modules) - 1 else f"blocks.{i - 1}.{n}"
    return modules, names


def corpus(path):
    text = open(path, encoding="utf-8").read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return [index[c] for c in text], len(chars)


def batch(ids, seed, step, train, rows, block):
    rng = Rng(seed, step)
    limit = len(ids) - block - 1
    starts = [rng.next() % limit for _ in range(train)]
    xs = [ids[s : s + block] for s in starts[rows[0] : rows[1]]]
    ys = [ids[s + 1 : s + 1 + block] for s in starts[rows[0] : rows[1]]]
    return torch.tensor(xs, dtype=torch.int64), torch.tensor(ys, dtype=torch.int64)


def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def print_step(step, loss, rank, world):
    """`step N loss X` on rank 0: this rank's loss averaged over the ranks, as the tch example prints it."""
    mean = torch.tensor([loss], dtype=torch.float32)
    torch.distributed.all_reduce(mean)
    if rank == 0:
        print(f"step {step + 1} loss {mean.item() / world:.6f}", flush=True)


def print_median(times, rank):
    """`median_step_s T` on rank 0: the median step after two warm-up steps."""
    t = sorted(times[2:] or times)
    if rank == 0:
        print(f"median_step_s {t[len(t) // 2]:.6f}", flush=True)


def leave():
    """Ends a rank once everything is written: DeepSpeed 0.19.8 on CPU can abort at interpreter exit ("terminate
    called without an active exception") after a finished run, so its exit handlers are not run."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", required=True)
    p.add_argument("--save-final")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--pipeline-stages", type=int, help="train through DeepSpeed's PipelineModule and train_batch")
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    here = os.path.dirname(os.path.abspath(__file__))
    ids, vocab = corpus(os.path.join(here, "../../examples/data/shakespeare.txt"))
    if a.pipeline_stages:
        return train_pipeline(a, ids, vocab, rank, world)
    model = Gpt(vocab, a.block, a.layers, a.heads, a.embd)
    init = load_file(a.init)
    missing = set(dict(model.named_parameters())) ^ set(init)
    assert not missing, f"--init names differ: {sorted(missing)[:5]}"
    model.load_state_dict(init, strict=True)
    cfg = json.load(open(a.config))
    # The tch example's recipe: no weight decay for 1-D parameters (biases, norms).
    decay = [p for _, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for _, p in model.named_parameters() if p.dim() <= 1]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    train = engine.train_batch_size()
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    times = []
    for step in range(a.steps):
        started = time.perf_counter()
        losses = []
        for m in range(gas):
            first = (m * world + rank) * micro
            x, y = batch(ids, a.seed, step, train, (first, first + micro), a.block)
            logits = engine(x)
            loss = F.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        times.append(time.perf_counter() - started)
        print_step(step, sum(losses) / len(losses), rank, world)
    print_median(times, rank)
    if a.save_final:
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=cfg.get("zero_optimization", {}).get("stage", 0) == 3):
            if rank == 0:
                save_file({n: p.detach().float().contiguous().clone() for n, p in engine.module.named_parameters()}, a.save_final)
    torch.distributed.barrier()
    print(f"peak_rss_bytes {peak_rss()}", flush=True)
    leave()


def train_pipeline(a, ids, vocab, rank, world):
    """The same GPT cut into `--pipeline-stages` stages by DeepSpeed's PipelineModule (partition by parameters,
    its default and zerorun's), one `train_batch` over gradient_accumulation_steps micro-batches per step."""
    from deepspeed.pipe import PipelineModule

    modules, names = pipeline_layers(vocab, a.block, a.layers, a.heads, a.embd)
    init = load_file(a.init)
    for i, m in enumerate(modules):
        m.load_state_dict({n: init[names[f"{i}.{n}"]] for n, _ in m.named_parameters()}, strict=True)
    loss_fn = lambda logits, y: F.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
    model = PipelineModule(layers=modules, num_stages=a.pipeline_stages, loss_fn=loss_fn, partition_method="parameters")
    cfg = json.load(open(a.config))
    decay = [p for _, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for _, p in model.named_parameters() if p.dim() <= 1]
    groups = [g for g in ({"params": decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    train, micro, gas = engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dp, dp_rank = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
    if rank == 0:
        print(f"pipeline parts {model.parts}", flush=True)
    times = []
    for step in range(a.steps):
        parts = [batch(ids, a.seed, step, train, ((m * dp + dp_rank) * micro, (m * dp + dp_rank + 1) * micro), a.block) for m in range(gas)]
        started = time.perf_counter()
        loss = engine.train_batch(iter(parts))
        times.append(time.perf_counter() - started)
        print_step(step, float(loss), rank, world)
    print_median(times, rank)
    if a.save_final:
        # Each stage's parameters (named `{layer}.{name}` by the global layer index) under the whole model's names,
        # gathered to rank 0.
        own = {names[n]: p.detach().float().clone() for n, p in engine.module.named_parameters()} if dp_rank == 0 else {}
        every = [None] * world
        torch.distributed.all_gather_object(every, own)
        if rank == 0:
            save_file({k: v.contiguous() for d in every for k, v in d.items()}, a.save_final)
    torch.distributed.barrier()
    print(f"peak_rss_bytes {peak_rss()}", flush=True)
    leave()


if __name__ == "__main__":
    main()
