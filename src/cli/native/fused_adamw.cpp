// libtorch's fused CPU AdamW kernel (aten::_fused_adamw_), for `zerorun bench adam` only: tch 0.24's generated
// bindings do not include it. Tensors arrive as tch's handles (pointers to at::Tensor).
#include <ATen/core/Tensor.h>
#include <ATen/ops/_fused_adamw.h>

extern "C" int zerorun_fused_adamw(at::Tensor *p, at::Tensor *g, at::Tensor *m, at::Tensor *v, at::Tensor *step,
                                   double lr, double beta1, double beta2, double weight_decay, double eps) {
    try {
        step->add_(1);
        at::_fused_adamw_({*p}, {*g}, {*m}, {*v}, {}, {*step}, lr, beta1, beta2, weight_decay, eps, false, false);
        return 0;
    } catch (...) {
        return 1;
    }
}
