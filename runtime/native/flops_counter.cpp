// The flops profiler's counter: libtorch's own profiler (Kineto, CPU activity, with_flops) around a stretch of
// the program, and the FLOPs it attributes to the operators run there, summed. libtorch computes them from the shapes
// the operators ran with (aten::mm, addmm, bmm, matmul's, convolutions, linear, scaled-dot-product attention...);
// what it counts nothing for (element-wise ops, embeddings, norms) DeepSpeed's profiler counts as at most numel.
// Errors come back as a malloc'ed message (nullptr on success) for Rust to free.
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdint>
#include <set>
#include <cstdlib>
#include <cstring>
#include <exception>

namespace prof = torch::autograd::profiler;

static char *message(const char *what) {
    char *m = static_cast<char *>(std::malloc(std::strlen(what) + 1));
    if (m) std::strcpy(m, what);
    return m;
}

static prof::ProfilerConfig config() {
    return prof::ProfilerConfig(prof::ProfilerState::KINETO, /*report_input_shapes=*/true, /*profile_memory=*/false,
                                /*with_stack=*/false, /*with_flops=*/true, /*with_modules=*/false);
}

extern "C" char *zerorun_flops_start() {
    try {
        // Kineto logs an error for every GPU it cannot count on a CPU-only machine; it reads this when it starts
        // (a value the user set is kept).
        setenv("KINETO_LOG_LEVEL", "5", 0);
        std::set<torch::profiler::impl::ActivityType> activities{torch::profiler::impl::ActivityType::CPU};
        prof::prepareProfiler(config(), activities);
        prof::enableProfiler(config(), activities);
        return nullptr;
    } catch (const std::exception &e) {
        return message(e.what());
    }
}

// Stops the profiler; `flops` gets the FLOPs of every operator it saw, `ops` how many operators ran.
extern "C" char *zerorun_flops_stop(uint64_t *flops, uint64_t *ops) {
    try {
        auto result = prof::disableProfiler();
        uint64_t sum = 0, n = 0;
        for (const auto &e : result->events()) {
            sum += e.flops();
            n += 1;
        }
        *flops = sum;
        *ops = n;
        return nullptr;
    } catch (const std::exception &e) {
        return message(e.what());
    }
}
