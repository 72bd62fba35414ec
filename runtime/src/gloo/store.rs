//! The job's TCPStore (rank 0 serves it) as a small key-value store, on a connection of this rank's own: what
//! fault tolerance agrees on each step (heartbeats, joins, the quorum, the vote) and the gloo groups it makes for
//! the live replica groups. Keys are strings, values short strings or counters (`add`).
use std::ffi::{c_int, c_void};
use std::time::Duration;

use super::backend::host_address;
use super::ffi::*;
use super::GlooComm;
use crate::comm::{CommError, CommResult};

/// Longest value read back (quorums are short lists of group numbers).
const VALUE_LEN: usize = 4096;

/// A client of the job's TCPStore.
pub struct TcpStore {
    store: *mut c_void,
    rank: usize,
    /// The store's address, for errors and for the address gloo binds.
    addr: String,
    port: u16,
    timeout: Duration,
}

// SAFETY: c10d's TCPStore client serialises its calls on its socket with a lock of its own, so one client may be
// called from several threads (the heartbeat's and the engine's).
unsafe impl Send for TcpStore {}
unsafe impl Sync for TcpStore {}

impl Drop for TcpStore {
    fn drop(&mut self) {
        // SAFETY: made by zr_store_connect, freed once.
        unsafe { zr_store_free(self.store) };
    }
}

impl TcpStore {
    /// Connects to the store at `addr:port` as rank `rank` (for errors); every call waits at most `timeout`.
    pub fn connect(addr: &str, port: u16, rank: usize, timeout: Duration) -> CommResult<TcpStore> {
        let mut err = ErrBuf::new();
        let a = c_string(addr);
        // SAFETY: a valid C string and an error buffer of the length given; the result is checked for null.
        let store = unsafe {
            zr_store_connect(a.as_ptr(), c_int::from(port), timeout.as_millis() as i64, err.ptr(), err.0.len())
        };
        if store.is_null() {
            return Err(CommError::Rendezvous {
                rank,
                world_size: 0,
                place: format!("the TCPStore at {addr}:{port}"),
                what: err.message(),
            });
        }
        Ok(TcpStore { store, rank, addr: addr.to_string(), port, timeout })
    }

    /// Another connection to the same store.
    pub fn reconnect(&self) -> CommResult<TcpStore> {
        TcpStore::connect(&self.addr, self.port, self.rank, self.timeout)
    }

    fn call(
        &self,
        op: &'static str,
        key: &str,
        f: impl FnOnce(*mut std::ffi::c_char, usize) -> c_int,
    ) -> CommResult<()> {
        let mut err = ErrBuf::new();
        let len = err.0.len();
        if f(err.ptr(), len) == 0 {
            return Ok(());
        }
        Err(CommError::BadArgument {
            op,
            rank: self.rank,
            what: format!("the TCPStore at {}:{}, key `{key}`: {}", self.addr, self.port, err.message()),
        })
    }

    /// Adds `delta` to the counter at `key` (0 when new) and returns its value; `add(key, 0)` reads it.
    pub fn add(&self, key: &str, delta: i64) -> CommResult<i64> {
        let k = c_string(key);
        let mut out = 0i64;
        // SAFETY: valid C string, an out pointer and an error buffer alive for the call.
        self.call("store add", key, |e, l| unsafe { zr_store_add(self.store, k.as_ptr(), delta, &mut out, e, l) })?;
        Ok(out)
    }

    /// Sets `key` to `value`.
    pub fn set(&self, key: &str, value: &str) -> CommResult<()> {
        let (k, v) = (c_string(key), c_string(value));
        // SAFETY: valid C strings and an error buffer alive for the call.
        self.call("store set", key, |e, l| unsafe { zr_store_set(self.store, k.as_ptr(), v.as_ptr(), e, l) })
    }

    /// The value at `key`, or None when it has none yet (never waits for it).
    pub fn get(&self, key: &str) -> CommResult<Option<String>> {
        let k = c_string(key);
        let mut out = vec![0u8; VALUE_LEN];
        let mut found: c_int = 0;
        // SAFETY: valid C string, an output buffer of the length given and an error buffer alive for the call.
        self.call("store get", key, |e, l| unsafe {
            zr_store_get(self.store, k.as_ptr(), out.as_mut_ptr() as *mut _, out.len(), &mut found, e, l)
        })?;
        Ok((found != 0).then(|| text(&out)))
    }

    /// Sets `key` to `value` unless it has a value already; returns the value it holds afterwards (the first
    /// writer's, whoever that was).
    pub fn set_once(&self, key: &str, value: &str) -> CommResult<String> {
        let (k, v) = (c_string(key), c_string(value));
        let mut out = vec![0u8; VALUE_LEN];
        // SAFETY: valid C strings, an output buffer of the length given and an error buffer alive for the call.
        self.call("store compare-set", key, |e, l| unsafe {
            zr_store_set_once(self.store, k.as_ptr(), v.as_ptr(), out.as_mut_ptr() as *mut _, out.len(), e, l)
        })?;
        Ok(text(&out))
    }

    /// A gloo group of `size` ranks (this one `rank` in it) on this store under `prefix`: its members call this
    /// together, within the store's timeout.
    pub fn gloo_group(&self, prefix: &str, rank: usize, size: usize) -> CommResult<GlooComm> {
        let host = host_address(&self.addr);
        let (p, h) = (c_string(prefix), c_string(&host));
        let mut err = ErrBuf::new();
        // SAFETY: a live store, valid C strings and an error buffer of the length given; checked for null.
        let group = unsafe {
            zr_gloo_on_store(
                self.store,
                p.as_ptr(),
                h.as_ptr(),
                rank as c_int,
                size as c_int,
                self.timeout.as_millis() as i64,
                err.ptr(),
                err.0.len(),
            )
        };
        let place = format!("the TCPStore at {}:{}", self.addr, self.port);
        if group.is_null() {
            return Err(CommError::Rendezvous {
                rank,
                world_size: size,
                place,
                what: format!("gloo group `{prefix}` (binding {host}): {}", err.message()),
            });
        }
        Ok(GlooComm::from_group(group, rank, size, place))
    }
}

fn text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}
