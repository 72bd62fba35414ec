// Tensors whose storage lives in zerorun's shared buffer region (comm/region/): the shm backend's peers map
// the region, so a collective on such a tensor is one memcpy from the peer's mapping. The storage keeps this
// allocator, so resizing it (stage 3 releasing and regathering a unit) frees and allocates in the region too.
// The region's allocate and free come from Rust as function pointers.
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DispatchKeySet.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>

using RegionAllocFn = void *(*)(size_t);
using RegionFreeFn = void (*)(void *, size_t);

namespace {

RegionAllocFn g_alloc = nullptr;
RegionFreeFn g_free = nullptr;

struct Block {
    void *ptr;
    size_t bytes;
};

void release_block(void *ctx) {
    auto *b = static_cast<Block *>(ctx);
    g_free(b->ptr, b->bytes);
    delete b;
}

class RegionAllocator final : public c10::Allocator {
  public:
    c10::DataPtr allocate(size_t n) override {
        if (n == 0) return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU));
        void *p = g_alloc(n);
        // A full region: the ordinary allocator (peers then read through process_vm_readv).
        if (!p) return c10::GetDefaultCPUAllocator()->allocate(n);
        return c10::DataPtr(p, new Block{p, n}, &release_block, c10::Device(c10::DeviceType::CPU));
    }

    void copy_data(void *dest, const void *src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

RegionAllocator g_allocator;

char *message(const char *what) {
    char *m = static_cast<char *>(std::malloc(std::strlen(what) + 1));
    if (m) std::strcpy(m, what);
    return m;
}

}  // namespace

extern "C" void zerorun_region_allocator_init(RegionAllocFn alloc, RegionFreeFn free) {
    g_alloc = alloc;
    g_free = free;
}

// A new 1-D CPU tensor of `numel` elements of `scalar_type` (c10::ScalarType) in the region, contents undefined.
extern "C" char *zerorun_region_empty(int64_t numel, int scalar_type, at::Tensor **out) {
    try {
        if (!g_alloc) return message("the region allocator is not initialised");
        at::TensorBase t = at::detail::empty_generic({numel}, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                      static_cast<c10::ScalarType>(scalar_type), std::nullopt);
        *out = new at::Tensor(std::move(t));
        return nullptr;
    } catch (const std::exception &e) {
        return message(e.what());
    }
}
