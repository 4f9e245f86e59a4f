//! The calling thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`): what a bench's own thread spent
//! running, in user and kernel mode (its syscalls included), and nothing of other threads or
//! processes — a redis-server on the other core, or criterion's own threads, never count.
//!
//! Nanosecond resolution (the scheduler's run-time accounting), unlike `/proc`'s 10 ms ticks
//! (`flashsale_engine::app::cpu`), so a few seconds of requests give a per-request figure to
//! well under 1%. Each reading is one syscall (the vDSO does not serve CPU clocks): read it
//! around a batch, never around a single request.
//!
//! Not here: wall time (criterion), other processes' CPU (`flashsale_engine::app::cpu`).

use std::time::Duration;

use rustix::time::{clock_gettime, ClockId};

/// This thread's CPU time so far.
pub fn thread_cpu() -> Duration {
    let t = clock_gettime(ClockId::ThreadCPUTime);
    // Both fields are non-negative for a CPU clock (time since the thread started).
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// `f`'s result and the CPU time this thread spent in it.
pub fn on_thread_cpu<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let start = thread_cpu();
    let value = f();
    (value, thread_cpu().saturating_sub(start))
}
