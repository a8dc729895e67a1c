//! Volumes: disks that outlive the sandboxes that use them.
//!
//! A volume is an ext4 file system on a copy-on-write chain
//! ([`tine_storage::LayeredDisk`]) whose frozen layers the volume's
//! directory keeps (hard links, as a template keeps its disk). A sandbox
//! attaches it in one of its VM's device slots ([`vmm::DiskConfig::slot`]):
//!
//! - **writable**, by one sandbox at a time (the *writer*): its VM gets a
//!   new top over the volume's chain. When the writer lets go (killed, or
//!   its creation failed), that top and every layer a branch or
//!   hibernation froze meanwhile become the volume's chain. A hibernated
//!   writer keeps the volume. A branch child of the writer gets a
//!   copy-on-write view (a new top over what the branch froze): its writes
//!   stay its own and never reach the volume.
//! - **read-only**, by any number of sandboxes: the volume's chain as it
//!   was when they attached (a writer's later writes are not seen until it
//!   lets go and they attach again), under a private top of their own.
//!   The guest mounts it read-only, so nothing it runs writes there; the
//!   top takes what the guest's ext4 itself writes at mount (the replay of
//!   a journal a writer that did not unmount left), and its layers are
//!   links among the sandbox layers, so a later release that merges the
//!   volume's layers never takes one a reader still reads.
//!
//! On the host:
//!
//! ```text
//! <kept>/volumes/<name>/volume.json   name, size, chain (names relative),
//!                                     the writer and its chain
//! <kept>/volumes/<name>/disk-base.img, disk-<i>.delta   the layers
//! ```
//!
//! `<name>` is `<tenant>~<name>` for a tenant's volume
//! ([`crate::templates::qualified`]). A volume belongs to its tenant:
//! another tenant neither sees nor attaches it.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tine_storage::ChainSpec;

use crate::disks;

/// A volume's record in its directory.
pub const VOLUME_META: &str = "volume.json";
/// The volumes' directory in the kept directory.
pub const VOLUMES_DIR: &str = "volumes";
/// The smallest volume (GiB).
pub const MIN_VOLUME_GIB: u64 = 1;

/// Errors of volumes.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// The name is not `[a-z0-9][a-z0-9_-]{0,62}`.
    #[error("bad volume name {0:?}: use 1-63 of a-z, 0-9, '-' and '_', starting with a letter or digit")]
    BadName(String),
    /// No volume of that name (for this tenant).
    #[error("no volume named {0:?}; volume_list shows the volumes you have")]
    NotFound(String),
    /// The name is taken.
    #[error("a volume named {0:?} exists already; pick another name or delete it first")]
    Exists(String),
    /// The size is out of range.
    #[error("size_gib must be {MIN_VOLUME_GIB}..={max}, got {asked}")]
    Size {
        /// The size asked for (GiB).
        asked: u64,
        /// The server's largest ([`crate::Limits::max_volume_gib`]).
        max: u64,
    },
    /// The server keeps as many volumes as it may.
    #[error("the server keeps {max} volumes already; delete one first")]
    TooMany {
        /// [`crate::Limits::max_volumes`].
        max: usize,
    },
    /// Another sandbox writes the volume.
    #[error(
        "volume {name:?} is attached writable to sandbox {writer}; attach it with read_only: true, or kill {writer} \
         first"
    )]
    Busy {
        /// The volume.
        name: String,
        /// The sandbox that writes it.
        writer: String,
    },
    /// Sandboxes use the volume.
    #[error("volume {name:?} is attached to {sandboxes}; kill them first")]
    InUse {
        /// The volume.
        name: String,
        /// Who uses it, comma-separated.
        sandboxes: String,
    },
    /// A file operation or a layer failed.
    #[error("volume {name:?}: {reason}")]
    Io {
        /// The volume.
        name: String,
        /// What failed.
        reason: String,
    },
}

/// What `volume_list` shows of a volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct VolumeInfo {
    /// Its name (without its tenant).
    pub name: String,
    /// Its size (GiB): what the guest's file system holds at most.
    pub size_gib: u64,
    /// Bytes its layers take on the host (sparse: what was written).
    pub used_bytes: u64,
    /// The sandbox that has it attached writable, if any (a hibernated
    /// one keeps it).
    pub writer: Option<String>,
    /// Sandboxes that have it attached read-only.
    pub readers: Vec<String>,
    /// When it was made (ms since the Unix epoch).
    pub created_unix_ms: u64,
}

/// The writer of a volume, recorded so that a server that stopped
/// without letting go still finds its writes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Writer {
    /// The sandbox.
    sandbox: String,
    /// Its chain at attach: the volume's layers (linked among sandbox
    /// layers) and its top (absolute paths).
    chain: ChainSpec,
}

/// A volume's record ([`VOLUME_META`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct VolumeMeta {
    /// Its size in bytes.
    size_bytes: u64,
    /// When it was made (ms since the Unix epoch).
    created_unix_ms: u64,
    /// The writer, if any.
    writer: Option<Writer>,
}

/// A volume in memory.
struct Volume {
    meta: VolumeMeta,
    /// Its frozen chain (absolute paths into its directory).
    chain: ChainSpec,
    /// Sandboxes that read it.
    readers: BTreeSet<String>,
}

/// The server's volumes.
pub struct VolumeStore {
    /// `<kept>/volumes`.
    dir: PathBuf,
    /// Where sandboxes' layers live (`<kept>/.disks`): writers' tops.
    layers: PathBuf,
    /// Frozen layers a volume's chain may have before a release merges
    /// them ([`crate::Limits::max_disk_layers`]).
    max_frozen: usize,
    volumes: Mutex<BTreeMap<String, Volume>>,
}

/// A volume's name checked and qualified with its tenant.
fn stored_name(tenant: Option<&str>, name: &str) -> Result<String, VolumeError> {
    let stored = crate::templates::qualified(tenant, name);
    if name.contains(crate::templates::TENANT_SEPARATOR) || crate::templates::check_name(&stored).is_err() {
        return Err(VolumeError::BadName(name.to_string()));
    }
    Ok(stored)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl VolumeStore {
    /// The volumes in `<kept>/volumes`, read from their records. A volume
    /// whose record cannot be read is left on disk and logged, not lost.
    ///
    /// Errors: [`VolumeError::Io`] (the directory cannot be made).
    pub fn open(kept: &Path, max_frozen: usize) -> Result<Self, VolumeError> {
        let dir = kept.join(VOLUMES_DIR);
        std::fs::create_dir_all(&dir)
            .map_err(|e| VolumeError::Io { name: String::new(), reason: format!("create {}: {e}", dir.display()) })?;
        let mut volumes = BTreeMap::new();
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                // A create or delete that a crash interrupted.
                tracing::info!("removing {} left by an interrupted volume create or delete", entry.path().display());
                let _ = std::fs::remove_dir_all(entry.path());
                continue;
            }
            match Self::load(&entry.path()) {
                Ok(v) => {
                    volumes.insert(name, v);
                }
                Err(e) => tracing::warn!("volume {name}: its record cannot be read ({e}); left as it is"),
            }
        }
        Ok(VolumeStore { dir, layers: kept.join(disks::DISKS_DIR), max_frozen, volumes: Mutex::new(volumes) })
    }

    fn load(dir: &Path) -> Result<Volume, String> {
        let bytes = std::fs::read(dir.join(VOLUME_META)).map_err(|e| e.to_string())?;
        let meta: VolumeMeta = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
        let chain = disks::load(dir).map_err(|e| e.to_string())?.ok_or("its disk.json is missing")?;
        Ok(Volume { meta, chain, readers: BTreeSet::new() })
    }

    fn save(&self, stored: &str, meta: &VolumeMeta) -> Result<(), VolumeError> {
        let io = |reason: String| VolumeError::Io { name: stored.to_string(), reason };
        let json = serde_json::to_vec_pretty(meta).map_err(|e| io(e.to_string()))?;
        crate::store::write_synced(&self.dir.join(stored).join(VOLUME_META), &json).map_err(|e| io(e.to_string()))
    }

    /// Makes an empty volume of `size_gib` GiB named `name` for `tenant`
    /// (an ext4 file system; sparse: a few MiB on the host).
    ///
    /// Errors: [`VolumeError::BadName`], [`VolumeError::Size`],
    /// [`VolumeError::Exists`], [`VolumeError::TooMany`],
    /// [`VolumeError::Io`] (mkfs.ext4 failed).
    pub fn create(
        &self,
        tenant: Option<&str>,
        name: &str,
        size_gib: u64,
        limits: &crate::Limits,
    ) -> Result<VolumeInfo, VolumeError> {
        let stored = stored_name(tenant, name)?;
        if !(MIN_VOLUME_GIB..=limits.max_volume_gib).contains(&size_gib) {
            return Err(VolumeError::Size { asked: size_gib, max: limits.max_volume_gib });
        }
        let mut volumes = crate::lock(&self.volumes);
        if volumes.contains_key(&stored) {
            return Err(VolumeError::Exists(name.to_string()));
        }
        if volumes.len() >= limits.max_volumes {
            return Err(VolumeError::TooMany { max: limits.max_volumes });
        }
        let io = |reason: String| VolumeError::Io { name: name.to_string(), reason };
        let bytes = size_gib << 30;
        let blank = disks::blank_volume(&self.layers, bytes).map_err(|e| io(e.to_string()))?;
        let tmp = self.dir.join(format!(".{stored}.tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| io(format!("create {}: {e}", tmp.display())))?;
        let made = (|| {
            disks::keep(&ChainSpec { base: Some(blank), ..ChainSpec::default() }, &tmp)
                .map_err(|e| io(e.to_string()))?;
            let meta = VolumeMeta { size_bytes: bytes, created_unix_ms: now_ms(), writer: None };
            let json = serde_json::to_vec_pretty(&meta).map_err(|e| io(e.to_string()))?;
            crate::store::write_synced(&tmp.join(VOLUME_META), &json).map_err(|e| io(e.to_string()))?;
            std::fs::rename(&tmp, self.dir.join(&stored)).map_err(|e| io(format!("rename into place: {e}")))?;
            Self::load(&self.dir.join(&stored)).map_err(io)
        })();
        let volume = match made {
            Ok(v) => v,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(e);
            }
        };
        let info = info_of(&stored, &volume);
        volumes.insert(stored, volume);
        tracing::info!(volume = %name, tenant = ?tenant, size_gib, "volume created");
        Ok(info)
    }

    /// The volumes of `tenant` (the server's own for `None`), by name.
    pub fn list(&self, tenant: Option<&str>) -> Vec<VolumeInfo> {
        let volumes = crate::lock(&self.volumes);
        volumes
            .iter()
            .filter(|(stored, _)| crate::templates::split_qualified(stored).0 == tenant)
            .map(|(stored, v)| info_of(stored, v))
            .collect()
    }

    /// Deletes `tenant`'s volume `name` and its data.
    ///
    /// Errors: [`VolumeError::NotFound`], [`VolumeError::InUse`] (a
    /// sandbox has it attached, a hibernated one included),
    /// [`VolumeError::Io`].
    pub fn delete(&self, tenant: Option<&str>, name: &str) -> Result<(), VolumeError> {
        let stored = stored_name(tenant, name)?;
        let mut volumes = crate::lock(&self.volumes);
        let v = volumes.get(&stored).ok_or_else(|| VolumeError::NotFound(name.to_string()))?;
        let users: Vec<&str> =
            v.meta.writer.iter().map(|w| w.sandbox.as_str()).chain(v.readers.iter().map(String::as_str)).collect();
        if !users.is_empty() {
            return Err(VolumeError::InUse { name: name.to_string(), sandboxes: users.join(", ") });
        }
        // Out of the way first, so a crash midway leaves no half volume.
        let doomed = self.dir.join(format!(".{stored}.deleted"));
        std::fs::rename(self.dir.join(&stored), &doomed)
            .map_err(|e| VolumeError::Io { name: name.to_string(), reason: format!("delete: {e}") })?;
        volumes.remove(&stored);
        drop(volumes);
        let _ = std::fs::remove_dir_all(&doomed);
        tracing::info!(volume = %name, tenant = ?tenant, "volume deleted");
        Ok(())
    }

    /// Attaches `tenant`'s volume `name` to `sandbox`: the chain its slot
    /// gets, a new top among the sandbox layers over the volume's chain
    /// (writable: `sandbox` is its writer until [`VolumeStore::release`];
    /// read-only: a private top, see the [module docs](self)). Blocking
    /// (links the layers, syncs the record). Returns the stored name and
    /// the chain.
    ///
    /// Errors: [`VolumeError::NotFound`], [`VolumeError::Busy`] (another
    /// sandbox writes it), [`VolumeError::Io`] (the top cannot be made).
    pub fn acquire(
        &self,
        tenant: Option<&str>,
        name: &str,
        sandbox: &str,
        read_only: bool,
    ) -> Result<(String, ChainSpec), VolumeError> {
        let stored = stored_name(tenant, name)?;
        let mut volumes = crate::lock(&self.volumes);
        let v = volumes.get_mut(&stored).ok_or_else(|| VolumeError::NotFound(name.to_string()))?;
        let io = |reason: String| VolumeError::Io { name: name.to_string(), reason };
        if read_only {
            let chain = disks::new_top(&v.chain, &self.layers).map_err(|e| io(e.to_string()))?;
            v.readers.insert(sandbox.to_string());
            return Ok((stored, chain));
        }
        if let Some(w) = &v.meta.writer {
            return Err(VolumeError::Busy { name: name.to_string(), writer: w.sandbox.clone() });
        }
        let chain = disks::new_top(&v.chain, &self.layers).map_err(|e| io(e.to_string()))?;
        let mut meta = v.meta.clone();
        meta.writer = Some(Writer { sandbox: sandbox.to_string(), chain: chain.clone() });
        self.save(&stored, &meta)?;
        v.meta = meta;
        Ok((stored, chain))
    }

    /// Whether `tenant`'s volume `name` could be attached now (it exists,
    /// and no sandbox writes it if `read_only` is false): a create checks
    /// before it starts anything; [`VolumeStore::acquire`] decides.
    ///
    /// Errors: as [`VolumeStore::acquire`].
    pub fn check(&self, tenant: Option<&str>, name: &str, read_only: bool) -> Result<(), VolumeError> {
        let stored = stored_name(tenant, name)?;
        let volumes = crate::lock(&self.volumes);
        let v = volumes.get(&stored).ok_or_else(|| VolumeError::NotFound(name.to_string()))?;
        match &v.meta.writer {
            Some(w) if !read_only => Err(VolumeError::Busy { name: name.to_string(), writer: w.sandbox.clone() }),
            _ => Ok(()),
        }
    }

    /// `sandbox` lets go of the volume stored as `stored`. A reader is
    /// forgotten. The writer's writes become the volume's: `last` is its
    /// slot's chain when it stopped (the top included, no longer written),
    /// or `None` when the VM is gone without one (a failed start, a server
    /// that stopped while it ran): then the chain last recorded
    /// ([`VolumeStore::acquire`], [`VolumeStore::note_chain`]), if its
    /// files are all there. Blocking: the layers are synced, and merged
    /// when there are more than `max_frozen` of them, without the store's
    /// lock (the volume keeps its writer meanwhile, so no other sandbox
    /// takes it).
    ///
    /// Errors: [`VolumeError::Io`] (the layers cannot be synced or linked:
    /// the volume keeps its writer and its record names the layers, which
    /// the disk sweep keeps, so nothing is lost; the next start of the
    /// server tries again, [`VolumeStore::recover`]).
    pub fn release(&self, stored: &str, sandbox: &str, last: Option<&ChainSpec>) -> Result<(), VolumeError> {
        let writer = {
            let mut volumes = crate::lock(&self.volumes);
            let Some(v) = volumes.get_mut(stored) else { return Ok(()) };
            v.readers.remove(sandbox);
            let Some(writer) = v.meta.writer.clone().filter(|w| w.sandbox == sandbox) else { return Ok(()) };
            writer
        };
        let last = last.cloned().unwrap_or(writer.chain);
        let name = crate::templates::split_qualified(stored).1.to_string();
        let io = |reason: String| VolumeError::Io { name: name.clone(), reason };
        let adopted = match disks::files(&last).find(|f| !f.exists()) {
            Some(missing) => {
                // Nothing to adopt: the volume stays as it was before this
                // writer, said rather than papered over.
                tracing::warn!(volume = %name, sandbox, "the writer's layer {} is gone; its writes since it \
                    attached are lost, the volume keeps what it held before", missing.display());
                None
            }
            None => {
                let frozen = ChainSpec {
                    base: last.base.clone(),
                    frozen: last.frozen.iter().chain(last.top.iter()).cloned().collect(),
                    top: None,
                };
                tine_storage::sync(&frozen).map_err(|e| io(e.to_string()))?;
                let kept = disks::shallow(&frozen, &self.layers, self.max_frozen);
                Some((frozen, kept))
            }
        };
        // Under the lock: a reader's acquire links the volume's layers by
        // the names its record gives, which `disks::keep` replaces.
        let mut volumes = crate::lock(&self.volumes);
        let Some(v) = volumes.get_mut(stored) else { return Ok(()) };
        if let Some((frozen, kept)) = adopted {
            let dir = self.dir.join(stored);
            disks::keep(&kept, &dir).map_err(|e| io(e.to_string()))?;
            if kept != frozen {
                let _ = std::fs::remove_file(&kept.frozen[0]);
            }
            // Layers of an older, longer chain that the new one no longer
            // names (a merge made it shorter); readers have links of their
            // own ([`disks::new_top`]).
            let chain = disks::load(&dir).map_err(|e| io(e.to_string()))?.unwrap_or_default();
            let named: HashSet<&PathBuf> = disks::files(&chain).collect();
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let p = entry.path();
                if p.extension().is_some_and(|e| e == "delta") && !named.contains(&p) {
                    let _ = std::fs::remove_file(&p);
                }
            }
            v.chain = chain;
        }
        let mut meta = v.meta.clone();
        meta.writer = None;
        self.save(stored, &meta)?;
        v.meta = meta;
        tracing::info!(volume = %name, sandbox, "volume released by its writer");
        Ok(())
    }

    /// Records `chain` as the chain of the volume stored as `stored` in
    /// its writer `sandbox`'s VM now (after a resume or a branch gave the
    /// VM a new top), so that a server that stops without a release finds
    /// the writes up to the stop ([`VolumeStore::recover`]), and the disk
    /// sweep keeps those layers. Nothing when `sandbox` is not the writer
    /// or the chain is the one recorded. Blocking (syncs the record).
    ///
    /// Errors: [`VolumeError::Io`] (the record cannot be written; the one
    /// before stays).
    pub fn note_chain(&self, stored: &str, sandbox: &str, chain: &ChainSpec) -> Result<(), VolumeError> {
        let mut volumes = crate::lock(&self.volumes);
        let Some(v) = volumes.get_mut(stored) else { return Ok(()) };
        let Some(w) = v.meta.writer.as_ref().filter(|w| w.sandbox == sandbox && w.chain != *chain) else {
            return Ok(());
        };
        let mut meta = v.meta.clone();
        meta.writer = Some(Writer { sandbox: w.sandbox.clone(), chain: chain.clone() });
        self.save(stored, &meta)?;
        v.meta = meta;
        Ok(())
    }

    /// Lets go of every volume whose writer is not among `live` (the
    /// sandboxes the server has, hibernated ones included): a server that
    /// stopped without a release ([`VolumeStore::release`] with `None`).
    pub fn recover(&self, live: &HashSet<String>) {
        let orphans: Vec<(String, String)> = crate::lock(&self.volumes)
            .iter()
            .filter_map(|(s, v)| v.meta.writer.as_ref().map(|w| (s.clone(), w.sandbox.clone())))
            .filter(|(_, w)| !live.contains(w))
            .collect();
        for (stored, writer) in orphans {
            tracing::warn!(volume = %stored, "its writer {writer} is gone (the server stopped while it ran): \
                taking its writes up to then");
            if let Err(e) = self.release(&stored, &writer, None) {
                tracing::warn!(volume = %stored, "{e}");
            }
        }
    }

    /// Notes `sandbox` (back from a record) as a reader of `stored`.
    pub fn note_reader(&self, stored: &str, sandbox: &str) {
        if let Some(v) = crate::lock(&self.volumes).get_mut(stored) {
            v.readers.insert(sandbox.to_string());
        }
    }

    /// The sandbox layers writers' records name, which clean-up keeps
    /// (a writer whose VM is not running: hibernated, or between
    /// attach and start).
    pub fn layers_in_use(&self) -> HashSet<PathBuf> {
        crate::lock(&self.volumes)
            .values()
            .filter_map(|v| v.meta.writer.as_ref())
            .flat_map(|w| disks::files(&w.chain).cloned().collect::<Vec<_>>())
            .collect()
    }

    /// Bytes the volumes' layers take on the host.
    pub fn disk_bytes(&self) -> u64 {
        crate::lock(&self.volumes).values().map(|v| used_bytes(&v.chain)).sum()
    }
}

/// Bytes allocated to the files of `chain` (shared ones too).
fn used_bytes(chain: &ChainSpec) -> u64 {
    use std::os::unix::fs::MetadataExt;
    disks::files(chain).filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.blocks() * 512).sum()
}

fn info_of(stored: &str, v: &Volume) -> VolumeInfo {
    VolumeInfo {
        name: crate::templates::split_qualified(stored).1.to_string(),
        size_gib: v.meta.size_bytes >> 30,
        used_bytes: used_bytes(&v.chain),
        writer: v.meta.writer.as_ref().map(|w| w.sandbox.clone()),
        readers: v.readers.iter().cloned().collect(),
        created_unix_ms: v.meta.created_unix_ms,
    }
}

/// A volume a create asks for (`sandbox_create { volumes }`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct VolumeRequest {
    /// The volume's name (`volume_create`).
    #[cfg_attr(feature = "schema", schemars(length(min = 1, max = 63)))]
    pub name: String,
    /// Where the guest mounts it: an absolute directory, made if missing.
    #[cfg_attr(feature = "schema", schemars(length(min = 2, max = 4095)))]
    pub path: String,
    /// Mount it read-only (any number of sandboxes may); otherwise this
    /// sandbox is its one writer until it is killed.
    #[serde(default)]
    pub read_only: bool,
}

/// A volume attached to a sandbox, as `sandbox_info` shows it and the
/// sandbox's record keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct AttachedVolume {
    /// The volume's name.
    pub name: String,
    /// Its mount point in the guest.
    pub path: String,
    /// Mounted read-only.
    pub read_only: bool,
    /// `false` for a branch child's copy-on-write view of its parent's
    /// volume: what it writes stays its own and never reaches the volume.
    pub shared: bool,
    /// The device slot it is in (the guest's disk serial `tine-slot-<n>`).
    pub slot: usize,
    /// The stored name (with its tenant).
    #[serde(skip_serializing_if = "String::is_empty", default)]
    #[cfg_attr(feature = "schema", schemars(skip))]
    pub stored: String,
}

impl AttachedVolume {
    /// Whether this sandbox writes the volume itself: attached writable,
    /// and not a branch child's copy-on-write view.
    pub fn writes(&self) -> bool {
        self.shared && !self.read_only
    }
}

/// Checks what a create asks for against `slots` free device slots:
/// distinct names and absolute, distinct mount points.
///
/// Errors: a message saying which entry is wrong and what to do.
pub fn check_requests(requests: &[VolumeRequest], slots: usize) -> Result<(), String> {
    if requests.len() > slots {
        return Err(format!(
            "{} volumes asked for; this sandbox's template has {slots} volume slots (the server's \
             limits.volume_slots for templates made now; an older template has none: rebuild it)",
            requests.len()
        ));
    }
    let mut names = BTreeSet::new();
    let mut paths = BTreeSet::new();
    for r in requests {
        let path = r.path.trim_end_matches('/');
        if !r.path.starts_with('/') || path.is_empty() || r.path.len() > tine_protocol::MAX_WORKING_DIR_BYTES {
            return Err(format!("volume {:?}: path {:?} must be an absolute directory other than /", r.name, r.path));
        }
        if !names.insert(r.name.as_str()) {
            return Err(format!("volume {:?} is asked for twice", r.name));
        }
        if path.split('/').any(|c| c == "." || c == "..") {
            return Err(format!("volume {:?}: path {:?} must not have . or .. in it", r.name, r.path));
        }
        if !paths.insert(path) {
            return Err(format!("two volumes are to be mounted at {path}"));
        }
    }
    // One inside another would hide it, or keep it from being unmounted.
    for (a, b) in paths.iter().flat_map(|a| paths.iter().map(move |b| (a, b))) {
        if b.strip_prefix(a).is_some_and(|rest| rest.starts_with('/')) {
            return Err(format!("volume mount points {a} and {b} nest; mount them side by side"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> crate::Limits {
        crate::Limits { max_volumes: 2, max_volume_gib: 4, ..crate::Limits::default() }
    }

    /// Writes `bytes` at offset 0 of `chain` (its top) and closes it.
    fn write(chain: &ChainSpec, bytes: &[u8]) {
        let mut d = tine_storage::LayeredDisk::open(chain).unwrap();
        let mut block = vec![0u8; 4096];
        block[..bytes.len()].copy_from_slice(bytes);
        d.write_at(&block, 0).unwrap();
        d.flush().unwrap();
    }

    fn read(chain: &ChainSpec) -> Vec<u8> {
        let d = tine_storage::LayeredDisk::open(chain).unwrap();
        let mut block = vec![0u8; 8];
        d.read_at(&mut block, 0).unwrap();
        block
    }

    #[test]
    fn names_sizes_and_the_count_are_checked() {
        let kept = tempfile::tempdir().unwrap();
        let store = VolumeStore::open(kept.path(), 8).unwrap();
        for bad in ["", "Data", "a/b", "-x", "a~b"] {
            assert!(matches!(store.create(None, bad, 1, &limits()), Err(VolumeError::BadName(_))), "{bad:?}");
        }
        assert!(matches!(store.create(None, "v", 0, &limits()), Err(VolumeError::Size { asked: 0, max: 4 })));
        assert!(matches!(store.create(None, "v", 5, &limits()), Err(VolumeError::Size { asked: 5, .. })));
        let v = store.create(Some("acme"), "v", 1, &limits()).unwrap();
        assert_eq!((v.name.as_str(), v.size_gib, v.writer.clone()), ("v", 1, None));
        assert!(v.used_bytes < 64 << 20, "sparse: {v:?}");
        assert!(matches!(store.create(Some("acme"), "v", 1, &limits()), Err(VolumeError::Exists(_))));
        // Another tenant's name space.
        store.create(None, "v", 1, &limits()).unwrap();
        assert!(matches!(store.create(None, "w", 1, &limits()), Err(VolumeError::TooMany { max: 2 })));
        assert_eq!(store.list(Some("acme")).len(), 1);
        assert_eq!(store.list(Some("other")).len(), 0);
        assert!(matches!(store.delete(Some("other"), "v"), Err(VolumeError::NotFound(_))));
        store.delete(Some("acme"), "v").unwrap();
        assert!(store.list(Some("acme")).is_empty());
        assert!(!kept.path().join(VOLUMES_DIR).join("acme~v").exists());
    }

    #[test]
    fn one_writer_many_readers_and_the_writers_data_kept_after_a_restart() {
        let kept = tempfile::tempdir().unwrap();
        let store = VolumeStore::open(kept.path(), 8).unwrap();
        store.create(None, "v", 1, &limits()).unwrap();
        let (stored, w) = store.acquire(None, "v", "sb-1", false).unwrap();
        assert!(w.top.is_some());
        assert!(
            matches!(store.acquire(None, "v", "sb-2", false), Err(VolumeError::Busy { writer, .. }) if writer == "sb-1")
        );
        // A reader's chain: a private top, every layer linked among the
        // sandbox layers (none named in the volume's directory).
        let (_, r) = store.acquire(None, "v", "sb-3", true).unwrap();
        assert!(r.top.is_some());
        assert!(disks::files(&r).all(|f| f.parent() == Some(kept.path().join(disks::DISKS_DIR).as_path())), "{r:?}");
        assert!(
            matches!(store.delete(None, "v"), Err(VolumeError::InUse { sandboxes, .. }) if sandboxes == "sb-1, sb-3")
        );
        let info = &store.list(None)[0];
        assert_eq!((info.writer.as_deref(), info.readers.clone()), (Some("sb-1"), vec!["sb-3".to_string()]));
        write(&w, b"first");
        // The writer's release: its top becomes the volume's.
        store.release(&stored, "sb-1", Some(&w)).unwrap();
        store.release(&stored, "sb-3", None).unwrap();
        let (_, w2) = store.acquire(None, "v", "sb-4", false).unwrap();
        assert_eq!(&read(&w2)[..5], b"first");
        write(&w2, b"second");
        // A branch or resume gave the writer a new top over what it wrote;
        // the manager notes it.
        let frozen = ChainSpec {
            base: w2.base.clone(),
            frozen: w2.frozen.iter().chain(w2.top.iter()).cloned().collect(),
            top: None,
        };
        let w3 = disks::new_top(&frozen, &kept.path().join(disks::DISKS_DIR)).unwrap();
        store.note_chain(&stored, "sb-4", &w3).unwrap();
        write(&w3, b"third");
        drop(store);
        // The server stopped with sb-4 writing: a new store finds its
        // writer and its last chain; sb-4 is gone, so its writes up to
        // then are taken, the later top's included.
        let store = VolumeStore::open(kept.path(), 8).unwrap();
        assert_eq!(store.list(None)[0].writer.as_deref(), Some("sb-4"));
        assert!(store.layers_in_use().contains(w3.top.as_ref().unwrap()));
        store.recover(&HashSet::new());
        assert_eq!(store.list(None)[0].writer, None);
        let (_, r2) = store.acquire(None, "v", "sb-5", true).unwrap();
        assert_eq!(&read(&r2)[..5], b"third");
        // The first reader still reads what it attached to.
        assert_eq!(&read(&r)[..5], &[0u8; 5]);
    }

    #[test]
    fn requests_fit_the_slots_with_distinct_names_and_mount_points() {
        let req = |name: &str, path: &str| VolumeRequest { name: name.into(), path: path.into(), read_only: false };
        assert!(check_requests(&[req("a", "/data"), req("b", "/srv")], 2).is_ok());
        assert!(check_requests(&[req("a", "/data"), req("b", "/srv")], 1).unwrap_err().contains("2 volumes"));
        assert!(check_requests(&[req("a", "/data"), req("a", "/srv")], 2).unwrap_err().contains("twice"));
        assert!(check_requests(&[req("a", "/data"), req("b", "/data/")], 2).unwrap_err().contains("two volumes"));
        let nested = check_requests(&[req("a", "/data"), req("c", "/data-x"), req("b", "/data/x")], 3);
        assert!(nested.unwrap_err().contains("nest"));
        for bad in ["", "/", "data", "/a/../b", "/a/./b"] {
            assert!(check_requests(&[req("a", bad)], 2).is_err(), "{bad:?}");
        }
    }
}
