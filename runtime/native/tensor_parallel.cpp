// Tensor parallelism's conjugate operators (Megatron-LM's tensor_parallel/mappings.py) as autograd functions:
// what one does forward, its conjugate does backward. tch cannot define autograd functions, so they live here; the
// collectives they need are the engine's communicator's, reached through a callback into Rust (`collective`), on
// contiguous buffers. Every rank of the group runs the same operators in the same order, forward and backward, so
// the collectives pair up.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

namespace {

// The callback: runs collective `kind` over `input` into `output` (the same tensor for an in-place all-reduce);
// returns null, or a malloc'ed message.
using Collective = char *(*)(void *group, int32_t kind, at::Tensor *input, at::Tensor *output);
enum Kind : int32_t { ALL_REDUCE = 0, ALL_GATHER = 1, REDUCE_SCATTER = 2 };

// The operators (forward / backward):
enum Region : int64_t {
  COPY = 0,                  // identity / all-reduce
  REDUCE = 1,                // all-reduce / identity
  SCATTER_LAST = 2,          // this rank's chunk of the last dimension / all-gather along it
  GATHER_LAST = 3,           // all-gather along the last dimension / this rank's chunk
  GATHER_FIRST = 4,          // all-gather along the first dimension / reduce-scatter along it (sequence parallel)
  REDUCE_SCATTER_FIRST = 5,  // reduce-scatter along the first dimension / all-gather along it
};

struct Group {
  Collective fn;
  void *ctx;
  int64_t rank;
  int64_t size;
};

char *message(const char *what) {
  char *m = static_cast<char *>(std::malloc(std::strlen(what) + 1));
  if (m) std::strcpy(m, what);
  return m;
}

void call(const Group &g, Kind kind, at::Tensor *in, at::Tensor *out) {
  if (char *m = g.fn(g.ctx, kind, in, out)) {
    std::string text(m);
    std::free(m);
    throw std::runtime_error(text);
  }
}

at::Tensor all_reduce(const Group &g, const at::Tensor &x) {
  at::Tensor t = x.contiguous().clone();
  call(g, ALL_REDUCE, &t, &t);
  return t;
}

void check_divides(const Group &g, const at::Tensor &x, int64_t dim) {
  int64_t n = x.size(dim);
  if (n % g.size != 0) {
    throw std::runtime_error("tensor parallel: dimension " + std::to_string(dim) + " of size " + std::to_string(n) +
                             " does not split into " + std::to_string(g.size) + " equal parts");
  }
}

at::Tensor chunk(const Group &g, const at::Tensor &x, int64_t dim) {
  check_divides(g, x, dim);
  return x.chunk(g.size, dim)[g.rank].contiguous();
}

at::Tensor all_gather(const Group &g, const at::Tensor &x, int64_t dim) {
  at::Tensor in = x.contiguous();
  at::Tensor out = at::empty({g.size * in.numel()}, in.options());
  call(g, ALL_GATHER, &in, &out);
  std::vector<int64_t> sizes = in.sizes().vec();
  sizes.insert(sizes.begin(), g.size);
  return at::cat(out.view(sizes).unbind(0), dim);
}

at::Tensor reduce_scatter(const Group &g, const at::Tensor &x, int64_t dim) {
  check_divides(g, x, dim);
  std::vector<at::Tensor> parts;
  for (const at::Tensor &p : x.chunk(g.size, dim)) parts.push_back(p.contiguous().view(-1));
  at::Tensor in = at::cat(parts);
  at::Tensor out = at::empty_like(x.chunk(g.size, dim)[g.rank].contiguous());
  call(g, REDUCE_SCATTER, &in, &out);
  return out;
}

at::Tensor run(const Group &g, int64_t region, const at::Tensor &x, bool forward) {
  int64_t last = x.dim() - 1;
  switch (region) {
    case COPY:
      return forward ? x.clone() : all_reduce(g, x);
    case REDUCE:
      return forward ? all_reduce(g, x) : x;
    case SCATTER_LAST:
      return forward ? chunk(g, x, last) : all_gather(g, x, last);
    case GATHER_LAST:
      return forward ? all_gather(g, x, last) : chunk(g, x, last);
    case GATHER_FIRST:
      return forward ? all_gather(g, x, 0) : reduce_scatter(g, x, 0);
    case REDUCE_SCATTER_FIRST:
      return forward ? reduce_scatter(g, x, 0) : all_gather(g, x, 0);
    default:
      throw std::runtime_error("tensor parallel: unknown operator " + std::to_string(region));
  }
}

struct RegionFunction : public torch::autograd::Function<RegionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &x, int64_t region, int64_t fn,
                            int64_t group, int64_t rank, int64_t size) {
    ctx->saved_data["region"] = region;
    ctx->saved_data["fn"] = fn;
    ctx->saved_data["group"] = group;
    ctx->saved_data["rank"] = rank;
    ctx->saved_data["size"] = size;
    Group g{reinterpret_cast<Collective>(fn), reinterpret_cast<void *>(group), rank, size};
    return run(g, region, x, true);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    Group g{reinterpret_cast<Collective>(ctx->saved_data["fn"].toInt()),
            reinterpret_cast<void *>(ctx->saved_data["group"].toInt()), ctx->saved_data["rank"].toInt(),
            ctx->saved_data["size"].toInt()};
    at::Tensor gx = run(g, ctx->saved_data["region"].toInt(), grads[0], false);
    return {gx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

// Applies operator `region` to `x` over the group (`fn`, `group`: the callback and its context; this rank, the
// group's size); `*out` takes the result, with its backward in the graph.
extern "C" char *zerorun_tp_region(at::Tensor *x, int64_t region, Collective fn, void *group, int64_t rank,
                                   int64_t size, at::Tensor **out) {
  try {
    at::Tensor y = RegionFunction::apply(*x, region, reinterpret_cast<int64_t>(fn), reinterpret_cast<int64_t>(group),
                                         rank, size);
    *out = new at::Tensor(std::move(y));
    return nullptr;
  } catch (const std::exception &e) {
    return message(e.what());
  }
}
