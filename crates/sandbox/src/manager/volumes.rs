//! Volumes in sandboxes ([`crate::volumes`]): a create attaches them in
//! the VM's device slots after the VM is up, a kill lets go of them.
//!
//! Attaching one is three steps: the store gives the slot's chain (and
//! makes the sandbox its writer), the VMM puts the chain in the slot and
//! raises a configuration change interrupt, and the agent mounts the disk
//! of that slot's serial once the guest sees its capacity.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tine_protocol::Mount;

use super::kvm::slot_serial;
use super::{Manager, Sandbox, SandboxError};
use crate::lock;
use crate::progress::CallContext;
use crate::volumes::{AttachedVolume, VolumeInfo, VolumeRequest};

/// How long a mount or unmount may take in the guest (the mount waits up
/// to [`tine_protocol::MOUNT_WAIT_MS`] for the disk's capacity).
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);

impl Manager {
    /// Makes an empty volume of `size_gib` GiB named `name`, the call's
    /// tenant's.
    ///
    /// Errors: [`SandboxError::Volume`] (name, size, taken, too many,
    /// mkfs).
    pub async fn volume_create(&self, cx: &CallContext, name: &str, size_gib: u64) -> Result<VolumeInfo, SandboxError> {
        let store = self.volumes.clone();
        let (tenant, name, limits) = (cx.tenant.clone(), name.to_string(), self.config.limits.clone());
        tokio::task::spawn_blocking(move || store.create(tenant.as_deref(), &name, size_gib, &limits))
            .await
            .map_err(super::task_failed("volume create task"))?
            .map_err(SandboxError::from)
    }

    /// The call's tenant's volumes.
    pub fn volume_list(&self, cx: &CallContext) -> Vec<VolumeInfo> {
        self.volumes.list(cx.tenant.as_deref())
    }

    /// Deletes the call's tenant's volume `name` and its data.
    ///
    /// Errors: [`SandboxError::Volume`] (not found, attached).
    pub async fn volume_delete(&self, cx: &CallContext, name: &str) -> Result<(), SandboxError> {
        let store = self.volumes.clone();
        let (tenant, name) = (cx.tenant.clone(), name.to_string());
        tokio::task::spawn_blocking(move || store.delete(tenant.as_deref(), &name))
            .await
            .map_err(super::task_failed("volume delete task"))?
            .map_err(SandboxError::from)
    }

    /// Attaches `requests` to the new sandbox `sb` (running, nothing of the
    /// caller's run in it yet), in slots 0, 1, ... of its VM. On an error
    /// the volumes attached so far stay in `sb`'s list, so the caller's
    /// teardown lets go of them.
    ///
    /// Errors: [`SandboxError::Volumes`] (more volumes than slots, bad
    /// paths), [`SandboxError::Volume`] (not found, written by another
    /// sandbox), [`SandboxError::Start`] (the slot), the agent's mount
    /// error.
    pub(super) async fn attach_volumes(
        &self,
        sb: &Arc<Sandbox>,
        tenant: Option<&str>,
        requests: &[VolumeRequest],
    ) -> Result<(), SandboxError> {
        let slots = lock(&sb.vm).vm.as_ref().map_or(0, |vm| vm.slot_count());
        crate::volumes::check_requests(requests, slots).map_err(SandboxError::Volumes)?;
        for (slot, r) in requests.iter().enumerate() {
            let (store, t, name, id, ro) =
                (self.volumes.clone(), tenant.map(str::to_string), r.name.clone(), sb.id.clone(), r.read_only);
            let (stored, chain) = tokio::task::spawn_blocking(move || store.acquire(t.as_deref(), &name, &id, ro))
                .await
                .map_err(super::task_failed("volume attach task"))??;
            lock(&sb.volumes).push(AttachedVolume {
                name: r.name.clone(),
                path: r.path.clone(),
                read_only: r.read_only,
                shared: true,
                slot,
                stored,
            });
            put_in_slot(sb, slot, Some(chain)).await?;
            let agent = sb.agent().ok_or_else(|| sb.gone())?;
            let mount = Mount { serial: slot_serial(slot), path: r.path.clone(), read_only: r.read_only };
            agent.mount(mount, MOUNT_TIMEOUT).await.map_err(|e| {
                SandboxError::Volumes(format!("volume {:?} could not be mounted at {}: {e}", r.name, r.path))
            })?;
            tracing::info!(sandbox = %sb.id, volume = %r.name, path = %r.path, read_only = r.read_only,
                "volume attached");
        }
        Ok(())
    }

    /// Lets go of the volumes of `sb`, whose VM has stopped (blocking):
    /// a writer's writes become the volume's (its slot's chain as its VM
    /// or hibernation left it). Called by every teardown; a volume the
    /// store cannot take back is logged and keeps its writer, so nothing
    /// is lost and the operator sees why.
    pub(super) fn release_volumes(&self, sb: &Sandbox) {
        let attached = std::mem::take(&mut *lock(&sb.volumes));
        if attached.is_empty() {
            return;
        }
        // Kept (a disk sweep keeps their layers) until the releases are done.
        let last = lock(&sb.slot_chains).clone();
        let hibernation = lock(&sb.hibernation).as_ref().map(|h| h.dir.clone());
        for v in attached.iter().filter(|v| v.shared) {
            let chain = match &hibernation {
                Some(dir) => crate::disks::load(&super::kvm::slot_dir(dir, v.slot)).ok().flatten(),
                None => last.get(v.slot).cloned().filter(|c| c.base.is_some()),
            };
            if let Err(e) = self.volumes.release(&v.stored, &sb.id, chain.as_ref()) {
                tracing::warn!(sandbox = %sb.id, volume = %v.name, "{e}");
            }
        }
        lock(&sb.slot_chains).clear();
    }

    /// Records, in the volume store, the chains of `sb`'s writable volumes
    /// as its VM has them now ([`crate::volumes::VolumeStore::note_chain`]):
    /// after a resume or a branch gave a slot a new top, so that a server
    /// stopping without a release loses none of the writes up to then.
    /// Off the async threads; nothing to do for a sandbox without one.
    pub(super) async fn note_volume_chains(&self, sb: &Arc<Sandbox>) {
        let writable: Vec<(usize, String)> =
            lock(&sb.volumes).iter().filter(|v| v.writes()).map(|v| (v.slot, v.stored.clone())).collect();
        if writable.is_empty() {
            return;
        }
        let (store, s) = (self.volumes.clone(), sb.clone());
        let _ = tokio::task::spawn_blocking(move || {
            let Some(chains) = lock(&s.vm).vm.as_ref().map(|vm| vm.slot_chains()) else { return };
            for (slot, stored) in writable {
                let Some(chain) = chains.get(slot).filter(|c| c.base.is_some()) else { continue };
                if let Err(e) = store.note_chain(&stored, &s.id, chain) {
                    tracing::warn!(sandbox = %s.id, volume = %stored, "{e}");
                }
            }
        })
        .await;
    }

    /// Writes out what the guest's page cache holds of `sb`'s writable
    /// volumes (`sync -f`, the syncfs(2) of each mount), before a pause or
    /// hibernation: the volume's layers then hold the writes up to it, and
    /// a kill of the paused sandbox, which cannot unmount them, loses
    /// nothing written before. Best effort (a guest that does not answer
    /// within [`MOUNT_TIMEOUT`] is logged).
    pub(super) async fn sync_volumes(&self, sb: &Sandbox) {
        let writable: Vec<String> = lock(&sb.volumes).iter().filter(|v| v.writes()).map(|v| v.path.clone()).collect();
        if writable.is_empty() {
            return;
        }
        let Some(agent) = sb.agent() else { return };
        // No shell: one process, the paths as they are.
        let exec = tine_protocol::Exec {
            command: tine_protocol::Command::Argv(
                ["sync".to_string(), "-f".to_string()].into_iter().chain(writable).collect(),
            ),
            cwd: None,
            env: Vec::new(),
            stdin: Vec::new(),
            timeout_ms: MOUNT_TIMEOUT.as_millis() as u32,
            output_limit: 4096,
        };
        match agent.run(exec, MOUNT_TIMEOUT + Duration::from_secs(5)).await {
            Ok(r) if r.status == tine_protocol::ExitStatus::Code(0) => {}
            Ok(r) => tracing::warn!(sandbox = %sb.id, "syncing its volumes: {:?}, {}", r.status,
                String::from_utf8_lossy(&r.stderr.data)),
            Err(e) => tracing::warn!(sandbox = %sb.id, "syncing its volumes: {e}"),
        }
    }

    /// Unmounts the writable volumes of running `sb` so that the guest
    /// writes out what it holds of them before its VM stops (best effort:
    /// a guest that does not answer loses what it had not written yet,
    /// as a power cut would).
    pub(super) async fn unmount_volumes(&self, sb: &Sandbox) {
        let writable: Vec<String> = lock(&sb.volumes).iter().filter(|v| v.writes()).map(|v| v.path.clone()).collect();
        if writable.is_empty() {
            return;
        }
        // A paused guest cannot answer; its volumes were synced at the pause.
        if sb.state() != super::SandboxState::Running {
            return;
        }
        let Some(agent) = sb.agent() else { return };
        for path in writable {
            if let Err(e) = agent.unmount(path.clone(), MOUNT_TIMEOUT).await {
                tracing::warn!(sandbox = %sb.id, "unmount {path} before the stop: {e}");
            }
        }
    }

    /// Takes `sb`'s volumes out of their slots for a capture (a template
    /// never carries one): each is unmounted in the guest, then its slot
    /// emptied. Returns each slot's chain, for
    /// [`Manager::reattach_volumes`]. A volume that cannot be unmounted
    /// (a process uses it) fails the snapshot, with what was detached put
    /// back.
    ///
    /// Errors: [`SandboxError::Volumes`] (paused: the guest cannot
    /// unmount; busy), [`SandboxError::Start`] (the slot).
    pub(super) async fn detach_volumes(
        &self,
        sb: &Arc<Sandbox>,
    ) -> Result<Vec<(usize, tine_storage::ChainSpec)>, SandboxError> {
        let attached = lock(&sb.volumes).clone();
        if attached.is_empty() {
            return Ok(Vec::new());
        }
        let agent = sb.agent().ok_or_else(|| {
            SandboxError::Volumes(format!(
                "sandbox {} has volumes attached and is not running: resume it first, so that they can be detached                  for the template",
                sb.id
            ))
        })?;
        let mut detached = Vec::new();
        for v in &attached {
            let out = match agent.unmount(v.path.clone(), MOUNT_TIMEOUT).await {
                Ok(()) => put_in_slot(sb, v.slot, None).await,
                Err(e) => Err(SandboxError::Volumes(format!(
                    "volume {:?} cannot be detached for the template ({e}); stop what uses {} and try again",
                    v.name, v.path
                ))),
            };
            match out {
                Ok(chain) => detached.push((v.slot, chain)),
                Err(e) => {
                    self.reattach_volumes(sb, detached).await?;
                    return Err(e);
                }
            }
        }
        Ok(detached)
    }

    /// Puts back what [`Manager::detach_volumes`] took out, and mounts it
    /// again where it was.
    ///
    /// Errors: [`SandboxError::Start`] (the slot), [`SandboxError::Volumes`]
    /// (the mount).
    pub(super) async fn reattach_volumes(
        &self,
        sb: &Arc<Sandbox>,
        detached: Vec<(usize, tine_storage::ChainSpec)>,
    ) -> Result<(), SandboxError> {
        let attached = lock(&sb.volumes).clone();
        for (slot, chain) in detached {
            put_in_slot(sb, slot, Some(chain)).await?;
            let Some(v) = attached.iter().find(|v| v.slot == slot) else { continue };
            let agent = sb.agent().ok_or_else(|| sb.gone())?;
            let mount = Mount { serial: slot_serial(slot), path: v.path.clone(), read_only: v.read_only };
            agent.mount(mount, MOUNT_TIMEOUT).await.map_err(|e| {
                SandboxError::Volumes(format!("volume {:?} could not be mounted again at {}: {e}", v.name, v.path))
            })?;
        }
        Ok(())
    }

    /// After the records are read at start: the readers they list, and
    /// every volume whose writer did not survive (only hibernated
    /// sandboxes keep theirs).
    pub(super) fn recover_volumes(&self) {
        let mut live = HashSet::new();
        for sb in lock(&self.sandboxes).values() {
            let hibernated = sb.state() == super::SandboxState::Hibernated;
            for v in lock(&sb.volumes).iter().filter(|v| v.shared) {
                if v.read_only {
                    self.volumes.note_reader(&v.stored, &sb.id);
                } else if hibernated {
                    live.insert(sb.id.clone());
                }
            }
        }
        self.volumes.recover(&live);
    }
}

/// Puts `chain` in device slot `slot` of `sb`'s VM (`None`: empties it),
/// off the async threads; returns the chain taken out.
///
/// Errors: the sandbox has no VM; [`SandboxError::Start`] (the slot).
async fn put_in_slot(
    sb: &Arc<Sandbox>,
    slot: usize,
    chain: Option<tine_storage::ChainSpec>,
) -> Result<tine_storage::ChainSpec, SandboxError> {
    let s = sb.clone();
    tokio::task::spawn_blocking(move || {
        let vm = lock(&s.vm);
        vm.vm.as_ref().ok_or_else(|| s.gone())?.insert_slot(slot, chain).map_err(SandboxError::Start)
    })
    .await
    .map_err(super::task_failed("volume slot task"))?
}
