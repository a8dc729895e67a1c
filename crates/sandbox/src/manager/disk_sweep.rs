//! Clean-up of sandbox disk layers ([`crate::disks`]): the layers in
//! `<kept>/.disks` that no VM, hibernation or template uses any more are
//! removed ([`Manager::sweep_disks`]) at start, after a sandbox ends and
//! every [`MIN_AGE`] from the reaper's memory thread (which also takes the
//! last top of a hibernated VM).
//!
//! What is in use: every layer of every VM this manager started and that
//! still has one (listed or not: pooled sandboxes and template builds
//! too). Templates and hibernations own hard links of their layers in
//! their own directories ([`crate::disks::keep`]), so removing a name in
//! `.disks` never takes a layer they need. A layer made or linked in the
//! last [`MIN_AGE`] is kept whatever: it may belong to a VM still
//! starting.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::{Manager, Sandbox};
use crate::lock;

/// Layers younger than this are never removed.
pub(super) const MIN_AGE: Duration = Duration::from_secs(120);

impl Manager {
    /// Notes that `sb` has a VM now, whose disk layers a sweep must keep
    /// while it has it.
    pub(super) fn note_vm(&self, sb: &Arc<Sandbox>) {
        let mut vms = lock(&self.vms_with_disks);
        vms.retain(|w| w.strong_count() > 0);
        vms.push(Arc::downgrade(sb));
    }

    /// Every disk layer in use ([module docs](self)).
    fn disk_layers_in_use(&self) -> HashSet<PathBuf> {
        // Volume writers' layers (hibernated, stopped, or starting).
        let mut used = self.volumes.layers_in_use();
        let vms: Vec<Arc<Sandbox>> = lock(&self.vms_with_disks).iter().filter_map(Weak::upgrade).collect();
        for sb in vms {
            for chain in lock(&sb.slot_chains).iter() {
                used.extend(crate::disks::files(chain).cloned());
            }
            if let Some(vm) = lock(&sb.vm).vm.as_ref() {
                for (_, chain) in vm.disks() {
                    used.extend(crate::disks::files(&chain).cloned());
                }
            }
        }
        used
    }

    /// The sandbox disk of `sb`'s VM (the chain in [`crate::disks`]'s
    /// directory, not the shared root image): its size (bytes) and the
    /// host bytes only it holds (allocated blocks of the layers of its chain
    /// with one link: its top and what it froze that no template or
    /// hibernation kept; a template's layers, linked in and shared with
    /// its other sandboxes, are not counted), and the files of its chain.
    /// `None` without a VM or disk.
    pub(super) fn sandbox_disk_use(&self, sb: &Sandbox) -> Option<(u64, u64, u64)> {
        let (_, size, chain) = sb.own_disk()?;
        let own = crate::disks::unshared_bytes(
            crate::disks::files(&chain).filter(|f| f.parent() == Some(self.disk_plan.dir.as_path())),
        );
        let layers = crate::disks::files(&chain).count() as u64;
        Some((size, own, layers))
    }

    /// Removes the disk layers nothing uses ([module docs](self)).
    /// Blocking (directory walks, the VMs' transports locked in turn).
    pub(super) fn sweep_disks(&self) {
        crate::disks::sweep(&self.disk_plan.dir, &self.disk_layers_in_use(), MIN_AGE);
    }
}
