//! Sizes a ds_config leaves to the model (absent or "auto"): DeepSpeed's defaults are sized for models of billions of
//! parameters (5e8 elements per reduction, 1e9 live), which for a smaller model mean one bucket and nothing
//! partitioned at all. Stage 3's keys come from its units, the gradient hooks' buckets (stage 2 in a plain loop,
//! stage 0's all-reduce in backward) from the trainable parameters; rank 0 logs what it chose and the engine's
//! resolved config keeps it.
use tch::Tensor;

use crate::config::Config;
use crate::engine::zero::layout::FlatLayout;
use crate::engine::zero::plan::StagePlan;

/// Stage 3's size keys for a config that left them to the model (absent or "auto"): DeepSpeed's defaults (5e8
/// elements per reduction round, 5e7 prefetched, 1e9 live) keep a model of under a billion parameters gathered
/// whole, so stage 3 would save nothing. Sized from the units instead: twice the largest unit live (the one in use
/// and the next one prefetched, FSDP2's default; with one, no all-gather of a largest unit starts before the unit
/// in use is released, so the link idles while it computes: a 2 x 1 stage-3 step across 1 Gbit/s hosts took 3.37 s
/// with one, 2.78-2.89 s with two), one unit prefetched per round, units under 1% of the model (at most DeepSpeed's 1e5
/// elements) kept gathered, and reductions in rounds of a quarter of the largest unit but at least 1M elements (a
/// whole unit when smaller): the round's fp32 bucket and its reduced half sit beside the unit's gathered parameters
/// and gradients, 3/8 of a unit instead of 1.5 units, while each collective still moves 4 MB or more.
/// Returns (key, value) for each key in `keys`.
pub(crate) fn sizes_from_model(unit_numels: &[u64], keys: &[&str]) -> Vec<(&'static str, u64)> {
    let largest = unit_numels.iter().copied().max().unwrap_or(1).max(1);
    let total: u64 = unit_numels.iter().sum();
    let all = [
        ("reduce_bucket_size", (largest / 4).max(largest.min(1 << 20))),
        ("stage3_prefetch_bucket_size", largest),
        ("stage3_param_persistence_threshold", (total / 100).min(100_000)),
        ("stage3_max_live_parameters", 2 * largest),
    ];
    all.into_iter().filter(|(k, _)| keys.contains(k)).collect()
}

/// Stage 2's bucket size (elements) for a config that left `reduce_bucket_size` to the model (absent or "auto"),
/// when the gradient hooks cut the parameters into buckets (no units given): an eighth of the model, at least 1M
/// elements and at most DeepSpeed's 5e8. DeepSpeed's 5e8 makes a model of under 500M parameters one bucket,
/// reduced after the last gradient of backward, with the whole gradient staged beside the `.grad` tensors; eight
/// buckets reduce while backward goes on (with `overlap_comm`), stage an eighth, and free each bucket's `.grad`
/// tensors as it is reduced, while each collective still moves 4 MB or more.
pub(crate) fn hooked_bucket_from_model(parameter_numels: &[usize]) -> u64 {
    let total: u64 = parameter_numels.iter().map(|&n| n as u64).sum();
    (total / 8).clamp(1 << 20, 500_000_000)
}

/// The gradient hooks' buckets (stage 2 in a plain loop, stage 0's all-reduce in backward): `reduce_bucket_size`
/// left out or "auto" sized from the trainable parameters ([`hooked_bucket_from_model`]), logged once and
/// kept in the engine's resolved config.
pub(crate) fn size_hooked_buckets(
    mut config: Config,
    plan: &StagePlan,
    trainable: &[(String, Tensor)],
    rank: usize,
) -> Config {
    let z = &mut config.zero_optimization;
    let Some(i) = z.sized_from_model.iter().position(|&k| k == "reduce_bucket_size") else { return config };
    if !plan.hooks_gradients() {
        return config;
    }
    z.sized_from_model.remove(i);
    let numels: Vec<usize> = trainable.iter().map(|(_, t)| t.numel()).collect();
    z.reduce_bucket_size = hooked_bucket_from_model(&numels);
    if rank == 0 {
        tracing::info!(
            "sized from the model's {} trainable elements (absent or \"auto\" in the config): zero_optimization.reduce_bucket_size = {}",
            numels.iter().sum::<usize>(),
            z.reduce_bucket_size
        );
    }
    config
}

/// Stage 3 with units: the size keys the config left out or set to "auto" sized from the units
/// ([`sizes_from_model`]), logged once and kept in the engine's resolved config.
pub(crate) fn size_from_model(mut config: Config, layout: &FlatLayout, plan: &StagePlan, rank: usize) -> Config {
    let z = &mut config.zero_optimization;
    if !plan.partitions_parameters() || z.sized_from_model.is_empty() || layout.units.len() < 2 {
        z.sized_from_model.clear();
        return config;
    }
    let numels: Vec<u64> = layout.units.iter().map(|u| u.range.len() as u64).collect();
    let sizes = sizes_from_model(&numels, &z.sized_from_model);
    for &(key, value) in &sizes {
        match key {
            "reduce_bucket_size" => z.reduce_bucket_size = value,
            "stage3_prefetch_bucket_size" => z.stage3_prefetch_bucket_size = value,
            "stage3_param_persistence_threshold" => z.stage3_param_persistence_threshold = value,
            _ => z.stage3_max_live_parameters = value,
        }
    }
    z.sized_from_model.clear();
    if rank == 0 {
        let chosen: Vec<String> = sizes.iter().map(|(k, v)| format!("zero_optimization.{k} = {v}")).collect();
        tracing::info!(
            "sized from the model's {} units (largest {} elements; absent or \"auto\" in the config): {}",
            numels.len(),
            numels.iter().max().unwrap_or(&0),
            chosen.join(", ")
        );
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::zero::plan::bucket_cuts;

    #[test]
    fn stage_3_sizes_from_the_model() {
        // 16 units of 4.2M elements and a 1,000-element one: one unit in use and one prefetched, a quarter reduced
        // per round, units under 1e5 (1% of the model is more) kept gathered.
        let mut units = vec![4_198_400u64; 16];
        units.push(1_000);
        let all = [
            "reduce_bucket_size",
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
        ];
        assert_eq!(
            sizes_from_model(&units, &all),
            vec![
                ("reduce_bucket_size", 1_049_600),
                ("stage3_prefetch_bucket_size", 4_198_400),
                ("stage3_param_persistence_threshold", 100_000),
                ("stage3_max_live_parameters", 8_396_800),
            ]
        );
        // A small model: 1% of it; only the keys asked for.
        assert_eq!(
            sizes_from_model(&[3_000, 2_000], &["stage3_param_persistence_threshold"]),
            vec![("stage3_param_persistence_threshold", 50)]
        );
        // Rounds of at least 1M elements: a whole unit below that, 1M up to 4M, a quarter above.
        for (largest, round) in [(3_000, 3_000), (2_000_000, 1 << 20), (67_117_056, 16_779_264)] {
            assert_eq!(sizes_from_model(&[largest, 10], &["reduce_bucket_size"]), vec![("reduce_bucket_size", round)]);
        }
    }

    #[test]
    fn stage_2_buckets_from_the_model_are_an_eighth_within_1m_and_5e8() {
        // The 54.6M-parameter MLP: eight buckets of about 6.8M elements.
        assert_eq!(hooked_bucket_from_model(&[4_194_304, 4096, 16_777_216 * 3, 4096 * 3, 32_768, 8]), 6_821_889);
        assert_eq!(hooked_bucket_from_model(&[1000, 10]), 1 << 20);
        assert_eq!(hooked_bucket_from_model(&[2_000_000_000, 2_000_000_000]), 500_000_000);
        // Cut by it, in layout order (by name: each layer's bias, then its weight), the MLP makes seven buckets:
        // the first layer with the next bias, each 16.7M weight alone, a bias alone before it, the last layer.
        let sizes = [4096, 4_194_304, 4096, 16_777_216, 4096, 16_777_216, 4096, 16_777_216, 8, 32_768];
        let cuts = bucket_cuts(&sizes, hooked_bucket_from_model(&sizes));
        assert_eq!(cuts, vec![0, 0, 0, 1, 2, 3, 4, 5, 6, 6]);
    }
}
