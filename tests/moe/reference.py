"""transformers' sparse MoE blocks on the weights and input tests/moe.rs wrote: the output, router logits,
load-balancing loss and the gradients of sum(output * c) + coef * aux, written back for the Rust layer to match.

Usage: reference.py {mixtral|qwen3} IN.safetensors OUT.safetensors HIDDEN FFN EXPERTS TOP_K NORM_TOPK COEF
"""
import sys

import torch
from safetensors.torch import load_file, save_file

kind, src, dst = sys.argv[1:4]
hidden, ffn, experts, top_k, norm, coef = (int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]),
                                           sys.argv[8] == "1", float(sys.argv[9]))
t = load_file(src)
if kind == "mixtral":
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func
    config = MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=experts,
                           num_experts_per_tok=top_k, router_jitter_noise=0.0)
    block = MixtralSparseMoeBlock(config)
else:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, load_balancing_loss_func
    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=ffn, num_experts=experts,
                            num_experts_per_tok=top_k, norm_topk_prob=norm)
    block = Qwen3MoeSparseMoeBlock(config)
block.load_state_dict({k: v for k, v in t.items() if k not in ("x", "c")}, strict=True)
block.train()
x = t["x"].clone().requires_grad_(True)
out, logits = block(x)
aux = load_balancing_loss_func((logits,), experts, top_k)
loss = (out * t["c"]).sum() + coef * aux
loss.backward()
result = {"output": out.detach().contiguous(), "router_logits": logits.detach().contiguous(),
          "aux": aux.detach().reshape(1), "x.grad": x.grad.contiguous()}
for name, p in block.named_parameters():
    result[name + ".grad"] = (p.grad if p.grad is not None else torch.zeros_like(p)).contiguous()
save_file(result, dst)
