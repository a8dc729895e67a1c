//! The previews a server has made: id → sandbox, port, tenant, public,
//! expiry. Kept in `previews.json` in the data directory (written whole to
//! a temporary file and renamed over it at every change), so URLs outlive
//! a restart as the sandboxes they name do.
//!
//! An id is 12 characters of base32 (RFC 4648 §7's extended-hex alphabet,
//! lower case: `0-9a-v`): 2 naming the host that made it ([`host_tag`]: in
//! a cluster, the host a request lands on finds the preview's host by
//! them) and 10 from 50 random bits. So it is a DNS label of its own (RFC
//! 1035 §2.3.4: 63 at most) whatever the host's and sandboxes' names, and
//! unguessable for a public URL whose id is its only secret.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::{PreviewError, MAX_PER_SANDBOX};

/// The store's file name in the data directory.
pub const FILE: &str = "previews.json";
/// Characters of a preview id.
pub const ID_LEN: usize = 12;

/// One preview URL's target.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
pub struct Preview {
    /// Its id ([`ID_LEN`] characters of `0-9a-v`).
    pub preview_id: String,
    /// The sandbox it reaches.
    pub sandbox_id: String,
    /// The guest port it reaches.
    pub port: u16,
    /// The sandbox's tenant when it was made (`None`: the operator's).
    pub tenant: Option<String>,
    /// Whether it needs no token.
    pub public: bool,
    /// When it was made (ms since the Unix epoch).
    pub created_at_ms: u64,
    /// When it stops working (ms since the Unix epoch).
    pub expires_at_ms: u64,
}

#[derive(Serialize, Deserialize)]
struct File {
    version: u32,
    previews: Vec<Preview>,
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or_default()
}

/// Whether `s` has the shape of a preview id.
pub fn is_id(s: &str) -> bool {
    s.len() == ID_LEN && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'v').contains(&b))
}

/// Characters of an id that name its host.
pub const TAG_LEN: usize = 2;

/// The tag of host `host` in the preview ids it makes: the first 10 bits
/// of the SHA-256 of its name, as 2 base32 characters. (Two hosts of a
/// cluster may share a tag, 1 in 1024 for a pair: the server warns at
/// start, and a request for the other's preview is then refused.)
pub fn host_tag(host: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(host.as_bytes());
    let mut tag = data_encoding::BASE32_DNSSEC.encode(&digest[..2]);
    tag.truncate(TAG_LEN);
    tag
}

/// The host tag of preview id `id` (which [`is_id`] accepts).
pub fn tag_of(id: &str) -> &str {
    id.get(..TAG_LEN).unwrap_or_default()
}

/// A new preview id of the host tagged `tag`.
///
/// Errors: [`PreviewError::Random`].
pub fn mint_id(tag: &str) -> Result<String, PreviewError> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).map_err(|e| PreviewError::Random(e.to_string()))?;
    let mut id = tag.to_string();
    id.push_str(&data_encoding::BASE32_DNSSEC.encode(&bytes));
    id.truncate(ID_LEN);
    Ok(id)
}

/// The previews, in memory and on disk.
pub struct PreviewStore {
    path: PathBuf,
    /// This host's [`host_tag`].
    tag: String,
    previews: Mutex<BTreeMap<String, Preview>>,
}

impl PreviewStore {
    /// The store of host `host` kept at `path` (empty when the file does
    /// not exist); expired previews are left out.
    ///
    /// Errors: [`PreviewError::Io`], [`PreviewError::Corrupt`] (a file
    /// this server did not write: it is left as it is, for the operator).
    pub fn open(path: &Path, host: &str) -> Result<Self, PreviewError> {
        let io = |source| PreviewError::Io { path: path.to_path_buf(), source };
        let previews = match std::fs::read(path) {
            Ok(bytes) => {
                let file: File = serde_json::from_slice(&bytes)
                    .map_err(|e| PreviewError::Corrupt { path: path.to_path_buf(), message: e.to_string() })?;
                let now = now_ms();
                file.previews
                    .into_iter()
                    .filter(|p| p.expires_at_ms > now && is_id(&p.preview_id))
                    .map(|p| (p.preview_id.clone(), p))
                    .collect()
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(io(e)),
        };
        Ok(PreviewStore { path: path.to_path_buf(), tag: host_tag(host), previews: Mutex::new(previews) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Preview>> {
        self.previews.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes the store (caller holds the lock).
    fn save(&self, previews: &BTreeMap<String, Preview>) -> Result<(), PreviewError> {
        let io = |source| PreviewError::Io { path: self.path.clone(), source };
        let file = File { version: 1, previews: previews.values().cloned().collect() };
        // Serializing plain strings and numbers cannot fail.
        let bytes = serde_json::to_vec_pretty(&file).unwrap_or_default();
        let tmp = self.path.with_extension("json.tmp");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp).map_err(io)?;
            f.write_all(&bytes).and_then(|()| f.sync_all()).map_err(io)?;
        }
        std::fs::rename(&tmp, &self.path).map_err(io)
    }

    /// Makes a preview of `sandbox_id`'s `port` for `tenant`, valid
    /// `ttl_secs` from now.
    ///
    /// Errors: [`PreviewError::TooMany`], [`PreviewError::Random`],
    /// [`PreviewError::Io`] (nothing is kept then).
    pub fn create(
        &self,
        sandbox_id: &str,
        port: u16,
        tenant: Option<&str>,
        public: bool,
        ttl_secs: u64,
    ) -> Result<Preview, PreviewError> {
        let now = now_ms();
        let mut previews = self.lock();
        previews.retain(|_, p| p.expires_at_ms > now);
        if previews.values().filter(|p| p.sandbox_id == sandbox_id).count() >= MAX_PER_SANDBOX {
            return Err(PreviewError::TooMany(sandbox_id.to_string()));
        }
        let mut id = mint_id(&self.tag)?;
        while previews.contains_key(&id) {
            id = mint_id(&self.tag)?;
        }
        let preview = Preview {
            preview_id: id.clone(),
            sandbox_id: sandbox_id.to_string(),
            port,
            tenant: tenant.map(str::to_string),
            public,
            created_at_ms: now,
            expires_at_ms: now.saturating_add(ttl_secs.saturating_mul(1000)),
        };
        previews.insert(id.clone(), preview.clone());
        if let Err(e) = self.save(&previews) {
            previews.remove(&id);
            return Err(e);
        }
        Ok(preview)
    }

    /// This host's tag in preview ids.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The preview `id`, unless it expired.
    pub fn get(&self, id: &str) -> Option<Preview> {
        self.lock().get(id).filter(|p| p.expires_at_ms > now_ms()).cloned()
    }

    /// `sandbox_id`'s previews that have not expired, oldest first (by
    /// id within a millisecond).
    pub fn of_sandbox(&self, sandbox_id: &str) -> Vec<Preview> {
        let now = now_ms();
        let mut v: Vec<_> =
            self.lock().values().filter(|p| p.sandbox_id == sandbox_id && p.expires_at_ms > now).cloned().collect();
        v.sort_by(|x, y| (x.created_at_ms, &x.preview_id).cmp(&(y.created_at_ms, &y.preview_id)));
        v
    }

    /// Removes `sandbox_id`'s previews that `pick` chooses; returns them.
    ///
    /// Errors: [`PreviewError::Io`] (they are removed from memory anyway:
    /// a revoked URL stops working now; the file catches up at the next
    /// change).
    pub fn revoke(&self, sandbox_id: &str, pick: impl Fn(&Preview) -> bool) -> Result<Vec<Preview>, PreviewError> {
        let mut previews = self.lock();
        let gone: Vec<Preview> = previews.values().filter(|p| p.sandbox_id == sandbox_id && pick(p)).cloned().collect();
        if gone.is_empty() {
            return Ok(gone);
        }
        for p in &gone {
            previews.remove(&p.preview_id);
        }
        self.save(&previews)?;
        Ok(gone)
    }

    /// Removes the previews whose sandbox `exists` says is gone; returns
    /// how many.
    ///
    /// Errors: [`PreviewError::Io`].
    pub fn forget_gone(&self, exists: impl Fn(&str) -> bool) -> Result<usize, PreviewError> {
        let now = now_ms();
        let mut previews = self.lock();
        let before = previews.len();
        previews.retain(|_, p| p.expires_at_ms > now && exists(&p.sandbox_id));
        let n = before - previews.len();
        if n > 0 {
            self.save(&previews)?;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_dns_labels_of_twelve_base32_characters() {
        let tag = host_tag("tine-a");
        assert_eq!(tag.len(), TAG_LEN);
        assert_ne!(tag, host_tag("tine-b"));
        for _ in 0..100 {
            let id = mint_id(&tag).unwrap();
            assert!(is_id(&id), "{id}");
            assert_eq!(tag_of(&id), tag);
        }
        assert!(!is_id("ABCDEFGHIJKL"));
        assert!(!is_id("abcdefghijk"));
        assert!(!is_id("abcdefghijkw"));
    }

    #[test]
    fn previews_outlive_the_process_and_revocation_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        let store = PreviewStore::open(&path, "h").unwrap();
        let a = store.create("sb-a", 8000, Some("t1"), false, 60).unwrap();
        let b = store.create("sb-a", 8001, Some("t1"), true, 60).unwrap();
        let c = store.create("sb-b", 8000, None, false, 60).unwrap();
        assert_eq!(store.get(&a.preview_id), Some(a.clone()));
        let mut both = vec![a.clone(), b.clone()];
        both.sort_by(|x, y| (x.created_at_ms, &x.preview_id).cmp(&(y.created_at_ms, &y.preview_id)));
        assert_eq!(store.of_sandbox("sb-a"), both);

        let again = PreviewStore::open(&path, "h").unwrap();
        assert_eq!(again.get(&b.preview_id), Some(b.clone()));
        assert_eq!(again.revoke("sb-a", |p| p.port == 8001).unwrap(), vec![b.clone()]);
        assert_eq!(again.revoke("sb-b", |p| p.preview_id == a.preview_id).unwrap(), vec![], "another sandbox's");

        let third = PreviewStore::open(&path, "h").unwrap();
        assert_eq!(third.get(&b.preview_id), None, "revoked stays revoked");
        assert_eq!(third.forget_gone(|s| s != "sb-b").unwrap(), 1);
        assert_eq!(third.get(&c.preview_id), None);
        assert_eq!(PreviewStore::open(&path, "h").unwrap().of_sandbox("sb-a"), vec![a]);
    }

    #[test]
    fn expired_previews_are_gone_and_a_sandbox_has_a_cap() {
        let dir = tempfile::tempdir().unwrap();
        let store = PreviewStore::open(&dir.path().join(FILE), "h").unwrap();
        let p = store.create("sb-a", 1, None, false, 0).unwrap();
        assert_eq!(store.get(&p.preview_id), None, "a zero lifetime is already over");
        for port in 0..MAX_PER_SANDBOX as u16 {
            store.create("sb-a", port + 1, None, false, 60).unwrap();
        }
        assert!(matches!(store.create("sb-a", 9, None, false, 60), Err(PreviewError::TooMany(_))));
        store.create("sb-b", 9, None, false, 60).unwrap();
    }

    #[test]
    fn a_file_it_did_not_write_is_refused_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        std::fs::write(&path, b"{not json").unwrap();
        assert!(matches!(PreviewStore::open(&path, "h"), Err(PreviewError::Corrupt { .. })));
        assert_eq!(std::fs::read(&path).unwrap(), b"{not json");
    }
}
