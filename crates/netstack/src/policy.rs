//! The egress policy of a sandbox and its verdicts.
//!
//! A connection to an address is judged in this order
//! ([`CompiledPolicy::check_addr`]):
//!
//! 1. the always-denied ranges ([`BLOCKED_RANGES`]) and the host's own
//!    addresses, unless a range in [`ServerNetPolicy::permit_ranges`]
//!    covers the address and port ([`PermitRange`]): rule
//!    `blocked-range:<cidr>` or `blocked-range:host-address`;
//! 2. the deny list: a CIDR/address entry matches the address, a domain
//!    entry matches if any of the names the sandbox's DNS gave for the
//!    address matches: rule `deny:<entry>`;
//! 3. the allow list, the same way: rule `allow:<entry>`;
//! 4. the default: rule `egress:allow` or `egress:deny`.
//!
//! What a connection admitted by its address must still show by name is
//! [`CompiledPolicy::name_check`]: nothing when an address rule allowed
//! the address ([`NameCheck::Off`]); when only a domain rule did (the
//! names DNS gave the address, under `egress: "deny"`), the name in its
//! first bytes must be there and allowed ([`NameCheck::Required`]: the
//! stack refuses what it cannot check, and UDP); when the default allowed
//! it and the policy has domain rules, a name seen is judged
//! ([`NameCheck::IfSeen`]). Under a ceiling the stricter of the two
//! applies. See `stack::gate` for what the stack does with it.
//!
//! A name (a DNS query, the TLS SNI or HTTP `Host` of a connection) is
//! judged by the domain entries ([`CompiledPolicy::check_name`]): deny
//! list, allow list, then the default. A name that is an IP literal (a
//! `Host: 203.0.113.5`) is judged by the CIDR/address entries instead. The
//! blocked ranges do not apply to names: they apply to the addresses the
//! names resolve to, and the connection's address was judged already.
//!
//! IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`, RFC 4291 §2.5.5.2) are
//! judged as the IPv4 address they carry, by every rule.
//!
//! A policy may have a ceiling ([`CompiledPolicy::with_ceiling`]: the
//! operator's limit for a tenant's sandboxes): what the policy allows is
//! judged again by the ceiling, and refused with the ceiling's rule
//! prefixed `ceiling:` when the ceiling denies it. Both are enforced on
//! every connection, name and query; no intersection of the two rule sets
//! is computed.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use ipnet::{IpNet, Ipv4Net};
use serde::{Deserialize, Serialize};

use crate::host_name;

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

impl fmt::Display for Egress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Egress::Allow => "allow",
            Egress::Deny => "deny",
        })
    }
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
    /// `127.0.0.0/8` for a test's loopback server, `127.0.0.1/32:8080` for
    /// one port of it). A connection is permitted when one of these
    /// ranges contains its address and port.
    pub permit_ranges: Vec<PermitRange>,
    /// The host's own addresses (always denied unless permitted):
    /// [`HostAddrs::system`] in a server, read again as they change.
    pub host_addrs: HostAddrs,
}

/// How often the host's addresses are read again (one `getifaddrs(3)`,
/// on a thread of its own: none per connection or packet, and none on a
/// network thread, whose seccomp filter has no netlink socket).
pub const HOST_ADDRS_MAX_AGE: Duration = Duration::from_secs(30);

/// The host's own addresses, shared by every policy of a server: read from
/// the system ([`HostAddrs::system`], read again every
/// [`HOST_ADDRS_MAX_AGE`] by a thread of its own while any clone lives, so
/// an address the host gains later, a new interface or a DHCP change, is
/// blocked within that time), or a fixed list ([`HostAddrs::fixed`]; the
/// default is an empty one). Cheap to clone (an `Arc`).
#[derive(Clone, Debug, Default)]
pub struct HostAddrs(Arc<HostAddrsInner>);

#[derive(Debug, Default)]
struct HostAddrsInner {
    /// Where they are read from (`None`: fixed).
    source: Option<fn() -> Vec<IpAddr>>,
    /// Canonical, sorted, without duplicates; when read.
    state: RwLock<(Vec<IpAddr>, Option<Instant>)>,
}

/// `addrs` canonical ([`canonical`]), sorted, without duplicates.
fn normal_addrs(addrs: Vec<IpAddr>) -> Vec<IpAddr> {
    let mut addrs: Vec<IpAddr> = addrs.into_iter().map(canonical).collect();
    addrs.sort();
    addrs.dedup();
    addrs
}

impl HostAddrs {
    /// This host's addresses ([`host_addresses`]), read now and again
    /// every [`HOST_ADDRS_MAX_AGE`] by a thread that ends with the last
    /// clone.
    pub fn system() -> Self {
        let addrs = Self::reading(host_addresses);
        let weak = Arc::downgrade(&addrs.0);
        let spawned = std::thread::Builder::new().name("tine-host-addrs".into()).spawn(move || loop {
            std::thread::sleep(HOST_ADDRS_MAX_AGE);
            let Some(inner) = weak.upgrade() else { return };
            HostAddrs(inner).refresh_if_old(Instant::now());
        });
        if let Err(e) = spawned {
            tracing::warn!("the host's addresses will not be read again: {e}");
        }
        addrs
    }

    /// Addresses read from `source` (as [`HostAddrs::system`] does).
    fn reading(source: fn() -> Vec<IpAddr>) -> Self {
        let now = Instant::now();
        let state = RwLock::new((normal_addrs(source()), Some(now)));
        Self(Arc::new(HostAddrsInner { source: Some(source), state }))
    }

    /// Exactly `addrs`, never read again.
    pub fn fixed(addrs: Vec<IpAddr>) -> Self {
        Self(Arc::new(HostAddrsInner { source: None, state: RwLock::new((normal_addrs(addrs), None)) }))
    }

    /// Whether `ip` (canonical) is one of them as last read.
    fn contains(&self, ip: IpAddr) -> bool {
        self.0.state.read().unwrap_or_else(|e| e.into_inner()).0.binary_search(&ip).is_ok()
    }

    /// Reads them again if the last read is [`HOST_ADDRS_MAX_AGE`] old at
    /// `now` (never for a fixed list).
    fn refresh_if_old(&self, now: Instant) {
        let inner = &*self.0;
        let Some(source) = inner.source else { return };
        let old = {
            let state = inner.state.read().unwrap_or_else(|e| e.into_inner());
            state.1.is_some_and(|t| now.saturating_duration_since(t) >= HOST_ADDRS_MAX_AGE)
        };
        if old {
            let addrs = normal_addrs(source());
            *inner.state.write().unwrap_or_else(|e| e.into_inner()) = (addrs, Some(now));
        }
    }

    /// The addresses as last read.
    pub fn snapshot(&self) -> Vec<IpAddr> {
        self.0.state.read().unwrap_or_else(|e| e.into_inner()).0.clone()
    }
}

impl From<Vec<IpAddr>> for HostAddrs {
    /// [`HostAddrs::fixed`].
    fn from(addrs: Vec<IpAddr>) -> Self {
        Self::fixed(addrs)
    }
}

/// An entry of [`ServerNetPolicy::permit_ranges`]: a CIDR, and the ports
/// it is permitted on. Written `127.0.0.0/8` (every port),
/// `127.0.0.1/32:8080` (one port), `10.0.0.0/8:8000-8099` (an inclusive
/// range of ports); an IPv6 CIDR with ports in brackets,
/// `[::1]/128:8080` (without ports `::1/128` and `[::1]/128` both do).
/// The port is the destination port of a TCP connection or UDP flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct PermitRange {
    /// The addresses, host bits cleared.
    pub net: IpNet,
    /// The ports, inclusive (`None`: every port).
    pub ports: Option<(u16, u16)>,
}

impl PermitRange {
    /// Whether this range covers `ip` (or its other form `original`, an
    /// IPv4-mapped IPv6 address) at `port`.
    fn covers(&self, ip: IpAddr, original: IpAddr, port: u16) -> bool {
        (self.net.contains(&ip) || self.net.contains(&original))
            && self.ports.is_none_or(|(lo, hi)| (lo..=hi).contains(&port))
    }
}

impl FromStr for PermitRange {
    type Err = PolicyError;

    /// Parses the forms of the type's doc.
    ///
    /// Errors: [`PolicyError::BadPermitRange`] naming the entry.
    fn from_str(entry: &str) -> Result<Self, PolicyError> {
        let bad = || PolicyError::BadPermitRange(entry.chars().take(64).collect());
        let e = entry.trim();
        let (net, ports) = if let Some(rest) = e.strip_prefix('[') {
            // `[addr]/len` and an optional `:ports`.
            let (addr, rest) = rest.split_once(']').ok_or_else(bad)?;
            let (len, ports) = match rest.split_once(':') {
                Some((len, ports)) => (len, Some(ports)),
                None => (rest, None),
            };
            (format!("{addr}{len}"), ports)
        } else if e.matches(':').count() > 1 {
            // IPv6 without brackets: no ports.
            (e.to_string(), None)
        } else {
            match e.split_once(':') {
                Some((net, ports)) => (net.to_string(), Some(ports)),
                None => (e.to_string(), None),
            }
        };
        let net = IpNet::from_str(&net).map_err(|_| bad())?.trunc();
        let port = |p: &str| p.parse::<u16>().ok().filter(|&p| p != 0);
        let ports = match ports {
            None => None,
            Some(p) => {
                let (lo, hi) = match p.split_once('-') {
                    Some((lo, hi)) => (port(lo).ok_or_else(bad)?, port(hi).ok_or_else(bad)?),
                    None => {
                        let p = port(p).ok_or_else(bad)?;
                        (p, p)
                    }
                };
                if lo > hi {
                    return Err(bad());
                }
                Some((lo, hi))
            }
        };
        Ok(PermitRange { net, ports })
    }
}

impl TryFrom<String> for PermitRange {
    type Error = PolicyError;

    fn try_from(s: String) -> Result<Self, PolicyError> {
        s.parse()
    }
}

impl fmt::Display for PermitRange {
    /// The form [`PermitRange::from_str`] reads.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.net, self.ports) {
            (IpNet::V6(n), Some(_)) => write!(f, "[{}]/{}", n.addr(), n.prefix_len())?,
            (net, _) => write!(f, "{net}")?,
        }
        match self.ports {
            Some((lo, hi)) if lo == hi => write!(f, ":{lo}"),
            Some((lo, hi)) => write!(f, ":{lo}-{hi}"),
            None => Ok(()),
        }
    }
}

/// Errors of a policy.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// An entry is neither a domain, a wildcard domain, an address nor a CIDR.
    #[error("network rule {0:?} is not a domain, *.domain, IP address or CIDR")]
    BadRule(String),
    /// A `permit_ranges` entry is not of the forms [`PermitRange`] reads.
    #[error(
        "permit_ranges entry {0:?} is not a CIDR with an optional :port or :low-high (127.0.0.0/8, \
         127.0.0.1/32:8080, [::1]/128:8000-8099)"
    )]
    BadPermitRange(String),
    /// An allow or deny list is longer than [`MAX_RULES`].
    #[error("the {list} list has {got} entries, at most {MAX_RULES} are allowed")]
    TooManyRules {
        /// "allow" or "deny".
        list: &'static str,
        /// Entries given.
        got: usize,
    },
}

/// Longest allow or deny entry (bytes): a domain of 253 (RFC 1035
/// §2.3.4) with a `*.` prefix; addresses and CIDRs are shorter.
pub const MAX_RULE_BYTES: usize = 255;

/// Most entries of one allow or deny list. Every new connection is judged
/// against each entry, so the list's length is work per connection.
pub const MAX_RULES: usize = 1024;

/// Allowed or denied, with the rule that decided.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    /// Whether the connection may go on.
    pub allowed: bool,
    /// The deciding rule, e.g. `deny:*.example.com`, `allow:10.0.0.0/8`,
    /// `blocked-range:169.254.0.0/16`, `egress:allow`.
    pub rule: String,
}

impl Verdict {
    fn new(allowed: bool, rule: String) -> Self {
        Self { allowed, rule }
    }
}

/// What a connection to an admitted address must still show by name (the
/// TLS SNI, the HTTP `Host`); ordered from the least to the most.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum NameCheck {
    /// Nothing: the policy has no domain rule, or an address rule
    /// (address or CIDR) allowed the address.
    Off,
    /// The default (`egress: "allow"`) allowed the address and the policy
    /// has domain rules: a name the connection shows is judged, a denied
    /// one refuses it; a connection that shows none goes on.
    IfSeen,
    /// Only a domain rule allowed the address (through the names DNS gave
    /// it, under `egress: "deny"`): the connection must show a name, and
    /// the name must be allowed.
    Required,
}

/// The always-denied ranges, each with the RFC that sets it apart. An
/// address in one of them is refused unless
/// [`ServerNetPolicy::permit_ranges`] covers it.
///
/// The documentation and benchmarking ranges (RFC 5737's TEST-NETs,
/// `198.18.0.0/15` of RFC 2544, `2001:db8::/32` and `3fff::/20`) are not
/// listed: they are no one's internal network, and some sites route them
/// (this project's CI host reaches its package registries' proxy at
/// `203.0.113.80`; "fake-IP" DNS resolvers answer from `198.18.0.0/15`),
/// so refusing them would cut such hosts' sandboxes off for no gain.
///
/// `::ffff:0:0/96` (IPv4-mapped, RFC 4291 §2.5.5.2) is not listed: such an
/// address is judged as its IPv4 address. `64:ff9b::/96` (the NAT64
/// well-known prefix, RFC 6052 §2.1) is refused when the IPv4 address it
/// embeds is (see [`NAT64_PREFIX`]).
pub const BLOCKED_RANGES: &[(&str, &str)] = &[
    ("0.0.0.0/8", "RFC 1122 §3.2.1.3: \"this\" network"),
    ("127.0.0.0/8", "RFC 1122 §3.2.1.3: loopback"),
    ("10.0.0.0/8", "RFC 1918 §3: private"),
    ("172.16.0.0/12", "RFC 1918 §3: private"),
    ("192.168.0.0/16", "RFC 1918 §3: private"),
    ("169.254.0.0/16", "RFC 3927: link-local, incl. cloud metadata 169.254.169.254"),
    ("100.64.0.0/10", "RFC 6598: shared address space (CGNAT)"),
    ("224.0.0.0/4", "RFC 5771: multicast"),
    ("255.255.255.255/32", "RFC 919 / RFC 8190: limited broadcast"),
    ("240.0.0.0/4", "RFC 1112 §4: reserved (class E)"),
    ("192.0.0.0/24", "RFC 6890 §2.2.2: IETF protocol assignments (incl. 192.0.0.192, Oracle Cloud metadata)"),
    ("192.88.99.0/24", "RFC 7526: deprecated 6to4 relay anycast"),
    ("168.63.129.16/32", "Azure WireServer (the platform's host agent endpoint, reachable from every VM)"),
    ("::1/128", "RFC 4291 §2.5.3: loopback"),
    ("::/128", "RFC 4291 §2.5.2: unspecified"),
    ("fc00::/7", "RFC 4193: unique local"),
    ("fe80::/10", "RFC 4291 §2.5.6: link-local"),
    ("fec0::/10", "RFC 3879: deprecated site-local"),
    ("ff00::/8", "RFC 4291 §2.7: multicast"),
    ("100::/64", "RFC 6666: discard-only"),
    ("64:ff9b:1::/48", "RFC 8215: local-use IPv4/IPv6 translation"),
    ("2001::/23", "RFC 2928: IETF protocol assignments (Teredo, ORCHID, benchmarking...)"),
    ("2002::/16", "RFC 3056: 6to4 (an IPv4 address inside; RFC 7526 deprecates its relays)"),
    ("5f00::/16", "RFC 9602: SRv6 segment identifiers"),
];

/// The NAT64 well-known prefix (RFC 6052 §2.1): an address in it is
/// refused when the IPv4 address in its last 32 bits is.
pub const NAT64_PREFIX: &str = "64:ff9b::/96";

/// The rule name for the host's own addresses.
const HOST_ADDRESS_RULE: &str = "blocked-range:host-address";

/// `ip` with IPv4-mapped IPv6 addresses turned into their IPv4 address.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// The IPv4 address a NAT64 address (`64:ff9b::/96`) embeds.
fn nat64_embedded(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = v6.segments();
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        let o = v6.octets();
        Some(Ipv4Addr::new(o[12], o[13], o[14], o[15]))
    } else {
        None
    }
}

/// This host's own interface addresses (every IPv4 and IPv6 address of every
/// interface, as `getifaddrs(3)` lists them), as [`HostAddrs::system`]
/// reads them. Empty if `getifaddrs` fails (logged).
pub fn host_addresses() -> Vec<IpAddr> {
    let addrs = match nix::ifaddrs::getifaddrs() {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!("getifaddrs failed, host addresses unknown: {e}");
            return Vec::new();
        }
    };
    let mut out: Vec<IpAddr> = Vec::new();
    for ifa in addrs {
        let Some(sa) = ifa.address else { continue };
        let ip = if let Some(v4) = sa.as_sockaddr_in() {
            IpAddr::V4(v4.ip())
        } else if let Some(v6) = sa.as_sockaddr_in6() {
            IpAddr::V6(v6.ip())
        } else {
            continue;
        };
        if !out.contains(&ip) {
            out.push(ip);
        }
    }
    out
}

/// One compiled allow/deny entry.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Matcher {
    /// An address (as a /32 or /128) or a CIDR; IPv4-mapped entries are
    /// stored as IPv4.
    Net(IpNet),
    /// Exactly this name.
    Domain(String),
    /// Any name ending in `.` + this suffix (from `*.suffix`).
    Below(String),
}

#[derive(Clone, Debug)]
struct Rule {
    /// The entry in normal form (lower-case domain, CIDR with host bits
    /// cleared), as rule names show it.
    text: String,
    matcher: Matcher,
}

impl Rule {
    fn parse(entry: &str) -> Result<Self, PolicyError> {
        // The entry as an error shows it: at most 64 characters of it.
        let bad = || {
            let mut shown: String = entry.chars().take(64).collect();
            if shown.len() < entry.len() {
                shown.push_str("...");
            }
            PolicyError::BadRule(shown)
        };
        let e = entry.trim();
        if e.is_empty() || entry.len() > MAX_RULE_BYTES {
            return Err(bad());
        }
        if let Ok(ip) = IpAddr::from_str(e) {
            let ip = canonical(ip);
            return Ok(Self { text: ip.to_string(), matcher: Matcher::Net(IpNet::from(ip)) });
        }
        if e.contains('/') {
            let net = IpNet::from_str(e).map_err(|_| bad())?.trunc();
            let net = match net {
                IpNet::V6(n) => match n.network().to_ipv4_mapped() {
                    Some(v4) if n.prefix_len() >= 96 => {
                        IpNet::V4(Ipv4Net::new(v4, n.prefix_len() - 96).map_err(|_| bad())?)
                    }
                    _ => IpNet::V6(n),
                },
                v4 => v4,
            };
            return Ok(Self { text: net.to_string(), matcher: Matcher::Net(net) });
        }
        if let Some(suffix) = e.strip_prefix("*.") {
            let d = host_name::parse(suffix).ok_or_else(bad)?;
            return Ok(Self { text: format!("*.{d}"), matcher: Matcher::Below(d) });
        }
        let d = host_name::parse(e).ok_or_else(bad)?;
        Ok(Self { text: d.clone(), matcher: Matcher::Domain(d) })
    }

    fn is_domain(&self) -> bool {
        !matches!(self.matcher, Matcher::Net(_))
    }

    /// Whether the (normal-form) name matches this domain rule.
    fn matches_name(&self, name: &str) -> bool {
        match &self.matcher {
            Matcher::Net(_) => false,
            Matcher::Domain(d) => d == name,
            Matcher::Below(s) => {
                name.len() > s.len() + 1
                    && name.ends_with(s.as_str())
                    && name.as_bytes().get(name.len() - s.len() - 1) == Some(&b'.')
            }
        }
    }

    fn matches_ip(&self, ip: IpAddr) -> bool {
        match &self.matcher {
            Matcher::Net(n) => n.contains(&ip),
            _ => false,
        }
    }
}

/// A [`NetworkPolicy`] checked and compiled for lookups.
#[derive(Clone, Debug)]
pub struct CompiledPolicy {
    policy: NetworkPolicy,
    allow: Vec<Rule>,
    deny: Vec<Rule>,
    blocked: Vec<IpNet>,
    permit: Vec<PermitRange>,
    host_addrs: HostAddrs,
    /// The operator's limit over this policy (see the module doc).
    ceiling: Option<std::sync::Arc<CompiledPolicy>>,
}

/// The verdict of a policy that allowed (`own`) under its ceiling's
/// (`ceiling`): the ceiling's refusal, marked, or the policy's own rule.
fn under_ceiling(own: Verdict, ceiling: Verdict) -> Verdict {
    if ceiling.allowed {
        own
    } else {
        Verdict::new(false, format!("ceiling:{}", ceiling.rule))
    }
}

impl CompiledPolicy {
    /// Checks and compiles `policy`.
    ///
    /// Errors: [`PolicyError::TooManyRules`] for a list longer than
    /// [`MAX_RULES`] (checked before any entry is parsed),
    /// [`PolicyError::BadRule`] naming the first bad entry (deny list
    /// first, then allow list).
    pub fn new(policy: &NetworkPolicy, server: &ServerNetPolicy) -> Result<Self, PolicyError> {
        for (list, rules) in [("deny", &policy.deny), ("allow", &policy.allow)] {
            if rules.len() > MAX_RULES {
                return Err(PolicyError::TooManyRules { list, got: rules.len() });
            }
        }
        let deny = policy.deny.iter().map(|e| Rule::parse(e)).collect::<Result<Vec<_>, _>>()?;
        let allow = policy.allow.iter().map(|e| Rule::parse(e)).collect::<Result<Vec<_>, _>>()?;
        let blocked = BLOCKED_RANGES.iter().filter_map(|(cidr, _)| IpNet::from_str(cidr).ok()).collect();
        let host_addrs = server.host_addrs.clone();
        Ok(Self {
            policy: policy.clone(),
            allow,
            deny,
            blocked,
            permit: server.permit_ranges.clone(),
            host_addrs,
            ceiling: None,
        })
    }

    /// This policy under `ceiling` (see the module doc; `None`: none).
    pub fn with_ceiling(mut self, ceiling: Option<std::sync::Arc<CompiledPolicy>>) -> Self {
        self.ceiling = ceiling;
        self
    }

    /// The policy as written.
    pub fn policy(&self) -> &NetworkPolicy {
        &self.policy
    }

    /// The ceiling over it, if any.
    pub fn ceiling(&self) -> Option<&std::sync::Arc<CompiledPolicy>> {
        self.ceiling.as_ref()
    }

    /// Whether any allow/deny entry (the ceiling's included) is a domain
    /// (the stack sniffs the SNI/`Host` of connections only then).
    pub fn has_domain_rules(&self) -> bool {
        self.allow.iter().chain(&self.deny).any(Rule::is_domain)
            || self.ceiling.as_ref().is_some_and(|c| c.has_domain_rules())
    }

    /// A one-line summary for logs, e.g.
    /// `egress:deny allow=[*.pypi.org, 203.0.113.0/24] deny=[]`, with the
    /// ceiling's after `ceiling:` if there is one.
    pub fn summary(&self) -> String {
        let list = |rules: &[Rule]| rules.iter().map(|r| r.text.as_str()).collect::<Vec<_>>().join(", ");
        let own = format!("egress:{} allow=[{}] deny=[{}]", self.policy.egress, list(&self.allow), list(&self.deny));
        match &self.ceiling {
            Some(c) => format!("{own} ceiling:({})", c.summary()),
            None => own,
        }
    }

    /// Why `wider` allows more than this policy does, if it visibly does:
    /// egress `allow` under egress `deny`, or an allow entry this policy
    /// refuses (a domain judged by name, a wildcard by a name below it, an
    /// address or CIDR by its first and last address). Deny entries of
    /// this policy that `wider` lacks are not counted: as a ceiling, this
    /// policy enforces them anyway.
    pub fn refuses_more_than(&self, wider: &NetworkPolicy) -> Option<String> {
        if wider.egress == Egress::Allow && self.policy.egress == Egress::Deny {
            return Some("egress \"allow\" where the ceiling's egress is \"deny\"".into());
        }
        for entry in &wider.allow {
            let probes: Vec<String> = match Rule::parse(entry).map(|r| r.matcher) {
                Ok(Matcher::Net(net)) => vec![net.network().to_string(), net.broadcast().to_string()],
                Ok(Matcher::Below(base)) => vec![format!("tine-probe.{base}")],
                Ok(Matcher::Domain(d)) => vec![d],
                Err(_) => continue,
            };
            for probe in probes {
                let v = self.check_name(&probe);
                if !v.allowed {
                    return Some(format!("allow entry {entry:?}, which the ceiling denies ({})", v.rule));
                }
            }
        }
        None
    }

    fn permitted(&self, ip: IpAddr, original: IpAddr, port: u16) -> bool {
        self.permit.iter().any(|r| r.covers(ip, original, port))
    }

    /// The always-denied rule `ip` at `port` falls under, if any.
    fn blocked_rule(&self, original: IpAddr, port: u16) -> Option<String> {
        let ip = canonical(original);
        if self.permitted(ip, original, port) {
            return None;
        }
        if let IpAddr::V6(v6) = ip {
            if let Some(v4) = nat64_embedded(v6) {
                return self.blocked_rule(IpAddr::V4(v4), port);
            }
        }
        if let Some(net) = self.blocked.iter().find(|n| n.contains(&ip)) {
            return Some(format!("blocked-range:{net}"));
        }
        if self.host_addrs.contains(ip) {
            return Some(HOST_ADDRESS_RULE.to_string());
        }
        None
    }

    /// The verdict for a connection to `ip` (port `port`), reached through
    /// the names in `names` (those the sandbox's DNS answers gave for
    /// `ip`; empty when dialled by address). Domain entries match if any
    /// of `names` matches; the port matters only to the permit ranges
    /// ([`PermitRange`]).
    pub fn check_addr(&self, ip: IpAddr, port: u16, names: &[String]) -> Verdict {
        let own = self.check_addr_own(ip, port, names);
        match &self.ceiling {
            Some(c) if own.allowed => under_ceiling(own, c.check_addr(ip, port, names)),
            _ => own,
        }
    }

    /// What a connection to `ip` that [`CompiledPolicy::check_addr`]
    /// allowed (with the same `names`) must still show by name (see
    /// [`NameCheck`]); the stricter of this policy's and its ceiling's.
    /// Meaningless for an address `check_addr` refuses.
    pub fn name_check(&self, ip: IpAddr, names: &[String]) -> NameCheck {
        let own = self.name_check_own(ip, names);
        match &self.ceiling {
            Some(c) => own.max(c.name_check(ip, names)),
            None => own,
        }
    }

    fn name_check_own(&self, ip: IpAddr, names: &[String]) -> NameCheck {
        let ip = canonical(ip);
        if self.allow.iter().any(|r| r.matches_ip(ip)) {
            return NameCheck::Off;
        }
        let names: Vec<String> = names.iter().filter_map(|n| host_name::fold(n)).collect();
        let by_name = self.allow.iter().any(|r| names.iter().any(|n| r.matches_name(n)));
        if by_name && self.policy.egress == Egress::Deny {
            NameCheck::Required
        } else if self.allow.iter().chain(&self.deny).any(Rule::is_domain) {
            NameCheck::IfSeen
        } else {
            NameCheck::Off
        }
    }

    fn check_addr_own(&self, ip: IpAddr, port: u16, names: &[String]) -> Verdict {
        if let Some(rule) = self.blocked_rule(ip, port) {
            return Verdict::new(false, rule);
        }
        let ip = canonical(ip);
        let names: Vec<String> = names.iter().filter_map(|n| host_name::fold(n)).collect();
        let hit = |rules: &[Rule]| {
            rules.iter().find(|r| r.matches_ip(ip) || names.iter().any(|n| r.matches_name(n))).map(|r| r.text.clone())
        };
        if let Some(t) = hit(&self.deny) {
            return Verdict::new(false, format!("deny:{t}"));
        }
        if let Some(t) = hit(&self.allow) {
            return Verdict::new(true, format!("allow:{t}"));
        }
        self.default_verdict()
    }

    /// The verdict for a name: a DNS query, or the TLS SNI / HTTP `Host`
    /// of a connection's first bytes. Domain entries apply to host names;
    /// CIDR/address entries to an IP literal (`203.0.113.5`, `::1`; no
    /// brackets). Names are compared lower-case without a trailing dot,
    /// and need not be valid host names (`_srv._tcp.example.com` meets
    /// `*.example.com`). The blocked ranges do not apply.
    pub fn check_name(&self, name: &str) -> Verdict {
        let own = self.check_name_own(name);
        match &self.ceiling {
            Some(c) if own.allowed => under_ceiling(own, c.check_name(name)),
            _ => own,
        }
    }

    fn check_name_own(&self, name: &str) -> Verdict {
        if let Ok(ip) = IpAddr::from_str(name.trim()) {
            let ip = canonical(ip);
            if let Some(r) = self.deny.iter().find(|r| r.matches_ip(ip)) {
                return Verdict::new(false, format!("deny:{}", r.text));
            }
            if let Some(r) = self.allow.iter().find(|r| r.matches_ip(ip)) {
                return Verdict::new(true, format!("allow:{}", r.text));
            }
        } else if let Some(n) = host_name::fold(name) {
            if let Some(r) = self.deny.iter().find(|r| r.matches_name(&n)) {
                return Verdict::new(false, format!("deny:{}", r.text));
            }
            if let Some(r) = self.allow.iter().find(|r| r.matches_name(&n)) {
                return Verdict::new(true, format!("allow:{}", r.text));
            }
        }
        self.default_verdict()
    }

    fn default_verdict(&self) -> Verdict {
        match self.policy.egress {
            Egress::Allow => Verdict::new(true, "egress:allow".into()),
            Egress::Deny => Verdict::new(false, "egress:deny".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn pol(egress: Egress, allow: &[&str], deny: &[&str]) -> CompiledPolicy {
        compile(egress, allow, deny, &ServerNetPolicy::default())
    }

    fn compile(egress: Egress, allow: &[&str], deny: &[&str], server: &ServerNetPolicy) -> CompiledPolicy {
        let p = NetworkPolicy {
            egress,
            allow: allow.iter().map(|s| s.to_string()).collect(),
            deny: deny.iter().map(|s| s.to_string()).collect(),
        };
        CompiledPolicy::new(&p, server).unwrap()
    }

    fn v(allowed: bool, rule: &str) -> Verdict {
        Verdict::new(allowed, rule.to_string())
    }

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn parses_every_entry_kind_and_rejects_bad_ones() {
        let ok = [
            ("Example.COM.", "example.com"),
            ("*.Example.com", "*.example.com"),
            ("11.0.113.7", "11.0.113.7"),
            ("11.0.113.9/24", "11.0.113.0/24"),
            ("2600:db8::1", "2600:db8::1"),
            ("2600:DB8::/32", "2600:db8::/32"),
            ("::ffff:11.0.113.7", "11.0.113.7"),
            ("::ffff:11.0.113.0/120", "11.0.113.0/24"),
            (" xn--bcher-kva.example ", "xn--bcher-kva.example"),
            ("a-b.c0", "a-b.c0"),
        ];
        for (entry, text) in ok {
            let r = Rule::parse(entry).unwrap_or_else(|e| panic!("{entry}: {e}"));
            assert_eq!(r.text, text, "{entry}");
        }
        let long_label = "a".repeat(64);
        let long_name = vec!["a".repeat(63); 4].join("."); // 255 bytes
        let bad = [
            "",
            " ",
            "*",
            "*.",
            "**.a.com",
            "a.*.com",
            "*a.com",
            "a..com",
            ".a.com",
            "-a.com",
            "a-.com",
            "a_b.com",
            "exa mple.com",
            "bücher.de",
            "10.0.0.0/33",
            "10.0.0.1/x",
            "1.2.3.256",
            "1.2.3",
            "http://a.com",
            "a.com:443",
            "fe80::1%eth0",
            &long_label,
            &long_name,
        ];
        // The error shows an entry whole up to 64 characters.
        let shown = |entry: &str| match entry.len() {
            0..=64 => entry.to_string(),
            _ => format!("{}...", &entry[..64]),
        };
        for entry in bad {
            assert!(
                matches!(Rule::parse(entry), Err(PolicyError::BadRule(e)) if e == shown(entry)),
                "{entry:?} should be refused"
            );
        }
        let p = NetworkPolicy { allow: vec!["ok.com".into(), "no good".into()], ..Default::default() };
        let e = CompiledPolicy::new(&p, &ServerNetPolicy::default()).unwrap_err();
        assert_eq!(e.to_string(), "network rule \"no good\" is not a domain, *.domain, IP address or CIDR");
        // A megabyte entry is refused by its length, and not echoed.
        let huge = "a".repeat(1 << 20);
        let e = Rule::parse(&huge).err().unwrap().to_string();
        assert!(e.len() < 200, "{e}");
        // Lists are bounded before any entry is parsed.
        let p = NetworkPolicy { deny: vec!["not a rule".into(); MAX_RULES + 1], ..Default::default() };
        let e = CompiledPolicy::new(&p, &ServerNetPolicy::default()).unwrap_err();
        assert_eq!(e, PolicyError::TooManyRules { list: "deny", got: MAX_RULES + 1 });
        let p = NetworkPolicy { allow: vec!["a.com".into(); MAX_RULES], ..Default::default() };
        assert!(CompiledPolicy::new(&p, &ServerNetPolicy::default()).is_ok(), "{MAX_RULES} rules are allowed");
    }

    #[test]
    fn always_denied_ranges_refused_by_default() {
        let p = pol(Egress::Allow, &["10.0.0.0/8", "127.0.0.1", "metadata.example"], &[]);
        let cases = [
            ("0.1.2.3", "0.0.0.0/8"),
            ("127.0.0.1", "127.0.0.0/8"),
            ("10.0.2.2", "10.0.0.0/8"),
            ("172.31.255.255", "172.16.0.0/12"),
            ("192.168.1.1", "192.168.0.0/16"),
            ("169.254.169.254", "169.254.0.0/16"),
            ("100.64.0.1", "100.64.0.0/10"),
            ("224.0.0.251", "224.0.0.0/4"),
            ("239.255.255.250", "224.0.0.0/4"),
            ("240.0.0.1", "240.0.0.0/4"),
            ("255.255.255.255", "255.255.255.255/32"),
            ("::1", "::1/128"),
            ("::", "::/128"),
            ("fd00::1", "fc00::/7"),
            ("fe80::1", "fe80::/10"),
            ("ff02::1", "ff00::/8"),
            ("::ffff:127.0.0.1", "127.0.0.0/8"),
            ("::ffff:169.254.169.254", "169.254.0.0/16"),
            ("64:ff9b::a9fe:a9fe", "169.254.0.0/16"), // NAT64 of 169.254.169.254
            ("64:ff9b::7f00:1", "127.0.0.0/8"),
        ];
        for (a, range) in cases {
            // An allow rule (by CIDR or by name) does not open a blocked range.
            assert_eq!(
                p.check_addr(ip(a), 80, &names(&["metadata.example"])),
                v(false, &format!("blocked-range:{range}")),
                "{a}"
            );
        }
        // Edges just outside the ranges.
        for a in ["172.32.0.1", "100.128.0.1", "11.0.0.1", "64:ff9b::b00:7107", "::ffff:11.0.113.7", "2600:db8::1"] {
            assert_eq!(p.check_addr(ip(a), 443, &[]), v(true, "egress:allow"), "{a}");
        }
    }

    #[test]
    fn special_use_ranges_and_the_azure_wire_server_are_blocked() {
        let p = pol(Egress::Allow, &[], &[]);
        let cases = [
            ("168.63.129.16", "168.63.129.16/32"),
            ("192.0.0.192", "192.0.0.0/24"),
            ("192.88.99.1", "192.88.99.0/24"),
            ("fec0::1", "fec0::/10"),
            ("100::1", "100::/64"),
            ("64:ff9b:1::1", "64:ff9b:1::/48"),
            ("2001::1", "2001::/23"),
            ("2002:a9fe:a9fe::1", "2002::/16"),
            ("5f00::1", "5f00::/16"),
        ];
        for (a, range) in cases {
            assert_eq!(p.check_addr(ip(a), 443, &[]), v(false, &format!("blocked-range:{range}")), "{a}");
        }
        // Documentation and benchmarking ranges are not refused (see
        // BLOCKED_RANGES): this project's CI host reaches its registries at
        // 203.0.113.80.
        for a in [
            "168.63.129.15",
            "168.63.129.17",
            "198.20.0.1",
            "192.0.1.255",
            "2001:200::1",
            "2600::1",
            "203.0.113.80",
            "198.18.0.1",
            "2001:db8::1",
        ] {
            assert!(p.check_addr(ip(a), 443, &[]).allowed, "{a}");
        }
    }

    #[test]
    fn host_addresses_are_read_again_when_old() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static READS: AtomicUsize = AtomicUsize::new(0);
        fn source() -> Vec<IpAddr> {
            // The host gains an address at its second read.
            match READS.fetch_add(1, Ordering::SeqCst) {
                0 => vec![ip("11.0.0.1")],
                _ => vec![ip("11.0.0.1"), ip("::ffff:11.0.0.2")],
            }
        }
        let addrs = HostAddrs::reading(source);
        let t0 = Instant::now();
        assert!(addrs.contains(ip("11.0.0.1")));
        addrs.refresh_if_old(t0 + HOST_ADDRS_MAX_AGE / 2);
        assert!(!addrs.contains(ip("11.0.0.2")));
        assert_eq!(READS.load(Ordering::SeqCst), 1, "no read while fresh");
        addrs.refresh_if_old(t0 + HOST_ADDRS_MAX_AGE + Duration::from_secs(1));
        assert!(addrs.contains(ip("11.0.0.2")));
        assert_eq!(READS.load(Ordering::SeqCst), 2);
        addrs.refresh_if_old(t0 + HOST_ADDRS_MAX_AGE + Duration::from_secs(2));
        assert_eq!(READS.load(Ordering::SeqCst), 2);
        // A policy compiled with them sees the new address.
        let server = ServerNetPolicy { permit_ranges: vec![], host_addrs: addrs.clone() };
        assert_eq!(
            compile(Egress::Allow, &[], &[], &server).check_addr(ip("11.0.0.2"), 1, &[]).rule,
            HOST_ADDRESS_RULE
        );
        let fixed = HostAddrs::fixed(vec![ip("11.0.0.9")]);
        fixed.refresh_if_old(t0 + Duration::from_secs(86400));
        assert!(fixed.contains(ip("11.0.0.9")));
        assert_eq!(fixed.snapshot(), vec![ip("11.0.0.9")]);
    }

    #[test]
    fn permit_ranges_take_ports() {
        let r = |s: &str| s.parse::<PermitRange>();
        for (text, shown) in [
            ("127.0.0.0/8", "127.0.0.0/8"),
            ("127.0.0.5/8", "127.0.0.0/8"),
            ("127.0.0.1/32:8080", "127.0.0.1/32:8080"),
            ("10.0.0.0/8:8000-8099", "10.0.0.0/8:8000-8099"),
            ("::1/128", "::1/128"),
            ("[::1]/128", "::1/128"),
            ("[::1]/128:8080", "[::1]/128:8080"),
            (" [fd00::]/8:1-2 ", "[fd00::]/8:1-2"),
        ] {
            assert_eq!(r(text).map(|p| p.to_string()), Ok(shown.to_string()), "{text}");
            assert_eq!(r(shown), r(text), "{shown} reads back");
        }
        for bad in [
            "",
            "127.0.0.1",
            "127.0.0.1/33",
            "127.0.0.1/32:",
            "127.0.0.1/32:0",
            "127.0.0.1/32:65536",
            "127.0.0.1/32:9-8",
            "127.0.0.1/32:x",
            "::1/128:8080",
            "[::1/128:8080",
            "[::1]/128:",
            "example.com:80",
        ] {
            assert!(matches!(r(bad), Err(PolicyError::BadPermitRange(_))), "{bad:?}: {:?}", r(bad));
        }
        let server = ServerNetPolicy {
            permit_ranges: vec![r("127.0.0.1/32:8080").unwrap(), r("[::1]/128:9000-9009").unwrap()],
            host_addrs: HostAddrs::default(),
        };
        let p = compile(Egress::Allow, &[], &[], &server);
        assert_eq!(p.check_addr(ip("127.0.0.1"), 8080, &[]), v(true, "egress:allow"));
        assert_eq!(p.check_addr(ip("::ffff:127.0.0.1"), 8080, &[]), v(true, "egress:allow"));
        assert_eq!(p.check_addr(ip("127.0.0.1"), 8081, &[]), v(false, "blocked-range:127.0.0.0/8"));
        assert_eq!(p.check_addr(ip("127.0.0.1"), 22, &[]), v(false, "blocked-range:127.0.0.0/8"));
        assert_eq!(p.check_addr(ip("::1"), 9009, &[]), v(true, "egress:allow"));
        assert_eq!(p.check_addr(ip("::1"), 9010, &[]), v(false, "blocked-range:::1/128"));
    }

    #[test]
    fn permit_ranges_and_host_addresses() {
        let server = ServerNetPolicy {
            permit_ranges: vec!["127.0.0.1/32".parse().unwrap(), "fd00::/8".parse().unwrap()],
            host_addrs: vec![ip("11.51.100.4"), ip("127.0.0.1"), ip("2600:db8::4")].into(),
        };
        let p = compile(Egress::Allow, &[], &[], &server);
        // Permitted: the range covers the address.
        assert_eq!(p.check_addr(ip("127.0.0.1"), 8080, &[]), v(true, "egress:allow"));
        assert_eq!(p.check_addr(ip("::ffff:127.0.0.1"), 8080, &[]), v(true, "egress:allow"));
        assert_eq!(p.check_addr(ip("fd00::5"), 1, &[]), v(true, "egress:allow"));
        // Not covered: still blocked.
        assert_eq!(p.check_addr(ip("127.0.0.2"), 8080, &[]), v(false, "blocked-range:127.0.0.0/8"));
        assert_eq!(p.check_addr(ip("fc00::5"), 1, &[]), v(false, "blocked-range:fc00::/7"));
        // The host's own (public) addresses.
        for a in ["11.51.100.4", "::ffff:11.51.100.4", "2600:db8::4"] {
            assert_eq!(p.check_addr(ip(a), 22, &[]), v(false, HOST_ADDRESS_RULE), "{a}");
        }
        // Egress deny still applies to a permitted address.
        let p = compile(Egress::Deny, &[], &[], &server);
        assert_eq!(p.check_addr(ip("127.0.0.1"), 8080, &[]), v(false, "egress:deny"));
        let p = compile(Egress::Deny, &["127.0.0.1"], &[], &server);
        assert_eq!(p.check_addr(ip("127.0.0.1"), 8080, &[]), v(true, "allow:127.0.0.1"));
    }

    #[test]
    fn check_addr_order_deny_allow_default() {
        let p = pol(
            Egress::Deny,
            &["11.0.113.0/24", "*.example.com", "2600:db8::/32"],
            &["11.0.113.66", "bad.example.com"],
        );
        assert_eq!(p.check_addr(ip("11.0.113.5"), 443, &[]), v(true, "allow:11.0.113.0/24"));
        assert_eq!(p.check_addr(ip("::ffff:11.0.113.5"), 443, &[]), v(true, "allow:11.0.113.0/24"));
        assert_eq!(p.check_addr(ip("11.0.113.66"), 443, &[]), v(false, "deny:11.0.113.66"));
        assert_eq!(p.check_addr(ip("2600:db8::9"), 443, &[]), v(true, "allow:2600:db8::/32"));
        assert_eq!(p.check_addr(ip("11.51.100.1"), 443, &[]), v(false, "egress:deny"));
        // Domain rules go by the names DNS gave for the address.
        let a = ip("11.51.100.1");
        assert_eq!(p.check_addr(a, 443, &names(&["www.example.com"])), v(true, "allow:*.example.com"));
        assert_eq!(p.check_addr(a, 443, &names(&["WWW.Example.COM."])), v(true, "allow:*.example.com"));
        assert_eq!(p.check_addr(a, 443, &names(&["example.com"])), v(false, "egress:deny"));
        // Any name matching a deny entry denies, whatever the other names.
        assert_eq!(
            p.check_addr(a, 443, &names(&["www.example.com", "bad.example.com"])),
            v(false, "deny:bad.example.com")
        );
        assert_eq!(p.check_addr(a, 443, &names(&["other.org", "a.example.com"])), v(true, "allow:*.example.com"));
        // A CIDR deny beats a name allow.
        assert_eq!(p.check_addr(ip("11.0.113.66"), 443, &names(&["a.example.com"])), v(false, "deny:11.0.113.66"));
        // Empty names match nothing; odd ones are still compared.
        assert_eq!(p.check_addr(a, 443, &names(&["", ".", "example.org"])), v(false, "egress:deny"));
        assert_eq!(p.check_addr(a, 443, &names(&["_x._tcp.Example.com"])), v(true, "allow:*.example.com"));

        let p = pol(Egress::Allow, &[], &["*.example.com", "11.51.100.0/24"]);
        assert_eq!(p.check_addr(ip("11.0.113.1"), 80, &names(&["a.b.example.com"])), v(false, "deny:*.example.com"));
        assert_eq!(p.check_addr(ip("11.51.100.200"), 80, &[]), v(false, "deny:11.51.100.0/24"));
        assert_eq!(p.check_addr(ip("11.0.113.1"), 80, &[]), v(true, "egress:allow"));
    }

    #[test]
    fn check_name_domains_only() {
        let p = pol(Egress::Deny, &["pypi.org", "*.pythonhosted.org", "10.0.0.0/8"], &["evil.pypi.org"]);
        assert_eq!(p.check_name("pypi.org"), v(true, "allow:pypi.org"));
        assert_eq!(p.check_name("PyPI.org."), v(true, "allow:pypi.org"));
        assert_eq!(p.check_name("www.pypi.org"), v(false, "egress:deny"));
        assert_eq!(p.check_name("files.pythonhosted.org"), v(true, "allow:*.pythonhosted.org"));
        assert_eq!(p.check_name("a.b.pythonhosted.org"), v(true, "allow:*.pythonhosted.org"));
        assert_eq!(p.check_name("pythonhosted.org"), v(false, "egress:deny"));
        assert_eq!(p.check_name("xpythonhosted.org"), v(false, "egress:deny"));
        assert_eq!(p.check_name("evil.pypi.org"), v(false, "deny:evil.pypi.org"));
        // IP literals go by the CIDR entries, never by blocked ranges.
        assert_eq!(p.check_name("10.1.2.3"), v(true, "allow:10.0.0.0/8"));
        assert_eq!(p.check_name("::ffff:10.1.2.3"), v(true, "allow:10.0.0.0/8"));
        assert_eq!(p.check_name("11.1.2.3"), v(false, "egress:deny"));
        assert_eq!(p.check_name(""), v(false, "egress:deny"));
        assert!(p.has_domain_rules());

        // Egress allow: names nobody listed are allowed; blocked ranges do
        // not apply to names.
        let p = pol(Egress::Allow, &[], &["*.internal.example"]);
        assert_eq!(p.check_name("localhost"), v(true, "egress:allow"));
        assert_eq!(p.check_name("db.internal.example"), v(false, "deny:*.internal.example"));
        assert_eq!(p.check_name("_dmarc.DB.internal.example."), v(false, "deny:*.internal.example"));
        assert_eq!(p.check_name("internal.example"), v(true, "egress:allow"));

        let p = pol(Egress::Allow, &["11.0.113.0/24"], &["11.51.100.7"]);
        assert!(!p.has_domain_rules());
        assert_eq!(p.check_name("anything.example"), v(true, "egress:allow"));
        assert_eq!(p.check_name("11.51.100.7"), v(false, "deny:11.51.100.7"));
        assert_eq!(p.check_name("127.0.0.1"), v(true, "egress:allow"));
        assert!(!pol(Egress::Deny, &[], &[]).has_domain_rules());
    }

    #[test]
    fn name_check_follows_what_allowed_the_address() {
        let a = ip("11.51.100.1");
        let named = names(&["pypi.org"]);
        let p = pol(Egress::Deny, &["pypi.org", "11.0.113.0/24"], &[]);
        assert_eq!(p.name_check(a, &named), NameCheck::Required, "only the name allowed it");
        assert_eq!(p.name_check(ip("11.0.113.9"), &named), NameCheck::Off, "the CIDR allowed it");
        assert_eq!(p.name_check(ip("::ffff:11.0.113.9"), &[]), NameCheck::Off);
        // Egress allow with domain rules: names are judged if seen.
        let p = pol(Egress::Allow, &["pypi.org"], &["evil.example"]);
        assert_eq!(p.name_check(a, &named), NameCheck::IfSeen);
        assert_eq!(p.name_check(a, &[]), NameCheck::IfSeen);
        assert_eq!(pol(Egress::Allow, &[], &["11.51.100.0/24"]).name_check(a, &[]), NameCheck::Off);
        assert_eq!(pol(Egress::Allow, &[], &[]).name_check(a, &named), NameCheck::Off);
        // The stricter of the policy and its ceiling.
        let ceiling = std::sync::Arc::new(pol(Egress::Deny, &["pypi.org"], &[]));
        let own = pol(Egress::Deny, &["11.51.100.0/24"], &[]).with_ceiling(Some(ceiling));
        assert!(own.check_addr(a, 443, &named).allowed);
        assert_eq!(own.name_check(a, &named), NameCheck::Required);
        let ceiling = std::sync::Arc::new(pol(Egress::Deny, &["11.51.100.0/24"], &[]));
        let own = pol(Egress::Deny, &["pypi.org"], &[]).with_ceiling(Some(ceiling));
        assert_eq!(own.name_check(a, &named), NameCheck::Required);
    }

    #[test]
    fn summary_and_policy_round_trip() {
        let p = pol(Egress::Deny, &["*.PyPI.org", "11.0.113.1/24"], &["bad.example"]);
        assert_eq!(p.summary(), "egress:deny allow=[*.pypi.org, 11.0.113.0/24] deny=[bad.example]");
        assert_eq!(p.policy().allow, vec!["*.PyPI.org", "11.0.113.1/24"]);
        assert_eq!(Egress::Deny.to_string(), "deny");
    }

    #[test]
    fn every_blocked_range_parses() {
        let p = pol(Egress::Allow, &[], &[]);
        assert_eq!(p.blocked.len(), BLOCKED_RANGES.len());
        assert_eq!(NAT64_PREFIX.parse::<IpNet>().unwrap().to_string(), NAT64_PREFIX);
    }

    #[test]
    fn host_addresses_lists_loopback() {
        let addrs = host_addresses();
        assert!(addrs.contains(&ip("127.0.0.1")), "{addrs:?}");
        let server = ServerNetPolicy { permit_ranges: vec![], host_addrs: HostAddrs::system() };
        let p = compile(Egress::Allow, &[], &[], &server);
        assert!(!p.check_addr(ip("127.0.0.1"), 80, &[]).allowed);
    }

    #[test]
    fn a_ceiling_refuses_what_it_denies_and_names_itself() {
        let server = ServerNetPolicy::default();
        let ceiling = std::sync::Arc::new(compile(
            Egress::Deny,
            &["pypi.org", "*.pythonhosted.org", "11.0.113.0/24"],
            &[],
            &server,
        ));
        let own = compile(Egress::Allow, &[], &["evil.example"], &server).with_ceiling(Some(ceiling.clone()));
        assert!(own.check_name("pypi.org").allowed);
        assert_eq!(own.check_name("example.com").rule, "ceiling:egress:deny");
        assert_eq!(own.check_name("evil.example").rule, "deny:evil.example", "its own refusal first");
        assert!(own.check_addr(ip("11.0.113.9"), 443, &[]).allowed);
        assert_eq!(own.check_addr(ip("11.51.100.1"), 443, &[]).rule, "ceiling:egress:deny");
        assert!(own.check_addr(ip("11.51.100.1"), 443, &["files.pythonhosted.org".into()]).allowed);
        assert!(own.summary().contains("ceiling:(egress:deny"), "{}", own.summary());

        let wider = |egress, allow: &[&str]| NetworkPolicy {
            egress,
            allow: allow.iter().map(|s| s.to_string()).collect(),
            deny: vec![],
        };
        assert!(ceiling.refuses_more_than(&wider(Egress::Allow, &[])).unwrap().contains("egress"));
        assert!(ceiling.refuses_more_than(&wider(Egress::Deny, &["pypi.org", "*.pythonhosted.org"])).is_none());
        assert!(ceiling.refuses_more_than(&wider(Egress::Deny, &["11.0.113.128/25"])).is_none());
        let e = ceiling.refuses_more_than(&wider(Egress::Deny, &["203.0.112.0/23"])).unwrap();
        assert!(e.contains("203.0.112.0/23"), "{e}");
        assert!(ceiling.refuses_more_than(&wider(Egress::Deny, &["*.pypi.org"])).is_some());
        assert!(ceiling.refuses_more_than(&wider(Egress::Deny, &["example.com"])).is_some());
    }
}
