//! The counting allocator's kept blocks: a freed large block goes to the next allocation of its size, is counted
//! while kept, and keeping never holds more large blocks (live and kept) than were live at once. Its own binary:
//! the allocator and its counters are per process.
use tch::{Device, Kind, Tensor};
use zerorun::runtime::report::allocations::{self, Counting};

const MIB: usize = 1 << 20;

fn block(bytes: usize) -> Tensor {
    Tensor::empty([(bytes / 4) as i64], (Kind::Float, Device::Cpu))
}

#[test]
fn freed_large_blocks_are_reused_within_the_live_peak() {
    let _counting = Counting::start().expect("the counting allocator");
    allocations::keep_freed(Some(4 * MIB));

    // Reuse by exact size; a block below the threshold is not kept.
    let a = block(8 * MIB);
    let at = a.data_ptr();
    drop(a);
    assert_eq!(allocations::live().kept, (8 * MIB) as u64);
    drop(block(MIB));
    assert_eq!(allocations::live().kept, (8 * MIB) as u64, "a 1 MiB block is below the threshold");
    let again = block(8 * MIB);
    assert_eq!(again.data_ptr(), at, "the kept block is handed out again");
    assert_eq!(allocations::live().kept, 0);

    // Two 8 MiB blocks live at once (16 MiB), then kept: a 12 MiB allocation finds none of its size, and 12 live
    // plus 16 kept would exceed the 16 live at once, so the kept blocks are given back.
    let b = block(8 * MIB);
    drop((again, b));
    assert_eq!(allocations::live().kept, (16 * MIB) as u64);
    let c = block(12 * MIB);
    let kept = allocations::live().kept;
    assert!(kept as usize + 12 * MIB <= 16 * MIB, "kept {kept} bytes beside 12 MiB live: over the 16 MiB peak");
    // A 4 MiB allocation fits beside them within the peak and keeps what is kept.
    drop(c);
    let d = block(4 * MIB);
    assert_eq!(allocations::live().kept, (12 * MIB) as u64, "12 MiB kept + 4 MiB live is within the peak");

    // Turning keeping off gives every kept block back.
    allocations::keep_freed(None);
    assert_eq!(allocations::live().kept, 0);
    drop(d);
    assert_eq!(allocations::live().kept, 0, "nothing is kept while keeping is off");
}
