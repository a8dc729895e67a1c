//! Short disk chains for live sandboxes ([`crate::disks`]).
//!
//! Each branch freezes the source's disk top when it was written since the
//! last capture, so a sandbox branched again and again (a tree search that
//! keeps its root) grows its chain by a layer each time, and so do the
//! children, which start over the same frozen chain. After a branch whose
//! chain has more than [`crate::Limits::max_disk_layers`] frozen layers,
//! those layers are merged into one ([`tine_storage::flatten`]) on the
//! blocking pool, off every pause, and put under the source's and the
//! children's tops in place of the chain they share
//! ([`tine_storage::Disk::replace_lower`]): one copy for all of them. The
//! guest sees the same bytes before and after. Resumes and templates keep
//! their chains short themselves ([`crate::disks::shallow`]).

use std::sync::Arc;

use tine_storage::ChainSpec;

use super::{Manager, Sandbox};
use crate::lock;

/// `sb`'s own disk ([`super::Sandbox::own_disk`]): its index among the
/// VM's disks and the frozen chain below the top. `None` without a VM or a
/// disk.
fn disk_below(sb: &Sandbox) -> Option<(usize, ChainSpec)> {
    let (index, _, chain) = sb.own_disk()?;
    Some((index, ChainSpec { top: None, ..chain }))
}

impl Manager {
    /// After a branch of `sandboxes[0]` into the rest: merges the frozen
    /// chain they share when it is too deep and puts the merged layer
    /// under each of them ([module docs](self)). In the background; a
    /// failure is logged and leaves the chains as they were.
    pub(super) fn shorten_disk_chains(self: &Arc<Self>, sandboxes: Vec<Arc<Sandbox>>) {
        let Some((index, below)) = sandboxes.first().and_then(|s| disk_below(s)) else { return };
        if below.frozen.len() <= self.disk_plan.max_frozen_layers {
            return;
        }
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.shorten_blocking(&sandboxes, index, &below));
    }

    /// [`Manager::shorten_disk_chains`]'s work: one flatten, then a swap
    /// under disk `index` (a branch's source and children have the same
    /// disks) of each sandbox; the swap itself leaves alone a disk that no
    /// longer has `below` under its top. Blocking.
    fn shorten_blocking(&self, sandboxes: &[Arc<Sandbox>], index: usize, below: &ChainSpec) {
        let t = std::time::Instant::now();
        let flat = match tine_storage::chain::new_layer_path(&self.disk_plan.dir)
            .and_then(|out| tine_storage::flatten(below, &out))
        {
            Ok(flat) => flat,
            Err(e) => {
                tracing::warn!(layers = below.frozen.len(), "disk chain not merged: {e}");
                return;
            }
        };
        let mut swapped = 0;
        for sb in sandboxes {
            let slot = lock(&sb.vm);
            let Some(vm) = slot.vm.as_ref() else { continue };
            match vm.replace_disk_lower(index, below, &flat) {
                Ok(true) => swapped += 1,
                Ok(false) => {}
                Err(e) => tracing::warn!(sandbox = %sb.id, "merged disk layers not put under the disk: {e}"),
            }
        }
        if swapped == 0 {
            // Nothing took it (all captured or ended meanwhile).
            for f in &flat.frozen {
                let _ = std::fs::remove_file(f);
            }
        }
        tracing::info!(
            layers = below.frozen.len(),
            sandboxes = swapped,
            took_ms = t.elapsed().as_millis() as u64,
            "disk chain merged into one layer"
        );
    }
}
