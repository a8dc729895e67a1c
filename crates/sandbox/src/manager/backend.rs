//! The seam between the manager and the VMM: [`VmBackend`] starts VMs,
//! [`VmHandle`] controls one. The real backend ([`super::kvm`]) runs
//! `vmm` guests on KVM; the fake one (`super::fake`, tests only) answers the
//! agent protocol from a thread, so the manager's lifecycle, lineage,
//! reaper and limits are tested without `/dev/kvm`.
//!
//! The methods block (a VM start takes a cold boot's first steps, a pause
//! waits for every vCPU to park): the manager calls them off the async
//! threads.

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm::{BranchMode, HostProfile, MemoryBacking};

use crate::templates::Template;

/// Why the VM backend failed: the VMM's own error, kept as the source.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct BackendError(Box<dyn std::error::Error + Send + Sync>);

impl BackendError {
    /// Wraps the backend's error.
    pub(crate) fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        BackendError(Box::new(e))
    }
}

/// What VM to make: the shape and the files of one sandbox.
#[derive(Clone, Debug)]
pub(crate) struct VmSpec {
    /// The VM's name (the sandbox id).
    pub name: String,
    /// Guest kernel.
    pub kernel: PathBuf,
    /// Root filesystem image, attached read-only.
    pub rootfs: PathBuf,
    /// vCPUs.
    pub vcpus: u8,
    /// Guest memory (MiB).
    pub memory_mib: u64,
    /// The host profile.
    pub profile: HostProfile,
    /// How a template's memory file backs a restored guest.
    pub memory_backing: MemoryBacking,
    /// Prefetch a template's working set, if it has one.
    pub prefetch: bool,
    /// Guest RAM of 2 MiB huge pages ([`vmm::VmConfig::huge_pages`]).
    pub huge_pages: bool,
    /// Where the guest console's output goes.
    pub console_log: PathBuf,
    /// The hybrid-vsock socket the host reaches the agent through.
    pub agent_socket: PathBuf,
    /// Its network device's NAT settings and control (`None`: no device).
    pub net: Option<vmm::NetConfig>,
    /// Where its own disk comes from.
    pub disk: DiskPlan,
    /// Whether the sandbox has a disk of its own (a disk size over 0): a
    /// restore from a branch point or hibernation of a sandbox without
    /// one finds its device slots right after the root.
    pub own_disk: bool,
    /// The VM's device slots for volumes ([`SlotPlan`]).
    pub slots: SlotPlan,
}

/// The device slots of a VM ([`vmm::DiskConfig::slot`]): empty virtio-blk
/// devices, after the root and the sandbox disk, that a volume is put in
/// while the VM runs ([`VmHandle::insert_slot`]). A restore has the slots
/// its snapshot has (a template's are empty).
#[derive(Clone, Debug, Default)]
pub(crate) struct SlotPlan {
    /// How many slots a boot makes ([`crate::Limits::volume_slots`]).
    pub boot_slots: usize,
    /// For a branch or a resume: per slot, whether the volume it held at
    /// the capture goes on (on a new top over the recorded chain, a
    /// private one for a reader as for a writer), or the slot starts
    /// empty (`false`, or past the end).
    pub keep: Vec<bool>,
}

/// Where a VM's own disk comes from ([`crate::disks`]).
#[derive(Clone, Debug)]
pub(crate) struct DiskPlan {
    /// The directory its new top goes to.
    pub dir: PathBuf,
    /// The empty file system a booted VM's disk starts from (`None`: a
    /// booted VM has no disk of its own and writes to guest memory).
    pub blank: Option<PathBuf>,
    /// Frozen layers its chain may have before a resume, a template's
    /// making or a branch merges them ([`crate::Limits::max_disk_layers`]).
    pub max_frozen_layers: usize,
}

/// A branch point: one instant of a VM that children are restored from.
/// Opaque to the manager; only the backend that made it can start from it.
pub(crate) type BranchImage = Arc<dyn Any + Send + Sync>;

/// Where a VM's first state comes from.
pub(crate) enum VmSource {
    /// A cold boot of the kernel.
    Boot,
    /// A template's snapshot.
    Template(Arc<Template>),
    /// A branch point of another sandbox (children share its pages).
    Branch(BranchImage),
    /// A hibernation ([`VmHandle::hibernate`]) in `dir`, written against
    /// `base`.
    Hibernated {
        /// The hibernation's directory.
        dir: PathBuf,
        /// What its page file was written against.
        base: Base,
    },
}

/// The memory a VM was restored from, which its hibernations are written
/// against (only the pages that differ from it are saved).
#[derive(Clone, Default)]
pub(crate) enum Base {
    /// None: booted, or resumed from a whole-memory hibernation.
    #[default]
    None,
    /// A loaded template's memory.
    Template(Arc<Template>),
    /// A branch point's memory (in this process only).
    Branch(BranchImage),
    /// A template generation's files pinned for hibernated sandboxes: the
    /// directory holding its `memory` (after a restart).
    Pinned(PathBuf),
}

impl Base {
    /// The base of a VM started from `source`.
    pub fn of(source: &VmSource) -> Base {
        match source {
            VmSource::Boot => Base::None,
            VmSource::Template(t) => Base::Template(t.clone()),
            VmSource::Branch(image) => Base::Branch(image.clone()),
            VmSource::Hibernated { base, .. } => base.clone(),
        }
    }
}

/// What a hibernation wrote.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hibernation {
    /// Whether only the pages that differ from the base were written.
    pub based: bool,
    /// The page file's size (bytes).
    pub bytes: u64,
    /// From the start of the write to the synced directory.
    pub took: Duration,
}

/// A branch point and what taking it cost.
pub(crate) struct BranchPoint {
    /// The image children start from.
    pub image: BranchImage,
    /// How the memory was copied.
    pub mode: BranchMode,
    /// Why the copy was made while paused, if it was.
    pub fallback_reason: Option<String>,
    /// How long the vCPUs were stopped.
    pub pause: Duration,
    /// From the pause until the copy was complete.
    pub total: Duration,
    /// Guest memory copied (bytes; zero pages left out).
    pub bytes_written: u64,
    /// Pages copied early because the source was about to write them.
    pub pages_copied_before_write: u64,
}

/// How a VM ended.
#[derive(Debug)]
pub(crate) enum VmEnd {
    /// The host stopped it.
    Stopped,
    /// The guest powered off.
    PowerOff,
    /// The guest rebooted.
    Reset,
    /// The guest faulted or its kernel panicked; the message says it all
    /// (with the console's last lines).
    GuestFault(String),
}

/// Waits for a VM to end, without holding the VM.
pub(crate) trait ExitWatch: Send + Sync {
    /// Waits until the VM has stopped, or `timeout` passed (`None`:
    /// forever); returns whether it stopped.
    fn wait(&self, timeout: Option<Duration>) -> bool;
    /// Whether the VM has stopped.
    fn is_stopped(&self) -> bool;
}

/// Starts VMs.
pub(crate) trait VmBackend: Send + Sync {
    /// Starts a VM of `spec` from `source`; its agent comes up on
    /// `spec.agent_socket` later. Blocking.
    ///
    /// Errors: the VMM's (bad image, no KVM, damaged snapshot, ...).
    fn start(&self, spec: &VmSpec, source: &VmSource) -> Result<Box<dyn VmHandle>, BackendError>;
}

/// One running (or paused) VM.
pub(crate) trait VmHandle: Send + Sync {
    /// When it was started (the boot or restore began).
    fn started(&self) -> Instant;
    /// The hybrid-vsock socket the agent is reached through.
    fn agent_socket(&self) -> &Path;
    /// A watcher of its end.
    fn exit_watch(&self) -> Box<dyn ExitWatch>;
    /// The guest console's last `lines` lines.
    fn console_tail(&self, lines: usize) -> String;
    /// CPU time its vCPUs used.
    fn cpu_time(&self) -> Duration;
    /// Host memory backing guest RAM now (bytes).
    fn resident_memory_bytes(&self) -> u64;
    /// Host memory (bytes) this VM holds of its own: guest RAM pages not
    /// shared with the template or branch point it was restored from (an
    /// upper bound while the guest runs; see [`vmm::GuestRam::own_bytes`]);
    /// `None` where it cannot be read. Admission counts it
    /// ([`crate::Limits::memory_headroom_mib`]).
    fn own_memory_bytes(&self) -> Option<u64>;
    /// The guest pages it has touched so far (see [`vmm::WorkingSet`]).
    ///
    /// Errors: reading the host's page tables.
    fn working_set(&self) -> Result<vmm::WorkingSet, BackendError>;
    /// Parks every vCPU, waiting up to `timeout`; returns how long it took.
    ///
    /// Errors: a vCPU that did not park in time, or a VM that ended.
    fn pause(&self, timeout: Duration) -> Result<Duration, BackendError>;
    /// Lets the vCPUs run again.
    fn resume(&self);
    /// Whether the vCPUs are parked.
    fn is_paused(&self) -> bool;
    /// Writes a snapshot of the paused VM into `dir`.
    ///
    /// Errors: the VMM's (file writes, device state).
    fn snapshot(&self, dir: &Path) -> Result<(), BackendError>;
    /// Writes the paused VM's state and memory into the empty directory
    /// `dir`, against `base` (only the pages that differ from it; all of
    /// them with [`Base::None`]), synced. The VM stays paused.
    ///
    /// Errors: the VMM's (a full disk, an I/O error, device state).
    fn hibernate(&self, dir: &Path, base: &Base) -> Result<Hibernation, BackendError>;
    /// Its disks now, in order: size (bytes) and files (every layer of
    /// each chain), so that clean-up keeps them
    /// ([`crate::disks::sweep`]) and usage can be counted.
    fn disks(&self) -> Vec<(u64, tine_storage::ChainSpec)>;
    /// Puts the frozen chain `new` under disk `index`'s top in place of
    /// `old` if that is still what is below it (`vmm`'s
    /// `RunningVm::replace_disk_lower`); `false`: it is not, or this
    /// backend has no such disks.
    fn replace_disk_lower(
        &self,
        index: usize,
        old: &tine_storage::ChainSpec,
        new: &tine_storage::ChainSpec,
    ) -> Result<bool, BackendError> {
        let _ = (index, old, new);
        Ok(false)
    }
    /// Takes a branch point (pausing for at most `pause_timeout` to park
    /// the vCPUs); a paused VM stays paused.
    ///
    /// Errors: the VMM's.
    fn branch(&self, pause_timeout: Duration) -> Result<BranchPoint, BackendError>;
    /// How many device slots the VM has ([`SlotPlan`]).
    fn slot_count(&self) -> usize {
        0
    }
    /// The chain in each device slot now, by slot (an empty slot's is
    /// empty), tops included.
    fn slot_chains(&self) -> Vec<tine_storage::ChainSpec> {
        Vec::new()
    }
    /// Puts `chain` in device slot `slot` (`None`: takes out what it
    /// holds) and returns the files of the disk taken out (its top, if
    /// any, no longer written).
    ///
    /// Errors: no such slot, the chain cannot be opened, the old disk's
    /// flush failed (nothing changed).
    fn insert_slot(
        &self,
        slot: usize,
        chain: Option<tine_storage::ChainSpec>,
    ) -> Result<tine_storage::ChainSpec, BackendError> {
        let _ = (slot, chain);
        Err(BackendError::new(std::io::Error::other("this VM backend has no device slots")))
    }
    /// Stops the VM and joins its threads; says how it ended.
    fn stop(&mut self) -> VmEnd;
}
