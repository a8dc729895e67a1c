//! `/mcp/podflare`: Podflare's local MCP server's tools (docs.podflare.ai,
//! "MCP"): `run_python`, `run_bash`, `fork`, `diff`, `merge_into`,
//! `upload`, `download`, on one sandbox per MCP session made on first use
//! (the native session sandbox, [`crate::mcp`]), killed when the session
//! ends. Podflare's published pages name the tools and results but not
//! every argument; the names here follow its SDK (`run_code(code)`,
//! `fork(n)`, `diff(other)`, `merge_into(winner)`, `upload(path, bytes)`,
//! `download(path)`), with files as base64 as its docs say.

use rmcp::model::Tool;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{field, parse, tool, Answer, NativeCall, Seed, SeedError, Step};

/// The endpoint.
pub struct Podflare;

/// `run_python`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct RunPython {
    /// A fork child to use instead of this session's sandbox (not in
    /// Podflare's tools).
    #[schemars(length(max = 128))]
    pub sandbox_id: Option<String>,
    /// Python code; state (variables, imports) persists across calls.
    #[schemars(length(max = 4194304))]
    pub code: String,
}

/// `run_bash`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct RunBash {
    /// A fork child to use instead of this session's sandbox (not in
    /// Podflare's tools).
    #[schemars(length(max = 128))]
    pub sandbox_id: Option<String>,
    /// A bash command line, run in a fresh shell.
    #[schemars(length(max = 131071))]
    pub command: String,
}

/// `fork`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Fork {
    /// How many children (1-32).
    #[schemars(range(min = 1, max = 32))]
    pub n: usize,
}

/// `diff`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Diff {
    /// The sandbox to compare with (a child id from fork).
    #[serde(alias = "sandbox_id")]
    #[schemars(length(min = 1, max = 128))]
    pub other: String,
}

/// `merge_into`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct MergeInto {
    /// The child (from fork) whose state becomes this session's sandbox's.
    #[serde(alias = "sandbox_id")]
    #[schemars(length(min = 1, max = 128))]
    pub winner: String,
}

/// `upload`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Upload {
    /// A fork child to use instead of this session's sandbox (not in
    /// Podflare's tools).
    #[schemars(length(max = 128))]
    pub sandbox_id: Option<String>,
    /// Absolute path in the sandbox.
    #[schemars(length(min = 1, max = 4096))]
    pub path: String,
    /// The bytes, base64 (at most 8 MiB decoded).
    #[serde(alias = "data", alias = "content_base64")]
    #[schemars(length(max = 11184812))]
    pub content: String,
}

/// `download`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Download {
    /// A fork child to use instead of this session's sandbox (not in
    /// Podflare's tools).
    #[schemars(length(max = 128))]
    pub sandbox_id: Option<String>,
    /// Absolute path in the sandbox.
    #[schemars(length(min = 1, max = 4096))]
    pub path: String,
    /// Byte offset to read from (default 0), for files larger than one
    /// result.
    #[serde(default)]
    #[schemars(range(max = 1099511627776u64))]
    pub offset: u64,
}

const RUN_PYTHON: &str = "Run Python in this session's sandbox. State persists across calls (REPL). Returns \
    {stdout, stderr, exit_code} (exit_code 1 when the cell raised; the traceback is in stderr).";
const RUN_BASH: &str = "Run a bash command in this session's sandbox (a fresh subprocess each call: exported \
    variables do not persist). Returns {stdout, stderr, exit_code}.";
const FORK: &str = "Spawn n children (1-32) from this session's sandbox's current state (memory, processes, \
    files), copy on write. Returns the list of child sandbox ids: run in one with sandbox_id, compare it with diff, \
    keep it with merge_into.";
const DIFF: &str = "Filesystem diff between this session's sandbox and another (a fork child): the paths added, \
    removed and modified.";
const MERGE_INTO: &str = "Commit a winner fork as the new parent state: this session's sandbox takes the \
    winner's memory, processes and files and keeps its id; the winner's id ceases to exist.";
const UPLOAD: &str = "Copy base64-encoded bytes into a path inside the sandbox (parent directories are made).";
const DOWNLOAD: &str = "Read a file from the sandbox, returned base64. Differs from Podflare: a file larger than \
    about 380 KiB comes in parts; remaining says how many bytes are left, read on with offset.";

impl Seed for Podflare {
    fn name(&self) -> &'static str {
        "podflare"
    }

    fn instructions(&self) -> &'static str {
        "Tine, serving Podflare's MCP tools: one sandbox per MCP session, made on the first tool call and removed \
         when the session ends (a new session gets a fresh one). Python state persists across run_python calls. \
         fork makes copy-on-write children; diff compares one with this session's sandbox; merge_into keeps one."
    }

    fn tools(&self) -> Vec<Tool> {
        vec![
            tool::<RunPython>("run_python", RUN_PYTHON),
            tool::<RunBash>("run_bash", RUN_BASH),
            tool::<Fork>("fork", FORK),
            tool::<Diff>("diff", DIFF),
            tool::<MergeInto>("merge_into", MERGE_INTO),
            tool::<Upload>("upload", UPLOAD),
            tool::<Download>("download", DOWNLOAD),
        ]
    }

    fn plan(&self, name: &str, args: Value) -> Result<NativeCall, SeedError> {
        Ok(match name {
            "run_python" => {
                let a: RunPython = parse(name, args)?;
                NativeCall::new("sandbox_run_python", json!({ "sandbox_id": a.sandbox_id, "code": a.code }))
            }
            "run_bash" => {
                let a: RunBash = parse(name, args)?;
                NativeCall::new("sandbox_exec", json!({ "sandbox_id": a.sandbox_id, "command": a.command }))
            }
            "fork" => {
                let a: Fork = parse(name, args)?;
                NativeCall::new("sandbox_branch", json!({ "n": a.n }))
            }
            "diff" => {
                let a: Diff = parse(name, args)?;
                NativeCall::new("sandbox_diff", json!({ "b": a.other }))
            }
            "merge_into" => {
                let a: MergeInto = parse(name, args)?;
                NativeCall::new("sandbox_merge_into", json!({ "winner": a.winner }))
            }
            "upload" => {
                let a: Upload = parse(name, args)?;
                NativeCall::new(
                    "sandbox_upload",
                    json!({ "sandbox_id": a.sandbox_id, "path": a.path, "data_base64": a.content }),
                )
            }
            "download" => {
                let a: Download = parse(name, args)?;
                NativeCall::new(
                    "sandbox_download",
                    json!({ "sandbox_id": a.sandbox_id, "path": a.path, "offset": a.offset }),
                )
            }
            other => return Err(SeedError::UnknownTool(other.to_string())),
        })
    }

    fn answer(&self, name: &str, _args: &Value, _step: usize, native: Value) -> Result<Step, SeedError> {
        let done = |v: Value| Ok(Step::Done(Answer::json(v)));
        match name {
            "run_python" => {
                let mut stderr = native["stderr"].as_str().unwrap_or_default().to_string();
                let failed = !native["error"].is_null() || native["timed_out"] == true;
                if let Some(tb) = native["error"]["traceback"].as_str() {
                    stderr.push_str(tb);
                }
                let mut stdout = native["stdout"].as_str().unwrap_or_default().to_string();
                // The cell's last expression, as a REPL echoes it.
                if let Some(r) = native["result"].as_str() {
                    stdout.push_str(r);
                    stdout.push('\n');
                }
                done(json!({ "stdout": stdout, "stderr": stderr, "exit_code": i32::from(failed) }))
            }
            "run_bash" => done(json!({
                "stdout": field(name, &native, "stdout")?,
                "stderr": native["stderr"],
                "exit_code": native["exit_code"].as_i64().unwrap_or(-1),
            })),
            "fork" => {
                let children: Vec<Value> = field(name, &native, "children")?
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| c["sandbox_id"].clone())
                    .collect();
                done(Value::Array(children))
            }
            "diff" => {
                // The report's lists are at the top of the native result.
                let report = native.get("report").unwrap_or(&native);
                field(name, report, "added")?;
                let paths = |k: &str| -> Vec<Value> {
                    report[k].as_array().into_iter().flatten().map(|c| c["path"].clone()).collect()
                };
                done(json!({
                    "added": paths("added"),
                    "removed": paths("removed"),
                    "modified": paths("modified"),
                    "truncated": native["report_truncated"],
                }))
            }
            "merge_into" => done(json!({ "sandbox_id": field(name, &native, "sandbox_id")?, "merged": true })),
            "upload" => done(json!({ "path": field(name, &native, "path")?, "bytes": native["bytes_written"] })),
            "download" => done(json!({
                "path": field(name, &native, "path")?,
                "content": native["data_base64"],
                "bytes": native["bytes"],
                "size": native["size"],
                "offset": native["offset"],
                "remaining": native["remaining"],
            })),
            other => Err(SeedError::UnknownTool(other.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_calls_map_to_native_calls() {
        let p = Podflare;
        assert_eq!(
            p.plan("run_python", json!({"code": "x = 1"})).unwrap(),
            NativeCall::new("sandbox_run_python", json!({"code": "x = 1"}))
        );
        assert_eq!(p.plan("fork", json!({"n": 3})).unwrap(), NativeCall::new("sandbox_branch", json!({"n": 3})));
        assert!(p.plan("fork", json!({"n": "3"})).is_err());
        assert_eq!(
            p.plan("merge_into", json!({"winner": "sb-1"})).unwrap(),
            NativeCall::new("sandbox_merge_into", json!({"winner": "sb-1"}))
        );
        assert_eq!(p.plan("diff", json!({"sandbox_id": "sb-2"})).unwrap().args, json!({"b": "sb-2"}));
    }

    #[test]
    fn fork_answers_the_list_of_child_ids() {
        let native = json!({"children": [{"sandbox_id": "sb-a"}, {"sandbox_id": "sb-b"}]});
        let Step::Done(a) = Podflare.answer("fork", &json!({"n": 2}), 0, native).unwrap() else { panic!() };
        assert_eq!(a.text, r#"["sb-a","sb-b"]"#);
        assert_eq!(a.structured, Some(json!({"result": ["sb-a", "sb-b"]})));
    }
}
