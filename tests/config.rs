//! ds_config parsing: every shipped config loads, every bad config gives its exact error, resolved configs
//! round-trip, DeepSpeed's defaults and aliases hold, and the batch rule is total.
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use serde_json::json;
use zerorun::config::{BatchInput, Config, ConfigError, OffloadDevice, OptimizerConfig, Precision};

fn repo(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(p)
}

fn json_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_shipped_config_loads_and_resolves_for_one_to_four_ranks() {
    let files = json_files(&repo("configs"));
    assert!(files.len() >= 11, "configs/ lost files: {files:?}");
    for f in files {
        let c = Config::from_file(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        for ws in 1..=4 {
            let r = c.resolve(ws).unwrap_or_else(|e| panic!("{} at world size {ws}: {e}", f.display()));
            let b = r.batch_sizes(ws).unwrap();
            assert_eq!(
                b.train_batch_size,
                b.train_micro_batch_size_per_gpu * b.gradient_accumulation_steps * ws as u64
            );
        }
    }
}

/// `tests/bad_configs/expected.txt`: one line per file, `name.json<TAB>exact error at world size 2`.
#[test]
fn every_bad_config_gives_its_exact_error() {
    let dir = repo("tests/bad_configs");
    let expected = std::fs::read_to_string(dir.join("expected.txt")).unwrap();
    let mut seen = Vec::new();
    for line in expected.lines().filter(|l| !l.trim().is_empty()) {
        let (file, message) = line.split_once('\t').expect("name<TAB>message");
        let err = Config::from_file(dir.join(file)).and_then(|c| c.resolve(2)).err();
        let err = err.unwrap_or_else(|| panic!("{file} was accepted"));
        assert_eq!(err.to_string(), message, "{file}");
        seen.push(file.to_string());
    }
    let files: Vec<String> =
        json_files(&dir).iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert!(files.len() >= 25, "the corpus needs at least 25 bad configs");
    for f in files {
        assert!(seen.contains(&f), "{f} has no expected error in expected.txt");
    }
}

#[test]
fn errors_name_the_json_path() {
    let e = Config::from_value(
        json!({"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {"device": "gpu"}}}),
    )
    .unwrap_err();
    assert_eq!(e.path(), Some("zero_optimization.offload_optimizer.device"));
    let e = Config::from_value(json!({"zero_optimization": {"stgae": 2}})).unwrap_err();
    assert_eq!(
        e,
        ConfigError::UnknownKey {
            path: "zero_optimization.stgae".into(),
            hint: "; did you mean `zero_optimization.stage`?".into()
        }
    );
}

#[test]
fn resolved_configs_round_trip() {
    let mut files = json_files(&repo("configs"));
    files.push(repo("tests/configs/everything.json"));
    for f in files {
        let resolved = Config::from_file(&f).unwrap().resolve(2).unwrap();
        let text = serde_json::to_string(&resolved.to_value()).unwrap();
        let mut back = Config::from_json_str(&text)
            .unwrap_or_else(|e| panic!("{}: resolved form does not read back: {e}", f.display()));
        // The resolved form writes every key, defaults included: what it notices may differ, what it means not.
        back.notices.clone_from(&resolved.notices);
        assert_eq!(back, resolved, "{}", f.display());
    }
}

#[test]
fn deepspeed_defaults() {
    let c = Config::from_value(json!({"train_batch_size": 8})).unwrap();
    assert_eq!(c.stage(), 0);
    assert_eq!(c.gradient_clipping, 1.0);
    assert_eq!(c.comms_timeout, 1800.0);
    assert_eq!(c.precision(), Precision::Fp32);
    let z = &c.zero_optimization;
    // zerorun's own default at stage 0 (DeepSpeed all-reduces after backward whatever it says): true.
    assert!(z.overlap_comm && z.contiguous_gradients && z.reduce_scatter);
    assert_eq!(
        (z.reduce_bucket_size, z.allgather_bucket_size, z.sub_group_size),
        (500_000_000, 500_000_000, 1_000_000_000)
    );
    assert_eq!((z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold), (50_000_000, 100_000));
    assert_eq!(
        (z.offload_optimizer.buffer_count, z.offload_param.buffer_count, z.offload_param.buffer_size),
        (4, 5, 100_000_000)
    );
    assert_eq!(c.fp16.initial_scale_power, 16);
    assert_eq!(c.fp16.loss_scale_window, 1000);
    assert_eq!(c.fp16.hysteresis, 2);
    assert_eq!(c.aio.block_size, 1_048_576);
    assert_eq!(c.aio.queue_depth, 8);
    let s3 = Config::from_value(json!({"train_batch_size": 8, "zero_optimization": {"stage": 3}})).unwrap();
    assert!(s3.zero_optimization.overlap_comm, "overlap_comm defaults to true at stage 3");
    // zerorun's own default at stage 2 (DeepSpeed's is false there): true, and a value given is kept.
    let s2 = Config::from_value(json!({"train_batch_size": 8, "zero_optimization": {"stage": 2}})).unwrap();
    assert!(s2.zero_optimization.overlap_comm, "overlap_comm defaults to true at stage 2");
    let off = json!({"train_batch_size": 8, "zero_optimization": {"stage": 2, "overlap_comm": false}});
    assert!(!Config::from_value(off).unwrap().zero_optimization.overlap_comm);
    let s1 = Config::from_value(json!({"train_batch_size": 8, "zero_optimization": {"stage": 1}})).unwrap();
    assert!(!s1.zero_optimization.overlap_comm, "stage 1 keeps DeepSpeed's false");
}

#[test]
fn adam_w_mode_follows_deepspeed() {
    let adam = |params: serde_json::Value, ty: &str| match Config::from_value(
        json!({"train_batch_size": 8, "optimizer": {"type": ty, "params": params}}),
    )
    .unwrap()
    .optimizer
    .unwrap()
    {
        OptimizerConfig::Adam(p) | OptimizerConfig::AdamW(p) => p,
        other => panic!("{other:?}"),
    };
    assert!(adam(json!({}), "Adam").adam_w_mode, "type Adam defaults to decoupled weight decay");
    assert!(!adam(json!({"adam_w_mode": false}), "adam").adam_w_mode);
    assert!(adam(json!({"adam_w_mode": false}), "AdamW").adam_w_mode, "AdamW is always decoupled");
    let p = adam(json!({}), "AdamW");
    assert_eq!((p.lr, p.betas, p.eps, p.weight_decay), (1e-3, [0.9, 0.999], 1e-8, 0.0));
}

#[test]
fn aliases_and_deprecated_keys() {
    let c = Config::from_value(json!({
        "train_batch_size": 8,
        "bfloat16": {"enabled": true},
        "aio": {"thread_count": 3},
        "zero_optimization": {"stage": 3, "prefetch_bucket_size": 123, "max_live_parameters": 456,
            "stage3_gather_fp16_weights_on_model_save": true, "cpu_offload": true, "cpu_offload_param": true,
            "cpu_offload_use_pin_memory": false}
    }))
    .unwrap();
    let z = &c.zero_optimization;
    assert_eq!(c.precision(), Precision::Bf16);
    assert_eq!(c.aio.intra_op_parallelism, 3);
    assert_eq!((z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters), (123, 456));
    assert!(z.stage3_gather_16bit_weights_on_model_save);
    assert_eq!((z.offload_optimizer.device, z.offload_param.device), (OffloadDevice::Cpu, OffloadDevice::Cpu));
    assert!(!z.offload_optimizer.pin_memory && !z.offload_param.pin_memory);
    // The old boolean form of zero_optimization.
    assert_eq!(Config::from_value(json!({"train_batch_size": 8, "zero_optimization": true})).unwrap().stage(), 1);
}

#[test]
fn auto_values() {
    // HF Trainer writes "auto": batch values are inferred, bucket sizes take DeepSpeed's defaults.
    let c = Config::from_value(json!({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}
    }))
    .unwrap();
    let b = c.batch_sizes(2).unwrap();
    assert_eq!((b.train_batch_size, b.train_micro_batch_size_per_gpu, b.gradient_accumulation_steps), (8, 4, 1));
    assert_eq!(c.zero_optimization.reduce_bucket_size, 500_000_000);
    let e = Config::from_value(json!({"train_batch_size": 8, "gradient_clipping": "auto"})).unwrap_err();
    assert_eq!(e.path(), Some("gradient_clipping"));
}

#[test]
fn accepts_json_string_value_and_file() {
    let text = r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}"#;
    let a: Config = text.parse().unwrap();
    let b = Config::from_value(serde_json::from_str(text).unwrap()).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.resolve(3).unwrap().train_batch_size, Some(6));
    let missing = Config::from_file("/nonexistent/ds_config.json").unwrap_err();
    assert!(missing.to_string().starts_with("cannot read config file /nonexistent/ds_config.json"), "{missing}");
}

#[test]
fn ignored_deepspeed_sections_are_accepted() {
    let c = Config::from_value(
        json!({"train_batch_size": 8, "tensorboard": {"enabled": true}, "flops_profiler": {"enabled": false}}),
    );
    assert!(c.is_ok());
}

proptest! {
    /// The batch rule either resolves to train = micro * gas * world_size (all > 0, given values kept) or errors.
    #[test]
    fn batch_rule_resolves_consistently_or_errors(
        train in proptest::option::of(0u64..200),
        micro in proptest::option::of(0u64..40),
        gas in proptest::option::of(0u64..10),
        ws in 1u64..9,
    ) {
        let input = BatchInput { train_batch_size: train, train_micro_batch_size_per_gpu: micro, gradient_accumulation_steps: gas };
        match input.resolve(ws) {
            Ok(b) => {
                prop_assert!(b.train_batch_size > 0 && b.train_micro_batch_size_per_gpu > 0 && b.gradient_accumulation_steps > 0);
                prop_assert_eq!(b.train_batch_size, b.train_micro_batch_size_per_gpu * b.gradient_accumulation_steps * ws);
                if let Some(t) = train { prop_assert_eq!(b.train_batch_size, t); }
                if let Some(m) = micro { prop_assert_eq!(b.train_micro_batch_size_per_gpu, m); }
                if let Some(g) = gas { prop_assert_eq!(b.gradient_accumulation_steps, g); }
            }
            Err(ConfigError::BatchMissing) => prop_assert!(train.is_none() && micro.is_none()),
            Err(ConfigError::Batch { train: t, micro: m, gas: g, world_size, .. }) => {
                prop_assert_eq!(world_size, ws);
                prop_assert!(t == 0 || m == 0 || g == 0 || t != m * g * ws);
            }
            Err(other) => prop_assert!(false, "unexpected error {}", other),
        }
    }
}

/// `elasticity` (DeepSpeed's elastic batch arithmetic, as 0.18 computed it): the global batch suits the most world
/// sizes in `min_gpus..=max_gpus` and stays the same at each; batch keys beside it are refused unless
/// `ignore_non_elastic_batch_info`; a world size the batch does not suit (version 0.1) is an error naming the
/// numbers, while version 0.2 gives it a batch of its own.
#[test]
fn elasticity_keeps_the_global_batch_across_world_sizes() {
    let elastic = |extra: serde_json::Value| {
        let mut e = json!({"enabled": true, "max_train_batch_size": 96, "micro_batch_sizes": [2, 4], "min_gpus": 1,
            "max_gpus": 8, "prefer_larger_batch": true, "version": 0.1, "num_gpus_per_node": 1, "model_parallel_size": 1});
        for (k, v) in extra.as_object().unwrap() {
            e[k] = v.clone();
        }
        Config::from_value(json!({ "elasticity": e }))
    };
    let c = elastic(json!({})).unwrap();
    let sizes: Vec<_> = [1, 2, 4, 8].iter().map(|&w| c.batch_sizes(w).unwrap()).collect();
    assert!(sizes.iter().all(|b| b.train_batch_size == 96), "{sizes:?}");
    // The largest micro-batch that divides the share; accumulation takes up the rest.
    assert_eq!((sizes[3].train_micro_batch_size_per_gpu, sizes[3].gradient_accumulation_steps), (4, 3));
    let err = c.batch_sizes(5).unwrap_err().to_string();
    assert!(err.contains("`elasticity`: world size 5 is not allowed") && err.contains("global batch 96"), "{err}");
    // Version 0.2 gives a world size outside the list a batch of its own: the largest multiple of a micro-batch
    // times the ranks (9 x 2 x 5 = 90).
    let v2 = elastic(json!({"version": 0.2})).unwrap();
    assert_eq!(v2.batch_sizes(5).unwrap().train_batch_size, 90);
    // The smaller batch among equally elastic ones.
    let smaller = elastic(json!({"prefer_larger_batch": false})).unwrap();
    assert!(smaller.batch_sizes(1).unwrap().train_batch_size <= 96);
    // Batch keys beside the section: refused, or overridden when asked.
    let both = json!({"train_batch_size": 8, "elasticity": {"enabled": true, "max_train_batch_size": 96, "micro_batch_sizes": [2, 4]}});
    let err = Config::from_value(both.clone()).unwrap_err().to_string();
    assert!(
        err.contains("`train_batch_size` would not be used") && err.contains("ignore_non_elastic_batch_info"),
        "{err}"
    );
    let mut overridden = both;
    overridden["elasticity"]["ignore_non_elastic_batch_info"] = json!(true);
    assert_eq!(Config::from_value(overridden).unwrap().batch_sizes(2).unwrap().train_batch_size, 96);
    // What DeepSpeed requires or refuses.
    let missing = Config::from_value(json!({"elasticity": {"enabled": true, "micro_batch_sizes": [2]}})).unwrap_err();
    assert_eq!(missing.to_string(), "`elasticity.max_train_batch_size` is required when `elasticity.enabled` is true");
    let mp = elastic(json!({"model_parallel_size": 2})).unwrap_err().to_string();
    assert!(mp.starts_with("`elasticity.model_parallel_size`: 2 is not allowed"), "{mp}");
    let per_node = elastic(json!({"version": 0.2, "num_gpus_per_node": 2, "min_gpus": 2})).unwrap();
    assert!(per_node.batch_sizes(4).is_ok());
    // Disabled (the default), the batch keys rule as ever.
    let off = Config::from_value(json!({"train_batch_size": 8, "elasticity": {"enabled": false}})).unwrap();
    assert_eq!(off.batch_sizes(2).unwrap().train_micro_batch_size_per_gpu, 4);
}
