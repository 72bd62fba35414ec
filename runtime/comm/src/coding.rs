//! Per-thread clocks of work the step-time breakdown takes out of the phase that ran it. [`CODING`]: the arithmetic
//! of compressed collectives (packing signs, unpacking them, PowerSGD's factor products), kept apart from their wire
//! time so the breakdown can say which of the two a compressed step waits on. [`EXCHANGE`]: the model's own
//! exchanges inside forward and backward (a mixture of experts' and Ulysses' all-to-alls of rows, ring attention's
//! hops; autograd runs a CPU model's backward on the thread that called it). Per thread: the engine reads the clocks
//! of the thread that ran the step, and a phase's time is its wall time less what a clock counted inside it.
use std::cell::Cell;
use std::thread::LocalKey;
use std::time::{Duration, Instant};

thread_local! {
    static CODING_TIME: Cell<Duration> = const { Cell::new(Duration::ZERO) };
    static EXCHANGE_TIME: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

/// One per-thread clock.
pub struct Clock(&'static LocalKey<Cell<Duration>>);

/// Compressed collectives' arithmetic.
pub static CODING: Clock = Clock(&CODING_TIME);
/// The model's exchanges inside forward and backward.
pub static EXCHANGE: Clock = Clock(&EXCHANGE_TIME);

impl Clock {
    /// Runs `f` and adds its wall time to this thread's clock.
    pub fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let out = f();
        let spent = started.elapsed();
        self.0.with(|c| c.set(c.get() + spent));
        out
    }

    /// The time counted on this thread since the last call, and the clock back to zero.
    pub fn take(&self) -> Duration {
        self.0.with(|c| c.replace(Duration::ZERO))
    }
}

/// [`CODING`]`.timed(f)`.
pub fn timed<T>(f: impl FnOnce() -> T) -> T {
    CODING.timed(f)
}

/// [`CODING`]`.take()`.
pub fn take() -> Duration {
    CODING.take()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_counts_what_ran_inside_and_restarts_on_take() {
        take();
        let v = timed(|| {
            std::thread::sleep(Duration::from_millis(5));
            7
        });
        assert_eq!(v, 7);
        let first = take();
        assert!(first >= Duration::from_millis(5), "{first:?}");
        assert_eq!(take(), Duration::ZERO);
        // Another thread's clock is its own, and so is another clock.
        std::thread::spawn(|| timed(|| std::thread::sleep(Duration::from_millis(2)))).join().unwrap();
        EXCHANGE.timed(|| std::thread::sleep(Duration::from_millis(1)));
        assert_eq!(take(), Duration::ZERO);
        assert!(EXCHANGE.take() >= Duration::from_millis(1));
    }
}
