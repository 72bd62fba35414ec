//! The counting allocator's kept blocks: a freed large block goes to the next allocation of its size, is counted
//! while kept, and keeping never holds more bytes (every block live, small ones included, and the kept ones) than
//! were live at once, or that plus the largest block when asked. Its own binary: the allocator and its counters are per process.
use tch::{Device, Kind, Tensor};
use zerorun::runtime::comm::threads;
use zerorun::runtime::report::allocations::{self, Counting, KeepBound};
use zerorun::{Engine, EngineOptions};

const MIB: usize = 1 << 20;

fn block(bytes: usize) -> Tensor {
    Tensor::empty([(bytes / 4) as i64], (Kind::Float, Device::Cpu))
}

#[test]
fn freed_large_blocks_are_reused_within_the_live_peak() {
    let _counting = Counting::start().expect("the counting allocator");
    allocations::release_kept(); // the peak counts from here: nothing is live
    assert_eq!(allocations::live().total, 0, "this test's binary holds no tensor yet");
    allocations::keep_freed(Some(4 * MIB), Some(KeepBound::Peak));

    // Reuse by exact size.
    let a = block(8 * MIB);
    let at = a.data_ptr();
    drop(a);
    assert_eq!(allocations::live().kept, (8 * MIB) as u64);
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
    drop(c);
    assert_eq!(allocations::live().kept, (12 * MIB) as u64);
    // Every byte live counts, not the large blocks alone: small blocks (activations, say) that bring the live
    // bytes near the peak push the kept ones out, so nothing kept sits on top of the peak.
    let small: Vec<Tensor> = (0..3).map(|_| block(MIB)).collect();
    assert_eq!(allocations::live().kept, (12 * MIB) as u64, "3 MiB live + 12 kept are within the 16 MiB peak");
    let more: Vec<Tensor> = (0..2).map(|_| block(MIB)).collect();
    assert_eq!(allocations::live().kept, 0, "5 MiB live + 12 kept are over the peak: the 12 MiB block went back");
    drop((small, more));

    // Keeping off: a freed block goes back at once, and so does what was kept.
    let d = block(4 * MIB);
    drop(d);
    assert_eq!(allocations::live().kept, (4 * MIB) as u64);
    allocations::keep_freed(Some(4 * MIB), None);
    assert_eq!(allocations::live().kept, 0);
    drop(block(8 * MIB));
    assert_eq!(allocations::live().kept, 0, "nothing is kept while keeping is off");

    // With the largest block's headroom (the peak and the largest block count afresh from here: nothing is
    // live), the same 8 + 8 then 12 keeps both 8 MiB blocks, which within the peak alone went: 12 live and 16
    // kept are within the 16 live at once plus the 12 MiB block.
    allocations::release_kept();
    allocations::keep_freed(Some(4 * MIB), Some(KeepBound::PeakAndLargest));
    let (a, b) = (block(8 * MIB), block(8 * MIB));
    drop((a, b));
    let c = block(12 * MIB);
    assert_eq!(allocations::live().kept, (16 * MIB) as u64, "both 8 MiB blocks kept beside 12 MiB live");
    drop(c);
    let again = block(8 * MIB);
    assert_eq!(allocations::live().kept, (20 * MIB) as u64, "an 8 MiB block reused; one and the 12 MiB one kept");
    // 8 live, 20 kept: a 16 MiB block (the largest now; 24 live at once) gives back the oldest kept block (8 MiB):
    // 24 live and 12 kept are within 24 + 16, 24 and 20 were not.
    let d = block(16 * MIB);
    assert_eq!(allocations::live().kept, (12 * MIB) as u64, "kept {} MiB", allocations::live().kept >> 20);
    drop(d);
    drop(again);
    allocations::keep_freed(Some(4 * MIB), None);
    assert_eq!(allocations::live().kept, 0);

    // An engine refuses a value of ZERORUN_ALLOCATOR_CACHE it does not know, naming it and what it takes. (In this
    // test, not beside it: an engine's start-up releases the kept blocks, process-wide.)
    std::env::set_var(allocations::KEEP_FREED_ENV, "lots");
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let _layer = tch::nn::linear(vs.root() / "l", 4, 4, Default::default());
    let config = zerorun::Config::from_value(serde_json::json!({"train_batch_size": 1})).unwrap();
    let comm = threads::group(1, std::time::Duration::from_secs(10)).pop().unwrap();
    let error = Engine::new(&vs, config, Box::new(comm), EngineOptions::default()).expect_err("refused").to_string();
    std::env::remove_var(allocations::KEEP_FREED_ENV);
    assert!(
        error.contains("ZERORUN_ALLOCATOR_CACHE=\"lots\"") && error.contains("peak") && error.contains("0 (keep none)"),
        "{error}"
    );
}
