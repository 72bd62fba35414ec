//! A ready ds_config.json for a planned strategy.
use serde_json::{json, Value};
use zerorun_config::Precision;

use crate::{Offload, Strategy};

/// The ds_config of `s` (AdamW at lr 3e-4, to be tuned) with `nvme_path` for NVMe offload. The tensor-parallel
/// degree and activation checkpointing are the program's (the examples' `--tensor-parallel`, and
/// `--activation-checkpointing` or `EngineOptions::activation_checkpointing`), so they are not in it.
pub fn ds_config(s: &Strategy, precision: Precision, nvme_path: &str) -> Value {
    let device = |on: bool, nvme: bool| -> Value {
        match (on, nvme) {
            (false, _) => json!({"device": "none"}),
            (true, false) => json!({"device": "cpu", "pin_memory": true}),
            (true, true) => json!({"device": "nvme", "nvme_path": nvme_path}),
        }
    };
    let mut zero = json!({"stage": s.stage});
    if s.offload != Offload::None {
        zero["offload_optimizer"] = device(true, s.offload.nvme());
    }
    if s.offload.params() {
        zero["offload_param"] = device(true, s.offload.nvme());
    }
    if s.offload.nvme() {
        zero["sub_group_size"] = json!(crate::predict::NVME_SUB_GROUP_SIZE);
    }
    let mut config = json!({
        "train_batch_size": s.micro_batch * s.gradient_accumulation * s.data,
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": s.gradient_accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
    });
    match precision {
        Precision::Bf16 => config["bf16"] = json!({"enabled": true}),
        Precision::Fp16 => config["fp16"] = json!({"enabled": true}),
        Precision::Fp32 => {}
    }
    if s.pipeline > 1 {
        config["pipeline"] = json!({"stages": s.pipeline});
    }
    if s.experts > 1 {
        config["expert_parallel"] = json!({"enabled": true, "autoep_size": s.experts});
    }
    if s.sequence > 1 {
        config["sequence_parallel_size"] = json!(s.sequence);
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_configs_load_as_zerorun_configs() {
        for offload in Offload::ALL {
            let s = Strategy {
                stage: if offload.params() { 3 } else { 2 },
                offload,
                pipeline: 1,
                tensor: 1,
                sequence: 1,
                experts: 1,
                data: 4,
                micro_batch: 2,
                gradient_accumulation: 3,
                activation_checkpointing: false,
            };
            let text = ds_config(&s, Precision::Bf16, "/local_nvme").to_string();
            let c = zerorun_config::Config::from_json_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(c.stage(), s.stage);
            let b = c.batch_sizes(4).unwrap();
            assert_eq!((b.train_batch_size, b.gradient_accumulation_steps), (24, 3));
        }
        // A sequence group of 2: the key, and the batch over the 4 data-parallel ranks of 8.
        let s = Strategy {
            stage: 3,
            offload: Offload::None,
            pipeline: 1,
            tensor: 1,
            sequence: 2,
            experts: 1,
            data: 4,
            micro_batch: 2,
            gradient_accumulation: 3,
            activation_checkpointing: false,
        };
        let c = zerorun_config::Config::from_json_str(&ds_config(&s, Precision::Fp32, "").to_string()).unwrap();
        assert_eq!(c.sequence_parallel_size, 2);
        assert_eq!(c.batch_sizes(8).unwrap().gradient_accumulation_steps, 3);
    }
}
