//! Finding the cluster's hosts by DNS (`[cluster] peer_dns`), for what
//! names no host: a preview id carries only a 10-bit tag of its host's
//! name (`crate::preview::store::host_tag`), so a host that knows its
//! peers only through `peer_url` (the Kubernetes deployment, where a new
//! pod is a new host) cannot tell which host made it.
//!
//! `peer_dns` is a URL whose name resolves to every host's address
//! (Kubernetes: the headless Service, "DNS for Services and Pods", A
//! records for every ready pod). Each address is asked its host name
//! (`GET /healthz` with the peer key answers `host` to the operator),
//! and the answers are kept for [`FRESH`]; a name not among them looks
//! again, at most once every [`RETRY`]. A peer is then reached at the
//! address itself (`http://10.244.1.7:5555`, scheme and port of the URL).

use std::time::{Duration, Instant};

use super::ClusterError;

/// How long a lookup's answers are used.
pub const FRESH: Duration = Duration::from_secs(60);
/// The shortest time between two lookups (a miss looks again at most this
/// often).
pub const RETRY: Duration = Duration::from_secs(5);
/// How long a host has to answer its name.
const ASK_TIMEOUT: Duration = Duration::from_secs(3);
/// Addresses asked, at most, per lookup.
const MAX_HOSTS: usize = 256;

/// One host found: its name and base URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// Its host name.
    pub name: String,
    /// Its base URL (`http://10.244.1.7:5555`).
    pub base: String,
}

struct Lookup {
    at: Instant,
    hosts: Vec<Found>,
}

/// The hosts behind `peer_dns`, looked up when needed.
pub struct Discovery {
    scheme: String,
    name: String,
    port: u16,
    last: tokio::sync::Mutex<Option<Lookup>>,
}

impl Discovery {
    /// Discovery through `url` (`http://tine-peers.tine.svc.cluster.local:5555`).
    ///
    /// Errors: [`ClusterError::BadPeerUrl`] for a URL without a host, or
    /// with a path.
    pub fn new(url: &str) -> Result<Self, ClusterError> {
        let bad = || ClusterError::BadPeerUrl { name: "peer_dns".into(), url: url.to_string() };
        let parsed = reqwest::Url::parse(url).map_err(|_| bad())?;
        if !matches!(parsed.scheme(), "http" | "https") || !matches!(parsed.path(), "" | "/") {
            return Err(bad());
        }
        let name = parsed.host_str().ok_or_else(bad)?.trim_start_matches('[').trim_end_matches(']').to_string();
        let port = parsed.port_or_known_default().ok_or_else(bad)?;
        Ok(Discovery { scheme: parsed.scheme().to_string(), name, port, last: tokio::sync::Mutex::new(None) })
    }

    /// The hosts found: the last lookup's if fresh (and, with `miss`,
    /// younger than [`RETRY`]), else a new lookup's. `ask` gives a base
    /// URL's host name. A lookup that fails keeps the last answers.
    pub async fn hosts<F, Fut>(&self, miss: bool, ask: F) -> Vec<Found>
    where
        F: Fn(String) -> Fut,
        Fut: std::future::Future<Output = Option<String>>,
    {
        let mut last = self.last.lock().await;
        if let Some(l) = last.as_ref() {
            let age = l.at.elapsed();
            if age < RETRY || (!miss && age < FRESH) {
                return l.hosts.clone();
            }
        }
        let addrs = match tokio::net::lookup_host((self.name.as_str(), self.port)).await {
            Ok(a) => a.take(MAX_HOSTS).collect::<Vec<_>>(),
            Err(e) => {
                tracing::warn!("[cluster] peer_dns: cannot resolve {}: {e}", self.name);
                if let Some(l) = last.as_mut() {
                    l.at = Instant::now();
                    return l.hosts.clone();
                }
                *last = Some(Lookup { at: Instant::now(), hosts: Vec::new() });
                return Vec::new();
            }
        };
        let bases: Vec<String> = addrs.iter().map(|a| format!("{}://{a}", self.scheme)).collect();
        let asked = futures_util::future::join_all(bases.iter().map(|b| {
            let answer = ask(b.clone());
            async move { tokio::time::timeout(ASK_TIMEOUT, answer).await.ok().flatten() }
        }))
        .await;
        let hosts: Vec<Found> =
            bases.into_iter().zip(asked).filter_map(|(base, name)| name.map(|name| Found { name, base })).collect();
        tracing::debug!("[cluster] peer_dns: {} of {} addresses answered", hosts.len(), addrs.len());
        *last = Some(Lookup { at: Instant::now(), hosts: hosts.clone() });
        hosts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_names_a_host_and_nothing_else() {
        let d = Discovery::new("http://tine-peers.tine.svc.cluster.local:5555").unwrap();
        assert_eq!((d.scheme.as_str(), d.name.as_str(), d.port), ("http", "tine-peers.tine.svc.cluster.local", 5555));
        assert_eq!(Discovery::new("https://peers/").unwrap().port, 443);
        for bad in ["peers:5555", "ftp://peers", "http://peers/mcp", "http://"] {
            assert!(Discovery::new(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn hosts_are_asked_their_names_and_kept() {
        let d = Discovery::new("http://localhost:5555").unwrap();
        let asked = std::sync::atomic::AtomicUsize::new(0);
        let ask = |base: String| {
            asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move { base.contains("127.0.0.1").then(|| "h1".to_string()) }
        };
        let hosts = d.hosts(false, &ask).await;
        assert_eq!(hosts, vec![Found { name: "h1".into(), base: "http://127.0.0.1:5555".into() }]);
        let n = asked.load(std::sync::atomic::Ordering::SeqCst);
        assert!(n >= 1);
        // Fresh answers, and a miss within RETRY, do not look again.
        assert_eq!(d.hosts(false, &ask).await, hosts);
        assert_eq!(d.hosts(true, &ask).await, hosts);
        assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), n);
    }
}
