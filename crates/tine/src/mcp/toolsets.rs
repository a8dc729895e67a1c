//! Toolsets: which tools a connection sees. A model pays for every tool
//! it is sent on every turn, so a client can ask for the few it needs:
//! `/mcp?tools=core`, or the header [`HEADER`] (`X-Tine-Tools: core`),
//! else the server's `[mcp] tools` (default [`FULL`]).
//!
//! A toolset is `full` (every tool) or a comma-separated list of groups
//! ([`GROUPS`]): `core` (at most [`CORE_MAX_TOOLS`] tools and
//! [`CORE_MAX_CHARS`] characters of descriptions and input schemas), and
//! `processes`, `templates`, `network`, `files`, `admin`. A tool outside
//! the connection's toolset is neither listed nor called.
//!
//! Every toolset but `full` lists its maps (`labels`, `env`, `secrets`,
//! `template_create`'s `files`)
//! as arrays of `{ "name", "value" }`: strict-schema converters (the
//! OpenAI Agents SDK's strict mode) refuse `additionalProperties` maps.
//! Every endpoint takes both forms ([`maps_from_pairs`]).

use std::collections::BTreeSet;
use std::sync::Arc;

use rmcp::model::JsonObject;
use serde_json::{json, Value};

/// The header that names a connection's toolset.
pub const HEADER: &str = "x-tine-tools";
/// The query parameter that names it.
pub const QUERY: &str = "tools";
/// The toolset of every tool.
pub const FULL: &str = "full";
/// Most tools of `core`.
pub const CORE_MAX_TOOLS: usize = 12;
/// Most characters of `core`'s descriptions and input schemas together.
pub const CORE_MAX_CHARS: usize = 10_000;
/// The argument maps every toolset but `full` lists as arrays of pairs
/// (`files` is `template_create`'s, path to text).
pub const MAP_ARGUMENTS: [&str; 4] = ["labels", "env", "secrets", "files"];

/// The groups and their tools.
pub const GROUPS: &[(&str, &[&str])] = &[
    (
        "core",
        &[
            "sandbox_create",
            "sandbox_exec",
            "sandbox_run_code",
            "sandbox_files_read",
            "sandbox_files_write",
            "sandbox_files_list",
            "sandbox_branch",
            "sandbox_kill",
            "sandbox_info",
            "sandbox_list",
            "sandbox_preview_url",
            "secret_list",
        ],
    ),
    (
        "processes",
        &[
            "sandbox_exec",
            "sandbox_process_list",
            "sandbox_process_output",
            "sandbox_process_wait",
            "sandbox_process_write",
            "sandbox_process_kill",
        ],
    ),
    ("templates", &["template_list", "template_create", "template_delete", "sandbox_snapshot", "sandbox_create"]),
    (
        "network",
        &["sandbox_network_log", "sandbox_update", "sandbox_preview_url", "sandbox_preview_revoke", "secret_list"],
    ),
    (
        "files",
        &[
            "sandbox_files_read",
            "sandbox_files_write",
            "sandbox_files_list",
            "sandbox_upload",
            "sandbox_download",
            "sandbox_files_url",
            "sandbox_download_dir",
        ],
    ),
    (
        "admin",
        &[
            "sandbox_list",
            "sandbox_info",
            "sandbox_update",
            "sandbox_pause",
            "sandbox_resume",
            "sandbox_kill",
            "sandbox_diff",
            "sandbox_merge_into",
            "volume_create",
            "volume_list",
            "volume_delete",
        ],
    ),
];

/// The parameters `core` lists of its tools that have more (the others
/// are still taken: a client that knows them may send them); a tool not
/// named here lists all of its own.
pub const CORE_PARAMETERS: &[(&str, &[&str])] = &[
    ("sandbox_create", &["name", "template", "env", "secrets"]),
    ("sandbox_list", &[]),
    ("sandbox_exec", &["sandbox_id", "command", "cwd", "env", "timeout_secs", "background"]),
    ("sandbox_files_write", &["sandbox_id", "path", "content", "append"]),
    ("sandbox_preview_url", &["sandbox_id", "port", "public", "ttl_secs"]),
];

/// A toolset that cannot be read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ToolsetError {
    /// A name that is neither `full` nor a group.
    #[error(
        "toolset {0:?}: use \"full\" or groups of core, processes, templates, network, files, admin (comma-separated)"
    )]
    Unknown(String),
}

/// One connection's toolset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Toolset {
    /// Its tools (`None`: every tool).
    tools: Option<BTreeSet<&'static str>>,
    /// What it was asked as (`full`, `core,processes`).
    spec: String,
}

impl Toolset {
    /// Every tool.
    pub fn full() -> Self {
        Toolset { tools: None, spec: FULL.into() }
    }

    /// Reads `full` or a comma-separated list of groups.
    ///
    /// Errors: [`ToolsetError::Unknown`].
    pub fn parse(spec: &str) -> Result<Self, ToolsetError> {
        let mut tools = BTreeSet::new();
        let mut names = Vec::new();
        for name in spec.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let name = name.to_ascii_lowercase();
            if name == FULL {
                return Ok(Toolset::full());
            }
            let (_, group) =
                GROUPS.iter().find(|(g, _)| *g == name).ok_or_else(|| ToolsetError::Unknown(name.clone()))?;
            tools.extend(group.iter().copied());
            names.push(name);
        }
        if names.is_empty() {
            return Err(ToolsetError::Unknown(spec.chars().take(64).collect()));
        }
        Ok(Toolset { tools: Some(tools), spec: names.join(",") })
    }

    /// The toolset a request asks for: its `?tools=` query, else its
    /// [`HEADER`], else `default`.
    ///
    /// Errors: [`ToolsetError::Unknown`].
    pub fn of_request(parts: Option<&axum::http::request::Parts>, default: &Toolset) -> Result<Self, ToolsetError> {
        let Some(parts) = parts else { return Ok(default.clone()) };
        let query = parts
            .uri
            .query()
            .and_then(|q| form_urlencoded::parse(q.as_bytes()).find(|(k, _)| k == QUERY).map(|(_, v)| v.into_owned()));
        let header = || parts.headers.get(HEADER).and_then(|v| v.to_str().ok()).map(str::to_string);
        match query.or_else(header) {
            Some(spec) => Toolset::parse(&spec),
            None => Ok(default.clone()),
        }
    }

    /// Whether tool `name` is in it.
    pub fn has(&self, name: &str) -> bool {
        self.tools.as_ref().is_none_or(|t| t.contains(name))
    }

    /// Whether it lists maps as arrays of pairs (every toolset but `full`).
    pub fn pairs(&self) -> bool {
        self.tools.is_some()
    }

    /// Whether it lists `core`'s shorter schemas ([`CORE_PARAMETERS`]): it
    /// has the `core` group.
    pub fn core(&self) -> bool {
        self.spec.split(',').any(|g| g == "core")
    }

    /// What it was asked as.
    pub fn spec(&self) -> &str {
        &self.spec
    }
}

/// `schema` (an input schema) with its map arguments ([`MAP_ARGUMENTS`])
/// as arrays of `{ "name", "value" }`, each bounded as the map was.
pub fn with_pairs(schema: &JsonObject) -> Arc<JsonObject> {
    let mut schema = schema.clone();
    super::schema::inline_refs(&mut schema);
    close_if_empty(&mut schema);
    if let Some(Value::Object(props)) = schema.get_mut("properties") {
        for name in MAP_ARGUMENTS {
            let Some(Value::Object(map)) = props.get(name) else { continue };
            let text = |v: Option<&Value>| v.and_then(|v| v.as_u64()).unwrap_or(256);
            let max_items = text(map.get("maxProperties"));
            let key_len = text(map.get("propertyNames").and_then(|p| p.get("maxLength")));
            let value_len = text(map.get("additionalProperties").and_then(|p| p.get("maxLength")));
            let mut pairs = json!({
                "type": "array",
                "maxItems": max_items,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": key_len},
                        "value": {"type": "string", "maxLength": value_len},
                    },
                    "required": ["name", "value"],
                    "additionalProperties": false,
                },
            });
            if let Some(d) = map.get("description") {
                pairs["description"] = d.clone();
            }
            props.insert(name.to_string(), pairs);
        }
    }
    Arc::new(schema)
}

/// Marks an input schema without properties (a tool without arguments, or
/// one `core` lists without any) `additionalProperties: false`: strict
/// converters refuse an object that declares no property and does not
/// close itself (the OpenAI Agents SDK's `MCPUtil.to_function_tool`).
fn close_if_empty(schema: &mut JsonObject) {
    let empty = schema.get("properties").and_then(Value::as_object).is_none_or(|p| p.is_empty());
    if empty && !schema.contains_key("additionalProperties") {
        schema.insert("additionalProperties".into(), Value::Bool(false));
    }
}

/// `schema` with only the properties `keep` names (and the `$defs` they
/// use), as `core` lists it.
pub fn trimmed(schema: &JsonObject, keep: &[&str]) -> JsonObject {
    let mut schema = schema.clone();
    if let Some(Value::Object(props)) = schema.get_mut("properties") {
        props.retain(|k, _| keep.contains(&k.as_str()));
    }
    close_if_empty(&mut schema);
    if let Some(Value::Array(required)) = schema.get_mut("required") {
        required.retain(|r| r.as_str().is_some_and(|r| keep.contains(&r)));
    }
    // The definitions still referred to, transitively.
    let defs = schema.remove("$defs");
    if let Some(Value::Object(defs)) = defs {
        let mut used: BTreeSet<String> = BTreeSet::new();
        let mut frontier = vec![Value::Object(schema.clone())];
        while let Some(v) = frontier.pop() {
            refs(&v, &mut |name| {
                if used.insert(name.to_string()) {
                    if let Some(d) = defs.get(name) {
                        frontier.push(d.clone());
                    }
                }
            });
        }
        let kept: serde_json::Map<String, Value> = defs.into_iter().filter(|(k, _)| used.contains(k)).collect();
        if !kept.is_empty() {
            schema.insert("$defs".into(), Value::Object(kept));
        }
    }
    schema
}

/// Calls `f` with the name of every `#/$defs/<name>` reference in `v`.
fn refs(v: &Value, f: &mut dyn FnMut(&str)) {
    match v {
        Value::Object(o) => {
            if let Some(Value::String(r)) = o.get("$ref") {
                if let Some(name) = r.strip_prefix("#/$defs/") {
                    f(name);
                }
            }
            o.values().for_each(|v| refs(v, f));
        }
        Value::Array(a) => a.iter().for_each(|v| refs(v, f)),
        _ => {}
    }
}

/// Turns the map arguments ([`MAP_ARGUMENTS`]) given as arrays of
/// `{ "name", "value" }` into the objects the tools take; anything else is
/// left for the arguments' check to judge.
pub fn maps_from_pairs(args: &mut JsonObject) {
    for name in MAP_ARGUMENTS {
        let Some(Value::Array(items)) = args.get(name) else { continue };
        let mut map = serde_json::Map::new();
        for item in items {
            let (Some(k), Some(v)) = (item.get("name").and_then(Value::as_str), item.get("value")) else {
                return;
            };
            map.insert(k.to_string(), v.clone());
        }
        args.insert(name.to_string(), Value::Object(map));
    }
}

/// The characters a tool costs a model: its description and its input
/// schema as sent.
pub fn cost(tool: &rmcp::model::Tool) -> usize {
    tool.description.as_deref().map_or(0, str::len) + serde_json::to_string(&*tool.input_schema).map_or(0, |s| s.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toolsets_read_groups_and_full() {
        let core = Toolset::parse("core").unwrap();
        assert!(core.has("sandbox_exec") && !core.has("sandbox_process_wait") && core.pairs());
        let both = Toolset::parse("Core, processes").unwrap();
        assert!(both.has("sandbox_process_wait") && both.has("sandbox_files_read"));
        assert_eq!(both.spec(), "core,processes");
        assert!(Toolset::parse("full").unwrap().has("volume_delete"));
        assert!(!Toolset::full().pairs());
        assert!(matches!(Toolset::parse("nope"), Err(ToolsetError::Unknown(_))));
        assert!(Toolset::parse(",").is_err());
        assert!(GROUPS[0].1.len() <= CORE_MAX_TOOLS);
        let req = |uri: &str, header: Option<&str>| {
            let mut b = axum::http::Request::get(uri);
            if let Some(h) = header {
                b = b.header(HEADER, h);
            }
            b.body(()).unwrap().into_parts().0
        };
        let full = Toolset::full();
        assert_eq!(Toolset::of_request(Some(&req("/mcp?tools=core", None)), &full).unwrap(), core);
        assert_eq!(Toolset::of_request(Some(&req("/mcp", Some("core"))), &full).unwrap(), core);
        assert_eq!(Toolset::of_request(Some(&req("/mcp", None)), &core).unwrap(), core);
        assert_eq!(Toolset::of_request(None, &full).unwrap(), full);
    }

    #[test]
    fn maps_become_pairs_and_back() {
        let schema = json!({"type": "object", "properties": {
            "env": {"type": "object", "description": "vars", "maxProperties": 4,
                    "propertyNames": {"maxLength": 8}, "additionalProperties": {"type": "string", "maxLength": 9}},
            "n": {"type": "integer"}}});
        let pairs = with_pairs(schema.as_object().unwrap());
        let env = &pairs["properties"]["env"];
        assert_eq!(
            (env["type"].as_str(), env["maxItems"].as_u64(), env["description"].as_str()),
            (Some("array"), Some(4), Some("vars"))
        );
        assert_eq!(env["items"]["properties"]["value"]["maxLength"], 9);
        assert_eq!(pairs["properties"]["n"], json!({"type": "integer"}));
        let with_defs = json!({"type": "object", "required": ["a", "b"], "properties": {
            "a": {"$ref": "#/$defs/A"}, "b": {"$ref": "#/$defs/B"}},
            "$defs": {"A": {"properties": {"x": {"$ref": "#/$defs/C"}}}, "B": {}, "C": {}}});
        let t = Value::Object(trimmed(with_defs.as_object().unwrap(), &["a"]));
        assert_eq!(t["required"], json!(["a"]));
        assert_eq!(t["$defs"].as_object().unwrap().keys().collect::<Vec<_>>(), ["A", "C"], "B is no longer used");
        let mut args = json!({"env": [{"name": "A", "value": "1"}], "labels": {"k": "v"}}).as_object().unwrap().clone();
        maps_from_pairs(&mut args);
        assert_eq!(Value::Object(args), json!({"env": {"A": "1"}, "labels": {"k": "v"}}));
    }
}
