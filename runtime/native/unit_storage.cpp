// Two things stage 3 needs from libtorch that tch 0.24 does not bind. Tensors arrive as tch's handles
// (pointers to at::Tensor); errors come back as a malloc'ed message (nullptr on success) for Rust to free.
//
// - Resizing a tensor's storage in place (what FSDP2 does with `untyped_storage().resize_(0)`): every view of a
//   unit's flat buffer, autograd's saved ones included, shares the one StorageImpl, so freeing it releases the
//   gathered parameters everywhere, and re-growing it before backward makes them valid again.
// - Backward from a unit's output with a given output gradient into a chosen list of inputs, returning the
//   gradients instead of accumulating them into `.grad` (torch::autograd::grad with allow_unused).
#include <ATen/core/Tensor.h>
#include <ATen/native/Resize.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

static char *message(const char *what) {
    char *m = static_cast<char *>(std::malloc(std::strlen(what) + 1));
    if (m) std::strcpy(m, what);
    return m;
}

// Storages keep their bytes up to the smaller size. Host ones through resize_bytes_cpu; device ones get a fresh
// allocation from the storage's own allocator (the CUDA caching allocator), the kept bytes copied by that allocator
// (resize_bytes_cuda lives in libtorch_cuda, which zerorun does not link).
extern "C" char *zerorun_resize_storage(at::Tensor *t, int64_t nbytes) {
    try {
        c10::StorageImpl *storage = t->storage().unsafeGetStorageImpl();
        if (storage->device_type() == c10::DeviceType::CPU) {
            at::native::resize_bytes_cpu(storage, static_cast<size_t>(nbytes));
            return nullptr;
        }
        if (!storage->resizable()) return message("the storage is not resizable");
        c10::Allocator *allocator = storage->allocator();
        c10::DataPtr fresh = nbytes > 0 ? allocator->allocate(static_cast<size_t>(nbytes))
                                        : c10::DataPtr(nullptr, storage->device());
        const size_t kept = std::min(storage->nbytes(), static_cast<size_t>(nbytes));
        if (kept > 0) allocator->copy_data(fresh.get(), storage->data(), kept);
        storage->set_data_ptr_noswap(std::move(fresh));
        storage->set_nbytes(static_cast<size_t>(nbytes));
        return nullptr;
    } catch (const std::exception &e) {
        return message(e.what());
    }
}

extern "C" int64_t zerorun_storage_nbytes(at::Tensor *t) {
    return static_cast<int64_t>(t->storage().nbytes());
}

extern "C" char *zerorun_grad(at::Tensor **roots, at::Tensor **root_grads, int n_roots, at::Tensor **inputs, int n_inputs,
                              at::Tensor **outputs) {
    try {
        std::vector<at::Tensor> r, g, in;
        for (int i = 0; i < n_roots; ++i) {
            r.push_back(*roots[i]);
            g.push_back(root_grads[i] ? *root_grads[i] : at::Tensor());
        }
        for (int i = 0; i < n_inputs; ++i) in.push_back(*inputs[i]);
        auto grads = torch::autograd::grad(r, in, g, /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
        for (int i = 0; i < n_inputs; ++i) outputs[i] = new at::Tensor(grads[i]);
        return nullptr;
    } catch (const std::exception &e) {
        return message(e.what());
    }
}

extern "C" int zerorun_grad_enabled() {
    return c10::GradMode::is_enabled() ? 1 : 0;
}

// Makes `grad` the `.grad` of `param` (a leaf): autograd then accumulates into it in place, so gradients can be
// views of one flat buffer (DDP's gradient_as_bucket_view).
extern "C" char *zerorun_set_grad(at::Tensor *param, at::Tensor *grad) {
    try {
        param->mutable_grad() = *grad;
        return nullptr;
    } catch (const std::exception &e) {
        return message(e.what());
    }
}

// The default CPU generator's state (what tch::manual_seed seeds and dropout draws from), as bytes, for
// checkpoints. `zerorun_rng_state_len` gives the size; get copies it out, set restores it.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>

extern "C" int64_t zerorun_rng_state_len() {
    auto g = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.get_state().numel();
}

extern "C" char *zerorun_rng_state_get(uint8_t *out, int64_t len) {
    try {
        auto g = at::detail::getDefaultCPUGenerator();
        std::lock_guard<std::mutex> lock(g.mutex());
        auto s = g.get_state();
        if (s.numel() != len) return message("generator state size changed");
        std::memcpy(out, s.data_ptr<uint8_t>(), len);
        return nullptr;
    } catch (const std::exception &e) {
        return message(e.what());
    }
}

extern "C" char *zerorun_rng_state_set(const uint8_t *in, int64_t len) {
    try {
        auto g = at::detail::getDefaultCPUGenerator();
        std::lock_guard<std::mutex> lock(g.mutex());
        auto s = at::empty({len}, at::kByte);
        std::memcpy(s.data_ptr<uint8_t>(), in, len);
        g.set_state(s);
        return nullptr;
    } catch (const std::exception &e) {
        return message(e.what());
    }
}

// The TensorImpl behind a handle: the identity of a variable, the same for every shallow clone and unchanged by
// set_data (which swaps the storage inside the impl). The engine tells the VarStore's variables apart by it.
extern "C" const void *zerorun_tensor_impl(at::Tensor *t) {
    return t->unsafeGetTensorImpl();
}

// A page-locked copy of the host tensor `t` (for the current accelerator), into `out`. Tensor::pin_memory with
// no device: libtorch 2.11 warns on every call that names one, which is the only form tch binds.
extern "C" char *zerorun_pin_memory(at::Tensor *t, at::Tensor **out) {
    try {
        *out = new at::Tensor(t->pin_memory());
        return nullptr;
    } catch (const std::exception &e) {
        return message(e.what());
    }
}

// Whether the host tensor `t` is page-locked (no device argument, as above); 0 on any error.
extern "C" int zerorun_is_pinned(at::Tensor *t) {
    try {
        return t->is_pinned() ? 1 : 0;
    } catch (...) {
        return 0;
    }
}
