//! The session's own sandbox: the one every tool uses when called without
//! `sandbox_id`. Created on first use (again after it was killed or merged
//! away), labelled [`SESSION_LABEL`], and killed when the MCP session ends.

use std::collections::BTreeMap;
use std::sync::Arc;

use tine_sandbox::{Manager, SandboxSpec};

use super::errors::ToolError;

/// The label that marks a session's own sandbox.
pub const SESSION_LABEL: &str = "tine/session-sandbox";

/// One MCP session's own sandbox; killed when the session's handler goes.
pub struct SessionSandbox {
    manager: Arc<Manager>,
    /// The sandbox's id, once made. Held across its creation, so two
    /// concurrent first calls make one sandbox.
    id: tokio::sync::Mutex<Option<String>>,
    /// Where the kill on drop runs.
    runtime: tokio::runtime::Handle,
}

impl SessionSandbox {
    /// No sandbox yet.
    ///
    /// Panics outside a Tokio runtime (it keeps the runtime's handle for
    /// the kill on drop).
    pub fn new(manager: Arc<Manager>) -> Self {
        SessionSandbox { manager, id: tokio::sync::Mutex::new(None), runtime: tokio::runtime::Handle::current() }
    }

    /// The sandbox a call is about: `id` if given, else the session's own
    /// sandbox (created now if it has none, or if it was killed).
    ///
    /// Errors: [`ToolError::Sandbox`] from creating the sandbox.
    pub async fn target(&self, id: Option<String>) -> Result<String, ToolError> {
        if let Some(id) = id {
            return Ok(id);
        }
        let mut own = self.id.lock().await;
        if let Some(id) = own.as_ref() {
            if self.manager.contains(id) {
                return Ok(id.clone());
            }
        }
        let spec = SandboxSpec {
            labels: BTreeMap::from([(SESSION_LABEL.to_string(), "true".to_string())]),
            ..SandboxSpec::default()
        };
        let info = self.manager.create(spec).await?;
        *own = Some(info.sandbox_id.clone());
        Ok(info.sandbox_id)
    }

    /// The session's own sandbox, if it has one.
    pub async fn own(&self) -> Option<String> {
        self.id.lock().await.clone()
    }

    /// Forgets the session's own sandbox if it is `id` (it was killed or
    /// merged away); the next call without `sandbox_id` makes a new one.
    pub async fn forget(&self, id: &str) {
        let mut own = self.id.lock().await;
        if own.as_deref() == Some(id) {
            *own = None;
        }
    }
}

impl Drop for SessionSandbox {
    fn drop(&mut self) {
        if let Some(id) = self.id.get_mut().take() {
            let manager = self.manager.clone();
            tracing::info!(sandbox = %id, "MCP session ended: killing its sandbox");
            self.runtime.spawn(async move {
                let _ = manager.kill(&id).await;
            });
        }
    }
}
