//! Port forwarding over the server's HTTP API: a raw TCP connection into a
//! sandbox's guest port, carried by an upgraded HTTP/1.1 connection
//! (RFC 9110 §7.8, as WebSockets do), so it passes the same listener,
//! TLS, proxy and bearer authentication as `/mcp` and works from another
//! machine.
//!
//! `GET /ports/{sandbox_id}/{port}` with `Connection: upgrade` and
//! `Upgrade: tine-port-forward` answers `101 Switching Protocols`; from
//! then on the connection's bytes are the guest connection's, both ways,
//! and a half-close is passed on as a FIN. The caller must own the sandbox
//! (the operator owns all). A hibernated or paused sandbox is woken first.
//! A guest that refuses the port closes the connection right after the
//! `101` with no byte. Refusals before the upgrade are JSON
//! (`{"error", "message"}`) with 400, 404, 421, 426 or 503, and 429 for
//! a tenant at its quota of requests open at once
//! ([`tine_sandbox::Quota::max_streams`]), which every open forward
//! counts against, as its MCP requests and SSE streams do
//! ([`crate::auth::sessions`]).
//!
//! `tine port-forward` (`crate::cli`) is the client.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use hyper::upgrade::OnUpgrade;
use tine_sandbox::{Manager, PortConnection, SandboxError};

use crate::auth::sessions::{streams_full, too_many, SessionOwners};
use crate::auth::Principal;
use crate::files_url::{refuse, sandbox_refusal, Refusal};

/// The `Upgrade` protocol token of a port forward.
pub const PROTOCOL: &str = "tine-port-forward";

/// The route's path, `{sandbox}` and `{port}` filled in.
pub fn path(sandbox: &str, port: u16) -> String {
    format!("/ports/{sandbox}/{port}")
}

#[derive(Clone)]
struct PortsState {
    manager: Arc<Manager>,
    /// This server's host name in a cluster (sandbox ids name their host).
    host: String,
    /// Where tenants' open requests are counted.
    owners: Arc<SessionOwners>,
}

/// `/ports/{sandbox}/{port}` (behind the bearer authentication layer);
/// open forwards are counted in `owners` against their tenant's quota.
pub fn routes(manager: Arc<Manager>, host: String, owners: Arc<SessionOwners>) -> Router {
    Router::new().route("/ports/{sandbox}/{port}", get(forward)).with_state(PortsState { manager, host, owners })
}

/// Whether the request asks to upgrade to [`PROTOCOL`].
fn wants_upgrade(headers: &HeaderMap) -> bool {
    let has = |name: header::HeaderName, token: &str| {
        headers
            .get_all(name)
            .iter()
            .any(|v| v.to_str().is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token))))
    };
    has(header::CONNECTION, "upgrade") && has(header::UPGRADE, PROTOCOL)
}

async fn forward(
    State(s): State<PortsState>,
    Path((sandbox, port)): Path<(String, u16)>,
    Extension(caller): Extension<Principal>,
    mut req: Request,
) -> Result<Response, Refusal> {
    if !wants_upgrade(req.headers()) {
        return Err(refuse(
            StatusCode::UPGRADE_REQUIRED,
            format!("a port forward is an HTTP/1.1 upgrade to {PROTOCOL}; use `tine port-forward`"),
        ));
    }
    match s.manager.tenant_of(&sandbox) {
        Some(owner) if caller.owns(owner.as_deref()) => {}
        Some(_) => return Err(sandbox_refusal(&SandboxError::NotFound(sandbox))),
        None => {
            return Err(match crate::cluster::host_of(&sandbox) {
                Some(host) if host != s.host => refuse(
                    StatusCode::MISDIRECTED_REQUEST,
                    format!("sandbox {sandbox} lives on host {host}: forward through that host's URL"),
                ),
                _ => sandbox_refusal(&SandboxError::NotFound(sandbox)),
            })
        }
    }
    // Counted from here until the forward closes.
    let slot = match caller.quota().map(|q| q.max_streams) {
        Some(max) => match s.owners.open_stream(caller.name(), max) {
            Ok(slot) => Some(slot),
            Err(open) => return Ok(too_many(streams_full(caller.name(), open, max))),
        },
        None => None,
    };
    let Some(on_upgrade) = req.extensions_mut().remove::<OnUpgrade>() else {
        return Err(refuse(StatusCode::UPGRADE_REQUIRED, "this connection cannot be upgraded (HTTP/2?); use HTTP/1.1"));
    };
    let conn = s.manager.connect_port(&sandbox, port).await.map_err(|e| match e {
        SandboxError::Inbound(tine_sandbox::network::InboundError::Port) => refuse(StatusCode::BAD_REQUEST, e),
        SandboxError::Inbound(tine_sandbox::network::InboundError::Busy) => refuse(StatusCode::SERVICE_UNAVAILABLE, e),
        e => sandbox_refusal(&e),
    })?;
    tracing::info!(sandbox = %sandbox, port, "port forward opened");
    tokio::spawn(async move {
        splice(on_upgrade, conn, sandbox, port).await;
        drop(slot);
    });
    let mut response = StatusCode::SWITCHING_PROTOCOLS.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(header::UPGRADE, HeaderValue::from_static(PROTOCOL));
    Ok(response)
}

/// Copies both ways between the upgraded client connection and the guest
/// connection until both directions are closed ([`crate::splice`]).
async fn splice(on_upgrade: OnUpgrade, conn: PortConnection, sandbox: String, port: u16) {
    use crate::splice::SpliceError;
    let (stream, lease) = conn.into_parts();
    let guest = async { stream.set_nonblocking(true).and_then(|()| tokio::net::UnixStream::from_std(stream)) };
    let result = crate::splice::splice(on_upgrade, guest).await;
    drop(lease);
    match result {
        Ok((up, down)) => tracing::info!(sandbox = %sandbox, port, up, down, "port forward closed"),
        Err(e @ SpliceError::Client(_)) => tracing::debug!(sandbox = %sandbox, port, "port forward: {e}"),
        Err(e @ SpliceError::Other(_)) => tracing::warn!(sandbox = %sandbox, port, "port forward: {e}"),
        Err(e @ SpliceError::Io(_)) => tracing::info!(sandbox = %sandbox, port, "port forward closed: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_upgrade_to_the_protocol_is_a_port_forward() {
        let mut h = HeaderMap::new();
        assert!(!wants_upgrade(&h));
        h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, Upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(!wants_upgrade(&h));
        h.insert(header::UPGRADE, HeaderValue::from_static("Tine-Port-Forward"));
        assert!(wants_upgrade(&h));
        h.remove(header::CONNECTION);
        assert!(!wants_upgrade(&h));
        assert_eq!(path("sb-a-b", 8080), "/ports/sb-a-b/8080");
    }
}
