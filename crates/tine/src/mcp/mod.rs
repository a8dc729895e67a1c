//! The MCP tools (MCP 2025-06-18 / 2025-11-25, "Tools"): one
//! [`TineMcp`] per MCP session, all sharing the sandbox [`Manager`]. The
//! tools themselves (each one's name, description, annotations, body,
//! parameter and result types) are in [`tools`], one file per family;
//! this file owns the handler: [`TineMcp`] and what every tool uses (the
//! caller, the call context, the owner check, the sandbox a call is
//! about), the router as the server lists it ([`Tools`]), and the
//! [`ServerHandler`] that checks, routes, runs and measures each call.
//! The session's own sandbox and the error messages live in the other
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
//! log messages about its sandboxes ([`logging`]).

pub mod bounds;
pub mod budget;
mod errors;
pub mod logging;
pub mod progress;
pub mod schema;
mod session;
mod tools;
pub mod toolsets;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crate::auth::{Auth, Principal};
use crate::cluster::{Cluster, Route, FORWARDED_HEADER};
use crate::files_url::FileUrls;
use crate::metrics::Metrics;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::ToolCallContext;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, Implementation, JsonObject, ServerCapabilities,
    ServerConfig,
};
use rmcp::service::{NotificationContext, RequestContext};
use rmcp::{tool_handler, ErrorData, RoleServer, ServerHandler};
use tine_sandbox::{CallContext, Manager, TemplateInfo};

use errors::ToolError;
use logging::SessionLog;
use session::SessionSandbox;

/// The tool router with standard schemas, built once.
fn router() -> ToolRouter<TineMcp> {
    static ROUTER: OnceLock<ToolRouter<TineMcp>> = OnceLock::new();
    ROUTER
        .get_or_init(|| {
            let mut router = tools::router();
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
const CODE_TOOLS: [&str; 1] = ["sandbox_create"];

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
    /// Each tool's input schema with its maps as arrays of pairs, as every
    /// toolset but `full` lists it ([`toolsets::with_pairs`]), and as a
    /// toolset with `core` lists it (fewer parameters,
    /// [`toolsets::CORE_PARAMETERS`]).
    pairs: std::collections::BTreeMap<String, (Arc<JsonObject>, Arc<JsonObject>)>,
    /// The toolset of a connection that names none (`[mcp] tools`).
    default: toolsets::Toolset,
}

impl Tools {
    /// The tools of `manager`'s server ([`router_for`]), their schemas
    /// compiled for [`bounds::ArgCheck`]; `default` is the toolset of
    /// connections that name none.
    ///
    /// Errors: a tool whose input schema is not valid JSON Schema (a bug,
    /// found at start).
    pub fn new(manager: &Manager, default: toolsets::Toolset) -> Result<Self, String> {
        let router = router_for(manager);
        let check =
            bounds::ArgCheck::new(router.map.values().map(|r| (r.attr.name.as_ref(), r.attr.input_schema.as_ref())))?;
        let pairs = router
            .map
            .values()
            .map(|r| {
                let pairs = toolsets::with_pairs(&r.attr.input_schema);
                let core = match toolsets::CORE_PARAMETERS.iter().find(|(t, _)| *t == r.attr.name) {
                    Some((_, keep)) => Arc::new(toolsets::trimmed(&pairs, keep)),
                    None => pairs.clone(),
                };
                (r.attr.name.to_string(), (pairs, core))
            })
            .collect();
        let tools = Tools { router, check, pairs, default };
        if let Ok(core) = toolsets::Toolset::parse("core") {
            let listed = tools.listed(&core);
            let cost: usize = listed.iter().map(toolsets::cost).sum();
            if listed.len() > toolsets::CORE_MAX_TOOLS || cost > toolsets::CORE_MAX_CHARS {
                tracing::warn!(
                    "the core toolset has {} tools and {cost} characters, more than its {} and {}",
                    listed.len(),
                    toolsets::CORE_MAX_TOOLS,
                    toolsets::CORE_MAX_CHARS
                );
            }
        }
        Ok(tools)
    }

    /// The tools `set` lists, with its schemas.
    pub fn listed(&self, set: &toolsets::Toolset) -> Vec<rmcp::model::Tool> {
        let mut tools: Vec<rmcp::model::Tool> =
            self.router.list_all().into_iter().filter(|t| set.has(&t.name)).collect();
        if set.pairs() {
            for t in &mut tools {
                if let Some((pairs, core)) = self.pairs.get(t.name.as_ref()) {
                    t.input_schema = if set.core() { core.clone() } else { pairs.clone() };
                }
            }
        }
        tools
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
    /// Preview URLs (`sandbox_preview_url`).
    previews: Arc<crate::preview::Previews>,
    /// Published host ports (`sandbox_create { ports }`).
    ports: Arc<crate::published_ports::Publisher>,
    /// The secrets store (`secret_list`).
    secrets: Option<Arc<crate::secrets::Store>>,
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
    /// Preview URLs (`sandbox_preview_url`).
    pub previews: Arc<crate::preview::Previews>,
    /// Published host ports.
    pub ports: Arc<crate::published_ports::Publisher>,
    /// The secrets store.
    pub secrets: Option<Arc<crate::secrets::Store>>,
    /// This host and its peers.
    pub cluster: Arc<Cluster>,
    /// The server's metrics.
    pub metrics: Arc<Metrics>,
    /// The tools and their arguments' check.
    pub tools: Arc<Tools>,
    /// The server's credentials.
    pub auth: Arc<Auth>,
}

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
            previews: shared.previews.clone(),
            ports: shared.ports.clone(),
            secrets: shared.secrets.clone(),
            cluster: shared.cluster.clone(),
            metrics: shared.metrics.clone(),
            tools: shared.tools.clone(),
            principal: Arc::new(std::sync::Mutex::new(Principal::Admin)),
            auth: shared.auth.clone(),
        }
    }

    /// Ends the session now (a session served on stdio, whose handler
    /// outlives its transport): the sandbox it made on first use is killed
    /// and waited for.
    pub async fn end_session(&self) {
        self.session.end().await;
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

    /// Puts sandbox ids in place of sandbox names (`sandbox_create {
    /// name }`) in the arguments that take a sandbox (`sandbox_id`, `a`,
    /// `b`, `winner`, `parent`), as `caller` names its sandboxes. A value
    /// shaped like an id (`sb-...`) is left as it is, and so is a name this
    /// host does not know: names are per host (in a cluster, call the host
    /// that holds the sandbox, or use its id, which names its host), and
    /// the call then answers as for an unknown sandbox.
    fn resolve_names(&self, args: &mut JsonObject, caller: &Principal) {
        for key in ["sandbox_id", "a", "b", "winner", "parent"] {
            let Some(serde_json::Value::String(v)) = args.get(key) else { continue };
            if v.starts_with("sb-") || v.is_empty() {
                continue;
            }
            if let Some(id) = self.manager.resolve(caller.tenant(), v) {
                args.insert(key.to_string(), serde_json::Value::String(id));
            }
        }
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
}

/// `s` quoted for bash: inside single quotes, each `'` as `'\''` (the
/// commands the file tools and the seed endpoints run in the guest).
pub(crate) fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
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

impl TineMcp {
    /// A `tools/call` as [`ServerHandler::call_tool`] makes it, in the
    /// connection's toolset, or in `toolset` when given (a seed endpoint's
    /// native calls, [`crate::mcp_seed`], use [`toolsets::Toolset::full`]).
    pub(crate) async fn call(
        &self,
        mut request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
        toolset: Option<toolsets::Toolset>,
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
        if let Some(args) = request.arguments.as_mut() {
            toolsets::maps_from_pairs(args);
            self.resolve_names(args, &caller);
        }
        let set = match toolset {
            Some(set) => Ok(set),
            None => toolsets::Toolset::of_request(parts, &self.tools.default),
        };
        let outside = match &set {
            Ok(set) if self.tools.router.map.contains_key(tool.as_ref()) && !set.has(&tool) => Some(format!(
                "{tool} is not in this connection's toolset ({}): connect to /mcp?tools=full, or add the group that has it",
                set.spec()
            )),
            Ok(_) => None,
            Err(e) => Some(e.to_string()),
        };
        let ids: Vec<String> = crate::cluster::named_ids(request.arguments.as_ref()).map(str::to_string).collect();
        let route = outside
            .map_or(Ok(()), Err)
            .and_then(|()| self.tools.check.check(&tool, &mut request.arguments))
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
                self.cluster
                    .forward(&host, &url, request, &caller, &context.ct)
                    .await
                    .unwrap_or_else(|e| refused(e.to_string())),
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
}

#[tool_handler(router = self.tools.router)]
impl ServerHandler for TineMcp {
    /// `tools/list`: the connection's toolset ([`toolsets`]: `?tools=`, the
    /// `X-Tine-Tools` header, else the server's `[mcp] tools`).
    async fn list_tools(
        &self,
        _request: Option<rmcp::model::PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::ListToolsResult, ErrorData> {
        let parts = context.extensions.get::<axum::http::request::Parts>();
        let set = toolsets::Toolset::of_request(parts, &self.tools.default)
            .map_err(|e| ErrorData::invalid_params(e.to_string(), None))?;
        Ok(rmcp::model::ListToolsResult::with_all_items(self.tools.listed(&set)))
    }

    /// Checks the arguments against the tool's input schema
    /// ([`bounds::ArgCheck`]: a call out of bounds is refused before any
    /// work, here or on a peer), runs the tool here, or on the host its ids
    /// name ([`Cluster::route`]), then [`budget::guard`]: a result over
    /// the budget is replaced by an error, never sent. Counted and timed in
    /// the metrics.
    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        self.call(request, context, None).await
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
        let raw = tools::router().list_all();
        let raw_found: usize =
            raw.iter().filter_map(|t| t.output_schema.as_ref()).map(|s| schema::nonstandard(s, "#").len()).sum();
        assert!(raw_found > 0, "schemars emits width formats; the check finds them");
        // The bound a width format implied is kept.
        let create = tools.iter().find(|t| t.name == "sandbox_create").unwrap();
        let out = serde_json::Value::Object(JsonObject::clone(create.output_schema.as_ref().unwrap()));
        assert!(out.to_string().contains("\"maximum\""), "{out}");
    }
}
