//! A CA of a test's own and TLS servers with its certificates: the
//! upstream HTTPS servers of the secret broker's tests and bench (the
//! broker trusts the CA's PEM file; the guest does not).

use std::path::Path;
use std::sync::Arc;

/// A test CA: rcgen's, on aws-lc-rs as the workspace's TLS is.
pub struct TestCa {
    pem: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl TestCa {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Self {
        let key = rcgen::KeyPair::generate().expect("a CA key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let pem = params.self_signed(&key).expect("the CA's certificate").pem();
        TestCa { pem, issuer: rcgen::Issuer::new(params, key) }
    }

    /// The CA's certificate (PEM).
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// Writes the CA's certificate to `path` (for `extra_roots`,
    /// `upstream_ca_certificates`).
    pub fn write_pem(&self, path: &Path) {
        std::fs::write(path, &self.pem).expect("write the test CA");
    }

    /// A rustls server configuration for DNS name `name` with a leaf of
    /// this CA, offering `h2` and `http/1.1` (ALPN).
    pub fn server_config(&self, name: &str) -> rustls::ServerConfig {
        let key = rcgen::KeyPair::generate().expect("a leaf key");
        let cert = rcgen::CertificateParams::new(vec![name.to_string()])
            .expect("leaf parameters")
            .signed_by(&key, &self.issuer)
            .expect("the leaf");
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .expect("the server's certificate");
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        config
    }
}

/// A root store of the certificates in `pem`.
pub fn roots(pem: &str) -> rustls::RootCertStore {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes()) {
        roots.add(c.expect("a PEM certificate")).expect("a root");
    }
    roots
}
