//! Where a tool call runs, and forwarding it: a call naming another
//! host's sandbox is made again on that host, over an MCP session this host
//! keeps with it per caller, authenticated with the peer key and carrying
//! the caller's tenant ([`crate::auth::TENANT_HEADER`]). The client is
//! [`crate::mcp_client`]'s, as the command line's; a call cancelled here is
//! cancelled on the peer too.

use std::sync::Arc;
use std::time::Duration;

use rmcp::model::{CallToolRequestParams, CallToolResult, JsonObject};
use tokio_util::sync::CancellationToken;

use super::{host_of, named_ids, Cluster, ClusterError, FORWARDED_HEADER};
use crate::auth::{Principal, TENANT_HEADER};
use crate::mcp_client::{self, Client};

/// Where a tool call runs.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    /// On this host.
    Local,
    /// On the named peer, at this base URL.
    Forward {
        /// The peer's name.
        host: String,
        /// Its base URL.
        url: String,
    },
}

impl Cluster {
    /// Where a call of `tool` with `args` runs: here unless its ids name
    /// another host. `forwarded_by`: the host that forwarded this call, if
    /// any (it is not forwarded again).
    ///
    /// Errors: [`ClusterError::TwoHosts`], [`ClusterError::NoPeerAddress`],
    /// [`ClusterError::ForwardedTwice`] (another host in a call that was
    /// already forwarded).
    pub fn route(
        &self,
        tool: &str,
        args: Option<&JsonObject>,
        forwarded_by: Option<&str>,
    ) -> Result<Route, ClusterError> {
        // The host of the first id named (an id without one is this
        // host's); every other id must name the same host.
        let mut named: Option<(&str, &str)> = None;
        for id in named_ids(args) {
            let host = host_of(id).unwrap_or(&self.host);
            match named {
                Some((first_host, first)) if first_host != host => {
                    return Err(ClusterError::TwoHosts {
                        tool: tool.into(),
                        first: first.into(),
                        first_host: first_host.into(),
                        id: id.into(),
                        host: host.into(),
                    })
                }
                Some(_) => {}
                None => named = Some((host, id)),
            }
        }
        let Some((host, id)) = named.filter(|(h, _)| *h != self.host) else { return Ok(Route::Local) };
        if let Some(by) = forwarded_by {
            return Err(ClusterError::ForwardedTwice {
                id: id.into(),
                host: host.into(),
                this: self.host.clone(),
                by: by.into(),
            });
        }
        match self.peer(host) {
            Some(url) => Ok(Route::Forward { host: host.to_string(), url }),
            None => Err(ClusterError::NoPeerAddress { id: id.into(), host: host.into(), this: self.host.clone() }),
        }
    }

    /// Calls `request` on peer `host` at `url` over this host's MCP
    /// session with it (made on first use, made again once if it broke),
    /// marked as forwarded by this host. When `cancel` is cancelled (the
    /// caller cancelled its request here), the peer is sent the
    /// cancellation and the call ends.
    ///
    /// Errors: [`ClusterError::Peer`] when the peer cannot be reached or the
    /// call fails at the protocol level (a tool error is a result), or it
    /// was cancelled.
    pub async fn forward(
        &self,
        host: &str,
        url: &str,
        request: CallToolRequestParams,
        caller: &Principal,
        cancel: &CancellationToken,
    ) -> Result<CallToolResult, ClusterError> {
        let result = self.forward_once((host, url), request.clone(), caller, false, cancel).await;
        let result = match result {
            Err(_) if !cancel.is_cancelled() => self.forward_once((host, url), request, caller, true, cancel).await,
            other => other,
        };
        self.forwarded.observe(&self.peer_label(host, result.is_ok()), result.is_ok());
        result.map_err(|reason| ClusterError::Peer { host: host.into(), url: url.into(), reason })
    }

    async fn forward_once(
        &self,
        (host, url): (&str, &str),
        request: CallToolRequestParams,
        caller: &Principal,
        reconnect: bool,
        cancel: &CancellationToken,
    ) -> Result<CallToolResult, String> {
        let key = (host.to_string(), caller.name().to_string());
        let slot = {
            let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
            clients.entry(key.clone()).or_default().clone()
        };
        let client = {
            let mut session = slot.lock().await;
            match session.as_ref() {
                Some(c) if !reconnect && !c.is_transport_closed() => c.clone(),
                _ => match self.connect(url, caller).await {
                    Ok(c) => {
                        let c = Arc::new(c);
                        *session = Some(c.clone());
                        c
                    }
                    Err(e) => {
                        // A host that does not answer (ids from clients
                        // may name made-up hosts) keeps no slot: the map
                        // holds only hosts with a session. Removed while
                        // the slot is locked, so that no call's new session
                        // in it is dropped.
                        *session = None;
                        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
                        if clients.get(&key).is_some_and(|s| Arc::ptr_eq(s, &slot)) {
                            clients.remove(&key);
                        }
                        return Err(e);
                    }
                },
            }
        };
        mcp_client::call_tool(client.peer(), request, cancel.cancelled()).await.map_err(|e| e.to_string())
    }

    /// A new MCP session with the peer at `url`, acting for `caller`.
    async fn connect(&self, url: &str, caller: &Principal) -> Result<Client, String> {
        let headers = [(FORWARDED_HEADER, self.host.clone()), (TENANT_HEADER, caller.name().to_string())];
        let config = mcp_client::transport_config(&format!("{url}/mcp"), self.peer_key.as_deref(), headers)
            .map_err(|e| e.to_string())?;
        mcp_client::connect(self.http.clone(), config, Duration::from_secs(30)).await.map_err(|e| e.to_string())
    }
}

/// This host's MCP session with one peer, made on first use.
pub(super) type PeerClient = tokio::sync::Mutex<Option<Arc<Client>>>;

#[cfg(test)]
mod tests {
    use super::super::ClusterConfig;
    use super::*;

    fn cluster(peers: &[(&str, &str)], peer_url: Option<&str>) -> Cluster {
        let config = ClusterConfig {
            host_name: Some("h1".into()),
            peers: peers.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect(),
            peer_url: peer_url.map(str::to_string),
            ..Default::default()
        };
        Cluster::new(&config, None).unwrap()
    }

    fn args(pairs: &[(&str, &str)]) -> JsonObject {
        pairs.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(*v))).collect()
    }

    #[test]
    fn calls_route_by_the_hosts_their_ids_name() {
        let c = cluster(&[("h2", "http://10.0.0.2:5555/")], None);
        assert_eq!(c.route("sandbox_exec", None, None).unwrap(), Route::Local);
        assert_eq!(c.route("sandbox_exec", Some(&args(&[("sandbox_id", "sb-h1-3")])), None).unwrap(), Route::Local);
        assert_eq!(
            c.route("sandbox_exec", Some(&args(&[("sandbox_id", "sb-h2-3")])), None).unwrap(),
            Route::Forward { host: "h2".into(), url: "http://10.0.0.2:5555".into() }
        );
        assert_eq!(
            c.route("sandbox_process_wait", Some(&args(&[("process_id", "sb-h2-3:p1")])), None).unwrap(),
            Route::Forward { host: "h2".into(), url: "http://10.0.0.2:5555".into() }
        );
        let e = c.route("sandbox_exec", Some(&args(&[("sandbox_id", "sb-h3-3")])), None).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("sb-h3-3 is on host h3; this is host h1, which has no address for h3"), "{e}");
        let e =
            c.route("sandbox_diff", Some(&args(&[("a", "sb-h1-1"), ("b", "sb-h2-2")])), None).unwrap_err().to_string();
        assert!(e.contains("two hosts") && e.contains("sb-h2-2 on h2"), "{e}");
        let e = c.route("sandbox_exec", Some(&args(&[("sandbox_id", "sb-h2-3")])), Some("h3")).unwrap_err().to_string();
        assert!(e.contains("forwarded once at most") && e.contains("from h3"), "{e}");
        assert_eq!(c.own_peer_host(), None);
        let t = cluster(&[], Some("http://{host}.peers:5555"));
        assert_eq!(t.own_peer_host().as_deref(), Some("h1.peers"));
        assert_eq!(
            t.route("sandbox_kill", Some(&args(&[("sandbox_id", "sb-h9-1")])), None).unwrap(),
            Route::Forward { host: "h9".into(), url: "http://h9.peers:5555".into() }
        );
        // A numeric host part is no host: the call stays here (where the
        // id is unknown), and no URL is made from it.
        for id in ["sb-2130706433-a1b2c3d4e5f6", "sb-0x7f000001-a1b2c3d4e5f6:p1"] {
            let key = if id.contains(":p") { "process_id" } else { "sandbox_id" };
            assert_eq!(t.route("sandbox_exec", Some(&args(&[(key, id)])), None).unwrap(), Route::Local, "{id}");
        }
    }

    /// Calls for hosts that do not answer (clients make host names up)
    /// leave no session slot behind: the slots stay as many as the hosts
    /// that answered.
    #[tokio::test]
    async fn hosts_that_do_not_answer_leave_no_sessions() {
        let c = cluster(&[], Some("http://{host}.peers:5555"));
        // A loopback port nothing listens on: connections are refused at once.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let url = format!("http://127.0.0.1:{closed}");
        for n in 0..20 {
            let request = CallToolRequestParams::new("sandbox_exec");
            let e = c
                .forward(&format!("made-up-{n}"), &url, request, &Principal::Admin, &CancellationToken::new())
                .await
                .unwrap_err();
            assert!(matches!(e, ClusterError::Peer { .. }), "{e}");
        }
        let slots = c.clients.lock().unwrap().len();
        assert_eq!(slots, 0, "20 calls for made-up hosts left {slots} session slots");
    }
}
