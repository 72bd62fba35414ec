//! Cross-memory attach: one rank reads another rank's buffer directly (`process_vm_readv`), one copy instead of
//! two through a staging slot. Used by the shm backend when every rank can read every other (checked at join);
//! sandboxes that forbid it (seccomp, Yama) make the backend fall back to staging.
use std::io;

/// Yama's PR_SET_PTRACER: lets sibling ranks (not our ancestors) read this process.
const PR_SET_PTRACER: libc::c_int = 0x5961_6d61;

/// Allows any process of this user to read this one (Yama scope 1 otherwise allows only ancestors).
pub(crate) fn allow_peers_to_read() {
    // SAFETY: prctl with plain integer arguments; failure (no Yama) is harmless.
    unsafe { libc::prctl(PR_SET_PTRACER, libc::c_ulong::MAX, 0, 0, 0) };
}

/// Copies `dst.len()` bytes from address `addr` of process `pid` into `dst`.
pub(crate) fn read(pid: u32, addr: usize, dst: &mut [u8]) -> io::Result<()> {
    let bytes = dst.len();
    let mut done = 0usize;
    while done < bytes {
        let local =
            libc::iovec { iov_base: unsafe { dst.as_mut_ptr().add(done) } as *mut libc::c_void, iov_len: bytes - done };
        let remote = libc::iovec { iov_base: (addr + done) as *mut libc::c_void, iov_len: bytes - done };
        // SAFETY: the local iovec is our own buffer; the kernel checks the remote one.
        let n = unsafe {
            libc::syscall(
                libc::SYS_process_vm_readv,
                pid as libc::pid_t,
                &local as *const libc::iovec,
                1usize,
                &remote as *const libc::iovec,
                1usize,
                0usize,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "process_vm_readv read nothing"));
        }
        done += n as usize;
    }
    Ok(())
}

/// A value every process holds at a known address, to test that a peer can be read.
pub(crate) static PROBE: u64 = 0x5a45_524f_5255_4e31;
