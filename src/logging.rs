/// Shows zerorun's logs on stderr, as a training program (or the CLI) should install them: warnings by default
/// (ignored config keys, slow settings, skipped fp16 steps) and the run's summaries (target `zerorun::summary`:
/// the pipeline's partition, logged once by rank 0), more with `RUST_LOG`; colours only on a terminal, not
/// into the pipes of `zerorun launch`. The library itself only logs through `tracing` and never prints; call this
/// once at the start of `main`, or install your own subscriber instead.
pub fn init_logging() {
    init_logging_with_default("warn,zerorun::summary=info");
}

/// [`init_logging`] with `default` as the filter when `RUST_LOG` is unset (`"warn"`: no summaries).
pub fn init_logging_with_default(default: &str) {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into()))
        .with_target(false)
        .init();
}
