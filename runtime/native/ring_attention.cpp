// Ring attention (context parallelism) as an autograd function: each rank holds the queries, keys and values of
// its own tokens (any positions of the sequence: contiguous slices, or the head-and-tail chunks that even out causal
// work), and the key/value blocks travel around the ring of the group's ranks, one hop a step, while each rank
// folds every block into its queries' output with an online softmax (FlashAttention's running maximum and sum).
// A block whose keys all come after a rank's queries is skipped; a query row that sees no key of a block gains
// nothing from it. Backward walks the ring again with the blocks, recomputing each block's probabilities from the
// saved log-sum-exp, and the keys' and values' gradients travel with their blocks, one more hop bringing them home.
// tch cannot define autograd functions, so this lives here; the ring shift is the group's communicator, reached
// through a callback into Rust.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// Sends `send` to the next rank of the ring and receives `recv` (the same shape) from the previous one; returns
// null, or a malloc'ed message.
using Shift = char *(*)(void *group, at::Tensor *send, at::Tensor *recv);

char *message(const char *what) {
  char *m = static_cast<char *>(std::malloc(std::strlen(what) + 1));
  if (m) std::strcpy(m, what);
  return m;
}

at::Tensor shift(Shift fn, void *group, const at::Tensor &x) {
  at::Tensor send = x.contiguous();
  at::Tensor recv = at::empty_like(send);
  if (char *m = fn(group, &send, &recv)) {
    std::string text(m);
    std::free(m);
    throw std::runtime_error(text);
  }
  return recv;
}

// Scores of queries at `pq` [tq] (the last at `q_last`) against keys at `pk` [tk]: q [b,h,tq,d] k [b,h,tk,d],
// causal by position. Returns the masked scores in fp32 and whether any pair is visible.
std::pair<at::Tensor, bool> scores(const at::Tensor &q, const at::Tensor &k, const at::Tensor &pq, int64_t q_last,
                                   const at::Tensor &pk, double scale) {
  bool any = pk.min().item<int64_t>() <= q_last;
  if (!any) return {at::Tensor(), false};
  at::Tensor s = at::matmul(q.to(at::kFloat), k.to(at::kFloat).transpose(-2, -1)) * scale;
  at::Tensor hidden = pk.unsqueeze(0) > pq.unsqueeze(1);  // [tq, tk]
  s = s.masked_fill(hidden, -std::numeric_limits<float>::infinity());
  return {s, true};
}

struct RingAttention : public torch::autograd::Function<RingAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &q, const at::Tensor &k,
                            const at::Tensor &v, const at::Tensor &pq, const at::Tensor &pk, double scale,
                            int64_t ranks, int64_t fn, int64_t group) {
    auto shift_fn = reinterpret_cast<Shift>(fn);
    auto ctx_group = reinterpret_cast<void *>(group);
    const float inf = std::numeric_limits<float>::infinity();
    auto sizes = q.sizes().vec();  // [b, h, tq, d]
    at::Tensor out = at::zeros(sizes, q.options().dtype(at::kFloat));
    at::Tensor m = at::full({sizes[0], sizes[1], sizes[2]}, -inf, q.options().dtype(at::kFloat));
    at::Tensor l = at::zeros({sizes[0], sizes[1], sizes[2]}, q.options().dtype(at::kFloat));
    at::Tensor kb = k.contiguous(), vb = v.contiguous(), pb = pk.contiguous();
    const int64_t q_last = pq.max().item<int64_t>();
    for (int64_t step = 0; step < ranks; ++step) {
      auto [s, any] = scores(q, kb, pq, q_last, pb, scale);
      if (any) {
        at::Tensor mb = std::get<0>(s.max(-1));
        at::Tensor m_new = at::maximum(m, mb);
        at::Tensor m_safe = at::where(at::isinf(m_new), at::zeros_like(m_new), m_new);
        at::Tensor p = at::exp(s - m_safe.unsqueeze(-1));
        at::Tensor alpha = at::exp(m - m_safe);
        l = l * alpha + p.sum(-1);
        out = out * alpha.unsqueeze(-1) + at::matmul(p, vb.to(at::kFloat));
        m = m_new;
      }
      if (step + 1 < ranks) {
        kb = shift(shift_fn, ctx_group, kb);
        vb = shift(shift_fn, ctx_group, vb);
        pb = shift(shift_fn, ctx_group, pb);
      }
    }
    // Rows that saw no key (none here: a query always sees itself) keep zeros.
    at::Tensor l_safe = at::where(l > 0, l, at::ones_like(l));
    at::Tensor o = out / l_safe.unsqueeze(-1);
    at::Tensor lse = at::where(l > 0, m + at::log(l_safe), at::full_like(l, -inf));
    ctx->save_for_backward({q, k, v, pq, pk, o, lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["ranks"] = ranks;
    ctx->saved_data["fn"] = fn;
    ctx->saved_data["group"] = group;
    return o.to(q.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor q = saved[0], k = saved[1], v = saved[2], pq = saved[3], pk = saved[4], o = saved[5], lse = saved[6];
    double scale = ctx->saved_data["scale"].toDouble();
    int64_t ranks = ctx->saved_data["ranks"].toInt();
    auto shift_fn = reinterpret_cast<Shift>(ctx->saved_data["fn"].toInt());
    auto group = reinterpret_cast<void *>(ctx->saved_data["group"].toInt());
    at::Tensor dout = grads[0].to(at::kFloat).contiguous();
    at::Tensor qf = q.to(at::kFloat);
    at::Tensor delta = (dout * o).sum(-1);  // [b, h, tq]
    at::Tensor lse_safe = at::where(at::isinf(lse), at::zeros_like(lse), lse);
    at::Tensor dq = at::zeros_like(qf);
    at::Tensor kb = k.contiguous(), vb = v.contiguous(), pb = pk.contiguous();
    at::Tensor dkb = at::zeros(k.sizes(), k.options().dtype(at::kFloat));
    at::Tensor dvb = at::zeros(v.sizes(), v.options().dtype(at::kFloat));
    const int64_t q_last = pq.max().item<int64_t>();
    for (int64_t step = 0; step < ranks; ++step) {
      auto [s, any] = scores(q, kb, pq, q_last, pb, scale);
      if (any) {
        at::Tensor p = at::exp(s - lse_safe.unsqueeze(-1));  // masked scores give 0
        at::Tensor kf = kb.to(at::kFloat), vf = vb.to(at::kFloat);
        dvb = dvb + at::matmul(p.transpose(-2, -1), dout);
        at::Tensor dp = at::matmul(dout, vf.transpose(-2, -1));
        at::Tensor ds = p * (dp - delta.unsqueeze(-1));
        dq = dq + at::matmul(ds, kf) * scale;
        dkb = dkb + at::matmul(ds.transpose(-2, -1), qf) * scale;
      }
      // Every block moves on with its gradients; after the last step only the gradients travel, home.
      if (step + 1 < ranks) {
        kb = shift(shift_fn, group, kb);
        vb = shift(shift_fn, group, vb);
        pb = shift(shift_fn, group, pb);
      }
      if (ranks > 1) {
        dkb = shift(shift_fn, group, dkb);
        dvb = shift(shift_fn, group, dvb);
      }
    }
    return {dq.to(q.scalar_type()), dkb.to(k.scalar_type()), dvb.to(v.scalar_type()), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

// Causal ring attention of this rank's queries q [b,h,tq,d] at positions pq [tq] over every rank's keys and values
// (k, v [b,h,tk,d] at pk [tk] here), `ranks` ranks in the ring; `*out` takes [b,h,tq,d] with its backward.
extern "C" char *zerorun_ring_attention(at::Tensor *q, at::Tensor *k, at::Tensor *v, at::Tensor *pq, at::Tensor *pk,
                                        double scale, int64_t ranks, Shift fn, void *group, at::Tensor **out) {
  try {
    at::Tensor y = RingAttention::apply(*q, *k, *v, *pq, *pk, scale, ranks, reinterpret_cast<int64_t>(fn),
                                        reinterpret_cast<int64_t>(group));
    *out = new at::Tensor(std::move(y));
    return nullptr;
  } catch (const std::exception &e) {
    return message(e.what());
  }
}
