//! How much guest work starts at once: boots, restores and agent calls
//! each wait for a slot here. On a host of few CPUs, guests that all start
//! or all fault in their first pages at once starve each other until
//! trivial calls time out (docs/hosts.md), so the manager admits them a
//! few at a time and queues the rest.

use tokio::sync::Semaphore;

use crate::limits::Limits;

/// Restores allowed at once per boot slot ([`Limits::concurrent_boots`]).
const RESTORES_PER_BOOT_SLOT: usize = 2;

/// The manager's start and call slots.
pub(super) struct Slots {
    /// One permit per boot allowed at once ([`Limits::concurrent_boots`]).
    pub(super) boots: Semaphore,
    /// Restores (from a template or a branch point) allowed at once, until
    /// the agent answers: [`RESTORES_PER_BOOT_SLOT`] per boot slot.
    /// Restored guests all handle their device resets and reconnect at
    /// once; 32 at a time on 2 host CPUs starved each other for minutes.
    pub(super) restores: Semaphore,
    /// Agent calls starting at once, one per host CPU
    /// ([`Limits::concurrent_boots`]), each held until its call ends or for
    /// 10 s: a new guest faults in the pages its first work touches, and
    /// many guests working at once on a few CPUs time out on trivial work.
    /// A caller waits here before its call's timeout starts.
    pub(super) calls: Semaphore,
}

impl Slots {
    /// Slots for `limits`.
    pub(super) fn new(limits: &Limits) -> Slots {
        let n = limits.concurrent_boots();
        Slots {
            boots: Semaphore::new(n),
            restores: Semaphore::new(n * RESTORES_PER_BOOT_SLOT),
            calls: Semaphore::new(n),
        }
    }

    /// Closes every slot: whoever waits for one, or asks later, gets an
    /// error at once (shutdown).
    pub(super) fn close(&self) {
        self.boots.close();
        self.restores.close();
        self.calls.close();
    }
}
