//! A session's requests sent to a host other than the session's are
//! passed on whole to that host (streams included), authenticated with
//! the peer key and carrying the caller's tenant.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::TryStreamExt;

use super::{session_host, Cluster, PROXIED_HEADER};
use crate::auth::{Principal, TENANT_HEADER};

/// Headers that belong to one connection (RFC 9110 §7.6.1) and are not
/// passed on by the proxy, with `Host` (the peer's own is sent).
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

/// A 404 for a session this host cannot serve: the Streamable HTTP
/// transport's answer to an unknown session (MCP 2025-11-25, "Session
/// Management": the client starts a new one), with why in a JSON-RPC error.
fn session_not_here(message: String) -> Response {
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {"code": -32001, "message": message},
    });
    (StatusCode::NOT_FOUND, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

/// Middleware before `/mcp`: a request whose `Mcp-Session-Id` names
/// another host goes to that host (once: not when it was forwarded to
/// this one), streamed both ways, its headers kept but hop-by-hop ones;
/// a session of a host this one cannot reach gets 404 saying whose it is.
pub async fn proxy_foreign_session(State(cluster): State<Arc<Cluster>>, req: Request, next: Next) -> Response {
    let Some(host) = req
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .and_then(session_host)
        .filter(|h| *h != cluster.host)
        .map(str::to_string)
    else {
        return next.run(req).await;
    };
    if let Some(by) = req.headers().get(PROXIED_HEADER).and_then(|v| v.to_str().ok()) {
        return session_not_here(format!(
            "session of host {host}, passed on here ({}) by {by}: a request is passed on once at most; check the \
             hosts' [cluster] peers",
            cluster.host
        ));
    }
    let Some(base) = cluster.peer(&host) else {
        return session_not_here(format!(
            "this session is on host {host}, and this host ({}) has no address for it ([cluster] peers or peer_url); \
             start a new session",
            cluster.host
        ));
    };
    let (parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/mcp");
    let caller = parts.extensions.get::<Principal>().cloned().unwrap_or(Principal::Admin);
    let mut headers = HeaderMap::new();
    for (name, value) in &parts.headers {
        // The caller's credential stays here; the peer key goes instead.
        if !hop_by_hop(name) && name != header::AUTHORIZATION && name.as_str() != TENANT_HEADER {
            headers.append(name.clone(), value.clone());
        }
    }
    if let Some(key) = &cluster.peer_key {
        if let Ok(v) = HeaderValue::from_str(&format!("Bearer {key}")) {
            headers.insert(header::AUTHORIZATION, v);
        }
    }
    if let Ok(v) = HeaderValue::from_str(caller.name()) {
        headers.insert(HeaderName::from_static(TENANT_HEADER), v);
    }
    let sent = cluster.pass_on(parts.method.clone(), format!("{base}{path}"), headers, body).await;
    let resp = match sent {
        Ok(r) => r,
        Err(e) => {
            cluster.forwarded.observe(&cluster.peer_label(&host, false), false);
            tracing::warn!("session of host {host}: {base} does not answer: {e}");
            return session_not_here(format!(
                "this session is on host {host}, which does not answer ({e}); its sandboxes are gone with it: start \
                 a new session"
            ));
        }
    };
    cluster.forwarded.observe(&host, true);
    let mut out = Response::builder().status(resp.status());
    for (name, value) in resp.headers() {
        if !hop_by_hop(name) {
            out = out.header(name, value);
        }
    }
    let stream = resp.bytes_stream().map_err(std::io::Error::other);
    out.body(Body::from_stream(stream)).unwrap_or_else(|e| {
        tracing::warn!("session of host {host}: bad answer from {base}: {e}");
        StatusCode::BAD_GATEWAY.into_response()
    })
}

impl Cluster {
    /// Sends a request to a peer's `url` as this host passes one on:
    /// `headers` and [`PROXIED_HEADER`] naming this host, `body` streamed.
    ///
    /// Errors: reqwest's, when the peer does not answer.
    pub(crate) async fn pass_on(
        &self,
        method: axum::http::Method,
        url: String,
        mut headers: HeaderMap,
        body: Body,
    ) -> Result<reqwest::Response, reqwest::Error> {
        if let Ok(v) = HeaderValue::from_str(&self.host) {
            headers.insert(HeaderName::from_static(PROXIED_HEADER), v);
        }
        self.http
            .request(method, url)
            .headers(headers)
            .body(reqwest::Body::wrap_stream(body.into_data_stream()))
            .send()
            .await
    }
}
