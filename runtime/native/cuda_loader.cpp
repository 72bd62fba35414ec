// CUDA on demand: libtorch_cuda is not linked (a CPU run would pay about 230 MiB for it), so code that uses CUDA
// dlopens it first. libtorch_cuda registers its hooks (at::CUDAHooks) in a static initializer when it loads; that
// registration is what these functions look at. at::detail::getCUDAHooks() is not asked here: it caches its first
// answer for the life of the process, so asking before the load would pin "no CUDA".
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/Context.h>

#include <dlfcn.h>

#include <cstring>
#include <string>

// Whether libtorch_cuda's hooks are registered in this process.
extern "C" int zerorun_cuda_hooks_registered() {
    return at::CUDAHooksRegistry()->Has("CUDAHooks") ? 1 : 0;
}

// The folder of the libtorch_cpu in use, into `out` (NUL-terminated); returns its length, or -1.
extern "C" int zerorun_libtorch_dir(char *out, int cap) {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void *>(&at::globalContext), &info) || !info.dli_fname) return -1;
    std::string path(info.dli_fname);
    auto slash = path.rfind('/');
    std::string dir = slash == std::string::npos ? std::string(".") : path.substr(0, slash);
    if (static_cast<int>(dir.size()) + 1 > cap) return -1;
    std::memcpy(out, dir.c_str(), dir.size() + 1);
    return static_cast<int>(dir.size());
}

// The CUDA caching allocator's statistics for one device (allocated and reserved bytes, current and peak), through
// libc10's allocator registry (c10::getDeviceAllocator), which libtorch_cuda fills when it loads: nothing of
// libtorch_cuda is linked. Returns 0, or -1 when no CUDA allocator is registered or it refuses.
#include <c10/core/CachingDeviceAllocator.h>

namespace {
// The registered CUDA allocator, or null when libtorch_cuda is not loaded or its allocator not initialized.
c10::DeviceAllocator *cuda_allocator() {
    if (!at::CUDAHooksRegistry()->Has("CUDAHooks")) return nullptr;
    c10::DeviceAllocator *allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
    return allocator && allocator->initialized() ? allocator : nullptr;
}
}  // namespace

extern "C" int zerorun_device_memory(int device_index, int64_t *out) {
    try {
        c10::DeviceAllocator *allocator = cuda_allocator();
        if (!allocator) return -1;
        auto stats = allocator->getDeviceStats(static_cast<c10::DeviceIndex>(device_index));
        const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
        out[0] = stats.allocated_bytes[all].current;
        out[1] = stats.allocated_bytes[all].peak;
        out[2] = stats.reserved_bytes[all].current;
        out[3] = stats.reserved_bytes[all].peak;
        return 0;
    } catch (...) {
        return -1;
    }
}

// Starts the allocator's peaks (allocated and reserved) over from their current values, as
// torch.cuda.reset_peak_memory_stats does; -1 when the CUDA backend is not loaded.
extern "C" int zerorun_reset_device_peak(int device_index) {
    try {
        c10::DeviceAllocator *allocator = cuda_allocator();
        if (!allocator) return -1;
        allocator->resetPeakStats(static_cast<c10::DeviceIndex>(device_index));
        return 0;
    } catch (...) {
        return -1;
    }
}
