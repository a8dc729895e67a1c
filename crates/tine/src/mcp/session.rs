//! The session's sandbox: the one every tool uses when called without
//! `sandbox_id`.
//!
//! The rule: the sandbox this session created last with `sandbox_create`
//! (after a merge that removed it, the parent it was merged into); else
//! (none created, or it was killed) the one made on first use, labelled
//! [`SESSION_LABEL`]. A sandbox made on first use is killed when the MCP
//! session ends; sandboxes made with `sandbox_create` live on until killed
//! or idle.

use std::collections::BTreeMap;
use std::sync::Arc;

use tine_sandbox::{CallContext, Manager, SandboxSpec};

use super::errors::ToolError;

/// The label that marks a sandbox made on first use for a session.
pub const SESSION_LABEL: &str = "tine/session-sandbox";

/// Which sandboxes belong to the session.
#[derive(Debug, Default)]
struct Ids {
    /// What calls without `sandbox_id` use.
    current: Option<String>,
    /// The sandbox made on first use, killed with the session.
    made: Option<String>,
}

/// One MCP session's sandbox; the one made on first use is killed when
/// the session's handler goes.
pub struct SessionSandbox {
    manager: Arc<Manager>,
    /// Held across a first-use creation, so two concurrent first calls
    /// make one sandbox.
    ids: tokio::sync::Mutex<Ids>,
    /// Where the kill on drop runs.
    runtime: tokio::runtime::Handle,
}

impl SessionSandbox {
    /// No sandbox yet.
    ///
    /// Panics outside a Tokio runtime (it keeps the runtime's handle for
    /// the kill on drop).
    pub fn new(manager: Arc<Manager>) -> Self {
        SessionSandbox {
            manager,
            ids: tokio::sync::Mutex::new(Ids::default()),
            runtime: tokio::runtime::Handle::current(),
        }
    }

    /// The sandbox a call is about: `id` if given, else the session's
    /// sandbox (made now if it has none, or if that one was killed, owned
    /// by `cx.owner` and reporting its progress to `cx.progress`).
    ///
    /// Errors: [`ToolError::Sandbox`] from creating the sandbox.
    pub async fn target_with(&self, id: Option<String>, cx: &CallContext) -> Result<String, ToolError> {
        if let Some(id) = id {
            return Ok(id);
        }
        let mut ids = self.ids.lock().await;
        // The current one, else (it was killed) the one made on first use.
        for id in [ids.current.clone(), ids.made.clone()].into_iter().flatten() {
            if self.manager.contains(&id) {
                ids.current = Some(id.clone());
                return Ok(id);
            }
        }
        let spec = SandboxSpec {
            labels: BTreeMap::from([(SESSION_LABEL.to_string(), "true".to_string())]),
            ..SandboxSpec::default()
        };
        let info = self.manager.create_with(spec, cx).await?;
        ids.made = Some(info.sandbox_id.clone());
        ids.current = Some(info.sandbox_id.clone());
        Ok(info.sandbox_id)
    }

    /// `sandbox_create` made `id`: calls without `sandbox_id` use it from
    /// now on.
    pub async fn created(&self, id: &str) {
        self.ids.lock().await.current = Some(id.to_string());
    }

    /// The session's sandbox, if it has one.
    pub async fn current(&self) -> Option<String> {
        self.ids.lock().await.current.clone()
    }

    /// `winner` was merged into `parent`: `winner`'s id is gone and
    /// `parent` has its state; a session that used `winner` uses `parent`.
    pub async fn merged(&self, winner: &str, parent: &str) {
        let mut ids = self.ids.lock().await;
        if ids.current.as_deref() == Some(winner) {
            ids.current = Some(parent.to_string());
        }
        if ids.made.as_deref() == Some(winner) {
            ids.made = None;
        }
    }

    /// Forgets `id` (it was killed); the next call without `sandbox_id`
    /// makes a new sandbox.
    pub async fn forget(&self, id: &str) {
        let mut ids = self.ids.lock().await;
        if ids.current.as_deref() == Some(id) {
            ids.current = None;
        }
        if ids.made.as_deref() == Some(id) {
            ids.made = None;
        }
    }
}

impl SessionSandbox {
    /// The session ended: kills the sandbox it made on first use, if any,
    /// and waits for that (the drop does it in the background).
    pub async fn end(&self) {
        let made = self.ids.lock().await.made.take();
        if let Some(id) = made {
            tracing::info!(sandbox = %id, "MCP session ended: killing the sandbox it made on first use");
            let _ = self.manager.kill(&id).await;
        }
    }
}

impl Drop for SessionSandbox {
    fn drop(&mut self) {
        if let Some(id) = self.ids.get_mut().made.take() {
            if self.manager.is_shutting_down() {
                // The server stops: the sandbox is hibernated and kept like
                // the others (its session cannot come back; retention
                // deletes it unless a client names it).
                tracing::info!(sandbox = %id, "MCP session ended during shutdown: its sandbox is kept");
                return;
            }
            let manager = self.manager.clone();
            tracing::info!(sandbox = %id, "MCP session ended: killing the sandbox it made on first use");
            self.runtime.spawn(async move {
                let _ = manager.kill(&id).await;
            });
        }
    }
}
