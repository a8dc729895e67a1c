//! Preview tokens: `<exp>.<sig>`, where `exp` is the expiry (Unix s) and
//! `sig` the first 128 bits, in hex, of HMAC-SHA256 (RFC 2104; truncation
//! to half the output as its §5 allows) over the preview id, sandbox id,
//! port, expiry and the tenant's grant ([`crate::auth::Auth::url_grant`]:
//! the tenant and the SHA-256 of its key), under a 32-byte key drawn at
//! the first start and kept in the data directory (`preview.key`, mode
//! 0600), so tokens outlive a restart. A token works for one preview of
//! one sandbox and port until it expires or the tenant's key changes.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::{Preview, PreviewError};

/// The key file's name in the data directory.
pub const KEY_FILE: &str = "preview.key";
/// Bytes of the signature a token carries (hex: twice as many characters).
const SIG_BYTES: usize = 16;

/// Why a token is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    /// Not `<exp>.<hex>`.
    #[error("this preview token is malformed: open the URL sandbox_preview_url gave")]
    Malformed,
    /// Signed for something else (another preview, sandbox, port or
    /// tenant key) or by another server.
    #[error("this preview token is not valid for this preview: open the URL sandbox_preview_url gave")]
    BadSignature,
    /// Past its expiry.
    #[error("this preview token expired {secs_ago} s ago: ask for a new URL with sandbox_preview_url")]
    Expired {
        /// Seconds since it expired.
        secs_ago: u64,
    },
}

/// The key tokens are signed with.
pub struct TokenKey {
    key: [u8; 32],
}

impl TokenKey {
    /// The key kept at `path`, made (32 bytes from getrandom(2), mode
    /// 0600) when the file does not exist.
    ///
    /// Errors: [`PreviewError::Io`] (unreadable, or not 32 bytes: a file
    /// this server did not write is left alone), [`PreviewError::Random`].
    pub fn open(path: &Path) -> Result<Self, PreviewError> {
        let io = |source| PreviewError::Io { path: path.to_path_buf(), source };
        let mut key = [0u8; 32];
        match std::fs::File::open(path) {
            Ok(mut f) => {
                let mut bytes = Vec::new();
                f.read_to_end(&mut bytes).map_err(io)?;
                key = bytes.try_into().map_err(|_| {
                    io(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "not a 32-byte key: remove it to make a new one",
                    ))
                })?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                getrandom::fill(&mut key).map_err(|e| PreviewError::Random(e.to_string()))?;
                let mut f =
                    std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).map_err(io)?;
                f.write_all(&key).and_then(|()| f.sync_all()).map_err(io)?;
            }
            Err(e) => return Err(io(e)),
        }
        Ok(TokenKey { key })
    }

    /// A key of the given bytes (tests).
    #[cfg(test)]
    pub fn from_bytes(key: [u8; 32]) -> Self {
        TokenKey { key }
    }

    fn mac(&self, p: &Preview, exp: u64, grant: &str) -> Hmac<Sha256> {
        // HMAC takes keys of any length (RFC 2104 §2): this cannot fail.
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes a key of any length");
        // NUL separates the fields: none of them can hold one.
        for part in ["tine-preview-v1", &p.preview_id, &p.sandbox_id, &p.port.to_string(), &exp.to_string(), grant] {
            mac.update(part.as_bytes());
            mac.update(&[0]);
        }
        mac
    }

    /// The token of preview `p` under the tenant's `grant`, expiring with
    /// the preview.
    pub fn sign(&self, p: &Preview, grant: &str) -> String {
        let exp = p.expires_at_ms / 1000;
        let sig = self.mac(p, exp, grant).finalize().into_bytes();
        format!("{exp}.{}", data_encoding::HEXLOWER.encode(&sig[..SIG_BYTES]))
    }

    /// Checks `token` for preview `p` under `grant` at `now` (Unix s): the
    /// signature first (in constant time), then the expiry.
    ///
    /// Errors: [`TokenError`].
    pub fn verify(&self, token: &str, p: &Preview, grant: &str, now: u64) -> Result<(), TokenError> {
        let (exp, sig) = token.split_once('.').ok_or(TokenError::Malformed)?;
        let exp: u64 = exp.parse().map_err(|_| TokenError::Malformed)?;
        let sig = data_encoding::HEXLOWER_PERMISSIVE.decode(sig.as_bytes()).map_err(|_| TokenError::Malformed)?;
        if sig.len() != SIG_BYTES {
            return Err(TokenError::Malformed);
        }
        self.mac(p, exp, grant).verify_truncated_left(&sig).map_err(|_| TokenError::BadSignature)?;
        if now > exp {
            return Err(TokenError::Expired { secs_ago: now - exp });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preview(id: &str, sandbox: &str, port: u16) -> Preview {
        Preview {
            preview_id: id.into(),
            sandbox_id: sandbox.into(),
            port,
            tenant: Some("t1".into()),
            public: false,
            created_at_ms: 0,
            expires_at_ms: 2_000_000_000_000,
        }
    }

    #[test]
    fn a_token_works_for_its_preview_only() {
        let key = TokenKey::from_bytes([7; 32]);
        let p = preview("0123456789ab", "sb-a", 8000);
        let t = key.sign(&p, "t1:k");
        assert_eq!(key.verify(&t, &p, "t1:k", 1_000), Ok(()));
        assert_eq!(
            key.verify(&t, &preview("0123456789ac", "sb-a", 8000), "t1:k", 1_000),
            Err(TokenError::BadSignature)
        );
        assert_eq!(
            key.verify(&t, &preview("0123456789ab", "sb-b", 8000), "t1:k", 1_000),
            Err(TokenError::BadSignature)
        );
        assert_eq!(
            key.verify(&t, &preview("0123456789ab", "sb-a", 8001), "t1:k", 1_000),
            Err(TokenError::BadSignature)
        );
        assert_eq!(key.verify(&t, &p, "t1:rotated", 1_000), Err(TokenError::BadSignature), "the tenant's key changed");
        assert_eq!(TokenKey::from_bytes([8; 32]).verify(&t, &p, "t1:k", 1_000), Err(TokenError::BadSignature));
        assert_eq!(key.verify(&t, &p, "t1:k", 2_000_000_005), Err(TokenError::Expired { secs_ago: 5 }));
        let (exp, sig) = t.split_once('.').unwrap();
        let later = format!("{}.{sig}", exp.parse::<u64>().unwrap() + 1);
        assert_eq!(key.verify(&later, &p, "t1:k", 1_000), Err(TokenError::BadSignature), "the expiry is signed");
        for bad in ["", "1", "1.", "x.00", "1.zz", "1.00", &format!("{t}00")] {
            assert_eq!(key.verify(bad, &p, "t1:k", 1_000), Err(TokenError::Malformed), "{bad:?}");
        }
    }

    #[test]
    fn the_key_is_kept_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(KEY_FILE);
        let p = preview("0123456789ab", "sb-a", 8000);
        let t = TokenKey::open(&path).unwrap().sign(&p, "");
        assert_eq!(TokenKey::open(&path).unwrap().verify(&t, &p, "", 0), Ok(()));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        std::fs::write(&path, b"short").unwrap();
        assert!(matches!(TokenKey::open(&path), Err(PreviewError::Io { .. })));
    }
}
