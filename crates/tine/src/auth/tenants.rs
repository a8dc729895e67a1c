//! The tenants file: who may call this server besides the operator, and
//! what each may hold.
//!
//! TOML, one table per tenant, written by `tine tenant add|rotate-key|remove`
//! (mode 0600, replaced whole with rename(2), so a reader never sees half
//! a file), read by every host of a cluster (the same file on every host: a
//! Kubernetes Secret, a shared path) and read again when it changes or on
//! SIGHUP ([`super::Auth::spawn_reload`]):
//!
//! ```toml
//! [tenant.acme]
//! key_sha256 = "9f86d081884c7d65..."   # SHA-256 (FIPS 180-4) of its API key, hex
//! created_at_ms = 1764230400000
//! public_previews = false              # no public preview URLs (default: [preview] public)
//! publish_ports = true                 # may publish host ports (default: [ports] tenants)
//! [tenant.acme.quota]                  # overrides of [limits.tenant]
//! max_running = 4
//! [tenant.acme.network]                # its ceiling (default: the server's [network])
//! egress = "deny"
//! allow = ["pypi.org", "*.pythonhosted.org"]
//! ```
//!
//! An API key is `tine_` and 64 hex digits (256 bits from the kernel's
//! random source); only its SHA-256 is kept, so the file does not hold a
//! usable key. A removed tenant stays in the file with `removed = true`:
//! its key no longer works, and a server that reads the mark deletes what
//! the tenant had there: its sandboxes, templates and volumes (its
//! secrets are deleted from the secrets file by `tine tenant remove`
//! itself). With `keep_data = true` (`tine tenant remove --keep-data`)
//! its volumes and secrets are kept for the operator and the name stays
//! reserved: it cannot be added again until `tine tenant purge` deletes
//! them, so a new tenant of the same name never inherits another's data.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tine_sandbox::network::NetworkPolicy;
use tine_sandbox::Quota;

/// Longest tenant name (bytes).
pub const MAX_TENANT_NAME: usize = 32;
/// The tenant name the operator's key acts as: reserved.
pub const ADMIN: &str = "admin";
/// What every API key starts with (so a leaked one is easy to find).
pub const KEY_PREFIX: &str = "tine_";

/// Errors of the tenants file.
#[derive(Debug, thiserror::Error)]
pub enum TenantsError {
    /// The file cannot be read or written.
    #[error("tenants file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a tenants file.
    #[error("tenants file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the TOML reader said.
        message: String,
    },
    /// Group or others can read or change the file.
    #[error("tenants file {path} has mode {mode:04o}: group or others can read or change it; run `chmod 600 {path}`")]
    Open {
        /// The file.
        path: PathBuf,
        /// Its mode.
        mode: u32,
    },
    /// A name that cannot be a tenant's.
    #[error(
        "tenant name {0:?}: use 1 to {MAX_TENANT_NAME} lowercase letters, digits or '-', starting with a letter or \
         digit ('admin' is the operator's)"
    )]
    BadName(String),
    /// `add` of a name the file has.
    #[error("tenant {0} exists; `tine tenant rotate-key {0}` gives it a new key")]
    Exists(String),
    /// `add` of a removed name whose data is kept (`--keep-data`) or not
    /// yet deleted.
    #[error(
        "tenant {name} was removed and its data is still here ({what}); a new tenant of that name would inherit \
         it: {next}"
    )]
    DataLeft {
        /// The name.
        name: String,
        /// What is left: `volumes a, b; secrets c`.
        what: String,
        /// What to do.
        next: String,
    },
    /// `purge` of a tenant that is not removed.
    #[error("tenant {0} is not removed; `tine tenant remove {0} --yes` removes it and deletes its data")]
    NotRemoved(String),
    /// A name the file does not have.
    #[error("no tenant {0} (`tine tenant list` shows them)")]
    NotFound(String),
    /// A tenant's network ceiling does not compile.
    #[error("tenant {tenant}: network ceiling: {reason}")]
    Ceiling {
        /// The tenant.
        tenant: String,
        /// What is wrong.
        reason: String,
    },
}

/// Quotas of one tenant that differ from `[limits.tenant]`
/// ([`Quota`]'s fields), as the tenants file keeps them and as
/// `tine tenant add` takes them (`--max-running 4`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct QuotaOverride {
    /// Sandboxes in any state.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub max_sandboxes: Option<usize>,
    /// Live sandboxes.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub max_running: Option<usize>,
    /// vCPUs of its live sandboxes together.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub max_vcpus: Option<u64>,
    /// Guest memory (MiB) of its live sandboxes together.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub max_memory_mib: Option<u64>,
    /// The size (MiB) of its sandboxes' own disks together, live and
    /// hibernated ones.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub max_disk_mib: Option<u64>,
    /// Templates of its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub max_templates: Option<usize>,
    /// Template builds at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub max_builds: Option<usize>,
    /// MCP sessions at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub max_sessions: Option<usize>,
    /// Requests, SSE streams and port forwards open at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub max_streams: Option<usize>,
}

impl QuotaOverride {
    /// `base` with these overrides.
    pub fn apply(&self, base: &Quota) -> Quota {
        Quota {
            max_sandboxes: self.max_sandboxes.unwrap_or(base.max_sandboxes),
            max_running: self.max_running.unwrap_or(base.max_running),
            max_vcpus: self.max_vcpus.unwrap_or(base.max_vcpus),
            max_memory_mib: self.max_memory_mib.unwrap_or(base.max_memory_mib),
            max_disk_mib: self.max_disk_mib.unwrap_or(base.max_disk_mib),
            max_templates: self.max_templates.unwrap_or(base.max_templates),
            max_builds: self.max_builds.unwrap_or(base.max_builds),
            max_sessions: self.max_sessions.unwrap_or(base.max_sessions),
            max_streams: self.max_streams.unwrap_or(base.max_streams),
        }
    }
}

/// One tenant as the file keeps it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantEntry {
    /// SHA-256 of its API key, 64 lowercase hex digits.
    pub key_sha256: String,
    /// When it was added, ms since the Unix epoch.
    #[serde(default)]
    pub created_at_ms: u64,
    /// When its key was last made, ms since the Unix epoch.
    #[serde(default)]
    pub key_created_at_ms: u64,
    /// Removed: its key no longer works; servers delete its sandboxes and
    /// templates.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub removed: bool,
    /// With `removed`: its volumes and secrets are kept for the operator
    /// (`tine tenant remove --keep-data`), and the name cannot be added
    /// again until `tine tenant purge` deletes them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep_data: bool,
    /// Its quotas where they differ from `[limits.tenant]`.
    #[serde(default, skip_serializing_if = "is_default")]
    pub quota: QuotaOverride,
    /// Its network ceiling (`None`: the server's `[network]` policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkPolicy>,
    /// Whether it may make public preview URLs (`None`: the server's
    /// `[preview] public`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_previews: Option<bool>,
    /// Whether it may publish host ports (`sandbox_create { ports }`;
    /// `None`: the server's `[ports] tenants`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish_ports: Option<bool>,
}

fn is_default(q: &QuotaOverride) -> bool {
    *q == QuotaOverride::default()
}

/// The whole file.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantsFile {
    /// Tenants by name.
    #[serde(default)]
    pub tenant: BTreeMap<String, TenantEntry>,
}

/// Checks a tenant name: 1 to [`MAX_TENANT_NAME`] of `[a-z0-9-]`, not
/// starting with `-`, not [`ADMIN`].
///
/// Errors: [`TenantsError::BadName`].
pub fn check_name(name: &str) -> Result<(), TenantsError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_TENANT_NAME
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && name != ADMIN;
    if ok {
        Ok(())
    } else {
        Err(TenantsError::BadName(name.to_string()))
    }
}

/// SHA-256 of `key`, lowercase hex.
pub fn key_hash(key: &str) -> String {
    Sha256::digest(key.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// A new API key: [`KEY_PREFIX`] and 64 hex digits from the kernel's
/// random source.
///
/// Errors: reading `/dev/urandom`.
pub fn new_key() -> std::io::Result<String> {
    Ok(format!("{KEY_PREFIX}{}", super::new_token()?))
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl TenantsFile {
    /// Reads `path`; a missing file is an empty one.
    ///
    /// Errors: [`TenantsError::Io`], [`TenantsError::Open`] (a file group
    /// or others can read), [`TenantsError::Parse`], [`TenantsError::BadName`].
    pub fn load(path: &Path) -> Result<Self, TenantsError> {
        use std::os::unix::fs::PermissionsExt;
        let io = |source| TenantsError::Io { path: path.into(), source };
        let meta = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(TenantsFile::default()),
            Err(e) => return Err(io(e)),
        };
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(TenantsError::Open { path: path.into(), mode });
        }
        let text = std::fs::read_to_string(path).map_err(io)?;
        let file: TenantsFile =
            toml::from_str(&text).map_err(|e| TenantsError::Parse { path: path.into(), message: e.to_string() })?;
        for (name, entry) in &file.tenant {
            check_name(name)?;
            let hex = entry.key_sha256.len() == 64 && entry.key_sha256.bytes().all(|b| b.is_ascii_hexdigit());
            if !hex {
                return Err(TenantsError::Parse {
                    path: path.into(),
                    message: format!("tenant {name}: key_sha256 is not 64 hex digits"),
                });
            }
            if let Some(ceiling) = &entry.network {
                tine_sandbox::network::check_policy(ceiling)
                    .map_err(|e| TenantsError::Ceiling { tenant: name.clone(), reason: e.to_string() })?;
            }
        }
        Ok(file)
    }

    /// Writes the file to `path` (mode 0600) through a temporary file
    /// renamed over it.
    ///
    /// Errors: [`TenantsError::Io`].
    pub fn save(&self, path: &Path) -> Result<(), TenantsError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let io = |source| TenantsError::Io { path: path.into(), source };
        let text = toml::to_string_pretty(self)
            .map_err(|e| TenantsError::Parse { path: path.into(), message: e.to_string() })?;
        if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        let mut f =
            std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp).map_err(io)?;
        let header = "# Tine tenants: written by `tine tenant`; keys are kept as their SHA-256 only.\n";
        f.write_all(header.as_bytes())
            .and_then(|()| f.write_all(text.as_bytes()))
            .and_then(|()| f.sync_all())
            .map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Adds tenant `name` with a new key, which is returned (and kept only
    /// as its hash). A removed tenant of that name is replaced, unless its
    /// data is kept (`keep_data`). The caller checks first that nothing of
    /// a removed tenant of that name is left on disk (its volumes: the
    /// servers delete them when they read the mark).
    ///
    /// Errors: [`TenantsError::BadName`], [`TenantsError::Exists`],
    /// [`TenantsError::DataLeft`] (removed with `--keep-data`), the random
    /// source's as [`TenantsError::Io`].
    pub fn add(&mut self, name: &str, quota: QuotaOverride, path: &Path) -> Result<String, TenantsError> {
        check_name(name)?;
        match self.tenant.get(name) {
            Some(t) if !t.removed => return Err(TenantsError::Exists(name.into())),
            Some(t) if t.keep_data => {
                return Err(TenantsError::DataLeft {
                    name: name.into(),
                    what: "kept with --keep-data".into(),
                    next: format!("`tine tenant purge {name} --yes` deletes its volumes and secrets"),
                })
            }
            _ => {}
        }
        let key = new_key().map_err(|source| TenantsError::Io { path: path.into(), source })?;
        let now = unix_ms();
        let entry = TenantEntry {
            key_sha256: key_hash(&key),
            created_at_ms: now,
            key_created_at_ms: now,
            removed: false,
            keep_data: false,
            quota,
            network: None,
            public_previews: None,
            publish_ports: None,
        };
        self.tenant.insert(name.to_string(), entry);
        Ok(key)
    }

    /// Gives tenant `name` a new key (returned); the old one stops working
    /// when servers read the file again, and with it the file URLs signed
    /// for its sandboxes.
    ///
    /// Errors: [`TenantsError::NotFound`] (also for a removed tenant), the
    /// random source's.
    pub fn rotate(&mut self, name: &str, path: &Path) -> Result<String, TenantsError> {
        let entry =
            self.tenant.get_mut(name).filter(|t| !t.removed).ok_or_else(|| TenantsError::NotFound(name.into()))?;
        let key = new_key().map_err(|source| TenantsError::Io { path: path.into(), source })?;
        entry.key_sha256 = key_hash(&key);
        entry.key_created_at_ms = unix_ms();
        Ok(key)
    }

    /// Marks tenant `name` removed; with `keep_data` its volumes and
    /// secrets are to be kept (and the name reserved).
    ///
    /// Errors: [`TenantsError::NotFound`].
    pub fn remove(&mut self, name: &str, keep_data: bool) -> Result<(), TenantsError> {
        let entry =
            self.tenant.get_mut(name).filter(|t| !t.removed).ok_or_else(|| TenantsError::NotFound(name.into()))?;
        entry.removed = true;
        entry.keep_data = keep_data;
        Ok(())
    }

    /// Lets the servers delete removed tenant `name`'s kept volumes (clears
    /// `keep_data`; the caller deletes its secrets).
    ///
    /// Errors: [`TenantsError::NotFound`], [`TenantsError::NotRemoved`].
    pub fn purge(&mut self, name: &str) -> Result<(), TenantsError> {
        let entry = self.tenant.get_mut(name).ok_or_else(|| TenantsError::NotFound(name.into()))?;
        if !entry.removed {
            return Err(TenantsError::NotRemoved(name.into()));
        }
        entry.keep_data = false;
        Ok(())
    }
}

/// One tenant as the server uses it.
#[derive(Debug)]
pub struct Tenant {
    /// Its name.
    pub name: String,
    /// SHA-256 of its key, hex (file URLs for its sandboxes are signed over
    /// it, so a new key ends them).
    pub key_sha256: String,
    /// Its quotas.
    pub quota: Arc<Quota>,
    /// Its network ceiling (`None`: the server's policy is the ceiling).
    pub ceiling: Option<NetworkPolicy>,
    /// Whether it may make public preview URLs (`None`: the server's
    /// `[preview] public` decides).
    pub public_previews: Option<bool>,
    /// Whether it may publish host ports (`None`: the server's `[ports]
    /// tenants` decides).
    pub publish_ports: Option<bool>,
}

/// The tenants file as read at one time: live tenants by key hash and by
/// name, and the names of removed ones.
#[derive(Debug, Default)]
pub struct Roster {
    by_hash: HashMap<String, Arc<Tenant>>,
    by_name: BTreeMap<String, Arc<Tenant>>,
    /// Tenants marked removed.
    pub removed: Vec<String>,
    /// Of those, the ones whose volumes are kept (`keep_data`).
    pub keeping_data: Vec<String>,
}

impl Roster {
    /// Each live tenant's quota, by name (for
    /// [`tine_sandbox::Manager::set_tenant_quotas`]).
    pub fn quotas(&self) -> BTreeMap<String, Arc<Quota>> {
        self.by_name.iter().map(|(name, t)| (name.clone(), t.quota.clone())).collect()
    }

    /// The roster of `file`, each tenant's quota `defaults` with its
    /// overrides.
    pub fn new(file: &TenantsFile, defaults: &Quota) -> Self {
        let mut roster = Roster::default();
        for (name, e) in &file.tenant {
            if e.removed {
                roster.removed.push(name.clone());
                if e.keep_data {
                    roster.keeping_data.push(name.clone());
                }
                continue;
            }
            let t = Arc::new(Tenant {
                name: name.clone(),
                key_sha256: e.key_sha256.to_ascii_lowercase(),
                quota: Arc::new(e.quota.apply(defaults)),
                ceiling: e.network.clone(),
                public_previews: e.public_previews,
                publish_ports: e.publish_ports,
            });
            roster.by_hash.insert(t.key_sha256.clone(), t.clone());
            roster.by_name.insert(name.clone(), t);
        }
        roster
    }

    /// The tenant whose key is `key`. The lookup is by the key's SHA-256,
    /// so its time says nothing about the keys themselves.
    pub fn by_key(&self, key: &str) -> Option<Arc<Tenant>> {
        self.by_hash.get(&key_hash(key)).cloned()
    }

    /// Live tenant `name`.
    pub fn by_name(&self, name: &str) -> Option<Arc<Tenant>> {
        self.by_name.get(name).cloned()
    }

    /// Live tenants' names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_kept_hashed_rotated_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tenants.toml");
        let mut file = TenantsFile::load(&path).unwrap();
        assert!(file.tenant.is_empty(), "a missing file is empty");
        let key = file.add("acme", QuotaOverride { max_running: Some(3), ..Default::default() }, &path).unwrap();
        assert!(key.starts_with(KEY_PREFIX) && key.len() == KEY_PREFIX.len() + 64, "{key}");
        assert!(matches!(file.add("acme", QuotaOverride::default(), &path), Err(TenantsError::Exists(_))));
        for bad in ["admin", "", "-a", "A", "a b", &"a".repeat(33)] {
            assert!(matches!(check_name(bad), Err(TenantsError::BadName(_))), "{bad:?}");
        }
        file.save(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(&key[KEY_PREFIX.len()..]), "only the hash is kept");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let read = TenantsFile::load(&path).unwrap();
        assert_eq!(read, file);
        let roster = Roster::new(&read, &Quota::default());
        let acme = roster.by_key(&key).expect("the key is acme's");
        assert_eq!((acme.name.as_str(), acme.quota.max_running), ("acme", 3));
        assert_eq!(acme.quota.max_sandboxes, Quota::default().max_sandboxes);
        assert!(roster.by_key("tine_0000").is_none());

        let mut file = read;
        let new = file.rotate("acme", &path).unwrap();
        let roster = Roster::new(&file, &Quota::default());
        assert!(roster.by_key(&key).is_none() && roster.by_key(&new).is_some(), "the old key ends");
        file.remove("acme", false).unwrap();
        let roster = Roster::new(&file, &Quota::default());
        assert!(roster.by_key(&new).is_none());
        assert_eq!(roster.removed, ["acme"]);
        assert!(roster.keeping_data.is_empty());
        assert!(matches!(file.rotate("acme", &path), Err(TenantsError::NotFound(_))));
        // A removed name can be added again, with a new key.
        file.add("acme", QuotaOverride::default(), &path).unwrap();
        // Not while its data is kept.
        file.remove("acme", true).unwrap();
        assert_eq!(Roster::new(&file, &Quota::default()).keeping_data, ["acme"]);
        let e = file.add("acme", QuotaOverride::default(), &path).unwrap_err();
        assert!(e.to_string().contains("tine tenant purge acme --yes"), "{e}");
        file.purge("acme").unwrap();
        file.add("acme", QuotaOverride::default(), &path).unwrap();
        assert!(matches!(file.purge("acme"), Err(TenantsError::NotRemoved(_))));

        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(TenantsFile::load(&path), Err(TenantsError::Open { mode: 0o644, .. })));
    }
}
