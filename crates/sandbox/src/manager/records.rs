//! Sandbox records: what a sandbox is, kept on disk so that it outlives a
//! restart of the server (`<kept>/<id>/sandbox.json`). A record is
//! written when a sandbox is made, when it changes (labels, idle timeout,
//! network policy, lineage), when it is hibernated or resumed and when the
//! server stops; a kill removes it. Written to a temporary name, synced
//! and renamed: a record is whole or absent.
//!
//! At start, [`Manager::recover`] lists every record's sandbox again: a
//! hibernated one as `hibernated` (its next call resumes it), one that was
//! running when the server died without hibernating it as `failed` with
//! the reason, never silently dropped.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::backend::Base;
use super::hibernate::{kept_dir_of, BASES_DIR};
use super::sandbox::{Hibernated, Lineage, SandboxSetup};
use super::{remove_dir, Manager, Sandbox, SandboxId, SandboxState};
use crate::lock;

/// The record file's name in a sandbox's kept directory.
pub(super) const RECORD_FILE: &str = "sandbox.json";
/// The record format this code writes and reads. Bump it on a change an
/// older reader would misread.
pub(super) const RECORD_FORMAT: u32 = 1;

/// One sandbox, as kept on disk.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Record {
    /// [`RECORD_FORMAT`] when written.
    pub format: u32,
    pub id: SandboxId,
    /// `running`, `paused`, `hibernated`, `stopped`, `failed` (`starting`
    /// is never written).
    pub state: String,
    #[serde(default)]
    pub error: Option<String>,
    pub vcpus: u8,
    pub memory_mib: u64,
    /// The size of its disk (MiB; 0: none, or a record written before
    /// sandboxes had disks).
    #[serde(default)]
    pub disk_mib: u64,
    /// Its root filesystem image when not the server's
    /// ([`Sandbox::rootfs`]: a template from an OCI image).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<std::path::PathBuf>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The tenant it belongs to (`None`: the server's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default)]
    pub template: Option<String>,
    #[serde(default)]
    pub parent: Option<SandboxId>,
    #[serde(default)]
    pub branched_at_ms: Option<u64>,
    #[serde(default)]
    pub children: Vec<SandboxId>,
    pub created_at_ms: u64,
    pub idle_timeout_secs: u64,
    /// The egress policy (`None`: no network device).
    #[serde(default)]
    pub network: Option<netstack::policy::NetworkPolicy>,
    /// The tenant's network ceiling over it, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_ceiling: Option<netstack::policy::NetworkPolicy>,
    /// The hibernation (state `hibernated`).
    #[serde(default)]
    pub hibernation: Option<HibernationRecord>,
    /// Its volumes ([`crate::volumes`]): a resume puts them back in their
    /// slots; a kill lets go of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<crate::volumes::AttachedVolume>,
    /// Its published host ports ([`crate::published_ports`]; `listening`
    /// and `error` as last known): the server listens again at start.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<crate::published_ports::PublishedPort>,
    /// Its secrets' bindings (placeholders, never values): the guest's
    /// memory holds the placeholders, so a resumed sandbox swaps again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<crate::secrets::SecretBinding>,
    /// Its name, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Where a hibernation is and what it was written against.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct HibernationRecord {
    /// Its directory, in the sandbox's kept directory (`hib-<g>`).
    pub dir: String,
    pub at_ms: u64,
    pub expires_at_ms: u64,
    /// The pinned base it was written against, in [`BASES_DIR`] (`None`:
    /// it holds the whole memory).
    #[serde(default)]
    pub base: Option<String>,
    /// The agent protocol version the sandbox's agent spoke when it was
    /// hibernated (4 for an agent of the release before protocol 5); the
    /// host learns it again when it connects after the resume. `None` in
    /// records written before this field, or without a connection.
    #[serde(default)]
    pub agent_protocol: Option<u16>,
}

fn state_name(s: SandboxState) -> &'static str {
    match s {
        SandboxState::Starting => "starting",
        SandboxState::Running => "running",
        SandboxState::Paused => "paused",
        SandboxState::Hibernated => "hibernated",
        SandboxState::Stopped => "stopped",
        SandboxState::Failed => "failed",
    }
}

/// `sb`'s record now; `pin` names its hibernation's pinned base. With
/// `hibernated`, the record of `sb` hibernated there (written before the
/// state changes: the record is the hibernation's commit point).
fn record_of(sb: &Sandbox, pin: Option<String>, hibernated: Option<&Hibernated>) -> Record {
    let (mut state, error, agent_protocol) = {
        let st = lock(&sb.status);
        (st.state, st.error.clone(), st.agent.as_ref().and_then(|a| a.wire()).map(|w| w.version()))
    };
    let lineage = lock(&sb.lineage).clone();
    let policy = lock(&sb.net).as_ref().map(|c| c.policy());
    let hib = match hibernated {
        Some(h) => {
            state = SandboxState::Hibernated;
            Some(h.clone())
        }
        None => lock(&sb.hibernation).clone(),
    };
    // One lock at a time: guards taken inside the struct expression below
    // would all be held to its end, in an order of their own (`info` takes
    // `name` before these; the two deadlocked).
    let volumes = lock(&sb.volumes).clone();
    let ports = lock(&sb.ports).clone();
    let secrets = lock(&sb.secrets).clone();
    let name = lock(&sb.name).clone();
    let hibernation = hib.map(|h| HibernationRecord {
        dir: h.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        at_ms: h.at_ms,
        expires_at_ms: h.expires_at_ms,
        base: pin,
        agent_protocol,
    });
    Record {
        format: RECORD_FORMAT,
        id: sb.id.clone(),
        state: state_name(state).into(),
        error,
        vcpus: sb.vcpus,
        memory_mib: sb.memory_mib,
        disk_mib: sb.disk_mib,
        rootfs: sb.rootfs.clone(),
        labels: sb.labels(),
        tenant: sb.tenant(),
        template: sb.template.clone(),
        parent: lineage.parent,
        branched_at_ms: lineage.branched_at_ms,
        children: lineage.children,
        created_at_ms: sb.created_at_ms,
        idle_timeout_secs: sb.idle_timeout().as_secs(),
        network: policy.as_ref().map(|c| c.policy().clone()),
        network_ceiling: policy.as_ref().and_then(|c| c.ceiling().map(|c| c.policy().clone())),
        hibernation,
        volumes,
        ports,
        secrets,
        name,
    }
}

/// Writes `record` to `<kept>/<id>/sandbox.json`: a temporary file,
/// synced, renamed, the directory synced.
///
/// Errors: the I/O error, with what was being done.
fn write(kept: &Path, record: &Record) -> Result<(), String> {
    let dir = kept_dir_of(kept, &record.id);
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let bytes = serde_json::to_vec_pretty(record).map_err(|e| e.to_string())?;
    crate::store::replace_file(&dir, RECORD_FILE, &bytes).map_err(|e| e.to_string())
}

/// What [`read_all`] found in one kept directory.
pub(super) struct Found {
    pub id: SandboxId,
    /// The record, or why it cannot be used.
    pub record: Result<Record, String>,
    /// The record file's modification time, ms since the Unix epoch.
    pub mtime_ms: u64,
}

/// Every kept directory's record, by id; also removes hibernations that
/// were being written (`hib-*.tmp`) and records' temporary files.
pub(super) fn read_all(kept: &Path) -> Vec<Found> {
    let Ok(entries) = std::fs::read_dir(kept) else { return Vec::new() };
    let mut found = Vec::new();
    for e in entries.flatten() {
        let id = e.file_name().to_string_lossy().into_owned();
        if id.starts_with('.') || !e.path().is_dir() {
            continue;
        }
        if let Ok(inner) = std::fs::read_dir(e.path()) {
            for f in inner.flatten() {
                if f.file_name().to_string_lossy().ends_with(".tmp") {
                    tracing::info!("removing {}, left half-written by an earlier run", f.path().display());
                    remove_dir(&f.path());
                    let _ = std::fs::remove_file(f.path());
                }
            }
        }
        let path = e.path().join(RECORD_FILE);
        let mtime_ms = std::fs::metadata(&path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as u64);
        let record = match std::fs::read(&path) {
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                // A kept directory without a record: a kill or a first
                // hibernation cut short. Nothing to list.
                tracing::info!("removing {}: it has no record", e.path().display());
                remove_dir(&kept_dir_of(kept, &id));
                continue;
            }
            Err(e) => Err(format!("its record {} cannot be read: {e}", path.display())),
            Ok(bytes) => parse(&bytes, &path),
        };
        found.push(Found { id, record, mtime_ms });
    }
    found.sort_by(|a, b| a.id.cmp(&b.id));
    found
}

/// A record's bytes, checked for a format this code reads.
fn parse(bytes: &[u8], path: &Path) -> Result<Record, String> {
    #[derive(Deserialize)]
    struct Format {
        format: u32,
    }
    let f: Format =
        serde_json::from_slice(bytes).map_err(|e| format!("its record {} is damaged: {e}", path.display()))?;
    if f.format > RECORD_FORMAT {
        return Err(format!(
            "it was kept by a newer tine (record format {}; this one reads {RECORD_FORMAT}) and cannot be restored by \
             this one",
            f.format
        ));
    }
    serde_json::from_slice(bytes).map_err(|e| format!("its record {} is damaged: {e}", path.display()))
}

impl Manager {
    /// Writes `sb`'s record now, if it is still this manager's (a record
    /// never outlives the kill that removed it). Blocking.
    pub(super) fn write_record(
        &self,
        sb: &Sandbox,
        pin: Option<String>,
        hibernated: Option<&Hibernated>,
    ) -> Result<(), String> {
        let _records = lock(&self.records);
        if !lock(&self.sandboxes).get(&sb.id).is_some_and(|s| std::ptr::eq(Arc::as_ptr(s), sb)) {
            return Ok(());
        }
        write(&self.config.kept_dir, &record_of(sb, pin, hibernated))
    }

    /// Writes `sb`'s record in the background (a create, a change): the
    /// caller does not wait for the sync. A failure is logged.
    pub(super) fn record_in_background(&self, sb: &Arc<Sandbox>) {
        let Some(me) = self.me.upgrade() else { return };
        let sb = sb.clone();
        let write = move || {
            let pin = lock(&sb.pin).clone();
            if let Err(e) = me.write_record(&sb, pin, None) {
                tracing::warn!(sandbox = %sb.id, "cannot write its record (it will not be listed after a restart): {e}");
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(write)),
            Err(_) => write(),
        }
    }

    /// Removes `id`'s kept directory (record and hibernations), then the
    /// pinned bases no sandbox names any more. Blocking.
    pub(super) fn remove_record(&self, id: &str) {
        let _records = lock(&self.records);
        remove_dir(&kept_dir_of(&self.config.kept_dir, id));
        self.remove_unused_pins(false);
    }

    /// Removes the pinned bases no sandbox of the map names (its `pin`),
    /// and, with `with_tmp`, pins left half-made (at start, when none is
    /// being made). The caller holds `records`, under which pins are made
    /// and given to their sandbox.
    fn remove_unused_pins(&self, with_tmp: bool) {
        let used: std::collections::BTreeSet<String> =
            lock(&self.sandboxes).values().filter_map(|s| lock(&s.pin).clone()).collect();
        let Ok(entries) = std::fs::read_dir(self.config.kept_dir.join(BASES_DIR)) else { return };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !used.contains(&name) && (with_tmp || !name.ends_with(".tmp")) {
                tracing::info!("removing the pinned base {name}: no kept sandbox needs it");
                remove_dir(&e.path());
            }
        }
    }

    /// Lists the sandboxes of the records in the kept directory again (at
    /// start, before anything else runs): hibernated ones as `hibernated`,
    /// others as they were when the server stopped, and those that were
    /// running when it died without hibernating them as `failed` with the
    /// reason. Pinned bases
    /// no record names are removed.
    pub(super) fn recover(&self) {
        let kept = &self.config.kept_dir;
        let found = read_all(kept);
        let _records = lock(&self.records);
        let mut map = lock(&self.sandboxes);
        for f in found {
            let sb = match f.record {
                Ok(r) => self.restored(r, f.mtime_ms),
                Err(reason) => {
                    let setup = SandboxSetup {
                        labels: BTreeMap::new(),
                        template: None,
                        idle_timeout: Duration::from_secs(self.config.limits.default_idle_timeout_secs),
                        owner: None,
                        tenant: None,
                        events: Some(self.events.clone()),
                        disk_mib: 0,
                        rootfs: None,
                    };
                    let sb = Sandbox::new(f.id.clone(), self.config.run_dir.join(&f.id), 0, 0, setup);
                    sb.end(SandboxState::Failed, Some(reason));
                    sb
                }
            };
            tracing::info!(sandbox = %sb.id, state = ?sb.state(), "kept sandbox listed again");
            map.insert(f.id, Arc::new(sb));
        }
        drop(map);
        self.remove_unused_pins(true);
    }

    /// The sandbox of record `r` (its file written at `mtime_ms`).
    fn restored(&self, r: Record, mtime_ms: u64) -> Sandbox {
        let setup = SandboxSetup {
            labels: r.labels.clone(),
            template: r.template.clone(),
            idle_timeout: Duration::from_secs(r.idle_timeout_secs),
            owner: None,
            tenant: r.tenant.clone(),
            events: Some(self.events.clone()),
            disk_mib: r.disk_mib,
            rootfs: r.rootfs.clone(),
        };
        let mut sb = Sandbox::new(r.id.clone(), self.config.run_dir.join(&r.id), r.vcpus, r.memory_mib, setup);
        sb.created_at_ms = r.created_at_ms;
        *lock(&sb.lineage) = Lineage {
            parent: r.parent.clone(),
            branched_at_ms: r.branched_at_ms,
            children: r.children.clone(),
            ..Lineage::default()
        };
        let ceiling = r.network_ceiling.as_ref();
        *lock(&sb.net) = match r.network.as_ref().map(|p| self.net_control(Some(p), ceiling)) {
            Some(Ok(c)) => c,
            Some(Err(e)) => {
                tracing::warn!(sandbox = %r.id, "its network policy no longer applies ({e}); the server's default \
                    is used");
                self.net_control(None, ceiling).ok().flatten()
            }
            None => self.net_control(None, ceiling).ok().flatten(),
        };
        let at = || {
            let secs = mtime_ms / 1000;
            format!("{secs} s after the Unix epoch")
        };
        // A hibernation (also one that failed to resume: its files stay
        // for the operator until retention or a kill).
        let hibernation = r.hibernation.as_ref().and_then(|h| {
            let dir = kept_dir_of(&self.config.kept_dir, &r.id).join(&h.dir);
            dir.is_dir().then(|| {
                *lock(&sb.base) = match &h.base {
                    Some(pin) => Base::Pinned(self.config.kept_dir.join(BASES_DIR).join(pin)),
                    None => Base::None,
                };
                *lock(&sb.pin) = h.base.clone();
                Hibernated { dir, at_ms: h.at_ms, expires_at_ms: h.expires_at_ms }
            })
        });
        let found = hibernation.is_some();
        *lock(&sb.hibernation) = hibernation;
        *lock(&sb.volumes) = r.volumes.clone();
        *lock(&sb.secrets) = r.secrets.clone();
        *lock(&sb.name) = r.name.clone();
        *lock(&sb.ports) =
            r.ports.iter().map(|p| crate::published_ports::PublishedPort { listening: false, ..p.clone() }).collect();
        let (state, error) = match r.state.as_str() {
            "hibernated" if found => (SandboxState::Hibernated, None),
            "hibernated" => {
                (SandboxState::Failed, Some("its hibernation's files are missing; it cannot be resumed".into()))
            }
            "stopped" => (SandboxState::Stopped, r.error.clone()),
            "failed" => (SandboxState::Failed, r.error.clone()),
            _ => (
                SandboxState::Failed,
                Some(format!(
                    "lost in a crash: the server stopped (SIGKILL, an OOM kill or a host crash) without hibernating \
                     it, at about {} (its record's last write); its memory was not saved",
                    at()
                )),
            ),
        };
        let _ = sb.transition(super::sandbox::Transition::Restored { to: state, error });
        sb
    }
}
