//! Hibernation: a sandbox's memory, vCPU and device state go to disk and
//! its VM is freed ([`Manager::hibernate`]); any call that needs the guest
//! restores it ([`Manager::wake`]). See `docs/design/hibernate.md`.
//!
//! On disk, under [`super::ManagerConfig::kept_dir`]:
//!
//! ```text
//! <kept>/<id>/hib-<g>/        state + pages (vmm::RunningVm::hibernate), synced
//! <kept>/<id>/hib-<g>.tmp/    a hibernation being written (removed on failure)
//! ```
//!
//! A hibernation is written against the memory the sandbox's VM was
//! restored from (its [`Base`]: a template), so an idle sandbox made from
//! a template costs the pages it changed. A branch child's base is its
//! branch point, which lives in memory only: it is hibernated whole.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::backend::{Base, VmSource};
use super::control::PAUSE_TIMEOUT;
use super::sandbox::{Hibernated, Transition};
use super::{remove_dir, task_failed, unix_ms, Manager, Sandbox, SandboxError, SandboxInfo, SandboxState};
use crate::events::EventKind;
use crate::lock;
use crate::memory::MemoryUse;
use crate::progress::ProgressSink;
use crate::templates::{FileIdentity, Template};

/// Why a sandbox is hibernated (its event's `why`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HibernateWhy {
    /// A client asked (`pause` to disk).
    Request,
    /// It was idle past its idle timeout.
    Idle,
    /// The server is stopping.
    Shutdown,
    /// A create, branch or resume needed its share of the memory budget.
    Memory,
    /// The host's available memory fell below the watermark
    /// ([`crate::Limits::min_available_mib`]).
    Watermark,
    /// A create, branch or resume from disk found `max_sandboxes` running.
    Cap,
}

impl HibernateWhy {
    fn name(self) -> &'static str {
        match self {
            HibernateWhy::Request => "request",
            HibernateWhy::Idle => "idle",
            HibernateWhy::Shutdown => "shutdown",
            HibernateWhy::Memory => "memory",
            HibernateWhy::Watermark => "watermark",
            HibernateWhy::Cap => "cap",
        }
    }
}

/// Numbers the hibernations of this process, so a new one never reuses a
/// directory name.
static GENERATION: AtomicU64 = AtomicU64::new(1);

/// The directory, in the kept directory, of pinned template generations
/// (`<kept>/.bases/<key>/{state,memory}`, hard links to a template's
/// files): hibernations are written against them and resumed over them,
/// also after the template was rebuilt or deleted.
pub(super) const BASES_DIR: &str = ".bases";

/// A sandbox's directory of kept state.
pub(super) fn kept_dir_of(kept: &Path, id: &str) -> PathBuf {
    kept.join(id)
}

impl Manager {
    /// Hibernates a running or paused sandbox: its memory (the pages that
    /// differ from the template it was restored from), vCPU and device
    /// state are written to the data directory and synced, then its VM is
    /// stopped and its memory freed. Processes, files, variables and the
    /// network policy stay; host connections through the NAT are reset. The
    /// next call that needs the guest (exec, Python, files, processes,
    /// branch, snapshot, merge, resume) restores it. Hibernating a
    /// hibernated sandbox does nothing.
    ///
    /// A hibernation that fails (disk full, I/O error) leaves the sandbox
    /// as it was (running or paused) and says why.
    ///
    /// Errors: [`SandboxError::NotFound`], [`SandboxError::Starting`],
    /// [`SandboxError::BadState`], [`SandboxError::Pause`],
    /// [`SandboxError::Hibernate`].
    pub async fn hibernate(&self, id: &str) -> Result<SandboxInfo, SandboxError> {
        let sb = self.get(id)?;
        sb.handed_out().await?;
        self.hibernate_sandbox(&sb, HibernateWhy::Request).await?;
        Ok(sb.info(None))
    }

    /// Hibernates `sb` for `why`, under its `control` lock, off the async
    /// threads.
    ///
    /// Errors: as [`Manager::hibernate`].
    pub(super) async fn hibernate_sandbox(&self, sb: &Arc<Sandbox>, why: HibernateWhy) -> Result<(), SandboxError> {
        let (me, s) = (self.me.upgrade().ok_or(SandboxError::ShuttingDown)?, sb.clone());
        // A paused one's were synced at its pause.
        if sb.state() == SandboxState::Running {
            self.sync_volumes(sb).await;
        }
        tokio::task::spawn_blocking(move || me.hibernate_blocking(&s, why))
            .await
            .map_err(task_failed("hibernate task"))?
    }

    /// Restores hibernated sandbox `sb` (under its `control` lock): its
    /// memory is admitted, its VM restored from its hibernation and its
    /// agent reconnected; it is `running` after, and its hibernation is
    /// removed. Does nothing if it is not hibernated.
    ///
    /// A hibernation that cannot be restored (damaged, its base gone)
    /// leaves the sandbox `failed` with the reason; its files stay until
    /// it is killed.
    ///
    /// Errors: [`SandboxError::TooMany`] (`max_sandboxes` running, none
    /// idle to hibernate), [`SandboxError::Quota`] (its tenant's live
    /// sandboxes, vCPUs or memory), [`SandboxError::OverBudget`],
    /// [`SandboxError::HostMemoryLow`] (it stays hibernated),
    /// [`SandboxError::Gone`], [`SandboxError::Wake`].
    pub(super) async fn wake(&self, sb: &Arc<Sandbox>) -> Result<(), SandboxError> {
        let _control = sb.control.lock().await;
        if sb.state() != SandboxState::Hibernated {
            return Ok(());
        }
        if !self.contains(&sb.id) {
            return Err(sb.gone());
        }
        let Some(dir) = lock(&sb.hibernation).as_ref().map(|h| h.dir.clone()) else {
            return Err(SandboxError::Wake { id: sb.id.clone(), reason: "its hibernation is not recorded".into() });
        };
        let t0 = Instant::now();
        // At the live-sandbox cap, an idle one makes room (it counts
        // running ones; a soft cap here: a create at the same moment may
        // pass it by one).
        self.make_room(1).await;
        let (live, max) = (self.live_count(), self.config.limits.max_sandboxes);
        if live >= max {
            return Err(SandboxError::TooMany { live, max });
        }
        self.check_wake_claim(sb)?;
        let charge = self.restored_charge_mib(sb.memory_mib, crate::store::disk_use(&dir));
        let memory = self.admit_or_hibernate("resume from disk", &[(MemoryUse::Sandbox, charge)]).await?.pop();
        if sb.transition(Transition::Wake).is_err() {
            return Err(sb.gone());
        }
        lock(&sb.memory).own = memory;
        let base = lock(&sb.base).clone();
        tracing::info!(sandbox = %sb.id, "resuming from disk ({})", dir.display());
        match self.start(sb, VmSource::Hibernated { dir: dir.clone(), base }, &ProgressSink::default(), t0).await {
            Ok(()) => {
                *lock(&sb.hibernation) = None;
                // Running again: a crash from now on loses it (and says so).
                if let Err(e) = self.write_record(sb, lock(&sb.pin).clone(), None) {
                    tracing::warn!(sandbox = %sb.id, "cannot write its record: {e}");
                }
                remove_dir(&dir);
                let ms = t0.elapsed().as_millis() as u64;
                tracing::info!(sandbox = %sb.id, "resumed from disk in {ms} ms");
                sb.emit(EventKind::Woken { ms });
                Ok(())
            }
            Err(e) => {
                let s = sb.clone();
                let _ = tokio::task::spawn_blocking(move || s.stop_vm()).await;
                let _ = std::fs::remove_file(sb.dir().join("vsock.sock"));
                if !matches!(e, SandboxError::Start(_)) {
                    // Not the files (a boot timeout under load, a shutdown):
                    // it stays hibernated, to be resumed by a later call.
                    let _ = sb.transition(Transition::Restored { to: SandboxState::Hibernated, error: None });
                    tracing::warn!(sandbox = %sb.id, "resuming from disk failed, it stays hibernated: {e}");
                    return Err(e);
                }
                let reason = format!("resuming from its hibernation failed: {e}");
                tracing::warn!(sandbox = %sb.id, "{reason}");
                sb.end(SandboxState::Failed, Some(reason.clone()));
                let _ = self.write_record(sb, lock(&sb.pin).clone(), None);
                Err(SandboxError::Wake { id: sb.id.clone(), reason })
            }
        }
    }

    /// Pins template `t`'s files for hibernations: hard links to its
    /// `state` and `memory` in `<kept>/.bases/<key>` (a sparse copy across
    /// file systems), made once per template generation; returns the key.
    /// The links are checked to be the files `t` was loaded from, so a
    /// template rebuilt since is not mistaken for it.
    ///
    /// Errors: why it cannot be pinned (I/O, a rebuilt template).
    fn pin_template(&self, t: &Template) -> Result<String, String> {
        let key = format!("t-{}-{}-{:08x}", t.meta.name, t.meta.created_at_ms, t.snapshot.memory_crc32);
        let bases = self.config.kept_dir.join(BASES_DIR);
        let dest = bases.join(&key);
        if dest.join(vmm::snapshot::MEMORY_FILE).exists() {
            return Ok(key);
        }
        let tmp = bases.join(format!("{key}.tmp"));
        remove_dir(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| format!("create {}: {e}", tmp.display()))?;
        let pinned = (|| {
            let changed = || format!("template {} was rebuilt since it was loaded", t.meta.name);
            for (name, want) in t.file_identities() {
                let (from, to) = (self.templates.path(&t.meta.name).join(name), tmp.join(name));
                let io = |what: &str, p: &Path| {
                    let what = format!("{what} {}", p.display());
                    move |e: std::io::Error| format!("{what}: {e}")
                };
                if std::fs::hard_link(&from, &to).is_ok() {
                    // The same inode, or a newer generation's: compare.
                    if FileIdentity::of(&to).map_err(io("stat", &to))? != *want {
                        return Err(changed());
                    }
                    continue;
                }
                // Another file system: copy from a handle checked first.
                let mut src = std::fs::File::open(&from).map_err(io("open", &from))?;
                if FileIdentity::of_file(&src).map_err(io("stat", &from))? != *want {
                    return Err(changed());
                }
                let mut dst = std::fs::File::create(&to).map_err(io("create", &to))?;
                std::io::copy(&mut src, &mut dst).map_err(io("copy to", &to))?;
            }
            crate::store::commit(&tmp, &dest, true).map_err(|e| e.to_string())
        })();
        if pinned.is_err() {
            remove_dir(&tmp);
        }
        pinned.map(|()| key)
    }

    /// Restores `sb` if it is hibernated: the first step of every call that
    /// needs the guest.
    ///
    /// Errors: as [`Manager::wake`].
    pub(super) async fn awake(&self, sb: &Arc<Sandbox>) -> Result<(), SandboxError> {
        if sb.state() == SandboxState::Hibernated {
            self.wake(sb).await?;
        }
        Ok(())
    }
}

/// Hibernates `sb` (see [`Manager::hibernate`]). Blocking.
impl Manager {
    /// The disk budget (MiB) of kept sandboxes' files:
    /// `max_hibernated_disk_mib`, or half the size of the kept directory's
    /// file system (no limit where it cannot be read).
    fn hibernation_disk_budget_mib(&self) -> u64 {
        match self.config.limits.max_hibernated_disk_mib {
            0 => crate::store::fs_size_mib(&self.config.kept_dir).map_or(u64::MAX, |mib| mib / 2),
            n => n,
        }
    }

    /// Bytes the kept sandboxes' files take (hibernations with their disk
    /// layers, records, pinned template files): the kept directory but
    /// `.disks`, where live sandboxes' layers are, and the volumes.
    pub(super) fn kept_bytes(&self) -> u64 {
        let kept = &self.config.kept_dir;
        crate::store::disk_use_except(kept, &kept.join(crate::disks::DISKS_DIR))
            .saturating_sub(crate::store::disk_use(&kept.join(crate::volumes::VOLUMES_DIR)))
    }

    fn hibernate_blocking(&self, sb: &Sandbox, why: HibernateWhy) -> Result<(), SandboxError> {
        let kept = &self.config.kept_dir;
        let retention_ms = self.config.limits.hibernated_retention_secs.saturating_mul(1000);
        let _control = sb.control.blocking_lock();
        match sb.state() {
            SandboxState::Hibernated => return Ok(()),
            SandboxState::Running | SandboxState::Paused => {}
            SandboxState::Starting => return Err(SandboxError::Starting(sb.id.clone())),
            state => return Err(SandboxError::BadState { id: sb.id.clone(), state, what: "hibernation" }),
        }
        let failed = |reason: String| SandboxError::Hibernate { id: sb.id.clone(), reason };
        // Not at shutdown: a sandbox not hibernated then is lost, and the
        // disk itself is the limit.
        let budget_mib = self.hibernation_disk_budget_mib();
        // Live sandboxes' disk layers are not kept state (a hibernation's
        // layers are: it holds links to them in its own directory).
        let used_mib = if why == HibernateWhy::Shutdown { 0 } else { self.kept_bytes() >> 20 };
        if used_mib >= budget_mib {
            return Err(failed(format!(
                "the kept sandboxes' files take {used_mib} MiB, the server's hibernation disk budget is {budget_mib} MiB \
                 (max_hibernated_disk_mib); kill hibernated sandboxes you no longer need"
            )));
        }
        let sandbox_dir = kept_dir_of(kept, &sb.id);
        let g = GENERATION.fetch_add(1, Ordering::Relaxed);
        let (tmp, dir) = (sandbox_dir.join(format!("hib-{g}.tmp")), sandbox_dir.join(format!("hib-{g}")));
        std::fs::create_dir_all(&tmp).map_err(|e| failed(format!("cannot create {}: {e}", tmp.display())))?;
        // What the hibernation is written against must outlive this process:
        // a template's files are pinned (once per template generation); a
        // branch point lives in this process only, so a child is written whole.
        // The pin is made and given to the sandbox under `records`, so a
        // concurrent kill's removal of unused pins cannot take it.
        let current = lock(&sb.base).clone();
        let records = lock(&self.records);
        let (base, pin) = match current {
            Base::Template(t) => match self.pin_template(&t) {
                Ok(pin) => (Base::Template(t), Some(pin)),
                Err(e) => {
                    tracing::warn!(sandbox = %sb.id, "cannot pin template {} ({e}); writing its whole memory", t.meta.name);
                    (Base::None, None)
                }
            },
            Base::Pinned(dir) => {
                let pin = dir.file_name().map(|n| n.to_string_lossy().into_owned());
                (Base::Pinned(dir), pin)
            }
            Base::Branch(_) | Base::None => (Base::None, None),
        };
        if pin.is_some() {
            *lock(&sb.pin) = pin.clone();
        }
        drop(records);
        let at_ms = unix_ms();
        let hibernated = Hibernated { dir: dir.clone(), at_ms, expires_at_ms: at_ms.saturating_add(retention_ms) };
        let (was_paused, written) = {
            let slot = lock(&sb.vm);
            let Some(vm) = slot.vm.as_ref() else {
                drop(slot);
                remove_dir(&tmp);
                return Err(SandboxError::BadState { id: sb.id.clone(), state: sb.state(), what: "hibernation" });
            };
            let was_paused = vm.is_paused();
            if !was_paused {
                if let Err(source) = vm.pause(PAUSE_TIMEOUT) {
                    drop(slot);
                    remove_dir(&tmp);
                    return Err(SandboxError::Pause { id: sb.id.clone(), source });
                }
            }
            let r = vm.hibernate(&tmp, &base).map_err(|e| e.to_string()).and_then(|h| {
                std::fs::rename(&tmp, &dir).map_err(|e| format!("cannot rename {}: {e}", tmp.display()))?;
                crate::store::sync_dir(&sandbox_dir).map_err(|e| e.to_string())?;
                Ok(h)
            });
            (was_paused, r)
        };
        // The commit (the VM's lock released: the record takes the map's):
        // from here a restart lists it hibernated.
        let written =
            written.and_then(|h| self.write_record(sb, pin.clone(), Some(&hibernated)).map(|()| (h, hibernated)));
        if written.is_err() && !was_paused {
            if let Some(vm) = lock(&sb.vm).vm.as_ref() {
                vm.resume();
            }
        }
        let (h, hibernated) = match written {
            Ok(h) => h,
            Err(reason) => {
                remove_dir(&tmp);
                remove_dir(&dir);
                tracing::warn!(sandbox = %sb.id, "hibernation failed, the sandbox keeps running: {reason}");
                return Err(failed(reason));
            }
        };
        if sb.transition(Transition::Hibernate).is_err() {
            // It ended while the hibernation was written (its VM crashed).
            remove_dir(&dir);
            let _ = self.write_record(sb, None, None);
            return Err(SandboxError::BadState { id: sb.id.clone(), state: sb.state(), what: "hibernation" });
        }
        let previous = lock(&sb.hibernation).replace(hibernated).map(|h| h.dir);
        sb.stop_vm();
        // The agent's socket goes with the VM; the console log stays.
        let _ = std::fs::remove_file(sb.dir().join("vsock.sock"));
        if !h.based {
            *lock(&sb.base) = Base::None;
        }
        if let Some(old) = previous {
            remove_dir(&old);
        }
        let ms = h.took.as_millis() as u64;
        tracing::info!(sandbox = %sb.id, why = why.name(), based = h.based,
        "hibernated: {} KiB written in {ms} ms; its VM is freed", h.bytes >> 10);
        sb.emit(EventKind::Hibernated { why: why.name().into(), bytes: h.bytes, ms });
        Ok(())
    }
}

impl Manager {
    /// Refuses new sandboxes and calls from now on, ahead of
    /// [`Manager::shutdown_keeping`]: an MCP session that ends after this
    /// leaves its sandbox to be kept ([`Manager::is_shutting_down`]).
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.slots.close();
    }

    /// Whether the manager is shutting down.
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Stops the manager keeping every sandbox (SIGTERM, SIGINT): the
    /// running and paused ones are hibernated in parallel within
    /// [`crate::Limits::shutdown_hibernate_secs`]; each sandbox's record
    /// says what it is, so the next start lists them all again with the
    /// same ids. A sandbox that could not be hibernated in time (or at
    /// all) has its VM stopped and is recorded `failed` with the reason;
    /// sandboxes still being created are killed. Returns the number
    /// hibernated.
    pub async fn shutdown_keeping(self: &Arc<Self>) -> usize {
        self.begin_shutdown();
        self.shutdown_pool().await;
        let secs = self.config.limits.shutdown_hibernate_secs;
        let all: Vec<Arc<Sandbox>> = lock(&self.sandboxes).values().cloned().collect();
        // A recipe's builder dies with its build, which does not outlive
        // the process.
        let (builders, all): (Vec<_>, Vec<_>) =
            all.into_iter().partition(|s| s.labels().contains_key(super::recipes::BUILD_LABEL));
        for sb in &builders {
            self.teardown(sb, Some("the server stopped during its template build".into())).await;
        }
        let mut writes = tokio::task::JoinSet::new();
        for sb in all.iter().filter(|s| matches!(s.state(), SandboxState::Running | SandboxState::Paused)) {
            let (me, sb) = (self.clone(), sb.clone());
            writes.spawn(async move {
                let r = me.hibernate_sandbox(&sb, HibernateWhy::Shutdown).await;
                (sb.id.clone(), r.map_err(|e| e.to_string()))
            });
        }
        let t0 = Instant::now();
        tracing::info!("hibernating {} sandboxes within {secs} s", writes.len());
        let mut failed: std::collections::BTreeMap<String, String> = std::collections::BTreeMap::new();
        let mut hibernated = 0;
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
        loop {
            match tokio::time::timeout_at(deadline, writes.join_next()).await {
                Ok(Some(Ok((_, Ok(()))))) => hibernated += 1,
                Ok(Some(Ok((id, Err(e))))) => drop(failed.insert(id, e)),
                Ok(Some(Err(e))) => tracing::warn!("a hibernation task failed: {e}"),
                Ok(None) => break,
                Err(_) => {
                    tracing::warn!("{} hibernations did not finish within {secs} s", writes.len());
                    break;
                }
            }
        }
        tracing::info!("{hibernated} sandboxes hibernated in {:?}", t0.elapsed());
        for sb in &all {
            let state = sb.state();
            match state {
                SandboxState::Hibernated => continue,
                // A create in progress: it was never handed to its caller.
                SandboxState::Starting if lock(&sb.hibernation).is_none() => {
                    self.teardown(sb, Some("the server stopped during its creation".into())).await;
                    continue;
                }
                // A resume from disk in progress: it stays hibernated.
                SandboxState::Starting => {
                    let _ = sb.transition(Transition::Restored { to: SandboxState::Hibernated, error: None });
                }
                SandboxState::Running | SandboxState::Paused => {
                    let why = failed
                        .get(&sb.id)
                        .cloned()
                        .unwrap_or_else(|| format!("its hibernation did not finish within {secs} s"));
                    sb.end(
                        SandboxState::Failed,
                        Some(format!("the server stopped and could not hibernate it: {why}; its memory was not saved")),
                    );
                }
                SandboxState::Stopped | SandboxState::Failed => {}
            }
            let (me, s) = (self.clone(), sb.clone());
            let _ = tokio::task::spawn_blocking(move || {
                // A hibernation still being written holds `control` and the
                // VM: it is left to finish (it finds the sandbox failed and
                // drops what it wrote) or to die with the process.
                if s.control.try_lock().is_ok() {
                    s.stop_vm();
                }
                if let Err(e) = me.write_record(&s, lock(&s.pin).clone(), None) {
                    tracing::warn!(sandbox = %s.id, "cannot write its record: {e}");
                }
            })
            .await;
        }
        // Forget them all; their records and hibernations stay.
        let left: Vec<Arc<Sandbox>> = std::mem::take(&mut *lock(&self.sandboxes)).into_values().collect();
        let _ = tokio::task::spawn_blocking(move || {
            for sb in left {
                if sb.control.try_lock().is_ok() {
                    sb.stop_vm();
                    remove_dir(&sb.dir());
                }
            }
        })
        .await;
        self.shutdown().await;
        hibernated
    }
}
