//! A started VM's control: [`RunningVm`] pauses and resumes its vCPUs,
//! runs work on parked vCPUs (save or load their state), stops it, waits
//! for its end and turns that end into a [`VmOutcome`] or a guest error; and
//! [`ExitWatcher`] waits for the end from another thread.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_ioctls::VmFd;
use vmm_sys_util::signal::Killable;

use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::ConsoleTail;
use crate::event_loop::EventLoop;
use crate::memory::GuestRam;
use crate::memory::MemoryError;
use crate::snapshot::CpuidLeaf;
use crate::snapshot::SnapshotError;
use crate::sync::{lock, wait_timeout};
use crate::vcpu::{kick_signal, GuestStop, PauseState, VcpuShared, VcpuWork};
use crate::vcpu_state::{VcpuState, VcpuStateError};
use crate::vm::outcome::outcome_of;
use crate::vm::{GuestError, VmOutcome};

/// How long stopping waits for the vCPU threads before it reports them
/// and kicks them again.
const VCPU_STOP_WAIT: Duration = Duration::from_secs(1);

/// A virtio-mmio device as the vCPUs see it: (base GPA, window size,
/// transport).
pub(crate) type MmioSlot = (u64, u64, Arc<Mutex<MmioTransport>>);

/// Errors of controlling a running VM: pause, vCPU and VM state, snapshot,
/// branch.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The vCPUs did not all leave `KVM_RUN` in time for a pause.
    #[error("the vCPUs did not stop within {0:?} for a pause")]
    PauseTimeout(Duration),
    /// The VM has stopped.
    #[error("the VM has stopped")]
    Stopped,
    /// The operation needs a paused VM.
    #[error("the VM must be paused first")]
    NotPaused,
    /// Saving or restoring a vCPU failed.
    #[error(transparent)]
    VcpuState(#[from] VcpuStateError),
    /// Saving or restoring the VM-wide state failed.
    #[error(transparent)]
    VmState(#[from] crate::vm_state::VmStateError),
    /// Guest memory set-up failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A snapshot could not be written, read, or does not fit this host.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// An argument does not fit the VM (e.g. a vCPU state count).
    #[error("invalid VM configuration: {0}")]
    Config(String),
    /// A disk could not be checkpointed (flushed and its top frozen) at a
    /// capture: a full host disk, an I/O error.
    #[error("disk {index}: {source}")]
    Disk {
        /// The disk's index in the configuration.
        index: usize,
        /// Why.
        source: tine_storage::DiskError,
    },
    /// A disk could not be put in or taken out of a device slot
    /// ([`RunningVm::insert_disk`]).
    #[error("disk slot {index}: {source}")]
    Slot {
        /// The disk's index in the configuration.
        index: usize,
        /// Why.
        source: crate::devices::virtio::block::BlockError,
    },
}

/// Waits for a VM's end from any thread (see [`RunningVm::exit_watcher`]).
#[derive(Clone)]
pub struct ExitWatcher(Arc<VcpuShared>);

impl ExitWatcher {
    /// Blocks until the VM stops (guest power-off, reset, fault, or a
    /// stop request), or until `timeout` passes; true if it stopped.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        self.0.wait_stopped(timeout.map(|t| Instant::now() + t))
    }

    /// Whether the VM has stopped.
    pub fn is_stopped(&self) -> bool {
        self.0.stop.load(Ordering::SeqCst)
    }
}

/// A started VM. Dropping it stops it.
pub struct RunningVm {
    pub(crate) vm: VmFd,
    /// Guest RAM: registered with KVM, read for snapshots and branch points.
    pub(crate) ram: GuestRam,
    pub(crate) shared: Arc<VcpuShared>,
    pub(crate) threads: Vec<JoinHandle<()>>,
    pub(crate) console_tail: ConsoleTail,
    pub(crate) started: Instant,
    /// The CPUID each vCPU was given (kept for snapshots).
    pub(crate) cpuid: Vec<Vec<CpuidLeaf>>,
    /// The VM's name (logs, thread and memfd names).
    pub(crate) name: String,
    // Declared after the vCPU threads' owner: dropped once they are joined
    // (RunningVm's Drop joins them first).
    pub(crate) _event_loop: EventLoop,
    /// The net thread's loop (virtio-net only), when the VM has a network.
    pub(crate) _net_loop: Option<EventLoop>,
}

impl RunningVm {
    /// Each disk of the VM now, in order: its size (bytes) and its files
    /// (each layer of a chain, the image of a raw disk; bottom first).
    /// Locks each transport briefly.
    pub fn disks(&self) -> Vec<(u64, tine_storage::ChainSpec)> {
        let mut out = Vec::new();
        for (_, _, t) in &self.shared.mmio {
            if let Some(d) = crate::sync::lock(t).disk() {
                out.push((d.size(), d.spec()));
            }
        }
        out
    }

    /// Puts the frozen chain `new` under disk `index`'s top (the order of
    /// [`RunningVm::disks`]) in place of `old`, if that disk still has
    /// exactly `old` below its top ([`tine_storage::Disk::replace_lower`]:
    /// `new` reads as `old`, so the guest sees no change). Locks the disk's
    /// transport for the swap, so a capture never sees half of it. `false`:
    /// no such disk, or its layers changed since `old` was read.
    ///
    /// Errors: [`ControlError::Disk`].
    pub fn replace_disk_lower(
        &self,
        index: usize,
        old: &tine_storage::ChainSpec,
        new: &tine_storage::ChainSpec,
    ) -> Result<bool, ControlError> {
        let mut seen = 0;
        for (_, _, t) in &self.shared.mmio {
            let mut t = crate::sync::lock(t);
            let Some(d) = t.disk() else { continue };
            if seen == index {
                return d.replace_lower(old, new).map_err(|source| ControlError::Disk { index, source });
            }
            seen += 1;
        }
        Ok(false)
    }

    /// Opens `image` and puts it in the device slot that is disk `index`
    /// (the order of [`RunningVm::disks`], a [`crate::DiskConfig::slot`]),
    /// in place of what it held ([`DiskImage::Empty`] takes the disk out),
    /// and tells the guest (a configuration change interrupt: Linux's
    /// virtio-blk driver then reads the new capacity, asynchronously).
    /// Returns the files of the disk taken out, flushed (a chain's top
    /// included: nothing writes it any more). The guest must not be using
    /// the old disk (unmounted): its requests in flight finish on it, the
    /// next ones go to the new disk.
    ///
    /// Errors: [`ControlError::Slot`] (no such disk, not a slot, the image
    /// cannot be opened, the old disk's flush failed: nothing changed).
    pub fn insert_disk(&self, index: usize, image: &crate::DiskImage) -> Result<tine_storage::ChainSpec, ControlError> {
        use crate::devices::virtio::block::{Block, BlockError};
        let disk = Block::open_disk(image).map_err(|source| ControlError::Slot { index, source })?;
        let mut seen = 0;
        for (_, _, t) in &self.shared.mmio {
            let mut t = crate::sync::lock(t);
            if t.disk().is_none() {
                continue;
            }
            if seen == index {
                let old = t.swap_disk(disk, &image.path()).map_err(|source| ControlError::Slot { index, source })?;
                return Ok(old.spec());
            }
            seen += 1;
        }
        Err(ControlError::Slot { index, source: BlockError::NotASlot })
    }

    /// The console's last bytes (shared; grows as the guest writes).
    pub fn console(&self) -> &ConsoleTail {
        &self.console_tail
    }

    /// When the VM's build began ([`crate::vm::build_for_boot`] or
    /// [`crate::vm::build_from_snapshot`]).
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Where each vCPU's RIP was when it stopped (`None` while running or
    /// if its registers could not be read), by vCPU index. Filled once the
    /// VM has ended; for a VM stopped by timeout it says where the guest was.
    pub fn final_rips(&self) -> Vec<Option<u64>> {
        lock(&self.shared.final_rips).clone()
    }

    /// Whether the VM has stopped (a vCPU recorded an outcome).
    pub fn is_stopped(&self) -> bool {
        self.shared.stop.load(Ordering::SeqCst)
    }

    /// A handle that waits for the VM to stop without borrowing it, so
    /// one thread can watch for the guest's end while another owns the VM.
    pub fn exit_watcher(&self) -> ExitWatcher {
        ExitWatcher(self.shared.clone())
    }

    /// CPU time the vCPU threads have used so far (user + system), read
    /// from each thread's CPU-time clock (`pthread_getcpuclockid(3)`).
    /// Threads that have ended count nothing.
    pub fn vcpu_cpu_time(&self) -> Duration {
        use std::os::unix::thread::JoinHandleExt;
        let mut total = Duration::ZERO;
        for t in self.threads.iter().filter(|t| !t.is_finished()) {
            let mut clock: libc::clockid_t = 0;
            // SAFETY: the pthread_t comes from a JoinHandle we hold and have
            // not joined, so the thread's id is valid; `clock` is a valid
            // out pointer.
            if unsafe { libc::pthread_getcpuclockid(t.as_pthread_t(), &mut clock) } != 0 {
                continue;
            }
            let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
            // SAFETY: `clock` was just returned for a live thread; `ts` is
            // a valid out pointer.
            if unsafe { libc::clock_gettime(clock, &mut ts) } == 0 {
                total += Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32);
            }
        }
        total
    }

    /// Host memory (bytes) that backs guest RAM right now: the resident
    /// pages of its mappings (`Rss` in `/proc/self/smaps`), not the
    /// configured size. For a VM restored copy-on-write this counts the
    /// template's page-cache pages it shares with others; see
    /// [`RunningVm::memory_usage`] for the proportional and private shares.
    pub fn resident_memory_bytes(&self) -> u64 {
        self.memory_usage().map(|u| u.rss_bytes).unwrap_or(0)
    }

    /// The pages of guest RAM this VM has touched so far, read and
    /// written (see [`crate::working_set`]): recorded from a VM restored
    /// from a snapshot, the working set to prefetch into the next ones
    /// ([`crate::VmConfig::prefetch`]).
    ///
    /// Errors: reading `/proc/self/pagemap`.
    pub fn working_set(&self) -> std::io::Result<crate::WorkingSet> {
        self.ram.working_set()
    }

    /// Resident, proportional (PSS) and private bytes of guest RAM's
    /// mappings, from `/proc/self/smaps` (kernel doc
    /// `Documentation/filesystems/proc.rst`).
    ///
    /// Errors: reading `/proc/self/smaps`.
    pub fn memory_usage(&self) -> std::io::Result<crate::memory::MemoryUsage> {
        self.ram.memory_usage()
    }

    /// Pauses the guest: every vCPU leaves `KVM_RUN` and parks until
    /// [`RunningVm::resume`]. Returns how long it took. Devices keep
    /// serving the host side (a paused guest simply does not run); the
    /// guest's clock goes on, so it sees the pause as lost time.
    ///
    /// Errors: [`ControlError::Stopped`] if the VM has ended,
    /// [`ControlError::PauseTimeout`] if a vCPU did not park within `timeout`
    /// (the pause is then withdrawn).
    pub fn pause(&self, timeout: Duration) -> Result<Duration, ControlError> {
        let start = Instant::now();
        let deadline = start + timeout;
        lock(&self.shared.pause).requested = true;
        // One kick per vCPU is enough: `immediate_exit` makes a vCPU about to
        // enter `KVM_RUN` return at once (see `crate::vcpu`). Still, a signal
        // can fail to be queued (`EAGAIN` at `RLIMIT_SIGPENDING`), so a slow
        // pause kicks again every `KICK_AGAIN`; a parked vCPU that gets a
        // second kick leaves its next `KVM_RUN` at once and runs on.
        const KICK_AGAIN: Duration = Duration::from_millis(100);
        self.kick_all();
        let mut next_kick = start + KICK_AGAIN;
        let mut p = lock(&self.shared.pause);
        loop {
            if self.is_stopped() {
                drop(p);
                self.resume();
                return Err(ControlError::Stopped);
            }
            if p.parked + p.exited >= self.threads.len() {
                return Ok(start.elapsed());
            }
            let now = Instant::now();
            if now >= deadline {
                drop(p);
                self.resume();
                return Err(ControlError::PauseTimeout(timeout));
            }
            if now >= next_kick {
                drop(p);
                self.kick_all();
                next_kick = now + KICK_AGAIN;
                p = lock(&self.shared.pause);
                continue;
            }
            // Parking vCPUs, exiting vCPUs and `VcpuShared::finish` all
            // notify `pause_changed` while holding `pause`.
            p = wait_timeout(&self.shared.pause_changed, p, deadline.min(next_kick) - now);
        }
    }

    /// Sends the kick signal to every vCPU thread that is still running.
    fn kick_all(&self) {
        for t in self.threads.iter().filter(|t| !t.is_finished()) {
            let _ = t.kill(kick_signal());
        }
    }

    /// Has every parked vCPU do `work(index)` on its own thread and
    /// returns the answers by vCPU index.
    fn on_parked_vcpus(&self, work: impl Fn(usize) -> VcpuWork) -> Result<Vec<Option<VcpuState>>, ControlError> {
        const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
        let n = self.threads.len();
        let mut p = self.paused_state()?;
        for i in 0..n {
            p.done[i] = None;
            p.work[i] = Some(work(i));
        }
        self.shared.pause_changed.notify_all();
        let deadline = Instant::now() + ANSWER_TIMEOUT;
        while p.done.iter().any(Option::is_none) {
            let now = Instant::now();
            if now >= deadline || self.is_stopped() {
                let missing = p.done.iter().position(Option::is_none).unwrap_or(0);
                p.work.iter_mut().for_each(|w| *w = None);
                return Err(VcpuStateError::NoAnswer(missing as u8).into());
            }
            p = wait_timeout(&self.shared.pause_changed, p, deadline - now);
        }
        p.done.iter_mut().map(|d| d.take().unwrap_or(Ok(None)).map_err(ControlError::from)).collect()
    }

    /// Saves every vCPU's state (the VM must be paused), by vCPU index.
    ///
    /// Errors: [`ControlError::NotPaused`], [`ControlError::VcpuState`].
    pub fn save_vcpu_states(&self) -> Result<Vec<VcpuState>, ControlError> {
        let answers = self.on_parked_vcpus(|_| VcpuWork::Save)?;
        answers.into_iter().enumerate().map(|(i, a)| a.ok_or(VcpuStateError::NoAnswer(i as u8).into())).collect()
    }

    /// Loads `states` (one per vCPU, by index) into the paused vCPUs.
    ///
    /// Errors: [`ControlError::NotPaused`], [`ControlError::VcpuState`],
    /// [`ControlError::Config`] if the count differs from the vCPU count.
    pub fn restore_vcpu_states(&self, states: &[Arc<VcpuState>]) -> Result<(), ControlError> {
        if states.len() != self.threads.len() {
            return Err(ControlError::Config(format!("{} vCPU states for {} vCPUs", states.len(), self.threads.len())));
        }
        self.on_parked_vcpus(|i| VcpuWork::Restore(states[i].clone()))?;
        Ok(())
    }

    /// The pause state, locked, if every vCPU is parked (none has ended).
    fn paused_state(&self) -> Result<std::sync::MutexGuard<'_, PauseState>, ControlError> {
        let p = lock(&self.shared.pause);
        if !p.requested || p.parked < self.threads.len() || self.threads.iter().any(|t| t.is_finished()) {
            return Err(ControlError::NotPaused);
        }
        Ok(p)
    }

    pub(crate) fn require_paused(&self) -> Result<(), ControlError> {
        self.paused_state().map(drop)
    }

    /// Saves the VM-wide state: interrupt controllers, PIT, clock (the VM
    /// must be paused).
    ///
    /// Errors: [`ControlError::NotPaused`], [`ControlError::VmState`].
    pub fn save_vm_state(&self) -> Result<crate::vm_state::VmState, ControlError> {
        self.require_paused()?;
        Ok(crate::vm_state::save(&self.vm)?)
    }

    /// Loads VM-wide state into the paused VM.
    ///
    /// Errors: [`ControlError::NotPaused`], [`ControlError::VmState`].
    pub fn restore_vm_state(&self, state: &crate::vm_state::VmState) -> Result<(), ControlError> {
        self.require_paused()?;
        Ok(crate::vm_state::restore(&self.vm, state)?)
    }

    /// Guest RAM. For tests and benchmarks: writing to memory the guest
    /// uses corrupts it.
    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    /// Lets paused vCPUs run again (nothing happens if none is paused).
    pub fn resume(&self) {
        let mut p = lock(&self.shared.pause);
        p.requested = false;
        self.shared.pause_changed.notify_all();
    }

    /// Whether a pause is in force.
    pub fn is_paused(&self) -> bool {
        lock(&self.shared.pause).requested
    }

    /// Kicks every vCPU out of `KVM_RUN` (the stop flag is set already),
    /// waits for their run loops to end (a run loop that panicked counts as
    /// ended: `vcpu::KvmRunGuard`) and joins their threads. A vCPU that has
    /// not ended after [`VCPU_STOP_WAIT`] (a device call that blocks, or a
    /// kick that could not be queued) is reported and kicked again.
    fn kick_and_join(&mut self) {
        self.kick_all();
        let mut deadline = Instant::now() + VCPU_STOP_WAIT;
        let mut p = lock(&self.shared.pause);
        while p.exited < self.threads.len() {
            let now = Instant::now();
            if now >= deadline {
                tracing::warn!(name = %self.name, "{} of {} vCPU threads have not stopped within {:?}; kicking them again",
                    self.threads.len() - p.exited, self.threads.len(), VCPU_STOP_WAIT);
                drop(p);
                self.kick_all();
                deadline = Instant::now() + VCPU_STOP_WAIT;
                p = lock(&self.shared.pause);
                continue;
            }
            p = wait_timeout(&self.shared.pause_changed, p, deadline - now);
        }
        drop(p);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    fn outcome(&mut self) -> Result<VmOutcome, GuestError> {
        self.kick_and_join();
        let why = lock(&self.shared.outcome).take();
        outcome_of(why, &self.console_tail)
    }

    /// Waits until the guest ends the VM.
    pub fn wait(&mut self) -> Result<VmOutcome, GuestError> {
        self.shared.wait_stopped(None);
        self.outcome()
    }

    /// Waits up to `timeout` for the guest to end the VM; on timeout the
    /// VM is stopped and `Ok(VmOutcome::Stopped)` returned.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<VmOutcome, GuestError> {
        self.shared.wait_stopped(Some(Instant::now() + timeout));
        self.shared.finish(GuestStop::Requested);
        self.outcome()
    }

    /// Stops the VM now and waits for its vCPU threads.
    pub fn stop(&mut self) -> Result<VmOutcome, GuestError> {
        self.shared.finish(GuestStop::Requested);
        self.outcome()
    }
}

impl Drop for RunningVm {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.shared.finish(GuestStop::Requested);
            self.kick_and_join();
        }
    }
}
