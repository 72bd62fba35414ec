//! `zerorun config show CONFIG.json [--world-size N] [--json]`: the fully resolved config.
//! `zerorun config keys [--markdown|--json]`: every key zerorun reads, generated from the reader itself.
use std::path::PathBuf;

use clap::Subcommand;
use zerorun_config::Config;

use super::{emit, CliError};

#[derive(Subcommand)]
pub enum ConfigCommand {
    /// Print the fully resolved config: every default filled in, batch values inferred.
    Show {
        /// A DeepSpeed-style ds_config.json.
        config: PathBuf,
        /// Data-parallel ranks for the batch rule (default: $WORLD_SIZE, else 1).
        #[arg(long)]
        world_size: Option<usize>,
        /// Print JSON only (it reads back as the same config).
        #[arg(long)]
        json: bool,
    },
    /// Every ds_config key zerorun reads: JSON path, type, default, what it does here, where DeepSpeed differs,
    /// and whether it is acted on, noticed or refused.
    Keys {
        /// The guide's configuration reference page (a Markdown table).
        #[arg(long, conflicts_with = "json")]
        markdown: bool,
        /// A JSON array of objects (path, type, default, status, what, deepspeed).
        #[arg(long)]
        json: bool,
    },
}

pub fn run(command: ConfigCommand) -> Result<(), CliError> {
    match command {
        ConfigCommand::Keys { markdown, json } => {
            if markdown {
                return emit(zerorun_config::keys::markdown().trim_end());
            }
            let keys = zerorun_config::keys::reference();
            if json {
                return emit(&serde_json::to_string_pretty(&keys).expect("JSON value prints"));
            }
            let mut text = String::new();
            for k in keys {
                let default = k.default.map_or("-".to_string(), |v| v.to_string());
                text.push_str(&format!(
                    "{} ({}; default {default}; {})\n    {}\n",
                    k.path,
                    k.kind,
                    k.status.as_str(),
                    k.what
                ));
                if !k.deepspeed.is_empty() {
                    text.push_str(&format!("    DeepSpeed: {}\n", k.deepspeed));
                }
            }
            emit(text.trim_end())
        }
        ConfigCommand::Show { config, world_size, json } => {
            let world_size = match world_size {
                Some(n) => n,
                None => match std::env::var("WORLD_SIZE") {
                    Ok(v) => v.parse().map_err(|_| CliError::Usage(format!("WORLD_SIZE={v:?} is not a number")))?,
                    Err(_) => 1,
                },
            };
            if world_size == 0 {
                return Err(CliError::Usage("--world-size must be >= 1".into()));
            }
            let resolved = Config::from_file(&config)?.resolve(world_size)?;
            let text = serde_json::to_string_pretty(&resolved.to_value()).expect("JSON value prints");
            if json {
                emit(&text)
            } else {
                let precision = format!("{:?}", resolved.precision()).to_lowercase();
                emit(&format!(
                    "# {} resolved for world size {world_size}: stage {}, {precision}\n{text}",
                    config.display(),
                    resolved.stage()
                ))
            }
        }
    }
}
