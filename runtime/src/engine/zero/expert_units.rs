//! Which units hold one expert-parallel position's experts, and the ranks they are split over (DeepSpeed-MoE's
//! expert-data-parallel group). With `expert_parallel.autoep_size` E at stage 3, rank r computes the experts of
//! position `r % E` of every layer (`ExpertParallel::adjacent`: experts `g * N / E ..` at position g), so a unit
//! whose trainable parameters are all experts of one position g is split over the ranks at that position,
//! `g, g + E, g + 2E, ..` (W / E of them), not over all W: each of them gathers only its own experts, and their
//! gradients are reduced among the ranks that computed them. Any other unit (dense, or experts of several
//! positions together) is split over every rank, as without expert parallelism. Also what such units cannot do yet
//! (refused by name) and the group they are split over.
use std::collections::BTreeMap;

use tch::Tensor;

use crate::comm::Communicator;
use crate::config::Config;
use crate::engine::zero::layout::UnitRanks;
use crate::error::{Error, Result};

/// An expert parameter's layer (the name up to its `experts` part) and expert index; None for a dense one.
fn expert_of(name: &str) -> Option<(&str, usize)> {
    let mut at = 0;
    for part in name.split('.') {
        let next = at + part.len() + 1;
        if part == "experts" {
            let rest = name.get(next..)?;
            let index = rest.split('.').next()?;
            if !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()) {
                return Some((&name[..at + part.len()], index.parse().ok()?));
            }
        }
        at = next;
    }
    None
}

/// The ranks each unit is split over (`units`: each unit's trainable parameter names), with E = `expert_parallel`
/// ranks per expert-parallel group and `world_size` ranks in all. A layer whose experts do not divide over E is an
/// error naming it.
pub(crate) fn unit_ranks(units: &[Vec<&str>], expert_parallel: usize, world_size: usize) -> Result<Vec<UnitRanks>> {
    let e = expert_parallel;
    if e <= 1 {
        return Ok(vec![UnitRanks::All; units.len()]);
    }
    let per_layer = experts_per_layer(units.iter().flatten().copied());
    for (layer, &n) in &per_layer {
        if n % e != 0 {
            return Err(Error::Usage(format!(
                "`{layer}` has {n} experts, which expert_parallel.autoep_size {e} does not divide: each expert-parallel rank computes experts / E of every layer"
            )));
        }
    }
    let position = |name: &str| expert_of(name).map(|(layer, i)| i / (per_layer[layer] / e));
    Ok(units
        .iter()
        .map(|names| {
            let positions: Option<Vec<usize>> = names.iter().map(|n| position(n)).collect();
            match positions.as_deref() {
                Some([g, rest @ ..]) if rest.iter().all(|p| p == g) => {
                    UnitRanks::Group((*g..world_size).step_by(e).collect())
                }
                _ => UnitRanks::All,
            }
        })
        .collect())
}

/// The expert-parallel degrees a model of these parameters (`names`) allows on `world_size` ranks: those dividing
/// the ranks and every layer's experts, ascending (empty for a model without experts).
pub(crate) fn allowed_degrees<'a>(names: impl Iterator<Item = &'a str>, world_size: usize) -> Vec<usize> {
    let per_layer = experts_per_layer(names);
    if per_layer.is_empty() {
        return Vec::new();
    }
    (1..=world_size).filter(|e| world_size % e == 0 && per_layer.values().all(|n| n % e == 0)).collect()
}

/// Experts per layer among `names`: the distinct indices under each layer's `experts`.
fn experts_per_layer<'a>(names: impl Iterator<Item = &'a str>) -> BTreeMap<&'a str, usize> {
    let mut indices: BTreeMap<&str, std::collections::BTreeSet<usize>> = BTreeMap::new();
    for name in names {
        if let Some((layer, i)) = expert_of(name) {
            indices.entry(layer).or_default().insert(i);
        }
    }
    indices.into_iter().map(|(l, s)| (l, s.len())).collect()
}

/// Units split over expert-data-parallel groups are gathered whole over their group (from memory or NVMe); what
/// would need them otherwise is refused by name.
pub(crate) fn check_supported(
    config: &Config,
    frozen_by_unit: &[Vec<(String, Tensor)>],
    replica_count: usize,
) -> Result<()> {
    let z = &config.zero_optimization;
    let size = config.expert_parallel.size().to_string();
    let refuse =
        |why: &'static str| Err(Error::Unsupported { key: "expert_parallel.autoep_size", value: size.clone(), why });
    if let Some((name, _)) = frozen_by_unit.iter().flatten().next() {
        return Err(Error::Parameter {
            name: name.clone(),
            why: "is frozen: units of one expert-parallel position's experts are split over their own ranks, which takes trainable parameters only so far".into(),
        });
    }
    if replica_count > 1 {
        return refuse("with shard groups (mics_shard_size, hpZ) not yet: the experts' units are split over their own group of ranks");
    }
    if z.zero_hpz_partition_size > 1 || z.zero_quantized_weights {
        return refuse("with hpZ or quantized weights (ZeRO++) not yet: the experts' units are gathered whole over their own group");
    }
    Ok(())
}

/// This rank's expert-data-parallel group: the ranks of `comm` at its expert-parallel position (`rank % E`), in
/// rank order. Collective over `comm`.
pub(crate) fn position_group(comm: &dyn Communicator, expert_parallel: usize) -> Result<Box<dyn Communicator>> {
    use crate::comm::Collectives;
    let position = comm.rank() % expert_parallel;
    Ok(comm.split(Some(position as u32), comm.rank() as i64)?.expect("every rank has a position"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_give_the_layer_and_the_expert() {
        assert_eq!(expert_of("model.layers.3.mlp.experts.12.w1.weight"), Some(("model.layers.3.mlp.experts", 12)));
        assert_eq!(expert_of("experts.0.gate_proj.weight"), Some(("experts", 0)));
        assert_eq!(expert_of("model.layers.3.mlp.gate.weight"), None);
        assert_eq!(expert_of("experts.w1"), None);
    }

    #[test]
    fn a_unit_of_one_positions_experts_is_split_over_the_ranks_at_that_position() {
        // 4 experts a layer, E = 2 on 6 ranks: position 0 computes experts 0-1 (ranks 0, 2, 4), position 1
        // experts 2-3 (ranks 1, 3, 5).
        let units = vec![
            vec!["embed.weight"],
            vec!["l0.experts.0.w1.weight", "l0.experts.1.w1.weight"],
            vec!["l0.experts.2.w1.weight", "l0.experts.3.w1.weight"],
            // A layer's experts of both positions in one unit, and a unit mixing dense and expert parameters.
            vec!["l1.experts.0.w", "l1.experts.1.w", "l1.experts.2.w", "l1.experts.3.w"],
            vec!["l2.router.weight", "l2.experts.0.w"],
            vec!["l2.experts.1.w"],
        ];
        let ranks = unit_ranks(&units, 2, 6).unwrap();
        let group = |r: &[usize]| UnitRanks::Group(r.to_vec());
        assert_eq!(ranks[0], UnitRanks::All);
        assert_eq!(ranks[1], group(&[0, 2, 4]));
        assert_eq!(ranks[2], group(&[1, 3, 5]));
        assert_eq!(ranks[3], UnitRanks::All);
        assert_eq!(ranks[4], UnitRanks::All);
        assert_eq!(ranks[5], group(&[1, 3, 5]), "l2 has 2 experts: expert 1 is position 1's");
        assert!(unit_ranks(&units, 1, 6).unwrap().iter().all(|r| *r == UnitRanks::All));
    }

    #[test]
    fn degrees_divide_the_ranks_and_every_layers_experts() {
        let names = ["embed", "l0.experts.0.w", "l0.experts.1.w", "l0.experts.2.w", "l0.experts.3.w"];
        assert_eq!(allowed_degrees(names.iter().copied(), 8), vec![1, 2, 4]);
        assert_eq!(allowed_degrees(names.iter().copied(), 6), vec![1, 2]);
        assert!(allowed_degrees(["embed", "head"].into_iter(), 4).is_empty());
    }

    #[test]
    fn experts_that_do_not_divide_over_the_positions_are_refused_by_layer() {
        let units = vec![vec!["l0.experts.0.w", "l0.experts.1.w", "l0.experts.2.w"]];
        let e = unit_ranks(&units, 2, 4).unwrap_err().to_string();
        assert!(e.contains("`l0.experts` has 3 experts") && e.contains("autoep_size 2"), "{e}");
    }
}
