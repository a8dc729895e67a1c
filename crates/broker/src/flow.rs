//! One flow: both TLS handshakes, then HTTP/1.1 or HTTP/2 request by
//! request, each passed on with its placeholders swapped and its
//! response scrubbed of the values ([`crate::scrub`]).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_LENGTH, TRANSFER_ENCODING};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::server::{Acceptor, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::{LazyConfigAcceptor, TlsConnector};

use crate::authority;
use crate::budget::Held;
use crate::scrub;
use crate::swap::{swap_body, swap_head, MAX_SWAP_BODY};
use crate::{Broker, BrokerError, BrokerEvent, Flow, FlowHooks, HANDSHAKE_TIMEOUT, IDLE_TIMEOUT};

type Body = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// What one flow carried.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowStats {
    /// Requests passed on.
    pub requests: u64,
    /// Requests in which at least one value was swapped in.
    pub swapped: u64,
    /// Whether the flow spoke HTTP/2.
    pub http2: bool,
}

/// The leaf for the flow's one name, whatever the ClientHello asks.
#[derive(Debug)]
struct OneLeaf(Arc<CertifiedKey>);

impl ResolvesServerCert for OneLeaf {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// The upstream side of a flow's requests.
enum Upstream {
    Http1(tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<Body>>),
    Http2(hyper::client::conn::http2::SendRequest<Body>),
}

/// What each request of a flow shares.
struct Shared {
    name: String,
    /// The port the guest dialled.
    port: u16,
    hooks: Arc<dyn FlowHooks>,
    upstream: Upstream,
    requests: AtomicU64,
    swapped: AtomicU64,
}

async fn timed<T, E>(
    what: &'static str,
    f: impl std::future::Future<Output = Result<T, E>>,
    side: &'static str,
) -> Result<T, BrokerError>
where
    E: Into<std::io::Error>,
{
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, f).await {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(BrokerError::Io { side, source: e.into() }),
        Err(_) => Err(BrokerError::Timeout(what)),
    }
}

pub(crate) async fn serve<G, U>(broker: &Broker, guest: G, flow: Flow<U>) -> Result<FlowStats, BrokerError>
where
    G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    U: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Flow { name, port, upstream, hooks } = flow;
    // The guest's ClientHello first: its name and ALPN list.
    let start = timed("guest", LazyConfigAcceptor::new(Acceptor::default(), guest), "guest").await?;
    let hello = start.client_hello();
    let sni = hello.server_name().map(str::to_ascii_lowercase);
    if sni.as_deref() != Some(name.as_str()) {
        return Err(BrokerError::Misdirected { want: name, got: sni });
    }
    let offered: Vec<Vec<u8>> =
        hello.alpn().into_iter().flatten().filter(|p| *p == b"h2" || *p == b"http/1.1").map(<[u8]>::to_vec).collect();
    // The real host, offered what the guest offered.
    let mut client = (*broker.client).clone();
    client.alpn_protocols = offered;
    let server_name =
        ServerName::try_from(name.clone()).map_err(|e| BrokerError::Tls(rustls::Error::General(e.to_string())))?;
    let up = timed("upstream", TlsConnector::from(Arc::new(client)).connect(server_name, upstream), "upstream").await?;
    let proto = up.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
    // The guest gets the host's choice only.
    let leaf = broker.ca.leaf(&name)?;
    let mut server = rustls::ServerConfig::builder_with_provider(broker.provider.clone())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(OneLeaf(leaf)));
    server.alpn_protocols = proto.iter().cloned().collect();
    let guest = timed("guest", start.into_stream(Arc::new(server)), "guest").await?;
    let http2 = proto.as_deref() == Some(b"h2");
    let (guest, up) = (TokioIo::new(guest), TokioIo::new(up));
    let upstream = if http2 {
        let (send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new()).handshake(up).await?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("broker: upstream HTTP/2 connection: {e}");
            }
        });
        Upstream::Http2(send)
    } else {
        let (send, conn) = hyper::client::conn::http1::Builder::new().handshake(up).await?;
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!("broker: upstream HTTP/1.1 connection: {e}");
            }
        });
        Upstream::Http1(tokio::sync::Mutex::new(send))
    };
    let shared =
        Arc::new(Shared { name, port, hooks, upstream, requests: AtomicU64::new(0), swapped: AtomicU64::new(0) });
    let service = {
        let shared = shared.clone();
        hyper::service::service_fn(move |req| {
            let shared = shared.clone();
            async move { Ok::<_, Infallible>(handle(&shared, req).await) }
        })
    };
    if http2 {
        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .keep_alive_interval(Some(IDLE_TIMEOUT))
            .max_concurrent_streams(100)
            .serve_connection(guest, service)
            .await?;
    } else {
        hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(IDLE_TIMEOUT)
            .serve_connection(guest, service)
            .with_upgrades()
            .await?;
    }
    Ok(FlowStats {
        requests: shared.requests.load(Ordering::Relaxed),
        swapped: shared.swapped.load(Ordering::Relaxed),
        http2,
    })
}

/// A response of the broker's own.
fn own(status: StatusCode, text: &str) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(format!("tine broker: {text}\n"))).map_err(|e| match e {}).boxed());
    *r.status_mut() = status;
    r
}

/// Why [`read_body`] stopped.
enum BodyRead {
    /// Longer than [`MAX_SWAP_BODY`].
    TooLong,
    /// The sandbox's [`BodyBudget`] has no room for it.
    OverBudget,
    /// The guest's body failed (a reset stream, bad chunking).
    Failed(hyper::Error),
}

/// Reads `body` whole, at most [`MAX_SWAP_BODY`] bytes, each frame
/// reserved in `held` before it is kept. Trailers are dropped (the
/// swapped body goes on with a length).
async fn read_body(mut body: Incoming, held: &mut Held) -> Result<Vec<u8>, BodyRead> {
    let mut whole = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(BodyRead::Failed)?;
        let Ok(data) = frame.into_data() else { continue };
        if whole.len() + data.len() > MAX_SWAP_BODY {
            return Err(BodyRead::TooLong);
        }
        if !held.grow(data.len() as u64) {
            return Err(BodyRead::OverBudget);
        }
        whole.extend_from_slice(&data);
    }
    Ok(whole)
}

/// Passes one request on.
async fn handle(shared: &Shared, mut req: Request<Incoming>) -> Response<Body> {
    let method = req.method().to_string();
    let path = req.uri().path().to_string();
    let host = shared.name.clone();
    let event = |status: u16, swapped: Vec<String>| {
        shared.hooks.event(BrokerEvent::Request {
            method: method.clone(),
            host: host.clone(),
            path: path.clone(),
            status,
            swapped,
        })
    };
    // Every authority the request names must be the flow's (nothing of a
    // request that names another goes upstream).
    if let Err(e) = authority::check(req.uri(), req.headers(), &shared.name, shared.port) {
        shared.hooks.event(BrokerEvent::Misdirected { host: shared.name.clone(), authority: e.named() });
        event(421, Vec::new());
        return own(StatusCode::MISDIRECTED_REQUEST, &format!("this connection is for {}: {e}", shared.name));
    }
    let guest_upgrade = req.headers().contains_key(hyper::header::UPGRADE).then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    let bindings = shared.hooks.bindings();
    let swapped = match swap_head(&mut parts, &shared.name, &bindings) {
        Ok(s) => s,
        Err(secret) => {
            event(502, Vec::new());
            return own(StatusCode::BAD_GATEWAY, &format!("secret {secret}'s value cannot be sent in an HTTP header"));
        }
    };
    // The authority upstream is the broker's: the TLS name and the port.
    let http2 = matches!(shared.upstream, Upstream::Http2(_));
    if let Err(e) = authority::write(&mut parts, &shared.name, shared.port, http2) {
        event(502, Vec::new());
        return own(StatusCode::BAD_GATEWAY, &e.to_string());
    }
    if !swapped.leaked.is_empty() {
        shared.hooks.event(BrokerEvent::LeakBlocked { host: shared.name.clone(), secrets: swapped.leaked.clone() });
    }
    let scrubbing = match scrub::request(&mut parts, &bindings, &shared.hooks, &shared.name, &path) {
        Ok(s) => s,
        Err(e) => {
            event(502, Vec::new());
            return own(StatusCode::BAD_GATEWAY, &e.to_string());
        }
    };
    let mut names = swapped.swapped.clone();
    // What this request's body holds of the sandbox's budget, until its
    // answer's head is back (the body has gone by then).
    let mut held = None;
    let body: Body = if swapped.in_body.is_empty() {
        body.map_err(Into::into).boxed()
    } else {
        let budget = shared.hooks.body_budget();
        let whole = match read_body(body, held.insert(budget.reserve())).await {
            Ok(whole) => whole,
            Err(BodyRead::TooLong) => {
                event(413, Vec::new());
                return own(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &format!("a body in which a secret is swapped may be {MAX_SWAP_BODY} bytes at most"),
                );
            }
            Err(BodyRead::OverBudget) => {
                shared.hooks.event(BrokerEvent::BodyBudget { host: shared.name.clone(), limit: budget.limit() });
                event(503, Vec::new());
                let mut r = own(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!(
                        "the sandbox's requests hold {} bytes of bodies in which secrets are swapped, at most; \
                         retry when one has been answered",
                        budget.limit()
                    ),
                );
                r.headers_mut().insert(hyper::header::RETRY_AFTER, HeaderValue::from_static("1"));
                return r;
            }
            Err(BodyRead::Failed(e)) => {
                event(400, Vec::new());
                return own(StatusCode::BAD_REQUEST, &format!("the request's body could not be read: {e}"));
            }
        };
        let (new, more) = swap_body(&whole, &bindings, &swapped.in_body);
        names.extend(more.into_iter().filter(|m| !swapped.swapped.contains(m)));
        parts.headers.remove(TRANSFER_ENCODING);
        if !new.is_empty() || parts.headers.contains_key(CONTENT_LENGTH) {
            parts.headers.insert(CONTENT_LENGTH, HeaderValue::from(new.len()));
        }
        // The swapped copy replaces the one read: reserve the difference.
        let grown = (new.len() as u64).saturating_sub(whole.len() as u64);
        drop(whole);
        if let Some(h) = held.as_mut() {
            // Values longer than their placeholders; past the budget by
            // this little it is let go rather than refused midway.
            let _ = h.grow(grown);
        }
        Full::new(Bytes::from(new)).map_err(|e| match e {}).boxed()
    };
    let request = Request::from_parts(parts, body);
    let sent = match &shared.upstream {
        Upstream::Http1(send) => {
            let mut send = send.lock().await;
            match send.ready().await {
                Ok(()) => send.send_request(request).await,
                Err(e) => Err(e),
            }
        }
        Upstream::Http2(send) => send.clone().send_request(request).await,
    };
    shared.requests.fetch_add(1, Ordering::Relaxed);
    if !names.is_empty() {
        shared.swapped.fetch_add(1, Ordering::Relaxed);
    }
    let resp = match sent {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!("broker: {host}: the request failed upstream: {e}");
            event(502, names);
            let mut r = own(StatusCode::BAD_GATEWAY, &format!("{host} did not answer: {e}"));
            r.headers_mut().insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
            return r;
        }
    };
    drop(held);
    let mut resp = match scrub::response(scrubbing.as_ref(), resp) {
        Ok(r) => r,
        Err(e) => {
            // The host's body is left unread: its connection goes.
            event(502, names);
            let mut r = own(StatusCode::BAD_GATEWAY, &e.to_string());
            r.headers_mut().insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
            return r;
        }
    };
    event(resp.status().as_u16(), names);
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(guest_upgrade) = guest_upgrade {
            let up_upgrade = hyper::upgrade::on(&mut resp);
            let ws = scrubbing.as_ref().map(scrub::Scrub::websocket);
            tokio::spawn(async move {
                match tokio::try_join!(guest_upgrade, up_upgrade) {
                    Ok((g, u)) => scrub::splice(ws, TokioIo::new(g), TokioIo::new(u)).await,
                    Err(e) => tracing::debug!("broker: upgrade: {e}"),
                }
            });
        }
    }
    resp
}
