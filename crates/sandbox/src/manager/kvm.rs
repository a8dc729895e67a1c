//! The real VM backend: `vmm` guests on KVM. Every use of the VMM's VM API
//! by the manager is in this file.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tine_storage::ChainSpec;
use vmm::{DiskConfig, DiskImage, MemoryBacking, RunningVm, VmConfig, VmOutcome, VsockConfig};

use super::backend::{
    BackendError, Base, BranchPoint, DiskPlan, ExitWatch, Hibernation, VmBackend, VmEnd, VmHandle, VmSource, VmSpec,
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

/// The frozen chain a VM started from `source` continues: a boot's blank
/// file system, the template's or the snapshot's recorded disk; `None`
/// when the source has no sandbox disk (a boot with disks off, or a
/// template made without one: its devices are restored as they were).
///
/// Errors: a hibernation's unreadable `disk.json` (said, not papered over
/// with the paths its state file recorded).
fn disk_below(
    plan: &DiskPlan,
    source: &VmSource,
    snapshot: Option<&vmm::Snapshot>,
) -> Result<Option<ChainSpec>, BackendError> {
    let recorded = || snapshot.and_then(|s| s.disks.get(SANDBOX_DISK).cloned().flatten());
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
        if let Some(below) = disk_below(&spec.disk, source, branch_snapshot.or(hibernated.as_ref()))? {
            let chain = disks::new_top(&below, &spec.disk.dir).map_err(BackendError::new)?;
            config.disks.push(DiskConfig { image: DiskImage::Chain(chain), id: SANDBOX_DISK_ID.into() });
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
        Ok(Box::new(KvmVm { vm, agent_socket: spec.agent_socket.clone(), max_frozen_layers }))
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

    /// The hibernation, and the sandbox disk's frozen chain kept in `dir`
    /// ([`disks::keep`]): a resume needs nothing else of its disk.
    fn hibernate(&self, dir: &Path, base: &Base) -> Result<Hibernation, BackendError> {
        let base = base_memory(base)?.map(|m| m.open()).transpose().map_err(BackendError::new)?;
        let r = self.vm.hibernate(dir, base.as_ref()).map_err(BackendError::new)?;
        if let Some(Some(chain)) = r.disks.get(SANDBOX_DISK) {
            disks::keep(chain, dir).map_err(BackendError::new)?;
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

    fn stop(&mut self) -> VmEnd {
        match self.vm.stop() {
            Ok(VmOutcome::PowerOff) => VmEnd::PowerOff,
            Ok(VmOutcome::Reset) => VmEnd::Reset,
            Ok(VmOutcome::Stopped) => VmEnd::Stopped,
            Err(e) => VmEnd::GuestFault(e.to_string()),
        }
    }
}
