//! The broker's certificate authority: one per server, generated at first
//! start and kept in the data directory (or the operator's, from the
//! configuration), and the leaf certificates it signs for the names the
//! broker terminates TLS for.
//!
//! The CA is what the guests trust in addition to their own store; its
//! key never leaves the host. Leaves are signed for exactly one DNS name
//! (RFC 5280 §4.2.1.6 subjectAltName), for [`LEAF_VALIDITY_DAYS`] days,
//! under one key pair the CA makes at start (P-256 ECDSA, RFC 5480), and
//! kept in memory for [`LEAF_CACHE`] names.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::sign::CertifiedKey;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// The CA certificate's file name in its directory.
pub const CA_CERT_FILE: &str = "broker-ca.pem";
/// The CA key's file name in its directory (mode 0600).
pub const CA_KEY_FILE: &str = "broker-ca.key";
/// How long a leaf certificate is valid (days).
pub const LEAF_VALIDITY_DAYS: i64 = 7;
/// Leaves kept in memory at once (one per name).
pub const LEAF_CACHE: usize = 1024;
/// How long a generated CA is valid (years).
const CA_VALIDITY_YEARS: i32 = 10;
/// A leaf is made again this long before it expires.
const LEAF_RENEW: Duration = Duration::from_secs(24 * 3600);

/// Errors of the CA.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    /// Reading or writing the CA's files.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The OS's error.
        source: std::io::Error,
    },
    /// A certificate or key that cannot be read or made.
    #[error("the broker CA: {0}")]
    Cert(#[from] rcgen::Error),
    /// rustls refused the key.
    #[error("the broker's leaf key: {0}")]
    Key(rustls::Error),
}

/// The CA and its leaves.
pub struct CertificateAuthority {
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
    /// The key pair of every leaf.
    leaf_key: KeyPair,
    leaf_signing: Arc<dyn rustls::sign::SigningKey>,
    leaves: Mutex<HashMap<String, (Arc<CertifiedKey>, Instant)>>,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority").finish_non_exhaustive()
    }
}

impl CertificateAuthority {
    /// The CA kept in `dir` ([`CA_CERT_FILE`], [`CA_KEY_FILE`]), made and
    /// written there (key mode 0600, written to a temporary name and
    /// renamed) when absent. `name` goes in a new CA's common name.
    ///
    /// Errors: [`CaError`].
    pub fn load_or_create(dir: &Path, name: &str) -> Result<Self, CaError> {
        let (cert_path, key_path) = (dir.join(CA_CERT_FILE), dir.join(CA_KEY_FILE));
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| CaError::Io { path, source }
        };
        if cert_path.exists() && key_path.exists() {
            let cert = std::fs::read_to_string(&cert_path).map_err(io(&cert_path))?;
            let key = std::fs::read_to_string(&key_path).map_err(io(&key_path))?;
            return Self::from_pem(&cert, &key);
        }
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "Tine");
        dn.push(DnType::CommonName, format!("Tine sandbox broker CA ({name})"));
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let today = time_now();
        params.not_before = today - time::Duration::days(1);
        params.not_after = today + time::Duration::days(365 * i64::from(CA_VALIDITY_YEARS));
        let cert = params.self_signed(&key)?;
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        write_new(&key_path, key.serialize_pem().as_bytes(), 0o600).map_err(io(&key_path))?;
        write_new(&cert_path, cert.pem().as_bytes(), 0o644).map_err(io(&cert_path))?;
        tracing::info!("broker CA made: {}", cert_path.display());
        Self::from_pem(&cert.pem(), &key.serialize_pem())
    }

    /// The CA of PEM certificate `cert` and PEM (PKCS#8) key `key` (an
    /// operator's own, from the configuration).
    ///
    /// Errors: [`CaError::Cert`], [`CaError::Key`].
    pub fn from_pem(cert: &str, key: &str) -> Result<Self, CaError> {
        let key = KeyPair::from_pem(key)?;
        let issuer = Issuer::from_ca_cert_pem(cert, key)?;
        let leaf_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
        let leaf_signing = rustls::crypto::aws_lc_rs::sign::any_supported_type(&der).map_err(CaError::Key)?;
        Ok(CertificateAuthority {
            cert_pem: cert.trim_end().to_string() + "\n",
            issuer,
            leaf_key,
            leaf_signing,
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The CA certificate (PEM), for the guests' trust store.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A certificate and key for DNS name `name` (lower case), signed by
    /// the CA; made once and kept until a day before it expires.
    ///
    /// Errors: [`CaError::Cert`] (a name rcgen refuses).
    pub fn leaf(&self, name: &str) -> Result<Arc<CertifiedKey>, CaError> {
        let mut leaves = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((leaf, made)) = leaves.get(name) {
            if made.elapsed() + LEAF_RENEW < Duration::from_secs(LEAF_VALIDITY_DAYS as u64 * 86_400) {
                return Ok(leaf.clone());
            }
        }
        let mut params = CertificateParams::new(vec![name.to_string()])?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let today = time_now();
        params.not_before = today - time::Duration::hours(1);
        params.not_after = today + time::Duration::days(LEAF_VALIDITY_DAYS);
        let cert = params.signed_by(&self.leaf_key, &self.issuer)?;
        let chain: Vec<CertificateDer<'static>> = vec![cert.der().clone()];
        let leaf = Arc::new(CertifiedKey::new(chain, self.leaf_signing.clone()));
        if leaves.len() >= LEAF_CACHE {
            leaves.clear();
        }
        leaves.insert(name.to_string(), (leaf.clone(), Instant::now()));
        Ok(leaf)
    }
}

/// Now, as rcgen's time type.
fn time_now() -> time::OffsetDateTime {
    time::OffsetDateTime::now_utc()
}

/// Writes `bytes` to `path` with `mode`: to a temporary name, synced, then
/// renamed over `path`.
fn write_new(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::client::danger::ServerCertVerifier;
    use rustls_pki_types::pem::PemObject;

    #[test]
    fn the_ca_is_kept_and_signs_leaves_that_rustls_accepts() {
        let dir = tempfile::tempdir().unwrap();
        let ca = CertificateAuthority::load_or_create(dir.path(), "t1").unwrap();
        let again = CertificateAuthority::load_or_create(dir.path(), "t1").unwrap();
        assert_eq!(ca.cert_pem(), again.cert_pem(), "the second start reads the first's CA");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join(CA_KEY_FILE)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);

        let leaf = ca.leaf("api.test").unwrap();
        assert!(Arc::ptr_eq(&leaf, &ca.leaf("api.test").unwrap()), "kept");
        // A client that trusts the CA (as the guest does) accepts the leaf
        // for its name and refuses it for another.
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pki_types::CertificateDer::pem_slice_iter(ca.cert_pem().as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider).build().unwrap();
        let now = rustls_pki_types::UnixTime::now();
        let ok = verifier.verify_server_cert(
            &leaf.cert[0],
            &[],
            &rustls_pki_types::ServerName::try_from("api.test").unwrap(),
            &[],
            now,
        );
        assert!(ok.is_ok(), "{ok:?}");
        let other = verifier.verify_server_cert(
            &leaf.cert[0],
            &[],
            &rustls_pki_types::ServerName::try_from("other.test").unwrap(),
            &[],
            now,
        );
        assert!(other.is_err());
    }
}
