//! Sandbox networking as the server configures it (`[network]` in the
//! configuration file) and as the manager applies it: every sandbox gets a
//! virtio-net device behind its own user-space NAT ([`netstack`]), with a
//! per-sandbox egress policy that can change while it runs, and a network
//! log.
//!
//! ```toml
//! [network]
//! enabled = true
//! egress = "allow"            # default policy of new sandboxes: "allow" | "deny"
//! allow = []                  # domains, *.domains, addresses, CIDRs
//! deny = []
//! permit_ranges = []          # always-denied ranges this server allows, e.g. ["127.0.0.0/8", "127.0.0.1/32:8080", "[::1]/128:8000-8099"]
//! dns_upstreams = []          # default: the nameservers of /etc/resolv.conf
//! max_connections = 256       # open TCP connections + UDP flows per sandbox
//! log_records = 1024          # network log records kept per sandbox
//! ca_certificates = []        # PEM files added to every guest's trust store; "host": the host's own store
//! upstream_ca_certificates = [] # PEM files the secret broker trusts for upstream hosts
//! [network.hosts]             # names the gateway's DNS answers itself
//! # "files.internal" = "10.0.2.2"
//! ```

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

pub use netstack::control::InboundError;
use netstack::control::NetControl;
pub use netstack::log::{Direction, NetRecord, Protocol};
pub use netstack::policy::PermitRange;
use netstack::policy::{CompiledPolicy, PolicyError, ServerNetPolicy};
pub use netstack::policy::{Egress, NetworkPolicy, MAX_RULES as MAX_POLICY_RULES};
use netstack::stack::StackConfig;
use serde::Deserialize;

/// `[network]` of the server configuration.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct NetworkConfig {
    /// Give sandboxes a network device (default true). Off: no device, no
    /// egress; templates made with the other setting are rebuilt.
    pub enabled: bool,
    /// The default verdict of new sandboxes' policies.
    pub egress: Egress,
    /// Default allow list of new sandboxes.
    pub allow: Vec<String>,
    /// Default deny list of new sandboxes.
    pub deny: Vec<String>,
    /// Always-denied ranges (loopback, RFC 1918, link-local, CGNAT,
    /// multicast, the host's own addresses...) that this server lets
    /// sandboxes reach anyway, as CIDRs with an optional port or port
    /// range ([`PermitRange`]: `127.0.0.1/32:8080`; without one, every
    /// port). Empty by default.
    pub permit_ranges: Vec<PermitRange>,
    /// Where the gateway's DNS forwards queries (default: the nameservers
    /// of `/etc/resolv.conf`, port 53).
    pub dns_upstreams: Vec<SocketAddr>,
    /// Names the gateway's DNS answers itself (A records).
    pub hosts: BTreeMap<String, IpAddr>,
    /// Open TCP connections plus UDP flows per sandbox, at most.
    pub max_connections: usize,
    /// Network log records kept per sandbox (older ones fall out, counted).
    pub log_records: usize,
    /// PEM files of CA certificates every guest trusts beside its own
    /// store (for TLS-inspecting proxies); the entry `"host"` stands for
    /// the host's own trust store (what `rustls-native-certs` finds:
    /// `$SSL_CERT_FILE`, else `/etc/ssl/certs/ca-certificates.crt`...).
    /// Installed at every start and restore (`Op::InstallTrust`), so
    /// templates do not depend on them.
    pub ca_certificates: Vec<PathBuf>,
    /// PEM files of CA certificates the secret broker trusts, beside the
    /// host's own store, for the hosts it opens TLS to on a sandbox's
    /// behalf (an internal API's private CA).
    pub upstream_ca_certificates: Vec<PathBuf>,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        NetworkConfig {
            enabled: true,
            egress: Egress::Allow,
            allow: Vec::new(),
            deny: Vec::new(),
            permit_ranges: Vec::new(),
            dns_upstreams: Vec::new(),
            hosts: BTreeMap::new(),
            max_connections: 256,
            log_records: 1024,
            ca_certificates: Vec::new(),
            upstream_ca_certificates: Vec::new(),
        }
    }
}

/// Errors of the network configuration.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    /// A rule of the default policy is bad.
    #[error("[network] default policy: {0}")]
    Policy(#[from] PolicyError),
    /// A limit is out of range.
    #[error("[network] {0}")]
    Limit(String),
    /// A CA certificate file cannot be read or is not PEM.
    #[error("[network] ca_certificates: {path}: {reason}")]
    CaCertificate {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// The network settings in force: what every sandbox's stack and policy
/// start from.
#[derive(Clone, Debug)]
pub struct NetworkSetup {
    /// The configuration as given.
    pub config: NetworkConfig,
    /// The default policy of new sandboxes.
    pub default_policy: NetworkPolicy,
    /// Server-wide policy inputs (permitted ranges, host addresses).
    pub server_policy: Arc<ServerNetPolicy>,
    /// Every stack's settings.
    pub stack: StackConfig,
    /// The CA certificates (PEM text, concatenated) guests trust beside
    /// their own store: `ca_certificates`' and, once the server adds it
    /// ([`NetworkSetup::trust_also`]), its secret broker's.
    pub ca_pem: String,
}

/// The `ca_certificates` entry that stands for the host's own trust store.
pub const HOST_TRUST: &str = "host";

impl NetworkSetup {
    /// Checks `config` (the default policy compiles, limits in range, CA
    /// files readable) and reads the host's addresses and resolvers.
    ///
    /// Errors: [`NetworkError`].
    pub fn new(config: NetworkConfig) -> Result<Self, NetworkError> {
        if config.max_connections == 0 || config.max_connections > 65_536 {
            return Err(NetworkError::Limit(format!(
                "max_connections must be 1..=65536, got {}",
                config.max_connections
            )));
        }
        if config.log_records == 0 || config.log_records > 1_000_000 {
            return Err(NetworkError::Limit(format!("log_records must be 1..=1000000, got {}", config.log_records)));
        }
        let server_policy = Arc::new(ServerNetPolicy {
            permit_ranges: config.permit_ranges.clone(),
            host_addrs: netstack::policy::HostAddrs::system(),
        });
        let default_policy =
            NetworkPolicy { egress: config.egress, allow: config.allow.clone(), deny: config.deny.clone() };
        CompiledPolicy::new(&default_policy, &server_policy)?;
        let mut stack = StackConfig::default();
        if !config.dns_upstreams.is_empty() {
            stack.dns_upstreams = config.dns_upstreams.clone();
        }
        stack.static_hosts = config.hosts.clone();
        stack.max_connections = config.max_connections;
        let mut ca_pem = String::new();
        for path in &config.ca_certificates {
            let bad = |reason: String| NetworkError::CaCertificate { path: path.clone(), reason };
            if path.as_os_str() == HOST_TRUST {
                ca_pem.push_str(&host_trust_pem().map_err(bad)?);
                continue;
            }
            let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
            if !text.contains("-----BEGIN CERTIFICATE-----") {
                return Err(bad("no PEM certificate (-----BEGIN CERTIFICATE-----) in it".into()));
            }
            ca_pem.push_str(text.trim_end());
            ca_pem.push('\n');
        }
        Ok(NetworkSetup { config, default_policy, server_policy, stack, ca_pem })
    }

    /// Adds the CA certificate(s) `pem` (the secret broker's) to what
    /// guests trust.
    pub fn trust_also(&mut self, pem: &str) {
        if !self.ca_pem.is_empty() && !self.ca_pem.ends_with('\n') {
            self.ca_pem.push('\n');
        }
        self.ca_pem.push_str(pem.trim_end());
        self.ca_pem.push('\n');
    }

    /// What templates made under this set-up depend on: the network
    /// device (the CA certificates are installed at every start and
    /// restore, so they are not part of it).
    pub fn fingerprint(&self) -> String {
        "virtio-net".into()
    }

    /// A new sandbox's control with `policy` (`None`: the default policy)
    /// under `ceiling` (a tenant's, [`netstack::policy`]).
    ///
    /// Errors: [`PolicyError`] for a bad rule.
    pub fn control(
        &self,
        policy: Option<&NetworkPolicy>,
        ceiling: Option<&NetworkPolicy>,
    ) -> Result<Arc<NetControl>, PolicyError> {
        let policy = policy.unwrap_or(&self.default_policy);
        NetControl::new(policy, ceiling, self.server_policy.clone(), self.config.log_records)
    }
}

/// The host's own trust store as PEM text: the certificates
/// `rustls-native-certs` finds (`$SSL_CERT_FILE`, `$SSL_CERT_DIR`, else
/// the distribution's bundle).
///
/// Errors: none found, with what the search saw.
pub fn host_trust_pem() -> Result<String, String> {
    use base64::Engine;
    let found = rustls_native_certs::load_native_certs();
    if found.certs.is_empty() {
        let why: Vec<String> = found.errors.iter().map(|e| e.to_string()).collect();
        return Err(format!("the host's trust store has no certificates ({})", why.join("; ")));
    }
    let mut pem = String::new();
    for c in &found.certs {
        let b64 = base64::engine::general_purpose::STANDARD.encode(c.as_ref());
        pem.push_str("-----BEGIN CERTIFICATE-----\n");
        for line in b64.as_bytes().chunks(64) {
            pem.push_str(std::str::from_utf8(line).unwrap_or_default());
            pem.push('\n');
        }
        pem.push_str("-----END CERTIFICATE-----\n");
    }
    Ok(pem)
}

/// Checks that `policy`'s rules compile.
///
/// Errors: [`PolicyError`] naming the first bad rule.
pub fn check_policy(policy: &NetworkPolicy) -> Result<(), PolicyError> {
    CompiledPolicy::new(policy, &ServerNetPolicy::default()).map(|_| ())
}

/// Why `asked` allows more than `ceiling` does, if it visibly does
/// ([`CompiledPolicy::refuses_more_than`]); `None` when it fits, or when
/// `ceiling` does not compile (it was checked when it was read).
pub fn wider_than_ceiling(asked: &NetworkPolicy, ceiling: &NetworkPolicy) -> Option<String> {
    CompiledPolicy::new(ceiling, &ServerNetPolicy::default()).ok()?.refuses_more_than(asked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configuration_is_checked() {
        let bad = NetworkConfig { deny: vec!["not a rule!".into()], ..Default::default() };
        let e = NetworkSetup::new(bad).unwrap_err().to_string();
        assert!(e.contains("not a rule!"), "{e}");
        let e = NetworkSetup::new(NetworkConfig { max_connections: 0, ..Default::default() }).unwrap_err();
        assert!(e.to_string().contains("max_connections must be 1..=65536, got 0"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let not_pem = dir.path().join("ca.pem");
        std::fs::write(&not_pem, "hello").unwrap();
        let e = NetworkSetup::new(NetworkConfig { ca_certificates: vec![not_pem], ..Default::default() }).unwrap_err();
        assert!(e.to_string().contains("no PEM certificate"), "{e}");
    }

    #[test]
    fn permit_ranges_take_ports_in_the_configuration() {
        let config: NetworkConfig =
            toml::from_str("permit_ranges = [\"127.0.0.1/32:8080\", \"[::1]/128:9000-9001\", \"10.0.0.0/8\"]")
                .expect("permit_ranges with ports");
        let setup = NetworkSetup::new(config).unwrap();
        let policy = setup.control(None, None).unwrap().policy();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(policy.check_addr(ip("127.0.0.1"), 8080, &[]).allowed);
        assert_eq!(policy.check_addr(ip("127.0.0.1"), 8081, &[]).rule, "blocked-range:127.0.0.0/8");
        assert!(policy.check_addr(ip("::1"), 9001, &[]).allowed);
        assert!(!policy.check_addr(ip("::1"), 9002, &[]).allowed);
        assert!(policy.check_addr(ip("10.1.2.3"), 22, &[]).allowed, "no port: every port");
        let e = toml::from_str::<NetworkConfig>("permit_ranges = [\"127.0.0.1/32:http\"]").unwrap_err().to_string();
        assert!(e.contains("permit_ranges entry \"127.0.0.1/32:http\" is not a CIDR"), "{e}");
    }

    #[test]
    fn templates_do_not_depend_on_the_ca_certificates() {
        let plain = NetworkSetup::new(NetworkConfig::default()).unwrap();
        assert_eq!(plain.fingerprint(), "virtio-net");
        let dir = tempfile::tempdir().unwrap();
        let pem = dir.path().join("ca.pem");
        std::fs::write(&pem, "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").unwrap();
        let mut with_ca =
            NetworkSetup::new(NetworkConfig { ca_certificates: vec![pem.clone()], ..Default::default() }).unwrap();
        assert_eq!(with_ca.fingerprint(), "virtio-net", "installed at every start and restore instead");
        assert_eq!(with_ca.ca_pem, "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
        with_ca.trust_also("-----BEGIN CERTIFICATE-----\nBBBB\n-----END CERTIFICATE-----");
        assert!(with_ca.ca_pem.ends_with(
            "AAAA\n-----END CERTIFICATE-----\n-----BEGIN CERTIFICATE-----\nBBBB\n-----END CERTIFICATE-----\n"
        ));
        // "host": the host's own store, where it has one.
        if std::path::Path::new("/etc/ssl/certs/ca-certificates.crt").exists() {
            let host =
                NetworkSetup::new(NetworkConfig { ca_certificates: vec![HOST_TRUST.into()], ..Default::default() })
                    .unwrap();
            assert!(host.ca_pem.matches("-----BEGIN CERTIFICATE-----").count() > 10, "the host's bundle");
        }
    }

    #[test]
    fn a_sandbox_policy_starts_from_the_default_and_can_be_its_own() {
        let setup = NetworkSetup::new(NetworkConfig { egress: Egress::Deny, ..Default::default() }).unwrap();
        assert_eq!(setup.control(None, None).unwrap().policy().policy().egress, Egress::Deny);
        let own = NetworkPolicy { egress: Egress::Allow, allow: vec![], deny: vec!["*.example.com".into()] };
        assert_eq!(setup.control(Some(&own), None).unwrap().policy().policy(), &own);
        let bad = NetworkPolicy { deny: vec!["1.2.3".into()], ..Default::default() };
        assert!(setup.control(Some(&bad), None).is_err());
    }
}
