//! A preview request that reached another host than the preview's: passed
//! to the preview's host whole (method, target, headers with `Host`, body
//! streamed; an upgrade's `101` and the connection after it spliced), as
//! `crate::cluster::proxy_foreign_session` does for MCP sessions. The
//! preview id's tag ([`super::store::host_tag`]) says which host; only
//! hosts that `[cluster] peers` names, and those `[cluster] peer_dns`
//! finds (`crate::cluster::discovery`), are known by tag. The request
//! carries [`PROXIED_HEADER`], and one that already has it is not passed
//! on again. The token or cookie goes with it: the preview's host checks
//! it (the key is that host's).

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::Response;
use hyper::upgrade::OnUpgrade;

use super::proxy::{end_to_end, forwarded_for, page, strip_hop_by_hop};
use super::store::{host_tag, tag_of};
use super::Dispatch;
use crate::cluster::PROXIED_HEADER;

/// The one name of `names` whose tag is `tag`, if exactly one has it.
fn tagged<'a>(tag: &str, mut names: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let mut hosts = names.by_ref().filter(|h| host_tag(h) == tag);
    let host = hosts.next()?;
    hosts.next().is_none().then_some(host)
}

/// The host whose tag `id` carries and its base URL: among the named
/// peers, else among those `[cluster] peer_dns` finds (looked up again
/// once on a miss).
async fn host_for(d: &Dispatch, id: &str) -> Option<(String, String)> {
    let tag = tag_of(id);
    if let Some(host) = tagged(tag, d.cluster.named_peers()) {
        return Some((host.to_string(), d.cluster.peer(host)?));
    }
    for miss in [false, true] {
        let found = d.cluster.discovered_peers(miss).await;
        if let Some(host) = tagged(tag, found.iter().map(|f| f.name.as_str())) {
            let f = found.iter().find(|f| f.name == host)?;
            return Some((f.name.clone(), f.base.clone()));
        }
    }
    None
}

/// The headers passed on: the end-to-end ones ([`end_to_end`]), with the
/// client in `X-Forwarded-For`.
fn passed_headers(req: &Request) -> HeaderMap {
    let mut headers = end_to_end(req.headers());
    headers.remove("x-forwarded-for");
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
    let Some((host, base)) = host_for(d, id).await else {
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
    let mut headers = resp.headers().clone();
    if status != StatusCode::SWITCHING_PROTOCOLS {
        strip_hop_by_hop(&mut headers);
    }
    let mut out = Response::builder().status(status);
    if let Some(h) = out.headers_mut() {
        *h = headers;
    }
    if status == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client) = client_upgrade else {
            return page(StatusCode::BAD_GATEWAY, "Upgrade not possible", "this request cannot be upgraded (HTTP/2?)");
        };
        let what = format!("preview {id} upgrade through {host}");
        tokio::spawn(async move {
            let r = crate::splice::splice(client, resp.upgrade()).await;
            tracing::debug!("{what} closed: {r:?}");
        });
        return out.body(Body::empty()).unwrap_or_else(|_| super::proxy::not_found());
    }
    out.body(Body::from_stream(resp.bytes_stream())).unwrap_or_else(|_| super::proxy::not_found())
}
