//! Cutting a model's ordered layers into `p` contiguous stages (DeepSpeed's `partition_method`): each layer gets a
//! weight (its trainable parameters, 1, or whether its name matches a regular expression) and the cut minimises
//! the heaviest stage; ties go to the cut whose stages' layer counts are most even, then to the one with the later
//! stages lighter (the last stage also computes the loss).
use std::ops::Range;

use regex::Regex;

use crate::config::Partition;

/// What the partitioner knows of a layer.
#[derive(Debug, Clone)]
pub struct LayerInfo {
    /// The layer's name.
    pub name: String,
    /// Trainable elements.
    pub parameters: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
/// A partition that cannot be made; names the key and the numbers.
pub enum PartitionError {
    #[error("pipeline.partition: {layers} layers cannot fill {stages} stages (every stage needs at least one layer)")]
    /// Fewer layers than stages.
    TooFewLayers {
        /// Layers.
        layers: usize,
        /// Stages.
        stages: usize,
    },
    #[error("pipeline.partition: the boundaries {bounds:?} must be {stages} + 1 increasing layer indices from 0 to {layers}")]
    /// Explicit boundaries that do not cut the layers into the stages.
    Bounds {
        /// The boundaries given.
        bounds: Vec<usize>,
        /// Stages.
        stages: usize,
        /// Layers.
        layers: usize,
    },
    #[error("pipeline.partition: \"type:{pattern}\" is not a regular expression: {why}")]
    /// A `type:REGEX` partition whose pattern is not a regular expression.
    Pattern {
        /// The pattern.
        pattern: String,
        /// The regex error.
        why: String,
    },
    #[error("pipeline.partition: \"type:{pattern}\" matches no layer (layers: {names})")]
    /// A `type:REGEX` partition whose pattern matches no layer.
    NoMatch {
        /// The pattern.
        pattern: String,
        /// The layers' names.
        names: String,
    },
}

/// Each stage's range of layers.
pub fn partition(layers: &[LayerInfo], stages: usize, how: &Partition) -> Result<Vec<Range<usize>>, PartitionError> {
    let n = layers.len();
    if stages == 0 || n < stages {
        return Err(PartitionError::TooFewLayers { layers: n, stages });
    }
    let weights: Vec<usize> = match how {
        Partition::Bounds(b) => {
            if b.len() != stages + 1 || b[0] != 0 || b[stages] != n || b.windows(2).any(|w| w[0] >= w[1]) {
                return Err(PartitionError::Bounds { bounds: b.clone(), stages, layers: n });
            }
            return Ok(b.windows(2).map(|w| w[0]..w[1]).collect());
        }
        Partition::Uniform => vec![1; n],
        Partition::Parameters => layers.iter().map(|l| l.parameters).collect(),
        Partition::Type(pattern) => {
            let re = Regex::new(pattern)
                .map_err(|e| PartitionError::Pattern { pattern: pattern.clone(), why: e.to_string() })?;
            let w: Vec<usize> = layers.iter().map(|l| usize::from(re.is_match(&l.name))).collect();
            if w.iter().all(|&x| x == 0) {
                let names = layers.iter().map(|l| l.name.as_str()).collect::<Vec<_>>().join(", ");
                return Err(PartitionError::NoMatch { pattern: pattern.clone(), names });
            }
            w
        }
    };
    Ok(balanced(&weights, stages))
}

/// The contiguous cut of `weights` into `stages` non-empty parts that minimises (heaviest part, spread of the parts'
/// lengths): dynamic programming over (layers placed, parts used), O(stages · n²).
fn balanced(weights: &[usize], stages: usize) -> Vec<Range<usize>> {
    let n = weights.len();
    let prefix: Vec<usize> = std::iter::once(0)
        .chain(weights.iter().scan(0, |s, &w| {
            *s += w;
            Some(*s)
        }))
        .collect();
    let ideal = n.div_ceil(stages);
    // cost[k][i]: the best (max weight, max length excess) for the first i layers in k parts; from[k][i] its last cut.
    let worst = (usize::MAX, usize::MAX);
    let mut cost = vec![vec![worst; n + 1]; stages + 1];
    let mut from = vec![vec![0usize; n + 1]; stages + 1];
    cost[0][0] = (0, 0);
    for k in 1..=stages {
        for i in k..=n - (stages - k) {
            for j in (k - 1)..i {
                let prev = cost[k - 1][j];
                if prev == worst {
                    continue;
                }
                let part = (prefix[i] - prefix[j], (i - j).saturating_sub(ideal));
                let c = (prev.0.max(part.0), prev.1.max(part.1));
                if c <= cost[k][i] {
                    cost[k][i] = c;
                    from[k][i] = j;
                }
            }
        }
    }
    let mut bounds = vec![n];
    let mut i = n;
    for k in (1..=stages).rev() {
        i = from[k][i];
        bounds.push(i);
    }
    bounds.reverse();
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layers(params: &[usize]) -> Vec<LayerInfo> {
        params.iter().enumerate().map(|(i, &p)| LayerInfo { name: format!("layer{i}"), parameters: p }).collect()
    }

    #[test]
    fn parameters_balance_the_heaviest_stage() {
        // An embedding, four equal blocks, a head: the embedding and head weigh as much as two blocks each.
        let l = layers(&[200, 100, 100, 100, 100, 200]);
        assert_eq!(partition(&l, 2, &Partition::Parameters).unwrap(), vec![0..3, 3..6]);
        assert_eq!(partition(&l, 4, &Partition::Parameters).unwrap(), vec![0..1, 1..3, 3..5, 5..6]);
        assert_eq!(partition(&l, 1, &Partition::Parameters).unwrap(), vec![0..6]);
    }

    #[test]
    fn uniform_and_bounds_and_type() {
        let l = layers(&[1, 1000, 1, 1, 1]);
        assert_eq!(partition(&l, 2, &Partition::Uniform).unwrap(), vec![0..3, 3..5]);
        assert_eq!(partition(&l, 2, &Partition::Bounds(vec![0, 1, 5])).unwrap(), vec![0..1, 1..5]);
        let named: Vec<LayerInfo> = ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
            .iter()
            .map(|n| LayerInfo { name: n.to_string(), parameters: 1 })
            .collect();
        let by_type = partition(&named, 2, &Partition::Type("^blocks".into())).unwrap();
        assert_eq!(
            by_type
                .iter()
                .map(|r| named[r.clone()].iter().filter(|l| l.name.starts_with("blocks")).count())
                .collect::<Vec<_>>(),
            vec![2, 2]
        );
    }

    #[test]
    fn errors_name_the_problem() {
        let l = layers(&[1, 1, 1]);
        assert_eq!(
            partition(&l, 4, &Partition::Uniform).unwrap_err().to_string(),
            "pipeline.partition: 3 layers cannot fill 4 stages (every stage needs at least one layer)"
        );
        assert_eq!(
            partition(&l, 2, &Partition::Bounds(vec![0, 3, 3])).unwrap_err().to_string(),
            "pipeline.partition: the boundaries [0, 3, 3] must be 2 + 1 increasing layer indices from 0 to 3"
        );
        assert!(partition(&l, 2, &Partition::Type("^head".into()))
            .unwrap_err()
            .to_string()
            .contains("matches no layer"));
        assert!(partition(&l, 2, &Partition::Type("(".into()))
            .unwrap_err()
            .to_string()
            .contains("not a regular expression"));
    }

    #[test]
    fn every_cut_covers_every_layer_once() {
        for n in 1..12usize {
            for p in 1..=n {
                let l = layers(&(0..n).map(|i| (i * 37) % 11 + 1).collect::<Vec<_>>());
                for how in [Partition::Parameters, Partition::Uniform] {
                    let cut = partition(&l, p, &how).unwrap();
                    assert_eq!(cut.len(), p);
                    assert_eq!(cut[0].start, 0);
                    assert_eq!(cut[p - 1].end, n);
                    assert!(cut.windows(2).all(|w| w[0].end == w[1].start && !w[0].is_empty()));
                }
            }
        }
    }
}
