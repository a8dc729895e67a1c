//! A preview request's way to the guest: which preview a request is for
//! ([`target`]), its token or cookie checked, then HTTP/1.1 to the guest's
//! port over a connection from the sandbox's network
//! (`tine_sandbox::Manager::connect_port`), kept for the next request
//! ([`super::upstream`]).
//!
//! Headers that belong to one connection (RFC 9110 §7.6.1) are not passed
//! on, but an upgrade (RFC 9110 §7.8: WebSockets, RFC 6455 §4) is: the
//! guest's `101` is answered to the client and the two connections are
//! spliced until both close. Bodies are streamed both ways (chunked,
//! Server-Sent Events) under [`super::PreviewConfig`]'s size limits; the
//! server holds a few frames of each at a time. The guest sees
//! `X-Forwarded-For`, `-Proto`, `-Host` (and `-Prefix` for a path-based
//! URL), and `Host: localhost:<port>` unless `rewrite_host` is off.
//! Refusals are small HTML pages that say what to do.
//!
//! Previews of different sandboxes (and tenants) must not reach each
//! other through the browser, so some of what passes is changed
//! ([`scrub_request`], [`scrub_response`]):
//!
//! - the token never reaches the guest: not in the target (the host
//!   form's `tine_preview_token` is taken out of the query, the path
//!   form's `/preview/<id>.<token>` prefix is cut), not in
//!   `X-Forwarded-Prefix` (`/preview/<id>`, without the token: absolute
//!   links an app builds from it work for public URLs only; relative ones
//!   keep the token), not in a `Referer` of a path URL of any preview
//!   (its token is cut, and a host URL's `tine_preview_token` taken out),
//!   and no other request header that holds it is passed on; the
//!   server's cookie (and its name before `__Host-`, `tine_preview`) is
//!   taken out of `Cookie`;
//! - path form: every path preview shares the server's origin (RFC 6454),
//!   so the guest's `Set-Cookie` (a cookie with `Path=/` would reach every
//!   other preview and the server) and `Service-Worker-Allowed` (a worker
//!   whose scope is `/` sees every request to the origin, other previews'
//!   tokens in their paths and signed `/files` URLs among them) are taken
//!   out of its responses;
//! - host form: each preview is its own origin but all are one site (the
//!   preview domain), so a guest's `Set-Cookie` loses its `Domain`
//!   attribute (it stays a host-only cookie of that preview, RFC 6265
//!   §5.3 step 6: none can plant a cookie on the others), and the
//!   server's own cookie is `__Host-tine_preview` (RFC 6265bis §4.1.3.2:
//!   `Secure`, `Path=/`, no `Domain`), which a sibling host cannot set or
//!   shadow. Browsers keep a `Secure` cookie only over https or from
//!   `localhost` and `*.localhost` (Chromium, Firefox), so a token URL of
//!   the host form needs one of those; a cookie a guest's script sets
//!   with `document.cookie` and `domain=` is beyond the proxy (an
//!   operator's preview domain on the Public Suffix List stops it).

use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, Version};
use axum::response::{IntoResponse, Response};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tine_sandbox::network::InboundError;
use tine_sandbox::SandboxError;

use super::store::{is_id, now_ms, tag_of, Preview};
use super::{Dispatch, UrlForms, COOKIE, OLD_COOKIE, PATH_PREFIX, TOKEN_PARAM};

/// Which preview a request is for, and how it named it.
#[derive(Debug, PartialEq, Eq)]
pub struct Target {
    /// The preview id.
    pub id: String,
    /// The URL's form.
    pub form: Form,
}

/// How a request named its preview.
#[derive(Debug, PartialEq, Eq)]
pub enum Form {
    /// By `Host`: `<id>.<domain>`.
    Host,
    /// By path: `/preview/<id>[.<token>]`, `prefix` bytes of the path.
    Path {
        /// The token in the path, if any.
        token: Option<String>,
        /// Bytes of the path that name the preview (`/preview/<segment>`).
        prefix: usize,
    },
}

/// The host a request was sent to, as sent, without a port or a final
/// dot: `Host` (HTTP/1.1) or the URI's authority (HTTP/2's
/// `:authority`).
fn request_host(req: &Request) -> Option<&str> {
    let raw = req.headers().get(header::HOST).and_then(|v| v.to_str().ok()).or(req.uri().host())?;
    let host = match raw.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => raw,
    };
    Some(host.trim_end_matches('.'))
}

/// The preview `req` is for, if any: a `Host` of `<id>.<domain>` when
/// host-based URLs are on, a path under [`PATH_PREFIX`] when path-based
/// ones are. Every request passes here: nothing is allocated unless it
/// names a preview.
pub fn target(forms: &UrlForms, req: &Request) -> Option<Target> {
    if let Some((_, domain, _)) = &forms.host {
        // `<id>.<domain>`, any case (`domain` is kept in lower case).
        let label = request_host(req).and_then(|host| {
            let cut = host.len().checked_sub(domain.len() + 1)?;
            let (label, rest) = (host.get(..cut)?, host.get(cut..)?);
            let rest = rest.strip_prefix('.')?;
            rest.eq_ignore_ascii_case(domain).then_some(label)
        });
        if let Some(id) = label.map(str::to_ascii_lowercase).filter(|id| is_id(id)) {
            return Some(Target { id, form: Form::Host });
        }
    }
    if forms.path {
        let rest = req.uri().path().strip_prefix(PATH_PREFIX)?;
        let segment = rest.split('/').next().unwrap_or_default();
        let (id, token) = match segment.split_once('.') {
            Some((id, token)) => (id, Some(token.to_string())),
            None => (segment, None),
        };
        if is_id(id) {
            return Some(Target {
                id: id.to_string(),
                form: Form::Path { token, prefix: PATH_PREFIX.len() + segment.len() },
            });
        }
    }
    None
}

/// The URL a preview is reached at, with its token when it is not public:
/// host-based when `host` is set, else path-based under `base`.
pub fn url(forms: &UrlForms, p: &Preview, token: Option<&str>, host_form: bool, base: &str) -> String {
    match (&forms.host, host_form) {
        (Some((scheme, domain, port)), true) => {
            let port = port.map(|p| format!(":{p}")).unwrap_or_default();
            let query = token.map(|t| format!("?{TOKEN_PARAM}={t}")).unwrap_or_default();
            format!("{scheme}://{}.{domain}{port}/{query}", p.preview_id)
        }
        _ => {
            let token = token.map(|t| format!(".{t}")).unwrap_or_default();
            format!("{}{PATH_PREFIX}{}{token}/", base.trim_end_matches('/'), p.preview_id)
        }
    }
}

/// A small HTML page (`Cache-Control: no-store`).
pub fn page(status: StatusCode, title: &str, message: &str) -> Response {
    let esc = |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;");
    let body = format!(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{t}</title></head>\n<body><h1>{t}</h1>\n<p>{m}</p>\n\
         <p><small>tine preview, {s}</small></p></body></html>\n",
        t = esc(title),
        m = esc(message),
        s = status.as_u16()
    );
    (status, [(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-store")], body)
        .into_response()
}

pub(super) fn not_found() -> Response {
    page(
        StatusCode::NOT_FOUND,
        "No such preview",
        "This preview URL was revoked, expired, or its sandbox is gone. Ask the agent for a new one \
         (sandbox_preview_url).",
    )
}

/// The value of cookie `name` in `headers` (RFC 6265 §5.4's `Cookie`).
fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v)
}

/// `Cookie` without the pairs named in `names`; `None` when nothing is
/// left.
fn cookie_without(headers: &HeaderMap, names: &[&str]) -> Option<HeaderValue> {
    let kept: Vec<&str> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|pair| !pair.is_empty() && pair.split_once('=').is_none_or(|(n, _)| !names.contains(&n)))
        .collect();
    if kept.is_empty() {
        return None;
    }
    HeaderValue::from_str(&kept.join("; ")).ok()
}

/// The query without [`TOKEN_PARAM`], and the token if it was there.
fn split_token(query: Option<&str>) -> (Option<String>, Option<String>) {
    let Some(q) = query else { return (None, None) };
    let mut token = None;
    let kept: Vec<&str> = q
        .split('&')
        .filter(|pair| match pair.split_once('=') {
            Some((TOKEN_PARAM, v)) => {
                token = Some(v.to_string());
                false
            }
            _ => *pair != TOKEN_PARAM,
        })
        .collect();
    let rest = if kept.is_empty() { None } else { Some(kept.join("&")) };
    (rest, token)
}

/// `Set-Cookie` value `v` without its `Domain` attribute (any case, with
/// its value; RFC 6265 §5.2.3), the rest byte for byte: the cookie is then
/// host-only (§5.3 step 6). Attributes are separated by `;`, which no
/// cookie value holds (§4.1.1).
fn without_domain(v: &HeaderValue) -> Option<HeaderValue> {
    let mut out = Vec::with_capacity(v.len());
    for (i, part) in v.as_bytes().split(|b| *b == b';').enumerate() {
        if i > 0 {
            let name = part.split(|b| *b == b'=').next().unwrap_or_default().trim_ascii();
            if name.eq_ignore_ascii_case(b"domain") {
                continue;
            }
            out.push(b';');
        }
        out.extend_from_slice(part);
    }
    HeaderValue::from_bytes(&out).ok()
}

/// A `Referer` without preview tokens: a path URL's
/// `/preview/<id>.<token>` becomes `/preview/<id>`, a host URL's
/// `tine_preview_token` leaves its query. `None` for one that is not an
/// absolute URI (it is not passed on: it might hold a token).
fn referer_without_tokens(v: &str) -> Option<String> {
    let uri: Uri = v.parse().ok()?;
    let (scheme, authority) = (uri.scheme_str()?, uri.authority()?);
    let mut path = uri.path().to_string();
    if let Some(rest) = path.strip_prefix(PATH_PREFIX) {
        let segment = rest.split('/').next().unwrap_or_default();
        if let Some((id, _)) = segment.split_once('.') {
            path = format!("{PATH_PREFIX}{id}{}", &rest[segment.len()..]);
        }
    }
    let query = split_token(uri.query()).0.map(|q| format!("?{q}")).unwrap_or_default();
    Some(format!("{scheme}://{authority}{path}{query}"))
}

/// What a request brings that must not reach the guest: a `Referer`'s
/// preview tokens ([`referer_without_tokens`]) and any header whose
/// value holds `token` (this preview's).
fn scrub_request(headers: &mut HeaderMap, token: Option<&str>) {
    let referers: Vec<HeaderValue> = headers
        .get_all(header::REFERER)
        .iter()
        .filter_map(|v| v.to_str().ok().and_then(referer_without_tokens))
        .filter_map(|r| HeaderValue::from_str(&r).ok())
        .collect();
    headers.remove(header::REFERER);
    for r in referers {
        headers.append(header::REFERER, r);
    }
    let Some(token) = token.filter(|t| !t.is_empty()) else { return };
    let holding: Vec<HeaderName> = headers
        .iter()
        .filter(|(_, v)| v.as_bytes().windows(token.len()).any(|w| w == token.as_bytes()))
        .map(|(n, _)| n.clone())
        .collect();
    for n in holding {
        headers.remove(n);
    }
}

/// What a guest's response may not bring to the browser: under the path
/// form (one origin for all) its `Set-Cookie` and `Service-Worker-Allowed`;
/// under the host form its cookies' `Domain` ([`without_domain`]).
fn scrub_response(headers: &mut HeaderMap, form: &Form) {
    match form {
        Form::Path { .. } => {
            headers.remove(header::SET_COOKIE);
            headers.remove("service-worker-allowed");
        }
        Form::Host => {
            let cookies: Vec<HeaderValue> =
                headers.get_all(header::SET_COOKIE).iter().filter_map(without_domain).collect();
            headers.remove(header::SET_COOKIE);
            for c in cookies {
                headers.append(header::SET_COOKIE, c);
            }
        }
    }
}

/// Whether `host` (no port) is one browsers count as secure over plain
/// http for cookies: `localhost`, `*.localhost` (RFC 6761 §6.3), a
/// loopback address.
fn is_localhost(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']').to_ascii_lowercase();
    host == "localhost"
        || host.ends_with(".localhost")
        || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Whether a header belongs to one connection (RFC 9110 §7.6.1), with
/// those the request's `Connection` names.
fn hop_by_hop(name: &HeaderName, connection: &[String]) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    ) || connection.iter().any(|c| c.eq_ignore_ascii_case(name.as_str()))
}

/// The tokens of the `Connection` headers, lower case.
fn connection_tokens(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect()
}

/// Whether a request or response asks to switch protocols.
fn is_upgrade(headers: &HeaderMap) -> bool {
    connection_tokens(headers).iter().any(|t| t == "upgrade") && headers.contains_key(header::UPGRADE)
}

/// A request's end-to-end headers, to pass on: hop-by-hop ones out, but
/// an upgrade's `Connection: upgrade` and `Upgrade` kept.
pub(super) fn end_to_end(headers: &HeaderMap) -> HeaderMap {
    let connection = connection_tokens(headers);
    let mut out = HeaderMap::new();
    for (name, value) in headers {
        if !hop_by_hop(name, &connection) {
            out.append(name.clone(), value.clone());
        }
    }
    if is_upgrade(headers) {
        out.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        for v in headers.get_all(header::UPGRADE) {
            out.append(header::UPGRADE, v.clone());
        }
    }
    out
}

/// Takes a response's hop-by-hop headers out (not for a `101`, whose
/// `Connection` and `Upgrade` the client needs).
pub(super) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let connection = connection_tokens(headers);
    let names: Vec<HeaderName> = headers.keys().filter(|n| hop_by_hop(n, &connection)).cloned().collect();
    for n in names {
        headers.remove(n);
    }
}

/// Answers a request for preview `target`: the preview's checks, then the
/// guest's answer.
pub async fn serve(d: &Dispatch, target: Target, req: Request) -> Response {
    let Some(p) = d.previews.store.get(&target.id) else {
        if tag_of(&target.id) != d.previews.store.tag() {
            return super::peer::pass_on(d, &target.id, req).await;
        }
        return not_found();
    };
    if d.manager.tenant_of(&p.sandbox_id).is_none() {
        // Its sandbox is gone: so is the preview.
        let _ = d.previews.store.forget_gone(|s| s != p.sandbox_id);
        return not_found();
    }
    // A path-based URL without the slash after its prefix: relative URLs
    // in the page would resolve outside it.
    if let Form::Path { prefix, .. } = &target.form {
        if req.uri().path().len() == *prefix {
            let q = req.uri().query().map(|q| format!("?{q}")).unwrap_or_default();
            let to = format!("{}/{q}", req.uri().path());
            return (StatusCode::PERMANENT_REDIRECT, [(header::LOCATION, to)]).into_response();
        }
    }
    let (query, url_token) = split_token(req.uri().query());
    if !p.public {
        let grant = d.auth.url_grant(p.tenant.as_deref());
        let now = now_ms() / 1000;
        let refused =
            |e: &dyn std::fmt::Display| page(StatusCode::UNAUTHORIZED, "This preview needs its token", &format!("{e}"));
        match &target.form {
            Form::Path { token, .. } => match token {
                Some(t) => {
                    if let Err(e) = d.previews.tokens.verify(t, &p, &grant, now) {
                        return refused(&e);
                    }
                }
                None => return refused(&"open the whole URL sandbox_preview_url gave (it carries a token)"),
            },
            Form::Host => match (url_token.as_deref(), cookie(req.headers(), COOKIE)) {
                (Some(t), _) => {
                    if let Err(e) = d.previews.tokens.verify(t, &p, &grant, now) {
                        return refused(&e);
                    }
                    if req.method() == Method::GET || req.method() == Method::HEAD {
                        return exchange(&p, t, req.uri().path(), query.as_deref());
                    }
                }
                (None, Some(c)) => {
                    if let Err(e) = d.previews.tokens.verify(c, &p, &grant, now) {
                        return refused(&e);
                    }
                }
                (None, None) => {
                    let plain = !secure(&d.previews.forms, &req) && !request_host(&req).is_some_and(is_localhost);
                    return refused(if plain {
                        &"open the whole URL sandbox_preview_url gave (it carries a token); if you did, this browser \
                          dropped the preview's cookie, which needs https (or a *.localhost name): ask the operator \
                          for https preview URLs or a public one"
                    } else {
                        &"open the whole URL sandbox_preview_url gave (it carries a token)"
                    });
                }
            },
        }
    }
    // The token checked above, to keep from the guest (a public URL's
    // has not been checked: it may be any string, and opens nothing).
    let token = match &target.form {
        _ if p.public => None,
        Form::Path { token, .. } => token.clone(),
        Form::Host => url_token.or_else(|| cookie(req.headers(), COOKIE).map(str::to_string)),
    };
    forward(d, &p, &target.form, query, token.as_deref(), req).await
}

/// Whether the client reached the server over TLS: the URL's scheme, or a
/// TLS proxy's `X-Forwarded-Proto`.
fn secure(forms: &UrlForms, req: &Request) -> bool {
    let forwarded = req.headers().get("x-forwarded-proto").and_then(|v| v.to_str().ok());
    forwarded == Some("https") || forms.host.as_ref().is_some_and(|(scheme, ..)| scheme == "https")
}

/// The token in the URL for a cookie: `303` to the same path and query
/// without the token, setting an HttpOnly, SameSite=Lax, host-only cookie
/// (no `Domain`: RFC 6265 §5.3 step 6) that lasts as long as the preview,
/// named [`COOKIE`] (`__Host-`: `Secure` and `Path=/` as RFC 6265bis
/// §4.1.3.2 asks; browsers keep it from https and from `*.localhost` over
/// http).
fn exchange(p: &Preview, token: &str, path: &str, query: Option<&str>) -> Response {
    let max_age = p.expires_at_ms.saturating_sub(now_ms()) / 1000;
    let cookie = format!("{COOKIE}={token}; Path=/; Max-Age={max_age}; HttpOnly; SameSite=Lax; Secure");
    let location = match query {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    (
        StatusCode::SEE_OTHER,
        [(header::LOCATION, location), (header::SET_COOKIE, cookie), (header::CACHE_CONTROL, "no-store".into())],
    )
        .into_response()
}

/// Why a request did not reach the guest, as a page.
fn unreachable(p: &Preview, e: &SandboxError) -> Response {
    let (status, title) = match e {
        SandboxError::NotFound(_) => return not_found(),
        SandboxError::Inbound(InboundError::Busy) => (StatusCode::SERVICE_UNAVAILABLE, "The sandbox is busy"),
        SandboxError::Timeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "The sandbox did not wake in time"),
        _ => (StatusCode::BAD_GATEWAY, "The sandbox cannot be reached"),
    };
    page(status, title, &format!("Port {} of sandbox {}: {e}", p.port, p.sandbox_id))
}

/// The page for a guest that gave no HTTP response on the port.
fn nothing_listening(p: &Preview, e: &dyn std::fmt::Display) -> Response {
    page(
        StatusCode::BAD_GATEWAY,
        &format!("Nothing answers on port {}", p.port),
        &format!(
            "Sandbox {} has no server answering HTTP on port {} ({e}). Start one that listens on 0.0.0.0:{} (a server \
             bound to 127.0.0.1 cannot be reached from outside the sandbox), then reload.",
            p.sandbox_id, p.port, p.port
        ),
    )
}

/// The request as the guest gets it: its URI,
/// `http://<sandbox_id>:<port>/<target>` (the pool's key is the sandbox
/// and port; the guest sees the origin form), and its headers: end-to-end
/// ones ([`end_to_end`]), the preview cookie out, no token
/// ([`scrub_request`] with the URL's `token`), `Host` and
/// `X-Forwarded-*`; `None` when the target is not a valid URI.
fn guest_request(
    d: &Dispatch,
    p: &Preview,
    form: &Form,
    query: Option<String>,
    token: Option<&str>,
    parts: &axum::http::request::Parts,
) -> Option<(Uri, HeaderMap)> {
    let path = match form {
        Form::Host => parts.uri.path(),
        Form::Path { prefix, .. } => parts.uri.path().get(*prefix..).filter(|r| r.starts_with('/')).unwrap_or("/"),
    };
    let query = query.map(|q| format!("?{q}")).unwrap_or_default();
    let uri: Uri = format!("http://{}:{}{path}{query}", p.sandbox_id, p.port).parse().ok()?;
    let mut headers = end_to_end(&parts.headers);
    headers.remove(header::HOST);
    headers.remove(header::COOKIE);
    // Ours replace the client's, but a TLS proxy's X-Forwarded-Proto.
    let theirs: Vec<HeaderName> = headers
        .keys()
        .filter(|n| n.as_str().starts_with("x-forwarded-") && *n != "x-forwarded-proto")
        .cloned()
        .collect();
    for n in theirs {
        headers.remove(n);
    }
    if let Some(c) = cookie_without(&parts.headers, &[COOKIE, OLD_COOKIE]) {
        headers.insert(header::COOKIE, c);
    }
    scrub_request(&mut headers, token);
    let original_host = request_host_of(parts);
    let host = if d.previews.config.rewrite_host { format!("localhost:{}", p.port) } else { original_host.clone() };
    headers.insert(header::HOST, HeaderValue::from_str(&host).ok()?);
    if let Some(v) = forwarded_for(&parts.headers, &parts.extensions) {
        headers.insert("x-forwarded-for", v);
    }
    if !headers.contains_key("x-forwarded-proto") {
        let proto = match &d.previews.forms.host {
            Some((scheme, ..)) if matches!(form, Form::Host) => scheme.as_str(),
            _ => "http",
        };
        headers.insert("x-forwarded-proto", HeaderValue::from_str(proto).ok()?);
    }
    if !original_host.is_empty() {
        headers.insert("x-forwarded-host", HeaderValue::from_str(&original_host).ok()?);
    }
    if let Form::Path { .. } = form {
        // Without the token (the module's doc says why).
        headers.insert("x-forwarded-prefix", HeaderValue::from_str(&format!("{PATH_PREFIX}{}", p.preview_id)).ok()?);
    }
    Some((uri, headers))
}

/// `X-Forwarded-For` as passed on: the client's chain with the client's
/// address (from [`ConnectInfo`]) appended, or the chain as it came.
pub(super) fn forwarded_for(headers: &HeaderMap, extensions: &axum::http::Extensions) -> Option<HeaderValue> {
    let before = headers.get("x-forwarded-for").and_then(|v| v.to_str().ok());
    let chain = match (before, extensions.get::<ConnectInfo<std::net::SocketAddr>>()) {
        (Some(b), Some(ConnectInfo(peer))) => format!("{b}, {}", peer.ip()),
        (None, Some(ConnectInfo(peer))) => peer.ip().to_string(),
        (Some(b), None) => b.to_string(),
        (None, None) => return None,
    };
    HeaderValue::from_str(&chain).ok()
}

/// `Host` as the client sent it (with its port), or the URI's authority.
fn request_host_of(parts: &axum::http::request::Parts) -> String {
    parts
        .headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| parts.uri.authority().map(|a| a.to_string()))
        .unwrap_or_default()
}

/// A response body that holds the request's place (and so its guest
/// connection's) until it ends.
struct Placed {
    body: http_body_util::Limited<hyper::body::Incoming>,
    _place: tokio::sync::OwnedSemaphorePermit,
}

impl http_body::Body for Placed {
    type Data = bytes::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Sends the request to the guest over a pooled connection
/// ([`super::upstream`]) and answers its response (or its `101` and the
/// splice).
async fn forward(
    d: &Dispatch,
    p: &Preview,
    form: &Form,
    query: Option<String>,
    token: Option<&str>,
    req: Request,
) -> Response {
    let (mut parts, body) = req.into_parts();
    let max_request = d.previews.max_request_bytes();
    let declared =
        parts.headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max_request) {
        return page(
            StatusCode::PAYLOAD_TOO_LARGE,
            "Request too large",
            &format!(
                "This server passes request bodies of at most {} MiB to a sandbox ([preview] max_request_mib).",
                d.previews.config.max_request_mib
            ),
        );
    }
    let Some((uri, headers)) = guest_request(d, p, form, query, token, &parts) else {
        return page(StatusCode::BAD_REQUEST, "Bad request", "the request's target or headers cannot be passed on");
    };
    let client_upgrade = parts.extensions.remove::<OnUpgrade>();
    let limited = http_body_util::Limited::new(body, usize::try_from(max_request).unwrap_or(usize::MAX));
    let Ok(mut request) =
        axum::http::Request::builder().method(parts.method).uri(uri).version(Version::HTTP_11).body(Body::new(limited))
    else {
        return page(StatusCode::BAD_REQUEST, "Bad request", "the request cannot be passed on");
    };
    *request.headers_mut() = headers;
    let place = match d.upstream.place(&p.sandbox_id, p.port).await {
        Ok(place) => place,
        Err(e) => {
            return page(StatusCode::SERVICE_UNAVAILABLE, "The sandbox is busy", &format!("Port {}: {e}", p.port))
        }
    };
    let mut response = match d.upstream.client().request(request).await {
        Ok(r) => r,
        Err(e) => {
            return match super::upstream::sandbox_error(&e) {
                Some(se) => unreachable(p, se),
                // Refused (the guest's reset closes the stream with no
                // byte), closed mid-request, or not HTTP: no answer.
                None => nothing_listening(p, &e),
            };
        }
    };
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client) = client_upgrade else {
            return page(
                StatusCode::BAD_GATEWAY,
                "Upgrade not possible",
                "the guest switched protocols on a request that cannot be upgraded (HTTP/2?)",
            );
        };
        let guest = hyper::upgrade::on(&mut response);
        let what = format!("preview upgrade to {}:{}", p.sandbox_id, p.port);
        tokio::spawn(async move {
            let r = crate::splice::splice(client, async { guest.await.map(TokioIo::new) }).await;
            tracing::debug!("{what} closed: {r:?}");
            drop(place);
        });
        let (mut parts, _) = response.into_parts();
        scrub_response(&mut parts.headers, form);
        return axum::http::Response::from_parts(parts, Body::empty());
    }
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    scrub_response(&mut parts.headers, form);
    let max_response = usize::try_from(d.previews.max_response_bytes()).unwrap_or(usize::MAX);
    let body = Placed { body: http_body_util::Limited::new(body, max_response), _place: place };
    axum::http::Response::from_parts(parts, Body::new(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forms(path: bool) -> UrlForms {
        UrlForms { host: Some(("https".into(), "preview.example.com".into(), None)), path }
    }

    fn req(host: &str, path: &str) -> Request {
        axum::http::Request::builder().uri(path).header(header::HOST, host).body(Body::empty()).unwrap()
    }

    #[test]
    fn the_host_or_the_path_names_the_preview() {
        let id = "0123456789ab";
        let t = target(&forms(false), &req(&format!("{id}.preview.example.com:8443"), "/x")).unwrap();
        assert_eq!(t, Target { id: id.into(), form: Form::Host });
        assert_eq!(
            target(&forms(false), &req(&format!("{}.Preview.Example.com.", id.to_uppercase()), "/")).map(|t| t.id),
            Some(id.into())
        );
        assert_eq!(target(&forms(false), &req("preview.example.com", "/")), None);
        assert_eq!(target(&forms(false), &req("x.0123456789ab.preview.example.com", "/")), None);
        assert_eq!(target(&forms(false), &req(&format!("{id}.example.com"), "/")), None);
        assert_eq!(
            target(&forms(false), &req("tine.example.com", &format!("/preview/{id}/"))),
            None,
            "path URLs are off"
        );
        let t = target(&forms(true), &req("tine.example.com", &format!("/preview/{id}.123.abcd/a/b?c"))).unwrap();
        assert_eq!(
            t,
            Target { id: id.into(), form: Form::Path { token: Some("123.abcd".into()), prefix: 9 + 12 + 9 } }
        );
        assert_eq!(target(&forms(true), &req("tine.example.com", "/preview/short/")), None);
        assert_eq!(target(&forms(true), &req("tine.example.com", "/mcp")), None);
    }

    #[test]
    fn urls_carry_the_token_where_their_form_keeps_it() {
        let p = Preview {
            preview_id: "0123456789ab".into(),
            sandbox_id: "sb-a".into(),
            port: 8000,
            tenant: None,
            public: false,
            created_at_ms: 0,
            expires_at_ms: 1,
        };
        let dev = UrlForms { host: Some(("http".into(), "localhost".into(), Some(5555))), path: true };
        assert_eq!(
            url(&dev, &p, Some("9.ff"), true, "http://h"),
            "http://0123456789ab.localhost:5555/?tine_preview_token=9.ff"
        );
        assert_eq!(url(&dev, &p, None, true, "http://h"), "http://0123456789ab.localhost:5555/");
        assert_eq!(url(&dev, &p, Some("9.ff"), false, "http://h/"), "http://h/preview/0123456789ab.9.ff/");
        assert_eq!(url(&forms(true), &p, None, true, ""), "https://0123456789ab.preview.example.com/");
    }

    #[test]
    fn the_token_and_the_cookie_never_reach_the_guest() {
        assert_eq!(split_token(Some("a=1&tine_preview_token=9.ff&b=2")), (Some("a=1&b=2".into()), Some("9.ff".into())));
        assert_eq!(split_token(Some("tine_preview_token=9.ff")), (None, Some("9.ff".into())));
        assert_eq!(split_token(Some("a")), (Some("a".into()), None));
        let mut h = HeaderMap::new();
        h.append(header::COOKIE, HeaderValue::from_static("a=1; __Host-tine_preview=9.ff; tine_preview=8.ee"));
        h.append(header::COOKIE, HeaderValue::from_static("b=2"));
        assert_eq!(cookie(&h, COOKIE), Some("9.ff"));
        assert_eq!(cookie_without(&h, &[COOKIE, OLD_COOKIE]).unwrap(), "a=1; b=2");
        let mut only = HeaderMap::new();
        only.insert(header::COOKIE, HeaderValue::from_static("__Host-tine_preview=9.ff"));
        assert_eq!(cookie_without(&only, &[COOKIE, OLD_COOKIE]), None);
        let mut old = HeaderMap::new();
        old.insert(header::COOKIE, HeaderValue::from_static("tine_preview=9.ff"));
        assert_eq!(cookie(&old, COOKIE), None, "the name before __Host- is not read");
    }

    #[test]
    fn a_guest_cookie_loses_its_domain_and_nothing_else() {
        let strip = |v: &'static str| without_domain(&HeaderValue::from_static(v)).unwrap();
        assert_eq!(strip("a=b; Domain=preview.example.com; Path=/"), "a=b; Path=/");
        assert_eq!(strip("a=b;domain=.Preview.Example.com;Secure"), "a=b;Secure");
        assert_eq!(strip("a=b; Path=/; HttpOnly; DOMAIN = x ; SameSite=Lax"), "a=b; Path=/; HttpOnly; SameSite=Lax");
        assert_eq!(strip("a=b; Domain"), "a=b");
        assert_eq!(strip("a=b; Domain=x; domain=y"), "a=b");
        assert_eq!(strip("domain=1; Path=/"), "domain=1; Path=/", "a cookie named domain keeps its name");
        assert_eq!(
            strip("a=b; Expires=Wed, 21 Oct 2026 07:28:00 GMT;  Path=/x"),
            "a=b; Expires=Wed, 21 Oct 2026 07:28:00 GMT;  Path=/x"
        );
        assert_eq!(strip("a=b; DomainX=1"), "a=b; DomainX=1");
    }

    #[test]
    fn a_path_guest_sets_no_cookie_and_no_wider_worker_a_host_guest_no_domain() {
        let mut h = HeaderMap::new();
        h.append(header::SET_COOKIE, HeaderValue::from_static("a=1; Domain=localhost; Path=/"));
        h.append(header::SET_COOKIE, HeaderValue::from_static("b=2; Path=/"));
        h.insert("service-worker-allowed", HeaderValue::from_static("/"));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html"));
        let mut host = h.clone();
        scrub_response(&mut host, &Form::Host);
        let cookies: Vec<_> = host.get_all(header::SET_COOKIE).iter().collect();
        assert_eq!(cookies, ["a=1; Path=/", "b=2; Path=/"]);
        assert_eq!(host["service-worker-allowed"], "/", "its own origin's");
        let mut path = h;
        scrub_response(&mut path, &Form::Path { token: None, prefix: 21 });
        assert_eq!(path.keys().collect::<Vec<_>>(), vec![header::CONTENT_TYPE]);
    }

    #[test]
    fn no_token_reaches_the_guest_in_a_header() {
        let id = "0123456789ab";
        assert_eq!(
            referer_without_tokens(&format!("http://h:5555/preview/{id}.9.ff/a/b?x=1")).unwrap(),
            format!("http://h:5555/preview/{id}/a/b?x=1")
        );
        assert_eq!(
            referer_without_tokens("http://abc.localhost:5555/p?tine_preview_token=9.ff&y=2").unwrap(),
            "http://abc.localhost:5555/p?y=2"
        );
        assert_eq!(
            referer_without_tokens(&format!("https://h/preview/{id}.7.aa")).unwrap(),
            format!("https://h/preview/{id}")
        );
        assert_eq!(referer_without_tokens("https://h/other/x.y/").unwrap(), "https://h/other/x.y/");
        assert_eq!(referer_without_tokens("/relative"), None);
        let mut h = HeaderMap::new();
        h.insert(header::REFERER, HeaderValue::from_str(&format!("http://h/preview/{id}.9.ff/")).unwrap());
        h.insert("x-original-uri", HeaderValue::from_static("/preview/0123456789ab.9.ff/x"));
        h.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
        scrub_request(&mut h, Some("9.ff"));
        assert_eq!(h[header::REFERER], format!("http://h/preview/{id}/"));
        assert!(!h.contains_key("x-original-uri"));
        assert_eq!(h[header::ACCEPT], "*/*");
        let mut bad = HeaderMap::new();
        bad.insert(header::REFERER, HeaderValue::from_static("not a url 9.ff"));
        scrub_request(&mut bad, None);
        assert!(bad.is_empty(), "a Referer that cannot be read is not passed on");
    }

    #[test]
    fn localhost_names_are_secure_for_cookies() {
        for h in ["localhost", "abc.LOCALHOST", "127.0.0.1", "[::1]"] {
            assert!(is_localhost(h), "{h}");
        }
        for h in ["preview.example.com", "localhost.example.com", "10.0.0.1"] {
            assert!(!is_localhost(h), "{h}");
        }
    }

    #[test]
    fn hop_by_hop_headers_stay_but_an_upgrade_is_seen() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, Upgrade, X-Private"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(is_upgrade(&h));
        let conn = connection_tokens(&h);
        assert!(hop_by_hop(&HeaderName::from_static("x-private"), &conn));
        assert!(hop_by_hop(&header::TRANSFER_ENCODING, &conn));
        assert!(!hop_by_hop(&header::CONTENT_TYPE, &conn));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        let passed = end_to_end(&h);
        assert_eq!(passed[header::CONNECTION], "upgrade");
        assert_eq!(passed[header::UPGRADE], "websocket");
        assert_eq!(passed[header::CONTENT_TYPE], "text/plain");
        assert!(!passed.contains_key("x-private") && !passed.contains_key("keep-alive"));
        let mut response = h.clone();
        strip_hop_by_hop(&mut response);
        assert_eq!(response.keys().collect::<Vec<_>>(), vec![header::CONTENT_TYPE]);
        h.remove(header::UPGRADE);
        assert!(!is_upgrade(&h));
        assert!(!end_to_end(&h).contains_key(header::CONNECTION));
    }

    #[test]
    fn the_client_joins_the_forwarded_chain() {
        let mut ext = axum::http::Extensions::new();
        let mut h = HeaderMap::new();
        assert_eq!(forwarded_for(&h, &ext), None);
        h.insert("x-forwarded-for", HeaderValue::from_static("203.0.113.7"));
        assert_eq!(forwarded_for(&h, &ext).unwrap(), "203.0.113.7");
        ext.insert(ConnectInfo(std::net::SocketAddr::from(([10, 0, 0, 2], 4000))));
        assert_eq!(forwarded_for(&h, &ext).unwrap(), "203.0.113.7, 10.0.0.2");
        h.clear();
        assert_eq!(forwarded_for(&h, &ext).unwrap(), "10.0.0.2");
    }

    #[test]
    fn pages_escape_what_they_quote() {
        let r = page(StatusCode::BAD_GATEWAY, "t", "<script>");
        assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "text/html; charset=utf-8");
    }
}
