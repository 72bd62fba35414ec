//! The gloo backend: libtorch's own c10d, a TCPStore at MASTER_ADDR:MASTER_PORT for the rendezvous (rank 0 serves
//! it, as under torchrun) and a ProcessGroupGloo for the collectives and point-to-point over TCP, so ranks can
//! span hosts without MPI. The C++ side is `native/gloo_backend.cpp`; this side adds what every zerorun backend
//! promises: a handshake before each collective (the same op, size and type on every rank, or an error on every
//! rank), a header handshake before each transfer, the mean as a sum divided here (gloo has no average, and the
//! division is the other backends' own), and groups on the same store.
//!
//! `ffi.rs` holds the C ABI and its error buffer, `backend.rs` the [`GlooComm`] communicator, `from_env.rs` the
//! choice of backend from the environment (gloo flat, or in two levels when ranks span hosts), `store.rs` the
//! job's TCPStore as a key-value store (fault tolerance's quorum) and gloo groups made on it.
mod backend;
mod ffi;
mod from_env;
mod store;

pub use backend::GlooComm;
pub use from_env::communicator_from_env;
pub use store::TcpStore;
