//! Capturing a VM's state: [`RunningVm::capture_state`] saves every
//! vCPU, the VM-wide state, every virtio transport and the legacy devices
//! of a paused VM, with the transports locked; [`RunningVm::snapshot`]
//! writes it with guest RAM to a directory, [`RunningVm::branch`] keeps
//! it in memory as a branch point.

use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use crate::branch::{BranchMode, BranchReport, PauseSteps, WriteProtection};
use crate::devices::virtio::mmio::{MmioTransport, TransportState};
use crate::devices::{LegacyState, Persist};
use crate::memory::{MemoryError, PageCopier};
use crate::snapshot::{file_crc32, Snapshot, SnapshotError, SnapshotMemory, MEMORY_FILE};
use crate::sync::lock;
use crate::vcpu_state::VcpuState;
use crate::vm::{ControlError, RunningVm};
use crate::vm_state::VmState;

/// A paused VM's state apart from guest RAM, taken at one instant.
pub(crate) struct CapturedState {
    /// Each vCPU's state, by index.
    pub vcpus: Vec<Arc<VcpuState>>,
    /// Interrupt controllers, PIT, clock.
    pub vm: VmState,
    /// Each virtio-mmio transport's state, by device index.
    pub transports: Vec<TransportState>,
    /// The serial port and the i8042.
    pub legacy: LegacyState,
    /// Each disk's checkpoint ([`Snapshot::disks`]).
    pub disks: Vec<Option<tine_storage::ChainSpec>>,
}

/// Every virtio transport of a VM, locked: while held, no device touches
/// guest memory or its virtqueues.
pub(crate) struct DeviceLocks<'a> {
    _guards: Vec<MutexGuard<'a, MmioTransport>>,
}

/// Makes the disks' checkpoints of a capture durable
/// ([`tine_storage::sync`]), for a snapshot or hibernation that names them.
///
/// Errors: [`ControlError::Disk`].
pub(super) fn sync_disks(disks: &[Option<tine_storage::ChainSpec>]) -> Result<(), ControlError> {
    for (index, spec) in disks.iter().enumerate() {
        if let Some(spec) = spec {
            tine_storage::sync(spec).map_err(|source| ControlError::Disk { index, source })?;
        }
    }
    Ok(())
}

impl RunningVm {
    /// Saves the state of the paused VM apart from guest RAM, and returns
    /// it with every virtio transport still locked, so the caller can take
    /// guest RAM at the same instant. Each disk is checkpointed at that
    /// instant too ([`tine_storage::Disk::checkpoint`]: a copy-on-write
    /// disk's top is flushed and frozen, and the VM goes on on a new top),
    /// so that the disk a snapshot records is the one its memory knows.
    ///
    /// Errors: [`ControlError::NotPaused`], [`ControlError::VcpuState`],
    /// [`ControlError::VmState`], [`ControlError::Disk`].
    pub(crate) fn capture_state(&self) -> Result<(DeviceLocks<'_>, CapturedState), ControlError> {
        self.require_paused()?;
        let mut guards: Vec<_> = self.shared.mmio.iter().map(|(_, _, t)| lock(t)).collect();
        let mut disks = Vec::new();
        for t in guards.iter_mut() {
            if let Some(disk) = t.disk() {
                let index = disks.len();
                disks.push(disk.checkpoint().map_err(|source| ControlError::Disk { index, source })?);
            }
        }
        let transports = guards.iter().map(|t| t.save()).collect();
        let legacy = lock(&self.shared.devices).save();
        let vcpus = self.save_vcpu_states()?.into_iter().map(Arc::new).collect();
        let vm = crate::vm_state::save(&self.vm)?;
        Ok((DeviceLocks { _guards: guards }, CapturedState { vcpus, vm, transports, legacy, disks }))
    }

    /// A snapshot of `state` with guest RAM in `memory`.
    pub(super) fn snapshot_of(&self, state: CapturedState, memory_crc32: u32, memory: SnapshotMemory) -> Snapshot {
        Snapshot {
            vcpus: state.vcpus,
            vm: state.vm,
            transports: state.transports,
            legacy: state.legacy,
            cpuid: self.cpuid.clone(),
            mem_bytes: self.ram.size,
            memory_crc32,
            memory,
            disks: state.disks,
        }
    }

    /// Takes a snapshot of the paused VM into the directory `dir` (which
    /// must exist): guest RAM to `dir/memory`, each disk's checkpoint made
    /// durable ([`Snapshot::disks`]), then the state file (see
    /// [`crate::snapshot`] for the format). Every virtio transport is locked
    /// for the whole snapshot, so no device touches guest memory or its
    /// virtqueues meanwhile. The VM stays paused; resume or stop it
    /// afterwards.
    ///
    /// Errors: [`ControlError::NotPaused`], [`ControlError::VcpuState`],
    /// [`ControlError::VmState`], [`ControlError::Memory`], [`ControlError::Snapshot`].
    pub fn snapshot(&self, dir: &std::path::Path) -> Result<Snapshot, ControlError> {
        let (locks, state) = self.capture_state()?;
        let memory_file = dir.join(MEMORY_FILE);
        self.ram.write_to(&memory_file)?;
        drop(locks);
        sync_disks(&state.disks)?;
        let io = |source| SnapshotError::Io { path: memory_file.clone(), source };
        let memory_crc32 = file_crc32(&std::fs::File::open(&memory_file).map_err(io)?, self.ram.size).map_err(io)?;
        let snapshot = self.snapshot_of(state, memory_crc32, SnapshotMemory::File(memory_file));
        snapshot.write_state(dir)?;
        Ok(snapshot)
    }

    /// Takes a branch point: a consistent copy of the VM's whole state at
    /// one instant, held in memory, to restore any number of VMs from
    /// ([`crate::vm::build_from_snapshot`] with the returned snapshot; its memory is a memfd,
    /// [`crate::snapshot::SnapshotMemory::Shared`]).
    ///
    /// The VM is paused (within `pause_timeout`), its vCPU, VM and device
    /// state saved, the pages of guest RAM that hold data and that a guest
    /// write changes in place write-protected, and the VM resumed; the
    /// memory is then copied while it runs, each protected page before its
    /// first write (see [`crate::branch`]). RAM restored privately from a
    /// snapshot file protects only the pages it wrote since; the others
    /// are the file's, read from it ([`crate::memory::GuestRam::branch_ranges`]).
    /// [`BranchReport::pause_steps`] says where the pause went. Where write
    /// protection is not available, or the VM was paused already, the
    /// memory is copied while paused instead, and the report says so. A VM
    /// paused before the call stays paused. Blocks until the copy is
    /// complete.
    ///
    /// Errors: [`ControlError::Stopped`], [`ControlError::PauseTimeout`],
    /// [`ControlError::VcpuState`], [`ControlError::VmState`], [`ControlError::Memory`].
    pub fn branch(&self, pause_timeout: Duration) -> Result<(Snapshot, BranchReport), ControlError> {
        let start = Instant::now();
        let was_paused = self.is_paused();
        let mut steps = PauseSteps::default();
        if !was_paused {
            self.pause(pause_timeout)?;
        }
        steps.stop_vcpus = start.elapsed();
        let ram = &self.ram;
        let mut step = Instant::now();
        let mut lap = move || std::mem::replace(&mut step, Instant::now()).elapsed();
        let taken = (|| {
            let memfd = crate::memory::new_memfd(&format!("tine-branch-{}", self.name), ram.size)
                .map_err(MemoryError::Memfd)?;
            steps.memfd = lap();
            let (locks, state) = self.capture_state()?;
            steps.state = lap();
            let (ranges, written) = ram.branch_ranges()?;
            steps.ranges = lap();
            let protection = if was_paused {
                Err("the VM was paused already, so its memory was copied as it stood".to_string())
            } else {
                // SAFETY: the regions are guest RAM's mappings, owned by
                // `self.ram`, which outlives this call (and the returned
                // protection, dropped within it); the vCPUs are paused and
                // every transport is locked until after this returns.
                unsafe { WriteProtection::start(&ram.regions(), &written, ram.page_size()) }
            };
            let mut copier = PageCopier::new(ram, &memfd);
            if protection.is_err() {
                for &(s, e) in &ranges {
                    copier.copy(s, e)?;
                }
            }
            let bytes_written = copier.bytes_written;
            steps.protect = lap();
            drop(locks);
            Ok::<_, ControlError>((memfd, state, ranges, written, protection, bytes_written))
        })();
        if !was_paused {
            self.resume();
        }
        let pause = start.elapsed();
        let (memfd, state, ranges, written, protection, mut bytes_written) = taken?;
        let bytes_examined = ranges.iter().map(|(s, e)| e - s).sum();
        let (mode, fallback_reason, pages_copied_before_write, write_faults) = match protection {
            Ok(wp) => {
                // The protected pages first (the VM's writes to them wait),
                // then those that only the snapshot file holds.
                let mut copier = PageCopier::new(ram, &memfd);
                let (early, faults) = wp.copy(&written, &mut copier)?;
                for (s, e) in crate::memory::difference(&ranges, &written) {
                    copier.copy_from_file(s, e)?;
                }
                bytes_written = copier.bytes_written;
                (BranchMode::WriteProtect, None, early, faults)
            }
            Err(reason) => (BranchMode::CopyWhilePaused, Some(reason), 0, 0),
        };
        let report = BranchReport {
            mode,
            fallback_reason,
            pause,
            pause_steps: steps,
            total: start.elapsed(),
            bytes_examined,
            bytes_written,
            pages_copied_before_write,
            write_faults,
        };
        tracing::info!(name = %self.name, ?mode, steps = ?report.pause_steps, "branch point taken: paused {:?}, copied {} MiB in {:?}, {} pages copied before a write",
            report.pause, report.bytes_written >> 20, report.total, report.pages_copied_before_write);
        let snapshot = self.snapshot_of(state, 0, SnapshotMemory::Shared(Arc::new(memfd)));
        Ok((snapshot, report))
    }
}
