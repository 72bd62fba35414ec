// A mixture-of-experts layer's dispatch as an autograd function: the rows of `x` (tokens, in the order of the ranks
// they go to) travel to the expert-parallel ranks that hold their experts, `send[q]` rows to rank q, and `recv[p]`
// rows arrive from rank p. Backward is the same all-to-all with the counts swapped: each row's gradient goes back to
// the rank it came from. tch cannot define autograd functions, so this lives here; the all-to-all itself is the
// group's communicator, reached through a callback into Rust. Every rank of the group runs the same dispatches in
// the same order, forward and backward, so the collectives pair up.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// The callback: all-to-all of `input`'s rows (`send[q]` elements to rank q) into `output` (`recv[p]` elements from
// rank p), `n` ranks; returns null, or a malloc'ed message.
using AllToAll = char *(*)(void *group, at::Tensor *input, const int64_t *send, at::Tensor *output,
                           const int64_t *recv, int64_t n);

char *message(const char *what) {
  char *m = static_cast<char *>(std::malloc(std::strlen(what) + 1));
  if (m) std::strcpy(m, what);
  return m;
}

at::Tensor exchange(AllToAll fn, void *group, const at::Tensor &x, const std::vector<int64_t> &send_rows,
                    const std::vector<int64_t> &recv_rows) {
  at::Tensor in = x.contiguous();
  // Elements per row from the shape (an empty input has rows of the same length).
  int64_t row = 1;
  for (int64_t d = 1; d < in.dim(); ++d) row *= in.size(d);
  int64_t rows = 0;
  for (int64_t r : recv_rows) rows += r;
  std::vector<int64_t> sizes = in.sizes().vec();
  sizes[0] = rows;
  at::Tensor out = at::empty(sizes, in.options());
  std::vector<int64_t> send(send_rows.size()), recv(recv_rows.size());
  for (size_t i = 0; i < send.size(); ++i) send[i] = send_rows[i] * row;
  for (size_t i = 0; i < recv.size(); ++i) recv[i] = recv_rows[i] * row;
  if (char *m = fn(group, &in, send.data(), &out, recv.data(), static_cast<int64_t>(send.size()))) {
    std::string text(m);
    std::free(m);
    throw std::runtime_error(text);
  }
  return out;
}

struct AllToAllRows : public torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &x, int64_t fn, int64_t group,
                            std::vector<int64_t> send, std::vector<int64_t> recv) {
    ctx->saved_data["fn"] = fn;
    ctx->saved_data["group"] = group;
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return exchange(reinterpret_cast<AllToAll>(fn), reinterpret_cast<void *>(group), x, send, recv);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    auto fn = reinterpret_cast<AllToAll>(ctx->saved_data["fn"].toInt());
    auto group = reinterpret_cast<void *>(ctx->saved_data["group"].toInt());
    std::vector<int64_t> send = ctx->saved_data["send"].toIntVector();
    std::vector<int64_t> recv = ctx->saved_data["recv"].toIntVector();
    at::Tensor gx = exchange(fn, group, grads[0], recv, send);
    return {gx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

// Sends `send[q]` rows of `x` to rank q and receives `recv[p]` rows from rank p (`n` ranks), `*out` taking the
// received rows with the reverse exchange as their backward.
extern "C" char *zerorun_moe_all_to_all(at::Tensor *x, const int64_t *send, const int64_t *recv, int64_t n,
                                        AllToAll fn, void *group, at::Tensor **out) {
  try {
    std::vector<int64_t> s(send, send + n), r(recv, recv + n);
    at::Tensor y = AllToAllRows::apply(*x, reinterpret_cast<int64_t>(fn), reinterpret_cast<int64_t>(group), s, r);
    *out = new at::Tensor(std::move(y));
    return nullptr;
  } catch (const std::exception &e) {
    return message(e.what());
  }
}
