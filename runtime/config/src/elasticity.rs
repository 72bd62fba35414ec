//! `elasticity`: a global batch that stays valid as the world size changes (DeepSpeed's elastic batch arithmetic,
//! as DeepSpeed 0.18 computed it; 0.19 refuses the section since it dropped elastic training). From the micro-batch
//! sizes a rank may run and the largest global batch acceptable, it picks the global batch that the most world
//! sizes between `min_gpus` and `max_gpus` can run (micro-batch x gradient accumulation x world size), and for a
//! world size the largest micro-batch that divides its share; gradient accumulation takes up the rest. So a job
//! that restarts on fewer (or more) ranks trains the same samples per optimizer step.
use serde::Serialize;

use super::batch::BatchSizes;
use super::error::{ConfigError, Result};
use super::reader::Section;

/// Highly composite numbers: scaling a base batch by one of them gives a batch with many divisors.
const HIGHLY_COMPOSITE: [u64; 38] = [
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120, 20160,
    25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400, 665280, 720720,
];

/// The `elasticity` section, every default filled in.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ElasticityConfig {
    /// Compute the batch from this section (the batch keys are then not the user's).
    pub enabled: bool,
    /// The largest global batch acceptable.
    pub max_train_batch_size: u64,
    /// Micro-batch sizes a rank may run.
    pub micro_batch_sizes: Vec<u64>,
    /// Fewest data-parallel ranks the batch must suit.
    pub min_gpus: u64,
    /// Most data-parallel ranks the batch must suit.
    pub max_gpus: u64,
    /// Minutes a scheduler should let the job run before scaling it (a scheduler's setting: noticed).
    pub min_time: u64,
    /// Among batches that suit as many world sizes, the larger.
    pub prefer_larger_batch: bool,
    /// Batch keys given beside the section are overridden instead of refused.
    pub ignore_non_elastic_batch_info: bool,
    /// 0.1: one batch for every valid world size, others refused; 0.2: by nodes, and a world size outside the
    /// valid ones gets a batch of its own.
    pub version: f64,
    /// Ranks per model replica (v0.2); zerorun's data-parallel ranks are what the batch divides, so 1.
    pub model_parallel_size: u64,
    /// Ranks per node (v0.2: world sizes move by whole nodes).
    pub num_gpus_per_node: u64,
}

impl Default for ElasticityConfig {
    fn default() -> Self {
        ElasticityConfig {
            enabled: false,
            max_train_batch_size: 2000,
            micro_batch_sizes: vec![2, 4, 6],
            min_gpus: 1,
            max_gpus: 10000,
            min_time: 0,
            prefer_larger_batch: true,
            ignore_non_elastic_batch_info: false,
            version: 0.2,
            model_parallel_size: 1,
            num_gpus_per_node: 1,
        }
    }
}

fn lcm(a: u64, b: u64) -> u64 {
    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    a / gcd(a, b) * b
}

/// World sizes in `min..=max` that run `batch` with one of `micro` (each micro-batch's largest world size and its
/// divisors), sorted.
fn valid_world_sizes(batch: u64, micro: &[u64], min: u64, max: u64) -> Vec<u64> {
    let mut out = std::collections::BTreeSet::new();
    for &m in micro {
        if batch % m != 0 {
            continue;
        }
        let most = batch / m;
        if (min..=max).contains(&most) {
            out.insert(most);
        }
        for i in (1..=most / 2).take_while(|&i| i <= max) {
            if i >= min && most % i == 0 {
                out.insert(i);
            }
        }
    }
    out.into_iter().collect()
}

/// DeepSpeed's v0.1 search: the global batch (≤ `max_batch`) with the most valid world sizes, and those sizes.
fn compatible(micro: &[u64], max_batch: u64, min: u64, max: u64, prefer_larger: bool) -> (u64, Vec<u64>) {
    let mut bases: Vec<u64> = micro.to_vec();
    bases.push(micro.iter().copied().fold(1, lcm));
    let mut candidates: Vec<u64> = bases
        .iter()
        .map(|&base| {
            if base >= max_batch {
                base
            } else {
                let most = HIGHLY_COMPOSITE.iter().copied().take_while(|&h| h <= max_batch / base).last().unwrap_or(1);
                most * base
            }
        })
        .collect();
    candidates.sort_unstable();
    candidates.dedup();
    let mut best = (micro.iter().copied().min().unwrap_or(1), Vec::new());
    for batch in candidates {
        let sizes = valid_world_sizes(batch, micro, min, max);
        let better = sizes.len() > best.1.len()
            || (sizes.len() == best.1.len()
                && ((prefer_larger && batch > best.0) || (!prefer_larger && batch < best.0)));
        if better {
            best = (batch, sizes);
        }
    }
    best
}

impl ElasticityConfig {
    pub(crate) fn read(mut s: Section) -> Result<Self> {
        let d = ElasticityConfig::default();
        let enabled = s.bool("enabled", d.enabled)?;
        let micro_batch_sizes = match s.take("micro_batch_sizes") {
            None if enabled => {
                return Err(ConfigError::Missing {
                    path: "elasticity.micro_batch_sizes".into(),
                    when: "when `elasticity.enabled` is true".into(),
                })
            }
            None => d.micro_batch_sizes,
            Some(v) => {
                let list = v.as_array().and_then(|a| a.iter().map(|x| x.as_u64().filter(|&m| m > 0)).collect());
                list.filter(|l: &Vec<u64>| !l.is_empty()).ok_or_else(|| ConfigError::Type {
                    path: s.path_of("micro_batch_sizes"),
                    expected: "a non-empty array of positive integers",
                    got: super::reader::describe(&v),
                })?
            }
        };
        let max_train_batch_size = match s.opt_uint("max_train_batch_size")? {
            None if enabled => {
                return Err(ConfigError::Missing {
                    path: "elasticity.max_train_batch_size".into(),
                    when: "when `elasticity.enabled` is true".into(),
                })
            }
            v => v.unwrap_or(d.max_train_batch_size),
        };
        let c = ElasticityConfig {
            enabled,
            max_train_batch_size,
            micro_batch_sizes,
            min_gpus: s.uint("min_gpus", d.min_gpus)?,
            max_gpus: s.uint("max_gpus", d.max_gpus)?,
            min_time: s.uint("min_time", d.min_time)?,
            prefer_larger_batch: s.bool("prefer_larger_batch", d.prefer_larger_batch)?,
            ignore_non_elastic_batch_info: s.bool("ignore_non_elastic_batch_info", d.ignore_non_elastic_batch_info)?,
            version: s.float("version", d.version)?,
            model_parallel_size: s.uint("model_parallel_size", d.model_parallel_size)?,
            num_gpus_per_node: s.uint("num_gpus_per_node", d.num_gpus_per_node)?,
        };
        let invalid = |key: &str, value: String, allowed: &str| ConfigError::Invalid {
            path: format!("elasticity.{key}"),
            value,
            allowed: allowed.into(),
        };
        if c.version != 0.1 && c.version != 0.2 {
            return Err(invalid("version", c.version.to_string(), "0.1 or 0.2"));
        }
        if c.model_parallel_size != 1 {
            return Err(invalid(
                "model_parallel_size",
                c.model_parallel_size.to_string(),
                "1: the batch divides zerorun's data-parallel ranks, whatever the model parallelism",
            ));
        }
        if c.num_gpus_per_node == 0 || c.min_gpus == 0 || c.min_gpus > c.max_gpus {
            return Err(invalid(
                "min_gpus",
                format!("{} (max_gpus {}, num_gpus_per_node {})", c.min_gpus, c.max_gpus, c.num_gpus_per_node),
                "1 <= min_gpus <= max_gpus, num_gpus_per_node >= 1",
            ));
        }
        if let Some(m) = c.micro_batch_sizes.iter().find(|&&m| m > c.max_train_batch_size) {
            return Err(invalid(
                "micro_batch_sizes",
                format!("{:?}", c.micro_batch_sizes),
                &format!("every micro-batch at most max_train_batch_size ({}; {m} is larger)", c.max_train_batch_size),
            ));
        }
        s.finish()?;
        Ok(c)
    }

    /// The global batch and the world sizes it suits (DeepSpeed's `compute_elastic_config` without a world size;
    /// for v0.2 the world sizes of whole nodes).
    pub fn valid_batch(&self) -> (u64, Vec<u64>) {
        let per_node = self.num_gpus_per_node;
        if self.version == 0.1 || per_node == 1 {
            return compatible(
                &self.micro_batch_sizes,
                self.max_train_batch_size,
                self.min_gpus,
                self.max_gpus,
                self.prefer_larger_batch,
            );
        }
        let (batch, nodes) = compatible(
            &self.micro_batch_sizes,
            self.max_train_batch_size / per_node,
            (self.min_gpus / per_node).max(1),
            self.max_gpus / per_node,
            self.prefer_larger_batch,
        );
        (batch * per_node, nodes.iter().map(|n| n * per_node).collect())
    }

    /// The batch sizes at `world_size` data-parallel ranks: an error naming the numbers when the world size is
    /// not one the batch suits (v0.1), or when no micro-batch divides its share.
    pub fn batch_sizes(&self, world_size: u64) -> Result<BatchSizes> {
        let (mut batch, valid) = self.valid_batch();
        if !valid.contains(&world_size) {
            if self.version == 0.1 {
                return Err(ConfigError::Invalid {
                    path: "elasticity".into(),
                    value: format!("world size {world_size}"),
                    allowed: format!(
                        "one of the world sizes global batch {batch} suits: {valid:?} (max_train_batch_size {}, micro_batch_sizes {:?}, min_gpus {}, max_gpus {})",
                        self.max_train_batch_size, self.micro_batch_sizes, self.min_gpus, self.max_gpus
                    ),
                });
            }
            // v0.2: a world size of its own gets the largest batch of a micro-batch x its ranks.
            let candidates =
                self.micro_batch_sizes.iter().map(|&m| self.max_train_batch_size / (m * world_size) * m * world_size);
            batch = if self.prefer_larger_batch { candidates.max() } else { candidates.min() }.unwrap_or(0);
        }
        let share = batch / world_size.max(1);
        let mut sizes = self.micro_batch_sizes.clone();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        let micro = sizes.into_iter().find(|&m| share % m == 0 && share > 0).ok_or_else(|| ConfigError::Invalid {
            path: "elasticity.micro_batch_sizes".into(),
            value: format!("{:?}", self.micro_batch_sizes),
            allowed: format!(
                "one that divides the {share} samples per rank of global batch {batch} at world size {world_size}"
            ),
        })?;
        Ok(BatchSizes {
            train_batch_size: batch,
            train_micro_batch_size_per_gpu: micro,
            gradient_accumulation_steps: share / micro,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn elastic(max: u64, micro: &[u64], min: u64, max_gpus: u64) -> ElasticityConfig {
        ElasticityConfig {
            enabled: true,
            max_train_batch_size: max,
            micro_batch_sizes: micro.to_vec(),
            min_gpus: min,
            max_gpus,
            version: 0.1,
            ..Default::default()
        }
    }

    /// DeepSpeed's own unit test (tests/unit/elasticity/test_elastic.py, `test_basic_10k`): 10000 max, micro
    /// [8, 12, 16, 17], 32..1500 GPUs gives 9792 and 23 valid GPU counts.
    #[test]
    fn deepspeeds_basic_case_gives_its_batch_and_world_sizes() {
        let (batch, valid) = elastic(10000, &[8, 12, 16, 17], 32, 1500).valid_batch();
        assert_eq!(batch, 9792);
        assert_eq!(valid.len(), 23);
        assert!(valid.iter().all(|g| (32..=1500).contains(g) && batch % g == 0));
    }

    /// DeepSpeed's `test_valid_world_size`, `test_invalid_world_size` and `test_proper_mbsz`.
    #[test]
    fn deepspeeds_micro_batch_choices() {
        let e = elastic(10000, &[8, 12, 16, 17], 32, 1500);
        assert_eq!(e.batch_sizes(64).unwrap().train_micro_batch_size_per_gpu, 17);
        assert!(e.batch_sizes(128).is_err());
        let e = elastic(32, &[1, 2, 3, 7], 1, 10000);
        assert_eq!(e.batch_sizes(7).unwrap().train_micro_batch_size_per_gpu, 3);
    }

    #[test]
    fn every_valid_world_size_keeps_the_global_batch() {
        let e = elastic(96, &[2, 4], 1, 8);
        let (batch, valid) = e.valid_batch();
        for w in valid {
            let b = e.batch_sizes(w).unwrap();
            assert_eq!(b.train_batch_size, batch);
            assert_eq!(b.train_micro_batch_size_per_gpu * b.gradient_accumulation_steps * w, batch);
        }
    }

    #[test]
    fn an_unsuited_world_size_is_an_error_naming_the_numbers() {
        let e = elastic(24, &[4], 1, 6);
        let err = e.batch_sizes(5).unwrap_err().to_string();
        assert!(
            err.contains("world size 5") && err.contains("global batch 24") && err.contains("[1, 2, 3, 6]"),
            "{err}"
        );
    }
}
