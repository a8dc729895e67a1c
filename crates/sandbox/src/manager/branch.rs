//! Branch and merge: a running sandbox becomes the parent of `n` children
//! restored from one branch point of it ([`vmm::RunningVm::branch`]), and a
//! child's VM can later take its parent's place.

use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(feature = "schema")]
use schemars::JsonSchema;
use serde::Serialize;
use vmm::BranchMode;

use super::backend::VmSource;
use super::control::PAUSE_TIMEOUT;
use super::lifecycle::ready_event;
use super::sandbox::{Sandbox, SandboxSetup, Transition};
use super::{remove_dir, task_failed, unix_ms, Manager, SandboxError, SandboxId, SandboxInfo, SandboxState};
use crate::events::EventKind;
use crate::lock;
use crate::memory::MemoryUse;
use crate::progress::{human_bytes, CallContext, ProgressSink};

/// What a branch made and what it cost.
#[derive(Clone, Debug, Serialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub struct BranchResult {
    /// The source sandbox.
    pub sandbox_id: SandboxId,
    /// The children, running, each from the source's state at the branch.
    pub children: Vec<SandboxInfo>,
    /// How the source's memory was copied: `write_protect` (the source ran
    /// on during the copy, each page copied before its first write) or
    /// `copy_while_paused`.
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub mode: BranchMode,
    /// Why the copy was made while paused, if it was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallback_reason: Option<String>,
    /// How long the source's vCPUs were stopped (ms).
    pub pause_ms: f64,
    /// From the pause until the branch point's memory was complete (ms).
    pub copy_ms: f64,
    /// Guest memory copied into the branch point (bytes; zero pages left out).
    pub memory_copied_bytes: u64,
    /// Pages copied early because the source was about to write them.
    pub pages_copied_before_write: u64,
    /// From the call until every child's agent answered (ms).
    pub ready_ms: u64,
}

impl Manager {
    /// Branches sandbox `id` into `n` children: each starts from the
    /// source's memory, processes, files and vCPU state at one instant, and
    /// gets fresh host entropy and the host clock. The source goes on
    /// running (a paused source stays paused). The children share the
    /// branch point's pages until they write them.
    ///
    /// If any child fails to start, none is kept.
    ///
    /// Errors: [`SandboxError::NotFound`], [`SandboxError::BadState`],
    /// [`SandboxError::BranchCount`], [`SandboxError::Branch`],
    /// [`SandboxError::ShuttingDown`], and those of starting a sandbox.
    pub async fn branch(self: &Arc<Self>, id: &str, n: usize) -> Result<BranchResult, SandboxError> {
        self.branch_with(id, n, &CallContext::default()).await
    }

    /// As [`Manager::branch`]; the children's owner is `cx.owner`, else
    /// the source's. Reports to `cx.progress` (progress: steps, of
    /// `n + 1`): "branch point taken (...)", then "children ready k/n" as
    /// each child's agent answers.
    ///
    /// Errors: as [`Manager::branch`].
    pub async fn branch_with(
        self: &Arc<Self>,
        id: &str,
        n: usize,
        cx: &CallContext,
    ) -> Result<BranchResult, SandboxError> {
        let (me, id, cx) = (self.clone(), id.to_string(), cx.clone());
        match tokio::spawn(async move { me.branch_inner(&id, n, &cx).await }).await {
            Ok(r) => r,
            Err(e) => Err(task_failed("branch task")(e)),
        }
    }

    async fn branch_inner(
        self: &Arc<Self>,
        id: &str,
        n: usize,
        cx: &CallContext,
    ) -> Result<BranchResult, SandboxError> {
        let started = Instant::now();
        let source = self.get(id)?;
        // In use: memory pressure and the cap do not hibernate it meanwhile.
        let _busy = source.mark_busy();
        // Children of a pooled sandbox carry its reseed and environment.
        source.handed_out().await?;
        self.awake(&source).await?;
        match source.state() {
            SandboxState::Running | SandboxState::Paused => {}
            state => return Err(SandboxError::BadState { id: source.id.clone(), state, what: "a branch" }),
        }
        // The count first: nothing below may be made n times (memory parts,
        // network controls, ids) before n is known to fit (`reserve` checks
        // again under the map's lock). At the cap, idle sandboxes make room.
        if (1..=self.config.limits.max_sandboxes).contains(&n) {
            self.check_kept(n)?;
            let claim = super::quota::Claim::of(cx, source.vcpus, source.memory_mib, source.disk_mib);
            self.check_fits(&lock(&self.sandboxes), n, source.disk_mib, claim.as_ref())?;
            self.make_room(n).await;
        }
        let room = self.config.limits.max_sandboxes.saturating_sub(self.live_count());
        if n == 0 || n > room {
            return Err(SandboxError::BranchCount { n, max: room });
        }
        // Admission: the children and the branch point are reserved before
        // anything is copied.
        let mib = source.memory_mib;
        let mut parts = vec![(MemoryUse::Sandbox, self.restored_charge_mib(mib, 0)); n];
        parts.push((MemoryUse::BranchPoint, mib));
        let mut memory = self.admit_or_hibernate("branch", &parts).await?;
        let mut point_memory = memory.pop();
        let children = self.reserve_children(&source, n, cx)?;
        for (child, r) in children.iter().zip(memory) {
            lock(&child.memory).own = Some(r);
        }
        let src = source.clone();
        let taken = tokio::task::spawn_blocking(move || {
            let _control = src.control.blocking_lock();
            let taken = lock(&src.vm).vm.as_ref().map(|vm| vm.branch(PAUSE_TIMEOUT));
            match taken {
                Some(r) => r.map_err(|source| SandboxError::Branch { id: src.id.clone(), source }),
                None => Err(SandboxError::BadState { id: src.id.clone(), state: src.state(), what: "a branch" }),
            }
        })
        .await
        .unwrap_or_else(|e| Err(task_failed("branch task")(e)));
        let point = match taken {
            Ok(t) => t,
            Err(e) => {
                self.discard(&children).await;
                return Err(e);
            }
        };
        // The branch froze the tops of the parent's volumes.
        self.note_volume_chains(&source).await;
        let image = point.image;
        let total = Some(n as f64 + 1.0);
        cx.progress.report(
            1.0,
            total,
            format!(
                "branch point taken ({}, paused {:.1} ms, {} copied)",
                mode_name(point.mode),
                ms(point.pause),
                human_bytes(point.bytes_written)
            ),
        );
        // The branch point holds what was copied (zero pages left out), for
        // as long as a child runs from it.
        if let Some(r) = point_memory.as_mut() {
            r.shrink_to(point.bytes_written.div_ceil(1 << 20));
        }
        let point_memory = point_memory.map(Arc::new);
        for child in &children {
            lock(&child.memory).branch_point = point_memory.clone();
        }
        drop(point_memory);
        let mut boots = tokio::task::JoinSet::new();
        for child in &children {
            let (me, child, image) = (self.clone(), child.clone(), image.clone());
            boots.spawn(async move {
                let quiet = ProgressSink::none();
                me.start(&child, VmSource::Branch(image), &quiet, Instant::now())
                    .await
                    .map_err(|e| format!("{}: {e}", child.id))
            });
        }
        let mut failed = Vec::new();
        let mut ready = 0;
        while let Some(r) = boots.join_next().await {
            match r {
                Ok(Ok(())) => {
                    ready += 1;
                    cx.progress.report(1.0 + ready as f64, total, format!("children ready {ready}/{n}"));
                }
                Ok(Err(e)) => failed.push(e),
                Err(e) => failed.push(e.to_string()),
            }
        }
        drop(image);
        if !failed.is_empty() {
            self.discard(&children).await;
            return Err(SandboxError::BranchChildren {
                id: source.id.clone(),
                failed: failed.len(),
                n,
                first: failed.swap_remove(0),
            });
        }
        lock(&source.lineage).children.extend(children.iter().map(|c| c.id.clone()));
        for child in &children {
            ready_event(child, format!("branch:{}", source.id));
            self.record_in_background(child);
        }
        self.record_in_background(&source);
        self.shorten_disk_chains(std::iter::once(source.clone()).chain(children.iter().cloned()).collect());
        let ready_ms = started.elapsed().as_millis() as u64;
        tracing::info!(sandbox = %source.id, n, mode = ?point.mode, pause = ?point.pause, "branched; children ready in {ready_ms} ms");
        Ok(BranchResult {
            sandbox_id: source.id.clone(),
            children: children.iter().map(|c| c.info(None)).collect(),
            mode: point.mode,
            fallback_reason: point.fallback_reason,
            pause_ms: ms(point.pause),
            copy_ms: ms(point.total),
            memory_copied_bytes: point.bytes_written,
            pages_copied_before_write: point.pages_copied_before_write,
            ready_ms,
        })
    }

    /// Puts `n` children of `source` in the map, starting, within the
    /// live-sandbox cap. The caller has checked `n` against the cap: a
    /// network control is made per child first.
    fn reserve_children(
        &self,
        source: &Sandbox,
        n: usize,
        cx: &CallContext,
    ) -> Result<Vec<Arc<Sandbox>>, SandboxError> {
        let owner = cx.owner.or(source.owner());
        let branched_at = unix_ms();
        let mut nets = (0..n).map(|_| self.inherit_net(source)).collect::<Result<Vec<_>, _>>()?;
        let claim = super::quota::Claim::of(cx, source.vcpus, source.memory_mib, source.disk_mib);
        let made = self.reserve(n, source.disk_mib, claim.as_ref(), |id, dir| {
            let setup = SandboxSetup {
                labels: source.labels(),
                template: source.template.clone(),
                idle_timeout: source.idle_timeout(),
                owner,
                // A child belongs to its source's tenant, whoever branched.
                tenant: source.tenant(),
                events: Some(self.events.clone()),
                disk_mib: source.disk_mib,
                rootfs: source.rootfs.clone(),
            };
            let child = Sandbox::new(id, dir, source.vcpus, source.memory_mib, setup);
            *lock(&child.net) = nets.pop().flatten();
            // Its source's secrets, placeholders and all (its processes
            // hold them), as bindings of its own: a detach in the child
            // leaves the source's as they are.
            *lock(&child.secrets) = lock(&source.secrets).clone();
            // The parent's volumes: a read-only one is read by the child
            // too; a writable one becomes the child's copy-on-write view
            // (its slot gets a new top over what the branch froze), which
            // never reaches the volume.
            *lock(&child.volumes) = lock(&source.volumes)
                .iter()
                .map(|v| {
                    let shared = v.read_only && v.shared;
                    if shared {
                        self.volumes.note_reader(&v.stored, &child.id);
                    }
                    crate::volumes::AttachedVolume { shared, ..v.clone() }
                })
                .collect();
            {
                let mut l = lock(&child.lineage);
                l.parent = Some(source.id.clone());
                l.branched_at_ms = Some(branched_at);
            }
            child
        });
        match made {
            Err(SandboxError::TooMany { live, max }) => {
                Err(SandboxError::BranchCount { n, max: max.saturating_sub(live) })
            }
            Ok(children) => {
                for c in &children {
                    self.attach_handoff(c);
                }
                Ok(children)
            }
            r => r,
        }
    }

    /// Removes children that will not be kept: out of the map, VMs
    /// stopped, files removed.
    async fn discard(&self, children: &[Arc<Sandbox>]) {
        for child in children {
            self.teardown(child, Some("discarded".into())).await;
        }
    }

    /// Takes `sb` out of its parent's list of children (when it is killed).
    pub(super) fn leave_parent(&self, sb: &Sandbox) {
        let parent = lock(&sb.lineage).parent.clone();
        if let Some(parent) = parent.and_then(|p| lock(&self.sandboxes).get(&p).cloned()) {
            lock(&parent.lineage).children.retain(|c| *c != sb.id);
        }
    }

    /// Merges `winner` into `parent`, an ancestor it was branched from: the
    /// parent's VM is stopped and `parent` now names the winner's VM
    /// (memory, processes, files), its labels, idle timeout and lineage
    /// kept; `winner` no longer exists; the winner's children become the
    /// parent's; other children of the parent are untouched.
    ///
    /// Errors: [`SandboxError::NotFound`], [`SandboxError::Gone`] (either
    /// was killed or merged away while this merge waited for it),
    /// [`SandboxError::NotDescendant`], [`SandboxError::BadState`] (a
    /// winner that is not running or paused, or a parent still starting),
    /// [`SandboxError::Io`].
    pub async fn merge_into(self: &Arc<Self>, winner: &str, parent: &str) -> Result<SandboxInfo, SandboxError> {
        let (w, p) = (self.get(winner)?, self.get(parent)?);
        w.handed_out().await?;
        p.handed_out().await?;
        self.check_descendant(&w, &p)?;
        // The winner's VM moves over: it must run. A hibernated parent's
        // hibernation is dropped with its VM.
        self.awake(&w).await?;
        let me = self.clone();
        let (w2, p2) = (w.clone(), p.clone());
        let merged = tokio::task::spawn_blocking(move || me.merge_blocking(&w2, &p2))
            .await
            .map_err(task_failed("merge task"))??;
        self.note_volume_chains(&p).await;
        tracing::info!(winner = %w.id, parent = %p.id, "merged: {} now runs {}'s VM", p.id, w.id);
        p.emit(EventKind::Merged { winner: w.id.clone() });
        Ok(merged)
    }

    /// Whether `parent` is among `w`'s ancestors (followed through live
    /// sandboxes).
    fn check_descendant(&self, w: &Sandbox, parent: &Sandbox) -> Result<(), SandboxError> {
        let mut chain = Vec::new();
        let mut cur = lock(&w.lineage).parent.clone();
        while let Some(id) = cur {
            chain.push(id.clone());
            if id == parent.id {
                return Ok(());
            }
            if chain.len() > 10_000 {
                break;
            }
            cur = lock(&self.sandboxes).get(&id).and_then(|s| lock(&s.lineage).parent.clone());
        }
        let lineage =
            if chain.is_empty() { "not branched".to_string() } else { format!("branched from {}", chain.join(" <- ")) };
        Err(SandboxError::NotDescendant { winner: w.id.clone(), parent: parent.id.clone(), lineage })
    }

    /// The merge itself, under both sandboxes' `control`; returns the
    /// parent as the merge left it (a kill waiting for `control` may end
    /// it right after).
    fn merge_blocking(&self, w: &Arc<Sandbox>, p: &Arc<Sandbox>) -> Result<SandboxInfo, SandboxError> {
        // Ancestor before descendant, as every merge takes them.
        let _pc = p.control.blocking_lock();
        let _wc = w.control.blocking_lock();
        // A kill of either that had `control` first: it is gone, whatever
        // state the kill left it in.
        for sb in [p, w] {
            if !lock(&self.sandboxes).get(&sb.id).is_some_and(|s| Arc::ptr_eq(s, sb)) {
                return Err(sb.gone());
            }
        }
        let (w_state, w_boot_ms) = {
            let st = lock(&w.status);
            (st.state, st.boot_ms)
        };
        if !matches!(w_state, SandboxState::Running | SandboxState::Paused) {
            return Err(SandboxError::BadState { id: w.id.clone(), state: w_state, what: "a merge (as the winner)" });
        }
        if p.state() == SandboxState::Starting {
            return Err(SandboxError::Starting(p.id.clone()));
        }
        // Both must still be the sandboxes of the map (a kill of either
        // may have had `control` first), and the winner must still have its VM, before the
        // winner leaves the map and its VM, agent and files move over.
        {
            let mut map = lock(&self.sandboxes);
            for sb in [p, w] {
                if !map.get(&sb.id).is_some_and(|s| Arc::ptr_eq(s, sb)) {
                    drop(map);
                    return Err(sb.gone());
                }
            }
            if lock(&w.vm).vm.is_none() {
                drop(map);
                return Err(SandboxError::BadState {
                    id: w.id.clone(),
                    state: w.state(),
                    what: "a merge (as the winner)",
                });
            }
            map.remove(&w.id);
        }
        let slot = std::mem::take(&mut *lock(&w.vm));
        let agent = lock(&w.status).agent.take();
        // The winner's monitor thread ends with the VM and finds the
        // winner gone; the parent gets a monitor of its own below.
        drop(slot.monitor);
        let Some(vm) = slot.vm else {
            // Its VM ended since the check: the winner is out of the map
            // already, so its files go now.
            remove_dir(&w.dir());
            return Err(SandboxError::BadState { id: w.id.clone(), state: w.state(), what: "a merge (as the winner)" });
        };
        let watch = vm.exit_watch();

        p.stop_vm();
        // A hibernated parent's saved state is replaced by the winner's VM.
        if let Some(old) = lock(&p.hibernation).take() {
            remove_dir(&old.dir);
        }
        let base = std::mem::take(&mut *lock(&w.base));
        *lock(&p.base) = base;
        let pin = lock(&w.pin).take();
        *lock(&p.pin) = pin;
        // The parent's share went with its VM; the winner's comes along.
        let held = std::mem::take(&mut *lock(&w.memory));
        *lock(&p.memory) = held;
        let old_dir = p.dir();
        *lock(&p.dir) = w.dir();
        remove_dir(&old_dir);
        lock(&p.vm).vm = Some(vm);
        // The winner's NAT runs in its VM, with the winner's control.
        let net = lock(&w.net).take();
        *lock(&p.net) = net;
        // The winner's VM holds the winner's placeholders.
        let secrets = lock(&w.secrets).clone();
        *lock(&p.secrets) = secrets;
        self.attach_handoff(p);
        let _ = p.transition(Transition::TakeOver { to: w_state, boot_ms: w_boot_ms, agent });
        if let Err(e) = p.spawn_monitor(watch) {
            tracing::error!(sandbox = %p.id, "cannot start a monitor thread after the merge: {e}; a crash will not be noticed")
        }
        let grandchildren = std::mem::take(&mut lock(&w.lineage).children);
        {
            let mut l = lock(&p.lineage);
            l.children.retain(|c| *c != w.id);
            l.children.extend(grandchildren.iter().cloned());
            l.merged_from = Some(w.id.clone());
            l.merged_at_ms = Some(unix_ms());
        }
        for id in &grandchildren {
            if let Some(c) = lock(&self.sandboxes).get(id).cloned() {
                lock(&c.lineage).parent = Some(p.id.clone());
            }
        }
        // In case the winner's own parent was in between.
        self.leave_parent(w);
        // The parent keeps its volumes, now in the winner's slots: a
        // writable one continues on the winner's view (what the winner
        // wrote to it reaches the volume at the parent's release, as the
        // rest of the winner's state replaces the parent's); the
        // winner's read-only ones were the parent's too.
        for v in std::mem::take(&mut *lock(&w.volumes)).iter().filter(|v| v.shared) {
            if let Err(e) = self.volumes.release(&v.stored, &w.id, None) {
                tracing::warn!(sandbox = %w.id, volume = %v.name, "{e}");
            }
        }
        w.end(SandboxState::Stopped, Some(format!("merged into {}", p.id)));
        self.remove_record(&w.id);
        self.record_in_background(p);
        p.touch();
        Ok(p.info(None))
    }
}

/// A branch mode's name, as [`BranchResult::mode`] serializes it.
fn mode_name(mode: BranchMode) -> String {
    serde_json::to_value(mode).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_else(|| format!("{mode:?}"))
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `mode` serializes as the strings it was before it became
    /// [`BranchMode`] (and its schema, with feature `schema`, is a string).
    #[test]
    fn branch_mode_serializes_as_before() {
        let result = |mode| BranchResult {
            sandbox_id: "sb-1".into(),
            children: Vec::new(),
            mode,
            fallback_reason: None,
            pause_ms: 0.0,
            copy_ms: 0.0,
            memory_copied_bytes: 0,
            pages_copied_before_write: 0,
            ready_ms: 0,
        };
        let v = serde_json::to_value(result(BranchMode::WriteProtect)).unwrap();
        assert_eq!(v["mode"], "write_protect");
        let v = serde_json::to_value(result(BranchMode::CopyWhilePaused)).unwrap();
        assert_eq!(v["mode"], "copy_while_paused");
        #[cfg(feature = "schema")]
        {
            let schema = serde_json::to_value(schemars::schema_for!(BranchResult)).unwrap();
            assert_eq!(schema["properties"]["mode"]["type"], "string");
        }
    }
}
