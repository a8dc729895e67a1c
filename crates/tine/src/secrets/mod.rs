//! The server's secrets: API keys and tokens a sandbox uses without ever
//! holding them. Set only from the host (`tine secret set`, which reads
//! the value from standard input or a file, never from MCP), kept sealed
//! in the data directory ([`file`]), read again when the file changes;
//! each belongs to a tenant, or to the operator (and, `shared`, to every
//! tenant).
//!
//! A sandbox binds one by name to an environment variable
//! (`sandbox_create { secrets: { OPENAI_API_KEY: "openai" } }`): the
//! variable holds a placeholder, and the broker (`crates/broker`) puts the
//! value in place of it in requests to the secret's hosts only
//! ([`tine_sandbox::secrets`]). [`Store`] is what the manager asks.
//!
//! ```toml
//! [secrets]
//! file = "/var/lib/tine/secrets.json"     # default: DATA_DIR/secrets.json
//! key_file = "/etc/tine/secrets.key"      # default: the systemd credential tine-secrets-key, else DATA_DIR/secrets.key
//! refuse_leaks = false                    # refuse plain HTTP that carries a placeholder to another host (always logged)
//! ca_cert = "/etc/tine/broker-ca.pem"     # the broker's CA (default: made in DATA_DIR at first start)
//! ca_key = "/etc/tine/broker-ca.key"
//! ```

pub mod file;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tine_sandbox::secrets::{HostPattern, SecretRule, SecretSource, SecretValue};

use file::{Key, StoredSecret};

/// How often the server looks for a changed secrets file.
pub const RELOAD_EVERY: Duration = Duration::from_secs(1);
/// Longest secret name (bytes).
pub const MAX_NAME: usize = 64;
/// Most hosts one secret may go to.
pub const MAX_HOSTS: usize = 32;

/// `[secrets]` in the configuration file.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct SecretsConfig {
    /// The secrets file (default: `DATA_DIR/secrets.json`).
    pub file: Option<PathBuf>,
    /// The key file (default: the systemd credential, else
    /// `DATA_DIR/secrets.key`).
    pub key_file: Option<PathBuf>,
    /// Refuse (reset) plain HTTP requests that carry a placeholder to a
    /// host its secret may not go to; they are logged either way.
    pub refuse_leaks: bool,
    /// The broker's CA certificate (PEM); with `ca_key`. Default: one made
    /// at first start in the data directory.
    pub ca_cert: Option<PathBuf>,
    /// The broker CA's key (PEM, PKCS#8).
    pub ca_key: Option<PathBuf>,
}

impl SecretsConfig {
    /// The secrets file of a server on `data_dir`.
    pub fn path(&self, data_dir: &Path) -> PathBuf {
        self.file.clone().unwrap_or_else(|| data_dir.join(file::SECRETS_FILE))
    }
}

/// Errors of the secrets store.
#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    /// The file cannot be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS's error.
        source: std::io::Error,
    },
    /// The file is not the store's.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The key cannot be had.
    #[error("the secrets key {path}: {reason}")]
    Key {
        /// Where it was looked for.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Sealing a value failed (the random source, the AEAD).
    #[error("{0}")]
    Crypto(String),
    /// A sealed value does not open: the entry was changed (its value or
    /// its policy), or the key is another.
    #[error(
        "secret {name:?}{} fails its integrity check: its entry in the file (the value, or its policy: \
         hosts, header, format, shared, any-header, in-query, in-body) was changed by something else \
         than `tine secret set`, or this is another key; set it again",
        .tenant.as_ref().map(|t| format!(" of tenant {t:?}")).unwrap_or_default()
    )]
    Integrity {
        /// The secret.
        name: String,
        /// Its tenant.
        tenant: Option<String>,
    },
    /// A name, host, header or value that cannot be used.
    #[error("{0}")]
    Invalid(String),
    /// No such secret.
    #[error("no secret {0:?}")]
    NotFound(String),
}

/// A secret's metadata, as `secret_list` and `tine secret ls` show it.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema, PartialEq, Eq)]
pub struct SecretInfo {
    /// Its name.
    pub name: String,
    /// Who may use it: `"operator"`, `"shared"` (every tenant) or
    /// `"tenant:<name>"`.
    pub owner: String,
    /// The hosts it may be sent to.
    pub hosts: Vec<String>,
    /// The header it goes in (absent: `Authorization`, or every header
    /// with `any_header`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// Swapped in every request header, not just its own.
    pub any_header: bool,
    /// Also swapped in query strings.
    pub in_query: bool,
    /// Also swapped in small request bodies.
    pub in_body: bool,
    /// When it was set, ms since the Unix epoch.
    pub updated_at_ms: u64,
}

impl SecretInfo {
    fn of(s: &StoredSecret) -> Self {
        let owner = match (&s.tenant, s.shared) {
            (Some(t), _) => format!("tenant:{t}"),
            (None, true) => "shared".into(),
            (None, false) => "operator".into(),
        };
        SecretInfo {
            name: s.name.clone(),
            owner,
            hosts: s.hosts.clone(),
            header: s.header.clone(),
            any_header: s.any_header,
            in_query: s.in_query,
            in_body: s.in_body,
            updated_at_ms: s.updated_at_ms,
        }
    }
}

/// What `tine secret set` sets.
#[derive(Debug)]
pub struct NewSecret {
    /// Its name.
    pub name: String,
    /// Its tenant (`None`: the operator's).
    pub tenant: Option<String>,
    /// An operator's secret every tenant may use.
    pub shared: bool,
    /// Its hosts.
    pub hosts: Vec<String>,
    /// The one header it is swapped in (`None`: `Authorization`).
    pub header: Option<String>,
    /// Without `header`: swap it in every request header.
    pub any_header: bool,
    /// The header's format (`{value}` where the value goes).
    pub format: Option<String>,
    /// Swap in query strings.
    pub in_query: bool,
    /// Swap in small bodies.
    pub in_body: bool,
}

/// Checks a secret's name: 1-[`MAX_NAME`] letters, digits, `_`, `-`, `.`.
///
/// Errors: [`SecretsError::Invalid`].
pub fn check_name(name: &str) -> Result<(), SecretsError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(SecretsError::Invalid(format!("secret name {name:?}: use 1-{MAX_NAME} letters, digits, '_', '-' or '.'")))
    }
}

/// The rule of a stored secret with its value.
fn rule_of(s: &StoredSecret, value: zeroize::Zeroizing<Vec<u8>>) -> Result<SecretRule, SecretsError> {
    let hosts = s
        .hosts
        .iter()
        .map(|h| HostPattern::parse(h))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| SecretsError::Invalid(format!("secret {}: {e}", s.name)))?;
    let header = match &s.header {
        Some(h) => Some((
            tine_broker::swap::check_header(h, s.format.as_deref())
                .map_err(|e| SecretsError::Invalid(format!("secret {}: {e}", s.name)))?,
            s.format.clone(),
        )),
        None => None,
    };
    Ok(SecretRule {
        name: s.name.clone(),
        value: Arc::new(SecretValue::new(value.to_vec())),
        hosts,
        header,
        any_header: s.any_header && s.header.is_none(),
        in_query: s.in_query,
        in_body: s.in_body,
    })
}

/// Sets `new` with `value` in the file at `path` under `key` (replacing a
/// secret of the same owner and name).
///
/// Errors: [`SecretsError`].
pub fn set(path: &Path, key: &Key, new: NewSecret, value: &[u8]) -> Result<SecretInfo, SecretsError> {
    check_name(&new.name)?;
    if value.is_empty() || value.len() > file::MAX_VALUE_BYTES {
        return Err(SecretsError::Invalid(format!("a value of 1 to {} bytes", file::MAX_VALUE_BYTES)));
    }
    if new.hosts.is_empty() || new.hosts.len() > MAX_HOSTS {
        return Err(SecretsError::Invalid(format!("--hosts: 1 to {MAX_HOSTS} hosts it may be sent to")));
    }
    if new.any_header && new.header.is_some() {
        return Err(SecretsError::Invalid("--any-header is for a secret without --header".into()));
    }
    if new.tenant.is_some() && new.shared {
        return Err(SecretsError::Invalid("--shared is for the operator's secrets, not a tenant's".into()));
    }
    let mut stored = StoredSecret {
        name: new.name,
        tenant: new.tenant,
        shared: new.shared,
        hosts: new.hosts.iter().map(|h| h.trim().to_ascii_lowercase()).collect(),
        header: new.header,
        any_header: new.any_header,
        format: new.format,
        in_query: new.in_query,
        in_body: new.in_body,
        updated_at_ms: crate::preview::store::now_ms(),
        nonce: String::new(),
        sealed: String::new(),
    };
    // Sealed under its policy as it is now (file::aad).
    (stored.nonce, stored.sealed) = file::seal(key, &stored, value)?;
    // The rules must read back (hosts, header, format).
    rule_of(&stored, zeroize::Zeroizing::new(value.to_vec()))?;
    // A format-1 file is rewritten first: one file holds one format.
    let migrated = file::migrate(path, key).map_err(|e| match e {
        SecretsError::Integrity { .. } => SecretsError::Invalid(format!(
            "{}: a format-1 file is rewritten in format {} before a secret is set, and {e} \
             (remove that one with `tine secret rm`, or pass the key it was sealed with)",
            path.display(),
            file::FORMAT
        )),
        e => e,
    })?;
    if migrated > 0 {
        tracing::info!("{}: {migrated} secrets rewritten in format {}", path.display(), file::FORMAT);
    }
    let mut all = file::load(path)?;
    all.retain(|s| !(s.name == stored.name && s.tenant == stored.tenant));
    let info = SecretInfo::of(&stored);
    all.push(stored);
    all.sort_by(|a, b| (&a.tenant, &a.name).cmp(&(&b.tenant, &b.name)));
    file::save(path, &all)?;
    Ok(info)
}

/// Removes `tenant`'s secret `name` from the file at `path`.
///
/// Errors: [`SecretsError::NotFound`], the file's.
pub fn remove(path: &Path, tenant: Option<&str>, name: &str) -> Result<(), SecretsError> {
    let (format, mut all) = file::load_format(path)?;
    let before = all.len();
    all.retain(|s| !(s.name == name && s.tenant.as_deref() == tenant));
    if all.len() == before {
        return Err(SecretsError::NotFound(name.to_string()));
    }
    // Without the key the others cannot be sealed again: the file keeps
    // its format.
    file::save_format(path, format, &all)
}

/// Removes every secret of `tenant` from the file at `path` (`tine tenant
/// remove`); returns their names (none when the file does not exist).
///
/// Errors: the file's.
pub fn remove_tenant(path: &Path, tenant: &str) -> Result<Vec<String>, SecretsError> {
    let (format, mut all) = file::load_format(path)?;
    let theirs: Vec<String> =
        all.iter().filter(|s| s.tenant.as_deref() == Some(tenant)).map(|s| s.name.clone()).collect();
    if !theirs.is_empty() {
        all.retain(|s| s.tenant.as_deref() != Some(tenant));
        // As `remove`: without the key the file keeps its format.
        file::save_format(path, format, &all)?;
    }
    Ok(theirs)
}

/// The names of `tenant`'s secrets in the file at `path`.
///
/// Errors: the file's.
pub fn tenant_names(path: &Path, tenant: &str) -> Result<Vec<String>, SecretsError> {
    Ok(file::load(path)?.into_iter().filter(|s| s.tenant.as_deref() == Some(tenant)).map(|s| s.name).collect())
}

/// Every secret's metadata in the file at `path`.
///
/// Errors: the file's.
pub fn list(path: &Path) -> Result<Vec<SecretInfo>, SecretsError> {
    Ok(file::load(path)?.iter().map(SecretInfo::of).collect())
}

/// The secrets as read at one time: rules by (owner, name), and metadata.
#[derive(Default)]
struct Loaded {
    rules: BTreeMap<(Option<String>, String), Arc<SecretRule>>,
    shared: std::collections::BTreeSet<String>,
    infos: Vec<SecretInfo>,
    /// The secrets swapped in every header (`owner/name`).
    any_header: Vec<String>,
}

/// The server's secrets in memory, read again when the file changes.
pub struct Store {
    path: PathBuf,
    key: Key,
    refuse_leaks: bool,
    loaded: RwLock<Loaded>,
    stamp: std::sync::Mutex<Option<std::time::SystemTime>>,
}

impl Store {
    /// The store of `config` on `data_dir` (the key made if missing),
    /// read now.
    ///
    /// Errors: [`SecretsError`] (a key or file that cannot be read).
    pub fn open(config: &SecretsConfig, data_dir: &Path) -> Result<Arc<Self>, SecretsError> {
        let key = Key::load(config.key_file.as_deref(), data_dir, true)?;
        let store = Arc::new(Store {
            path: config.path(data_dir),
            key,
            refuse_leaks: config.refuse_leaks,
            loaded: RwLock::new(Loaded::default()),
            stamp: std::sync::Mutex::new(None),
        });
        store.reload(true)?;
        Ok(store)
    }

    /// Reads the file again if it changed (or with `force`); `true` when
    /// it was read. A format-1 file is rewritten in the current format
    /// first ([`file::migrate`]; if a value does not open it is read as it
    /// is, logged). A secret that does not open is left out (logged).
    ///
    /// Errors: the file's; the secrets read before stay.
    pub fn reload(&self, force: bool) -> Result<bool, SecretsError> {
        let mtime = std::fs::metadata(&self.path).and_then(|m| m.modified()).ok();
        {
            let mut stamp = self.stamp.lock().unwrap_or_else(|p| p.into_inner());
            if !force && *stamp == mtime {
                return Ok(false);
            }
            *stamp = mtime;
        }
        match file::migrate(&self.path, &self.key) {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                file = %self.path.display(),
                "{n} secrets rewritten in format {}: their policies are now under the AEAD",
                file::FORMAT
            ),
            Err(e) => tracing::error!(
                file = %self.path.display(),
                "not rewritten in format {} ({e}); read as format {}, whose policies are not under the AEAD",
                file::FORMAT,
                file::FORMAT_1
            ),
        }
        let mut loaded = Loaded::default();
        let (format, secrets) = file::load_format(&self.path)?;
        for s in secrets {
            let rule = file::open(&self.key, &s, format).and_then(|v| rule_of(&s, v));
            match rule {
                Ok(rule) => {
                    if s.shared && s.tenant.is_none() {
                        loaded.shared.insert(s.name.clone());
                    }
                    let info = SecretInfo::of(&s);
                    if rule.any_header {
                        loaded.any_header.push(format!("{}/{}", info.owner, info.name));
                    }
                    loaded.infos.push(info);
                    loaded.rules.insert((s.tenant.clone(), s.name.clone()), Arc::new(rule));
                }
                Err(e) => tracing::error!("{}: {e}; the secret is left out", self.path.display()),
            }
        }
        let mut now = self.loaded.write().unwrap_or_else(|p| p.into_inner());
        // Named at start, and again when the list changes.
        if !loaded.any_header.is_empty() && loaded.any_header != now.any_header {
            tracing::warn!(
                secrets = %loaded.any_header.join(", "),
                "secrets swapped in every request header (--any-header): a header the host echoes back, \
                 logs or forwards carries the value; set them again with --header (default Authorization)"
            );
        }
        *now = loaded;
        Ok(true)
    }

    /// The secrets `tenant` (`None`: the operator, who sees all) may see.
    pub fn visible(&self, tenant: Option<&str>) -> Vec<SecretInfo> {
        let loaded = self.loaded.read().unwrap_or_else(|p| p.into_inner());
        loaded
            .infos
            .iter()
            .filter(|i| match tenant {
                None => true,
                Some(t) => i.owner == "shared" || i.owner == format!("tenant:{t}"),
            })
            .cloned()
            .collect()
    }

    /// Reads the file again every [`RELOAD_EVERY`] when it changed
    /// (errors logged; call in a Tokio runtime).
    pub fn spawn_reload(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(RELOAD_EVERY).await;
                match me.reload(false) {
                    Ok(true) => tracing::info!(file = %me.path.display(), "secrets read again"),
                    Ok(false) => {}
                    Err(e) => tracing::error!("{e}; the secrets read before stay in force"),
                }
            }
        })
    }
}

impl SecretSource for Store {
    fn lookup(&self, tenant: Option<&str>, name: &str) -> Option<Arc<SecretRule>> {
        let loaded = self.loaded.read().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = loaded.rules.get(&(tenant.map(str::to_string), name.to_string())) {
            return Some(r.clone());
        }
        // The operator's own are the operator's; shared ones anyone's.
        if tenant.is_some() && loaded.shared.contains(name) {
            return loaded.rules.get(&(None, name.to_string())).cloned();
        }
        None
    }

    fn refuse_leaks(&self) -> bool {
        self.refuse_leaks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new(name: &str, tenant: Option<&str>, shared: bool) -> NewSecret {
        NewSecret {
            name: name.into(),
            tenant: tenant.map(str::to_string),
            shared,
            hosts: vec!["api.test".into()],
            header: None,
            any_header: false,
            format: None,
            in_query: false,
            in_body: false,
        }
    }

    #[test]
    fn a_policy_edited_in_the_file_fails_the_integrity_check() {
        let dir = tempfile::tempdir().unwrap();
        let config = SecretsConfig::default();
        let store = Store::open(&config, dir.path()).unwrap();
        let key = Key::load(None, dir.path(), false).unwrap();
        let path = config.path(dir.path());
        set(&path, &key, new("api", None, false), b"the-value").unwrap();
        store.reload(true).unwrap();
        assert!(store.lookup(None, "api").is_some_and(|r| r.hosts[0].matches("api.test")));
        // Whoever can write the file, without the key, sends it elsewhere.
        let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        json["secrets"][0]["hosts"] = serde_json::json!(["evil.test"]);
        std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
        let edited = &file::load(&path).unwrap()[0];
        let e = file::open(&key, edited, file::FORMAT).unwrap_err();
        assert!(matches!(e, SecretsError::Integrity { .. }), "{e}");
        assert!(e.to_string().contains("\"api\" fails its integrity check"), "{e}");
        store.reload(true).unwrap();
        assert!(store.lookup(None, "api").is_none(), "left out, not sent to evil.test");
        assert!(store.visible(None).is_empty());
    }

    #[test]
    fn tenants_see_and_use_their_own_and_the_shared_ones() {
        let dir = tempfile::tempdir().unwrap();
        let config = SecretsConfig::default();
        let store = Store::open(&config, dir.path()).unwrap();
        let key = Key::load(None, dir.path(), false).unwrap();
        let path = config.path(dir.path());
        set(&path, &key, new("mine", Some("acme"), false), b"acme-value").unwrap();
        set(&path, &key, new("ops", None, false), b"ops-value").unwrap();
        set(&path, &key, new("common", None, true), b"common-value").unwrap();
        assert!(store.reload(true).unwrap());
        assert_eq!(store.lookup(Some("acme"), "mine").unwrap().value.expose(), b"acme-value");
        assert!(store.lookup(Some("beta"), "mine").is_none(), "another tenant's");
        assert!(store.lookup(Some("acme"), "ops").is_none(), "the operator's own");
        assert_eq!(store.lookup(Some("beta"), "common").unwrap().value.expose(), b"common-value");
        assert!(store.lookup(None, "ops").is_some());
        let names = |t: Option<&str>| store.visible(t).into_iter().map(|i| i.name).collect::<Vec<_>>();
        assert_eq!(names(Some("acme")), ["common", "mine"]);
        assert_eq!(names(Some("beta")), ["common"]);
        assert_eq!(names(None).len(), 3);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains("value"), "values are sealed in the file: {text}");
        remove(&path, Some("acme"), "mine").unwrap();
        assert!(matches!(remove(&path, Some("acme"), "mine"), Err(SecretsError::NotFound(_))));
        store.reload(true).unwrap();
        assert!(store.lookup(Some("acme"), "mine").is_none(), "gone at once");
        for bad in ["", "a b", &"x".repeat(65)] {
            assert!(set(&path, &key, new(bad, None, false), b"v").is_err(), "{bad}");
        }
        let mut no_hosts = new("h", None, false);
        no_hosts.hosts.clear();
        assert!(set(&path, &key, no_hosts, b"v").is_err());
        let mut bad_host = new("h", None, false);
        bad_host.hosts = vec!["not a host".into()];
        assert!(set(&path, &key, bad_host, b"v").is_err());
    }
}
