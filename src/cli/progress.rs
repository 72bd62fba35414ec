//! Progress of the commands that run for more than a few seconds, on stderr (stdout keeps the command's output):
//! a bar with an ETA on a terminal (indicatif), one plain line per item when stderr is not a terminal (logs, CI),
//! nothing with `--quiet`.
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

static QUIET: AtomicBool = AtomicBool::new(false);

/// `--quiet`: no progress at all, here and in the helper processes a command starts (`ZERORUN_QUIET=1`).
pub fn set_quiet(quiet: bool) {
    QUIET.store(quiet, Ordering::Relaxed);
    if quiet {
        // Called first thing in main, before any thread starts.
        std::env::set_var("ZERORUN_QUIET", "1");
    }
}

/// Whether `--quiet` was given (to this process or the one that started it).
pub fn quiet() -> bool {
    QUIET.load(Ordering::Relaxed) || std::env::var_os("ZERORUN_QUIET").is_some_and(|v| v == "1")
}

enum Output {
    Bar(ProgressBar),
    Lines,
    Silent,
}

/// A fixed number of items (measurements, runs, tensors) done one after another.
pub struct Progress {
    what: String,
    total: u64,
    done: u64,
    started: Instant,
    /// When the last plain line was printed: at most one every [`LINE_EVERY`], so a fast command prints one.
    last_line: Option<Instant>,
    output: Output,
}

const LINE_EVERY: Duration = Duration::from_secs(2);

impl Progress {
    /// `what` names the command (`bench comm`); `total` items follow.
    pub fn new(what: &str, total: u64) -> Progress {
        let output = if quiet() {
            Output::Silent
        } else if std::io::stderr().is_terminal() {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} (ETA {eta})")
                .expect("a valid template")
                .progress_chars("=> ");
            bar.set_style(style);
            bar.set_prefix(what.to_string());
            bar.enable_steady_tick(Duration::from_millis(200));
            Output::Bar(bar)
        } else {
            Output::Lines
        };
        Progress { what: what.to_string(), total, done: 0, started: Instant::now(), last_line: None, output }
    }

    /// The next item starts.
    pub fn item(&mut self, name: &str) {
        match &self.output {
            Output::Bar(bar) => bar.set_message(name.to_string()),
            Output::Lines => {
                if self.last_line.is_some_and(|t| t.elapsed() < LINE_EVERY) {
                    return;
                }
                self.last_line = Some(Instant::now());
                let eta = match self.done {
                    0 => String::new(),
                    done => {
                        let per_item = self.started.elapsed().as_secs_f64() / done as f64;
                        format!(", about {:.0} s left", per_item * (self.total - done) as f64)
                    }
                };
                eprintln!("{}: {}/{} {name}{eta}", self.what, self.done + 1, self.total);
            }
            Output::Silent => {}
        }
    }

    /// Runs `f` (which prints to stdout) with the bar cleared, so its lines and the bar do not mix.
    #[allow(dead_code)] // the zerorun-torch helper's benches print as they go; `zerorun`'s own print at the end
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.output {
            Output::Bar(bar) => bar.suspend(f),
            _ => f(),
        }
    }

    /// The current item is done.
    pub fn done(&mut self) {
        self.done = (self.done + 1).min(self.total);
        if let Output::Bar(bar) = &self.output {
            bar.set_position(self.done);
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Output::Bar(bar) = &self.output {
            bar.finish_and_clear();
        }
    }
}
