//! Token buckets for the rates a sandbox may start things at: new TCP
//! connections and UDP flows ([`crate::stack::StackConfig::connection_rate`])
//! and DNS queries to the resolver
//! ([`crate::stack::StackConfig::dns_rate`]).
//!
//! A bucket holds at most [`RateLimit::burst`] tokens and gains
//! [`RateLimit::per_second`] a second; each new thing takes one, and
//! finds none when the guest starts things faster than the rate for
//! longer than the burst lasts. The arithmetic is in integer thousandths
//! of a token, so nothing here can overflow, round to a free token or
//! panic, whatever the clock does.
//!
//! A [`Limiter`] also says which refusals to log: the first of each second
//! (the network log is a bounded ring, and a guest flooding it would push
//! out the records worth reading); the others are only counted.

use std::time::{Duration, Instant};

/// The rule of a log record for something refused by a rate limit.
pub const RULE_LIMIT_RATE: &str = "limit:rate";

/// A rate: `per_second` a second on average, `burst` at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimit {
    /// Tokens gained a second (0: none after the burst).
    pub per_second: u32,
    /// Tokens held at most (and at the start); at least 1 is used.
    pub burst: u32,
}

/// Thousandths of a token in a token.
const MILLI: u64 = 1000;

/// How often a refusal is logged at most, per limiter.
pub const LOG_EVERY: Duration = Duration::from_secs(1);

/// A token bucket; `None` limit: every take succeeds.
#[derive(Debug)]
pub struct Bucket {
    limit: Option<RateLimit>,
    /// Thousandths of a token held now.
    milli: u64,
    /// When `milli` was last brought up to date.
    at: Instant,
}

impl Bucket {
    /// A full bucket for `limit` at `now`.
    pub fn new(limit: Option<RateLimit>, now: Instant) -> Self {
        let milli = limit.map_or(0, Self::cap);
        Self { limit, milli, at: now }
    }

    fn cap(limit: RateLimit) -> u64 {
        u64::from(limit.burst.max(1)) * MILLI
    }

    /// Takes one token at `now`; `false`: none left. A `now` before the
    /// last one adds nothing.
    pub fn take(&mut self, now: Instant) -> bool {
        let Some(limit) = self.limit else {
            return true;
        };
        let elapsed = now.saturating_duration_since(self.at);
        // Thousandths gained: µs × per_second / 1000 (in u128: no overflow).
        let gained = elapsed.as_micros().saturating_mul(u128::from(limit.per_second)) / 1000;
        let gained = u64::try_from(gained).unwrap_or(u64::MAX);
        if gained > 0 {
            self.milli = self.milli.saturating_add(gained).min(Self::cap(limit));
            self.at = now;
        }
        if self.milli >= MILLI {
            self.milli -= MILLI;
            true
        } else {
            false
        }
    }
}

/// What [`Limiter::take`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// Within the rate.
    Allowed,
    /// Over it; `log`: the first refusal this [`LOG_EVERY`], to be logged.
    Refused {
        /// Whether this refusal gets a log record.
        log: bool,
    },
}

/// A bucket with its refusals counted and their logging thinned.
#[derive(Debug)]
pub struct Limiter {
    bucket: Bucket,
    last_logged: Option<Instant>,
    refused: u64,
}

impl Limiter {
    /// A full limiter for `limit` (`None`: unlimited) at `now`.
    pub fn new(limit: Option<RateLimit>, now: Instant) -> Self {
        Self { bucket: Bucket::new(limit, now), last_logged: None, refused: 0 }
    }

    /// One more thing at `now`.
    pub fn take(&mut self, now: Instant) -> Take {
        if self.bucket.take(now) {
            return Take::Allowed;
        }
        self.refused = self.refused.saturating_add(1);
        let log = self.last_logged.is_none_or(|t| now.saturating_duration_since(t) >= LOG_EVERY);
        if log {
            self.last_logged = Some(now);
        }
        Take::Refused { log }
    }

    /// Refusals so far.
    pub fn refused(&self) -> u64 {
        self.refused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_gives_its_burst_then_its_rate() {
        let t0 = Instant::now();
        let mut b = Bucket::new(Some(RateLimit { per_second: 10, burst: 3 }), t0);
        assert!((0..3).all(|_| b.take(t0)));
        assert!(!b.take(t0));
        // 100 ms is one token at 10/s; 99 ms is not.
        assert!(!b.take(t0 + Duration::from_millis(99)));
        assert!(b.take(t0 + Duration::from_millis(100)));
        assert!(!b.take(t0 + Duration::from_millis(100)));
        // A long pause refills to the burst, not beyond.
        let later = t0 + Duration::from_secs(3600);
        assert!((0..3).all(|_| b.take(later)));
        assert!(!b.take(later));
        // A clock going back adds nothing and does not panic.
        assert!(!b.take(t0));
    }

    #[test]
    fn fractions_add_up_and_extremes_do_not_overflow() {
        let t0 = Instant::now();
        // 3 a second: a token every 333.3 ms, the thousandths kept.
        let mut b = Bucket::new(Some(RateLimit { per_second: 3, burst: 5 }), t0);
        assert!((0..5).all(|_| b.take(t0)));
        let mut got = 0;
        for ms in 1..=3000 {
            if b.take(t0 + Duration::from_millis(ms)) {
                got += 1;
            }
        }
        assert_eq!(got, 9);
        let mut b = Bucket::new(Some(RateLimit { per_second: u32::MAX, burst: u32::MAX }), t0);
        assert!(b.take(t0 + Duration::from_secs(u64::from(u32::MAX))));
        // No rate after the burst; a burst of 0 counts as 1.
        let mut b = Bucket::new(Some(RateLimit { per_second: 0, burst: 0 }), t0);
        assert!(b.take(t0));
        assert!(!b.take(t0 + Duration::from_secs(1000)));
        let mut b = Bucket::new(None, t0);
        assert!((0..10_000).all(|_| b.take(t0)));
    }

    #[test]
    fn a_limiter_logs_one_refusal_a_second_and_counts_all() {
        let t0 = Instant::now();
        let mut l = Limiter::new(Some(RateLimit { per_second: 0, burst: 1 }), t0);
        assert_eq!(l.take(t0), Take::Allowed);
        assert_eq!(l.take(t0), Take::Refused { log: true });
        assert_eq!(l.take(t0 + Duration::from_millis(500)), Take::Refused { log: false });
        assert_eq!(l.take(t0 + Duration::from_millis(1000)), Take::Refused { log: true });
        assert_eq!(l.refused(), 3);
    }
}
