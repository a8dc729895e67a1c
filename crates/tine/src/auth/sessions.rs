//! MCP sessions belong to the principal that opened them.
//!
//! A session id (`Mcp-Session-Id`, MCP "Transports": session management)
//! is a bearer of its own: whoever holds it could read the session's log
//! stream or use its session sandbox. [`bind`] records which principal's
//! `initialize` made each session of this host, and answers a request of
//! another principal on it exactly as rmcp answers an unknown session (404
//! `Not Found: Session not found`). It also holds each tenant to its
//! quota of sessions ([`tine_sandbox::Quota::max_sessions`]): an
//! `initialize` past it is answered 429 with the quota's name.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::Principal;
use crate::cluster::HostSessions;

/// The session header (MCP "Transports", Streamable HTTP §session management).
const SESSION_HEADER: &str = "mcp-session-id";

/// Which principal opened each session of this host.
pub struct SessionOwners {
    owners: Mutex<HashMap<String, String>>,
    sessions: Arc<HostSessions>,
}

impl SessionOwners {
    /// Owners of the sessions in `sessions`.
    pub fn new(sessions: Arc<HostSessions>) -> Arc<Self> {
        Arc::new(SessionOwners { owners: Mutex::new(HashMap::new()), sessions })
    }

    fn owners(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.owners.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets the owners of sessions that ended, and returns how many
    /// sessions `principal` has open.
    async fn open_of(&self, principal: &str) -> usize {
        let live = self.sessions.ids().await;
        let mut owners = self.owners();
        owners.retain(|id, _| live.contains(id.as_str()));
        owners.values().filter(|o| o.as_str() == principal).count()
    }
}

/// The middleware, inside [`super::authenticate`] and after a foreign
/// session's request was passed to its host: see the module doc.
pub async fn bind(State(owners): State<Arc<SessionOwners>>, req: Request, next: Next) -> Response {
    let principal = req.extensions().get::<Principal>().cloned().unwrap_or(Principal::Admin);
    let name = principal.name().to_string();
    let session = req.headers().get(SESSION_HEADER).and_then(|v| v.to_str().ok()).map(str::to_string);
    if let Some(id) = session {
        let owner = owners.owners().get(&id).cloned();
        if owner.is_some_and(|o| o != name) {
            return (StatusCode::NOT_FOUND, "Not Found: Session not found").into_response();
        }
        return next.run(req).await;
    }
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    // A request without a session: an `initialize` makes one.
    if let Some(quota) = principal.quota() {
        let open = owners.open_of(&name).await;
        if open >= quota.max_sessions {
            let message = format!(
                "tenant {name} is at its quota of MCP sessions: {open} open, the quota is {}; end sessions it no \
                 longer uses (DELETE /mcp with their Mcp-Session-Id) or wait for them to time out",
                quota.max_sessions
            );
            let body = serde_json::json!({"error": "quota", "message": message}).to_string();
            let mut resp =
                (StatusCode::TOO_MANY_REQUESTS, [(header::CONTENT_TYPE, "application/json")], body).into_response();
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("60"));
            return resp;
        }
    }
    let resp = next.run(req).await;
    if let Some(id) = resp.headers().get(SESSION_HEADER).and_then(|v| v.to_str().ok()) {
        owners.owners().insert(id.to_string(), name);
    }
    resp
}
