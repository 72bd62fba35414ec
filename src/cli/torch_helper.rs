//! Commands that need libtorch run in `zerorun-torch`, a binary built beside `zerorun`: `zerorun` itself links no
//! libtorch, so `config show`, `estimate`, `launch`, `consolidate` and `bench comm|swap` start in milliseconds with
//! a few MiB of memory instead of loading libtorch's hundreds. The user still types `zerorun bench adam`.
use std::os::unix::process::CommandExt;
use std::process::Command;

use super::CliError;

/// The helper's name, next to the running `zerorun`.
pub const HELPER: &str = "zerorun-torch";

/// Replaces this process with the helper, given this command's own arguments. Returns only on failure.
pub fn run_here() -> Result<(), CliError> {
    let exe = std::env::current_exe()
        .map_err(|e| CliError::Io { context: "finding the zerorun executable".into(), source: e })?;
    let helper = exe.with_file_name(HELPER);
    if !helper.is_file() {
        return Err(CliError::Usage(format!(
            "{}: not found; this command runs libtorch in the helper binary beside zerorun (build both: `cargo build --release --bins`)",
            helper.display()
        )));
    }
    let err = Command::new(&helper).args(std::env::args_os().skip(1)).exec();
    Err(CliError::Io { context: format!("running {}", helper.display()), source: err })
}
