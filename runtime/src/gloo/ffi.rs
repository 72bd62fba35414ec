//! The C ABI of `native/gloo_backend.cpp`, and the buffer its calls write their errors into.
use std::ffi::{c_char, c_int, c_void, CString};

extern "C" {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn zr_gloo_new(
        master_addr: *const c_char,
        master_port: c_int,
        agent_store: c_int,
        host: *const c_char,
        rank: c_int,
        size: c_int,
        timeout_ms: i64,
        prefix: *const c_char,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
    pub(super) fn zr_gloo_subgroup(
        parent: *mut c_void,
        name: *const c_char,
        rank: c_int,
        size: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
    pub(super) fn zr_gloo_free(group: *mut c_void);
    pub(super) fn zr_gloo_all_reduce(
        group: *mut c_void,
        data: *mut c_void,
        n: i64,
        dtype: c_int,
        op: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(super) fn zr_gloo_all_gather(
        group: *mut c_void,
        data: *mut c_void,
        part: i64,
        dtype: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(super) fn zr_gloo_exchange_parts(
        group: *mut c_void,
        input: *mut c_void,
        slots: *mut c_void,
        part: i64,
        dtype: c_int,
        tag: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)] // the C signature
    pub(super) fn zr_gloo_exchange_v(
        group: *mut c_void,
        input: *mut c_void,
        send_offsets: *const i64,
        send_counts: *const i64,
        output: *mut c_void,
        recv_offsets: *const i64,
        recv_counts: *const i64,
        dtype: c_int,
        tag: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(super) fn zr_gloo_share_parts(
        group: *mut c_void,
        data: *mut c_void,
        part: i64,
        dtype: c_int,
        tag: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(super) fn zr_gloo_broadcast(
        group: *mut c_void,
        data: *mut c_void,
        n: i64,
        dtype: c_int,
        root: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(super) fn zr_gloo_barrier(group: *mut c_void, err: *mut c_char, err_len: usize) -> c_int;
    pub(super) fn zr_gloo_send(
        group: *mut c_void,
        data: *mut c_void,
        n: i64,
        dtype: c_int,
        dst: c_int,
        tag: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(super) fn zr_gloo_send_recv(
        group: *mut c_void,
        send: *mut c_void,
        n_send: i64,
        dst: c_int,
        recv: *mut c_void,
        n_recv: i64,
        src: c_int,
        dtype: c_int,
        tag: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(super) fn zr_gloo_recv(
        group: *mut c_void,
        data: *mut c_void,
        n: i64,
        dtype: c_int,
        src: c_int,
        tag: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(super) fn zr_store_connect(
        addr: *const c_char,
        port: c_int,
        timeout_ms: i64,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
    pub(super) fn zr_store_free(store: *mut c_void);
    pub(super) fn zr_store_add(
        store: *mut c_void,
        key: *const c_char,
        delta: i64,
        out: *mut i64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(super) fn zr_store_set(
        store: *mut c_void,
        key: *const c_char,
        value: *const c_char,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)] // the C signature
    pub(super) fn zr_store_get(
        store: *mut c_void,
        key: *const c_char,
        out: *mut c_char,
        out_len: usize,
        found: *mut c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)] // the C signature
    pub(super) fn zr_store_set_once(
        store: *mut c_void,
        key: *const c_char,
        desired: *const c_char,
        out: *mut c_char,
        out_len: usize,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)] // the C signature
    pub(super) fn zr_gloo_on_store(
        store: *mut c_void,
        prefix: *const c_char,
        host: *const c_char,
        rank: c_int,
        size: c_int,
        timeout_ms: i64,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
}

/// An error buffer for the C side, and the message it holds.
pub(super) struct ErrBuf(pub(super) [u8; 2048]);

impl ErrBuf {
    pub(super) fn new() -> ErrBuf {
        ErrBuf([0; 2048])
    }

    pub(super) fn ptr(&mut self) -> *mut c_char {
        self.0.as_mut_ptr() as *mut c_char
    }

    pub(super) fn message(&self) -> String {
        let end = self.0.iter().position(|&b| b == 0).unwrap_or(self.0.len());
        String::from_utf8_lossy(&self.0[..end]).into_owned()
    }
}

pub(super) fn c_string(s: &str) -> CString {
    CString::new(s.replace('\0', "")).expect("no NUL left")
}
