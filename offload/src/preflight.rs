//! Start-up checks of `nvme_path`: it exists, is a writable folder, and its filesystem has room for every swap
//! file plus a margin. Failing here, before the first step, beats ENOSPC an hour into a run.
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::error::{OffloadError, Result};

/// Room kept free beyond the swap files: 10% and 16 MiB.
pub fn with_margin(bytes: u64) -> u64 {
    bytes + bytes / 10 + (16 << 20)
}

/// Bytes available to an unprivileged writer on the filesystem of `dir`.
pub fn free_bytes(dir: &Path) -> Result<u64> {
    let c = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| OffloadError::Preflight { path: dir.into(), what: "contains a NUL byte".into() })?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid C string and st a valid out-pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(OffloadError::Preflight {
            path: dir.into(),
            what: format!("statvfs: {}", std::io::Error::last_os_error()),
        });
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Checks `dir` can hold `needed` bytes of swap files.
pub fn check(dir: &Path, needed: u64) -> Result<()> {
    let fail = |what: String| Err(OffloadError::Preflight { path: dir.to_path_buf(), what });
    match std::fs::metadata(dir) {
        Err(e) => return fail(format!("does not exist or cannot be read ({e})")),
        Ok(m) if !m.is_dir() => return fail("is not a folder".into()),
        Ok(_) => {}
    }
    let probe = dir.join(format!(".zerorun-probe-{}", std::process::id()));
    if let Err(e) = std::fs::write(&probe, b"zerorun") {
        return fail(format!("is not writable ({e})"));
    }
    let _ = std::fs::remove_file(&probe);
    let free = free_bytes(dir)?;
    let want = with_margin(needed);
    if free < want {
        return fail(format!(
            "needs {want} bytes for swap files ({needed} plus margin) but its filesystem has {free} free"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_unwritable_and_full_folders_are_named() {
        let d = std::env::temp_dir().join(format!("zerorun-preflight-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let e = check(&d, 1).unwrap_err().to_string();
        assert!(e.starts_with(&format!("nvme_path {}: does not exist", d.display())), "{e}");
        std::fs::create_dir_all(&d).unwrap();
        check(&d, 1 << 20).unwrap();
        let e = check(&d, u64::MAX / 4).unwrap_err().to_string();
        assert!(e.contains("bytes for swap files") && e.contains("free"), "{e}");
        let file = d.join("f");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(check(&file, 1).unwrap_err().to_string(), format!("nvme_path {}: is not a folder", file.display()));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
