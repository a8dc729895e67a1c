//! This host's MCP sessions: rmcp's in-process sessions, named
//! `<host>.<uuid>` so any host can tell whose a session is, and capped.

use rmcp::transport::streamable_http_server::session::local::{
    create_local_session, LocalSessionManager, LocalSessionWorker,
};
use rmcp::transport::streamable_http_server::session::{SessionId, SessionManager};
use rmcp::transport::WorkerTransport;

use super::ClusterError;

/// Sessions named `<host>.<uuid>`, otherwise rmcp's in-process sessions
/// ([`LocalSessionManager`]), so that any host can tell whose a session
/// is from its `Mcp-Session-Id`; at most `max` open at once. A session
/// ends on `DELETE /mcp` or after the session configuration's
/// `keep_alive` without a request (rmcp then removes it).
pub struct HostSessions {
    inner: LocalSessionManager,
    host: String,
    max: usize,
}

impl HostSessions {
    /// Sessions of `host`, configured as `inner`, at most `max` (at least
    /// 1) open at once.
    pub fn new(inner: LocalSessionManager, host: &str, max: usize) -> Self {
        HostSessions { inner, host: host.to_string(), max: max.max(1) }
    }

    /// Sessions open now.
    pub async fn count(&self) -> usize {
        self.inner.sessions.read().await.len()
    }

    /// The ids of the sessions open now.
    pub async fn ids(&self) -> std::collections::HashSet<String> {
        self.inner.sessions.read().await.keys().map(|id| id.to_string()).collect()
    }

    /// Whether as many sessions as allowed are open now.
    pub async fn is_full(&self) -> bool {
        self.count().await >= self.max
    }

    /// The error of a session refused at the cap, which says what to do.
    pub fn full_error(&self) -> ClusterError {
        let idle_secs = self.inner.session_config.keep_alive.map_or(0, |d| d.as_secs());
        ClusterError::TooManySessions { max: self.max, idle_secs }
    }
}

impl SessionManager for HostSessions {
    type Error = ClusterError;
    type Transport = WorkerTransport<LocalSessionWorker>;

    /// Errors: [`ClusterError::TooManySessions`] when `max` are open.
    async fn create_session(&self) -> Result<(SessionId, Self::Transport), Self::Error> {
        let id: SessionId = format!("{}.{}", self.host, uuid::Uuid::new_v4()).into();
        let mut sessions = self.inner.sessions.write().await;
        if sessions.len() >= self.max {
            return Err(self.full_error());
        }
        let (handle, worker) = create_local_session(id.clone(), self.inner.session_config.clone());
        sessions.insert(id.clone(), handle);
        drop(sessions);
        Ok((id, WorkerTransport::spawn(worker)))
    }

    async fn initialize_session(
        &self,
        id: &SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<rmcp::model::ServerJsonRpcMessage, Self::Error> {
        Ok(self.inner.initialize_session(id, message).await?)
    }

    async fn has_session(&self, id: &SessionId) -> Result<bool, Self::Error> {
        Ok(self.inner.has_session(id).await?)
    }

    async fn close_session(&self, id: &SessionId) -> Result<(), Self::Error> {
        Ok(self.inner.close_session(id).await?)
    }

    async fn create_stream(
        &self,
        id: &SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<
        impl futures_util::Stream<Item = rmcp::transport::common::server_side_http::ServerSseMessage>
            + Send
            + Sync
            + 'static,
        Self::Error,
    > {
        Ok(self.inner.create_stream(id, message).await?)
    }

    async fn accept_message(
        &self,
        id: &SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<(), Self::Error> {
        Ok(self.inner.accept_message(id, message).await?)
    }

    async fn create_standalone_stream(
        &self,
        id: &SessionId,
    ) -> Result<
        impl futures_util::Stream<Item = rmcp::transport::common::server_side_http::ServerSseMessage>
            + Send
            + Sync
            + 'static,
        Self::Error,
    > {
        Ok(self.inner.create_standalone_stream(id).await?)
    }

    async fn resume(
        &self,
        id: &SessionId,
        last_event_id: String,
    ) -> Result<
        impl futures_util::Stream<Item = rmcp::transport::common::server_side_http::ServerSseMessage>
            + Send
            + Sync
            + 'static,
        Self::Error,
    > {
        Ok(self.inner.resume(id, last_event_id).await?)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn sessions_past_the_cap_are_not_made() {
        let mut local = LocalSessionManager::default();
        local.session_config.keep_alive = Some(Duration::from_secs(30));
        let sessions = HostSessions::new(local, "h1", 2);
        let (a, _ta) = sessions.create_session().await.unwrap();
        assert!(a.starts_with("h1."), "{a}");
        let _b = sessions.create_session().await.unwrap();
        assert!(sessions.is_full().await);
        let e = sessions.create_session().await.err().expect("a third is refused");
        assert!(matches!(e, ClusterError::TooManySessions { max: 2, idle_secs: 30 }), "{e}");
        assert_eq!(sessions.count().await, 2);
        sessions.close_session(&a).await.unwrap();
        assert!(!sessions.is_full().await);
        sessions.create_session().await.expect("a place came free");
    }
}
