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

// Activation checkpointing inside a unit's scope: a custom autograd function whose forward runs a Rust closure
// without recording (only its inputs are kept) and whose backward runs it again with recording, from its inputs
// detached, and runs a backward of that graph into the inputs, the unit's parameters and the parameters of units
// entered inside it (which the closure names as it recomputes), as torch's reentrant checkpoint does. The
// parameters reach `.grad` through autograd's own accumulation (and its hooks), once; the function returns the
// inputs' gradients only. The unit's parameters are inputs of the function too (the closure reads them as it
// captured them), so the outputs require grad when they do.
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include <unordered_set>
#include <vector>

// `(data, inputs, n, outputs, params)`: the closure on `n` inputs; pushes its outputs to `outputs` and the
// parameters of the units it entered to `params` (both `std::vector<at::Tensor>`, through `zerorun_tensors_push`);
// a non-null message is an error.
using RunFn = char *(*)(void *, at::Tensor **, int64_t, void *, void *);
// `(sink, tensor)`: takes one of a checkpoint's outputs (a new at::Tensor to own).
using PushFn = void (*)(void *, at::Tensor *);

// Appends `t` to `list` (a `std::vector<at::Tensor>` a checkpoint passed to its closure).
extern "C" void zerorun_tensors_push(void *list, at::Tensor *t) {
    static_cast<std::vector<at::Tensor> *>(list)->push_back(*t);
}

namespace {

struct Closure final : torch::CustomClassHolder {
    Closure(void *d, RunFn f, DropFn dr) : data(d), run(f), drop(dr) {}
    ~Closure() override { drop(data); }
    // The outputs; the parameters of the units entered inside go to `nested`.
    torch::autograd::variable_list call(const torch::autograd::variable_list &inputs,
                                        std::vector<at::Tensor> &nested) const {
        std::vector<at::Tensor *> handles;
        handles.reserve(inputs.size());
        for (const auto &t : inputs) handles.push_back(new at::Tensor(t));
        std::vector<at::Tensor> outputs;
        // The closure takes each handle (Rust's Tensor owns and frees it).
        char *m = run(data, handles.data(), static_cast<int64_t>(handles.size()), &outputs, &nested);
        if (m != nullptr) {
            std::string text(m);
            std::free(m);
            throw std::runtime_error(text);
        }
        return outputs;
    }
    void *data;
    RunFn run;
    DropFn drop;
};

struct Checkpoint : public torch::autograd::Function<Checkpoint> {
    // `all`: the closure's inputs, then `all.size() - inputs` parameters.
    // A TensorList, not a variable_list: only tensors and lists of them count as the function's variables.
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx, at::TensorList all_list,
                                                  int64_t inputs, c10::intrusive_ptr<Closure> closure) {
        torch::autograd::variable_list all(all_list.begin(), all_list.end());
        ctx->save_for_backward(all);
        ctx->saved_data["closure"] = c10::IValue::make_capsule(closure);
        ctx->saved_data["inputs"] = inputs;
        torch::autograd::variable_list in(all.begin(), all.begin() + inputs);
        std::vector<at::Tensor> nested;  // entered again in backward: named there
        return closure->call(in, nested);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        auto closure = c10::static_intrusive_pointer_cast<Closure>(ctx->saved_data["closure"].toCapsule());
        const int64_t inputs = ctx->saved_data["inputs"].toInt();
        auto all = ctx->get_saved_variables();
        torch::autograd::variable_list in;
        for (int64_t i = 0; i < inputs; ++i) {
            auto t = all[i].detach();
            if (all[i].requires_grad()) t.requires_grad_(true);
            in.push_back(t);
        }
        std::vector<at::Tensor> nested;
        torch::autograd::variable_list out;
        {
            at::AutoGradMode recording(true);
            out = closure->call(in, nested);
        }
        // What the backward reaches: the inputs, the unit's parameters and the nested units', each once.
        torch::autograd::variable_list wrt;
        std::unordered_set<const c10::TensorImpl *> seen;
        auto reach = [&](const at::Tensor &t) {
            if (t.defined() && t.requires_grad() && seen.insert(t.unsafeGetTensorImpl()).second) wrt.push_back(t);
        };
        for (const auto &t : in) reach(t);
        for (size_t i = inputs; i < all.size(); ++i) reach(all[i]);
        for (const auto &t : nested) reach(t);
        torch::autograd::variable_list roots, root_grads;
        for (size_t k = 0; k < out.size() && k < grads.size(); ++k) {
            if (out[k].defined() && out[k].requires_grad() && grads[k].defined()) {
                roots.push_back(out[k]);
                root_grads.push_back(grads[k]);
            }
        }
        torch::autograd::variable_list result(all.size() + 2);  // + the count and the closure
        if (!roots.empty() && !wrt.empty()) {
            torch::autograd::backward(roots, root_grads, /*retain_graph=*/false, /*create_graph=*/false, wrt);
            for (int64_t i = 0; i < inputs; ++i) {
                if (in[i].requires_grad()) result[i] = in[i].grad();
            }
        }
        return result;
    }
};

}  // namespace

// Runs the closure `(data, run)` on `inputs` as a checkpoint (above), `params` being the parameters it reads;
// pushes each output to `sink` through `push`; `drop(data)` once nothing needs it (also on an error).
extern "C" char *zerorun_checkpoint(at::Tensor **inputs, int64_t n, at::Tensor **params, int64_t n_params, void *data,
                                    RunFn run, DropFn drop, void *sink, PushFn push) {
    try {
        auto closure = c10::make_intrusive<Closure>(data, run, drop);
        torch::autograd::variable_list all;
        for (int64_t i = 0; i < n; ++i) all.push_back(*inputs[i]);
        for (int64_t i = 0; i < n_params; ++i) all.push_back(*params[i]);
        auto outputs = Checkpoint::apply(at::TensorList(all), n, closure);
        for (auto &t : outputs) push(sink, new at::Tensor(t));
        return nullptr;
    } catch (const std::exception &e) {
        return message(e.what());
    }
}
