//! Templates: named snapshots of a sandbox taken when its agent was ready,
//! from which new sandboxes are restored instead of booted.
//!
//! On disk, `<templates_dir>/<name>/` holds the VMM snapshot (`state` and
//! `memory`, see [`vmm::snapshot`]) and `template.json` ([`TemplateMeta`]:
//! shape, origin, and the identity of the kernel and root filesystem image
//! it was made from). A template is made in `.<name>.tmp` and renamed into
//! place when whole and synced ([`crate::store`]). Loaded snapshots are cached and reloaded when the
//! files change.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::lock;
use crate::memory::{MemoryBudget, MemoryUse, OverBudget, Reservation};
use crate::store;

#[cfg(feature = "schema")]
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use vmm::snapshot::{MEMORY_FILE, STATE_FILE};
use vmm::{Snapshot, SnapshotError};

/// The template the server builds at first start and `sandbox_create`
/// uses when no other is named.
pub const DEFAULT_TEMPLATE: &str = "default";
/// Names with this prefix are the server's own, as [`DEFAULT_TEMPLATE`] is.
pub const RESERVED_PREFIX: &str = "tine-";
/// The metadata file's name in a template directory.
const META_FILE: &str = "template.json";
/// The working set's file in a template directory (JSON of
/// [`vmm::WorkingSet`]): the pages a sandbox restored from the template
/// touched until its first exec and Python cell answered, prefetched into
/// every sandbox restored after. Optional: without it, restores fault
/// their pages in on first touch. Delete it to record it again.
pub const WORKING_SET_FILE: &str = "working-set.json";
/// Longest template name (bytes).
const MAX_NAME: usize = 63;

/// Errors of the template store. Messages say what happened (callers add
/// what to do next).
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The name is not usable.
    #[error(
        "invalid template name {0:?}: use 1-63 lowercase letters, digits, '-' or '_', starting with a letter or digit"
    )]
    BadName(String),
    /// No template has this name.
    #[error("no template {0:?}")]
    NotFound(String),
    /// The name is taken.
    #[error("a template named {0:?} exists already")]
    Exists(String),
    /// The template was made from another kernel or root filesystem.
    #[error("template {name:?} was made from another {what} than the server uses now")]
    Stale {
        /// The template.
        name: String,
        /// "guest kernel" or "root filesystem image".
        what: &'static str,
    },
    /// The snapshot files are damaged, of another version, or of a host
    /// with other CPU features.
    #[error("template {name:?} cannot be used: {source}")]
    Snapshot {
        /// The template.
        name: String,
        /// Why.
        #[source]
        source: SnapshotError,
    },
    /// `template.json` is missing or damaged.
    #[error("template {name:?} is damaged ({}): {reason}", dir.display())]
    Meta {
        /// The template.
        name: String,
        /// The directory.
        dir: PathBuf,
        /// Why.
        reason: String,
    },
    /// The name is the server's own ([`DEFAULT_TEMPLATE`] or
    /// [`RESERVED_PREFIX`]`*`): clients can neither write nor delete it.
    #[error("template name {0:?} is reserved for the server (\"default\" and names starting with \"tine-\")")]
    Reserved(String),
    /// The template quota (count or disk space) is used up.
    #[error("template quota reached: {0}")]
    Quota(String),
    /// Loading the template's memory does not fit the memory budget, even
    /// after unloading the templates no sandbox is being made from.
    #[error(transparent)]
    OverBudget(#[from] OverBudget),
    /// A recipe that cannot be built as given.
    #[error("bad recipe: {0}")]
    BadRecipe(String),
    /// A build of this name runs.
    #[error("template {0:?} is being built; wait for it (template_list shows its step)")]
    Building(String),
    /// A recipe's setup step failed or timed out; the build stopped there.
    #[error("setup step {step} ({command}) failed: {exit}; stdout: {stdout:?}; stderr: {stderr:?}")]
    SetupFailed {
        /// Its number, from 1.
        step: usize,
        /// The command (cut).
        command: String,
        /// "exit code 2", "signal 9" or "timed out after 600 s".
        exit: String,
        /// The end of its stdout (at most 4 KiB).
        stdout: String,
        /// The end of its stderr (at most 4 KiB).
        stderr: String,
    },
    /// A file operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl From<store::StoreError> for TemplateError {
    fn from(e: store::StoreError) -> Self {
        match e {
            store::StoreError::Exists(p) => TemplateError::Exists(p.display().to_string()),
            store::StoreError::Io { what, source } => TemplateError::Io { what, source },
        }
    }
}

/// Which file, by identity: a changed image must not be used under a
/// template made from the old one (the guest's page cache would disagree
/// with the disk).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileIdentity {
    /// Size (bytes).
    pub len: u64,
    /// Modification time (ns since the Unix epoch).
    pub mtime_ns: i128,
    /// Inode number.
    pub ino: u64,
}

impl FileIdentity {
    /// The identity of the file at `path`.
    ///
    /// Errors: the `stat(2)` error.
    pub fn of(path: &Path) -> std::io::Result<Self> {
        Ok(Self::from_metadata(&std::fs::metadata(path)?))
    }

    /// The identity of the open file `file`.
    ///
    /// Errors: the `fstat(2)` error.
    pub fn of_file(file: &std::fs::File) -> std::io::Result<Self> {
        Ok(Self::from_metadata(&file.metadata()?))
    }

    fn from_metadata(m: &std::fs::Metadata) -> Self {
        FileIdentity {
            len: m.len(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
            ino: m.ino(),
        }
    }
}

/// `template.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateMeta {
    /// The name (the directory's).
    pub name: String,
    /// vCPUs of every sandbox made from it.
    pub vcpus: u8,
    /// Guest memory of every sandbox made from it (MiB).
    pub memory_mib: u64,
    /// When it was made (ms since the Unix epoch).
    pub created_at_ms: u64,
    /// The sandbox it was taken from (`None` for a built default).
    pub source_sandbox: Option<String>,
    /// The guest kernel it was booted from.
    pub kernel: FileIdentity,
    /// The server's root filesystem image when it was made: what it runs
    /// on, or (for a template from an OCI image) where its agent came from.
    pub rootfs: FileIdentity,
    /// The guest set-up it was made with beyond the images (network
    /// device, extra CA certificates; see [`TemplateStore::with_guest_setup`]);
    /// empty for none.
    #[serde(default)]
    pub guest_setup: String,
    /// The base image its sandboxes boot as their root (`/dev/vda`) when
    /// it was made from an OCI image, and that file's identity then.
    /// `None`: the server's root filesystem.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<(PathBuf, FileIdentity)>,
}

/// What `template_list` shows of a template.
#[derive(Clone, Debug, Serialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub struct TemplateInfo {
    /// The name, for `sandbox_create { template }`.
    pub name: String,
    /// vCPUs of sandboxes made from it.
    pub vcpus: u8,
    /// Guest memory of sandboxes made from it (MiB).
    pub memory_mib: u64,
    /// When it was made (ms since the Unix epoch).
    pub created_at_ms: u64,
    /// The sandbox it was taken from, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_sandbox: Option<String>,
    /// Disk space its memory file takes (bytes; the file is sparse).
    pub disk_bytes: u64,
    /// Why it cannot be used, if it cannot (for a failed build: why it
    /// failed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// `ready` (usable), `building` (a recipe's build runs) or `failed`.
    pub state: TemplateState,
    /// While building: what the build does now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    /// Whether restores prefetch its recorded working set (see
    /// [`WORKING_SET_FILE`]).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub prefetch: bool,
}

/// Whether a template can be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum TemplateState {
    /// Made: sandboxes can start from it (unless `error` says otherwise).
    Ready,
    /// Its recipe's build runs.
    Building,
    /// Its recipe's build failed (`error` says why).
    Failed,
}

/// A loaded template: its metadata and checked snapshot.
pub struct Template {
    /// `template.json`.
    pub meta: TemplateMeta,
    /// The snapshot, checked (checksums, version) when loaded, its memory
    /// copied into a memfd ([`Snapshot::into_memory`]).
    pub snapshot: Snapshot,
    /// Its sandbox disk's frozen chain, kept in its directory
    /// ([`crate::disks::keep`]); `None` for a template whose sandboxes
    /// have no disk.
    pub disk: Option<tine_storage::ChainSpec>,
    /// Identity of the state and memory files when loaded.
    files: (FileIdentity, FileIdentity),
    /// Its working set ([`WORKING_SET_FILE`]), once recorded.
    working_set: Mutex<Option<Arc<vmm::WorkingSet>>>,
}

impl Template {
    /// Its snapshot's files as they were when it was loaded: the state
    /// file's and the memory file's names and identities.
    pub fn file_identities(&self) -> [(&'static str, &FileIdentity); 2] {
        [(STATE_FILE, &self.files.0), (MEMORY_FILE, &self.files.1)]
    }

    /// The pages to prefetch into a sandbox restored from it, if recorded.
    pub fn working_set(&self) -> Option<Arc<vmm::WorkingSet>> {
        lock(&self.working_set).clone()
    }
}

/// A loaded template and its share of the memory budget.
struct Cached {
    template: Arc<Template>,
    _memory: Option<Reservation>,
}

/// The templates directory and a cache of loaded templates.
pub struct TemplateStore {
    dir: PathBuf,
    kernel: PathBuf,
    rootfs: PathBuf,
    cache: Mutex<BTreeMap<String, Cached>>,
    /// Held while a template is read into the cache: two callers that miss
    /// the cache at once (the start's check of the default template and a
    /// first create, say) load it once, and the budget counts it once.
    loading: Mutex<()>,
    budget: Option<Arc<MemoryBudget>>,
    /// See [`TemplateStore::with_guest_setup`].
    guest_setup: String,
}

/// Whether `name` is one only the server may write or delete:
/// [`DEFAULT_TEMPLATE`] and names starting with [`RESERVED_PREFIX`]. A
/// tenant's template ([`qualified`]) never is.
pub fn is_reserved(name: &str) -> bool {
    name == DEFAULT_TEMPLATE || name.starts_with(RESERVED_PREFIX)
}

/// Between a tenant and its template's name in the name the store keeps:
/// tenant `acme`'s template `data` is `acme~data` (a character no name has,
/// so tenants' names never meet each other's or the server's).
pub const TENANT_SEPARATOR: char = '~';

/// The name the store keeps for template `name` of `tenant` (`None`: the
/// server's, kept as `name`).
pub fn qualified(tenant: Option<&str>, name: &str) -> String {
    match tenant {
        Some(t) => format!("{t}{TENANT_SEPARATOR}{name}"),
        None => name.to_string(),
    }
}

/// A stored name's tenant and name: `acme~data` gives `(Some("acme"),
/// "data")`, `default` gives `(None, "default")`.
pub fn split_qualified(stored: &str) -> (Option<&str>, &str) {
    match stored.split_once(TENANT_SEPARATOR) {
        Some((t, n)) => (Some(t), n),
        None => (None, stored),
    }
}

/// Checks a template name as the store keeps it: `[a-z0-9][a-z0-9_-]{0,62}`,
/// or such a name behind a tenant's name and [`TENANT_SEPARATOR`] (the
/// tenant's name of the same characters, at most 32 bytes).
///
/// Errors: [`TemplateError::BadName`].
pub fn check_name(stored: &str) -> Result<(), TemplateError> {
    let plain = |name: &str, max: usize| {
        !name.is_empty()
            && name.len() <= max
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
            && name.as_bytes()[0].is_ascii_alphanumeric()
    };
    let ok = match split_qualified(stored) {
        (Some(tenant), name) => plain(tenant, 32) && plain(name, MAX_NAME),
        (None, name) => plain(name, MAX_NAME),
    };
    if ok {
        Ok(())
    } else {
        Err(TemplateError::BadName(stored.to_string()))
    }
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> TemplateError {
    move |source| TemplateError::Io { what, source }
}

impl TemplateStore {
    /// A store in `dir` (created if missing; half-made templates left by
    /// an earlier run are removed) for templates of `kernel` and `rootfs`.
    ///
    /// Errors: [`TemplateError::Io`].
    pub fn new(dir: PathBuf, kernel: PathBuf, rootfs: PathBuf) -> Result<Self, TemplateError> {
        std::fs::create_dir_all(&dir).map_err(io(format!("create {}", dir.display())))?;
        let entries = std::fs::read_dir(&dir).map_err(io(format!("read {}", dir.display())))?;
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with('.') {
                tracing::info!("removing the half-made template {}", e.path().display());
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        Ok(TemplateStore {
            dir,
            kernel,
            rootfs,
            cache: Mutex::new(BTreeMap::new()),
            loading: Mutex::new(()),
            budget: None,
            guest_setup: String::new(),
        })
    }

    /// The store, for templates made with `guest_setup` (a fingerprint of
    /// the server's guest set-up beyond the images: whether sandboxes have
    /// a network device, which CA certificates they trust); templates made
    /// with another are stale.
    pub fn with_guest_setup(mut self, guest_setup: String) -> Self {
        self.guest_setup = guest_setup;
        self
    }

    /// The guest set-up fingerprint of templates made now.
    pub fn guest_setup(&self) -> &str {
        &self.guest_setup
    }

    /// The store, with every loaded template's memory counted against
    /// `budget` ([`crate::memory`]).
    pub fn with_budget(mut self, budget: Arc<MemoryBudget>) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Unloads every loaded template that nothing uses now (no restore is
    /// being made from it), except `keep`; returns how many went. Their
    /// memory leaves the budget; sandboxes restored from them keep the
    /// pages they mapped.
    pub fn evict_unused(&self, keep: Option<&str>) -> usize {
        let mut cache = lock(&self.cache);
        let before = cache.len();
        cache.retain(|name, c| Some(name.as_str()) == keep || Arc::strong_count(&c.template) > 1);
        let evicted = before - cache.len();
        if evicted > 0 {
            tracing::info!("unloaded {evicted} unused templates to free memory");
        }
        evicted
    }

    /// Names of the loaded templates.
    pub fn loaded(&self) -> Vec<String> {
        lock(&self.cache).keys().cloned().collect()
    }

    /// Checks that one more template (of the server's, `replace`-ing an
    /// existing one, or not) fits the quotas `max_templates` and
    /// `max_disk_bytes`.
    ///
    /// Errors: [`TemplateError::Quota`].
    pub fn check_quota(&self, name: &str, max_templates: usize, max_disk_bytes: u64) -> Result<(), TemplateError> {
        let all = self.list();
        let count = all.iter().filter(|t| t.name != name).count();
        if count + 1 > max_templates {
            return Err(TemplateError::Quota(format!(
                "{count} templates exist, the limit is {max_templates}; delete one with template_delete"
            )));
        }
        let disk: u64 = all.iter().map(|t| t.disk_bytes).sum();
        if disk >= max_disk_bytes {
            return Err(TemplateError::Quota(format!(
                "templates take {} MiB of disk, the limit is {} MiB; delete one with template_delete",
                disk >> 20,
                max_disk_bytes >> 20
            )));
        }
        Ok(())
    }

    /// Deletes template `name`: its directory goes and it is unloaded;
    /// sandboxes restored from it keep running on the files they opened.
    /// Blocking (removes files).
    ///
    /// Errors: [`TemplateError::BadName`], [`TemplateError::NotFound`],
    /// [`TemplateError::Io`].
    pub fn delete(&self, name: &str) -> Result<(), TemplateError> {
        check_name(name)?;
        let dir = self.path(name);
        if !dir.exists() {
            return Err(TemplateError::NotFound(name.to_string()));
        }
        // Renamed out of the way first (store::remove), so a concurrent
        // load sees it gone rather than half-removed.
        let removed = store::remove(&dir);
        lock(&self.cache).remove(name);
        Ok(removed?)
    }

    /// The directory of template `name`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Whether a template directory named `name` exists (usable or not).
    pub fn exists(&self, name: &str) -> bool {
        self.path(name).join(STATE_FILE).exists()
    }

    /// A new, empty directory (its own, even for concurrent calls) to make
    /// template `name` in; pass it to
    /// [`TemplateStore::commit`] when the snapshot is written.
    ///
    /// Errors: [`TemplateError::BadName`], [`TemplateError::Exists`],
    /// [`TemplateError::Io`].
    pub fn begin(&self, name: &str, replace: bool) -> Result<PathBuf, TemplateError> {
        check_name(name)?;
        if !replace && self.path(name).exists() {
            return Err(TemplateError::Exists(name.to_string()));
        }
        // Unique per call: two snapshots under one name may race; the
        // second to commit finds the name taken.
        Ok(store::begin(&self.dir, name)?)
    }

    /// Writes `template.json` into `tmp` and moves it into place as
    /// `meta.name` (replacing an older template of that name if `replace`).
    /// VMs restored from a replaced template keep its files open.
    ///
    /// Errors: [`TemplateError::Exists`], [`TemplateError::Io`].
    pub fn commit(&self, tmp: &Path, meta: &TemplateMeta, replace: bool) -> Result<(), TemplateError> {
        let json = serde_json::to_vec_pretty(meta)
            .map_err(|e| TemplateError::Io { what: "encode template.json".into(), source: e.into() })?;
        store::write_synced(&tmp.join(META_FILE), &json)?;
        store::commit(tmp, &self.path(&meta.name), replace).map_err(|e| match e {
            store::StoreError::Exists(_) => TemplateError::Exists(meta.name.clone()),
            e => e.into(),
        })?;
        lock(&self.cache).remove(&meta.name);
        Ok(())
    }

    /// The identities of the kernel and root filesystem in use now.
    ///
    /// Errors: [`TemplateError::Io`].
    pub fn images(&self) -> Result<(FileIdentity, FileIdentity), TemplateError> {
        let k = FileIdentity::of(&self.kernel).map_err(io(format!("stat {}", self.kernel.display())))?;
        let r = FileIdentity::of(&self.rootfs).map_err(io(format!("stat {}", self.rootfs.display())))?;
        Ok((k, r))
    }

    fn read_meta(&self, name: &str) -> Result<TemplateMeta, TemplateError> {
        let dir = self.path(name);
        let damaged = |reason: String| TemplateError::Meta { name: name.to_string(), dir: dir.clone(), reason };
        let text = std::fs::read(dir.join(META_FILE)).map_err(|e| damaged(format!("{META_FILE}: {e}")))?;
        let meta: TemplateMeta = serde_json::from_slice(&text).map_err(|e| damaged(format!("{META_FILE}: {e}")))?;
        if meta.name != name {
            return Err(damaged(format!("{META_FILE} names {:?}", meta.name)));
        }
        Ok(meta)
    }

    fn file_ids(&self, name: &str) -> Result<(FileIdentity, FileIdentity), TemplateError> {
        let dir = self.path(name);
        let id = |f: &str| FileIdentity::of(&dir.join(f)).map_err(io(format!("stat {}", dir.join(f).display())));
        Ok((id(STATE_FILE)?, id(MEMORY_FILE)?))
    }

    /// Template `name`, loaded and checked (metadata, image identities,
    /// snapshot checksums and version); cached until its files change.
    /// Reading a large memory file takes a while: call it from a blocking
    /// context.
    ///
    /// Errors: [`TemplateError::BadName`], [`TemplateError::NotFound`],
    /// [`TemplateError::Meta`], [`TemplateError::Stale`],
    /// [`TemplateError::Snapshot`], [`TemplateError::Io`].
    pub fn load(&self, name: &str) -> Result<Arc<Template>, TemplateError> {
        check_name(name)?;
        if !self.path(name).exists() {
            return Err(TemplateError::NotFound(name.to_string()));
        }
        let files = self.file_ids(name).map_err(|e| match e {
            TemplateError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => TemplateError::Meta {
                name: name.to_string(),
                dir: self.path(name),
                reason: "its snapshot files are missing".into(),
            },
            e => e,
        })?;
        if let Some(t) = self.cached(name, &files) {
            return Ok(t);
        }
        let _loading = lock(&self.loading);
        // Another caller may have loaded it while this one waited.
        if let Some(t) = self.cached(name, &files) {
            return Ok(t);
        }
        let meta = self.read_meta(name)?;
        if let Some(e) = stale(&meta, &self.images()?) {
            return Err(e);
        }
        if meta.guest_setup != self.guest_setup {
            return Err(TemplateError::Stale {
                name: meta.name.clone(),
                what: "guest set-up (the VMM's machine revision, network device or CA certificates)",
            });
        }
        let memory = match &self.budget {
            None => None,
            Some(b) => {
                let parts = [(MemoryUse::Template, meta.memory_mib)];
                let r = b.reserve("template load", &parts).or_else(|_| {
                    self.evict_unused(Some(name));
                    b.reserve("template load", &parts)
                })?;
                r.into_iter().next()
            }
        };
        // Held in a memfd, the memory is shmem: sandboxes restored from it
        // map that, which userfaultfd can write-protect, so they branch
        // without a copy while paused (see `vmm::branch`).
        let snapshot = Snapshot::load(&self.path(name))
            .and_then(|s| s.into_memory(name))
            .map_err(|source| TemplateError::Snapshot { name: name.to_string(), source })?;
        let disk = crate::disks::load(&self.path(name)).map_err(|e| TemplateError::Meta {
            name: name.to_string(),
            dir: self.path(name),
            reason: e.to_string(),
        })?;
        let working_set = Mutex::new(read_working_set(&self.path(name), meta.memory_mib << 20));
        let t = Arc::new(Template { meta, snapshot, disk, files, working_set });
        lock(&self.cache).insert(name.to_string(), Cached { template: t.clone(), _memory: memory });
        Ok(t)
    }

    /// Template `name` from the cache when its files are still `files`;
    /// a cached one whose files changed since is dropped (its memory
    /// leaves the budget).
    fn cached(&self, name: &str, files: &(FileIdentity, FileIdentity)) -> Option<Arc<Template>> {
        let mut cache = lock(&self.cache);
        match cache.get(name) {
            Some(c) if c.template.files == *files => Some(c.template.clone()),
            Some(_) => {
                cache.remove(name);
                None
            }
            None => None,
        }
    }

    /// Stores `ws` as template `name`'s working set ([`WORKING_SET_FILE`],
    /// written whole then renamed into place) and gives it to the loaded
    /// template, so the next restores prefetch it.
    ///
    /// Errors: [`TemplateError::NotFound`], [`TemplateError::Io`].
    pub fn save_working_set(&self, name: &str, ws: vmm::WorkingSet) -> Result<(), TemplateError> {
        let dir = self.path(name);
        if !dir.join(META_FILE).exists() {
            return Err(TemplateError::NotFound(name.to_string()));
        }
        let json = serde_json::to_vec(&ws).map_err(|e| TemplateError::Io {
            what: format!("encode the working set of {name}"),
            source: std::io::Error::other(e),
        })?;
        store::replace_file(&dir, WORKING_SET_FILE, &json)?;
        if let Some(c) = lock(&self.cache).get(name) {
            *lock(&c.template.working_set) = Some(Arc::new(ws));
        }
        Ok(())
    }

    /// Every template directory, by name, with why it cannot be used if it
    /// cannot (metadata and image checks only; checksums are checked on use).
    pub fn list(&self) -> Vec<TemplateInfo> {
        let mut out = Vec::new();
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return out };
        let images = self.images().ok();
        let mut names: Vec<String> = entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| check_name(n).is_ok())
            .collect();
        names.sort();
        for name in names {
            let dir = self.path(&name);
            let disk_bytes = std::fs::metadata(dir.join(MEMORY_FILE)).map(|m| m.blocks() * 512).unwrap_or(0);
            match self.read_meta(&name) {
                Ok(m) => {
                    let error = images.as_ref().and_then(|i| stale(&m, i)).map(|e| e.to_string());
                    out.push(TemplateInfo {
                        name,
                        vcpus: m.vcpus,
                        memory_mib: m.memory_mib,
                        created_at_ms: m.created_at_ms,
                        source_sandbox: m.source_sandbox,
                        disk_bytes,
                        error,
                        state: TemplateState::Ready,
                        step: None,
                        prefetch: dir.join(WORKING_SET_FILE).exists(),
                    });
                }
                Err(e) => out.push(TemplateInfo {
                    name,
                    vcpus: 0,
                    memory_mib: 0,
                    created_at_ms: 0,
                    source_sandbox: None,
                    disk_bytes,
                    error: Some(e.to_string()),
                    state: TemplateState::Ready,
                    step: None,
                    prefetch: false,
                }),
            }
        }
        out
    }
}

/// The working set in template directory `dir`, if there is one that
/// parses and fits guest RAM of `size` bytes (a damaged one is ignored
/// with a warning: restores work without it).
fn read_working_set(dir: &Path, size: u64) -> Option<Arc<vmm::WorkingSet>> {
    let text = match std::fs::read(dir.join(WORKING_SET_FILE)) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!("cannot read {}: {e}", dir.join(WORKING_SET_FILE).display());
            return None;
        }
    };
    match serde_json::from_slice::<vmm::WorkingSet>(&text) {
        Ok(ws) if ws.fits(size) => Some(Arc::new(ws)),
        Ok(_) => {
            tracing::warn!("{} does not fit the template's memory; ignored", dir.join(WORKING_SET_FILE).display());
            None
        }
        Err(e) => {
            tracing::warn!("{} is damaged ({e}); ignored", dir.join(WORKING_SET_FILE).display());
            None
        }
    }
}

/// [`TemplateError::Stale`] if `meta` was made from other images than
/// `images` (kernel, root filesystem), else `None`.
fn stale(meta: &TemplateMeta, images: &(FileIdentity, FileIdentity)) -> Option<TemplateError> {
    // A template from an OCI image also runs on its own base image (and
    // its agent came from the server's root filesystem).
    let what = if meta.kernel != images.0 {
        "guest kernel"
    } else if meta.rootfs != images.1 {
        "root filesystem image"
    } else if let Some((path, identity)) = &meta.base {
        // "... made from another base image (its file is missing) than ..."
        match FileIdentity::of(path) {
            Ok(now) if now == *identity => return None,
            Ok(_) => "base image (its file was replaced)",
            Err(_) => "base image (its file is missing)",
        }
    } else {
        return None;
    };
    Some(TemplateError::Stale { name: meta.name.clone(), what })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["default", "py-3", "a", "x_1", "0abc", "acme~data", "t-1~default"] {
            check_name(ok).unwrap();
        }
        let long_tenant = format!("{}~a", "t".repeat(33));
        for bad in ["", "-a", "_a", "A", "a/b", "..", ".x", "a b", &"x".repeat(64), "~a", "a~", "a~b~c", &long_tenant] {
            assert!(matches!(check_name(bad), Err(TemplateError::BadName(_))), "{bad:?}");
        }
        // A tenant's names are its own and never reserved.
        assert_eq!(qualified(Some("acme"), "default"), "acme~default");
        assert!(!is_reserved("acme~default") && !is_reserved("acme~tine-x"));
        assert_eq!(split_qualified("acme~data"), (Some("acme"), "data"));
        assert_eq!(split_qualified("default"), (None, "default"));
    }

    fn store() -> (tempfile::TempDir, TemplateStore) {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("vmlinux"), b"kernel").unwrap();
        std::fs::write(d.path().join("rootfs"), b"rootfs").unwrap();
        let s =
            TemplateStore::new(d.path().join("templates"), d.path().join("vmlinux"), d.path().join("rootfs")).unwrap();
        (d, s)
    }

    fn meta(s: &TemplateStore, name: &str) -> TemplateMeta {
        let (kernel, rootfs) = s.images().unwrap();
        TemplateMeta {
            name: name.into(),
            vcpus: 1,
            memory_mib: 128,
            created_at_ms: 1,
            source_sandbox: None,
            kernel,
            rootfs,
            guest_setup: String::new(),
            base: None,
        }
    }

    #[test]
    fn commit_list_and_stale_images() {
        let (d, s) = store();
        let tmp = s.begin("t1", false).unwrap();
        std::fs::write(tmp.join(STATE_FILE), b"x").unwrap();
        std::fs::write(tmp.join(MEMORY_FILE), b"y").unwrap();
        s.commit(&tmp, &meta(&s, "t1"), false).unwrap();
        assert!(s.exists("t1"));
        assert!(matches!(s.begin("t1", false), Err(TemplateError::Exists(_))));
        let l = s.list();
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].name, "t1");
        assert!(l[0].error.is_none());
        // A damaged state file is found on load, with the snapshot's reason.
        let e = s.load("t1").err().unwrap();
        assert!(matches!(e, TemplateError::Snapshot { .. }), "{e}");
        assert!(e.to_string().contains("template \"t1\" cannot be used"), "{e}");
        // A rebuilt root filesystem makes the template stale.
        std::thread::sleep(std::time::Duration::from_millis(10));
        std::fs::write(d.path().join("rootfs"), b"rootfs, rebuilt").unwrap();
        let e = s.load("t1").err().unwrap();
        assert!(matches!(e, TemplateError::Stale { what: "root filesystem image", .. }), "{e}");
        assert!(s.list()[0].error.as_deref().unwrap().contains("another root filesystem image"));
        assert!(matches!(s.load("nope"), Err(TemplateError::NotFound(_))));
        assert!(matches!(s.load("../etc"), Err(TemplateError::BadName(_))));
        // Half-made templates go at the next start.
        let _half = s.begin("t2", false).unwrap();
        let s2 =
            TemplateStore::new(d.path().join("templates"), d.path().join("vmlinux"), d.path().join("rootfs")).unwrap();
        assert_eq!(std::fs::read_dir(d.path().join("templates")).unwrap().count(), 1);
        assert_eq!(s2.list().len(), 1);
    }
}
