// Stage 3 for any model (`engine/zero/scopes.rs`): what libtorch must do for units entered from the program's own
// forward, and tch does not bind.
//
// - A released parameter that no kernel can read. Between its unit's scopes a parameter is pointed (a shallow copy
//   of the TensorImpl's metadata, as `set_data` does, keeping the variable's identity, autograd meta and version
//   counter) at a tensor of the parameter's shape on the PrivateUse1 device, whose storage holds no bytes and carries
//   a description of the parameter in its DataPtr's context. Every PrivateUse1 kernel is a fallback that refuses
//   with that description; so are the composite operators that would check devices before reaching a backend
//   kernel (linear, LSTM, attention, norms, ...), registered by name. No backend ever reads the missing bytes, so a
//   stray call is an error, never a read of freed memory. zerorun registers nothing else on PrivateUse1.
// - A hook on a unit's outputs that runs before autograd computes anything inside the unit (a tensor pre-hook on
//   the output's grad_fn, FSDP2's pre-backward hook): the engine gathers the unit there.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>

namespace {

char *message(const char *what) {
    char *m = static_cast<char *>(std::malloc(std::strlen(what) + 1));
    if (m) std::strcpy(m, what);
    return m;
}

constexpr uint64_t RELEASED_MAGIC = 0x7a65726f72756e31ULL;  // "zerorun1"

struct Released {
    uint64_t magic;
    std::string what;
};

void delete_released(void *p) { delete static_cast<Released *>(p); }

const Released *released_of(const at::Tensor &t) {
    if (!t.defined() || t.device().type() != c10::DeviceType::PrivateUse1 || !t.has_storage()) return nullptr;
    auto *r = static_cast<const Released *>(t.storage().data_ptr().get_context());
    return r != nullptr && r->magic == RELEASED_MAGIC ? r : nullptr;
}

// Every operator that reaches a released parameter: an error naming it (std::runtime_error, so tch shows the text
// alone, without libtorch's backtrace).
void refuse(const c10::OperatorHandle &op, torch::jit::Stack *stack) {
    const auto n = op.schema().arguments().size();
    std::string what;
    auto look = [&](const at::Tensor &t) {
        if (what.empty())
            if (const Released *r = released_of(t)) what = r->what;
    };
    for (const c10::IValue &a : torch::jit::last(*stack, n)) {
        if (a.isTensor()) {
            look(a.toTensor());
        } else if (a.isTensorList()) {
            for (const at::Tensor &t : a.toTensorList()) look(t);
        } else if (a.isList()) {
            for (const c10::IValue &e : a.toListRef())
                if (e.isTensor()) look(e.toTensor());
        }
    }
    if (what.empty())
        what = "a released stage-3 parameter (or a tensor made from one) is read: ZeRO stage 3 keeps only this "
               "rank's shard of a unit's parameters outside the unit; run the code that reads it inside its "
               "`engine.unit(..)`, or through `engine.forward`";
    throw std::runtime_error("zerorun: " + what + " [" + op.schema().name() + "]");
}

}  // namespace

// Autograd asks the device's guard when it records a parameter's metadata; nothing runs on this device.
C10_REGISTER_GUARD_IMPL(PrivateUse1, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::PrivateUse1>);

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
    m.fallback(torch::CppFunction::makeFromBoxedFunction<&refuse>());
}

// Composite operators that check their tensors' devices before any backend kernel runs: refused by name, so the
// error names the parameter instead of "found two devices".
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
    for (const char *op :
         {"linear", "matmul", "embedding", "layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm",
          "lstm.input", "lstm.data", "gru.input", "gru.data", "rnn_tanh.input", "rnn_tanh.data", "rnn_relu.input",
          "rnn_relu.data", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
          "conv1d", "conv2d", "conv3d", "conv1d.padding", "conv2d.padding", "conv3d.padding", "conv_transpose1d",
          "conv_transpose2d.input", "conv_transpose3d.input", "bilinear", "einsum"})
        m.impl(op, torch::CppFunction::makeFromBoxedFunction<&refuse>());
}

// A tensor shaped and typed like `like` that every kernel refuses with "zerorun: <what> [operator]".
extern "C" char *zerorun_released_like(at::Tensor *like, const char *what, at::Tensor **out) {
    try {
        c10::Device device(c10::DeviceType::PrivateUse1, 0);
        c10::DataPtr data(nullptr, new Released{RELEASED_MAGIC, what}, &delete_released, device);
        c10::Storage storage(c10::Storage::use_byte_size_t(), 0, std::move(data), nullptr, false);
        auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage),
                                                          c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                          like->dtype());
        t.unsafeGetTensorImpl()->set_sizes_contiguous(like->sizes());
        *out = new at::Tensor(std::move(t));
        return nullptr;
    } catch (const std::exception &e) {
        return message(e.what());
    }
}

// Points the variable `var` at `data`'s storage, shape and device (what `set_data` does, without its check that
// both are of one backend: a parameter moves between the host and the released device).
extern "C" char *zerorun_point_at(at::Tensor *var, at::Tensor *data) {
    try {
        var->unsafeGetTensorImpl()->shallow_copy_from(data->getIntrusivePtr());
        return nullptr;
    } catch (const std::exception &e) {
        return message(e.what());
    }
}

// `fn(ctx, unit)` before autograd computes the gradient of anything `t` was computed from (a pre-hook on `t`'s
// grad_fn); a non-null message from it stops the backward with that message. `drop(ctx)` runs when the hook goes
// with its graph.
using OutputReadyFn = char *(*)(void *, int64_t);
using DropFn = void (*)(void *);

extern "C" char *zerorun_on_output_grad(at::Tensor *t, OutputReadyFn fn, void *ctx, DropFn drop, int64_t unit) {
    try {
        std::shared_ptr<void> owner(ctx, drop);
        t->register_hook([fn, owner, unit](const at::TensorBase &) {
            if (char *m = fn(owner.get(), unit)) {
                std::string text(m);
                std::free(m);
                throw std::runtime_error(text);
            }
        });
        return nullptr;
    } catch (const std::exception &e) {
        // The shared_ptr dropped `ctx` already.
        return message(e.what());
    }
}
