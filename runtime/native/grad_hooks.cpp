// Stage 2 for plain training loops: a post-accumulate-grad hook on each parameter (what PyTorch's
// `register_post_accumulate_grad_hook` installs) tells the engine when autograd has written the parameter's
// `.grad`, so a bucket of parameters is reduced, and its gradients freed, while backward still runs. The hook
// lives on the tensor itself, so it survives every new graph; the engine removes it when it is dropped.
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>

using GradReadyFn = void (*)(void *, int64_t);

namespace {

char *message(const char *what) {
    char *m = static_cast<char *>(std::malloc(std::strlen(what) + 1));
    if (m) std::strcpy(m, what);
    return m;
}

struct GradReadyHook final : torch::autograd::PostAccumulateGradHook {
    GradReadyHook(GradReadyFn f, void *c, int64_t i) : fn(f), ctx(c), index(i) {}
    void operator()(const torch::autograd::Variable & /*param*/) override { fn(ctx, index); }
    GradReadyFn fn;
    void *ctx;
    int64_t index;
};

}  // namespace

// Calls `fn(ctx, index)` each time autograd has accumulated `param`'s gradient.
extern "C" char *zerorun_on_grad_ready(at::Tensor *param, GradReadyFn fn, void *ctx, int64_t index) {
    try {
        torch::autograd::impl::set_post_acc_grad_hooks(*param, std::make_unique<GradReadyHook>(fn, ctx, index));
        return nullptr;
    } catch (const std::exception &e) {
        return message(e.what());
    }
}

extern "C" void zerorun_remove_grad_ready(at::Tensor *param) {
    torch::autograd::impl::set_post_acc_grad_hooks(*param, nullptr);
}

// Frees `param`'s `.grad` (as `param.grad = None`).
extern "C" void zerorun_reset_grad(at::Tensor *param) {
    param->mutable_grad().reset();
}
