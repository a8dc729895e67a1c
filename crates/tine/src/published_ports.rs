//! Published ports (`sandbox_create { ports: ["8080:80"] }`,
//! microsandbox's form): the server listens on a host address and port
//! for the sandbox's whole life, and splices each accepted TCP connection
//! with a connection into the guest's port
//! ([`tine_sandbox::Manager::connect_port`]: a hibernated or paused
//! sandbox is woken first, and an open connection keeps it from idling).
//! Raw TCP, for what a preview URL does not carry (a database, a
//! debugger); no authentication of its own: whoever reaches the host
//! address reaches the guest port, which is why ports are published on
//! loopback unless the operator allows other addresses (`[ports] bind`).
//!
//! The mappings are part of the sandbox's record: a restarted server
//! listens again ([`Publisher::restore`]); an address it cannot take back
//! shows in the sandbox's info (`ports[].listening: false` and `error`).
//! A kill, the idle reaper, an expiry or a failed create closes the
//! listeners ([`Publisher::watch`]). A branch child publishes nothing.
//! Connections count against the sandbox's `max_connections` and show in
//! its network log as `inbound`.
//!
//! ```toml
//! [ports]
//! bind = ["127.0.0.1"]   # host addresses ports may be published on; the first is the default
//! min_host_port = 1024   # lowest host port a sandbox may publish
//! tenants = false        # whether tenants may publish (default: only the operator); per tenant: publish_ports
//! ```

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use tine_sandbox::published_ports::{parse_mappings, PortsError, PublishedPort, LOOPBACK};
use tine_sandbox::{EventKind, Manager, SandboxError};
use tokio::net::TcpListener;
use tokio::sync::broadcast::error::RecvError;
use tokio::task::AbortHandle;

use crate::auth::Principal;

/// Connections one published port serves at once (waiting for the
/// sandbox to wake included); more wait in the listen queue.
pub const MAX_CONNECTIONS_PER_PORT: usize = 64;

/// `[ports]` in the configuration file.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct PortsConfig {
    /// Host addresses ports may be published on; the first is where a
    /// mapping without an address goes. Default: `127.0.0.1` only.
    pub bind: Vec<IpAddr>,
    /// The lowest host port a mapping may name.
    pub min_host_port: u16,
    /// Whether tenants may publish ports (a tenant's `publish_ports`
    /// overrides it); the operator always may.
    pub tenants: bool,
}

impl PortsConfig {
    /// Reads `texts` (`"8080:80"`, `"127.0.0.1:8080:80"`) and checks them
    /// against `[ports]` for `caller`.
    ///
    /// Errors: [`PublishError`] (not `Bind`).
    pub fn check(&self, texts: &[String], caller: &Principal) -> Result<Vec<PublishedPort>, PublishError> {
        let allowed = match caller {
            Principal::Admin => true,
            Principal::Tenant(t) => t.publish_ports.unwrap_or(self.tenants),
        };
        if !allowed && !texts.is_empty() {
            return Err(PublishError::NotAllowed);
        }
        let default_ip = self.bind.first().copied().unwrap_or(LOOPBACK);
        let ports = parse_mappings(texts, default_ip)?;
        for p in &ports {
            if !self.bind.contains(&p.host.ip()) {
                let allowed = self.bind.iter().map(|ip| ip.to_string()).collect::<Vec<_>>().join(", ");
                return Err(PublishError::Address { ip: p.host.ip(), allowed });
            }
            if p.host.port() < self.min_host_port {
                return Err(PublishError::LowPort { port: p.host.port(), min: self.min_host_port });
            }
        }
        Ok(ports)
    }
}

impl Default for PortsConfig {
    fn default() -> Self {
        PortsConfig { bind: vec![LOOPBACK], min_host_port: 1024, tenants: false }
    }
}

/// Why ports cannot be published.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// A mapping that cannot be read, or too many.
    #[error(transparent)]
    Mapping(#[from] PortsError),
    /// The caller may not publish ports.
    #[error(
        "publishing host ports is not allowed for this tenant ([ports] tenants or the tenant's publish_ports): use \
         sandbox_preview_url for HTTP, or ask the operator"
    )]
    NotAllowed,
    /// An address outside `[ports] bind`.
    #[error("host address {ip} is not one ports may be published on here (allowed: {allowed}); leave the address out")]
    Address {
        /// The address asked for.
        ip: IpAddr,
        /// `[ports] bind`.
        allowed: String,
    },
    /// A host port below `[ports] min_host_port`.
    #[error("host port {port} is below {min}, the lowest one ports may be published on here: pick a higher one")]
    LowPort {
        /// The port asked for.
        port: u16,
        /// `[ports] min_host_port`.
        min: u16,
    },
    /// The address is taken (another sandbox's, another program's).
    #[error("cannot listen on {host}: {source}; pick another host port")]
    Bind {
        /// The address.
        host: SocketAddr,
        /// The OS's error.
        source: std::io::Error,
    },
}

/// The server's published-port listeners.
pub struct Publisher {
    manager: Arc<Manager>,
    config: PortsConfig,
    /// The accept loops of each sandbox's ports.
    open: Mutex<BTreeMap<String, Vec<AbortHandle>>>,
}

impl Publisher {
    /// Listeners of `manager`'s sandboxes, as `config` allows them.
    pub fn new(manager: Arc<Manager>, config: PortsConfig) -> Arc<Self> {
        Arc::new(Publisher { manager, config, open: Mutex::new(BTreeMap::new()) })
    }

    /// `[ports]`.
    pub fn config(&self) -> &PortsConfig {
        &self.config
    }

    /// Binds every port of `ports`, all or none (before the sandbox is
    /// made, so a taken port costs no VM).
    ///
    /// Errors: [`PublishError::Bind`].
    pub async fn bind(&self, ports: &[PublishedPort]) -> Result<Vec<Bound>, PublishError> {
        let mut bound = Vec::with_capacity(ports.len());
        for p in ports {
            let listener =
                TcpListener::bind(p.host).await.map_err(|source| PublishError::Bind { host: p.host, source })?;
            bound.push(Bound { port: p.clone(), listener });
        }
        Ok(bound)
    }

    /// Starts serving `bound` for sandbox `id` and records its ports
    /// there. A sandbox gone meanwhile closes them again.
    pub fn start(self: &Arc<Self>, id: &str, bound: Vec<Bound>) {
        if bound.is_empty() {
            return;
        }
        let ports = bound.iter().map(|b| PublishedPort { listening: true, error: None, ..b.port.clone() }).collect();
        if self.manager.set_published_ports(id, ports).is_err() {
            return;
        }
        self.serve(id, bound);
    }

    fn serve(self: &Arc<Self>, id: &str, bound: Vec<Bound>) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let loops = open.entry(id.to_string()).or_default();
        for b in bound {
            tracing::info!(sandbox = %id, host = %b.port.host, guest_port = b.port.guest_port, "publishing a port");
            let task = tokio::spawn(accept_loop(self.clone(), id.to_string(), b));
            loops.push(task.abort_handle());
        }
    }

    /// Listens again on the ports of every sandbox that has some (at
    /// start, after the manager recovered its records); an address that
    /// cannot be taken is recorded in the sandbox's info with why.
    pub async fn restore(self: &Arc<Self>) {
        for (id, ports) in self.manager.all_published_ports() {
            let mut bound = Vec::new();
            for p in ports {
                match TcpListener::bind(p.host).await {
                    Ok(listener) => {
                        self.manager.set_published_port_state(&id, p.host, Ok(()));
                        bound.push(Bound { port: p, listener });
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %id, host = %p.host, "cannot publish its port again: {e}");
                        self.manager.set_published_port_state(&id, p.host, Err(format!("cannot listen again: {e}")));
                    }
                }
            }
            self.serve(&id, bound);
        }
    }

    /// Closes sandbox `id`'s listeners (its connections go on until they end).
    pub fn close(&self, id: &str) {
        if let Some(loops) = self.open.lock().unwrap_or_else(|p| p.into_inner()).remove(id) {
            tracing::info!(sandbox = %id, "closing its {} published ports", loops.len());
            loops.iter().for_each(AbortHandle::abort);
        }
    }

    /// Closes listeners of sandboxes that are gone.
    fn close_gone(&self) {
        let ids: Vec<String> = self.open.lock().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect();
        for id in ids {
            if self.manager.tenant_of(&id).is_none() {
                self.close(&id);
            }
        }
    }

    /// Follows the manager's events: a sandbox that ends (killed, reaped,
    /// expired, failed to create) loses its listeners. Runs until the
    /// manager's event channel closes.
    pub fn watch(self: &Arc<Self>) {
        let me = self.clone();
        let mut events = self.manager.subscribe_events();
        tokio::spawn(async move {
            loop {
                match events.recv().await {
                    Ok(e) => match e.kind {
                        EventKind::Killed
                        | EventKind::Reaped { .. }
                        | EventKind::Expired
                        | EventKind::CreateFailed { .. } => me.close(&e.sandbox_id),
                        EventKind::Merged { winner } => me.close(&winner),
                        _ => {}
                    },
                    Err(RecvError::Lagged(_)) => me.close_gone(),
                    Err(RecvError::Closed) => return,
                }
            }
        });
    }
}

/// A published port with its listener bound.
pub struct Bound {
    port: PublishedPort,
    listener: TcpListener,
}

/// Accepts connections on `b` for sandbox `id` until aborted or the
/// sandbox is gone; each is served by a task of its own.
async fn accept_loop(publisher: Arc<Publisher>, id: String, b: Bound) {
    let places = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS_PER_PORT));
    loop {
        let Ok(place) = places.clone().acquire_owned().await else { return };
        match b.listener.accept().await {
            Ok((client, peer)) => {
                let task = serve_connection(publisher.clone(), id.clone(), b.port.guest_port, client, peer);
                tokio::spawn(async move {
                    task.await;
                    drop(place);
                });
            }
            Err(e) => {
                // EMFILE and the like: wait a little rather than spin.
                tracing::warn!(sandbox = %id, host = %b.port.host, "accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

/// Connects `client` to sandbox `id`'s `guest_port` and copies both ways
/// until both sides closed; a guest that cannot be reached closes
/// `client` (and a sandbox that is gone closes its listeners).
async fn serve_connection(
    publisher: Arc<Publisher>,
    id: String,
    guest_port: u16,
    mut client: tokio::net::TcpStream,
    peer: SocketAddr,
) {
    let conn = match publisher.manager.connect_port(&id, guest_port).await {
        Ok(conn) => conn,
        Err(SandboxError::NotFound(_)) => return publisher.close(&id),
        Err(e) => {
            tracing::info!(sandbox = %id, %peer, guest_port, "published port: no connection into the guest: {e}");
            return;
        }
    };
    let (stream, lease) = conn.into_parts();
    let guest = stream.set_nonblocking(true).and_then(|()| tokio::net::UnixStream::from_std(stream));
    let result = match guest {
        Ok(mut guest) => tokio::io::copy_bidirectional(&mut client, &mut guest).await,
        Err(e) => Err(e),
    };
    drop(lease);
    match result {
        Ok((up, down)) => tracing::debug!(sandbox = %id, %peer, guest_port, up, down, "published port: closed"),
        Err(e) => tracing::debug!(sandbox = %id, %peer, guest_port, "published port: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings_are_checked_against_the_config() {
        let p = PortsConfig::default();
        let ports = p.check(&["8080:80".into()], &Principal::Admin).unwrap();
        assert_eq!(ports[0].host, "127.0.0.1:8080".parse().unwrap());
        assert!(matches!(p.check(&["0.0.0.0:8080:80".into()], &Principal::Admin), Err(PublishError::Address { .. })));
        assert!(matches!(p.check(&["80:80".into()], &Principal::Admin), Err(PublishError::LowPort { .. })));
        assert!(matches!(p.check(&["8080".into()], &Principal::Admin), Err(PublishError::Mapping(_))));
        let open = PortsConfig { bind: vec!["0.0.0.0".parse().unwrap(), LOOPBACK], min_host_port: 80, tenants: false };
        assert_eq!(open.check(&["80:80".into()], &Principal::Admin).unwrap()[0].host, "0.0.0.0:80".parse().unwrap());
        assert!(open.check(&[], &Principal::Admin).unwrap().is_empty());
    }
}
