//! The bytes of request bodies one sandbox's flows may hold at once to
//! swap in them ([`BodyBudget`]).
//!
//! A body in which a placeholder may be swapped ([`crate::Binding::in_body`])
//! is read whole before it goes on (at most [`crate::swap::MAX_SWAP_BODY`]
//! each). Without a bound across requests one guest, over HTTP/2's
//! concurrent streams or many connections, could make the daemon hold any
//! number of such bodies. Every flow of a sandbox reserves what it holds
//! in that sandbox's budget; a request past it is refused (503) and
//! logged, and what is held counts in the server's memory budget (the
//! sandbox's network buffers, `netstack::control::NetControl::buffered_bytes`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A sandbox's budget by default (bytes): four bodies of the largest size
/// at once.
pub const DEFAULT_SANDBOX_BODY_BUDGET: u64 = 4 * crate::swap::MAX_SWAP_BODY as u64;

/// The bytes of bodies a sandbox's flows hold at once, at most.
#[derive(Debug)]
pub struct BodyBudget {
    limit: u64,
    held: AtomicU64,
}

impl BodyBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(BodyBudget { limit, held: AtomicU64::new(0) })
    }

    /// Its limit (bytes).
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The bytes held now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// An empty reservation, grown by [`Held::grow`] as a body is read.
    pub fn reserve(self: &Arc<Self>) -> Held {
        Held { budget: self.clone(), bytes: 0 }
    }
}

/// Bytes reserved in a [`BodyBudget`], given back when dropped.
#[derive(Debug)]
pub struct Held {
    budget: Arc<BodyBudget>,
    bytes: u64,
}

impl Held {
    /// Reserves `n` bytes more; `false` (and nothing reserved) when the
    /// budget has not that many left.
    pub fn grow(&mut self, n: u64) -> bool {
        let b = &self.budget;
        let got = b.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            held.checked_add(n).filter(|&total| total <= b.limit)
        });
        if got.is_ok() {
            self.bytes += n;
        }
        got.is_ok()
    }

    /// The bytes this reservation holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_share_the_limit_and_give_back_when_dropped() {
        let budget = BodyBudget::new(100);
        let mut a = budget.reserve();
        assert!(a.grow(60));
        let mut b = budget.reserve();
        assert!(!b.grow(41), "past the limit");
        assert_eq!((b.bytes(), budget.held()), (0, 60), "a refused grow reserves nothing");
        assert!(b.grow(40));
        assert_eq!(budget.held(), 100);
        assert!(!a.grow(1));
        drop(a);
        assert_eq!(budget.held(), 40);
        assert!(b.grow(60));
        drop(b);
        assert_eq!(budget.held(), 0);
        assert!(!budget.reserve().grow(u64::MAX), "no overflow");
    }
}
