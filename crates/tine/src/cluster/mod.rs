//! More than one Tine host behind one MCP endpoint.
//!
//! Every host has a name ([`ClusterConfig::host_name`]), and the ids it
//! hands out carry it: sandboxes are `sb-<host>-<random>` (processes
//! `sb-<host>-<random>:p<m>`), MCP sessions `<host>.<uuid>`. A load balancer
//! keeps a session on one host by hashing `Mcp-Session-Id` (nginx
//! `hash $http_mcp_session_id consistent`, `deploy/nginx/`); its first
//! request (`initialize`, which has no id yet) goes to any host, so later
//! requests may land on another host than the one that made the session.
//! A host that gets a request for another host's session or a tool call
//! naming another host's sandbox passes it to that host when it knows its
//! address ([`ClusterConfig::peers`], [`ClusterConfig::peer_url`]) and
//! otherwise answers with an error naming the host:
//!
//! - a session's HTTP request is proxied whole ([`proxy_foreign_session`]),
//!   streams included;
//! - a tool call is made again on the peer over an MCP session this host
//!   keeps with it ([`Cluster::forward`]); its progress notifications stay
//!   on the peer.
//!
//! Both authenticate with the peer key (`[cluster] peer_key_file`, which a
//! host that reaches peers must have: it does not start without one, so
//! the operator's token and the caller's credential never go to a peer), name the
//! caller's principal in [`crate::auth::TENANT_HEADER`] (which a host
//! believes only with the peer key), so the peer acts for the same tenant
//! and checks its objects as its own calls, and carry a header naming
//! this host ([`PROXIED_HEADER`], [`FORWARDED_HEADER`]):
//! a request is proxied once at most and a tool call forwarded once at
//! most, so a wrong peer table cannot make a loop. Sandboxes do
//! not move between hosts: a host that stops takes its sandboxes and
//! sessions with it.
//!
//! Preview ids name their host by a short tag only: a host finds the
//! tagged host among `peers`, or among the hosts `peer_dns` resolves to
//! ([`discovery`]).
//!
//! The parts: [`ids`] (host names and the hosts that ids name), [`discovery`] (hosts found by DNS),
//! [`forward`] (where a tool call runs, and forwarding it), [`proxy`] (a
//! session's requests passed on whole) and [`sessions`] (this host's MCP
//! sessions, named after it). Every error is a [`ClusterError`].

pub mod discovery;
pub mod forward;
pub mod ids;
pub mod proxy;
pub mod sessions;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rmcp::transport::streamable_http_server::session::local::LocalSessionManagerError;
use serde::Deserialize;

pub use forward::Route;
pub use ids::{host_name, host_of, named_ids, session_host, system_host_name, HOST_NAME_ENV, MAX_HOST_NAME};
pub use proxy::proxy_foreign_session;
pub use sessions::HostSessions;

/// The header a forwarded tool call carries: the name of the host that
/// made it again here. A host never forwards a call that has it.
pub const FORWARDED_HEADER: &str = "x-tine-forwarded-by";
/// The header a proxied session request carries: the name of the host
/// that passed it on. A host never proxies a request that has it. (A
/// proxied request may still forward its tool call once: two hops at
/// most.)
pub const PROXIED_HEADER: &str = "x-tine-proxied-by";
/// How long a connection to a peer may take to open.
const PEER_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// `[cluster]` in the configuration file.
///
/// ```toml
/// [cluster]
/// host_name = "tine-a"          # default: $TINE_HOST_NAME, else the system's host name
/// peers = { tine-b = "http://10.0.0.2:5555" }
/// peer_url = "http://{host}.tine-peers:5555"   # for hosts not in peers
/// peer_key_file = "/etc/tine/peer-key"         # required with peers, peer_url or peer_dns
/// peer_dns = "http://tine-peers.tine.svc.cluster.local:5555"   # every host's address, for previews
/// ```
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// This host's name, in its sandbox and session ids: letters, digits,
    /// `-` and `.` (a `.` becomes `-`), at most [`MAX_HOST_NAME`] bytes,
    /// lowercased. Default: `$TINE_HOST_NAME`, else the first label of the
    /// system's host name.
    pub host_name: Option<String>,
    /// Other hosts by name: the base URL (`http://10.0.0.2:5555`) this
    /// host forwards their sessions and sandboxes' calls to.
    pub peers: BTreeMap<String, String>,
    /// The base URL of a host not in `peers`, with `{host}` standing for
    /// its name followed by a fixed DNS suffix:
    /// `http(s)://{host}.<suffix>[:port]`, the suffix's last label not a
    /// number (a DNS name per host, such as a headless Service's). A host
    /// name never makes such a URL an IP address's; `http://{host}:5555`
    /// is refused ([`ClusterError::BadPeerTemplate`]): list such hosts in
    /// `peers`. Unset: only `peers` are reached, and calls for other hosts
    /// are refused with their name.
    pub peer_url: Option<String>,
    /// The file holding the key hosts present to each other (at least 32
    /// printable bytes, mode 0600; the same on every host; not the
    /// operator's token). Required when `peers`, `peer_url` or `peer_dns`
    /// is set (the server does not start without it,
    /// [`ClusterError::NoPeerKey`]); unset otherwise.
    pub peer_key_file: Option<std::path::PathBuf>,
    /// A URL whose name resolves to every host's address (Kubernetes: the
    /// headless Service): a host finds the host of a preview it did not
    /// make among them ([`discovery`]). Unset: only among `peers`.
    pub peer_dns: Option<String>,
}

impl ClusterConfig {
    /// Whether this host reaches other hosts (`peers`, `peer_url` or
    /// `peer_dns` set): then it needs a peer key of its own.
    pub fn reaches_peers(&self) -> bool {
        !self.peers.is_empty() || self.peer_url.is_some() || self.peer_dns.is_some()
    }
}

/// Errors of the cluster configuration, of forwarding and of this host's
/// MCP sessions ([`HostSessions`]).
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A host name that cannot be used in ids.
    #[error(
        "host name {name:?}: {reason}; use 1 to {MAX_HOST_NAME} letters, digits, '-' or '.' ([cluster] host_name or \
         ${HOST_NAME_ENV})"
    )]
    BadHostName {
        /// The name given.
        name: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// A peer's URL is not `http(s)://host[:port]`.
    #[error("[cluster] peer {name}: {url:?} is not an http:// or https:// base URL")]
    BadPeerUrl {
        /// The peer.
        name: String,
        /// Its URL.
        url: String,
    },
    /// `peer_url` is not `http(s)://{host}.<DNS suffix>[:port]` with a
    /// last label that is not a number.
    #[error(
        "[cluster] peer_url {url:?}: use http(s)://{{host}}.<DNS suffix>[:port] (e.g. \
         http://{{host}}.tine-peers.tine.svc.cluster.local:5555), {{host}} once and first, the suffix's last label \
         not a number, so that no host name in a client's id makes it an IP address; or list each host's URL in \
         [cluster] peers"
    )]
    BadPeerTemplate {
        /// The template given.
        url: String,
    },
    /// A host that reaches peers has no peer key of its own.
    #[error(
        "[cluster] names other hosts (peers, peer_url or peer_dns) but no peer_key_file: hosts authenticate to \
         each other with a key of their own, never the operator's token; make one with `tine server keygen --out \
         /etc/tine/peer-key`, give every host the same file (mode 0600) and set [cluster] peer_key_file to it \
         (`tine doctor` checks it)"
    )]
    NoPeerKey,
    /// The peer key is the operator's token.
    #[error(
        "[cluster] peer_key_file holds the operator's token: peers would receive it; make a key of its own with \
         `tine server keygen --out /etc/tine/peer-key` (the same file on every host)"
    )]
    PeerKeyIsToken,
    /// The HTTP client cannot be made.
    #[error("cannot make the HTTP client for peers: {0}")]
    Client(String),
    /// A new MCP session would be one more than `max_sessions`.
    #[error(
        "this server has {max} MCP sessions open, as many as its max_sessions allows: end sessions you no longer \
         use (DELETE /mcp with their Mcp-Session-Id header; a session also ends after {idle_secs} s without a \
         request), or raise max_sessions in the server's configuration"
    )]
    TooManySessions {
        /// The cap.
        max: usize,
        /// After how long without a request a session ends (s).
        idle_secs: u64,
    },
    /// rmcp's session error (an unknown session, a session that ended).
    #[error(transparent)]
    Session(#[from] LocalSessionManagerError),
    /// A tool call names sandboxes on two hosts.
    #[error("{tool} names sandboxes on two hosts ({first} on {first_host}, {id} on {host}); it works within one host")]
    TwoHosts {
        /// The tool.
        tool: String,
        /// The first id named, and its host.
        first: String,
        /// Its host.
        first_host: String,
        /// An id on another host.
        id: String,
        /// Its host.
        host: String,
    },
    /// A forwarded call names a host other than the one it was forwarded to.
    #[error(
        "{id} is on host {host}, not on {this} (which got this call forwarded from {by}); a call is forwarded once at \
         most: check the hosts' [cluster] peers"
    )]
    ForwardedTwice {
        /// The id.
        id: String,
        /// The host it names.
        host: String,
        /// This host.
        this: String,
        /// The host that forwarded the call here.
        by: String,
    },
    /// An id names a host this one has no address for.
    #[error(
        "{id} is on host {host}; this is host {this}, which has no address for {host} ([cluster] peers or peer_url): \
         call {host}'s endpoint, or connect through the load balancer"
    )]
    NoPeerAddress {
        /// The id.
        id: String,
        /// The host it names.
        host: String,
        /// This host.
        this: String,
    },
    /// A peer did not take a forwarded call (unreachable, no MCP session,
    /// or a protocol error; a tool's own error is a result, not this).
    #[error("host {host} ({url}) did not take the forwarded call: {reason}")]
    Peer {
        /// The peer.
        host: String,
        /// Its base URL.
        url: String,
        /// What went wrong.
        reason: String,
    },
}

/// Checks a `peer_url` template ([`ClusterConfig::peer_url`]): `{host}`
/// once, right after `http://` or `https://` and followed by `.` and a
/// fixed DNS suffix (non-empty labels, the last not a number by the WHATWG
/// URL Standard's "ends in a number checker", [`ids::is_numeric_label`]),
/// then at most a port and `/`. The last label of any URL made from it is
/// then the suffix's, so the URL parser reads every host name as a domain.
///
/// Errors: [`ClusterError::BadPeerTemplate`].
fn check_peer_url(template: &str) -> Result<(), ClusterError> {
    let bad = || ClusterError::BadPeerTemplate { url: template.to_string() };
    let rest = template.strip_prefix("http://").or_else(|| template.strip_prefix("https://")).ok_or_else(bad)?;
    let after = rest.strip_prefix("{host}.").ok_or_else(bad)?;
    if after.contains("{host}") {
        return Err(bad());
    }
    // The URL as a sample host name makes it: its host is that name and
    // the suffix, nothing else is set.
    let url = reqwest::Url::parse(&template.replace("{host}", "h")).map_err(|_| bad())?;
    let suffix = url.host_str().and_then(|h| h.strip_prefix("h.")).ok_or_else(bad)?;
    let labels_ok = suffix.split('.').all(|l| !l.is_empty() && !l.contains(['[', ']', ':']));
    let last_ok = suffix.rsplit('.').next().is_some_and(|l| !ids::is_numeric_label(l));
    let bare = url.username().is_empty()
        && url.password().is_none()
        && url.query().is_none()
        && url.fragment().is_none()
        && matches!(url.path(), "" | "/");
    if !(labels_ok && last_ok && bare) {
        return Err(bad());
    }
    Ok(())
}

/// This host and how it reaches the others.
pub struct Cluster {
    host: String,
    peers: BTreeMap<String, String>,
    peer_url: Option<String>,
    /// The key this host presents to peers (`None`: `--dev`).
    peer_key: Option<String>,
    http: reqwest::Client,
    /// MCP sessions with peers for forwarded tool calls, by peer name and
    /// the principal they act for: only peers that answered (a slot whose
    /// session cannot be made is removed, [`Cluster::forward`]).
    /// Each peer's slot is locked while its session is made, so a peer
    /// that is slow to answer holds up only calls to itself.
    clients: std::sync::Mutex<BTreeMap<(String, String), Arc<forward::PeerClient>>>,
    /// Forwarded calls by peer and outcome, for `/metrics`.
    pub(crate) forwarded: crate::metrics::Forwarded,
    /// The hosts `peer_dns` finds.
    discovery: Option<discovery::Discovery>,
}

impl Cluster {
    /// This host as `config` names it (see [`ClusterConfig::host_name`]);
    /// `peer_key` authenticates its requests to peers.
    ///
    /// Errors: [`ClusterError`] for a bad name or peer URL.
    pub fn new(config: &ClusterConfig, peer_key: Option<String>) -> Result<Self, ClusterError> {
        let host = match config.host_name.clone().or_else(|| std::env::var(HOST_NAME_ENV).ok()) {
            Some(raw) if !raw.trim().is_empty() => host_name(&raw)?,
            _ => system_host_name(),
        };
        let mut peers = BTreeMap::new();
        for (name, url) in &config.peers {
            let url = url.trim_end_matches('/').to_string();
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(ClusterError::BadPeerUrl { name: name.clone(), url });
            }
            peers.insert(host_name(name)?, url);
        }
        if let Some(t) = &config.peer_url {
            if !(t.starts_with("http://") || t.starts_with("https://")) || !t.contains("{host}") {
                return Err(ClusterError::BadPeerUrl { name: "peer_url".into(), url: t.clone() });
            }
            check_peer_url(t)?;
        }
        let http = reqwest::Client::builder()
            .connect_timeout(PEER_CONNECT_TIMEOUT)
            // A peer's redirect could send the peer key elsewhere.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| ClusterError::Client(e.to_string()))?;
        let discovery = config.peer_dns.as_deref().map(discovery::Discovery::new).transpose()?;
        Ok(Cluster {
            discovery,
            host,
            peers,
            peer_url: config.peer_url.as_ref().map(|t| t.trim_end_matches('/').to_string()),
            peer_key,
            http,
            clients: std::sync::Mutex::new(BTreeMap::new()),
            forwarded: Default::default(),
        })
    }

    /// This host's name.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The host name (without port) peers use for this host through
    /// [`ClusterConfig::peer_url`], if set: the server accepts it as a
    /// `Host`, since the address is this host's own.
    pub fn own_peer_host(&self) -> Option<String> {
        let url = self.peer_url.as_ref()?.replace("{host}", &self.host);
        reqwest::Url::parse(&url).ok()?.host_str().map(str::to_string)
    }

    /// `host` as the `peer` label of the forwarded-calls metric: a peer of
    /// `peers`, or one reached through `peer_url`; a failure to reach a
    /// name only `peer_url` knows counts as `unlisted`, so that clients'
    /// made-up names do not grow the series.
    fn peer_label(&self, host: &str, ok: bool) -> String {
        if ok || self.peers.contains_key(host) {
            host.to_string()
        } else {
            "unlisted".into()
        }
    }

    /// The base URL of peer `host`, if this host can reach it.
    pub(crate) fn peer(&self, host: &str) -> Option<String> {
        self.peers.get(host).cloned().or_else(|| self.peer_url.as_ref().map(|t| t.replace("{host}", host)))
    }

    /// The peers [`ClusterConfig::peers`] names (not those only
    /// [`ClusterConfig::peer_url`] reaches: they are not known by name).
    pub(crate) fn named_peers(&self) -> impl Iterator<Item = &str> {
        self.peers.keys().map(String::as_str)
    }

    /// The other hosts [`ClusterConfig::peer_dns`] finds, by name and base
    /// URL (none without it): the last lookup's while fresh; with `miss`
    /// (the caller did not find what it looked for) a new one unless the
    /// last is very recent ([`discovery::RETRY`]).
    pub(crate) async fn discovered_peers(&self, miss: bool) -> Vec<discovery::Found> {
        let Some(d) = &self.discovery else { return Vec::new() };
        let mut found = d.hosts(miss, |base| self.ask_name(base)).await;
        found.retain(|f| f.name != self.host);
        found
    }

    /// The host name the server at `base` gives in its `/healthz`
    /// (which names it to the operator's credential, and so the peer key's).
    async fn ask_name(&self, base: String) -> Option<String> {
        let mut req = self.http.get(format!("{base}/healthz"));
        if let Some(key) = &self.peer_key {
            req = req.bearer_auth(key);
        }
        let resp = match req.send().await {
            Ok(r) if r.status().is_success() => r,
            Ok(r) => {
                tracing::debug!("[cluster] peer_dns: {base}/healthz answered {}", r.status());
                return None;
            }
            Err(e) => {
                tracing::debug!("[cluster] peer_dns: {base} does not answer: {e}");
                return None;
            }
        };
        let body: serde_json::Value = resp.json().await.ok()?;
        let name = body.get("host")?.as_str()?;
        host_name(name).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_peers_are_refused() {
        let config =
            ClusterConfig { peers: BTreeMap::from([("h2".into(), "10.0.0.2:5555".into())]), ..Default::default() };
        assert!(matches!(Cluster::new(&config, None), Err(ClusterError::BadPeerUrl { .. })));
        let config = ClusterConfig { peer_url: Some("http://peers:5555".into()), ..Default::default() };
        assert!(matches!(Cluster::new(&config, None), Err(ClusterError::BadPeerUrl { .. })));
    }

    /// `{host}` must be followed by a fixed DNS suffix whose last label is
    /// not a number: then no host name makes the URL an IP address's.
    #[test]
    fn a_peer_url_needs_a_dns_suffix_after_its_host() {
        let with = |t: &str| ClusterConfig { peer_url: Some(t.into()), ..Default::default() };
        for bad in [
            "http://{host}:5555",
            "http://{host}",
            "https://{host}/",
            "http://{host}.1:5555",
            "http://{host}.0x7f:5555",
            "http://{host}.peers.017:5555",
            "http://x{host}.peers:5555",
            "http://{host}-a.peers:5555",
            "http://{host}..peers:5555",
            "http://user@{host}.peers:5555",
            "http://{host}.peers:5555/mcp",
            "http://{host}.peers:5555/?{host}",
            "http://{host}.{host}.peers:5555",
            "http://peers:5555/{host}",
            "http://{host}.[::1]:5555",
        ] {
            let e = Cluster::new(&with(bad), None).err().unwrap_or_else(|| panic!("{bad} was accepted"));
            assert!(e.to_string().contains("peer_url"), "{bad}: {e}");
        }
        for good in [
            "http://{host}.tine-peers.tine.svc.cluster.local:5555",
            "https://{host}.peers",
            "http://{host}.peers:5555/",
            "http://{host}.peers.example.com",
        ] {
            let c = Cluster::new(&with(good), None).unwrap_or_else(|e| panic!("{good}: {e}"));
            assert!(c.peer("h2").unwrap().contains("h2.peers") || c.peer("h2").unwrap().contains("h2.tine-peers"));
        }
    }
}
