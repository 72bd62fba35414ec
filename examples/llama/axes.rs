//! The sequence- and expert-parallel degrees: the flags and the ds_config keys that may both say them, agreed and
//! checked against the model.
use super::support::llama_model::LlamaConfig;
use super::Args;

/// A degree a flag and a ds_config key may both give: the flag where the key is 1 (its default), the key where
/// the flag is absent; both given must agree.
fn agreed(flag: Option<u64>, key: u64, flag_name: &str, key_name: &str) -> Result<u64, String> {
    match (flag, key) {
        (Some(flag), 1) => Ok(flag),
        (Some(flag), key) if flag != key => {
            Err(format!("{flag_name} {flag} and ds_config's {key_name} {key} disagree"))
        }
        (_, key) => Ok(key),
    }
}

/// The sequence-parallel degree: `--sequence-parallel` and ds_config's `sequence_parallel_size` (either, or both
/// agreeing), written into the config the engine reads. Checked against the model's heads and the other flags.
/// Returns (S, ring attention): ring when asked, or when the heads do not divide over S (Ulysses needs them to).
pub(super) fn sequence_parallel(
    args: &Args,
    config: &mut zerorun::Config,
    c: &LlamaConfig,
) -> Result<(u64, bool), String> {
    let s =
        agreed(args.sequence_parallel, config.sequence_parallel_size, "--sequence-parallel", "sequence_parallel_size")?;
    if s <= 1 {
        if args.ring_attention {
            return Err("--ring-attention: needs --sequence-parallel S (or sequence_parallel_size) above 1".into());
        }
        return Ok((1, false));
    }
    let ring = args.ring_attention || c.num_attention_heads % s as i64 != 0;
    if ring && !args.ring_attention {
        tracing::info!(
            heads = c.num_attention_heads,
            ranks = s,
            "the heads do not divide over the sequence-parallel ranks: ring attention rather than Ulysses"
        );
    }
    let parts = if ring { 2 * s } else { s };
    if args.seq_len % parts as i64 != 0 && args.data.is_none() {
        return Err(format!("--sequence-parallel {s}: --seq-len {} does not split into {parts} parts", args.seq_len));
    }
    if c.experts().is_some() || args.pipeline_stages.is_some() || args.tensor_parallel.is_some() {
        return Err(format!(
            "--sequence-parallel {s}: not with experts, --pipeline-stages or --tensor-parallel in this example yet"
        ));
    }
    config.sequence_parallel_size = s;
    Ok((s, ring))
}

/// The expert-parallel degree: `--expert-parallel` and ds_config's `expert_parallel` block (either, or both
/// agreeing), written into the config the engine checks. It must divide every sparse layer's experts.
pub(super) fn expert_parallel(args: &Args, config: &mut zerorun::Config, c: &LlamaConfig) -> Result<u64, String> {
    let e = agreed(
        args.expert_parallel,
        config.expert_parallel.size(),
        "--expert-parallel",
        "expert_parallel.autoep_size",
    )?;
    if let Some(preset) = &config.expert_parallel.preset_model {
        if *preset != c.model_type {
            return Err(format!(
                "ds_config's expert_parallel.preset_model {preset:?} is not the model's model_type {:?}",
                c.model_type
            ));
        }
    }
    if e == 0 {
        return Err("--expert-parallel 0: at least 1 rank per group".into());
    }
    if e == 1 {
        return Ok(1);
    }
    let Some(experts) = c.experts() else {
        return Err(format!("--expert-parallel {e}: the model has no experts (model_type {:?})", c.model_type));
    };
    if experts % e as i64 != 0 {
        return Err(format!("--expert-parallel {e}: the {experts} experts of a layer do not split over {e} ranks"));
    }
    config.expert_parallel.enabled = true;
    config.expert_parallel.autoep_size = e;
    Ok(e)
}
