//! The MCP tools (MCP 2025-06-18 / 2025-11-25, "Tools"): one
//! [`TineMcp`] per MCP session, all sharing the sandbox [`Manager`]. This
//! file owns the tool router (each tool's name, description, annotations
//! and body) and the [`ServerHandler`]; the session's own sandbox, the
//! parameter and result types, and the error messages live in the
//! submodules.
//!
//! Every tool that takes `sandbox_id` also works without it, on the
//! session's sandbox ([`session`]): the one this session created last with
//! `sandbox_create` (after a merge that removed it, the parent it was
//! merged into), else one made on first use and killed when the session
//! ends. Results are structured (`structuredContent`, with the same JSON
//! as text) and fit the result budget ([`budget`]); failures are tool
//! results with `isError: true` and a short message that says what to do
//! next. Schemas are standard JSON Schema ([`schema`]).
//!
//! Long calls report progress when asked ([`progress`]); the session gets
//! log messages about its sandboxes ([`logging`]); background processes
//! have their own tools ([`processes`]).

pub mod bounds;
pub mod budget;
mod errors;
mod files;
pub mod logging;
mod params;
mod processes;
pub mod progress;
mod results;
pub mod schema;
mod session;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::auth::{Auth, Principal};
use crate::cluster::{Cluster, Route, FORWARDED_HEADER};
use crate::files_url::FileUrls;
use crate::metrics::Metrics;
use base64::Engine as _;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::ToolCallContext;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, Implementation, JsonObject, ServerCapabilities,
    ServerConfig,
};
use rmcp::service::{NotificationContext, RequestContext};
use rmcp::{tool, tool_handler, tool_router, ErrorData, Json, RoleServer, ServerHandler};
use tine_protocol::MAX_FILE_CHUNK;
use tine_sandbox::{
    BranchResult, CallContext, DiffOptions, DiffReport, ExecRequest, Manager, Recipe, SandboxInfo, SandboxSpec,
    SandboxUpdate, SetupStep, TemplateInfo,
};

use errors::ToolError;
use logging::SessionLog;
use params::{
    secs_to_ms, BranchParams, CodeLanguage, CreateParams, DiffParams, ExecParams, ListDirParams, ListParams,
    MergeParams, NetworkLogParams, PauseParams, PythonParams, ReadParams, RunCodeParams, SandboxParams, SnapshotParams,
    UpdateParams, UploadParams, WriteParams,
};
use params::{TemplateCreateParams, TemplateDeleteParams};
use progress::Reporter;
use results::TemplateDeleteResult;
use results::{
    DiffResult, DownloadResult, Entry, ExecResult, KillResult, ListDirResult, ListResult, NetworkLogResult,
    PythonResult, ReadResult, TemplateListResult, WriteResult, NETWORK_LOG_MAX,
};
use session::SessionSandbox;

/// Largest chunk `sandbox_files_read` reads at once (bytes): 160 KiB;
/// less is returned when its JSON escape would not fit the content budget
/// (control characters take up to 6 bytes each).
pub const MAX_READ_BYTES: u64 = 160 << 10;
/// Bytes of JSON the text of one `sandbox_files_read` may take: 160 KiB.
const READ_TEXT_BUDGET: usize = 160 << 10;
/// Largest chunk `sandbox_download` returns at once (bytes): 128 KiB, i.e.
/// 171 KiB of base64, sent twice (structured and text), well within
/// [`budget::RESULT_BUDGET`].
pub const MAX_DOWNLOAD_BYTES: u64 = 128 << 10;
/// Longest `template_create { wait_secs }` waits (s): 10 minutes.
pub const MAX_TEMPLATE_WAIT_SECS: u64 = 600;

/// The tool router with standard schemas, built once.
fn router() -> ToolRouter<TineMcp> {
    static ROUTER: OnceLock<ToolRouter<TineMcp>> = OnceLock::new();
    ROUTER
        .get_or_init(|| {
            let mut router = TineMcp::tool_router() + TineMcp::process_router() + TineMcp::files_router();
            fn standard(s: &Arc<JsonObject>) -> Arc<JsonObject> {
                let mut s = JsonObject::clone(s);
                schema::standardize(&mut s);
                Arc::new(s)
            }
            for route in router.map.values_mut() {
                route.attr.input_schema = standard(&route.attr.input_schema);
                route.attr.output_schema = route.attr.output_schema.as_ref().map(standard);
            }
            router
        })
        .clone()
}

/// Tools whose description ends with what network the sandbox has.
const CODE_TOOLS: [&str; 4] = ["sandbox_create", "sandbox_exec", "sandbox_run_python", "sandbox_run_code"];

/// The router for `manager`'s server: the server's network stated in the
/// descriptions of the tools that run code ([`CODE_TOOLS`]), and the
/// bounds of its `[limits]` in the input schemas ([`bounds::apply_limits`]).
fn router_for(manager: &Manager) -> ToolRouter<TineMcp> {
    let mut router = router();
    let network = manager.network_summary();
    for name in CODE_TOOLS {
        if let Some(route) = router.map.get_mut(name) {
            let d = route.attr.description.as_deref().unwrap_or_default();
            route.attr.description = Some(format!("{d} {network}").into());
        }
    }
    bounds::apply_limits(bounds::input_schemas(&mut router), manager.limits());
    router
}

/// The tools as this server lists them, and their arguments' check; made
/// once per server, shared by every session.
pub struct Tools {
    router: ToolRouter<TineMcp>,
    check: bounds::ArgCheck,
}

impl Tools {
    /// The tools of `manager`'s server ([`router_for`]), their schemas
    /// compiled for [`bounds::ArgCheck`].
    ///
    /// Errors: a tool whose input schema is not valid JSON Schema (a bug,
    /// found at start).
    pub fn new(manager: &Manager) -> Result<Self, String> {
        let router = router_for(manager);
        let check =
            bounds::ArgCheck::new(router.map.values().map(|r| (r.attr.name.as_ref(), r.attr.input_schema.as_ref())))?;
        Ok(Tools { router, check })
    }
}

/// One MCP session's handler.
#[derive(Clone)]
pub struct TineMcp {
    manager: Arc<Manager>,
    session: Arc<SessionSandbox>,
    /// The session's key: the `owner` of the sandboxes it makes.
    key: u64,
    /// The session's log level and forwarder.
    log: Arc<SessionLog>,
    /// Signs file URLs (`sandbox_files_url`).
    files: Arc<FileUrls>,
    /// This host and its peers: calls naming another host's sandbox go there.
    cluster: Arc<Cluster>,
    /// Tool calls are counted and timed here.
    metrics: Arc<Metrics>,
    /// The tools (shared by every session, made once per server); every
    /// call's arguments are checked against its tool's schema first.
    tools: Arc<Tools>,
    /// Who the session's calls act as: set from each call's request
    /// (every request of a session is its opener's, [`crate::auth::sessions`]).
    principal: Arc<std::sync::Mutex<Principal>>,
    /// The server's credentials (a tenant's key signs its file URLs).
    auth: Arc<Auth>,
}

/// What a session's handler shares with every other session on the host.
#[derive(Clone)]
pub struct Shared {
    /// The sandboxes.
    pub manager: Arc<Manager>,
    /// Signs file URLs (`sandbox_files_url`).
    pub files: Arc<FileUrls>,
    /// This host and its peers.
    pub cluster: Arc<Cluster>,
    /// The server's metrics.
    pub metrics: Arc<Metrics>,
    /// The tools and their arguments' check.
    pub tools: Arc<Tools>,
    /// The server's credentials.
    pub auth: Arc<Auth>,
}

#[tool_router]
impl TineMcp {
    /// A handler for a new MCP session.
    pub fn new(shared: &Shared) -> Self {
        static NEXT_KEY: AtomicU64 = AtomicU64::new(1);
        let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
        let manager = shared.manager.clone();
        TineMcp {
            session: Arc::new(SessionSandbox::new(manager.clone())),
            manager,
            key,
            log: SessionLog::new(key),
            files: shared.files.clone(),
            cluster: shared.cluster.clone(),
            metrics: shared.metrics.clone(),
            tools: shared.tools.clone(),
            principal: Arc::new(std::sync::Mutex::new(Principal::Admin)),
            auth: shared.auth.clone(),
        }
    }

    /// Who this call acts as.
    fn caller(&self) -> Principal {
        self.principal.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The call context for the manager: this session's key, the caller's
    /// tenant and quota, no progress.
    fn cx(&self) -> CallContext {
        let caller = self.caller();
        CallContext {
            owner: Some(self.key),
            tenant: caller.tenant().map(str::to_string),
            quota: caller.quota(),
            ceiling: self.ceiling(),
            ..CallContext::default()
        }
    }

    /// The caller's network ceiling: a tenant's own, else the server's
    /// default policy; none for the operator.
    fn ceiling(&self) -> Option<tine_sandbox::network::NetworkPolicy> {
        match self.caller() {
            Principal::Admin => None,
            Principal::Tenant(t) => t.ceiling.clone().or_else(|| self.manager.default_network_policy().cloned()),
        }
    }

    /// Refuses a `network` the caller asks for that allows more than its
    /// ceiling ([`tine_sandbox::network::wider_than_ceiling`]).
    fn check_ceiling(&self, asked: Option<&tine_sandbox::network::NetworkPolicy>) -> Result<(), ToolError> {
        let (Some(asked), Some(ceiling)) = (asked, self.ceiling()) else { return Ok(()) };
        match tine_sandbox::network::wider_than_ceiling(asked, &ceiling) {
            Some(why) => Err(ToolError::AboveCeiling { why }),
            None => Ok(()),
        }
    }

    /// The name the template store keeps for the caller's template `name`
    /// (a tenant's are `<tenant>~<name>`; the operator's are the server's).
    fn own_template(&self, name: &str) -> String {
        tine_sandbox::templates::qualified(self.caller().tenant(), name)
    }

    /// The template `name` means to the caller: its own of that name if it
    /// has one, else the server's.
    fn resolve_template(&self, name: &str) -> String {
        let own = self.own_template(name);
        if own != name && self.manager.templates().iter().any(|t| t.name == own) {
            own
        } else {
            name.to_string()
        }
    }

    /// `t` as the caller sees it: a tenant's own templates under their
    /// plain names.
    fn shown_template(&self, mut t: TemplateInfo) -> TemplateInfo {
        if self.caller().tenant().is_some() {
            t.name = tine_sandbox::templates::split_qualified(&t.name).1.to_string();
        }
        t
    }

    /// Refuses a tenant's call that names a sandbox or process that is not
    /// its own, whether another tenant's or none at all, with the same
    /// error at the same point (after the arguments' check, before the
    /// tool runs), so a call tells nothing about other tenants' ids; ids
    /// of other hosts are checked there.
    fn check_owner(&self, args: Option<&JsonObject>) -> Result<(), ToolError> {
        let caller = self.caller();
        if matches!(caller, Principal::Admin) {
            return Ok(());
        }
        for id in crate::cluster::named_ids(args) {
            if crate::cluster::host_of(id).is_some_and(|h| h != self.cluster.host()) {
                continue;
            }
            let sandbox = id.split_once(':').map_or(id, |(s, _)| s);
            match self.manager.tenant_of(sandbox) {
                Some(owner) if caller.owns(owner.as_deref()) => {}
                _ => return Err(tine_sandbox::SandboxError::NotFound(sandbox.to_string()).into()),
            }
        }
        Ok(())
    }

    /// The sandbox a call is about: the given id, or the session's
    /// sandbox (see [`session`]); made on first use without progress.
    async fn target(&self, id: Option<String>) -> Result<String, ToolError> {
        self.target_with(id, &self.cx()).await
    }

    /// As [`TineMcp::target`], a first-use creation reporting to `cx`. The
    /// sandbox is watched by the session's log from now on.
    async fn target_with(&self, id: Option<String>, cx: &CallContext) -> Result<String, ToolError> {
        let id = self.session.target_with(id, cx).await?;
        self.watch(&id);
        Ok(id)
    }

    /// The session's log follows sandbox `id` from now on, if it exists:
    /// a name given for a sandbox not (yet) made must not route a later
    /// sandbox's messages to this session (ids are predictable).
    fn watch(&self, id: &str) {
        if self.manager.contains(id) {
            self.log.watch(id);
        }
    }

    #[tool(
        description = "Create a new sandbox: an isolated Linux microVM (Debian, bash, Python 3, Node.js) with its own \
                       kernel. Returns its sandbox_id. It becomes this session's sandbox: tools called without \
                       sandbox_id use the sandbox this session created last. Reports progress (cold boot, \
                       waiting for the default template) when the request has a progressToken.",
        annotations(
            title = "Create sandbox",
            read_only_hint = false,
            destructive_hint = false,
            open_world_hint = false
        )
    )]
    async fn sandbox_create(
        &self,
        Parameters(p): Parameters<CreateParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<SandboxInfo>, ToolError> {
        let spec = SandboxSpec {
            vcpus: p.vcpus,
            memory_mib: p.memory_mib,
            labels: p.labels,
            idle_timeout_secs: p.idle_timeout_secs,
            template: p.template.map(|t| self.resolve_template(&t)),
            network: p.network.map(|n| n.into_policy()),
            env: p.env,
        };
        self.check_ceiling(spec.network.as_ref())?;
        let info = Reporter::around(&ctx, self.cx(), async |cx| self.manager.create_with(spec, cx).await).await?;
        self.log.watch(&info.sandbox_id);
        self.session.created(&info.sandbox_id).await;
        Ok(Json(info))
    }

    #[tool(
        description = "List templates: snapshots of a ready sandbox that sandbox_create { template } starts from \
                       in a fraction of a boot's time. 'default' is what sandbox_create uses when none is named.",
        annotations(title = "List templates", read_only_hint = true, open_world_hint = false)
    )]
    async fn template_list(&self) -> Result<Json<TemplateListResult>, ToolError> {
        let caller = self.caller();
        let mut templates: Vec<TemplateInfo> = self
            .manager
            .templates()
            .into_iter()
            .filter(|t| match tine_sandbox::templates::split_qualified(&t.name).0 {
                None => true,
                owner => caller.owns(owner),
            })
            .map(|t| self.shown_template(t))
            .collect();
        let truncated = budget::fit_list(&mut templates, budget::CONTENT_BUDGET - 64) > 0;
        Ok(Json(TemplateListResult { templates, truncated }))
    }

    #[tool(
        description = "Build a template from a recipe in the background: start a sandbox from `from` (default: \
                       the default template) with env, write files, run each setup command in order (each with its \
                       own deadline; the first failure stops the build and is reported with its output), and \
                       snapshot the result as `name`. Returns at once with state \"building\" (or waits up to \
                       wait_secs); template_list shows building (with the step), ready or failed (with the \
                       reason). Then sandbox_create { template: name }.",
        annotations(
            title = "Build template",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = true
        )
    )]
    async fn template_create(
        &self,
        Parameters(p): Parameters<TemplateCreateParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<TemplateInfo>, ToolError> {
        let recipe = Recipe {
            name: self.own_template(&p.name),
            from: p.from.map(|f| self.resolve_template(&f)),
            vcpus: p.vcpus,
            memory_mib: p.memory_mib,
            env: p.env,
            files: p.files,
            setup: p.setup.into_iter().map(SetupStep::Command).collect(),
            step_timeout_secs: p.step_timeout_secs,
        };
        let name = recipe.name.clone();
        let started = self.manager.start_template_build(recipe, &self.cx())?;
        let wait = Duration::from_secs(p.wait_secs.unwrap_or(0).min(MAX_TEMPLATE_WAIT_SECS));
        if wait.is_zero() {
            return Ok(Json(self.shown_template(started)));
        }
        let info = Reporter::around(&ctx, self.cx(), async |cx| {
            self.manager.wait_template_build(&name, wait, &cx.progress).await
        })
        .await?;
        Ok(Json(self.shown_template(info)))
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
        self.manager.template_delete(&self.own_template(&p.name)).await.map_err(ToolError::from)?;
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
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<TemplateInfo>, ToolError> {
        Reporter::around(&ctx, self.cx(), async |cx| {
            let id = self.target_with(p.sandbox_id, cx).await?;
            let made = self.manager.snapshot_with(&id, &self.own_template(&p.name), cx).await?;
            Ok(Json(self.shown_template(made)))
        })
        .await
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
    async fn sandbox_branch(
        &self,
        Parameters(p): Parameters<BranchParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<BranchResult>, ToolError> {
        Reporter::around(&ctx, self.cx(), async |cx| {
            let id = self.target_with(p.sandbox_id, cx).await?;
            Ok(Json(self.manager.branch_with(&id, p.n, cx).await?))
        })
        .await
    }

    #[tool(
        description = "Compare two sandboxes' filesystems (everything written since boot, and /tmp): the paths \
                       added, removed and modified from a to b, with size, mode and SHA-256, and on request a \
                       unified diff of small text files. A report larger than the result budget is cut \
                       (report_truncated, total_changes).",
        annotations(title = "Diff sandboxes", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_diff(&self, Parameters(p): Parameters<DiffParams>) -> Result<Json<DiffResult>, ToolError> {
        let mut opts = DiffOptions { unified: p.unified, ..DiffOptions::default() };
        if let Some(max) = p.max_text_bytes {
            opts.max_text_bytes = max;
        }
        self.watch(&p.a);
        self.watch(&p.b);
        let report: DiffReport = self.manager.diff(&p.a, &p.b, opts).await?;
        Ok(Json(DiffResult::new(report, budget::CONTENT_BUDGET)))
    }

    #[tool(
        description = "Merge a branched sandbox (winner) into the sandbox it was branched from (parent): the \
                       parent's VM is replaced by the winner's, so the parent's id now has the winner's memory, \
                       processes, Python state and files; the winner's id ceases to exist; other children are \
                       untouched. A session that used the winner as its sandbox now uses the parent.",
        annotations(
            title = "Merge sandbox into its parent",
            read_only_hint = false,
            destructive_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_merge_into(&self, Parameters(p): Parameters<MergeParams>) -> Result<Json<SandboxInfo>, ToolError> {
        self.watch(&p.parent);
        let info = self.manager.merge_into(&p.winner, &p.parent).await?;
        self.session.merged(&p.winner, &p.parent).await;
        Ok(Json(info))
    }

    #[tool(
        description = "List your sandboxes (every session's of your key), optionally only those carrying all the \
                       given labels.",
        annotations(title = "List sandboxes", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_list(&self, Parameters(p): Parameters<ListParams>) -> Result<Json<ListResult>, ToolError> {
        let caller = self.caller();
        let mut sandboxes = self.manager.list(&p.labels);
        sandboxes.retain(|s| caller.owns(s.tenant.as_deref()));
        let total = sandboxes.len() as u64;
        let truncated = budget::fit_list(&mut sandboxes, budget::CONTENT_BUDGET - 128) > 0;
        Ok(Json(ListResult { sandboxes, total, truncated }))
    }

    #[tool(
        description = "A sandbox's state (starting, running, paused, stopped, failed), vCPUs, memory, uptime, labels, \
                       outbound network policy, and CPU and memory use.",
        annotations(title = "Sandbox info", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_info(&self, Parameters(p): Parameters<SandboxParams>) -> Result<Json<SandboxInfo>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        self.manager.info(&id).await.map(Json).map_err(ToolError::from)
    }

    #[tool(
        description = "Change a sandbox's settings; each one given replaces the old: env (variables every \
                       later exec, background process and Python cell gets), labels, idle_timeout_secs, and \
                       network (egress \"allow\" or \"deny\", allow and deny lists of domains, *.domains, \
                       addresses and CIDRs; connections opened from then on follow it). A refused value changes \
                       nothing. Returns the sandbox's info.",
        annotations(
            title = "Update sandbox",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_update(&self, Parameters(p): Parameters<UpdateParams>) -> Result<Json<SandboxInfo>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let update = SandboxUpdate {
            labels: p.labels,
            idle_timeout_secs: p.idle_timeout_secs,
            env: p.env,
            network: p.network.map(|n| n.into_policy()),
        };
        self.check_ceiling(update.network.as_ref())?;
        self.manager.update(&id, update).await.map(Json).map_err(ToolError::from)
    }

    #[tool(
        description = "A sandbox's network log: its outbound connections, UDP flows and DNS queries, oldest \
                       first, each with time, protocol, destination, domain, verdict and the rule that decided, \
                       bytes each way and duration. Page with since_ms and limit (at most 200).",
        annotations(title = "Network log", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_network_log(
        &self,
        Parameters(p): Parameters<NetworkLogParams>,
    ) -> Result<Json<NetworkLogResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let limit = p.limit.unwrap_or(NETWORK_LOG_MAX).clamp(1, NETWORK_LOG_MAX);
        let log = self.manager.network_log(&id, p.since_ms.unwrap_or(0), limit)?;
        Ok(Json(NetworkLogResult::new(id, log, limit)))
    }

    #[tool(
        description = "Kill a sandbox: stop its VM and delete everything in it. Without sandbox_id, kills this \
                       session's sandbox (the one it created last, or the one made on first use; a new one is \
                       made on next use).",
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
            None => self.session.current().await.ok_or(ToolError::NoOwnSandbox)?,
        };
        self.watch(&id);
        self.manager.kill(&id).await?;
        self.session.forget(&id).await;
        Ok(Json(KillResult { sandbox_id: id, killed: true }))
    }

    #[tool(
        description = "Pause a sandbox: its vCPUs stop and use no CPU; memory, processes, files and Python state \
                       are kept. With to_disk: true it is hibernated: its state goes to disk, its memory is freed, \
                       and it survives a server restart. sandbox_exec, sandbox_run_python and the file tools \
                       resume it by themselves.",
        annotations(
            title = "Pause sandbox",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_pause(&self, Parameters(p): Parameters<PauseParams>) -> Result<Json<SandboxInfo>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let paused = if p.to_disk { self.manager.hibernate(&id).await } else { self.manager.pause(&id).await };
        paused.map(Json).map_err(ToolError::from)
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
        description = "Run a bash command (command) or a program without a shell (argv) in a sandbox and \
                       return its exit code, stdout and stderr (each cut \
                       at 32 KiB, and further to fit the result budget; truncated says so, stdout_bytes and \
                       stderr_bytes give the full sizes). The command and its children are killed at the \
                       timeout; with a progressToken, progress (elapsed time, output so far, last lines) is \
                       reported while it runs. background: true returns at once with a process_id instead (no \
                       timeout; stdin stays open): follow it with sandbox_process_wait, _output, _write, _kill \
                       and _list. Background processes get PYTHONUNBUFFERED=1, keep the last 256 KiB of each \
                       stream, survive pause/resume, snapshots, templates and branches, and do not keep the \
                       sandbox alive: its idle timeout counts tool calls only.",
        annotations(title = "Run command", read_only_hint = false, destructive_hint = true, open_world_hint = true)
    )]
    async fn sandbox_exec(
        &self,
        Parameters(mut p): Parameters<ExecParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<ExecResult>, ToolError> {
        let (command, argv) = p.command_or_argv()?;
        if p.background {
            return self.exec_background(p, command, argv).await;
        }
        let timeout_ms = secs_to_ms(p.timeout_secs)?;
        let req = ExecRequest {
            command,
            argv,
            cwd: p.cwd,
            env: p.env.into_iter().collect(),
            stdin: p.stdin.map(String::into_bytes).unwrap_or_default(),
            timeout_ms,
            output_limit: 0,
        };
        Reporter::around(&ctx, self.cx(), async |cx| {
            let id = self.target_with(p.sandbox_id, cx).await?;
            let r = self.manager.exec_with(&id, req, cx).await?;
            Ok(Json(ExecResult::new(id, r)))
        })
        .await
    }

    #[tool(
        description = "Run Python code in the sandbox's persistent interpreter: variables, imports and functions \
                       stay defined between calls. Returns the final expression's repr (cut at 64 KiB: \
                       result_truncated, result_bytes), printed output (cut at 32 KiB per stream), and any \
                       exception with its traceback.",
        annotations(title = "Run Python", read_only_hint = false, destructive_hint = true, open_world_hint = true)
    )]
    async fn sandbox_run_python(
        &self,
        Parameters(p): Parameters<PythonParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<PythonResult>, ToolError> {
        let timeout_ms = secs_to_ms(p.timeout_secs)?;
        // Progress only for a sandbox made on first use.
        let id = Reporter::around(&ctx, self.cx(), async |cx| self.target_with(p.sandbox_id, cx).await).await?;
        let r = self.manager.python(&id, p.code, timeout_ms).await?;
        Ok(Json(PythonResult::new(id, r)))
    }

    #[tool(
        description = "Run code in one of the sandbox's persistent interpreters, language \"python\" (as \
                       sandbox_run_python) or \"javascript\" (Node.js: top-level let/const/function and await \
                       work; variables stay defined between calls). Returns the final expression's value (Python \
                       repr, JS util.inspect; cut at 64 KiB), printed output (cut at 32 KiB per stream, child \
                       processes included), and any error with its traceback or stack.",
        annotations(title = "Run code", read_only_hint = false, destructive_hint = true, open_world_hint = true)
    )]
    async fn sandbox_run_code(
        &self,
        Parameters(p): Parameters<RunCodeParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<PythonResult>, ToolError> {
        let timeout_ms = secs_to_ms(p.timeout_secs)?;
        let id = Reporter::around(&ctx, self.cx(), async |cx| self.target_with(p.sandbox_id, cx).await).await?;
        let r = match p.language {
            CodeLanguage::Python => self.manager.python(&id, p.code, timeout_ms).await?,
            CodeLanguage::Javascript => self.manager.node(&id, p.code, timeout_ms).await?,
        };
        Ok(Json(PythonResult::new(id, r)))
    }

    #[tool(
        description = "Read a text file from a sandbox (UTF-8, up to 160 KiB per call, less when the text \
                       needs much JSON escaping; read on with offset: next_offset). For binary files use \
                       sandbox_download.",
        annotations(title = "Read file", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_files_read(&self, Parameters(p): Parameters<ReadParams>) -> Result<Json<ReadResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let length = p.length.unwrap_or(MAX_READ_BYTES).min(MAX_READ_BYTES);
        let f = self.manager.read_file(&id, p.path.clone(), p.offset, Some(length)).await?;
        let read = f.data.len();
        let mut data = f.data;
        if let Err(e) = std::str::from_utf8(&data) {
            // A character cut by the chunk's end is read next time.
            let cut_at_end = e.error_len().is_none() && read as u64 == length && e.valid_up_to() > 0;
            if !cut_at_end {
                return Err(ToolError::NotUtf8 {
                    path: p.path,
                    offset: p.offset.saturating_add(e.valid_up_to() as u64),
                });
            }
            data.truncate(e.valid_up_to());
        }
        let text = String::from_utf8(data).unwrap_or_default();
        let content = budget::cut(text, READ_TEXT_BUDGET).text;
        let n = content.len() as u64;
        Ok(Json(ReadResult {
            sandbox_id: id,
            path: p.path,
            content,
            offset: p.offset,
            bytes: n,
            next_offset: p.offset.saturating_add(n),
            size: f.size,
            remaining: f.size.saturating_sub(p.offset.saturating_add(n)),
            truncated: n < read as u64,
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
        if p.content.len() as u64 > MAX_FILE_CHUNK {
            return Err(ToolError::WriteTooLargeForOneCall { bytes: p.content.len() });
        }
        let id = self.target(p.sandbox_id).await?;
        let n = self.manager.write_file(&id, p.path.clone(), p.content.into_bytes(), p.mode, p.append).await?;
        Ok(Json(WriteResult { sandbox_id: id, path: p.path, bytes_written: n }))
    }

    #[tool(
        description = "List a directory in a sandbox: names, kinds, sizes, modes and modification times. A \
                       directory too large for the result budget lists its first entries (truncated, \
                       total_entries).",
        annotations(title = "List directory", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_files_list(
        &self,
        Parameters(p): Parameters<ListDirParams>,
    ) -> Result<Json<ListDirResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let path = p.path.unwrap_or_else(|| "/".into());
        let entries = self.manager.list_dir(&id, path.clone()).await?;
        let mut entries: Vec<Entry> = entries.into_iter().map(Entry::from).collect();
        let total_entries = entries.len() as u64;
        let room = budget::CONTENT_BUDGET.saturating_sub(256 + budget::escaped_len(&path) + budget::escaped_len(&id));
        let truncated = budget::fit_list(&mut entries, room) > 0;
        Ok(Json(ListDirResult { sandbox_id: id, path, entries, total_entries, truncated }))
    }

    #[tool(
        description = "Upload bytes (base64) to a file in a sandbox, at most 8 MiB per call.",
        annotations(title = "Upload file", read_only_hint = false, destructive_hint = true, open_world_hint = false)
    )]
    async fn sandbox_upload(&self, Parameters(p): Parameters<UploadParams>) -> Result<Json<WriteResult>, ToolError> {
        let data = base64::engine::general_purpose::STANDARD.decode(p.data_base64.trim())?;
        if data.len() as u64 > MAX_FILE_CHUNK {
            return Err(ToolError::WriteTooLargeForOneCall { bytes: data.len() });
        }
        let id = self.target(p.sandbox_id).await?;
        let n = self.manager.write_file(&id, p.path.clone(), data, p.mode, false).await?;
        Ok(Json(WriteResult { sandbox_id: id, path: p.path, bytes_written: n }))
    }

    #[tool(
        description = "Download a file from a sandbox as base64, at most 128 KiB (131072 bytes) per call: call \
                       again with offset: next_offset until remaining is 0.",
        annotations(title = "Download file", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_download(&self, Parameters(p): Parameters<ReadParams>) -> Result<Json<DownloadResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let max = MAX_DOWNLOAD_BYTES;
        let length = p.length.unwrap_or(max).min(max);
        let f = self.manager.read_file(&id, p.path.clone(), p.offset, Some(length)).await?;
        let n = f.data.len() as u64;
        Ok(Json(DownloadResult {
            sandbox_id: id,
            path: p.path,
            data_base64: base64::engine::general_purpose::STANDARD.encode(&f.data),
            offset: p.offset,
            bytes: n,
            next_offset: p.offset.saturating_add(n),
            size: f.size,
            remaining: f.size.saturating_sub(p.offset.saturating_add(n)),
        }))
    }
}

/// A failed call's message as a tenant sees it: its templates under their
/// own names (`"data"`, not the stored `"acme~data"`).
fn own_names(caller: &Principal, mut r: CallToolResult) -> CallToolResult {
    let Some(tenant) = caller.tenant() else { return r };
    if r.is_error == Some(true) {
        let stored = format!("\"{tenant}{}", tine_sandbox::templates::TENANT_SEPARATOR);
        for c in &mut r.content {
            if let rmcp::model::ContentBlock::Text(t) = c {
                t.text = t.text.replace(&stored, "\"");
            }
        }
    }
    r
}

#[tool_handler(router = self.tools.router)]
impl ServerHandler for TineMcp {
    /// Checks the arguments against the tool's input schema
    /// ([`bounds::ArgCheck`]: a call out of bounds is refused before any
    /// work, here or on a peer), runs the tool here, or on the host its ids
    /// name ([`Cluster::route`]), then [`budget::guard`]: a result over
    /// the budget is replaced by an error, never sent. Counted and timed in
    /// the metrics.
    async fn call_tool(
        &self,
        mut request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let tool = request.name.clone();
        let started = Instant::now();
        let parts = context.extensions.get::<axum::http::request::Parts>();
        let forwarded_by =
            parts.and_then(|p| p.headers.get(FORWARDED_HEADER)).and_then(|v| v.to_str().ok()).map(str::to_string);
        // No principal: a request that did not come through the server's
        // HTTP layer (unit tests), which has the operator's rights there.
        let caller = parts.and_then(|p| p.extensions.get::<Principal>()).cloned().unwrap_or(Principal::Admin);
        *self.principal.lock().unwrap_or_else(|p| p.into_inner()) = caller.clone();
        let refused = |message: String| CallToolResult::error(vec![rmcp::model::ContentBlock::text(message)]);
        let ids: Vec<String> = crate::cluster::named_ids(request.arguments.as_ref()).map(str::to_string).collect();
        let route = self
            .tools
            .check
            .check(&tool, &mut request.arguments)
            .and_then(|()| self.check_owner(request.arguments.as_ref()).map_err(|e| e.to_string()))
            .and_then(|()| {
                self.cluster
                    .route(&tool, request.arguments.as_ref(), forwarded_by.as_deref())
                    .map_err(|e| e.to_string())
            });
        let response = match route {
            Ok(Route::Local) => {
                let tcc = ToolCallContext::new(self, request, context);
                self.tools.router.call(tcc).await
            }
            Ok(Route::Forward { host, url }) => Ok(CallToolResponse::Complete(
                self.cluster.forward(&host, &url, request, &caller).await.unwrap_or_else(|e| refused(e.to_string())),
            )),
            Err(message) => Ok(CallToolResponse::Complete(refused(message))),
        };
        let response = response.map(|r| match r {
            CallToolResponse::Complete(r) => CallToolResponse::Complete(budget::guard(&tool, own_names(&caller, r))),
            other => other,
        });
        let ok = match &response {
            Ok(CallToolResponse::Complete(r)) => r.is_error != Some(true),
            Ok(_) => true,
            Err(_) => false,
        };
        // Known tools only: a client's made-up names must not grow the series.
        let label = if self.tools.router.map.contains_key(tool.as_ref()) { tool.as_ref() } else { "unknown" };
        let elapsed = started.elapsed();
        crate::audit::tool_call(caller.name(), self.key, label, &ids, ok, elapsed);
        self.metrics.tool_call(label, caller.name(), elapsed, ok);
        response
    }

    /// The session is ready: sandbox events start flowing to it as log
    /// messages ([`logging`]).
    async fn on_initialized(&self, ctx: NotificationContext<RoleServer>) {
        self.log.start(ctx.peer, self.manager.subscribe_events());
    }

    /// `logging/setLevel`: the least level of this session's log messages.
    #[allow(deprecated)]
    async fn set_level(
        &self,
        request: rmcp::model::SetLevelRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        self.log.set_level(request.level);
        self.log.start(ctx.peer.clone(), self.manager.subscribe_events());
        Ok(())
    }

    #[allow(deprecated)]
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_logging().enable_tools().build())
            .with_server_info(Implementation::new("tine", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Tine gives you isolated Linux microVM sandboxes (Debian with bash and Python 3). Tools called \
                 without sandbox_id use this session's sandbox: the one this session created last with \
                 sandbox_create (after sandbox_merge_into removed it, the parent it was merged into), else one \
                 made on first use (removed when the session ends). Pass sandbox_id to use another. Python \
                 state persists between sandbox_run_python calls. Every result fits a 512 KiB budget: long \
                 output is cut and marked truncated with its full size; read files in chunks with offset. \
                 sandbox_exec { background: true } starts servers and long jobs; follow them with the \
                 sandbox_process_* tools. Long calls report progress when the request has a progressToken; \
                 log messages (logging/setLevel, default warning) tell this session about its sandboxes.",
            )
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;

    /// What in `schema` (at `at`) is not bounded: an integer without
    /// `minimum` and `maximum`, a string without `maxLength`, a list
    /// without `maxItems`, a map without `maxProperties` or bounded keys;
    /// `$ref`s are followed into `defs`.
    fn unbounded(schema: &Value, defs: &Value, at: &str, out: &mut Vec<String>) {
        if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
            let name = r.trim_start_matches("#/$defs/");
            return unbounded(&defs[name], defs, at, out);
        }
        for key in ["anyOf", "oneOf", "allOf"] {
            for (i, s) in schema.get(key).and_then(Value::as_array).into_iter().flatten().enumerate() {
                unbounded(s, defs, &format!("{at}/{key}/{i}"), out);
            }
        }
        if schema.get("enum").is_some() || schema.get("const").is_some() {
            return;
        }
        let types: Vec<&str> = match schema.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        let has = |k: &str| schema.get(k).is_some_and(Value::is_number);
        for t in types {
            match t {
                "integer" | "number" if !(has("minimum") && has("maximum")) => {
                    out.push(format!("{at}: a number without minimum and maximum"))
                }
                "string" if !has("maxLength") => out.push(format!("{at}: a string without maxLength")),
                "array" => {
                    if !has("maxItems") {
                        out.push(format!("{at}: a list without maxItems"));
                    }
                    if let Some(items) = schema.get("items") {
                        unbounded(items, defs, &format!("{at}/items"), out);
                    }
                }
                "object" => {
                    for (name, p) in schema.get("properties").and_then(Value::as_object).into_iter().flatten() {
                        unbounded(p, defs, &format!("{at}/{name}"), out);
                    }
                    if let Some(values) = schema.get("additionalProperties").filter(|v| v.is_object()) {
                        if !has("maxProperties") {
                            out.push(format!("{at}: a map without maxProperties"));
                        }
                        if !schema["propertyNames"].get("maxLength").is_some_and(Value::is_number) {
                            out.push(format!("{at}: a map whose keys have no maxLength"));
                        }
                        unbounded(values, defs, &format!("{at}/*"), out);
                    }
                }
                _ => {}
            }
        }
    }

    /// Every argument of every tool, as `tools/list` sends it, carries its
    /// bounds, so a tool added later cannot take an unbounded count or size
    /// without failing here; and every input schema compiles for the check.
    #[test]
    fn every_tool_argument_is_bounded() {
        let mut router = router();
        let limits = tine_sandbox::Limits { max_sandboxes: 7, max_labels: 5, ..Default::default() };
        bounds::apply_limits(bounds::input_schemas(&mut router), &limits);
        let tools = router.list_all();
        let mut found = Vec::new();
        for t in &tools {
            let schema = Value::Object(JsonObject::clone(&t.input_schema));
            unbounded(&schema, &schema["$defs"], &t.name, &mut found);
        }
        assert!(found.is_empty(), "unbounded arguments:\n{}", found.join("\n"));
        let schema =
            |tool: &str| Value::Object(JsonObject::clone(&tools.iter().find(|t| t.name == tool).unwrap().input_schema));
        // The configured limits are what the schemas say.
        assert_eq!(schema("sandbox_branch")["properties"]["n"]["maximum"], 7);
        assert_eq!(schema("sandbox_create")["properties"]["labels"]["maxProperties"], 5);
        assert_eq!(schema("sandbox_create")["properties"]["memory_mib"]["maximum"], limits.max_memory_mib);
        let check = bounds::ArgCheck::new(tools.iter().map(|t| (t.name.as_ref(), t.input_schema.as_ref())))
            .expect("every input schema compiles");
        let args = |v: Value| v.as_object().cloned();
        assert!(check.check("sandbox_branch", &mut args(json!({"n": 7}))).is_ok());
        let e = check.check("sandbox_branch", &mut args(json!({"n": 8}))).unwrap_err();
        assert!(e.starts_with("sandbox_branch: n (8) is greater than the maximum of 7"), "{e}");
    }

    /// Every tool's input and output schema, as `tools/list` sends them,
    /// uses only standard JSON Schema keywords and formats.
    #[test]
    fn every_tool_schema_is_standard_json_schema() {
        let tools = router().list_all();
        assert!(tools.len() >= 20, "{} tools", tools.len());
        for name in [
            "sandbox_process_list",
            "sandbox_process_output",
            "sandbox_process_wait",
            "sandbox_process_write",
            "sandbox_process_kill",
        ] {
            assert!(tools.iter().any(|t| t.name == name), "{name} is listed");
        }
        let exec = tools.iter().find(|t| t.name == "sandbox_exec").unwrap();
        assert!(exec.input_schema["properties"].get("background").is_some(), "sandbox_exec takes background");
        let mut found = Vec::new();
        for t in &tools {
            found.extend(schema::nonstandard(&t.input_schema, &format!("{}: input #", t.name)));
            let output = t.output_schema.as_ref().unwrap_or_else(|| panic!("{} has no output schema", t.name));
            found.extend(schema::nonstandard(output, &format!("{}: output #", t.name)));
        }
        assert!(found.is_empty(), "non-standard JSON Schema:\n{}", found.join("\n"));
        // The raw schemars output has them; the check would catch them.
        let raw = (TineMcp::tool_router() + TineMcp::process_router()).list_all();
        let raw_found: usize =
            raw.iter().filter_map(|t| t.output_schema.as_ref()).map(|s| schema::nonstandard(s, "#").len()).sum();
        assert!(raw_found > 0, "schemars emits width formats; the check finds them");
        // The bound a width format implied is kept.
        let create = tools.iter().find(|t| t.name == "sandbox_create").unwrap();
        let out = serde_json::Value::Object(JsonObject::clone(create.output_schema.as_ref().unwrap()));
        assert!(out.to_string().contains("\"maximum\""), "{out}");
    }
}
