//! Recording a template's working set (see [`vmm::working_set`]): a
//! sandbox is restored from the new template, its agent answers a first
//! exec (`bash -c true`) and a first Python cell, and the guest pages it
//! touched meanwhile are stored with the template
//! ([`crate::templates::WORKING_SET_FILE`]); every later restore populates
//! them before its vCPUs run instead of faulting them in one by one.
//!
//! The server records it for the default template and for templates
//! built from a recipe, right after their snapshot, when
//! [`ManagerConfig::prefetch`](super::ManagerConfig::prefetch) is on. A
//! template without one (made by `sandbox_snapshot`, by an older server,
//! or whose recording failed) restores without prefetch; `tine template
//! build` rebuilds the default one with it. A failure is logged
//! and leaves the template without one: restores work as before.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tine_protocol::{Cell, Command, Exec};

use super::backend::VmSource;
use super::sandbox::SandboxSetup;
use super::{task_failed, Manager, Sandbox, SandboxError};
use crate::lock;
use crate::memory::MemoryUse;
use crate::progress::ProgressSink;

/// Timeout of the recording's exec and Python cell (they are trivial; the
/// host may be loaded).
const RECORD_CALL: Duration = Duration::from_secs(120);

impl Manager {
    /// Records template `name`'s working set, unless it has one, and
    /// stores it with the template. Logs the outcome; never fails the
    /// caller.
    pub(super) async fn record_working_set(self: &Arc<Self>, name: &str) {
        // With huge pages a restore copies all the data in up front.
        if !self.config.prefetch || self.config.huge_pages {
            return;
        }
        let t0 = Instant::now();
        match self.record_working_set_inner(name).await {
            Ok(Some(ws)) => {
                let (read, written) = ws.bytes();
                tracing::info!(
                    template = name,
                    read_kib = read >> 10,
                    written_kib = written >> 10,
                    "working set recorded in {} ms; restores prefetch it",
                    t0.elapsed().as_millis()
                );
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(template = name, "cannot record the working set (restores fault pages in): {e}"),
        }
    }

    async fn record_working_set_inner(self: &Arc<Self>, name: &str) -> Result<Option<vmm::WorkingSet>, SandboxError> {
        let template = self.load_template(name.to_string()).await?;
        if template.working_set().is_some() {
            return Ok(None);
        }
        let (vcpus, memory_mib) = (template.meta.vcpus, template.meta.memory_mib);
        let memory = self.admit("working-set recording", &[(MemoryUse::Sandbox, memory_mib)])?.pop();
        let setup = SandboxSetup {
            labels: BTreeMap::new(),
            template: Some(name.to_string()),
            idle_timeout: Duration::MAX,
            owner: None,
            tenant: None,
            events: None,
            disk_mib: crate::disks::size_mib(template.disk.as_ref()),
            rootfs: template.meta.base.as_ref().map(|(path, _)| path.clone()),
        };
        let sb = self.unlisted_sandbox("template", (vcpus, memory_mib), setup, memory)?;
        let r = self.record_on(&sb, template).await;
        self.teardown(&sb, None).await;
        r.map(Some)
    }

    /// Restores `sb` from `template`, runs the first calls and reads the
    /// pages its VM touched.
    async fn record_on(
        self: &Arc<Self>,
        sb: &Arc<Sandbox>,
        template: Arc<crate::templates::Template>,
    ) -> Result<vmm::WorkingSet, SandboxError> {
        let name = template.meta.name.clone();
        self.start(sb, VmSource::Template(template), &ProgressSink::none(), Instant::now()).await?;
        let agent = lock(&sb.status).agent.clone().ok_or_else(|| sb.gone())?;
        let connection = |e: tine_agent_client::ClientError| SandboxError::Connection {
            id: sb.id.clone(),
            reason: format!("working-set recording: {e}"),
        };
        let exec = Exec {
            command: Command::Shell("true".into()),
            cwd: None,
            env: Vec::new(),
            stdin: Vec::new(),
            timeout_ms: RECORD_CALL.as_millis() as u32,
            output_limit: 0,
        };
        agent.run(exec, RECORD_CALL).await.map_err(connection)?;
        let cell = Cell { code: "1 + 1".into(), timeout_ms: RECORD_CALL.as_millis() as u32, output_limit: 0 };
        match agent.run_python(cell, RECORD_CALL).await {
            // An image without python3 (a template from an OCI image): the
            // working set is the restore's and the exec's.
            Err(tine_agent_client::ClientError::Agent(tine_protocol::AgentError::Unsupported { .. })) => {}
            r => {
                r.map_err(connection)?;
            }
        }
        let s = sb.clone();
        let ws = tokio::task::spawn_blocking(move || lock(&s.vm).vm.as_ref().map(|vm| vm.working_set()))
            .await
            .map_err(task_failed("working-set task"))?
            .ok_or_else(|| sb.gone())?
            .map_err(SandboxError::Start)?;
        let me = self.clone();
        let saved = ws.clone();
        tokio::task::spawn_blocking(move || me.templates.save_working_set(&name, saved))
            .await
            .map_err(task_failed("working-set save task"))??;
        Ok(ws)
    }
}
