//! The secrets file: every secret's metadata in the clear and its value
//! sealed with ChaCha20-Poly1305 (RFC 8439, aws-lc-rs's AEAD) under the
//! server's secrets key, a fresh 96-bit random nonce per value, and the
//! secret's owner and name as associated data (a sealed value moved to
//! another secret's entry does not open). JSON, mode 0600, written whole
//! to a temporary name and renamed over the old one.
//!
//! The key is 32 bytes written as 64 hex digits: systemd's credential
//! `tine-secrets-key` (`$CREDENTIALS_DIRECTORY/tine-secrets-key`,
//! `LoadCredential=`, systemd.exec(5)), else `[secrets] key_file`, else
//! `DATA_DIR/secrets.key`, made (0600) at first use.

use std::path::{Path, PathBuf};

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};
use base64::Engine;
use serde::{Deserialize, Serialize};

use super::SecretsError;

/// The systemd credential name of the secrets key.
pub const KEY_CREDENTIAL: &str = "tine-secrets-key";
/// The key file's name in the data directory when nothing names another.
pub const KEY_FILE: &str = "secrets.key";
/// The secrets file's name in the data directory.
pub const SECRETS_FILE: &str = "secrets.json";
/// The file format this code writes.
const FORMAT: u32 = 1;
/// Longest value (bytes).
pub const MAX_VALUE_BYTES: usize = 64 << 10;

/// One secret as the file keeps it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct StoredSecret {
    /// Its name: 1-64 letters, digits, '_', '-' or '.'.
    pub name: String,
    /// The tenant it belongs to (`None`: the operator's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// An operator's secret every tenant may use.
    #[serde(default)]
    pub shared: bool,
    /// The hosts it may be sent to (`api.openai.com`, `*.anthropic.com`).
    pub hosts: Vec<String>,
    /// The header it goes in (`None`: `Authorization`, or every header
    /// with `any_header`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// Without `header`: swapped in every request header (`tine secret
    /// set --any-header`), as every secret without a header was before.
    #[serde(default)]
    pub any_header: bool,
    /// The header's value around it, `{value}` where it goes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// Also swapped in query strings.
    #[serde(default)]
    pub in_query: bool,
    /// Also swapped in small request bodies.
    #[serde(default)]
    pub in_body: bool,
    /// When it was set, ms since the Unix epoch.
    pub updated_at_ms: u64,
    /// The nonce (base64).
    pub nonce: String,
    /// The sealed value and its tag (base64).
    pub sealed: String,
}

#[derive(Serialize, Deserialize)]
struct File {
    format: u32,
    secrets: Vec<StoredSecret>,
}

/// The secrets key.
pub struct Key(LessSafeKey);

impl Key {
    /// The key: the systemd credential, else `key_file`, else
    /// `DATA_DIR/secrets.key`, made when `create` and absent.
    ///
    /// Errors: [`SecretsError::Key`] (unreadable, not 64 hex digits, or
    /// absent without `create`).
    pub fn load(key_file: Option<&Path>, data_dir: &Path, create: bool) -> Result<Self, SecretsError> {
        let credential = std::env::var_os("CREDENTIALS_DIRECTORY").map(|d| PathBuf::from(d).join(KEY_CREDENTIAL));
        let path = match (credential.filter(|p| p.exists()), key_file) {
            (Some(p), _) => p,
            (None, Some(p)) => p.to_path_buf(),
            (None, None) => data_dir.join(KEY_FILE),
        };
        let bad = |reason: String| SecretsError::Key { path: path.clone(), reason };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
                let hex = crate::auth::new_token().map_err(|e| bad(e.to_string()))?;
                write_private(&path, format!("{hex}\n").as_bytes()).map_err(|e| bad(e.to_string()))?;
                tracing::info!("secrets key made: {}", path.display());
                hex
            }
            Err(e) => return Err(bad(e.to_string())),
        };
        let t = text.trim();
        if t.len() != 64 || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad("not 64 hex digits (32 bytes)".into()));
        }
        let bytes: Vec<u8> = (0..32).filter_map(|i| u8::from_str_radix(&t[2 * i..2 * i + 2], 16).ok()).collect();
        let key = UnboundKey::new(&CHACHA20_POLY1305, &bytes).map_err(|_| bad("not a ChaCha20-Poly1305 key".into()))?;
        Ok(Key(LessSafeKey::new(key)))
    }
}

/// The associated data of `tenant`'s secret `name`.
fn aad(tenant: Option<&str>, name: &str) -> Vec<u8> {
    format!("tine-secret-v1\0{}\0{name}", tenant.unwrap_or("")).into_bytes()
}

/// Seals `value` for `tenant`'s secret `name`: (nonce, sealed), base64.
///
/// Errors: [`SecretsError::Crypto`].
pub fn seal(key: &Key, tenant: Option<&str>, name: &str, value: &[u8]) -> Result<(String, String), SecretsError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|e| SecretsError::Crypto(e.to_string()))?;
    let mut buf = value.to_vec();
    key.0
        .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(aad(tenant, name)), &mut buf)
        .map_err(|_| SecretsError::Crypto("sealing failed".into()))?;
    let b64 = base64::engine::general_purpose::STANDARD;
    let out = (b64.encode(nonce), b64.encode(&buf));
    zeroize::Zeroize::zeroize(&mut buf);
    Ok(out)
}

/// Opens `s`'s value.
///
/// Errors: [`SecretsError::Crypto`] (another key, a changed entry).
pub fn open(key: &Key, s: &StoredSecret) -> Result<zeroize::Zeroizing<Vec<u8>>, SecretsError> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let bad = || {
        SecretsError::Crypto(format!(
            "secret {:?} does not open under this key (another key, or a changed entry)",
            s.name
        ))
    };
    let nonce: [u8; NONCE_LEN] = b64.decode(&s.nonce).ok().and_then(|n| n.try_into().ok()).ok_or_else(bad)?;
    let mut buf = zeroize::Zeroizing::new(b64.decode(&s.sealed).map_err(|_| bad())?);
    let plain = key
        .0
        .open_in_place(Nonce::assume_unique_for_key(nonce), Aad::from(aad(s.tenant.as_deref(), &s.name)), &mut buf)
        .map_err(|_| bad())?;
    Ok(zeroize::Zeroizing::new(plain.to_vec()))
}

/// The secrets of the file at `path` (none when it does not exist).
///
/// Errors: [`SecretsError::Io`], [`SecretsError::Parse`].
pub fn load(path: &Path) -> Result<Vec<StoredSecret>, SecretsError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(SecretsError::Io { path: path.into(), source }),
    };
    let file: File = serde_json::from_slice(&bytes)
        .map_err(|e| SecretsError::Parse { path: path.into(), message: e.to_string() })?;
    if file.format != FORMAT {
        return Err(SecretsError::Parse {
            path: path.into(),
            message: format!("format {} (this server reads {FORMAT})", file.format),
        });
    }
    Ok(file.secrets)
}

/// Writes `secrets` to `path` (0600, through a temporary name).
///
/// Errors: [`SecretsError::Io`].
pub fn save(path: &Path, secrets: &[StoredSecret]) -> Result<(), SecretsError> {
    let text = serde_json::to_vec_pretty(&File { format: FORMAT, secrets: secrets.to_vec() })
        .map_err(|e| SecretsError::Parse { path: path.into(), message: e.to_string() })?;
    write_private(path, &text).map_err(|source| SecretsError::Io { path: path.into(), source })
}

/// Writes `bytes` to `path` with mode 0600: a temporary name, synced, renamed.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_open_only_under_their_key_and_entry() {
        let dir = tempfile::tempdir().unwrap();
        let key = Key::load(None, dir.path(), true).unwrap();
        let (nonce, sealed) = seal(&key, Some("acme"), "openai", b"sk-value").unwrap();
        let s = StoredSecret {
            name: "openai".into(),
            tenant: Some("acme".into()),
            shared: false,
            hosts: vec!["api.openai.com".into()],
            header: None,
            any_header: false,
            format: None,
            in_query: false,
            in_body: false,
            updated_at_ms: 1,
            nonce,
            sealed,
        };
        assert_eq!(open(&key, &s).unwrap().as_slice(), b"sk-value");
        assert!(!s.sealed.contains("sk-value"));
        let moved = StoredSecret { name: "other".into(), ..s.clone() };
        assert!(open(&key, &moved).is_err(), "bound to its name");
        let other_dir = tempfile::tempdir().unwrap();
        let other = Key::load(None, other_dir.path(), true).unwrap();
        assert!(open(&other, &s).is_err(), "bound to its key");
        let path = dir.path().join(SECRETS_FILE);
        save(&path, std::slice::from_ref(&s)).unwrap();
        assert_eq!(load(&path).unwrap(), vec![s]);
        use std::os::unix::fs::PermissionsExt;
        for f in [path, dir.path().join(KEY_FILE)] {
            assert_eq!(std::fs::metadata(&f).unwrap().permissions().mode() & 0o777, 0o600, "{}", f.display());
        }
        assert!(Key::load(None, tempfile::tempdir().unwrap().path(), false).is_err(), "no key without create");
    }
}
