// libtorch's fused Adam and AdamW kernels (aten::_fused_adam_, aten::_fused_adamw_: what torch.optim.Adam(W)
// with fused=True runs, on CPU and CUDA tensors alike), which tch 0.24's generated bindings do not include. The
// engine's optimizer step on device memory runs through them. Tensors arrive as tch's handles.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>

#include <cstdio>
#include <exception>

// One step of `p` with gradient `g`, moments `m` and `v` (and `max_v` under amsgrad; null otherwise) at step
// count `step` (a float scalar tensor the caller has advanced: the kernel reads it). Returns 0, or 1 with the
// exception's message in `err`.
extern "C" int zerorun_fused_adam(at::Tensor *p, at::Tensor *g, at::Tensor *m, at::Tensor *v, at::Tensor *max_v,
                                  at::Tensor *step, double lr, double beta1, double beta2, double weight_decay,
                                  double eps, int amsgrad, int decoupled, char *err, long err_len) {
    try {
        std::vector<at::Tensor> maxes;
        if (max_v != nullptr) {
            maxes.push_back(*max_v);
        }
        if (decoupled) {
            at::_fused_adamw_({*p}, {*g}, {*m}, {*v}, maxes, {*step}, lr, beta1, beta2, weight_decay, eps,
                              amsgrad != 0, false);
        } else {
            at::_fused_adam_({*p}, {*g}, {*m}, {*v}, maxes, {*step}, lr, beta1, beta2, weight_decay, eps,
                             amsgrad != 0, false);
        }
        return 0;
    } catch (const std::exception &e) {
        std::snprintf(err, err_len, "%s", e.what());
        return 1;
    }
}
