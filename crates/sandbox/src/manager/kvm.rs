//! The real VM backend: `vmm` guests on KVM. Every use of the VMM's VM API
//! by the manager is in this file.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tine_storage::ChainSpec;
use vmm::{DiskConfig, DiskImage, MemoryBacking, RunningVm, VmConfig, VmOutcome, VsockConfig};

use super::backend::{
    BackendError, Base, BranchPoint, DiskPlan, ExitWatch, Hibernation, SlotPlan, VmBackend, VmEnd, VmHandle, VmSource,
    VmSpec,
};
use crate::disks;

/// The guest CID every sandbox's vsock device gets (each VM has its own
/// device and host socket, so CIDs need not differ).
const GUEST_CID: u64 = 3;
/// The guest kernel's command line (the root is the read-only image).
/// The agent is init by its own path, which Tine's root filesystem and
/// every base image built from an OCI image have (`tine_image::AGENT_PATH`;
/// an image's own `/sbin/init` is left alone).
const CMDLINE: &str = "root=/dev/vda ro rootfstype=ext4 quiet init=/usr/local/sbin/tine-agent";
/// The sandbox's own disk is the second disk (`/dev/vdb`, after the root):
/// its index in [`vmm::Snapshot::disks`].
const SANDBOX_DISK: usize = 1;
/// Its serial (GET_ID).
const SANDBOX_DISK_ID: &str = "tine-disk";

/// The serial (GET_ID) of device slot `slot`: how the agent finds the
/// disk of a volume ([`tine_protocol::Mount::serial`]).
pub(crate) fn slot_serial(slot: usize) -> String {
    format!("tine-slot-{slot}")
}

/// Where a hibernation in `dir` keeps the chain of the volume in slot
/// `slot` ([`disks::keep`]).
pub(crate) fn slot_dir(dir: &Path, slot: usize) -> PathBuf {
    dir.join(format!("slot-{slot}"))
}

/// How many device slots the sandboxes of template `t` have: its
/// snapshot's disks after the root and the sandbox disk; `None` when the
/// snapshot records no disks (one made before disks were recorded, or by
/// another backend).
pub(crate) fn slots_of(t: &crate::templates::Template) -> Option<usize> {
    let disks = t.snapshot.disks.len();
    let fixed = 1 + usize::from(t.disk.is_some());
    (disks >= fixed).then(|| disks - fixed)
}

/// The device slots of a VM started from `source` (its snapshot's, else
/// `plan.boot_slots` empty ones), each as the disk it starts with: a new
/// top over the chain a branch point or hibernation recorded for a volume
/// (a reader's is private too, [`crate::volumes`]), else empty.
///
/// Errors: a layer that cannot be linked or a top that cannot be made.
fn slot_disks(
    plan: &SlotPlan,
    disk: &DiskPlan,
    source: &VmSource,
    snapshot: Option<&vmm::Snapshot>,
    first_slot: usize,
) -> Result<Vec<DiskImage>, BackendError> {
    let recorded: Vec<Option<ChainSpec>> = match (source, snapshot) {
        (VmSource::Boot, _) => return Ok(vec![DiskImage::Empty; plan.boot_slots]),
        (VmSource::Template(t), _) => return Ok(vec![DiskImage::Empty; slots_of(t).unwrap_or(0)]),
        (_, Some(s)) => s.disks.iter().skip(first_slot).cloned().collect(),
        (_, None) => Vec::new(),
    };
    let mut out = Vec::with_capacity(recorded.len());
    for (slot, chain) in recorded.into_iter().enumerate() {
        // A hibernation's own links to the volume's layers come first; a
        // long line of hibernations and resumes is merged here, as the
        // sandbox disk's is.
        let chain = match source {
            VmSource::Hibernated { dir, .. } => disks::load(&slot_dir(dir, slot))
                .map_err(BackendError::new)?
                .or(chain)
                .map(|c| disks::shallow(&c, &disk.dir, disk.max_frozen_layers)),
            _ => chain,
        };
        out.push(match chain.filter(|_| plan.keep.get(slot).copied().unwrap_or(false)) {
            Some(chain) => DiskImage::Chain(disks::new_top(&chain, &disk.dir).map_err(BackendError::new)?),
            None => DiskImage::Empty,
        });
    }
    Ok(out)
}

/// The frozen chain a VM started from `source` continues: a boot's blank
/// file system, the template's or the snapshot's recorded disk; `None`
/// when the source has no sandbox disk (a boot with disks off, or a
/// template made without one: its devices are restored as they were).
///
/// Errors: a hibernation's unreadable `disk.json` (said, not papered over
/// with the paths its state file recorded).
fn disk_below(
    plan: &DiskPlan,
    own_disk: bool,
    source: &VmSource,
    snapshot: Option<&vmm::Snapshot>,
) -> Result<Option<ChainSpec>, BackendError> {
    let recorded = || snapshot.and_then(|s| s.disks.get(SANDBOX_DISK).cloned().flatten());
    if !own_disk && matches!(source, VmSource::Branch(_) | VmSource::Hibernated { .. }) {
        // Its snapshot's second disk is a device slot.
        return Ok(None);
    }
    Ok(match source {
        VmSource::Boot => plan.blank.clone().map(|blank| ChainSpec { base: Some(blank), ..ChainSpec::default() }),
        VmSource::Template(t) => t.disk.clone(),
        VmSource::Branch(_) => recorded(),
        // The hibernation's own links to its layers; one written before
        // hibernations kept them has only its state file's record.
        // A long line of hibernations and resumes is merged here, where a
        // copy delays only this resume.
        VmSource::Hibernated { dir, .. } => disks::load(dir)
            .map_err(BackendError::new)?
            .or_else(recorded)
            .map(|chain| disks::shallow(&chain, &plan.dir, plan.max_frozen_layers)),
    })
}

/// Starts `vmm` VMs.
pub(crate) struct KvmBackend;

impl VmBackend for KvmBackend {
    fn start(&self, spec: &VmSpec, source: &VmSource) -> Result<Box<dyn VmHandle>, BackendError> {
        let mut config = VmConfig::new(spec.name.clone(), &spec.kernel);
        config.profile = spec.profile;
        config.vcpus = spec.vcpus;
        config.memory_mib = spec.memory_mib;
        config.console_log = Some(spec.console_log.clone());
        config.disks = vec![DiskConfig::raw(spec.rootfs.clone(), true, "root")];
        config.vsock = Some(VsockConfig { cid: GUEST_CID, uds_path: spec.agent_socket.clone() });
        config.net = spec.net.clone();
        config.cmdline = CMDLINE.into();
        config.huge_pages = spec.huge_pages;
        let branch_snapshot = match source {
            VmSource::Branch(image) => Some(image.downcast_ref::<vmm::Snapshot>().ok_or_else(|| {
                BackendError::new(std::io::Error::other("the branch point was not made by this backend"))
            })?),
            _ => None,
        };
        let hibernated = match source {
            VmSource::Hibernated { dir, base } => {
                Some(vmm::Snapshot::load_hibernated(dir, base_memory(base)?).map_err(BackendError::new)?)
            }
            _ => None,
        };
        // The sandbox's own disk: a new top over what the source froze.
        if let Some(below) = disk_below(&spec.disk, spec.own_disk, source, branch_snapshot.or(hibernated.as_ref()))? {
            let chain = disks::new_top(&below, &spec.disk.dir).map_err(BackendError::new)?;
            config.disks.push(DiskConfig::fixed(DiskImage::Chain(chain), SANDBOX_DISK_ID));
        }
        let first_slot = config.disks.len();
        let slots = slot_disks(&spec.slots, &spec.disk, source, branch_snapshot.or(hibernated.as_ref()), first_slot)?;
        let slot_count = slots.len();
        for (slot, image) in slots.into_iter().enumerate() {
            config.disks.push(DiskConfig::slot(image, slot_serial(slot)));
        }
        let (snapshot, backing) = match source {
            VmSource::Boot => (None, spec.memory_backing),
            VmSource::Template(t) => {
                config.prefetch = t.working_set().filter(|_| spec.prefetch);
                (Some(&t.snapshot), spec.memory_backing)
            }
            // Children share the branch point's pages (MAP_PRIVATE of its
            // memfd) whatever the templates' backing.
            VmSource::Branch(_) => (branch_snapshot, MemoryBacking::Private),
            // Private over the base whatever the templates' backing, so that
            // the next hibernation finds the guest's own pages in the page
            // tables.
            VmSource::Hibernated { .. } => (hibernated.as_ref(), MemoryBacking::Private),
        };
        let vm = match snapshot {
            None => vmm::build_for_boot(&config),
            Some(snapshot) => vmm::build_from_snapshot(&config, snapshot, backing),
        }
        .map_err(BackendError::new)?;
        let max_frozen_layers = spec.disk.max_frozen_layers;
        Ok(Box::new(KvmVm { vm, agent_socket: spec.agent_socket.clone(), max_frozen_layers, first_slot, slot_count }))
    }
}

/// The memory of `base`, as the VMM takes it.
///
/// Errors: a branch point not made by this backend.
fn base_memory(base: &Base) -> Result<Option<vmm::SnapshotMemory>, BackendError> {
    Ok(match base {
        Base::None => None,
        Base::Template(t) => Some(t.snapshot.memory.clone()),
        Base::Pinned(dir) => Some(vmm::SnapshotMemory::File(dir.join(vmm::snapshot::MEMORY_FILE))),
        Base::Branch(image) => Some(
            image
                .downcast_ref::<vmm::Snapshot>()
                .ok_or_else(|| {
                    BackendError::new(std::io::Error::other("the branch point was not made by this backend"))
                })?
                .memory
                .clone(),
        ),
    })
}

/// A running `vmm` VM.
struct KvmVm {
    vm: RunningVm,
    agent_socket: PathBuf,
    /// [`DiskPlan::max_frozen_layers`] of its start.
    max_frozen_layers: usize,
    /// The index of its first device slot among its disks.
    first_slot: usize,
    /// How many device slots it has.
    slot_count: usize,
}

impl ExitWatch for vmm::ExitWatcher {
    fn wait(&self, timeout: Option<Duration>) -> bool {
        vmm::ExitWatcher::wait(self, timeout)
    }

    fn is_stopped(&self) -> bool {
        vmm::ExitWatcher::is_stopped(self)
    }
}

impl VmHandle for KvmVm {
    fn started(&self) -> Instant {
        self.vm.started()
    }

    fn agent_socket(&self) -> &Path {
        &self.agent_socket
    }

    fn exit_watch(&self) -> Box<dyn ExitWatch> {
        Box::new(self.vm.exit_watcher())
    }

    fn console_tail(&self, lines: usize) -> String {
        self.vm.console().last_lines(lines)
    }

    fn cpu_time(&self) -> Duration {
        self.vm.vcpu_cpu_time()
    }

    fn resident_memory_bytes(&self) -> u64 {
        self.vm.resident_memory_bytes()
    }

    fn own_memory_bytes(&self) -> Option<u64> {
        self.vm.ram().own_bytes().ok()
    }

    fn working_set(&self) -> Result<vmm::WorkingSet, BackendError> {
        self.vm.working_set().map_err(BackendError::new)
    }

    fn pause(&self, timeout: Duration) -> Result<Duration, BackendError> {
        self.vm.pause(timeout).map_err(BackendError::new)
    }

    fn resume(&self) {
        self.vm.resume();
    }

    fn is_paused(&self) -> bool {
        self.vm.is_paused()
    }

    /// The snapshot, and the sandbox disk's frozen chain kept in `dir`
    /// ([`disks::keep`]): a template owns its disk. A deep chain is kept
    /// flattened ([`disks::shallow`]), so that the sandboxes of a template
    /// of a template of ... start shallow.
    fn snapshot(&self, dir: &Path) -> Result<(), BackendError> {
        let snapshot = self.vm.snapshot(dir).map_err(BackendError::new)?;
        if let Some(Some(chain)) = snapshot.disks.get(SANDBOX_DISK) {
            let kept = disks::shallow(chain, dir, self.max_frozen_layers);
            disks::keep(&kept, dir).map_err(BackendError::new)?;
            if kept != *chain {
                // keep linked the merged layer under its own name.
                let _ = std::fs::remove_file(&kept.frozen[0]);
            }
        }
        Ok(())
    }

    fn disks(&self) -> Vec<(u64, ChainSpec)> {
        self.vm.disks()
    }

    fn replace_disk_lower(&self, index: usize, old: &ChainSpec, new: &ChainSpec) -> Result<bool, BackendError> {
        self.vm.replace_disk_lower(index, old, new).map_err(BackendError::new)
    }

    /// The hibernation, and the frozen chains of the sandbox disk and of
    /// each volume in a device slot kept in `dir` ([`disks::keep`];
    /// volumes in [`slot_dir`]): a resume needs nothing else of its disks.
    fn hibernate(&self, dir: &Path, base: &Base) -> Result<Hibernation, BackendError> {
        let base = base_memory(base)?.map(|m| m.open()).transpose().map_err(BackendError::new)?;
        let r = self.vm.hibernate(dir, base.as_ref()).map_err(BackendError::new)?;
        // The sandbox disk, when the VM has one (else that index is a slot).
        if let Some(Some(chain)) = r.disks.get(SANDBOX_DISK).filter(|_| self.first_slot > SANDBOX_DISK) {
            disks::keep(chain, dir).map_err(BackendError::new)?;
        }
        for (slot, chain) in r.disks.iter().skip(self.first_slot).enumerate() {
            if let Some(chain) = chain {
                let keep_in = slot_dir(dir, slot);
                std::fs::create_dir_all(&keep_in).map_err(BackendError::new)?;
                disks::keep(chain, &keep_in).map_err(BackendError::new)?;
            }
        }
        Ok(Hibernation { based: r.based, bytes: r.pages.file_bytes, took: r.took })
    }

    fn branch(&self, pause_timeout: Duration) -> Result<BranchPoint, BackendError> {
        let (snapshot, report) = self.vm.branch(pause_timeout).map_err(BackendError::new)?;
        Ok(BranchPoint {
            image: std::sync::Arc::new(snapshot),
            mode: report.mode,
            fallback_reason: report.fallback_reason,
            pause: report.pause,
            total: report.total,
            bytes_written: report.bytes_written,
            pages_copied_before_write: report.pages_copied_before_write,
        })
    }

    fn slot_count(&self) -> usize {
        self.slot_count
    }

    fn slot_chains(&self) -> Vec<ChainSpec> {
        self.vm.disks().into_iter().skip(self.first_slot).map(|(_, chain)| chain).collect()
    }

    fn insert_slot(&self, slot: usize, chain: Option<ChainSpec>) -> Result<ChainSpec, BackendError> {
        if slot >= self.slot_count {
            return Err(BackendError::new(std::io::Error::other(format!(
                "the VM has {} device slots, no slot {slot}",
                self.slot_count
            ))));
        }
        let image = chain.map_or(DiskImage::Empty, DiskImage::Chain);
        self.vm.insert_disk(self.first_slot + slot, &image).map_err(BackendError::new)
    }

    fn stop(&mut self) -> VmEnd {
        match self.vm.stop() {
            Ok(VmOutcome::PowerOff) => VmEnd::PowerOff,
            Ok(VmOutcome::Reset) => VmEnd::Reset,
            Ok(VmOutcome::Stopped) => VmEnd::Stopped,
            Err(e) => VmEnd::GuestFault(e.to_string()),
        }
    }
}
