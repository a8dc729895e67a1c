//! Seed-compatible MCP endpoints: `/mcp/microsandbox`, `/mcp/podflare`,
//! `/mcp/forkd` and `/mcp/superserve` serve the tool names, argument
//! shapes, result fields and session models of the MCP servers Tine
//! replaces, so agents and prompts written for them work unchanged, over
//! the same sandboxes as `/mcp`.
//!
//! Each endpoint is a [`Seed`] in a module of its own and is only a
//! mapping: a seed call becomes one native tool call ([`NativeCall`],
//! [`Seed::plan`]; at most [`MAX_STEPS`], where the second needs the
//! first's result: Superserve's secret attach reads the bindings it
//! replaces), each made through the native handler exactly as a call to
//! `/mcp` is made ([`crate::mcp::TineMcp`]: the same argument check, owner
//! check, cluster routing, session sandbox, progress, cancellation,
//! metrics and result budget), and the last native call's structured
//! result becomes the seed's result ([`Seed::answer`]). A native error is passed
//! on as it is. Where a seed's behaviour cannot be matched exactly, its
//! tool's description says what differs.
//!
//! Every seed session is an MCP session of its own with its own session
//! sandbox: the tools that take no sandbox (Podflare's) use the one the session made last, else one made on
//! first use and killed when the session ends ([`crate::mcp`]).

pub mod forkd;
pub mod microsandbox;
pub mod podflare;
pub mod superserve;

use std::sync::{Arc, OnceLock};

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation, JsonObject, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{NotificationContext, RequestContext};
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::mcp::{toolsets::Toolset, Shared, TineMcp};

/// Why a seed call could not be mapped or answered.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    /// The seed has no tool of this name.
    #[error("unknown tool {0:?}: tools/list shows this endpoint's tools")]
    UnknownTool(String),
    /// The arguments do not have the tool's shape.
    #[error("{tool}: {why}")]
    Arguments {
        /// The seed tool.
        tool: String,
        /// What is wrong, from the deserializer.
        why: String,
    },
    /// A value the seed allows that Tine cannot take.
    #[error("{tool}: {why}")]
    Unsupported {
        /// The seed tool.
        tool: String,
        /// What Tine cannot do, and what to do instead.
        why: String,
    },
    /// The native result lacked a field the seed's result needs (a bug).
    #[error("{tool}: the native result has no {field}")]
    Answer {
        /// The seed tool.
        tool: String,
        /// The field.
        field: &'static str,
    },
}

/// One native tool call (`/mcp`'s tool `tool` with arguments `args`): what
/// a seed call is made of.
#[derive(Debug, Clone, PartialEq)]
pub struct NativeCall {
    /// The native tool.
    pub tool: &'static str,
    /// Its arguments (a JSON object).
    pub args: Value,
}

impl NativeCall {
    /// `tool` with `args` (`serde_json::json!({...})`), nulls dropped: a
    /// seed's absent option is the native default.
    pub fn new(tool: &'static str, args: Value) -> Self {
        let args = match args {
            Value::Object(m) => Value::Object(m.into_iter().filter(|(_, v)| !v.is_null()).collect()),
            other => other,
        };
        NativeCall { tool, args }
    }
}

/// A seed's result: the text block clients show, and the structured
/// content (`None`: a text-only result, as servers that send none).
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The text block.
    pub text: String,
    /// `structuredContent` (always an object, MCP 2025-06-18 "Tools",
    /// "Structured Content").
    pub structured: Option<Value>,
}

impl Answer {
    /// `v` as JSON text and as structured content; a value that is not an
    /// object is structured as `{ "result": v }` (as the Python SDK's
    /// FastMCP wraps a list).
    pub fn json(v: Value) -> Self {
        let text = v.to_string();
        let structured = if v.is_object() { v } else { serde_json::json!({ "result": v }) };
        Answer { text, structured: Some(structured) }
    }

    /// `v` as pretty-printed JSON text only.
    pub fn text_json(v: &Value) -> Self {
        Answer { text: serde_json::to_string_pretty(v).unwrap_or_default(), structured: None }
    }

    /// `text` with `v` as its structured content.
    pub fn with_text(text: String, v: Value) -> Self {
        Answer { text, structured: Some(v) }
    }
}

/// What comes after a native call's result: the seed's answer, or one
/// more native call (a seed call that needs what the first returned).
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// The seed's result.
    Done(Answer),
    /// The next native call; its result comes to [`Seed::answer`] with
    /// `step + 1`.
    Then(NativeCall),
}

/// Most native calls one seed call makes.
pub const MAX_STEPS: usize = 3;

/// A seed endpoint: its tools, and how each seed call maps to native
/// calls and back.
pub trait Seed: Send + Sync + 'static {
    /// The endpoint's name: it is served at `/mcp/<name>`.
    fn name(&self) -> &'static str;
    /// The server's `instructions`: the seed's session model and what
    /// differs from the seed.
    fn instructions(&self) -> &'static str;
    /// The tools as `tools/list` shows them (made once per server).
    fn tools(&self) -> Vec<Tool>;
    /// The first native call for seed tool `tool` with arguments `args`.
    ///
    /// Errors: [`SeedError::UnknownTool`], [`SeedError::Arguments`] for
    /// arguments not of the tool's shape, [`SeedError::Unsupported`].
    fn plan(&self, tool: &str, args: Value) -> Result<NativeCall, SeedError>;
    /// What follows native call number `step` (0: the one [`Seed::plan`]
    /// made) of seed call `tool` with `args`, from its structured result
    /// `native`.
    ///
    /// Errors: [`SeedError::Answer`] for a native result without a field
    /// the answer needs.
    fn answer(&self, tool: &str, args: &Value, step: usize, native: Value) -> Result<Step, SeedError>;
}

/// The seed endpoints, as served.
pub fn seeds() -> [&'static dyn Seed; 4] {
    [&microsandbox::Microsandbox, &podflare::Podflare, &forkd::Forkd, &superserve::Superserve]
}

/// Parses a seed tool's arguments. A `null` member of an object is taken as
/// absent: strict-schema clients (the OpenAI Agents SDK's strict mode)
/// send every property, `null` for those the model leaves out.
///
/// Errors: [`SeedError::Arguments`].
pub fn parse<T: DeserializeOwned>(tool: &str, mut args: Value) -> Result<T, SeedError> {
    drop_nulls(&mut args);
    serde_json::from_value(args).map_err(|e| SeedError::Arguments { tool: tool.to_string(), why: e.to_string() })
}

/// Removes the `null` members of every object in `v`.
fn drop_nulls(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.retain(|_, v| !v.is_null());
            m.values_mut().for_each(drop_nulls);
        }
        Value::Array(a) => a.iter_mut().for_each(drop_nulls),
        _ => {}
    }
}

/// A tool for a seed's list: its input schema from `T` (schemars, then
/// standard JSON Schema, [`crate::mcp::schema::standardize`], references
/// inlined for strict-schema converters, [`crate::mcp::schema::inline_refs`]).
pub fn tool<T: schemars::JsonSchema + 'static>(name: &'static str, description: &'static str) -> Tool {
    let mut schema = rmcp::handler::server::common::schema_for_type::<T>().as_ref().clone();
    crate::mcp::schema::standardize(&mut schema);
    crate::mcp::schema::inline_refs(&mut schema);
    Tool::new(name, description, Arc::new(schema))
}

/// Field `field` of a native result.
///
/// Errors: [`SeedError::Answer`] when it is absent.
pub fn field<'a>(tool: &str, native: &'a Value, field: &'static str) -> Result<&'a Value, SeedError> {
    native.get(field).ok_or(SeedError::Answer { tool: tool.to_string(), field })
}

/// Turns `["KEY=VALUE", ...]` into the native `env` map (a name without `=`
/// gets the empty value).
pub fn env_map(pairs: &[String]) -> Value {
    Value::Object(
        pairs
            .iter()
            .map(|p| match p.split_once('=') {
                Some((k, v)) => (k.to_string(), Value::String(v.to_string())),
                None => (p.clone(), Value::String(String::new())),
            })
            .collect(),
    )
}

/// One MCP session on a seed endpoint: the seed's tools over a native
/// session handler.
#[derive(Clone)]
pub struct SeedMcp {
    native: TineMcp,
    seed: &'static dyn Seed,
    tools: Arc<Vec<Tool>>,
}

impl SeedMcp {
    /// A handler for a new session on `seed`'s endpoint; `tools` is the
    /// seed's list, made once ([`Seed::tools`]).
    pub fn new(shared: &Shared, seed: &'static dyn Seed, tools: Arc<Vec<Tool>>) -> Self {
        SeedMcp { native: TineMcp::new(shared), seed, tools }
    }

    /// The seed's tools, made once per process.
    pub fn tools_of(seed: &'static dyn Seed) -> Arc<Vec<Tool>> {
        static LISTS: OnceLock<std::collections::BTreeMap<&'static str, Arc<Vec<Tool>>>> = OnceLock::new();
        let lists = LISTS.get_or_init(|| seeds().iter().map(|s| (s.name(), Arc::new(s.tools()))).collect());
        lists.get(seed.name()).cloned().unwrap_or_default()
    }
}

/// A failed call's result: `message` as the one text block.
fn refused(message: String) -> CallToolResponse {
    CallToolResponse::Complete(CallToolResult::error(vec![ContentBlock::text(message)]))
}

impl ServerHandler for SeedMcp {
    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.tools.as_ref().clone()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.tools.iter().find(|t| t.name == name).cloned()
    }

    /// Maps the call ([`Seed::plan`]), makes the native call in the full
    /// toolset, and maps its result back ([`Seed::answer`]); a native
    /// error is passed on as it is.
    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let tool = request.name.to_string();
        let mut args = Value::Object(request.arguments.clone().unwrap_or_default());
        drop_nulls(&mut args);
        let plan = match self.seed.plan(&tool, args.clone()) {
            Ok(plan) => plan,
            Err(e) => return Ok(refused(e.to_string())),
        };
        let mut call = plan;
        for step in 0..MAX_STEPS {
            let native = CallToolRequestParams::new(call.tool).with_arguments(match call.args {
                Value::Object(m) => m,
                _ => JsonObject::new(),
            });
            let mut native = native;
            native.meta = request.meta.clone();
            let result = match self.native.call(native, context.clone(), Some(Toolset::full())).await? {
                CallToolResponse::Complete(r) if r.is_error == Some(true) => return Ok(CallToolResponse::Complete(r)),
                CallToolResponse::Complete(r) => r.structured_content.unwrap_or(Value::Null),
                other => return Ok(other),
            };
            match self.seed.answer(&tool, &args, step, result) {
                Ok(Step::Done(answer)) => {
                    let mut r = CallToolResult::success(vec![ContentBlock::text(answer.text)]);
                    r.structured_content = answer.structured;
                    return Ok(CallToolResponse::Complete(crate::mcp::budget::guard(&tool, r)));
                }
                Ok(Step::Then(next)) => call = next,
                Err(e) => return Ok(refused(e.to_string())),
            }
        }
        Ok(refused(format!("{tool}: more than {MAX_STEPS} native calls (a bug)")))
    }

    async fn on_initialized(&self, ctx: NotificationContext<RoleServer>) {
        self.native.on_initialized(ctx).await
    }

    #[allow(deprecated)]
    async fn set_level(
        &self,
        request: rmcp::model::SetLevelRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        self.native.set_level(request, ctx).await
    }

    #[allow(deprecated)]
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_logging().enable_tools().build())
            .with_server_info(Implementation::new(
                format!("tine ({}-compatible)", self.seed.name()),
                env!("CARGO_PKG_VERSION"),
            ))
            .with_instructions(self.seed.instructions())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every seed tool's input schema is standard JSON Schema (what the
    /// TypeScript SDK's Ajv and the Python SDK read without a warning),
    /// its tools are named once, and each plans its own documented call
    /// name (no seed tool falls through to "unknown").
    #[test]
    fn seed_schemas_are_standard_and_every_tool_is_mapped() {
        for seed in seeds() {
            let tools = seed.tools();
            let mut names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), tools.len(), "{}: a tool named twice", seed.name());
            for t in &tools {
                let found = crate::mcp::schema::nonstandard(&t.input_schema, &format!("{}/{}", seed.name(), t.name));
                assert!(found.is_empty(), "{found:?}");
                if std::env::var_os("TINE_DUMP_SEED_SCHEMAS").is_some() {
                    println!("SCHEMA {} {} {}", seed.name(), t.name, Value::Object(JsonObject::clone(&t.input_schema)));
                }
                let e = seed.plan(&t.name, Value::Object(JsonObject::new()));
                assert!(!matches!(e, Err(SeedError::UnknownTool(_))), "{}/{} is not mapped", seed.name(), t.name);
            }
        }
    }
}
