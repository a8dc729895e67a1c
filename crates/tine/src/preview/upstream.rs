//! The connections from the server to guest ports that preview requests
//! travel: hyper-util's pooled HTTP/1.1 client, whose connector opens a
//! connection with `tine_sandbox::Manager::connect_port` (waking the
//! sandbox, within the wake timeout). A connection stays open for the next
//! request to the same sandbox and port for [`POOL_IDLE`] (a guest whose
//! kernel is emulated pays dearly for each new connection: a SYN, an
//! accept, often a thread), and at most [`PreviewConfig::max_guest_connections`]
//! requests of one sandbox and port are in flight at once; more wait for
//! a place up to the wake timeout, then get 503. A WebSocket or other
//! upgraded connection holds its place until it closes.
//!
//! [`PreviewConfig::max_guest_connections`]: super::PreviewConfig::max_guest_connections

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tine_sandbox::{Manager, PortLease, SandboxError};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How long an idle connection to a guest is kept for the next request.
/// It keeps its sandbox busy (not idle) meanwhile, so it is short.
pub const POOL_IDLE: Duration = Duration::from_secs(5);
/// Idle connections kept per sandbox and port, at most.
const POOL_MAX_IDLE: usize = 8;

/// A connection into a guest port, with the lease that keeps its sandbox
/// busy while it is open.
pub struct GuestIo {
    io: TokioIo<tokio::net::UnixStream>,
    _lease: PortLease,
}

impl Connection for GuestIo {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl hyper::rt::Read for GuestIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for GuestIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Opens connections for URIs `http://<sandbox_id>:<port>/`.
#[derive(Clone)]
pub struct Connector {
    manager: Arc<Manager>,
    timeout: Duration,
}

type ConnectFuture = Pin<Box<dyn std::future::Future<Output = Result<GuestIo, SandboxError>> + Send>>;

impl tower_service::Service<Uri> for Connector {
    type Response = GuestIo;
    type Error = SandboxError;
    type Future = ConnectFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (manager, timeout) = (self.manager.clone(), self.timeout);
        Box::pin(async move {
            let sandbox = uri.host().unwrap_or_default().to_string();
            let port = uri.port_u16().unwrap_or(0);
            let conn = match tokio::time::timeout(timeout, manager.connect_port(&sandbox, port)).await {
                Ok(c) => c?,
                Err(_) => return Err(SandboxError::Timeout { id: sandbox, secs: timeout.as_secs() }),
            };
            let (stream, lease) = conn.into_parts();
            let io = |source| SandboxError::Io { what: "a connection into the guest".into(), source };
            stream.set_nonblocking(true).map_err(io)?;
            let stream = tokio::net::UnixStream::from_std(stream).map_err(io)?;
            Ok(GuestIo { io: TokioIo::new(stream), _lease: lease })
        })
    }
}

/// The pooled client and the places per sandbox and port.
pub struct Upstream {
    client: Client<Connector, Body>,
    places: Mutex<HashMap<(String, u16), Arc<Semaphore>>>,
    max_per_port: usize,
    wait: Duration,
}

/// Why a request could not have a place.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// Every place of the port stayed taken for the whole wait.
    #[error("{0} requests to this port are in flight and none ended within {1} s; try again")]
    Full(usize, u64),
}

impl Upstream {
    /// A client whose connections come from `manager` within `wait`; at
    /// most `max_per_port` requests per sandbox and port at once.
    pub fn new(manager: Arc<Manager>, wait: Duration, max_per_port: usize) -> Self {
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE)
            .pool_max_idle_per_host(POOL_MAX_IDLE)
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .build(Connector { manager, timeout: wait });
        Upstream { client, places: Mutex::new(HashMap::new()), max_per_port: max_per_port.max(1), wait }
    }

    /// The client (requests name `http://<sandbox_id>:<port>/...`).
    pub fn client(&self) -> &Client<Connector, Body> {
        &self.client
    }

    /// A place for one request to `sandbox`'s `port`, waiting for one up
    /// to the wake timeout.
    ///
    /// Errors: [`UpstreamError::Full`].
    pub async fn place(&self, sandbox: &str, port: u16) -> Result<OwnedSemaphorePermit, UpstreamError> {
        let places = {
            let mut all = self.places.lock().unwrap_or_else(|p| p.into_inner());
            if all.len() > 4096 {
                // Ports nobody waits for or uses any more.
                let max = self.max_per_port;
                all.retain(|_, s| s.available_permits() < max || Arc::strong_count(s) > 1);
            }
            all.entry((sandbox.to_string(), port))
                .or_insert_with(|| Arc::new(Semaphore::new(self.max_per_port)))
                .clone()
        };
        match tokio::time::timeout(self.wait, places.acquire_owned()).await {
            Ok(Ok(p)) => Ok(p),
            // The semaphore is never closed.
            _ => Err(UpstreamError::Full(self.max_per_port, self.wait.as_secs())),
        }
    }
}

/// The sandbox error behind a failed request, if the connector gave one.
pub fn sandbox_error(e: &hyper_util::client::legacy::Error) -> Option<&SandboxError> {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(se) = s.downcast_ref::<SandboxError>() {
            return Some(se);
        }
        source = s.source();
    }
    None
}
