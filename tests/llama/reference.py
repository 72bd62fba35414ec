"""transformers' side of tests/llama.rs: makes tiny random Llamas, computes their logits, trains one with
torch.optim.AdamW in one process on the example's data order, and evaluates saved models. Run with the project
venv's python (make setup installs transformers)."""
import json
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


def tiny_moe(kind, seed):
    """A tiny Mixtral or Qwen3-MoE (4 experts, top 2, the load-balancing loss in the loss at 0.02); the Qwen3-MoE
    has a dense layer (mlp_only_layers) and does not renormalise its top-k weights."""
    torch.manual_seed(seed)
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                 max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=96, num_local_experts=4, **shape))
    else:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=48, num_experts=4,
                                                   head_dim=16, norm_topk_prob=False, mlp_only_layers=[1], **shape))
    return model.eval()


def tiny(tied, seed):
    if tied in ("mixtral", "qwen3_moe"):
        model = tiny_moe(tied, seed)
    elif tied == "heads3":
        # Three heads over one key/value head: heads that do not divide over 2 ranks.
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=3, num_key_value_heads=1, vocab_size=128,
                                             max_position_embeddings=64, rms_norm_eps=1e-6)).eval()
    else:
        model = tiny_llama(tied == "tied", seed)
    # Random norm weights too: ones would hide a norm applied in the wrong place.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def tiny_llama(tied, seed):
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).eval()


def make(out, tied, shard):
    """A tiny random model in `out` (sharded past `shard` bytes when given), and its logits on fixed tokens."""
    model = tiny(tied, 7)
    if shard:
        model.save_pretrained(out, max_shard_size=int(shard))
    else:
        model.save_pretrained(out)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    save_file({"ids": ids.contiguous(), "logits": logits.contiguous()}, f"{out}/reference_logits.safetensors")


def tokens(path, rows, width, vocab, dtype):
    ids = torch.randint(0, vocab, (rows, width), generator=torch.Generator().manual_seed(11))
    save_file({"tokens": ids.to(getattr(torch, dtype)).contiguous()}, path)


def batch(rows, step, size):
    """Step `step` (1-based) of the example's contract: rows (step-1)·B .. step·B mod N."""
    n = rows.shape[0]
    index = torch.tensor([((step - 1) * size + i) % n for i in range(size)])
    r = rows[index].long()
    return r[:, :-1], r[:, 1:]


def loss_of(model, x, y, parts=1):
    """The mean next-token cross-entropy; with experts (output_router_logits), each of `parts` equal parts of the
    batch (the data-parallel ranks' micro-batches, in order) adds router_aux_loss_coef times its own load-balancing
    loss, and the loss is the parts' mean."""
    total = 0.0
    for xp, yp in zip(x.chunk(parts), y.chunk(parts)):
        out = model(input_ids=xp)
        logits = out.logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), yp.reshape(-1))
        if getattr(out, "aux_loss", None) is not None:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss
        total = total + loss
    return total / parts


def train(source, data, config_path, steps, out, parts=1):
    """`steps` optimizer steps of the full batch, as ds_config says (AdamW, constant lr, clipping), one process;
    the batch's loss is the mean over `parts` micro-batches (see loss_of)."""
    ds = json.load(open(config_path))
    params = ds["optimizer"]["params"]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"],
        weight_decay=params["weight_decay"],
    )
    rows = load_file(data)["tokens"]
    for step in range(1, steps + 1):
        x, y = batch(rows, step, ds["train_batch_size"])
        opt.zero_grad()
        loss = loss_of(model, x, y, int(parts))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), ds["gradient_clipping"])
        opt.step()
        print(f"reference step {step} loss {loss.item():.6f}")
    model.save_pretrained(out)


def compare(a, b, bound):
    """Largest |a - b| over every element of two model folders' tensors (and how far training moved them)."""
    ma = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).state_dict()
    mb, info = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    mb = mb.state_dict()
    worst, name = max(((ma[k] - mb[k]).abs().max().item(), k) for k in ma)
    print(f"max difference {worst:.3e} ({name})")
    assert worst <= float(bound), f"{a} vs {b}: {name} differs by {worst:.3e} > {bound}"


def evaluate(model_dir, data, size):
    """The loss of `model_dir` on step 1's batch of `data`."""
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    x, y = batch(load_file(data)["tokens"], 1, int(size))
    with torch.no_grad():
        print(f"loss {loss_of(model.eval(), x, y).item():.8f}")


def equal(a, b):
    """Every tensor of two model folders bitwise equal."""
    ma = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).state_dict()
    mb = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).state_dict()
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    print("bitwise equal")


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"make": make, "tokens": lambda p, r, w, v, d: tokens(p, int(r), int(w), int(v), d), "train":
     lambda s, d, c, n, o, parts=1: train(s, d, c, int(n), o, parts), "compare": compare, "evaluate": evaluate, "equal": equal}[
        command](*args)
