// The gloo backend's C++ side: libtorch's own c10d (TCPStore for the rendezvous, ProcessGroupGloo for the
// collectives and point-to-point over TCP), driven through a C ABI. Only libtorch is called (constructors, the
// virtual methods of c10d::Backend, Work::wait); no gloo type is built here, since Debian's gloo headers are older
// than the gloo libtorch bundles (../shared/reference/c10d.md). Every call catches what libtorch throws and hands
// the message back; every wait is bounded by the group's timeout.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Group {
  c10::intrusive_ptr<c10d::Store> store;  // the job's store (prefixed per group)
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
  std::chrono::milliseconds timeout;
  std::string host;  // the address this rank's gloo device binds
  int rank;
  int size;
};

void put_error(const std::string& what, char* err, size_t len) {
  if (err == nullptr || len == 0) return;
  size_t n = std::min(what.size(), len - 1);
  std::memcpy(err, what.data(), n);
  err[n] = '\0';
}

template <typename F>
int guarded(char* err, size_t len, F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    put_error(e.what(), err, len);
  } catch (...) {
    put_error("unknown C++ exception", err, len);
  }
  return 1;
}

at::ScalarType scalar(int dtype) {
  switch (dtype) {
    case 1: return at::kBFloat16;
    case 2: return at::kHalf;
    case 3: return at::kLong;
    default: return at::kFloat;
  }
}

at::Tensor view(void* data, int64_t n, int dtype) {
  return at::from_blob(data, {n}, at::TensorOptions().dtype(scalar(dtype)).device(at::kCPU));
}

c10d::ReduceOp reduce_op(int op) {
  return op == 2 ? c10d::ReduceOp(c10d::ReduceOp::MAX) : c10d::ReduceOp(c10d::ReduceOp::SUM);
}

void wait(Group* g, const c10::intrusive_ptr<c10d::Work>& work) {
  work->wait(g->timeout);
}

c10::intrusive_ptr<c10d::ProcessGroupGloo> make_pg(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                   std::chrono::milliseconds timeout, const std::string& host) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(host));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
}

// A group on `store` (the job's store, kept for later groups) whose rendezvous is under `prefixed`.
Group* new_group(const c10::intrusive_ptr<c10d::Store>& store, const c10::intrusive_ptr<c10d::Store>& prefixed,
                 int rank, int size, std::chrono::milliseconds timeout, const std::string& host) {
  auto g = new Group{store, nullptr, timeout, host, rank, size};
  try {
    g->pg = make_pg(prefixed, rank, size, timeout, g->host);
  } catch (...) {
    delete g;
    throw;
  }
  return g;
}

}  // namespace

extern "C" {

// The TCPStore at master_addr:master_port: rank 0 serves it and waits for every rank to register (under zerorun
// launch), or torchrun's agent serves it (`agent_store`) and the ranks only connect. Every rank then joins the
// group under `prefix`.
void* zr_gloo_new(const char* master_addr, int master_port, int agent_store, const char* host, int rank, int size,
                  int64_t timeout_ms, const char* prefix, char* err, size_t err_len) {
  Group* out = nullptr;
  guarded(err, err_len, [&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(master_port);
    so.isServer = rank == 0 && agent_store == 0;
    if (agent_store == 0) {
      so.numWorkers = size;
      so.waitWorkers = true;
    } else {
      so.waitWorkers = false;
    }
    so.timeout = timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(std::string(master_addr), so);
    auto store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), tcp);
    out = new_group(tcp, store, rank, size, timeout, std::string(host));
  });
  return out;
}

// A group of `size` ranks (this one is `rank` in it) on the same store under `name`: its members call this together.
void* zr_gloo_subgroup(void* parent, const char* name, int rank, int size, char* err, size_t err_len) {
  Group* out = nullptr;
  auto p = static_cast<Group*>(parent);
  guarded(err, err_len, [&] {
    auto store = c10::make_intrusive<c10d::PrefixStore>(std::string(name), p->store);
    out = new_group(p->store, store, rank, size, p->timeout, p->host);
  });
  return out;
}

void zr_gloo_free(void* group) {
  delete static_cast<Group*>(group);
}

int zr_gloo_all_reduce(void* group, void* data, int64_t n, int dtype, int op, char* err, size_t err_len) {
  auto g = static_cast<Group*>(group);
  return guarded(err, err_len, [&] {
    std::vector<at::Tensor> t{view(data, n, dtype)};
    c10d::AllreduceOptions o;
    o.reduceOp = reduce_op(op);
    o.timeout = g->timeout;
    wait(g, g->pg->allreduce(t, o));
  });
}

// `data` holds `size` parts of `part` elements; this rank's part is in place and every other part arrives.
int zr_gloo_all_gather(void* group, void* data, int64_t part, int dtype, char* err, size_t err_len) {
  auto g = static_cast<Group*>(group);
  return guarded(err, err_len, [&] {
    auto whole = view(data, part * g->size, dtype);
    auto mine = whole.narrow(0, part * g->rank, part).clone();
    c10d::AllgatherOptions o;
    o.timeout = g->timeout;
    wait(g, g->pg->_allgather_base(whole, mine, o));
  });
}

// The reduce-scatter's exchange, bandwidth-optimal and rank-ordered: every rank sends part `peer` of `input` (size
// parts of `part` elements) to each peer and receives each peer's part `rank` into `slots` (size - 1 parts, the
// peers' in rank order); all transfers are in flight at once, so each rank moves (size-1)/size of the buffer each
// way. The caller then sums the parts in rank order (libtorch's _reduce_scatter_base on gloo all-reduces the whole
// buffer instead).
int zr_gloo_exchange_parts(void* group, void* input, void* slots, int64_t part, int dtype, int tag, char* err,
                           size_t err_len) {
  auto g = static_cast<Group*>(group);
  return guarded(err, err_len, [&] {
    auto in = view(input, part * g->size, dtype);
    auto out = view(slots, part * (g->size - 1), dtype);
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int k = 1; k < g->size; ++k) {
      int to = (g->rank + k) % g->size;
      int from = (g->rank - k + g->size) % g->size;
      int slot = from < g->rank ? from : from - 1;
      std::vector<at::Tensor> recv{out.narrow(0, part * slot, part)};
      works.push_back(g->pg->recv(recv, from, tag));
      std::vector<at::Tensor> send{in.narrow(0, part * to, part)};
      works.push_back(g->pg->send(send, to, tag));
    }
    for (auto& w : works) wait(g, w);
  });
}

// The all-to-all of parts of any length: `send_counts[q]` elements of `input` from `send_offsets[q]` go to rank q,
// and `recv_counts[p]` from rank p land at `recv_offsets[p]` of `output`, every transfer in flight at once. Counts
// were agreed before (an empty part is no transfer on either end); this rank's own part is the caller's to copy.
int zr_gloo_exchange_v(void* group, void* input, const int64_t* send_offsets, const int64_t* send_counts,
                       void* output, const int64_t* recv_offsets, const int64_t* recv_counts, int dtype, int tag,
                       char* err, size_t err_len) {
  auto g = static_cast<Group*>(group);
  return guarded(err, err_len, [&] {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int k = 1; k < g->size; ++k) {
      int to = (g->rank + k) % g->size;
      int from = (g->rank - k + g->size) % g->size;
      if (recv_counts[from] > 0) {
        std::vector<at::Tensor> recv{view(static_cast<char*>(output) + recv_offsets[from], recv_counts[from], dtype)};
        works.push_back(g->pg->recv(recv, from, tag));
      }
      if (send_counts[to] > 0) {
        std::vector<at::Tensor> send{view(static_cast<char*>(input) + send_offsets[to], send_counts[to], dtype)};
        works.push_back(g->pg->send(send, to, tag));
      }
    }
    for (auto& w : works) wait(g, w);
  });
}

// The all-gather's exchange: this rank's part `rank` of `data` goes to every peer and each peer's part arrives in
// its place, all in flight at once ((size-1)/size of the buffer each way per rank, no copy of this rank's part).
int zr_gloo_share_parts(void* group, void* data, int64_t part, int dtype, int tag, char* err, size_t err_len) {
  auto g = static_cast<Group*>(group);
  return guarded(err, err_len, [&] {
    auto whole = view(data, part * g->size, dtype);
    auto mine = whole.narrow(0, part * g->rank, part);
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int k = 1; k < g->size; ++k) {
      int to = (g->rank + k) % g->size;
      int from = (g->rank - k + g->size) % g->size;
      std::vector<at::Tensor> recv{whole.narrow(0, part * from, part)};
      works.push_back(g->pg->recv(recv, from, tag));
      std::vector<at::Tensor> send{mine};
      works.push_back(g->pg->send(send, to, tag));
    }
    for (auto& w : works) wait(g, w);
  });
}

int zr_gloo_broadcast(void* group, void* data, int64_t n, int dtype, int root, char* err, size_t err_len) {
  auto g = static_cast<Group*>(group);
  return guarded(err, err_len, [&] {
    std::vector<at::Tensor> t{view(data, n, dtype)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = g->timeout;
    wait(g, g->pg->broadcast(t, o));
  });
}

int zr_gloo_barrier(void* group, char* err, size_t err_len) {
  auto g = static_cast<Group*>(group);
  return guarded(err, err_len, [&] {
    c10d::BarrierOptions o;
    o.timeout = g->timeout;
    wait(g, g->pg->barrier(o));
  });
}

int zr_gloo_send(void* group, void* data, int64_t n, int dtype, int dst, int tag, char* err, size_t err_len) {
  auto g = static_cast<Group*>(group);
  return guarded(err, err_len, [&] {
    std::vector<at::Tensor> t{view(data, n, dtype)};
    wait(g, g->pg->send(t, dst, tag));
  });
}

// Both payloads of a sendrecv in flight at once: `send` (n_send elements) to `dst`, `recv` (n_recv) from `src`.
int zr_gloo_send_recv(void* group, void* send, int64_t n_send, int dst, void* recv, int64_t n_recv, int src, int dtype,
                      int tag, char* err, size_t err_len) {
  auto g = static_cast<Group*>(group);
  return guarded(err, err_len, [&] {
    std::vector<at::Tensor> out{view(send, n_send, dtype)};
    std::vector<at::Tensor> in{view(recv, n_recv, dtype)};
    auto received = g->pg->recv(in, src, tag);
    auto sent = g->pg->send(out, dst, tag);
    wait(g, sent);
    wait(g, received);
  });
}

int zr_gloo_recv(void* group, void* data, int64_t n, int dtype, int src, int tag, char* err, size_t err_len) {
  auto g = static_cast<Group*>(group);
  return guarded(err, err_len, [&] {
    std::vector<at::Tensor> t{view(data, n, dtype)};
    wait(g, g->pg->recv(t, src, tag));
  });
}

// ---- The job's TCPStore as a key-value store (fault tolerance's quorum), and gloo groups made on it ----

// A client connection of its own to the job's TCPStore (rank 0 serves it): the quorum's and the heartbeat's
// traffic never waits behind a group's rendezvous. Every call waits at most `timeout_ms`.
void* zr_store_connect(const char* addr, int port, int64_t timeout_ms, char* err, size_t err_len) {
  c10d::TCPStore* out = nullptr;
  guarded(err, err_len, [&] {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(port);
    so.isServer = false;
    so.waitWorkers = false;
    so.timeout = std::chrono::milliseconds(timeout_ms);
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(addr), so);
    out = store.release();
  });
  return out;
}

void zr_store_free(void* store) {
  c10::intrusive_ptr<c10d::TCPStore>::reclaim(static_cast<c10d::TCPStore*>(store));
}

int zr_store_add(void* store, const char* key, int64_t delta, int64_t* out, char* err, size_t err_len) {
  auto s = static_cast<c10d::TCPStore*>(store);
  return guarded(err, err_len, [&] { *out = s->add(std::string(key), delta); });
}

int zr_store_set(void* store, const char* key, const char* value, char* err, size_t err_len) {
  auto s = static_cast<c10d::TCPStore*>(store);
  return guarded(err, err_len, [&] {
    std::string v(value);
    s->set(std::string(key), std::vector<uint8_t>(v.begin(), v.end()));
  });
}

// The value at `key` into `out` (NUL-terminated, cut at out_len - 1), or `*found` = 0 when there is none yet
// (never waits for the key).
int zr_store_get(void* store, const char* key, char* out, size_t out_len, int* found, char* err, size_t err_len) {
  auto s = static_cast<c10d::TCPStore*>(store);
  return guarded(err, err_len, [&] {
    std::string k(key);
    *found = s->check({k}) ? 1 : 0;
    if (*found == 0) return;
    auto v = s->get(k);
    put_error(std::string(v.begin(), v.end()), out, out_len);
  });
}

// Sets `key` to `desired` if it has no value yet; `out` gets the value it holds afterwards (the first writer's).
int zr_store_set_once(void* store, const char* key, const char* desired, char* out, size_t out_len, char* err,
                      size_t err_len) {
  auto s = static_cast<c10d::TCPStore*>(store);
  return guarded(err, err_len, [&] {
    std::string d(desired);
    auto v = s->compareSet(std::string(key), std::vector<uint8_t>(), std::vector<uint8_t>(d.begin(), d.end()));
    put_error(std::string(v.begin(), v.end()), out, out_len);
  });
}

// A gloo group of `size` ranks on `store` under `prefix` (its members call this together), bound to `host`.
void* zr_gloo_on_store(void* store, const char* prefix, const char* host, int rank, int size, int64_t timeout_ms,
                       char* err, size_t err_len) {
  Group* out = nullptr;
  guarded(err, err_len, [&] {
    auto tcp = c10::intrusive_ptr<c10d::TCPStore>::unsafe_reclaim_from_nonowning(static_cast<c10d::TCPStore*>(store));
    auto timeout = std::chrono::milliseconds(timeout_ms);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), tcp);
    out = new_group(tcp, prefixed, rank, size, timeout, std::string(host));
  });
  return out;
}

}  // extern "C"
