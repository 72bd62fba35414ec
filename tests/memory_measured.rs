//! The memory report's measured categories, from the counting allocator: activations of a model whose saved
//! tensors are known exactly, a tensor the program keeps showing under temporaries, and malloc's retained free
//! blocks falling when the heap is trimmed. One test: the counters are per process, so nothing else may train
//! in this binary at the same time.
use std::time::Duration;

use serde_json::json;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use zerorun::runtime::comm::threads;
use zerorun::runtime::report::memory::{EventSample, MemoryReport};
use zerorun::{Config, Engine, EngineOptions, Sequence};

const WIDTH: i64 = 512;
const BATCH: i64 = 256;
const LAYERS: usize = 4;
const MIB: f64 = 1024.0 * 1024.0;

fn config(stage: u8) -> Config {
    Config::from_value(json!({
        "train_batch_size": BATCH, "memory_breakdown": true,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}
    }))
    .unwrap()
}

/// LAYERS units of linear then tanh: each keeps exactly one [BATCH, WIDTH] fp32 tensor for backward (tanh's
/// output, which the next linear saves too; the linear's own output is freed once tanh has run).
fn model(vs: &nn::VarStore) -> Sequence<'_> {
    let mut seq = Sequence::new();
    for i in 0..LAYERS {
        let l = nn::linear(vs.root() / format!("l{i}"), WIDTH, WIDTH, Default::default());
        seq = seq.unit([format!("l{i}")], move |x| l.forward(x).tanh());
    }
    seq
}

fn category(e: &EventSample, name: &str) -> u64 {
    e.categories.get(name).copied().unwrap_or_else(|| panic!("event `{}` has no `{name}`: {:?}", e.event, e.categories))
}

/// Trains `steps` steps on one rank; `between(step)` runs before each step's forward. Returns the report.
fn train(stage: u8, steps: usize, mut between: impl FnMut(usize)) -> MemoryReport {
    let comm = threads::group(1, Duration::from_secs(60)).pop().unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let model = model(&vs);
    let mut engine =
        Engine::new(&vs, config(stage), Box::new(comm), EngineOptions::default().units_of(&model)).unwrap();
    let x = Tensor::randn([BATCH, WIDTH], (Kind::Float, Device::Cpu));
    for step in 0..steps {
        between(step);
        let loss = engine.forward(&model, &x).unwrap().square().mean(Kind::Float);
        engine.backward_units(&model, &loss).unwrap();
        drop(loss);
        engine.step().unwrap();
    }
    engine.memory_report()
}

#[test]
fn activations_temporaries_and_retained_memory_are_measured() {
    let per_unit = (BATCH * WIDTH * 4) as u64;
    // Activations: at the end of forward, LAYERS saved tensors (the last is the output), at stage 0 and stage 3;
    // at stage 3 each unit's share is recorded too.
    for stage in [0u8, 3] {
        let report = train(stage, 3, |_| {});
        let forward = report.events.iter().find(|e| e.event == "forward").expect("an end-of-forward event");
        let got = category(forward, "activations");
        let want = per_unit * LAYERS as u64;
        let off = (got as f64 - want as f64).abs() / want as f64;
        assert!(off <= 0.02, "stage {stage}: activations {got} bytes at the end of forward, exactly {want} kept");
        let optimizer = report.events.iter().find(|e| e.event == "optimizer step").unwrap();
        let left = category(optimizer, "activations");
        assert!(
            left < per_unit / 8,
            "stage {stage}: {left} bytes of activations left after backward ({per_unit} per unit)"
        );
        // The process's peak is found between events (VmHWM read and reset at each one), never below the highest
        // event, and it is the report's process peak.
        let window = report.peak_window.as_ref().expect("the window of the process's peak");
        let highest = report.peak.as_ref().unwrap().rss_bytes;
        assert!(
            window.rss_bytes >= highest && report.peak_rss_bytes >= window.rss_bytes,
            "{window:?}, event {highest}"
        );
        if stage == 3 {
            assert_eq!(report.unit_activations_bytes.len(), LAYERS);
            for (i, b) in report.unit_activations_bytes.iter().enumerate() {
                let off = (*b as f64 - per_unit as f64).abs() / per_unit as f64;
                assert!(off <= 0.02, "unit {i}: {b} bytes kept, exactly {per_unit}");
            }
            assert_eq!(report.unit_input_bytes, vec![per_unit; LAYERS]);
        }
    }

    // A tensor the program keeps shows under temporaries from the step after it was made.
    let leak_bytes = 32 << 20;
    let mut leaked = None;
    let report = train(3, 4, |step| {
        if step == 2 {
            leaked = Some(Tensor::ones([leak_bytes / 4], (Kind::Float, Device::Cpu)));
        }
    });
    let temporaries: Vec<u64> = report
        .steps
        .iter()
        .map(|s| category(s.peak_event.as_ref().expect("the step's highest event"), "temporaries"))
        .collect();
    let grew = temporaries[3] as f64 - temporaries[1] as f64;
    assert!(
        (grew - leak_bytes as f64).abs() / (leak_bytes as f64) < 0.02,
        "temporaries by step {temporaries:?}: the kept {leak_bytes} bytes should appear"
    );
    drop(leaked);

    // Freed small blocks stay in malloc's arenas (allocator_retained) until the heap is trimmed.
    let mut pin = None;
    let report = train(0, 4, |step| {
        if step == 1 {
            // 96 MiB in 64 KiB tensors (below the engine's 4 MiB mmap threshold: heap blocks), then freed; a small
            // tensor made after them stays, so malloc cannot hand them back as the top of its heap.
            let blocks: Vec<Tensor> = (0..1536).map(|_| Tensor::ones([16384], (Kind::Float, Device::Cpu))).collect();
            pin = Some(Tensor::ones([16], (Kind::Float, Device::Cpu)));
            drop(blocks);
        }
        if step == 3 {
            // SAFETY: malloc_trim only returns free pages of malloc's arenas.
            unsafe { libc::malloc_trim(0) };
        }
    });
    let retained: Vec<f64> = report
        .steps
        .iter()
        .map(|s| category(s.peak_event.as_ref().unwrap(), "allocator_retained") as f64 / MIB)
        .collect();
    // Most of the 96 MiB stays with malloc (the steps reuse some of it, and the heap's top is trimmed by malloc
    // itself); trimming returns it.
    assert!(retained[0] < 16.0 && retained[2] >= 48.0, "retained MiB by step {retained:?}: freed before step 2");
    assert!(retained[3] <= retained[2] - 40.0, "retained MiB by step {retained:?}: the heap trimmed before step 4");
    drop(pin);

    // The peak's largest allocations, when asked for: a 64 MiB tensor the program keeps from step 2 on makes every
    // later event the highest so far, and it heads the list as the program's, from `aten::ones`, in no engine phase.
    // SAFETY: this binary's one test; no other thread reads the environment now.
    unsafe { std::env::set_var(zerorun::runtime::report::allocations::SNAPSHOT_ENV, "1") };
    let mut kept = None;
    let report = train(3, 3, |step| {
        if step == 1 {
            kept = Some(Tensor::ones([16 << 20], (Kind::Float, Device::Cpu)));
        }
    });
    let snapshot = report.peak_allocations.expect("a snapshot at the highest event");
    let sizes: Vec<u64> = snapshot.allocations.iter().map(|a| a.bytes).collect();
    assert!(sizes.windows(2).all(|w| w[0] >= w[1]) && sizes.iter().sum::<u64>() <= snapshot.live_bytes, "{snapshot:?}");
    let first = &snapshot.allocations[0];
    assert_eq!((first.bytes, first.owner.as_str(), first.phase.as_str()), (64 << 20, "program", ""), "{snapshot:?}");
    assert!(first.op.contains("aten::ones"), "{snapshot:?}");
    assert!(snapshot.allocations.iter().all(|a| a.owner == "program" || !a.phase.is_empty()), "{snapshot:?}");
    drop(kept);
}
