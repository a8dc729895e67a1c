//! Memory pressure: what frees memory before anything is refused or the
//! kernel's OOM killer acts. Two signals, one remedy:
//!
//! - the memory budget ([`crate::memory`]) refuses a create, branch or
//!   resume from disk;
//! - the host's `MemAvailable` (`/proc/meminfo`, proc(5)) is below the
//!   watermark ([`crate::Limits::min_available_mib`]), checked before every
//!   create, branch and resume from disk and by the reaper every tick.
//!
//! What a running sandbox counts in the budget is measured: the host
//! memory it holds of its own plus a headroom
//! ([`crate::Limits::memory_headroom_mib`]), at most its guest memory,
//! updated every reaper period on a thread of its own
//! ([`Manager::measure_memory`]); a sandbox
//! restored from a template holds a few MiB of its own, so the budget
//! admits many more of them than their sizes add up to.
//!
//! A third signal, `max_sandboxes` (running ones), has the last step of
//! the same remedy: a create, branch or resume from disk at the cap
//! hibernates the least recently used idle sandbox ([`Manager::make_room`]).
//!
//! The remedy, in order: templates nothing is being made from are
//! unloaded, the warm pool gives its sandboxes back, then the least
//! recently used idle sandbox is hibernated ([`Manager::hibernate`]), one
//! at a time, until the signal is gone. A sandbox is idle when it has had
//! no call for [`crate::Limits::pressure_min_idle_secs`], nothing is in
//! flight or under way on it, and it is not a recipe's builder. When
//! nothing is left to free, the budget refuses the call, and so does the
//! watermark's floor (half the watermark: between the two a call goes on),
//! with an error that says why.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::hibernate::HibernateWhy;
use super::{Manager, Sandbox, SandboxError, SandboxState};
use crate::lock;
use crate::memory::{MemoryUse, Reservation};

/// The host's available memory (MiB), or `None` when it cannot be read.
pub(super) type Probe = Box<dyn Fn() -> Option<u64> + Send + Sync>;

/// The watermark on the host's available memory.
pub(super) struct Watermark {
    /// MiB; 0: none.
    mib: u64,
    probe: Probe,
    /// Whether the host was below the watermark at the last check (to log
    /// once per episode).
    below: AtomicBool,
}

impl Watermark {
    /// A watermark of `mib` MiB (0: none) on what `probe` reads.
    pub(super) fn new(mib: u64, probe: Probe) -> Self {
        Watermark { mib, probe, below: AtomicBool::new(false) }
    }

    /// The host's `MemAvailable`.
    pub(super) fn host_probe() -> Probe {
        Box::new(|| crate::limits::host_meminfo_mib("MemAvailable"))
    }

    /// The watermark (MiB; 0: none).
    pub(super) fn mib(&self) -> u64 {
        self.mib
    }

    /// Whether the host is below the watermark now.
    pub(super) fn is_below(&self) -> bool {
        self.below().is_some()
    }

    /// The host's available memory (MiB) when it is below the watermark.
    fn below(&self) -> Option<u64> {
        if self.mib == 0 {
            return None;
        }
        let available = (self.probe)().filter(|&a| a < self.mib);
        let was = self.below.swap(available.is_some(), Ordering::Relaxed);
        match available {
            Some(a) if !was => {
                tracing::warn!("host memory low: {a} MiB available, below the watermark of {} MiB", self.mib)
            }
            None if was => tracing::info!("host memory back above the watermark of {} MiB", self.mib),
            _ => {}
        }
        available
    }
}

impl Manager {
    /// Frees host memory for `what` while the host is below the watermark
    /// (see the module's doc), then reserves `parts` of the memory budget
    /// as [`Manager::admit`] does, hibernating idle sandboxes while the
    /// budget refuses.
    ///
    /// Errors: [`SandboxError::HostMemoryLow`] (below half the watermark
    /// with nothing left to free), [`SandboxError::OverBudget`] (nothing left to
    /// hibernate, or a hibernation failed: logged).
    pub(super) async fn admit_or_hibernate(
        &self,
        what: &'static str,
        parts: &[(MemoryUse, u64)],
    ) -> Result<Vec<Reservation>, SandboxError> {
        // Below the watermark with nothing left to hibernate, the call goes
        // on down to the floor (half the watermark), and is refused below
        // it: the watermark starts reclaim, the floor keeps the host's last
        // memory from the next guest.
        if let Some(available_mib) = self.relieve_pressure().await {
            let floor_mib = self.watermark.mib() / 2;
            if available_mib < floor_mib {
                return Err(SandboxError::HostMemoryLow { available_mib, floor_mib, what });
            }
        }
        loop {
            let over = match self.admit(what, parts) {
                Err(SandboxError::OverBudget(over)) => over,
                r => return r,
            };
            let Some(victim) = self.least_recently_used_idle() else { return Err(SandboxError::OverBudget(over)) };
            tracing::info!(sandbox = %victim.id, idle_secs = victim.idle().as_secs(),
                "{what} needs memory: hibernating the least recently used idle sandbox");
            if let Err(e) = self.hibernate_sandbox(&victim, HibernateWhy::Memory).await {
                tracing::warn!(sandbox = %victim.id, "hibernation for memory failed: {e}");
                return Err(SandboxError::OverBudget(over));
            }
        }
    }

    /// While the host is below the watermark: unloads unused templates,
    /// empties the warm pool, then hibernates the least recently used idle
    /// sandbox, one at a time. Returns the host's available memory (MiB)
    /// when it is still below with nothing left to free, `None` once it
    /// is not. The reaper calls it every tick.
    pub(super) async fn relieve_pressure(&self) -> Option<u64> {
        loop {
            let available = self.watermark.below()?;
            if self.templates.evict_unused(None) > 0 || self.release_pooled_memory() {
                continue;
            }
            let Some(victim) = self.least_recently_used_idle() else { return Some(available) };
            tracing::info!(sandbox = %victim.id, idle_secs = victim.idle().as_secs(), available_mib = available,
                "host memory below the watermark: hibernating the least recently used idle sandbox");
            if let Err(e) = self.hibernate_sandbox(&victim, HibernateWhy::Watermark).await {
                tracing::warn!(sandbox = %victim.id, "hibernation for host memory failed: {e}");
                return Some(available);
            }
        }
    }

    /// Hibernates the least recently used idle sandboxes while `n` more
    /// live ones would pass `max_sandboxes` (a create, branch or resume
    /// from disk at the cap). What it cannot make room for, the cap's own
    /// check refuses; an `n` past the cap itself is left to that check.
    pub(super) async fn make_room(&self, n: usize) {
        let max = self.config.limits.max_sandboxes;
        if n > max {
            return;
        }
        while self.live_count().saturating_add(n) > max {
            let Some(victim) = self.least_recently_used_idle() else { return };
            tracing::info!(sandbox = %victim.id, idle_secs = victim.idle().as_secs(),
                "{max} sandboxes running: hibernating the least recently used idle one");
            if let Err(e) = self.hibernate_sandbox(&victim, HibernateWhy::Cap).await {
                tracing::warn!(sandbox = %victim.id, "hibernation to make room failed: {e}");
                return;
            }
        }
    }

    /// What a sandbox restored from a template, a branch point or its own
    /// hibernation is charged until measured: the headroom plus
    /// `own_bytes` (what it brings of its own: its hibernation's pages), at
    /// most its guest memory. A restored guest shares the rest with what
    /// it was restored from; a booted one is charged its whole size.
    pub(super) fn restored_charge_mib(&self, memory_mib: u64, own_bytes: u64) -> u64 {
        own_bytes.div_ceil(1 << 20).saturating_add(self.config.limits.memory_headroom_mib).min(memory_mib)
    }

    /// Counts every running or paused sandbox (and every pooled one) in the
    /// memory budget by the host memory it holds of its own plus the
    /// headroom, at most its guest memory, plus what its network's buffers
    /// hold (`NetControl::buffered_bytes`). A sandbox whose VM is busy
    /// (being paused, hibernated, branched) keeps its count until the next
    /// tick. Blocking: one `PAGEMAP_SCAN` per sandbox.
    pub(super) fn measure_memory(&self) {
        let headroom = self.config.limits.memory_headroom_mib;
        let mut sandboxes: Vec<Arc<Sandbox>> = lock(&self.sandboxes)
            .values()
            .filter(|s| matches!(s.state(), SandboxState::Running | SandboxState::Paused))
            .cloned()
            .collect();
        sandboxes.extend(self.pooled_sandboxes());
        for sb in sandboxes {
            let own = match sb.vm.try_lock() {
                Ok(slot) => slot.vm.as_ref().and_then(|vm| vm.own_memory_bytes()),
                Err(_) => None,
            };
            let Some(own) = own else { continue };
            // Its network's buffers are host memory too, outside the guest's.
            let net = lock(&sb.net).as_ref().map_or(0, |c| c.buffered_bytes());
            let mib = own.div_ceil(1 << 20).saturating_add(headroom).min(sb.memory_mib) + net.div_ceil(1 << 20);
            if let Some(r) = lock(&sb.memory).own.as_mut() {
                r.set_mib(mib);
            }
        }
    }

    /// The running or paused sandbox unused for longest, if one has been
    /// idle [`crate::Limits::pressure_min_idle_secs`] with nothing in
    /// flight and is not a recipe's builder.
    fn least_recently_used_idle(&self) -> Option<Arc<Sandbox>> {
        let min_idle = self.config.limits.pressure_min_idle();
        lock(&self.sandboxes)
            .values()
            .filter(|s| matches!(s.state(), SandboxState::Running | SandboxState::Paused))
            .filter(|s| s.busy.load(Ordering::SeqCst) == 0 && s.idle() >= min_idle)
            .filter(|s| !s.labels().contains_key(super::recipes::BUILD_LABEL))
            .filter(|s| s.control.try_lock().is_ok())
            // The longest idle; of equals, the first in id order.
            .min_by_key(|s| std::cmp::Reverse(s.idle()))
            .cloned()
    }
}
