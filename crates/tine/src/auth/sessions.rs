//! MCP sessions belong to the principal that opened them.
//!
//! A session id (`Mcp-Session-Id`, MCP "Transports": session management)
//! is a bearer of its own: whoever holds it could read the session's log
//! stream or use its session sandbox. [`bind`] records which principal's
//! `initialize` made each session of this host, and answers a request of
//! another principal on it exactly as rmcp answers an unknown session (404
//! `Not Found: Session not found`). It also holds each tenant to its
//! quota of sessions ([`tine_sandbox::Quota::max_sessions`]): an
//! `initialize` past it is answered 429 with the quota's name, and to its
//! quota of requests open at once on its sessions
//! ([`tine_sandbox::Quota::max_streams`]: a session's `GET` SSE stream and
//! each `POST` count until their answer's body ends or is dropped; a
//! `DELETE` that ends a session is never refused). Port forwards
//! ([`crate::port_forward`]) count against the same quota while open
//! ([`SessionOwners::open_stream`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt as _;

use super::Principal;
use crate::cluster::HostSessions;

/// The session header (MCP "Transports", Streamable HTTP §session management).
const SESSION_HEADER: &str = "mcp-session-id";

/// Which principal opened each session of this host.
pub struct SessionOwners {
    state: Mutex<Owners>,
    sessions: Arc<HostSessions>,
}

/// Sessions by owner, `initialize`s in flight by principal (counted
/// against the quota until their session is recorded), and requests open
/// on sessions by principal.
#[derive(Default)]
struct Owners {
    by_session: HashMap<String, String>,
    pending: HashMap<String, usize>,
    streams: HashMap<String, usize>,
}

/// One open request of a principal on a session (or port forward),
/// counted until dropped (with the answer's body, or the forward).
pub struct StreamSlot {
    owners: Arc<SessionOwners>,
    principal: String,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut st = self.owners.state();
        if let Some(n) = st.streams.get_mut(&self.principal) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                st.streams.remove(&self.principal);
            }
        }
    }
}

impl SessionOwners {
    /// Owners of the sessions in `sessions`.
    pub fn new(sessions: Arc<HostSessions>) -> Arc<Self> {
        Arc::new(SessionOwners { state: Mutex::new(Owners::default()), sessions })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Owners> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a place for a new session of `principal` if it has fewer than
    /// `max` open or being opened (forgetting the owners of sessions that
    /// ended); otherwise how many it has.
    async fn reserve(&self, principal: &str, max: usize) -> Result<(), usize> {
        let live = self.sessions.ids().await;
        let mut st = self.state();
        st.by_session.retain(|id, _| live.contains(id.as_str()));
        let open = st.by_session.values().filter(|o| o.as_str() == principal).count()
            + st.pending.get(principal).copied().unwrap_or(0);
        if open >= max {
            return Err(open);
        }
        *st.pending.entry(principal.to_string()).or_default() += 1;
        Ok(())
    }

    /// A slot for one more open request (or port forward) of `principal`
    /// if it has fewer than `max`; otherwise how many it has.
    pub fn open_stream(self: &Arc<Self>, principal: &str, max: usize) -> Result<StreamSlot, usize> {
        let mut st = self.state();
        let n = st.streams.entry(principal.to_string()).or_default();
        if *n >= max {
            return Err(*n);
        }
        *n += 1;
        Ok(StreamSlot { owners: self.clone(), principal: principal.to_string() })
    }

    /// Ends a reservation of `principal`; `session`: the session it made.
    fn settle(&self, principal: &str, session: Option<String>) {
        let mut st = self.state();
        if let Some(n) = st.pending.get_mut(principal) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                st.pending.remove(principal);
            }
        }
        if let Some(id) = session {
            st.by_session.insert(id, principal.to_string());
        }
    }
}

/// The middleware, inside [`super::authenticate`] and after a foreign
/// session's request was passed to its host: see the module doc.
pub async fn bind(State(owners): State<Arc<SessionOwners>>, req: Request, next: Next) -> Response {
    let principal = req.extensions().get::<Principal>().cloned().unwrap_or(Principal::Admin);
    let name = principal.name().to_string();
    let session = req.headers().get(SESSION_HEADER).and_then(|v| v.to_str().ok()).map(str::to_string);
    if let Some(id) = session {
        let owner = owners.state().by_session.get(&id).cloned();
        if owner.is_some_and(|o| o != name) {
            return (StatusCode::NOT_FOUND, "Not Found: Session not found").into_response();
        }
        // Ending a session is never refused: it is how a client frees places.
        let Some(max) = principal.quota().filter(|_| req.method() != Method::DELETE).map(|q| q.max_streams) else {
            return next.run(req).await;
        };
        let slot = match owners.open_stream(&name, max) {
            Ok(slot) => slot,
            Err(open) => {
                return too_many(streams_full(&name, open, max));
            }
        };
        // The slot goes with the answer's body: an SSE stream holds it
        // while it is open.
        let (parts, body) = next.run(req).await.into_parts();
        let stream = body.into_data_stream().map(move |chunk| {
            let _held = &slot;
            chunk
        });
        return Response::from_parts(parts, axum::body::Body::from_stream(stream));
    }
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    // A request without a session: an `initialize` makes one.
    let max = principal.quota().map_or(usize::MAX, |q| q.max_sessions);
    if let Err(open) = owners.reserve(&name, max).await {
        let message = format!(
            "tenant {name} is at its quota of MCP sessions: {open} open, the quota is {max}; end sessions it no \
             longer uses (DELETE /mcp with their Mcp-Session-Id) or wait for them to time out"
        );
        return too_many(message);
    }
    // Settled even when the request is dropped half-way (a client gone).
    struct Reservation<'a>(&'a SessionOwners, &'a str, Option<String>);
    impl Drop for Reservation<'_> {
        fn drop(&mut self) {
            self.0.settle(self.1, self.2.take());
        }
    }
    let mut reservation = Reservation(&owners, &name, None);
    let resp = next.run(req).await;
    reservation.2 = resp.headers().get(SESSION_HEADER).and_then(|v| v.to_str().ok()).map(str::to_string);
    drop(reservation);
    resp
}

/// What a tenant at its quota of open requests is told: `open` of `max`.
pub fn streams_full(name: &str, open: usize, max: usize) -> String {
    format!(
        "tenant {name} is at its quota of requests open at once on its MCP sessions and port forwards: {open} open \
         (SSE streams and port forwards included), the quota is {max}; close streams it no longer reads or port \
         forwards it no longer uses, or wait for calls to end"
    )
}

/// A 429 with `message` in a JSON body and `Retry-After: 60`.
pub fn too_many(message: String) -> Response {
    let body = serde_json::json!({"error": "quota", "message": message}).to_string();
    let mut resp = (StatusCode::TOO_MANY_REQUESTS, [(header::CONTENT_TYPE, "application/json")], body).into_response();
    resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("60"));
    resp
}
