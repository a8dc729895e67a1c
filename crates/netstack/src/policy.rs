//! The egress policy of a sandbox and its verdicts.
//!
//! STUB: the lead wrote the types and signatures; the policy helper fills
//! in the logic (see /work/wt/DESIGN-15.md).

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// The default verdict for destinations no rule matches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Egress {
    /// Public internet (the default).
    #[default]
    Allow,
    /// Nothing but what `allow` lists.
    Deny,
}

/// A sandbox's egress policy as users write it (MCP `network`, server
/// config). Each entry of `allow`/`deny` is a domain (`example.com`), a
/// wildcard domain (`*.example.com`: any name below it, not itself), an
/// IP address or a CIDR (`203.0.113.0/24`, `2001:db8::/32`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkPolicy {
    /// The verdict when no rule matches.
    #[serde(default)]
    pub egress: Egress,
    /// Allowed destinations (exceptions to `egress: "deny"`).
    #[serde(default)]
    pub allow: Vec<String>,
    /// Denied destinations; a deny beats an allow.
    #[serde(default)]
    pub deny: Vec<String>,
}

/// Server-wide settings the policy depends on.
#[derive(Clone, Debug, Default)]
pub struct ServerNetPolicy {
    /// Always-denied ranges the server config explicitly allows (e.g.
    /// `127.0.0.0/8` for a test's loopback server).
    pub permit_ranges: Vec<IpNet>,
    /// The host's own addresses (always denied unless permitted).
    pub host_addrs: Vec<IpAddr>,
}

/// Errors of a policy.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// An entry is neither a domain, a wildcard domain, an address nor a CIDR.
    #[error("network rule {0:?} is not a domain, *.domain, IP address or CIDR")]
    BadRule(String),
}

/// Allowed or denied, with the rule that decided.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    /// Whether the connection may go on.
    pub allowed: bool,
    /// The deciding rule, e.g. `deny:*.example.com`, `allow:10.0.0.0/8`,
    /// `blocked-range:169.254.0.0/16`, `egress:allow`.
    pub rule: String,
}

/// A [`NetworkPolicy`] checked and compiled for lookups.
#[derive(Clone, Debug)]
pub struct CompiledPolicy {
    _p: (),
}

impl CompiledPolicy {
    /// Checks and compiles `policy`.
    ///
    /// Errors: [`PolicyError::BadRule`] naming the first bad entry.
    pub fn new(_policy: &NetworkPolicy, _server: &ServerNetPolicy) -> Result<Self, PolicyError> {
        todo!("policy helper")
    }

    /// The policy as written.
    pub fn policy(&self) -> &NetworkPolicy {
        todo!("policy helper")
    }

    /// The verdict for a connection to `ip` (port `port`), reached through
    /// the names in `names` (those the sandbox's DNS answers gave for
    /// `ip`; empty when dialled by address).
    pub fn check_addr(&self, _ip: IpAddr, _port: u16, _names: &[String]) -> Verdict {
        todo!("policy helper")
    }

    /// The verdict for a name: a DNS query, or the TLS SNI / HTTP `Host`
    /// of a connection's first bytes.
    pub fn check_name(&self, _name: &str) -> Verdict {
        todo!("policy helper")
    }
}

// LEAD-TEMP: replaced by the policy helper's.
/// This host's own addresses.
pub fn host_addresses() -> Vec<IpAddr> {
    todo!("policy helper")
}

impl CompiledPolicy {
    /// LEAD-TEMP.
    pub fn summary(&self) -> String {
        todo!("policy helper")
    }
}
