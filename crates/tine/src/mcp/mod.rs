//! The MCP tools (MCP 2025-06-18 / 2025-11-25, "Tools"): one
//! [`TineMcp`] per MCP session, all sharing the sandbox [`Manager`]. This
//! file owns the tool router (each tool's name, description, annotations
//! and body) and the [`ServerHandler`]; the session's own sandbox, the
//! parameter and result types, and the error messages live in the
//! submodules.
//!
//! Every tool that takes `sandbox_id` also works without it, on the
//! session's own sandbox: created on first use, killed when the session
//! ends. Results are structured (`structuredContent`, with the same JSON
//! as text); failures are tool results with `isError: true` and a short
//! message that says what to do next.

mod errors;
mod params;
mod results;
mod session;

use std::sync::Arc;

use base64::Engine as _;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{Implementation, ServerCapabilities, ServerConfig};
use rmcp::{tool, tool_handler, tool_router, Json, ServerHandler};
use tine_protocol::MAX_FILE_CHUNK;
use tine_sandbox::{
    BranchResult, DiffOptions, DiffReport, ExecRequest, Manager, SandboxInfo, SandboxSpec, TemplateInfo,
};

use errors::ToolError;
use params::TemplateDeleteParams;
use params::{
    secs_to_ms, BranchParams, CreateParams, DiffParams, ExecParams, ListDirParams, ListParams, MergeParams,
    PythonParams, ReadParams, SandboxParams, SnapshotParams, UploadParams, WriteParams,
};
use results::TemplateDeleteResult;
use results::{
    DownloadResult, Entry, ExecResult, KillResult, ListDirResult, ListResult, PythonResult, ReadResult,
    TemplateListResult, WriteResult,
};
use session::SessionSandbox;

/// Largest text `sandbox_files_read` returns at once (bytes).
pub const MAX_READ_BYTES: u64 = 1 << 20;

/// One MCP session's handler.
#[derive(Clone)]
pub struct TineMcp {
    manager: Arc<Manager>,
    session: Arc<SessionSandbox>,
    tool_router: ToolRouter<Self>,
}

#[tool_router]
impl TineMcp {
    /// A handler for a new MCP session.
    pub fn new(manager: Arc<Manager>) -> Self {
        TineMcp { session: Arc::new(SessionSandbox::new(manager.clone())), manager, tool_router: Self::tool_router() }
    }

    /// The sandbox a call is about: the given id, or the session's own
    /// sandbox (created now if it has none, or if it was killed).
    async fn target(&self, id: Option<String>) -> Result<String, ToolError> {
        self.session.target(id).await
    }

    #[tool(
        description = "Create a new sandbox: an isolated Linux microVM (Debian, bash, Python 3) with its own \
                       kernel. Returns its sandbox_id. Tools called without sandbox_id use this session's own \
                       sandbox instead, created on first use.",
        annotations(
            title = "Create sandbox",
            read_only_hint = false,
            destructive_hint = false,
            open_world_hint = false
        )
    )]
    async fn sandbox_create(&self, Parameters(p): Parameters<CreateParams>) -> Result<Json<SandboxInfo>, ToolError> {
        let spec = SandboxSpec {
            vcpus: p.vcpus,
            memory_mib: p.memory_mib,
            labels: p.labels,
            idle_timeout_secs: p.idle_timeout_secs,
            template: p.template,
        };
        self.manager.create(spec).await.map(Json).map_err(ToolError::from)
    }

    #[tool(
        description = "List templates: snapshots of a ready sandbox that sandbox_create { template } starts from \
                       in a fraction of a boot's time. 'default' is what sandbox_create uses when none is named.",
        annotations(title = "List templates", read_only_hint = true, open_world_hint = false)
    )]
    async fn template_list(&self) -> Result<Json<TemplateListResult>, ToolError> {
        Ok(Json(TemplateListResult { templates: self.manager.templates() }))
    }

    #[tool(
        description = "Delete a template made with sandbox_snapshot. Sandboxes made from it keep running. \
                       'default' and names starting with 'tine-' are the server's and cannot be deleted.",
        annotations(
            title = "Delete template",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn template_delete(
        &self,
        Parameters(p): Parameters<TemplateDeleteParams>,
    ) -> Result<Json<TemplateDeleteResult>, ToolError> {
        self.manager.template_delete(&p.name).await.map_err(ToolError::from)?;
        Ok(Json(TemplateDeleteResult { name: p.name, deleted: true }))
    }

    #[tool(
        description = "Save a running sandbox as a new template under a name: its memory, running processes, \
                       files and Python state as they are now. The sandbox pauses for the copy and goes on. \
                       Then sandbox_create { template: name } makes copies of it, each with fresh randomness \
                       and the current clock.",
        annotations(
            title = "Snapshot sandbox",
            read_only_hint = false,
            destructive_hint = false,
            open_world_hint = false
        )
    )]
    async fn sandbox_snapshot(
        &self,
        Parameters(p): Parameters<SnapshotParams>,
    ) -> Result<Json<TemplateInfo>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        self.manager.snapshot(&id, &p.name).await.map(Json).map_err(ToolError::from)
    }

    #[tool(
        description = "Branch a running sandbox into n children: each child starts from the sandbox's exact \
                       state at this instant (memory, running processes, Python variables, files) and then goes \
                       its own way; the source keeps running, paused for milliseconds. Children share unchanged \
                       memory. Returns the children's ids. Compare children with sandbox_diff, keep the best with \
                       sandbox_merge_into, kill the rest with sandbox_kill.",
        annotations(
            title = "Branch sandbox",
            read_only_hint = false,
            destructive_hint = false,
            open_world_hint = false
        )
    )]
    async fn sandbox_branch(&self, Parameters(p): Parameters<BranchParams>) -> Result<Json<BranchResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        self.manager.branch(&id, p.n).await.map(Json).map_err(ToolError::from)
    }

    #[tool(
        description = "Compare two sandboxes' filesystems (everything written since boot, and /tmp): the paths \
                       added, removed and modified from a to b, with size, mode and SHA-256, and on request a \
                       unified diff of small text files.",
        annotations(title = "Diff sandboxes", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_diff(&self, Parameters(p): Parameters<DiffParams>) -> Result<Json<DiffReport>, ToolError> {
        let mut opts = DiffOptions { unified: p.unified, ..DiffOptions::default() };
        if let Some(max) = p.max_text_bytes {
            opts.max_text_bytes = max;
        }
        self.manager.diff(&p.a, &p.b, opts).await.map(Json).map_err(ToolError::from)
    }

    #[tool(
        description = "Merge a branched sandbox (winner) into the sandbox it was branched from (parent): the \
                       parent's VM is replaced by the winner's, so the parent's id now has the winner's memory, \
                       processes, Python state and files; the winner's id ceases to exist; other children are \
                       untouched.",
        annotations(
            title = "Merge sandbox into its parent",
            read_only_hint = false,
            destructive_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_merge_into(&self, Parameters(p): Parameters<MergeParams>) -> Result<Json<SandboxInfo>, ToolError> {
        let info = self.manager.merge_into(&p.winner, &p.parent).await?;
        self.session.forget(&p.winner).await;
        Ok(Json(info))
    }

    #[tool(
        description = "List sandboxes (all sessions'), optionally only those carrying all the given labels.",
        annotations(title = "List sandboxes", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_list(&self, Parameters(p): Parameters<ListParams>) -> Result<Json<ListResult>, ToolError> {
        Ok(Json(ListResult { sandboxes: self.manager.list(&p.labels) }))
    }

    #[tool(
        description = "A sandbox's state (starting, running, paused, stopped, failed), vCPUs, memory, uptime, labels, \
                       and CPU and memory use.",
        annotations(title = "Sandbox info", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_info(&self, Parameters(p): Parameters<SandboxParams>) -> Result<Json<SandboxInfo>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        self.manager.info(&id).await.map(Json).map_err(ToolError::from)
    }

    #[tool(
        description = "Kill a sandbox: stop its VM and delete everything in it. Without sandbox_id, kills this \
                       session's own sandbox (a new one is made on next use).",
        annotations(
            title = "Kill sandbox",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_kill(&self, Parameters(p): Parameters<SandboxParams>) -> Result<Json<KillResult>, ToolError> {
        let id = match p.sandbox_id {
            Some(id) => id,
            None => self.session.own().await.ok_or(ToolError::NoOwnSandbox)?,
        };
        self.manager.kill(&id).await?;
        self.session.forget(&id).await;
        Ok(Json(KillResult { sandbox_id: id, killed: true }))
    }

    #[tool(
        description = "Pause a sandbox: its vCPUs stop and use no CPU; memory, processes, files and Python state \
                       are kept. sandbox_exec, sandbox_run_python and the file tools resume it by themselves.",
        annotations(
            title = "Pause sandbox",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_pause(&self, Parameters(p): Parameters<SandboxParams>) -> Result<Json<SandboxInfo>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        self.manager.pause(&id).await.map(Json).map_err(ToolError::from)
    }

    #[tool(
        description = "Resume a paused sandbox where it left off.",
        annotations(
            title = "Resume sandbox",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_resume(&self, Parameters(p): Parameters<SandboxParams>) -> Result<Json<SandboxInfo>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        self.manager.resume(&id).await.map(Json).map_err(ToolError::from)
    }

    #[tool(
        description = "Run a bash command in a sandbox and return its exit code, stdout and stderr (each capped \
                       at 32 KiB). The command and its children are killed at the timeout.",
        annotations(title = "Run command", read_only_hint = false, destructive_hint = true, open_world_hint = true)
    )]
    async fn sandbox_exec(&self, Parameters(p): Parameters<ExecParams>) -> Result<Json<ExecResult>, ToolError> {
        let timeout_ms = secs_to_ms(p.timeout_secs)?;
        let id = self.target(p.sandbox_id).await?;
        let req = ExecRequest {
            command: p.command,
            cwd: p.cwd,
            env: p.env.into_iter().collect(),
            stdin: p.stdin.map(String::into_bytes).unwrap_or_default(),
            timeout_ms,
            output_limit: 0,
        };
        let r = self.manager.exec(&id, req).await?;
        Ok(Json(ExecResult::new(id, r)))
    }

    #[tool(
        description = "Run Python code in the sandbox's persistent interpreter: variables, imports and functions \
                       stay defined between calls. Returns the final expression's repr, printed output, and any \
                       exception with its traceback.",
        annotations(title = "Run Python", read_only_hint = false, destructive_hint = true, open_world_hint = true)
    )]
    async fn sandbox_run_python(
        &self,
        Parameters(p): Parameters<PythonParams>,
    ) -> Result<Json<PythonResult>, ToolError> {
        let timeout_ms = secs_to_ms(p.timeout_secs)?;
        let id = self.target(p.sandbox_id).await?;
        let r = self.manager.python(&id, p.code, timeout_ms).await?;
        Ok(Json(PythonResult::new(id, r)))
    }

    #[tool(
        description = "Read a text file from a sandbox (UTF-8, up to 1 MiB per call; use offset to read on). \
                       For binary files use sandbox_download.",
        annotations(title = "Read file", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_files_read(&self, Parameters(p): Parameters<ReadParams>) -> Result<Json<ReadResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let length = p.length.unwrap_or(MAX_READ_BYTES).min(MAX_READ_BYTES);
        let f = self.manager.read_file(&id, p.path.clone(), p.offset, Some(length)).await?;
        let n = f.data.len() as u64;
        let content = String::from_utf8(f.data).map_err(|e| ToolError::NotUtf8 {
            path: p.path.clone(),
            offset: p.offset + e.utf8_error().valid_up_to() as u64,
        })?;
        Ok(Json(ReadResult {
            sandbox_id: id,
            path: p.path,
            content,
            offset: p.offset,
            size: f.size,
            remaining: f.size.saturating_sub(p.offset + n),
        }))
    }

    #[tool(
        description = "Write a text file in a sandbox (replacing it, or appending), making missing parent \
                       directories. For binary data use sandbox_upload.",
        annotations(title = "Write file", read_only_hint = false, destructive_hint = true, open_world_hint = false)
    )]
    async fn sandbox_files_write(
        &self,
        Parameters(p): Parameters<WriteParams>,
    ) -> Result<Json<WriteResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let n = self.manager.write_file(&id, p.path.clone(), p.content.into_bytes(), p.mode, p.append).await?;
        Ok(Json(WriteResult { sandbox_id: id, path: p.path, bytes_written: n }))
    }

    #[tool(
        description = "List a directory in a sandbox: names, kinds, sizes, modes and modification times.",
        annotations(title = "List directory", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_files_list(
        &self,
        Parameters(p): Parameters<ListDirParams>,
    ) -> Result<Json<ListDirResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let path = p.path.unwrap_or_else(|| "/".into());
        let entries = self.manager.list_dir(&id, path.clone()).await?;
        let entries = entries.into_iter().map(Entry::from).collect();
        Ok(Json(ListDirResult { sandbox_id: id, path, entries }))
    }

    #[tool(
        description = "Upload bytes (base64) to a file in a sandbox, at most 8 MiB per call.",
        annotations(title = "Upload file", read_only_hint = false, destructive_hint = true, open_world_hint = false)
    )]
    async fn sandbox_upload(&self, Parameters(p): Parameters<UploadParams>) -> Result<Json<WriteResult>, ToolError> {
        let data = base64::engine::general_purpose::STANDARD.decode(p.data_base64.trim())?;
        if data.len() as u64 > MAX_FILE_CHUNK {
            return Err(ToolError::UploadTooLarge { bytes: data.len() });
        }
        let id = self.target(p.sandbox_id).await?;
        let n = self.manager.write_file(&id, p.path.clone(), data, p.mode, false).await?;
        Ok(Json(WriteResult { sandbox_id: id, path: p.path, bytes_written: n }))
    }

    #[tool(
        description = "Download a file from a sandbox as base64, at most 8 MiB per call (use offset to read on).",
        annotations(title = "Download file", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_download(&self, Parameters(p): Parameters<ReadParams>) -> Result<Json<DownloadResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let max = MAX_FILE_CHUNK;
        let length = p.length.unwrap_or(max).min(max);
        let f = self.manager.read_file(&id, p.path.clone(), p.offset, Some(length)).await?;
        let n = f.data.len() as u64;
        Ok(Json(DownloadResult {
            sandbox_id: id,
            path: p.path,
            data_base64: base64::engine::general_purpose::STANDARD.encode(&f.data),
            offset: p.offset,
            bytes: n,
            size: f.size,
            remaining: f.size.saturating_sub(p.offset + n),
        }))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for TineMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("tine", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Tine gives you isolated Linux microVM sandboxes (Debian with bash and Python 3). Call \
                 sandbox_exec or sandbox_run_python directly to work in this session's own sandbox (made on \
                 first use, removed when the session ends), or sandbox_create for more sandboxes and pass \
                 their sandbox_id. Python state persists between sandbox_run_python calls.",
            )
    }
}
