//! A preview request that reached another host than the preview's: passed
//! to the preview's host whole (method, target, headers with `Host`, body
//! streamed; an upgrade's `101` and the connection after it spliced), as
//! `crate::cluster::proxy_foreign_session` does for MCP sessions. The
//! preview id's tag ([`super::store::host_tag`]) says which host; only
//! hosts that `[cluster] peers` names are known by tag. The request
//! carries [`PROXIED_HEADER`], and one that already has it is not passed
//! on again. The token or cookie goes with it: the preview's host checks
//! it (the key is that host's).

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

use super::proxy::{connection_tokens, forwarded_for, hop_by_hop, is_upgrade, page};
use super::store::{host_tag, tag_of};
use super::Dispatch;
use crate::cluster::PROXIED_HEADER;

/// The named peer whose tag `id` carries, if exactly one has it.
fn host_for(d: &Dispatch, id: &str) -> Option<String> {
    let tag = tag_of(id);
    let mut hosts = d.cluster.named_peers().filter(|h| host_tag(h) == tag);
    let host = hosts.next()?;
    hosts.next().is_none().then(|| host.to_string())
}

/// The headers passed on: all but hop-by-hop ones (an upgrade's kept),
/// with the client in `X-Forwarded-For`.
fn passed_headers(req: &Request) -> HeaderMap {
    let connection = connection_tokens(req.headers());
    let mut headers = HeaderMap::new();
    for (name, value) in req.headers() {
        if !hop_by_hop(name, &connection) && name != "x-forwarded-for" {
            headers.append(name.clone(), value.clone());
        }
    }
    if is_upgrade(req.headers()) {
        headers.insert(axum::http::header::CONNECTION, HeaderValue::from_static("upgrade"));
        for v in req.headers().get_all(axum::http::header::UPGRADE) {
            headers.append(axum::http::header::UPGRADE, v.clone());
        }
    }
    if let Some(v) = forwarded_for(req.headers(), req.extensions()) {
        headers.insert(HeaderName::from_static("x-forwarded-for"), v);
    }
    headers
}

/// Passes a request for preview `id`, which another host made, to that
/// host; a 404 page when this host cannot (no such peer, or the request
/// was passed on already), a 502 page when the peer does not answer.
pub async fn pass_on(d: &Dispatch, id: &str, mut req: Request) -> Response {
    if req.headers().contains_key(PROXIED_HEADER) {
        return super::proxy::not_found();
    }
    let Some(host) = host_for(d, id) else {
        return super::proxy::not_found();
    };
    let Some(base) = d.cluster.peer(&host) else {
        return super::proxy::not_found();
    };
    let target = req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/").to_string();
    let headers = passed_headers(&req);
    let client_upgrade = req.extensions_mut().remove::<OnUpgrade>();
    let (parts, body) = req.into_parts();
    let sent = d.cluster.pass_on(parts.method, format!("{base}{target}"), headers, body).await;
    let resp = match sent {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("preview {id} of host {host}: {base} does not answer: {e}");
            return page(
                StatusCode::BAD_GATEWAY,
                "The preview's host does not answer",
                &format!("This preview is served by host {host}, which does not answer now."),
            );
        }
    };
    let status = resp.status();
    let mut out = Response::builder().status(status);
    let connection = connection_tokens(resp.headers());
    for (name, value) in resp.headers() {
        if status == StatusCode::SWITCHING_PROTOCOLS || !hop_by_hop(name, &connection) {
            out = out.header(name, value);
        }
    }
    if status == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client) = client_upgrade else {
            return page(StatusCode::BAD_GATEWAY, "Upgrade not possible", "this request cannot be upgraded (HTTP/2?)");
        };
        let id = id.to_string();
        tokio::spawn(async move {
            match (client.await, resp.upgrade().await) {
                (Ok(client), Ok(mut remote)) => {
                    let mut client = TokioIo::new(client);
                    let r = tokio::io::copy_bidirectional(&mut client, &mut remote).await;
                    tracing::debug!(preview = %id, "preview upgrade through {host} closed: {r:?}");
                }
                (c, r) => {
                    tracing::debug!(preview = %id, "preview upgrade through {host} failed: {:?} {:?}", c.err(), r.err())
                }
            }
        });
        return out.body(Body::empty()).unwrap_or_else(|_| super::proxy::not_found());
    }
    out.body(Body::from_stream(resp.bytes_stream())).unwrap_or_else(|_| super::proxy::not_found())
}
