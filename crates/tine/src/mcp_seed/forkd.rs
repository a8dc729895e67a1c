//! `/mcp/forkd`: forkd's MCP tools (`deeplethe/forkd`,
//! `sdk/mcp/forkd_mcp/server.py`): snapshots are Tine templates
//! (`list_snapshots`, `create_snapshot`, `branch_sandbox` = snapshot a
//! running sandbox), `spawn_sandboxes` makes N from one (the default
//! template from the warm pool first, `prewarm` is always so), and the
//! sandbox tools take explicit ids. Records have forkd's fields
//! (`SandboxInfo`, `SnapshotInfo`); lists are structured as
//! `{ "result": [...] }`, as the Python SDK's FastMCP sends them.

use rmcp::model::Tool;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{field, parse, tool, Answer, NativeCall, Seed, SeedError, Step};

/// The endpoint.
pub struct Forkd;

/// Tools without arguments (none others taken: strict converters want
/// `additionalProperties: false`).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoArgs {}

/// `create_snapshot`.
// Some fields are read only as the seed\'s shape (their docs say so).
#[allow(dead_code)]
#[derive(Debug, Deserialize, JsonSchema)]
pub struct CreateSnapshot {
    /// The snapshot's tag (a template name: lowercase letters, digits, '-', '_').
    #[schemars(length(min = 1, max = 63))]
    pub tag: String,
    /// Ignored: Tine boots its own kernel.
    #[schemars(length(max = 4096))]
    pub kernel: Option<String>,
    /// Ignored: Tine boots its own root filesystem.
    #[schemars(length(max = 4096))]
    pub rootfs: Option<String>,
    /// Ignored.
    #[serde(default)]
    pub rw: bool,
    /// Ignored: every sandbox gets its own network device.
    #[schemars(length(max = 64))]
    pub tap: Option<String>,
    /// Seconds to let the guest settle before the snapshot (default 10; Tine
    /// snapshots once the guest agent answers).
    #[schemars(range(max = 3600))]
    pub boot_wait_secs: Option<u64>,
}

fn one() -> usize {
    1
}

/// `spawn_sandboxes`.
// Some fields are read only as the seed\'s shape (their docs say so).
#[allow(dead_code)]
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Spawn {
    /// The snapshot to spawn from ("default": the default template).
    #[schemars(length(min = 1, max = 63))]
    pub snapshot_tag: String,
    /// How many (default 1; at most 64 per call here, where forkd takes
    /// 1000: the native sandbox_create's count).
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = tine_sandbox::MAX_SPAWN))]
    pub n: usize,
    /// Ignored: each sandbox has its own network already.
    #[serde(default)]
    pub per_child_netns: bool,
    /// Ignored (a snapshot's memory is its template's).
    #[schemars(range(max = 1048576))]
    pub memory_limit_mib: Option<u64>,
    /// Accepted: the default template's sandboxes come from the warm pool.
    #[serde(default)]
    pub prewarm: bool,
    /// Ignored.
    #[serde(default)]
    pub live_fork: bool,
}

/// `branch_sandbox`.
// Some fields are read only as the seed\'s shape (their docs say so).
#[allow(dead_code)]
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Branch {
    /// The running sandbox to snapshot.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
    /// The new snapshot's tag (default: "<sandbox_id>-<n>").
    #[schemars(length(max = 63))]
    pub tag: Option<String>,
    /// Ignored (Tine snapshots are always full).
    #[serde(default)]
    pub diff: bool,
    /// Ignored.
    #[serde(default)]
    pub measure_diff: bool,
    /// Ignored.
    #[schemars(length(max = 16))]
    pub mode: Option<String>,
    /// Ignored: the snapshot is ready when the call returns.
    #[serde(default)]
    pub wait: Option<bool>,
}

/// A sandbox by id.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ById {
    /// The sandbox.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
}

fn thirty() -> u32 {
    30
}

/// `exec_command`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Exec {
    /// The sandbox.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
    /// The program and its arguments (argv, no shell).
    #[schemars(length(min = 1, max = 4096), inner(length(max = 131071)))]
    pub args: Vec<String>,
    /// Seconds before it is killed (default 30).
    #[serde(default = "thirty")]
    #[schemars(range(min = 1, max = 86400))]
    pub timeout_secs: u32,
}

/// `eval_code`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Eval {
    /// The sandbox.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
    /// Python code; the value of its last expression is returned.
    #[schemars(length(max = 4194304))]
    pub code: String,
}

fn sixty() -> f64 {
    60.0
}

fn poll() -> u64 {
    200
}

/// `wait_for_text`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct WaitForText {
    /// The sandbox.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
    /// The file to watch in the guest.
    #[schemars(length(min = 1, max = 4096))]
    pub path: String,
    /// The text to wait for.
    #[schemars(length(min = 1, max = 4096))]
    pub marker: String,
    /// Longest wait (seconds, default 60).
    #[serde(default = "sixty")]
    #[schemars(range(min = 0.0, max = 3600.0))]
    pub timeout_secs: f64,
    /// Time between looks (ms, default 200).
    #[serde(default = "poll")]
    #[schemars(range(min = 10, max = 60000))]
    pub poll_interval_ms: u64,
}

const LIST_SNAPSHOTS: &str = "List snapshots (Tine templates): tag, status (ready, writing, failed), created_at_unix.";
const CREATE_SNAPSHOT: &str = "Boot a fresh sandbox and snapshot it as tag, to spawn sandboxes from. Differs from \
    forkd: kernel, rootfs, rw and tap are ignored (Tine boots its own); it returns when the snapshot is ready.";
const SPAWN: &str = "Spawn n sandboxes from snapshot snapshot_tag in one call (\"default\": the default template, \
    served from the warm pool first). Returns their records: id, snapshot_tag, created_at_unix, branch_count.";
const BRANCH: &str = "Snapshot a running sandbox's memory and disk as a new snapshot (tag) to spawn from; the \
    sandbox keeps running. Returns the snapshot record with branched_from.";
const LIST_SANDBOXES: &str = "List running sandboxes with their records.";
const GET_SANDBOX: &str = "One sandbox's record.";
const EXEC: &str = "Run a program with arguments (args is argv, no shell: use [\"sh\", \"-c\", \"...\"] for a \
    shell line) in a sandbox. Returns {stdout, stderr, exit_code}; killed at timeout_secs.";
const EVAL: &str = "Evaluate Python in a sandbox's persistent interpreter. Returns {result, error, exit_code}: result \
    is the last expression's repr, error the exception.";
const WAIT: &str = "Wait until a file in the sandbox contains marker (for a background job's log line). Returns \
    {found, elapsed_ms, last_excerpt} (the file's last 256 characters).";
const PING: &str = "Check that a sandbox's guest agent answers. Returns {pong, sandbox_id}.";
const KILL: &str = "Kill a sandbox and free its memory. Returns {id, killed}.";

/// Seconds since the Unix epoch from ms.
fn unix(ms: &Value) -> u64 {
    ms.as_u64().unwrap_or_default() / 1000
}

/// A native sandbox as forkd's `SandboxInfo`.
fn sandbox_record(sb: &Value) -> Value {
    json!({
        "id": sb["sandbox_id"],
        "snapshot_tag": sb["template"].as_str().unwrap_or("default"),
        "netns": null,
        "guest_addr": null,
        "created_at_unix": unix(&sb["created_at_ms"]),
        "pid": null,
        "memory_limit_mib": sb["memory_mib"],
        "has_branched": sb["lineage"]["children"].as_array().is_some_and(|c| !c.is_empty()),
        "last_branch_memory_path": null,
        "branch_count": sb["lineage"]["children"].as_array().map_or(0, Vec::len),
        "state": sb["state"],
    })
}

/// A native template as forkd's `SnapshotInfo`.
fn snapshot_record(t: &Value) -> Value {
    let status = match t["state"].as_str() {
        Some("ready") => "ready",
        Some("failed") => "failed",
        _ => "writing",
    };
    let mut r = json!({
        "tag": t["name"],
        "dir": "",
        "created_at_unix": unix(&t["created_at_ms"]),
        "status": status,
        "bootable": status == "ready",
    });
    if let Some(from) = t["source_sandbox"].as_str() {
        r["branched_from"] = json!(from);
    }
    r
}

/// The guest-side loop of `wait_for_text`: the file and marker come in the
/// environment (never in the command line), `T` is the limit and `I` the
/// interval (ms). Prints "FOUND ELAPSED_MS", then the file's last 256 bytes.
///
/// POSIX sh, and cheap where a guest is slow: the clock is
/// `/proc/uptime` (10 ms steps) read by the shell's own `read`, the
/// interval's seconds are shell arithmetic, so a look costs one `grep`
/// and one `sleep` (2 programs, against 4 with `date` and `awk`; a
/// program's start took 1.5-3 s on a loaded nested-KVM guest,
/// docs/hosts.md). `date +%s%3N` only where `/proc` is not mounted.
const WAIT_SCRIPT: &str = r#"ms() { if read -r up _ </proc/uptime 2>/dev/null; then
    c=${up#*.}; c=${c%"${c#??}"}; now=$(( ${up%.*} * 1000 + ${c#0} * 10 ))
  else now=$(date +%s%3N); fi; }
f=$(( I % 1000 )); case $f in ?) f=00$f ;; ??) f=0$f ;; esac; pause=$(( I / 1000 )).$f
ms; start=$now; found=0
while :; do
  if grep -qF -- "$MARKER" "$FILE" 2>/dev/null; then found=1; break; fi
  ms; [ $(( now - start )) -ge "$T" ] && break
  sleep "$pause"
done
ms; echo "$found $(( now - start ))"
tail -c 256 "$FILE" 2>/dev/null; true"#;

impl Seed for Forkd {
    fn name(&self) -> &'static str {
        "forkd"
    }

    fn instructions(&self) -> &'static str {
        "Tine, serving forkd's MCP tools: snapshots are Tine templates; spawn_sandboxes makes N sandboxes from \
         one; branch_sandbox snapshots a running sandbox to spawn from; sandboxes are addressed by id. (Tine's \
         own sandbox_branch on /mcp forks a running sandbox into live copy-on-write children instead.)"
    }

    fn tools(&self) -> Vec<Tool> {
        vec![
            tool::<NoArgs>("list_snapshots", LIST_SNAPSHOTS),
            tool::<CreateSnapshot>("create_snapshot", CREATE_SNAPSHOT),
            tool::<Spawn>("spawn_sandboxes", SPAWN),
            tool::<Branch>("branch_sandbox", BRANCH),
            tool::<NoArgs>("list_sandboxes", LIST_SANDBOXES),
            tool::<ById>("get_sandbox", GET_SANDBOX),
            tool::<Exec>("exec_command", EXEC),
            tool::<Eval>("eval_code", EVAL),
            tool::<WaitForText>("wait_for_text", WAIT),
            tool::<ById>("ping_sandbox", PING),
            tool::<ById>("kill_sandbox", KILL),
        ]
    }

    fn plan(&self, name: &str, args: Value) -> Result<NativeCall, SeedError> {
        Ok(match name {
            "list_snapshots" => NativeCall::new("template_list", json!({})),
            "create_snapshot" => {
                let a: CreateSnapshot = parse(name, args)?;
                NativeCall::new("template_create", json!({ "name": a.tag }))
            }
            "spawn_sandboxes" => {
                let a: Spawn = parse(name, args)?;
                let template = (a.snapshot_tag != "default").then_some(a.snapshot_tag);
                NativeCall::new("sandbox_create", json!({ "count": a.n, "template": template }))
            }
            "branch_sandbox" => {
                let a: Branch = parse(name, args)?;
                let tag = a.tag.unwrap_or_else(|| {
                    let ms =
                        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
                    format!("{}-{ms}", a.sandbox_id.to_ascii_lowercase())
                });
                NativeCall::new("sandbox_snapshot", json!({ "sandbox_id": a.sandbox_id, "name": tag }))
            }
            "list_sandboxes" => NativeCall::new("sandbox_list", json!({})),
            "get_sandbox" => {
                let a: ById = parse(name, args)?;
                NativeCall::new("sandbox_info", json!({ "sandbox_id": a.sandbox_id }))
            }
            "exec_command" => {
                let a: Exec = parse(name, args)?;
                NativeCall::new(
                    "sandbox_exec",
                    json!({ "sandbox_id": a.sandbox_id, "argv": a.args, "timeout_secs": a.timeout_secs }),
                )
            }
            "eval_code" => {
                let a: Eval = parse(name, args)?;
                NativeCall::new("sandbox_run_python", json!({ "sandbox_id": a.sandbox_id, "code": a.code }))
            }
            "wait_for_text" => {
                let a: WaitForText = parse(name, args)?;
                let limit_ms = (a.timeout_secs.max(0.0) * 1000.0) as u64;
                NativeCall::new(
                    "sandbox_exec",
                    json!({
                        "sandbox_id": a.sandbox_id,
                        "command": WAIT_SCRIPT,
                        "env": { "FILE": a.path, "MARKER": a.marker, "T": limit_ms.to_string(),
                                 "I": a.poll_interval_ms.to_string() },
                        "timeout_secs": limit_ms / 1000 + 30,
                    }),
                )
            }
            "ping_sandbox" => {
                let a: ById = parse(name, args)?;
                NativeCall::new("sandbox_exec", json!({ "sandbox_id": a.sandbox_id, "argv": ["true"] }))
            }
            "kill_sandbox" => {
                let a: ById = parse(name, args)?;
                NativeCall::new("sandbox_kill", json!({ "sandbox_id": a.sandbox_id }))
            }
            other => return Err(SeedError::UnknownTool(other.to_string())),
        })
    }

    fn answer(&self, name: &str, args: &Value, _step: usize, native: Value) -> Result<Step, SeedError> {
        let done = |v: Value| Ok(Step::Done(Answer::json(v)));
        match name {
            "list_snapshots" => {
                done(field(name, &native, "templates")?.as_array().into_iter().flatten().map(snapshot_record).collect())
            }
            "create_snapshot" => done(snapshot_record(&native)),
            "branch_sandbox" => {
                let mut r = snapshot_record(&native);
                r["branched_from"] = args["sandbox_id"].clone();
                done(r)
            }
            "spawn_sandboxes" => {
                let made = field(name, &native, "sandboxes")?.as_array().cloned().unwrap_or_default();
                if let Some(e) = native["spawn_error"].as_str() {
                    // Partial: the sandboxes made are kept; say so.
                    return Ok(Step::Done(Answer::with_text(
                        format!("spawned {} of {}: {e}", made.len(), args["n"]),
                        json!({ "result": made.iter().map(sandbox_record).collect::<Vec<_>>(), "error": e }),
                    )));
                }
                done(made.iter().map(sandbox_record).collect())
            }
            "list_sandboxes" => {
                done(field(name, &native, "sandboxes")?.as_array().into_iter().flatten().map(sandbox_record).collect())
            }
            "get_sandbox" => done(sandbox_record(&native)),
            "exec_command" => done(json!({
                "stdout": field(name, &native, "stdout")?,
                "stderr": native["stderr"],
                "exit_code": native["exit_code"].as_i64().unwrap_or(-1),
            })),
            "eval_code" => {
                let error = native["error"]
                    .as_object()
                    .map(|e| format!("{}: {}", e["name"].as_str().unwrap_or(""), e["message"].as_str().unwrap_or("")));
                done(json!({
                    "result": native["result"],
                    "error": error,
                    "traceback": native["error"]["traceback"],
                    "exit_code": i32::from(error.is_some()),
                    "stdout": native["stdout"],
                }))
            }
            "wait_for_text" => {
                let out = field(name, &native, "stdout")?.as_str().unwrap_or_default();
                let (head, tail) = out.split_once('\n').unwrap_or((out, ""));
                let mut words = head.split_whitespace();
                let found = words.next() == Some("1");
                // A loop killed at its exec's timeout printed nothing: the
                // exec's own duration is the time waited.
                let elapsed: u64 = words
                    .next()
                    .and_then(|w| w.parse().ok())
                    .unwrap_or_else(|| native["duration_ms"].as_u64().unwrap_or_default());
                done(json!({ "found": found, "elapsed_ms": elapsed, "last_excerpt": tail }))
            }
            "ping_sandbox" => done(json!({ "pong": native["exit_code"] == 0, "sandbox_id": native["sandbox_id"] })),
            "kill_sandbox" => done(json!({ "id": args["sandbox_id"], "killed": native["killed"] })),
            other => Err(SeedError::UnknownTool(other.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_calls_map_to_native_calls() {
        let f = Forkd;
        assert_eq!(
            f.plan("spawn_sandboxes", json!({"snapshot_tag": "default", "n": 4, "prewarm": true})).unwrap(),
            NativeCall::new("sandbox_create", json!({"count": 4}))
        );
        assert_eq!(
            f.plan("spawn_sandboxes", json!({"snapshot_tag": "agent-base"})).unwrap(),
            NativeCall::new("sandbox_create", json!({"count": 1, "template": "agent-base"}))
        );
        assert_eq!(
            f.plan("exec_command", json!({"sandbox_id": "sb-1", "args": ["echo", "hi"]})).unwrap(),
            NativeCall::new("sandbox_exec", json!({"sandbox_id": "sb-1", "argv": ["echo", "hi"], "timeout_secs": 30}))
        );
        assert_eq!(
            f.plan("branch_sandbox", json!({"sandbox_id": "sb-1", "tag": "t1"})).unwrap(),
            NativeCall::new("sandbox_snapshot", json!({"sandbox_id": "sb-1", "name": "t1"}))
        );
        let wait = f.plan("wait_for_text", json!({"sandbox_id": "sb-1", "path": "/tmp/l", "marker": "ready"})).unwrap();
        assert_eq!(wait.args["env"]["MARKER"], "ready");
        assert_eq!(wait.args["env"]["T"], "60000");
    }

    #[test]
    fn wait_for_text_reads_the_guest_loop() {
        let native = json!({"stdout": "1 420\n... ready\n", "exit_code": 0});
        let Step::Done(a) = Forkd.answer("wait_for_text", &json!({}), 0, native).unwrap() else { panic!() };
        assert_eq!(a.structured, Some(json!({"found": true, "elapsed_ms": 420, "last_excerpt": "... ready\n"})));
        // Killed at the exec's timeout: nothing printed, the exec's time.
        let native = json!({"stdout": "", "exit_code": null, "timed_out": true, "duration_ms": 31000});
        let Step::Done(a) = Forkd.answer("wait_for_text", &json!({}), 0, native).unwrap() else { panic!() };
        assert_eq!(a.structured, Some(json!({"found": false, "elapsed_ms": 31000, "last_excerpt": ""})));
    }

    /// The loop itself, run by this host's POSIX sh (the guest's shell is
    /// bash or sh): found at once, found when written later, and given up
    /// after the limit with the time it waited.
    #[test]
    fn the_wait_script_finds_waits_and_gives_up() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("app.log");
        std::fs::write(&log, "booting\nready\n").unwrap();
        let run = |marker: &str, limit_ms: u32, interval_ms: u32| {
            let out = std::process::Command::new("sh")
                .args(["-c", WAIT_SCRIPT])
                .env("FILE", &log)
                .env("MARKER", marker)
                .env("T", limit_ms.to_string())
                .env("I", interval_ms.to_string())
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
            let out = String::from_utf8(out.stdout).unwrap();
            let (head, tail) = out.split_once('\n').unwrap();
            let (found, elapsed) = head.split_once(' ').unwrap();
            (found == "1", elapsed.parse::<u64>().unwrap(), tail.to_string())
        };
        let (found, elapsed, tail) = run("ready", 60_000, 200);
        assert!(found && elapsed < 60_000, "{elapsed}");
        assert_eq!(tail, "booting\nready\n");
        let (found, elapsed, _) = run("never", 300, 7);
        assert!(!found && (300..60_000).contains(&elapsed), "{elapsed}");
        let writer = {
            let log = log.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(300));
                std::fs::write(log, "later\n").unwrap();
            })
        };
        let (found, _, tail) = run("later", 60_000, 50);
        writer.join().unwrap();
        assert!(found);
        assert_eq!(tail, "later\n");
    }
}
