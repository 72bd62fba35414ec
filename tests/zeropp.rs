//! ZeRO++ at stage 3 (and qwZ at 2): quantized weight and gradient communication trains near the full-precision
//! run with every rank reading the same weights; hpZ's host copies serve backward's gathers and change no value.
use serde_json::json;
use zerorun::{Config, Engine, EngineOptions};

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

#[path = "common/hosts.rs"]
mod hosts;
use hosts::two_level_comms;

#[path = "common/compare.rs"]
mod compare;
use compare::max_relative_difference;

#[path = "common/stage3_runs.rs"]
mod stage3_runs;
use stage3_runs::*;

/// ZeRO++'s quantized communication: with `zero_quantized_weights` every gather carries int8 blocks, so training
/// sees weights within half a quantization step of the shards'; with `zero_quantized_gradients` the reduce-scatter's
/// parts do. Either ends near the unquantized run; what the model's weights are read as (here `full_parameters`)
/// is gathered exactly, the same on every rank. Below their stages the keys are refused.
#[test]
fn quantized_weight_and_gradient_communication_trains_near_the_full_precision_run() {
    let reference = adamw_reference();
    let nvme = std::env::temp_dir().join(format!("zerorun-qwz-nvme-{}", std::process::id()));
    std::fs::create_dir_all(&nvme).unwrap();
    let cases = [
        (2, json!({"zero_quantized_weights": true})),
        (3, json!({"zero_quantized_weights": true, "stage3_param_persistence_threshold": 100000})),
        (3, json!({"zero_quantized_gradients": true})),
        (2, json!({"zero_quantized_weights": true, "zero_quantized_gradients": true})),
        // Where the shards live does not matter to the collectives: optimizer on the CPU, parameters on NVMe.
        (
            2,
            json!({"zero_quantized_weights": true, "zero_quantized_gradients": true,
                   "offload_optimizer": {"device": "cpu"},
                   "offload_param": {"device": "nvme", "nvme_path": nvme.clone()}}),
        ),
    ];
    for (world, zero) in cases {
        let runs = run(world, config(1, zero.clone()), Units::PerLayer, false, &DIMS);
        let d = max_relative_difference(&runs[0].params, &reference);
        assert!(d > 1e-6 && d < 0.1, "world size {world}, {zero}: {d:e} from the unquantized run");
        for r in &runs[1..] {
            assert_eq!(r.params, runs[0].params, "world size {world}, {zero}: every rank reads the same weights");
        }
    }
    std::fs::remove_dir_all(&nvme).unwrap();
    for (stage, key) in [(2, "zero_quantized_weights"), (1, "zero_quantized_gradients")] {
        let e = Config::from_value(json!({"train_batch_size": 4, "zero_optimization": {"stage": stage, key: true}}))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("zero_optimization.{key}")) && e.contains(&format!("at stage {stage}")), "{e}");
    }
}

/// hpZ (`zero_hpz_partition_size`) on 2 hosts x 2 thread ranks in two levels: the first gather of each unit after a
/// step keeps this rank's half of it, and the unit's later gathers (backward's) come from the host's two halves.
/// The values are the same, so the run equals the two-level run without hpZ bitwise (and one rank's within the
/// two levels' reduction order); the halves count among the gathered bytes, so the peak grows by at most half the
/// model. A partition size that is not a host's ranks is an error naming the key; without a host level the key
/// has no effect.
#[test]
fn hpz_gathers_from_the_host_copies_and_matches_the_run_without() {
    let dims = [IN, 64, 64, OUT];
    let one = run(1, config(1, json!({})), Units::PerLayer, false, &dims);
    let plain = run_on(two_level_comms(2, 2), config(1, json!({})), Units::PerLayer, Default::default(), &dims);
    let hpz_config = config(1, json!({"zero_hpz_partition_size": 2}));
    let hpz = run_on(two_level_comms(2, 2), hpz_config.clone(), Units::PerLayer, Default::default(), &dims);
    let psi_bytes: usize = dims.windows(2).map(|w| ((w[0] * w[1] + w[1]) as usize).div_ceil(4) * 4 * 4).sum();
    for (rank, r) in hpz.iter().enumerate() {
        assert_eq!(r.params, plain[rank].params, "rank {rank}: hpZ changes no value");
        let d = max_relative_difference(&r.params, &one[0].params);
        assert!(d <= 1e-4, "rank {rank}: {d:e} from one rank");
        let extra = r.peak_gathered as i64 - plain[rank].peak_gathered as i64;
        assert!(extra > 0 && extra as usize <= psi_bytes / 2, "rank {rank}: hpZ added {extra} gathered bytes");
    }
    let errors: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = two_level_comms(2, 2)
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let (vs, layers) = init_layers(&dims);
                    let options = EngineOptions::default().units_of(&layers);
                    let bad = config(1, json!({"zero_hpz_partition_size": 4}));
                    Engine::new(&vs, bad, comm, options).err().map(|e| e.to_string()).unwrap_or_default()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errors {
        assert!(e.contains("zero_optimization.zero_hpz_partition_size is 4, but each host runs 2 ranks"), "{e:?}");
    }
    // One level (plain thread ranks): no effect, the same result as without the key.
    let flat = run(2, hpz_config, Units::PerLayer, false, &dims);
    let without = run(2, config(1, json!({})), Units::PerLayer, false, &dims);
    assert_eq!(flat[0].params, without[0].params);
}
