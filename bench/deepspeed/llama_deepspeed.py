"""transformers' own LlamaForCausalLM trained with DeepSpeed on the data order of examples/llama/ (rows
(s-1)·B .. s·B of the token file, rank r's share r·B/W .. (r+1)·B/W in micro-batches), from the same Hugging Face
folder and ds_config.json. Prints what the tch example prints: `step N loss X` (mean over ranks), `median_step_s T`
and every rank's `peak_rss_bytes B`. Run under DeepSpeed's launcher:
    deepspeed --num_gpus 2 llama_deepspeed.py --config C --hf DIR --data TOKENS --steps N [--sequence-parallel S]

With --sequence-parallel S (the config's `sequence_parallel_size` too): DeepSpeed-Ulysses through its Hugging Face
path (ALST's UlyssesSPAttentionHF over sdpa): S adjacent ranks take the same rows, each its slice of the sequence
with its positions, and each rank's loss is its tokens' summed cross-entropy over the group's tokens (the printed
loss is the group's sum of those: the rows' mean). A Mixtral folder (its config's output_router_logits) adds
router_aux_loss_coef times transformers' load-balancing loss to each micro-batch's cross-entropy, as the example."""
import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import deepspeed

from gpt_deepspeed import leave


def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def every_expert_runs():
    """transformers' Mixtral block runs only the experts some token chose, so a rank whose tokens left an expert
    unchosen has no gradient for it, and DeepSpeed's ZeRO-2 buckets differ across the ranks: its all-reduce fails
    (gloo: "Received data size doesn't match expected size"; DeepSpeed #4808 is the ZeRO-3 hang). As zerorun's layer
    does, every expert also runs on no rows here: zeros added, a gradient (zeros) for each."""
    from transformers.models.mixtral import modeling_mixtral as mixtral

    original = mixtral.MixtralSparseMoeBlock.forward

    def forward(self, hidden_states):
        out, logits = original(self, hidden_states)
        none = hidden_states.reshape(-1, hidden_states.shape[-1])[:0]
        return out + sum(expert(none).sum() for expert in self.experts), logits

    mixtral.MixtralSparseMoeBlock.forward = forward


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--hf", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--sequence-parallel", type=int, default=1)
    a = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = json.load(open(a.config))
    dtype = torch.bfloat16 if cfg.get("bf16", {}).get("enabled") else torch.float32
    sp = a.sequence_parallel
    if json.load(open(os.path.join(a.hf, "config.json"))).get("model_type") == "mixtral":
        every_expert_runs()
    rows = load_file(a.data)["tokens"].long()
    n = rows.shape[0]
    if sp > 1:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        cfg["sequence_parallel_size"] = sp
        model = AutoModelForCausalLM.from_pretrained(a.hf, dtype=dtype, attn_implementation="sdpa")
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
            micro_batch_size=cfg["train_micro_batch_size_per_gpu"], seq_length=rows.shape[1] - 1,
            seq_length_is_variable=False)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu)
        group = mpu.get_sequence_parallel_group()
    else:
        model = AutoModelForCausalLM.from_pretrained(a.hf, dtype=dtype)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    train, micro = engine.train_batch_size(), engine.train_micro_batch_size_per_gpu()
    gas = int(engine.gradient_accumulation_steps())  # a float with sequence_parallel_size
    data_rank, data_world = rank // sp, world // sp
    times = []
    for step in range(a.steps):
        started = time.perf_counter()
        losses = []
        base = step * train + data_rank * (train // data_world)
        for m in range(gas):
            index = torch.tensor([(base + m * micro + i) % n for i in range(micro)])
            x, y = rows[index, :-1], rows[index, 1:]
            if sp == 1:
                out = engine(input_ids=x)
                logits = out.logits
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
                if getattr(out, "aux_loss", None) is not None:
                    loss = loss + model.config.router_aux_loss_coef * out.aux_loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                continue
            t = x.shape[1] // sp
            r = torch.distributed.get_rank(group)
            xs, ys = x[:, r * t:(r + 1) * t], y[:, r * t:(r + 1) * t]
            positions = torch.arange(r * t, (r + 1) * t).unsqueeze(0).expand(x.shape[0], t)
            logits = engine(input_ids=xs, position_ids=positions).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ys.reshape(-1), reduction="sum") / y.numel()
            engine.backward(loss)
            engine.step()
            whole = loss.detach().clone()
            torch.distributed.all_reduce(whole, group=group)
            losses.append(whole.item())
        mean = torch.tensor([sum(losses) / len(losses)], dtype=torch.float32)
        torch.distributed.all_reduce(mean)
        times.append(time.perf_counter() - started)
        if rank == 0:
            print(f"step {step + 1} loss {mean.item() / world:.6f}", flush=True)
    t = sorted(times[2:] or times)
    if rank == 0:
        print(f"median_step_s {t[len(t) // 2]:.6f}", flush=True)
    torch.distributed.barrier()
    print(f"peak_rss_bytes {peak_rss()}", flush=True)
    leave()


if __name__ == "__main__":
    main()
