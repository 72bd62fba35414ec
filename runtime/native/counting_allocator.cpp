// libtorch's CPU allocator with counters: every CPU tensor's storage allocated after installation is counted while
// it lives, under the owner tag that was current when it was allocated (the engine, the model's forward,
// autograd's backward, the program). The memory report reads the counters at its events; that is how it tells the
// activations and temporaries apart from the engine's own memory and from what glibc keeps after frees.
//
// Each block carries a 64-byte header (its size and tag) in front of the data, so a free finds its counter without
// a lookup and `data == context` holds (raw_allocate works). Blocks come from c10's own alloc_cpu, as the default
// allocator's do. An opt-in trace records every live block with the operator that made it (RecordFunction) for
// the peak's largest allocations; it costs a lock per allocation, so it is off unless asked for.
//
// Large blocks (from the engine's threshold up, 256 KiB) get a mapping of their own, and can be kept for reuse (`zr_counting_allocator_keep`): a ZeRO step
// allocates the same sizes every step (a unit's gathered parameters, autograd's weight gradients, the
// activations), so a freed block is kept and handed to the next allocation of the same size instead of being
// mapped and zeroed afresh. Kept blocks are bounded by every byte live: whenever the live and kept bytes together
// pass the most bytes that were live at once (plus the largest block when asked, `headroom`), the oldest kept
// blocks are given back. So at the step's peak (forward's end, the activations live) nothing is kept, and the
// resident peak is the live peak; between peaks the kept blocks fill what the peak will need again. (Bounded by
// the large blocks alone, as before, they sat on top of the activations' peak: measured, the demo's GPT at
// stage 3, 150-250 MiB of the peak. malloc's heap, which held the smaller blocks, kept another 150 MiB of pages
// that temporaries had walked through.) One block of headroom keeps a step whose live mix changes (a unit's
// gradient live beside the next unit in backward) from evicting the very blocks it needs next (measured: 2 hosts
// x 2 ranks, ZeRO++ 1.38-1.45 -> 1.16-1.21 s a step).
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr int kTags = 4;
constexpr size_t kHeader = 64;  // keeps c10's 64-byte alignment of the data

struct Header {
    uint64_t bytes;     // asked for
    uint64_t capacity;  // mapped: bytes rounded up to a page, the key of reuse
    uint8_t tag;
    bool large;  // mapped here (not malloc's), counted in the large blocks live, kept when freed
};
static_assert(sizeof(Header) <= kHeader, "the header fits in front of the data");

constexpr uint64_t kPage = 4096;
// A large block's own mapping: given back whole when it is freed (or when a kept one is let go).
Header *map_large(uint64_t capacity) {
    uint64_t len = (capacity + kHeader + kPage - 1) / kPage * kPage;
    void *p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(p != MAP_FAILED, "zerorun's CPU allocator: out of memory mapping ", len, " bytes");
    return static_cast<Header *>(p);
}

void unmap_large(Header *h) {
    uint64_t len = (h->capacity + kHeader + kPage - 1) / kPage * kPage;
    munmap(h, len);
}

void free_block(Header *h) {
    if (h->large) {
        unmap_large(h);
    } else {
        c10::free_cpu(h);
    }
}

std::atomic<int64_t> g_live[kTags];
std::atomic<int64_t> g_total{0};
std::atomic<uint8_t> g_tag{0};
std::atomic<bool> g_tracing{false};

struct Traced {
    uint64_t bytes;
    uint8_t tag;
    std::string op;
    std::string phase;
};
std::mutex g_trace_mutex;
std::unordered_map<void *, Traced> g_trace;
std::string g_phase;
thread_local std::vector<std::string> t_ops;

// Kept blocks, oldest first. A step keeps tens of them, so a scan costs nothing beside mapping a block.
std::atomic<uint64_t> g_large_from{0};  // blocks from here up are large (0: none, all from c10's alloc_cpu)
std::atomic<bool> g_keeping{false};     // freed large blocks are kept
std::atomic<int64_t> g_kept_bytes{0};
std::mutex g_kept_mutex;
std::vector<Header *> g_kept;

// The most bytes that were live at once (every block, large or not), and the largest large block allocated.
std::atomic<int64_t> g_total_peak{0};
std::atomic<int64_t> g_large_block{0};  // read without the lock by every allocation's bound check
std::atomic<bool> g_headroom{false};  // kept blocks may exceed the peak by g_large_block

// Whether the live and kept bytes together are over the peak (plus the largest block, with headroom).
bool over_bound(int64_t live, int64_t kept) {
    int64_t bound = g_total_peak.load(std::memory_order_relaxed) +
                    (g_headroom.load(std::memory_order_relaxed) ? g_large_block.load(std::memory_order_relaxed) : 0);
    return kept > 0 && live + kept > bound;
}

// Gives back the oldest kept blocks until the live and kept bytes stay within the bound. Caller holds the lock;
// the blocks come back to be unmapped outside it.
void evict_over_bound(std::vector<Header *> &evicted) {
    int64_t kept = g_kept_bytes.load(std::memory_order_relaxed);
    int64_t live = g_total.load(std::memory_order_relaxed);
    size_t n = 0;
    while (n < g_kept.size() && over_bound(live, kept)) {
        kept -= static_cast<int64_t>(g_kept[n]->capacity);
        evicted.push_back(g_kept[n++]);
    }
    g_kept.erase(g_kept.begin(), g_kept.begin() + static_cast<std::ptrdiff_t>(n));
    g_kept_bytes.store(kept, std::memory_order_relaxed);
}

// Counts `n` bytes live, raising the peak; then, when the kept blocks no longer fit under it, gives back the
// oldest. Bounding the kept blocks by *every* byte live (not the large blocks alone) is what keeps them out of
// the resident peak: where the step is at its most (forward's end, activations live), nothing is kept.
void count_live(int64_t n) {
    int64_t live = g_total.fetch_add(n, std::memory_order_relaxed) + n;
    int64_t peak = g_total_peak.load(std::memory_order_relaxed);
    while (live > peak && !g_total_peak.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {
    }
    if (!over_bound(live, g_kept_bytes.load(std::memory_order_relaxed))) return;
    std::vector<Header *> evicted;
    {
        std::lock_guard<std::mutex> lock(g_kept_mutex);
        evict_over_bound(evicted);
    }
    for (Header *h : evicted) unmap_large(h);  // outside the lock
}

// A kept block of exactly `capacity` (the most recently kept), or null.
Header *take_kept(uint64_t capacity) {
    std::lock_guard<std::mutex> lock(g_kept_mutex);
    int64_t cap = static_cast<int64_t>(capacity);
    if (cap > g_large_block.load(std::memory_order_relaxed)) g_large_block.store(cap, std::memory_order_relaxed);
    for (size_t i = g_kept.size(); i-- > 0;) {
        if (g_kept[i]->capacity == capacity) {
            Header *h = g_kept[i];
            g_kept.erase(g_kept.begin() + static_cast<std::ptrdiff_t>(i));
            g_kept_bytes.fetch_sub(cap, std::memory_order_relaxed);
            return h;
        }
    }
    return nullptr;
}

// Gives every kept block back; the peak and the largest block count again from the blocks live now (start-up's
// one-off blocks, such as the model packed into one buffer, no longer widen the bound).
void release_kept() {
    std::vector<Header *> all;
    {
        std::lock_guard<std::mutex> lock(g_kept_mutex);
        all.swap(g_kept);
        g_kept_bytes.store(0, std::memory_order_relaxed);
        g_total_peak.store(g_total.load(std::memory_order_relaxed), std::memory_order_relaxed);
        g_large_block.store(0, std::memory_order_relaxed);
    }
    for (Header *h : all) unmap_large(h);
}

void on_free(void *data) {
    if (!data) return;
    auto *h = reinterpret_cast<Header *>(static_cast<char *>(data) - kHeader);
    g_live[h->tag].fetch_sub(static_cast<int64_t>(h->bytes), std::memory_order_relaxed);
    g_total.fetch_sub(static_cast<int64_t>(h->bytes), std::memory_order_relaxed);
    if (g_tracing.load(std::memory_order_relaxed)) {
        std::lock_guard<std::mutex> lock(g_trace_mutex);
        g_trace.erase(data);
    }
    if (h->large && g_keeping.load(std::memory_order_relaxed)) {
        std::lock_guard<std::mutex> lock(g_kept_mutex);
        g_kept.push_back(h);
        g_kept_bytes.fetch_add(static_cast<int64_t>(h->capacity), std::memory_order_relaxed);
        return;
    }
    free_block(h);
}

class CountingAllocator final : public c10::Allocator {
  public:
    c10::DataPtr allocate(size_t n) override {
        c10::Device cpu(c10::DeviceType::CPU);
        if (n == 0) return c10::DataPtr(nullptr, nullptr, &on_free, cpu);
        uint64_t large_from = g_large_from.load(std::memory_order_relaxed);
        bool large = large_from != 0 && n >= large_from;
        uint64_t capacity = large ? (n + kPage - 1) / kPage * kPage : n;
        Header *h = large ? take_kept(capacity) : nullptr;
        // Counted before a block is made, so kept blocks over the bound go back before the new one is touched.
        count_live(static_cast<int64_t>(n));
        if (!h) h = large ? map_large(capacity) : static_cast<Header *>(c10::alloc_cpu(capacity + kHeader));
        uint8_t tag = g_tag.load(std::memory_order_relaxed);
        h->bytes = n;
        h->capacity = capacity;
        h->large = large;
        h->tag = tag;
        void *data = reinterpret_cast<char *>(h) + kHeader;
        g_live[tag].fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
        if (g_tracing.load(std::memory_order_relaxed)) {
            std::string op;
            if (!t_ops.empty()) {
                op = t_ops.front();
                if (t_ops.size() > 1) op += " > " + t_ops.back();
            }
            std::lock_guard<std::mutex> lock(g_trace_mutex);
            // The program's own allocations (outside the engine's calls) belong to no engine phase.
            g_trace[data] = Traced{n, tag, std::move(op), tag == 0 ? std::string() : g_phase};
        }
        return c10::DataPtr(data, data, &on_free, cpu);
    }

    c10::DeleterFnPtr raw_deleter() const override { return &on_free; }

    void copy_data(void *dest, const void *src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

CountingAllocator g_allocator;
bool g_installed = false;
std::once_flag g_callback_once;

std::unique_ptr<at::ObserverContext> op_enter(const at::RecordFunction &fn) {
    if (g_tracing.load(std::memory_order_relaxed)) t_ops.emplace_back(fn.name());
    return nullptr;
}

void op_exit(const at::RecordFunction & /*fn*/, at::ObserverContext * /*ctx*/) {
    if (!t_ops.empty()) t_ops.pop_back();
}

}  // namespace

// Makes the counting allocator libtorch's CPU allocator (above the default's priority). Idempotent. Storage
// allocated before keeps its own deleter, so it is simply not counted.
extern "C" void zr_counting_allocator_install() {
    if (g_installed) return;
    c10::SetCPUAllocator(&g_allocator, /*priority=*/10);
    g_installed = true;
}

// The owner tag of allocations from now on (0..3); returns the previous one.
extern "C" int zr_counting_allocator_set_tag(int tag) {
    if (tag < 0 || tag >= kTags) tag = 0;
    return g_tag.exchange(static_cast<uint8_t>(tag), std::memory_order_relaxed);
}

// live[0..4] by tag, the total live, then the bytes of kept blocks.
extern "C" void zr_counting_allocator_stats(int64_t *out) {
    for (int i = 0; i < kTags; ++i) out[i] = g_live[i].load(std::memory_order_relaxed);
    out[kTags] = g_total.load(std::memory_order_relaxed);
    out[kTags + 1] = g_kept_bytes.load(std::memory_order_relaxed);
}

// Blocks of at least `min_bytes` get a mapping of their own (0: none; every block from c10's alloc_cpu); with
// `keep`, freed ones are kept for reuse by allocations of the same size, within the most bytes live at once, plus
// the largest block when `headroom` is nonzero; without, they are unmapped at once (and what is kept goes back).
extern "C" void zr_counting_allocator_keep(int64_t min_bytes, int keep, int headroom) {
    g_headroom.store(headroom != 0, std::memory_order_relaxed);
    g_large_from.store(min_bytes > 0 ? static_cast<uint64_t>(min_bytes) : 0, std::memory_order_relaxed);
    g_keeping.store(keep != 0 && min_bytes > 0, std::memory_order_relaxed);
    if (keep == 0 || min_bytes <= 0) release_kept();
}

// Gives every kept block back.
extern "C" void zr_counting_allocator_release_kept() { release_kept(); }

// Records every block allocated from now on with the operator and phase that made it.
extern "C" void zr_counting_allocator_trace(int on) {
    if (on) {
        std::call_once(g_callback_once, [] {
            at::addGlobalCallback(at::RecordFunctionCallback(&op_enter, &op_exit).scopes({at::RecordScope::FUNCTION}));
        });
    }
    g_tracing.store(on != 0, std::memory_order_relaxed);
}

// The phase (e.g. "forward unit 3") recorded with traced blocks from now on.
extern "C" void zr_counting_allocator_set_phase(const char *phase) {
    std::lock_guard<std::mutex> lock(g_trace_mutex);
    g_phase = phase ? phase : "";
}

// The `max` largest traced live blocks, largest first. Each entry: bytes, tag, and the op and phase copied into
// `op`/`phase` (NUL-terminated, truncated to `text_len`). Returns how many were written.
extern "C" int zr_counting_allocator_top(int max, int64_t *bytes, int *tags, char *op, char *phase, int text_len) {
    std::vector<const std::pair<void *const, Traced> *> all;
    std::lock_guard<std::mutex> lock(g_trace_mutex);
    all.reserve(g_trace.size());
    for (const auto &e : g_trace) all.push_back(&e);
    int n = std::min<int>(max, static_cast<int>(all.size()));
    std::partial_sort(all.begin(), all.begin() + n, all.end(),
                      [](auto *a, auto *b) { return a->second.bytes > b->second.bytes; });
    for (int i = 0; i < n; ++i) {
        const Traced &t = all[i]->second;
        bytes[i] = static_cast<int64_t>(t.bytes);
        tags[i] = t.tag;
        std::snprintf(op + static_cast<size_t>(i) * text_len, text_len, "%s", t.op.c_str());
        std::snprintf(phase + static_cast<size_t>(i) * text_len, text_len, "%s", t.phase.c_str());
    }
    return n;
}
