//! Disk admission: the sandboxes' own disks are sparse on the host but
//! accounted by their size, so that a guest meets ENOSPC from its own file
//! system when its disk is full rather than I/O errors from a host file
//! system that ran out under it. Every sandbox that holds its disk (live
//! or hibernated, [`super::SandboxState::holds_disk`]) takes its size of
//! a server-wide budget ([`crate::Limits::disk_budget_mib`]) and of its
//! tenant's quota ([`crate::limits::Quota::max_disk_mib`], checked in
//! [`super::quota`]); a create, branch or hand-out that does not fit is
//! refused at once. Templates, hibernations' memory and the warm pool's
//! sandboxes are outside it (the first two have their own limits,
//! `max_template_disk_mib` and `max_hibernated_disk_mib`).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{Manager, Sandbox, SandboxError, SandboxId};

/// The disk budget (MiB) for `configured` MiB of
/// [`crate::Limits::disk_budget_mib`] and sandboxes kept in `dir`: the
/// configured figure, or when it is 0 the size of `dir`'s file system
/// (none where it cannot be read).
pub(super) fn budget_mib(configured: u64, dir: &std::path::Path) -> u64 {
    match configured {
        0 => crate::store::fs_size_mib(dir).unwrap_or(u64::MAX),
        n => n,
    }
}

/// Sandboxes of `map` that hold a disk, and the MiB their disks take.
pub(super) fn disk_use<'a>(map: impl IntoIterator<Item = &'a Arc<Sandbox>>) -> (u64, u64) {
    map.into_iter()
        .filter(|s| s.disk_mib > 0 && s.state().holds_disk())
        .fold((0, 0), |(n, mib), s| (n + 1, mib + s.disk_mib))
}

impl Manager {
    /// The size (MiB) of a booted sandbox's disk: `default_disk_mib`, 0
    /// when sandboxes have no disk.
    pub(super) fn boot_disk_mib(&self) -> u64 {
        match self.disk_plan.blank {
            Some(_) => self.config.limits.default_disk_mib,
            None => 0,
        }
    }

    /// Checks that `n` more sandboxes with disks of `disk_mib` each fit the
    /// server's disk budget, given the sandboxes in `map` (called with the
    /// map locked, where they are put in it).
    ///
    /// Errors: [`SandboxError::DiskBudget`].
    pub(super) fn check_disk_budget(
        &self,
        map: &BTreeMap<SandboxId, Arc<Sandbox>>,
        n: usize,
        disk_mib: u64,
    ) -> Result<(), SandboxError> {
        let asked_mib = disk_mib.saturating_mul(n as u64);
        if asked_mib == 0 {
            return Ok(());
        }
        let (sandboxes, used_mib) = disk_use(map.values());
        let budget_mib = self.disk_budget_mib;
        if asked_mib > budget_mib.saturating_sub(used_mib) {
            return Err(SandboxError::DiskBudget { budget_mib, sandboxes, used_mib, asked_mib });
        }
        Ok(())
    }

    /// Checks that `n` more sandboxes with disks of `disk_mib` each fit
    /// the tenant's quota (`claim`, one sandbox's shape; `None`: no quota)
    /// and the server's disk budget, given the sandboxes in `map` (with
    /// the map locked): the checks a create, a branch, a pooled hand-out
    /// and [`Manager::reserve`] each make.
    ///
    /// Errors: [`SandboxError::Quota`], [`SandboxError::DiskBudget`].
    pub(super) fn check_fits(
        &self,
        map: &BTreeMap<SandboxId, Arc<Sandbox>>,
        n: usize,
        disk_mib: u64,
        claim: Option<&super::quota::Claim<'_>>,
    ) -> Result<(), SandboxError> {
        if let Some(claim) = claim {
            claim.check(map, n)?;
        }
        self.check_disk_budget(map, n, disk_mib)
    }
}

/// Disk use on the host (bytes), by kind, for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskBytes {
    /// Layers only live sandboxes hold (their tops and frozen layers no
    /// template or hibernation links to), in `<kept>/.disks`.
    pub sandbox_layers: u64,
    /// The templates' files (snapshot memory and state, disk layers).
    pub templates: u64,
    /// Kept sandboxes' files: hibernations (memory, state, disk layers),
    /// records and pinned template files.
    pub hibernations: u64,
    /// OCI images: pulled blobs (`DATA_DIR/images/oci`) and the base
    /// images built from them (`DATA_DIR/images/bases`).
    pub images: u64,
    /// Volumes' layers (`<kept>/volumes`).
    pub volumes: u64,
    /// The size of the disks live and hibernated sandboxes hold, as the
    /// disk budget counts them.
    pub reserved: u64,
    /// The disk budget ([`crate::Limits::disk_budget_mib`]).
    pub budget: u64,
}

impl Manager {
    /// Disk use on the host now, by kind. Blocking: walks the templates'
    /// and the kept sandboxes' directories (a file linked from two places
    /// counts in each place but `.disks`, whose files count only when
    /// nothing else links them; hibernations as their budget counts them,
    /// `Manager::kept_bytes`).
    pub fn disk_bytes(&self) -> DiskBytes {
        let layers_dir = self.config.kept_dir.join(crate::disks::DISKS_DIR);
        let sandbox_layers = std::fs::read_dir(&layers_dir)
            .map(|d| crate::disks::unshared_bytes(d.flatten().map(|e| e.path())))
            .unwrap_or(0);
        let reserved = disk_use(crate::lock(&self.sandboxes).values()).1 << 20;
        DiskBytes {
            sandbox_layers,
            templates: crate::store::disk_use(&self.config.templates_dir),
            hibernations: self.kept_bytes(),
            images: crate::store::disk_use(&self.config.images_dir.join("oci"))
                + crate::store::disk_use(&self.config.images_dir.join("bases")),
            volumes: crate::store::disk_use(&self.config.kept_dir.join(crate::volumes::VOLUMES_DIR)),
            reserved,
            budget: self.disk_budget_mib.saturating_mul(1 << 20),
        }
    }
}
