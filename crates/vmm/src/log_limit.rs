//! Rate limiting of the log lines a guest can cause, per VM.
//!
//! Anything a guest's behaviour makes the VMM log (bad descriptors, bad
//! MMIO accesses, vsock garbage, ...) goes through one [`LogLimiter`] per
//! VM, a token bucket: [`BURST`] lines at once, then one more per
//! [`REFILL`]. Lines past that are counted, not logged; the next line that
//! passes is preceded by one line saying how many were suppressed. So a
//! hostile guest adds at most [`BURST`] lines plus one per [`REFILL`] to
//! the host's log, however fast it misbehaves.
//!
//! Log through [`guest_warn!`](crate::guest_warn). Guest-provided text in
//! such lines must be escaped ([`escape`]) so it cannot forge log lines.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::sync::lock;

/// Lines a VM may cause at once.
pub const BURST: u32 = 10;
/// One more line is allowed per this interval (6 s: 10 lines a minute
/// sustained).
pub const REFILL: Duration = Duration::from_secs(6);

/// What to do with one line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Log it; first say that `suppressed` lines were dropped before it
    /// (when not 0).
    Log {
        /// Lines dropped since the last one logged.
        suppressed: u64,
    },
    /// Drop it (counted).
    Drop,
}

struct Bucket {
    tokens: u32,
    /// When the last token was added (or the bucket made).
    refilled: Instant,
    suppressed: u64,
}

/// A per-VM token bucket for guest-triggered log lines (see the module
/// documentation). Shared by the VM's devices and threads.
pub struct LogLimiter {
    vm: String,
    bucket: Mutex<Bucket>,
}

impl LogLimiter {
    /// A full bucket for the VM named `vm` (the name goes into every line).
    pub fn new(vm: impl Into<String>) -> Self {
        LogLimiter {
            vm: vm.into(),
            bucket: Mutex::new(Bucket { tokens: BURST, refilled: Instant::now(), suppressed: 0 }),
        }
    }

    /// The VM's name.
    pub fn vm(&self) -> &str {
        &self.vm
    }

    /// Takes a token for one line now.
    pub fn check(&self) -> Verdict {
        self.check_at(Instant::now())
    }

    /// Takes a token for one line at time `now` (not before the last call's).
    pub fn check_at(&self, now: Instant) -> Verdict {
        let mut b = lock(&self.bucket);
        let elapsed = now.saturating_duration_since(b.refilled);
        let new = (elapsed.as_nanos() / REFILL.as_nanos()).min(u128::from(BURST)) as u32;
        if new > 0 {
            b.tokens = (b.tokens + new).min(BURST);
            b.refilled = if b.tokens == BURST { now } else { b.refilled + REFILL * new };
        }
        if b.tokens == 0 {
            b.suppressed += 1;
            return Verdict::Drop;
        }
        b.tokens -= 1;
        Verdict::Log { suppressed: std::mem::take(&mut b.suppressed) }
    }

    /// Lines dropped and not yet reported.
    pub fn suppressed(&self) -> u64 {
        lock(&self.bucket).suppressed
    }
}

impl Drop for LogLimiter {
    fn drop(&mut self) {
        let n = self.bucket.get_mut().map(|b| b.suppressed).unwrap_or_else(|e| e.into_inner().suppressed);
        if n > 0 {
            tracing::warn!(vm = %self.vm, "{n} more guest-triggered warnings were suppressed (rate limit)");
        }
    }
}

impl Default for LogLimiter {
    fn default() -> Self {
        LogLimiter::new("")
    }
}

/// `text` with control characters (newlines included) and other
/// non-printing characters escaped as Rust does (`\n`, `\u{1b}`), so
/// guest-provided text stays on one log line and cannot move the cursor or
/// forge another line.
pub fn escape(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() || c == '\u{2028}' || c == '\u{2029}' {
                c.escape_debug().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Logs a warning a guest caused, through the VM's [`LogLimiter`]
/// (`$limiter`: anything that derefs to one), with a `vm` field; the first
/// line after suppressed ones says how many were dropped. Arguments as for
/// `tracing::warn!`'s message; escape guest text with [`escape`].
#[macro_export]
macro_rules! guest_warn {
    ($limiter:expr, $($arg:tt)+) => {{
        let limiter: &$crate::log_limit::LogLimiter = &$limiter;
        match limiter.check() {
            $crate::log_limit::Verdict::Log { suppressed } => {
                if suppressed > 0 {
                    tracing::warn!(vm = %limiter.vm(), "{suppressed} guest-triggered warnings were suppressed (rate limit)");
                }
                tracing::warn!(vm = %limiter.vm(), $($arg)+);
            }
            $crate::log_limit::Verdict::Drop => {}
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_one_per_refill_then_the_count() {
        let l = LogLimiter::new("t");
        let t0 = Instant::now();
        for _ in 0..BURST {
            assert_eq!(l.check_at(t0), Verdict::Log { suppressed: 0 });
        }
        for _ in 0..1000 {
            assert_eq!(l.check_at(t0), Verdict::Drop);
        }
        assert_eq!(l.suppressed(), 1000);
        // Just before a refill: still nothing.
        assert_eq!(l.check_at(t0 + REFILL - Duration::from_millis(1)), Verdict::Drop);
        // One refill: one line, carrying the count.
        assert_eq!(l.check_at(t0 + REFILL), Verdict::Log { suppressed: 1001 });
        assert_eq!(l.check_at(t0 + REFILL), Verdict::Drop);
        assert_eq!(l.check_at(t0 + REFILL * 2), Verdict::Log { suppressed: 1 });
    }

    #[test]
    fn a_quiet_guest_gets_its_burst_back_but_no_more() {
        let l = LogLimiter::new("t");
        let t0 = Instant::now();
        for _ in 0..BURST {
            l.check_at(t0);
        }
        let later = t0 + REFILL * 1000;
        for _ in 0..BURST {
            assert!(matches!(l.check_at(later), Verdict::Log { .. }));
        }
        assert_eq!(l.check_at(later), Verdict::Drop);
    }

    #[test]
    fn escape_keeps_text_on_one_line() {
        assert_eq!(escape("plain text: ok"), "plain text: ok");
        let forged = "x\n2025-01-01T00:00:00Z  WARN tine: fake\r\u{1b}[2K";
        let e = escape(forged);
        assert!(!e.contains('\n') && !e.contains('\r') && !e.contains('\u{1b}'), "{e}");
        assert_eq!(e, "x\\n2025-01-01T00:00:00Z  WARN tine: fake\\r\\u{1b}[2K");
    }
}
