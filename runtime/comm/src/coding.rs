//! A clock for the arithmetic of compressed collectives (packing signs, unpacking them, PowerSGD's factor
//! products), kept apart from their wire time so the step-time breakdown can say which of the two a compressed
//! step waits on. Per thread: the engine reads the clock of the thread that ran the step, and a phase's time is
//! its wall time less what this clock counted inside it.
use std::cell::Cell;
use std::time::{Duration, Instant};

thread_local! {
    static CODING: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

/// Runs `f` and adds its wall time to this thread's coding clock.
pub fn timed<T>(f: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let out = f();
    let spent = started.elapsed();
    CODING.with(|c| c.set(c.get() + spent));
    out
}

/// The coding time counted on this thread since the last call, and the clock back to zero.
pub fn take() -> Duration {
    CODING.with(|c| c.replace(Duration::ZERO))
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
        // Another thread's clock is its own.
        std::thread::spawn(|| timed(|| std::thread::sleep(Duration::from_millis(2)))).join().unwrap();
        assert_eq!(take(), Duration::ZERO);
    }
}
