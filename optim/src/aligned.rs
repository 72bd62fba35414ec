//! `AlignedVec`: an f32 buffer whose start is 64-byte aligned (2 MiB for large buffers, with a huge-page hint).
//!
//! Why not `Vec<f32>`: a large `Vec` starts 16 bytes into a page, so every 64-byte vector load and store of a
//! kernel straddles two cache lines. Measured here, that alone costs AVX-512 kernels a large share of bandwidth.
use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ops::{Deref, DerefMut};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Buffers of at least this many bytes are 2 MiB aligned and advised to use transparent huge pages.
const HUGE: usize = 4 << 20;
const HUGE_ALIGN: usize = 2 << 20;

/// A vector of f32 aligned for the SIMD kernels (64 bytes).
pub struct AlignedVec {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: AlignedVec owns its allocation like a Vec<f32>.
unsafe impl Send for AlignedVec {}
unsafe impl Sync for AlignedVec {}

impl AlignedVec {
    fn layout(len: usize) -> Layout {
        let bytes = (len * 4).max(64);
        let align = if bytes >= HUGE { HUGE_ALIGN } else { 64 };
        Layout::from_size_align(bytes, align).expect("buffer size fits a Layout")
    }

    /// `len` elements, all `value`. Pages are advised huge before they are first touched.
    pub fn filled(len: usize, value: f32) -> Self {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) } as *mut f32;
        if ptr.is_null() {
            handle_alloc_error(layout);
        }
        #[cfg(target_os = "linux")]
        if layout.size() >= HUGE {
            // SAFETY: the range is our own allocation, 2 MiB aligned; the advice cannot fail in a harmful way.
            unsafe { libc::madvise(ptr as *mut libc::c_void, layout.size(), libc::MADV_HUGEPAGE) };
        }
        let mut v = AlignedVec { ptr, len };
        if value != 0.0 || value.is_sign_negative() {
            v.fill(value);
        }
        v
    }

    /// A copy of `values`.
    pub fn from_slice(values: &[f32]) -> Self {
        let mut v = AlignedVec::filled(values.len(), 0.0);
        v.copy_from_slice(values);
        v
    }

    /// The values.
    pub fn as_slice(&self) -> &[f32] {
        self
    }

    /// The values, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        self
    }
}

impl Drop for AlignedVec {
    fn drop(&mut self) {
        // SAFETY: allocated in `filled` with this layout.
        unsafe { dealloc(self.ptr as *mut u8, Self::layout(self.len)) }
    }
}

impl Deref for AlignedVec {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: ptr holds len initialized f32.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for AlignedVec {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as above, and we own it exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Clone for AlignedVec {
    fn clone(&self) -> Self {
        AlignedVec::from_slice(self)
    }
}

impl PartialEq for AlignedVec {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl std::fmt::Debug for AlignedVec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedVec(len {})", self.len)
    }
}

impl Serialize for AlignedVec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.as_slice().serialize(s)
    }
}

impl<'de> Deserialize<'de> for AlignedVec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(AlignedVec::from_slice(&Vec::<f32>::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_filled_and_cloned() {
        for len in [0usize, 1, 17, 1 << 20, 3 << 20] {
            let v = AlignedVec::filled(len, 1.5);
            assert_eq!(v.as_ptr() as usize % 64, 0);
            if len * 4 >= HUGE {
                assert_eq!(v.as_ptr() as usize % HUGE_ALIGN, 0);
            }
            assert!(v.iter().all(|x| *x == 1.5));
            assert_eq!(v.clone(), v);
        }
    }
}
