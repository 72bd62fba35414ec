//! One module per subcommand; each returns a typed error that `main` renders once. None of them links libtorch:
//! `bench adam` runs in the `zerorun-torch` helper (`torch_helper.rs`, `bench_adam.rs`).
pub mod bench;
pub mod bench_async;
pub mod bench_cluster;
pub mod bench_comm;
pub mod bench_scopes;
pub mod bench_swap;
pub mod config;
pub mod consolidate;
pub mod estimate;
pub mod launch;
mod launch_nodes;
mod launch_ranks;
mod launch_slurm;
mod launch_ssh;
pub mod pipeline;
pub mod plan;
pub mod plan_validate;
pub mod progress;
pub mod report;
pub mod torch_helper;

/// An error of any subcommand, rendered once by `main`.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Config(#[from] zerorun_config::ConfigError),
    #[error("{0}")]
    Usage(String),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
}

/// Renders a command's error once, on stderr, and gives the process's exit status.
pub fn exit_code(result: Result<(), CliError>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Writes command output to stdout; a closed pipe (`zerorun ... | head`) ends the output quietly.
pub fn emit(text: &str) -> Result<(), CliError> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.write_all(b"\n")).and_then(|_| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(CliError::Io { context: "writing to stdout".into(), source: e })
        }
        _ => Ok(()),
    }
}
