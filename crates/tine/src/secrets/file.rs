//! The secrets file: every secret's metadata in the clear and its value
//! sealed with ChaCha20-Poly1305 (RFC 8439, aws-lc-rs's AEAD) under the
//! server's secrets key, a fresh 96-bit random nonce per value. The
//! associated data ([`aad`]) is a canonical serialization of the
//! secret's owner, name and whole policy (shared, hosts, header,
//! any-header, format, in-query, in-body), so a changed policy fails the
//! value's integrity check just as a changed value does: whoever can
//! write the file but has not the key cannot send a value to another
//! host, another header or another tenant, nor move a sealed value to
//! another entry. JSON, mode 0600, written whole to a temporary name and
//! renamed over the old one.
//!
//! Format 1 (before) had only the owner and name as associated data; a
//! format-1 file is still read and is rewritten in format 2 by
//! [`migrate`] (each value opened and sealed again under the new
//! associated data), which the server does when it reads the file and
//! `tine secret set` before it writes.
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
/// The file format this code writes: the policy under the AEAD.
pub const FORMAT: u32 = 2;
/// The format before: only owner and name under the AEAD; read, and
/// rewritten in [`FORMAT`] by [`migrate`].
pub const FORMAT_1: u32 = 1;
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

/// The associated data of format 1: `tenant`'s secret `name`.
fn aad_1(tenant: Option<&str>, name: &str) -> Vec<u8> {
    format!("tine-secret-v1\0{}\0{name}", tenant.unwrap_or("")).into_bytes()
}

/// Appends `bytes` with its length first (32 bits, big-endian).
fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(bytes);
}

/// Appends an optional string: `0`, or `1` and the string.
fn put_opt(out: &mut Vec<u8>, text: Option<&str>) {
    match text {
        None => out.push(0),
        Some(t) => {
            out.push(1);
            put(out, t.as_bytes());
        }
    }
}

/// The associated data of format 2 for `s`: `tine-secret-v2\0`, then its
/// tenant, name, shared, hosts (their count, then each), header,
/// any-header, format, in-query and in-body in that order, each string
/// length-prefixed and each flag one byte, so two different policies
/// never serialize alike. The nonce, the sealed value and the time it
/// was set are not in it.
pub fn aad(s: &StoredSecret) -> Vec<u8> {
    let mut out = b"tine-secret-v2\0".to_vec();
    put_opt(&mut out, s.tenant.as_deref());
    put(&mut out, s.name.as_bytes());
    out.push(u8::from(s.shared));
    out.extend_from_slice(&u32::try_from(s.hosts.len()).unwrap_or(u32::MAX).to_be_bytes());
    for h in &s.hosts {
        put(&mut out, h.as_bytes());
    }
    put_opt(&mut out, s.header.as_deref());
    out.push(u8::from(s.any_header));
    put_opt(&mut out, s.format.as_deref());
    out.push(u8::from(s.in_query));
    out.push(u8::from(s.in_body));
    out
}

/// Seals `value` with associated data `aad`: (nonce, sealed), base64.
fn seal_with(key: &Key, aad: Vec<u8>, value: &[u8]) -> Result<(String, String), SecretsError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|e| SecretsError::Crypto(e.to_string()))?;
    let mut buf = value.to_vec();
    key.0
        .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(aad), &mut buf)
        .map_err(|_| SecretsError::Crypto("sealing failed".into()))?;
    let b64 = base64::engine::general_purpose::STANDARD;
    let out = (b64.encode(nonce), b64.encode(&buf));
    zeroize::Zeroize::zeroize(&mut buf);
    Ok(out)
}

/// Seals `value` for the secret `s` (its owner, name and policy as they
/// are now; its `nonce` and `sealed` are not read): (nonce, sealed),
/// base64, for `s`'s `nonce` and `sealed`.
///
/// Errors: [`SecretsError::Crypto`].
pub fn seal(key: &Key, s: &StoredSecret, value: &[u8]) -> Result<(String, String), SecretsError> {
    seal_with(key, aad(s), value)
}

/// Opens `s`'s value, `s` read from a file of format `format`.
///
/// Errors: [`SecretsError::Integrity`] (another key, or a changed entry:
/// its value or, from format 2 on, its policy).
pub fn open(key: &Key, s: &StoredSecret, format: u32) -> Result<zeroize::Zeroizing<Vec<u8>>, SecretsError> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let bad = || SecretsError::Integrity { name: s.name.clone(), tenant: s.tenant.clone() };
    let nonce: [u8; NONCE_LEN] = b64.decode(&s.nonce).ok().and_then(|n| n.try_into().ok()).ok_or_else(bad)?;
    let mut buf = zeroize::Zeroizing::new(b64.decode(&s.sealed).map_err(|_| bad())?);
    let aad = if format == FORMAT_1 { aad_1(s.tenant.as_deref(), &s.name) } else { aad(s) };
    let plain =
        key.0.open_in_place(Nonce::assume_unique_for_key(nonce), Aad::from(aad), &mut buf).map_err(|_| bad())?;
    Ok(zeroize::Zeroizing::new(plain.to_vec()))
}

/// Rewrites a format-1 file at `path` in [`FORMAT`]: each value opened
/// under the format-1 associated data and sealed again under its
/// policy's (a fresh nonce). Nothing is written unless every value
/// opens. Returns how many secrets were migrated (0: the file is not
/// format 1, or absent).
///
/// Errors: [`SecretsError::Integrity`] (a value that does not open: the
/// file is left as it is), the file's.
pub fn migrate(path: &Path, key: &Key) -> Result<usize, SecretsError> {
    let (format, secrets) = load_format(path)?;
    if format != FORMAT_1 {
        return Ok(0);
    }
    let mut out = Vec::with_capacity(secrets.len());
    for s in secrets {
        let value = open(key, &s, FORMAT_1)?;
        let (nonce, sealed) = seal(key, &s, &value)?;
        out.push(StoredSecret { nonce, sealed, ..s });
    }
    save(path, &out)?;
    Ok(out.len())
}

/// The secrets of the file at `path` (none when it does not exist).
///
/// Errors: [`SecretsError::Io`], [`SecretsError::Parse`].
pub fn load(path: &Path) -> Result<Vec<StoredSecret>, SecretsError> {
    Ok(load_format(path)?.1)
}

/// The format of the file at `path` ([`FORMAT`] when it does not exist)
/// and its secrets.
///
/// Errors: [`SecretsError::Io`], [`SecretsError::Parse`] (not JSON, or a
/// format this server does not read).
pub fn load_format(path: &Path) -> Result<(u32, Vec<StoredSecret>), SecretsError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((FORMAT, Vec::new())),
        Err(source) => return Err(SecretsError::Io { path: path.into(), source }),
    };
    let file: File = serde_json::from_slice(&bytes)
        .map_err(|e| SecretsError::Parse { path: path.into(), message: e.to_string() })?;
    if file.format != FORMAT && file.format != FORMAT_1 {
        return Err(SecretsError::Parse {
            path: path.into(),
            message: format!("format {} (this server reads {FORMAT_1} and {FORMAT})", file.format),
        });
    }
    Ok((file.format, file.secrets))
}

/// Writes `secrets` (sealed for [`FORMAT`]) to `path` (0600, through a
/// temporary name).
///
/// Errors: [`SecretsError::Io`].
pub fn save(path: &Path, secrets: &[StoredSecret]) -> Result<(), SecretsError> {
    save_format(path, FORMAT, secrets)
}

/// Writes `secrets`, sealed for `format`, to `path` as a file of that
/// format (a format-1 file from which one was removed stays format 1).
///
/// Errors: [`SecretsError::Io`].
pub fn save_format(path: &Path, format: u32, secrets: &[StoredSecret]) -> Result<(), SecretsError> {
    let text = serde_json::to_vec_pretty(&File { format, secrets: secrets.to_vec() })
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

    fn stored(key: &Key, value: &[u8]) -> StoredSecret {
        let mut s = StoredSecret {
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
            nonce: String::new(),
            sealed: String::new(),
        };
        (s.nonce, s.sealed) = seal(key, &s, value).unwrap();
        s
    }

    #[test]
    fn values_open_only_under_their_key_and_entry() {
        let dir = tempfile::tempdir().unwrap();
        let key = Key::load(None, dir.path(), true).unwrap();
        let s = stored(&key, b"sk-value");
        assert_eq!(open(&key, &s, FORMAT).unwrap().as_slice(), b"sk-value");
        assert!(!s.sealed.contains("sk-value"));
        let moved = StoredSecret { name: "other".into(), ..s.clone() };
        assert!(open(&key, &moved, FORMAT).is_err(), "bound to its name");
        let other_dir = tempfile::tempdir().unwrap();
        let other = Key::load(None, other_dir.path(), true).unwrap();
        assert!(open(&other, &s, FORMAT).is_err(), "bound to its key");
        let path = dir.path().join(SECRETS_FILE);
        save(&path, std::slice::from_ref(&s)).unwrap();
        assert_eq!(load_format(&path).unwrap(), (FORMAT, vec![s]));
        use std::os::unix::fs::PermissionsExt;
        for f in [path, dir.path().join(KEY_FILE)] {
            assert_eq!(std::fs::metadata(&f).unwrap().permissions().mode() & 0o777, 0o600, "{}", f.display());
        }
        assert!(Key::load(None, tempfile::tempdir().unwrap().path(), false).is_err(), "no key without create");
    }

    #[test]
    fn every_policy_field_is_under_the_aead() {
        let dir = tempfile::tempdir().unwrap();
        let key = Key::load(None, dir.path(), true).unwrap();
        let s = stored(&key, b"sk-value");
        let changed = [
            StoredSecret { hosts: vec!["evil.test".into()], ..s.clone() },
            StoredSecret { hosts: vec!["api.openai.com".into(), "evil.test".into()], ..s.clone() },
            StoredSecret { tenant: None, ..s.clone() },
            StoredSecret { shared: true, ..s.clone() },
            StoredSecret { header: Some("x-echo".into()), ..s.clone() },
            StoredSecret { any_header: true, ..s.clone() },
            StoredSecret { format: Some("{value}".into()), ..s.clone() },
            StoredSecret { in_query: true, ..s.clone() },
            StoredSecret { in_body: true, ..s.clone() },
        ];
        for c in &changed {
            let e = open(&key, c, FORMAT).unwrap_err();
            assert!(matches!(e, SecretsError::Integrity { .. }) && e.to_string().contains("integrity"), "{c:?}: {e}");
        }
        // Length-prefixed: the same bytes split differently are another policy.
        let a = StoredSecret { hosts: vec!["a.b".into(), "c".into()], ..s.clone() };
        let b = StoredSecret { hosts: vec!["a".into(), "b.c".into()], ..s.clone() };
        assert_ne!(aad(&a), aad(&b));
        assert_eq!(
            open(&key, &StoredSecret { updated_at_ms: 9, ..s.clone() }, FORMAT).unwrap().as_slice(),
            b"sk-value"
        );
    }

    #[test]
    fn a_format_1_file_is_migrated_and_its_values_still_open() {
        let dir = tempfile::tempdir().unwrap();
        let key = Key::load(None, dir.path(), true).unwrap();
        // Written as format 1 was: owner and name only under the AEAD.
        let mut s = stored(&key, b"sk-value");
        (s.nonce, s.sealed) = seal_with(&key, aad_1(s.tenant.as_deref(), &s.name), b"sk-value").unwrap();
        let path = dir.path().join(SECRETS_FILE);
        save_format(&path, FORMAT_1, std::slice::from_ref(&s)).unwrap();
        assert_eq!(open(&key, &s, FORMAT_1).unwrap().as_slice(), b"sk-value");
        let other_dir = tempfile::tempdir().unwrap();
        let other = Key::load(None, other_dir.path(), true).unwrap();
        assert!(matches!(migrate(&path, &other), Err(SecretsError::Integrity { .. })), "another key");
        assert_eq!(load_format(&path).unwrap().0, FORMAT_1, "left as it was");
        assert_eq!(migrate(&path, &key).unwrap(), 1);
        let (format, after) = load_format(&path).unwrap();
        assert_eq!((format, after.len()), (FORMAT, 1));
        assert_ne!(after[0].sealed, s.sealed);
        assert_eq!(open(&key, &after[0], FORMAT).unwrap().as_slice(), b"sk-value");
        assert_eq!(migrate(&path, &key).unwrap(), 0, "once");
        let edited = StoredSecret { hosts: vec!["evil.test".into()], ..after[0].clone() };
        assert!(open(&key, &edited, FORMAT).is_err(), "the migrated policy is under the AEAD");
    }

    #[test]
    fn removing_a_tenants_secrets_keeps_a_format_1_file_in_format_1() {
        let dir = tempfile::tempdir().unwrap();
        let key = Key::load(None, dir.path(), true).unwrap();
        let mut acme = stored(&key, b"sk-acme");
        (acme.nonce, acme.sealed) = seal_with(&key, aad_1(acme.tenant.as_deref(), &acme.name), b"sk-acme").unwrap();
        let mut ops = StoredSecret { tenant: None, name: "ops".into(), ..acme.clone() };
        (ops.nonce, ops.sealed) = seal_with(&key, aad_1(None, "ops"), b"sk-ops").unwrap();
        let path = dir.path().join(SECRETS_FILE);
        save_format(&path, FORMAT_1, &[acme, ops]).unwrap();
        // `tine tenant remove` has no key: the others cannot be sealed again.
        assert_eq!(crate::secrets::remove_tenant(&path, "acme").unwrap(), ["openai"]);
        let (format, left) = load_format(&path).unwrap();
        assert_eq!((format, left.len()), (FORMAT_1, 1));
        assert_eq!(open(&key, &left[0], FORMAT_1).unwrap().as_slice(), b"sk-ops", "the operator's still opens");
    }
}
