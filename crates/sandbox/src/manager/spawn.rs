//! Spawn N: `n` sandboxes of one spec in one call
//! (`sandbox_create { count }`, forkd's `spawn_sandboxes`). They are made
//! at once, each as [`Manager::create_with`] makes one: from the warm pool
//! while it has them, else restored (the boot and restore slots bound how
//! many start together). A partial failure keeps those made and says why
//! the others were not.

use std::sync::Arc;
use std::time::Instant;

use super::{Manager, SandboxError, SandboxInfo, SandboxSpec};
use crate::CallContext;

/// Most sandboxes one spawn asks for (the live-sandbox cap bounds it too).
pub const MAX_SPAWN: usize = 64;

/// What a spawn made.
#[derive(Debug)]
pub struct Spawned {
    /// The sandboxes made.
    pub sandboxes: Vec<SandboxInfo>,
    /// How long the spawn took (ms).
    pub ms: u64,
    /// Why the others were not made, if some were not.
    pub error: Option<SandboxError>,
}

impl Manager {
    /// Makes `n` (1-[`MAX_SPAWN`]) sandboxes of `spec` for `cx` at once.
    ///
    /// Errors: [`SandboxError::Spawn`] for `n` out of range or a name with
    /// `n` > 1 (a name names one sandbox); when none was made, the first
    /// create's error.
    pub async fn create_many(
        self: &Arc<Self>,
        spec: SandboxSpec,
        n: usize,
        cx: &CallContext,
    ) -> Result<Spawned, SandboxError> {
        if n == 0 || n > MAX_SPAWN {
            return Err(SandboxError::Spawn(format!("count must be 1 to {MAX_SPAWN}, got {n}")));
        }
        if n > 1 && spec.name.is_some() {
            return Err(SandboxError::Spawn("a name names one sandbox: leave name out, or count at 1".into()));
        }
        let t0 = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..n {
            let (me, spec, cx) = (self.clone(), spec.clone(), cx.clone());
            set.spawn(async move { me.create_with(spec, &cx).await });
        }
        let mut sandboxes = Vec::with_capacity(n);
        let mut error = None;
        while let Some(r) = set.join_next().await {
            match r {
                Ok(Ok(info)) => sandboxes.push(info),
                Ok(Err(e)) => {
                    error.get_or_insert(e);
                }
                Err(e) => {
                    error.get_or_insert(SandboxError::Spawn(format!("a create task failed: {e}")));
                }
            }
        }
        sandboxes.sort_by(|a, b| a.created_at_ms.cmp(&b.created_at_ms).then_with(|| a.sandbox_id.cmp(&b.sandbox_id)));
        let ms = t0.elapsed().as_millis() as u64;
        match (sandboxes.is_empty(), error) {
            (true, Some(e)) => Err(e),
            (_, error) => Ok(Spawned { sandboxes, ms, error }),
        }
    }
}
