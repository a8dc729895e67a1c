//! The bounds of every tool argument, and their check at the MCP boundary.
//!
//! Each parameter type states its bounds in its JSON Schema (schemars
//! attributes on its fields: `range`, `length`, and [`string_map`] for
//! maps), so the schema a client reads in `tools/list` is the rule the
//! server enforces: [`ArgCheck`] validates a call's arguments against its
//! tool's input schema (JSON Schema draft 2020-12, with the `jsonschema`
//! crate) before anything else happens, forwarding to another host
//! included. Bounds that come from the server's configuration (vCPUs,
//! memory, idle timeout, labels, branch children) are written into the
//! schemas by [`apply_limits`] when the server starts. A refused call gets
//! a tool error naming the argument, what it was and the bound, e.g.
//! `sandbox_branch: n (9223372036854775808) is greater than the maximum of
//! 16`; no work is started and nothing is allocated for it.
//!
//! The sandbox manager, the agent and the guest keep their own checks
//! (byte counts where a schema can only count characters, sums such as an
//! environment's total size): this is the first line, not the only one.

use std::collections::HashMap;
use std::sync::Arc;

use rmcp::model::JsonObject;
use schemars::Schema;
use serde_json::{json, Value};
use tine_sandbox::Limits;

/// Longest sandbox or process id (characters). Ids are
/// `sb-<host>-<random>[:p<m>]` with host names of at most 40 characters
/// (`cluster::MAX_HOST_NAME`).
pub const MAX_ID_CHARS: u64 = 128;
/// Longest path in a sandbox (characters): Linux's `PATH_MAX`, 4096 bytes
/// with its NUL (`<linux/limits.h>`).
pub const MAX_PATH_CHARS: u64 = 4096;
/// Longest template name (characters); the store allows 1-63 of
/// `[a-z0-9_-]`.
pub const MAX_NAME_CHARS: u64 = 63;
/// What a template name looks like (`tine_sandbox::templates::check_name`):
/// a lowercase letter or digit, then lowercase letters, digits, `-` or `_`.
pub const NAME_PATTERN: &str = "^[a-z0-9][a-z0-9_-]*$";
/// Longest bash script, argv word or setup command (characters): one
/// argument of `execve(2)` is at most `MAX_ARG_STRLEN`, 32 pages (131072
/// bytes) with its NUL (`<linux/binfmts.h>`).
pub const MAX_COMMAND_CHARS: u64 = (128 << 10) - 1;
/// Most words of `sandbox_exec`'s `argv`.
pub const MAX_ARGV_WORDS: u64 = 4096;
/// Longest Python or JavaScript cell (characters): 4 MiB.
pub const MAX_CODE_CHARS: u64 = 4 << 20;
/// Longest text of `sandbox_files_write` and of a synchronous exec's
/// `stdin` (characters): one agent file chunk, 8 MiB
/// (`tine_protocol::MAX_FILE_CHUNK`).
pub const MAX_TEXT_CHARS: u64 = tine_protocol::MAX_FILE_CHUNK;
/// Longest `data_base64` of `sandbox_upload` (characters): 8 MiB encoded
/// (RFC 4648 §4: 4 characters per 3 bytes), and room for a trailing
/// newline.
pub const MAX_BASE64_CHARS: u64 = tine_protocol::MAX_FILE_CHUNK.div_ceil(3) * 4 + 2;
/// Longest `sandbox_process_write` data (characters): 1 MiB
/// (`tine_protocol::MAX_PROCESS_WRITE`, checked again in bytes).
pub const MAX_PROCESS_WRITE_CHARS: u64 = tine_protocol::MAX_PROCESS_WRITE as u64;
/// Longest wait pattern (characters; checked again in bytes).
pub const MAX_PATTERN_CHARS: u64 = tine_protocol::MAX_WAIT_PATTERN_BYTES as u64;
/// Longest signal name, e.g. `SIGTERM` (characters).
pub const MAX_SIGNAL_CHARS: u64 = 16;
/// Most entries of a network policy's `allow` or of its `deny`
/// (`netstack::policy::MAX_RULES`).
pub const MAX_POLICY_RULES: u64 = tine_sandbox::network::MAX_POLICY_RULES as u64;
/// Longest policy entry (characters): a domain of 253 (RFC 1035 §2.3.4)
/// with a `*.` wildcard prefix; addresses and CIDRs are shorter.
pub const MAX_POLICY_ENTRY_CHARS: u64 = 255;
/// Most environment variables (`tine_protocol::MAX_SANDBOX_ENV_VARS`).
pub const MAX_ENV_VARS: u64 = tine_protocol::MAX_SANDBOX_ENV_VARS as u64;
/// Longest environment variable name (characters).
pub const MAX_ENV_NAME_CHARS: u64 = 256;
/// Longest environment value (characters): the whole environment is at
/// most `tine_protocol::MAX_SANDBOX_ENV_BYTES` (64 KiB), checked in bytes.
pub const MAX_ENV_VALUE_CHARS: u64 = tine_protocol::MAX_SANDBOX_ENV_BYTES as u64;
/// Longest `timeout_secs` of a call (s): `tine_protocol::MAX_TIMEOUT_MS`.
pub const MAX_TIMEOUT_SECS: u64 = (tine_protocol::MAX_TIMEOUT_MS / 1000) as u64;
/// Largest file offset (bytes): `off_t` is a signed 64-bit integer.
pub const MAX_OFFSET: u64 = i64::MAX as u64;
/// Largest permission bits of a new file: `0o7777`.
pub const MAX_MODE: u64 = 0o7777;

/// The `[limits]` defaults the parameter types' schemas state (the server
/// writes its own configuration's over them, [`apply_limits`]; a test
/// checks these against `Limits::default()`): vCPUs, memory (MiB), idle
/// timeout (s), live sandboxes (a branch's children), labels.
pub const DEFAULT_MAX_VCPUS: u64 = 8;
/// See [`DEFAULT_MAX_VCPUS`].
pub const DEFAULT_MAX_MEMORY_MIB: u64 = 8192;
/// See [`DEFAULT_MAX_VCPUS`].
pub const DEFAULT_MAX_DISK_MIB: u64 = 65_536;
/// See [`DEFAULT_MAX_VCPUS`].
pub const DEFAULT_MAX_IDLE_SECS: u64 = 86_400;
/// See [`DEFAULT_MAX_VCPUS`].
pub const DEFAULT_MAX_SANDBOXES: u64 = 16;
/// See [`DEFAULT_MAX_VCPUS`].
pub const DEFAULT_MAX_LABELS: u64 = 16;
/// Least guest memory (MiB): `tine_sandbox::MIN_MEMORY_MIB`.
pub const MIN_MEMORY_MIB: u64 = tine_sandbox::MIN_MEMORY_MIB;
/// Least disk (MiB): `tine_sandbox::MIN_DISK_MIB`.
pub const MIN_DISK_MIB: u64 = tine_sandbox::MIN_DISK_MIB;

/// Schema transform for a map of strings (`labels`, `env`, `files`): at
/// most `ENTRIES` entries, keys of at most `KEY` characters, values of at
/// most `VALUE` characters (`maxProperties`, `propertyNames`,
/// `additionalProperties`; JSON Schema Validation §6.5, §10.3.2). Use as
/// `#[schemars(transform = string_map::<ENTRIES, KEY, VALUE>)]`.
pub fn string_map<const ENTRIES: u64, const KEY: u64, const VALUE: u64>(schema: &mut Schema) {
    schema.insert("maxProperties".into(), ENTRIES.into());
    schema.insert("propertyNames".into(), json!({ "maxLength": KEY }));
    schema.insert("additionalProperties".into(), json!({ "type": "string", "maxLength": VALUE }));
}

/// Writes the bounds that come from the server's `[limits]` into the tools'
/// input schemas (`tool`'s `property` gets `minimum`/`maximum`, or
/// `maxProperties` for labels), replacing the static ones: what
/// `tools/list` shows is what the server accepts.
pub fn apply_limits<'a>(schemas: impl IntoIterator<Item = (&'a str, &'a mut JsonObject)>, limits: &Limits) {
    let max_sandboxes = limits.max_sandboxes as u64;
    let max_labels = limits.max_labels as u64;
    let memory = (MIN_MEMORY_MIB, limits.max_memory_mib);
    let vcpus = (1, u64::from(limits.max_vcpus));
    let idle = (1, limits.max_idle_timeout_secs);
    for (tool, schema) in schemas {
        let Some(Value::Object(props)) = schema.get_mut("properties") else { continue };
        let mut range = |name: &str, (min, max): (u64, u64)| {
            if let Some(Value::Object(p)) = props.get_mut(name) {
                p.insert("minimum".into(), min.into());
                p.insert("maximum".into(), max.into());
            }
        };
        match tool {
            "sandbox_create" | "template_create" => {
                range("vcpus", vcpus);
                range("memory_mib", memory);
                if tool == "sandbox_create" {
                    range("idle_timeout_secs", idle);
                    range("disk_mib", (MIN_DISK_MIB, limits.max_disk_mib));
                }
            }
            "sandbox_update" => range("idle_timeout_secs", idle),
            "sandbox_branch" => range("n", (1, max_sandboxes)),
            _ => {}
        }
        if let Some(Value::Object(p)) = props.get_mut("labels") {
            p.insert("maxProperties".into(), max_labels.into());
        }
    }
}

/// The tools' input schemas compiled once, to check each call's arguments
/// before it runs.
pub struct ArgCheck {
    validators: HashMap<String, jsonschema::Validator>,
}

impl ArgCheck {
    /// Compiles each `(tool name, input schema)`.
    ///
    /// Errors: the first schema that is not valid JSON Schema, with the
    /// tool's name (a bug in a parameter type, found at start).
    pub fn new<'a>(schemas: impl IntoIterator<Item = (&'a str, &'a JsonObject)>) -> Result<Self, String> {
        let mut validators = HashMap::new();
        for (tool, schema) in schemas {
            let v = jsonschema::validator_for(&Value::Object(schema.clone()))
                .map_err(|e| format!("{tool}'s input schema is not valid JSON Schema: {e}"))?;
            validators.insert(tool.to_string(), v);
        }
        Ok(ArgCheck { validators })
    }

    /// Checks `args` (absent: `{}`) against `tool`'s input schema, and
    /// leaves them as they were. They are moved into a JSON value for the
    /// check and back, not copied: a call's arguments may be megabytes. A
    /// tool it does not know passes (the router answers for it).
    ///
    /// Errors: a message naming the tool, the argument, what was given
    /// (numbers in full, strings, lists and maps by their size) and the
    /// bound it broke.
    pub fn check(&self, tool: &str, args: &mut Option<JsonObject>) -> Result<(), String> {
        let Some(v) = self.validators.get(tool) else { return Ok(()) };
        let given = args.is_some();
        let value = Value::Object(args.take().unwrap_or_default());
        let checked = v
            .validate(&value)
            .map_err(|e| format!("{tool}: {}; the tool's inputSchema gives every bound", describe(&e)));
        if let (true, Value::Object(map)) = (given, value) {
            *args = Some(map);
        }
        checked
    }
}

/// The error that says most: inside `anyOf`/`oneOf` (an `Option` of a
/// struct or enum), the branch whose type matched, else the error itself;
/// with its instance shown by [`brief`] after its path.
fn describe(e: &jsonschema::ValidationError<'_>) -> String {
    use jsonschema::error::{TypeKind, ValidationErrorKind as K};
    let placeholder = format!("{} ({})", path(e.instance_path().as_str()), brief(e.instance()));
    if let K::AnyOf { context } | K::OneOfNotValid { context } = e.kind() {
        let firsts: Vec<_> = context.iter().filter_map(|branch| branch.first()).collect();
        if let Some(inner) = firsts.iter().find(|b| !matches!(b.kind(), K::Type { .. })) {
            return describe(inner);
        }
        // Every form has another type (an untagged number-or-name, say).
        let mut types = Vec::new();
        for b in &firsts {
            match b.kind() {
                K::Type { kind: TypeKind::Single(t) } => types.push(t.as_str()),
                K::Type { kind: TypeKind::Multiple(ts) } => types.extend(ts.iter().map(|t| t.as_str())),
                _ => {}
            }
        }
        types.retain(|t| *t != "null");
        types.dedup();
        if !types.is_empty() {
            let types: Vec<String> = types.iter().map(|t| format!("{t:?}")).collect();
            return format!("{placeholder} is not of type {}", types.join(" or "));
        }
    }
    if let K::PropertyNames { error } = e.kind() {
        return format!("a key of {}: {}", path(e.instance_path().as_str()), describe(error));
    }
    cut(e.masked_with(placeholder).to_string(), 512)
}

/// A JSON pointer as an agent reads it: `/network/allow/3` is
/// `network.allow[3]`, the root is `the arguments`.
fn path(pointer: &str) -> String {
    if pointer.is_empty() {
        return "the arguments".into();
    }
    let mut out = String::new();
    for seg in pointer.split('/').skip(1) {
        let seg = seg.replace("~1", "/").replace("~0", "~");
        if !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit()) {
            out.push_str(&format!("[{seg}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(&seg);
        }
    }
    cut(out, 128)
}

/// A value in a few words: numbers and short strings as they are, long
/// strings, lists and maps by their size (an error never echoes a
/// client's megabyte back).
fn brief(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => {
            let chars = s.chars().count();
            if chars <= 40 && !s.chars().any(char::is_control) {
                format!("{s:?}")
            } else {
                format!("a string of {chars} characters")
            }
        }
        Value::Array(a) => format!("a list of {} items", a.len()),
        Value::Object(m) => format!("a map of {} entries", m.len()),
    }
}

/// `s` cut to at most `max` bytes on a character boundary, marked.
fn cut(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut at = max;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
        s.push_str("...");
    }
    s
}

/// The input schemas of a router's tools, by name.
pub fn input_schemas<S>(
    router: &mut rmcp::handler::server::router::tool::ToolRouter<S>,
) -> impl Iterator<Item = (&str, &mut JsonObject)> {
    router.map.values_mut().map(|route| (route.attr.name.as_ref(), Arc::make_mut(&mut route.attr.input_schema)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_one(schema: Value, args: Value) -> Result<(), String> {
        let schema = schema.as_object().unwrap().clone();
        let check = ArgCheck::new([("t", &schema)]).unwrap();
        let mut args = args.as_object().cloned();
        let before = args.clone();
        let checked = check.check("t", &mut args);
        assert_eq!(args, before, "the check leaves the arguments as they were");
        checked
    }

    #[test]
    fn numbers_out_of_range_name_the_argument_and_the_bound() {
        let s = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 16}},
                       "required": ["n"]});
        assert_eq!(check_one(s.clone(), json!({"n": 16})), Ok(()));
        let e = check_one(s.clone(), json!({"n": 9223372036854775808u64})).unwrap_err();
        assert!(e.starts_with("t: n (9223372036854775808) is greater than the maximum of 16"), "{e}");
        let e = check_one(s.clone(), json!({"n": -1})).unwrap_err();
        assert!(e.contains("n (-1) is less than the minimum of 1"), "{e}");
        let e = check_one(s.clone(), json!({"n": 1.5})).unwrap_err();
        assert!(e.contains("n (1.5) is not of type \"integer\""), "{e}");
        // 2^64 arrives as a float (serde_json without arbitrary precision).
        let big: Value = serde_json::from_str("18446744073709551616").unwrap();
        let e = check_one(s.clone(), json!({ "n": big })).unwrap_err();
        assert!(e.contains("is greater than the maximum of 16"), "{e}");
        let e = check_one(s, json!({})).unwrap_err();
        assert!(e.contains("\"n\" is a required property"), "{e}");
    }

    #[test]
    fn long_strings_lists_and_maps_are_described_not_echoed() {
        let s = json!({"type": "object", "properties": {
            "path": {"type": "string", "maxLength": 8},
            "allow": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        }});
        let e = check_one(s.clone(), json!({"path": "x".repeat(1 << 20)})).unwrap_err();
        assert!(e.contains("path (a string of 1048576 characters) is longer than 8 characters"), "{e}");
        assert!(e.len() < 300, "{e}");
        let e = check_one(s.clone(), json!({"allow": ["a", "b", "c"]})).unwrap_err();
        assert!(e.contains("allow (a list of 3 items) has more than 2 items"), "{e}");
        let e = check_one(s, json!({"allow": ["a", "bbbbbbbbbbb"]})).unwrap_err();
        assert!(e.contains("allow[1] (\"bbbbbbbbbbb\") is longer than 4 characters"), "{e}");
    }

    #[test]
    fn maps_are_bounded_in_entries_keys_and_values() {
        let mut m = Schema::from(json!({"type": "object"}).as_object().unwrap().clone());
        string_map::<2, 3, 4>(&mut m);
        let s = json!({"type": "object", "properties": {"labels": m.to_value()}});
        assert_eq!(check_one(s.clone(), json!({"labels": {"a": "b"}})), Ok(()));
        let e = check_one(s.clone(), json!({"labels": {"a": "1", "b": "2", "c": "3"}})).unwrap_err();
        assert!(e.contains("labels (a map of 3 entries) has more than 2 properties"), "{e}");
        let e = check_one(s.clone(), json!({"labels": {"long-key": "1"}})).unwrap_err();
        assert!(e.contains("a key of labels: ") && e.contains("is longer than 3 characters"), "{e}");
        let e = check_one(s, json!({"labels": {"a": "12345"}})).unwrap_err();
        assert!(e.contains("labels.a (\"12345\") is longer than 4 characters"), "{e}");
    }

    #[test]
    fn an_option_of_a_struct_reports_the_struct_error() {
        let s = json!({"type": "object", "properties": {
            "network": {"anyOf": [{"$ref": "#/$defs/Net"}, {"type": "null"}]}},
            "$defs": {"Net": {"type": "object", "properties": {"allow": {"type": "array", "maxItems": 1}}}}});
        assert_eq!(check_one(s.clone(), json!({"network": null})), Ok(()));
        let e = check_one(s, json!({"network": {"allow": [1, 2]}})).unwrap_err();
        assert!(e.contains("network.allow (a list of 2 items) has more than 1 item"), "{e}");
    }

    #[test]
    fn a_number_or_a_name_says_both_types() {
        let s = json!({"type": "object", "properties": {"signal": {"anyOf": [
            {"type": "integer", "minimum": 1, "maximum": 64}, {"type": "string", "maxLength": 16}]}}});
        let e = check_one(s.clone(), json!({"signal": 1.5})).unwrap_err();
        assert!(e.contains("signal (1.5) is not of type \"integer\" or \"string\""), "{e}");
        let e = check_one(s.clone(), json!({"signal": 0})).unwrap_err();
        assert!(e.contains("signal (0) is less than the minimum of 1"), "{e}");
        let e = check_one(s, json!({"signal": "x".repeat(17)})).unwrap_err();
        assert!(e.contains("signal (\"xxxxxxxxxxxxxxxxx\") is longer than 16 characters"), "{e}");
    }

    #[test]
    fn the_static_limits_are_the_configurations_defaults() {
        let d = Limits::default();
        assert_eq!(DEFAULT_MAX_VCPUS, u64::from(d.max_vcpus));
        assert_eq!(DEFAULT_MAX_MEMORY_MIB, d.max_memory_mib);
        assert_eq!(DEFAULT_MAX_DISK_MIB, d.max_disk_mib);
        assert_eq!(DEFAULT_MAX_IDLE_SECS, d.max_idle_timeout_secs);
        assert_eq!(DEFAULT_MAX_SANDBOXES, d.max_sandboxes as u64);
        assert_eq!(DEFAULT_MAX_LABELS, d.max_labels as u64);
    }

    #[test]
    fn strings_with_control_characters_are_not_echoed() {
        assert_eq!(brief(&json!("a\0b")), "a string of 3 characters");
        assert_eq!(brief(&json!("short")), "\"short\"");
        assert_eq!(path("/network/allow/3"), "network.allow[3]");
        assert_eq!(path("/a~1b"), "a/b");
        assert_eq!(path(""), "the arguments");
    }
}
