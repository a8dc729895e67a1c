//! Connection hygiene: every connection, whatever its HTTP version, must
//! send its first request within a deadline and is closed when it carries
//! no request for too long, and one client address may be held to a number
//! of connections.
//!
//! Why the server needs this besides hyper's own timers: hyper-util's
//! `auto::Builder` first reads up to 24 bytes to tell the HTTP/2 preface
//! from HTTP/1, with no timer; hyper's HTTP/1 `header_read_timeout` starts
//! only after that; HTTP/2 has no such timeout at all, and its keep-alive
//! pings are answered by any client's HTTP/2 stack, so an HTTP/2
//! connection that never sends a request would live for ever. A
//! connection that sends nothing, or `PRI * HTTP/2.0\r\n` and nothing
//! more, would hold one of the server's `max_connections` slots until the
//! client goes away; a few hundred of them stop `/mcp` and `/healthz`.
//!
//! How: [`serve_connection`] wraps the application in [`Tracked`], a hyper
//! service that counts the requests it is given and the ones whose response
//! body is still open (an SSE stream counts until it ends), and publishes
//! them on a [`tokio::sync::watch`] channel. The connection's task races
//! hyper's connection future against a timer it sets from that count:
//!
//! - no request yet: the first one's headers (HTTP/1), or the preface,
//!   SETTINGS and first request's HEADERS (HTTP/2) must have arrived
//!   within [`ConnLimits::first_request`] of the accept;
//! - requests seen, none in progress: the connection may stay idle
//!   [`ConnLimits::idle`], or [`BUSY_IDLE`] while the server's slots run
//!   low ([`Pressure`]: more than 3/4 of them taken), so that keep-alive
//!   connections idle between requests (an unauthenticated `GET /healthz`
//!   client's, say) give their slots to clients waiting in the backlog;
//! - a request in progress (an SSE stream open included): no deadline.
//!
//! When the timer fires the connection is asked to close gracefully (an
//! HTTP/2 GOAWAY; an HTTP/1 or still-undetected connection closes at
//! once), and is dropped (its socket closed) if it has not closed
//! [`CLOSE_GRACE`] later with no request in progress.
//!
//! HTTP/1 keep-alive: hyper (1.12) arms its `header_read_timeout` again
//! when a keep-alive connection goes idle after a response, so an HTTP/1
//! connection idle between requests longer than the header read timeout
//! is closed by hyper itself; [`ConnLimits::idle`] bounds it too when
//! shorter, and is what bounds idle HTTP/2 connections.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Request, Response};
use axum::Router;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long a connection asked to close (at a deadline of
/// [`ConnLimits`]) may take to do so, with no request in progress,
/// before its socket is closed: an HTTP/2 GOAWAY's round trip.
pub const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// How long a connection that has served requests may stay idle while the
/// server's slots run low ([`Pressure`]), when [`ConnLimits::idle`] is
/// longer: 3 s, a few round trips for a client between two requests.
pub const BUSY_IDLE: Duration = Duration::from_secs(3);

/// Whether the server's connection slots run low: more than 3/4 of
/// `total` taken, published on a [`watch`] channel for the connections
/// ([`serve_connection`]'s `busy`), which then wait [`BUSY_IDLE`] at most
/// while idle.
pub struct Pressure {
    slots: Arc<tokio::sync::Semaphore>,
    total: usize,
    busy: watch::Sender<bool>,
}

impl Pressure {
    /// The pressure on `slots`, a semaphore of `total` permits (one per
    /// slot, held while a connection is open).
    pub fn new(slots: Arc<tokio::sync::Semaphore>, total: usize) -> Self {
        Pressure { slots, total, busy: watch::channel(false).0 }
    }

    /// What connections watch.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.busy.subscribe()
    }

    /// Looks at the slots again (after a slot was taken or given back).
    pub fn update(&self) {
        let taken = self.total.saturating_sub(self.slots.available_permits());
        let busy = taken.saturating_mul(4) > self.total.saturating_mul(3);
        self.busy.send_if_modified(|b| std::mem::replace(b, busy) != busy);
    }
}

/// The deadlines one connection is served under.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Time from the accept by which the first request's headers must
    /// have arrived (HTTP/1: the request line and headers; HTTP/2: the
    /// preface, SETTINGS and the first HEADERS frame).
    pub first_request: Duration,
    /// Time a connection that has served requests may carry none (no
    /// request being read or answered, no response body such as an SSE
    /// stream open) before it is closed.
    pub idle: Duration,
}

/// How a connection ended badly.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    /// No request arrived within [`ConnLimits::first_request`].
    #[error("no request within {0:?} of the connection's accept; closed")]
    NoFirstRequest(Duration),
    /// Asked to close, the connection had not closed [`CLOSE_GRACE`]
    /// later; its socket was closed.
    #[error("the connection did not close within {CLOSE_GRACE:?} of being asked; its socket was closed")]
    CloseTimeout,
    /// hyper's error (a malformed request, a reset, hyper's own header
    /// read timeout).
    #[error("{0}")]
    Http(Box<dyn std::error::Error + Send + Sync>),
}

/// What the service tells the connection's task.
#[derive(Clone, Copy, Debug)]
struct Activity {
    /// Requests given to the service so far.
    requests: u64,
    /// Requests whose response (body included) has not ended.
    in_flight: usize,
    /// When `in_flight` last fell to 0 (the accept before any request).
    idle_since: Instant,
}

/// One request in progress, from the service call to the end (drop) of
/// its response body.
struct InFlight(Arc<watch::Sender<Activity>>);

impl InFlight {
    /// Counts a new request on `activity`.
    fn begin(activity: &Arc<watch::Sender<Activity>>) -> Self {
        activity.send_modify(|a| {
            a.requests += 1;
            a.in_flight += 1;
        });
        InFlight(activity.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.send_modify(|a| {
            a.in_flight = a.in_flight.saturating_sub(1);
            if a.in_flight == 0 {
                a.idle_since = Instant::now();
            }
        });
    }
}

/// A response body that keeps its request counted as in progress until
/// hyper has sent it whole or dropped it.
struct TrackedBody {
    body: Body,
    _in_flight: InFlight,
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        // `Body` is `Unpin`, so is `TrackedBody`.
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The application as hyper calls it, counting requests in progress for
/// the connection's task (see the module's documentation).
#[derive(Clone)]
pub struct Tracked {
    app: TowerToHyperService<Router>,
    activity: Arc<watch::Sender<Activity>>,
    /// The client's address.
    peer: Option<std::net::SocketAddr>,
}

impl hyper::service::Service<Request<Incoming>> for Tracked {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn call(&self, mut req: Request<Incoming>) -> Self::Future {
        if let Some(peer) = self.peer {
            req.extensions_mut().insert(axum::extract::ConnectInfo(peer));
        }
        let in_flight = InFlight::begin(&self.activity);
        let answer = self.app.call(req);
        Box::pin(async move {
            let resp = answer.await?;
            Ok(resp.map(|body| Body::new(TrackedBody { body, _in_flight: in_flight })))
        })
    }
}

/// Serves `app` on `io` (from `peer`, given to every request as
/// [`axum::extract::ConnectInfo`]) with `builder` under `limits` (see the
/// module's documentation; `busy`: whether the server's slots run low,
/// [`Pressure`]) until the connection ends; `shutdown` asks it to close
/// gracefully (without a deadline: the caller bounds the drain).
///
/// Errors: [`ConnError`] when the connection was closed at a deadline
/// before its first request or after it did not close in time, or
/// hyper's error. A connection closed for being idle ends with `Ok`.
pub fn serve_connection<I>(
    builder: &auto::Builder<TokioExecutor>,
    io: I,
    peer: Option<std::net::SocketAddr>,
    app: Router,
    limits: ConnLimits,
    mut busy: watch::Receiver<bool>,
    shutdown: CancellationToken,
) -> impl Future<Output = Result<(), ConnError>> + Send + 'static
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let accepted = Instant::now();
    let (tx, mut activity) = watch::channel(Activity { requests: 0, in_flight: 0, idle_since: accepted });
    let service = Tracked { app: TowerToHyperService::new(app), activity: Arc::new(tx), peer };
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service).into_owned();
    async move {
        let mut conn = std::pin::pin!(conn);
        // When the connection was asked to close at one of its deadlines,
        // and whether that was before its first request.
        let mut closing: Option<(Instant, bool)> = None;
        let mut shutting_down = false;
        let mut watching = true;
        let mut watching_busy = true;
        loop {
            let now = *activity.borrow_and_update();
            let idle = if *busy.borrow_and_update() { limits.idle.min(BUSY_IDLE) } else { limits.idle };
            let deadline = match closing {
                Some((asked, _)) => (now.in_flight == 0).then(|| asked.max(now.idle_since) + CLOSE_GRACE),
                None if shutting_down => None,
                None if now.requests == 0 => Some(accepted + limits.first_request),
                None if now.in_flight == 0 => Some(now.idle_since + idle),
                None => None,
            };
            let timer = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ended = conn.as_mut() => {
                    if let Some((_, true)) = closing {
                        return Err(ConnError::NoFirstRequest(limits.first_request));
                    }
                    return match ended {
                        Ok(()) => Ok(()),
                        // Asked to close before its version was known
                        // (hyper-util ends it with "Cancelled").
                        Err(_) if closing.is_some() || shutting_down => Ok(()),
                        Err(e) => Err(ConnError::Http(e)),
                    };
                }
                _ = shutdown.cancelled(), if !shutting_down => {
                    shutting_down = true;
                    conn.as_mut().graceful_shutdown();
                }
                changed = activity.changed(), if watching => {
                    // The sender lives as long as the connection's service;
                    // should it go first, only the connection is awaited.
                    watching = changed.is_ok();
                }
                changed = busy.changed(), if watching_busy => {
                    // The server's slots ran low or recovered: the idle
                    // deadline changes. (The sender lives as long as the
                    // accept loop.)
                    watching_busy = changed.is_ok();
                }
                () = timer => {
                    if activity.has_changed().unwrap_or(false) {
                        continue; // a request came at the deadline
                    }
                    match closing {
                        Some((_, true)) => return Err(ConnError::NoFirstRequest(limits.first_request)),
                        Some((_, false)) => return Err(ConnError::CloseTimeout),
                        None => {
                            closing = Some((Instant::now(), now.requests == 0));
                            conn.as_mut().graceful_shutdown();
                        }
                    }
                }
            }
        }
    }
}

/// Connections open per client address, at most `max` each (0: no cap).
/// Behind a reverse proxy (nginx, a Kubernetes Ingress) every client has
/// the proxy's address, so the cap then holds all of them together.
pub struct PerAddress {
    max: usize,
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// One connection counted against its address; uncounted on drop.
pub struct AddressSlot {
    addr: IpAddr,
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl PerAddress {
    /// At most `max` connections per address; 0 turns the cap off.
    pub fn new(max: usize) -> Self {
        PerAddress { max, open: Arc::default() }
    }

    /// Counts a connection from `addr` (an IPv4-mapped IPv6 address counts
    /// as its IPv4 one); `None` when `addr` already has `max` open.
    pub fn take(&self, addr: IpAddr) -> Option<AddressSlot> {
        let addr = addr.to_canonical();
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(addr).or_insert(0);
        if self.max != 0 && *n >= self.max {
            return None;
        }
        *n += 1;
        Some(AddressSlot { addr, open: self.open.clone() })
    }

    /// Connections open from `addr` now.
    #[cfg(test)]
    pub fn open(&self, addr: IpAddr) -> usize {
        let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.get(&addr.to_canonical()).copied().unwrap_or(0)
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.addr) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.addr);
            }
        }
    }
}

#[cfg(test)]
mod tests;
