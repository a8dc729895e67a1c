//! `/mcp/microsandbox`: microsandbox's MCP tools (`microsandbox-server`,
//! `lib/mcp.rs`, before namespaces were removed in its #371, which kept
//! the same tools without `namespace`): `sandbox_start`, `sandbox_stop`,
//! `sandbox_run_code`, `sandbox_run_command`, `sandbox_get_metrics`.
//!
//! A microsandbox sandbox is a Tine sandbox named `sandbox` with the label
//! `namespace` ([`NAMESPACE_LABEL`]); results are one text block of
//! pretty-printed JSON, as microsandbox sends them (no structured
//! content): `run_code` and `run_command` give `output` as
//! `[{ stream, text }]` lines, metrics give `cpu_usage` (%),
//! `memory_usage` (MiB) and `disk_usage` (bytes).

use rmcp::model::Tool;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{env_map, field, parse, tool, Answer, NativeCall, Seed, SeedError, Step};

/// The label that holds a sandbox's microsandbox namespace.
pub const NAMESPACE_LABEL: &str = "namespace";

/// Where microsandbox's images work: commands and code start there (it is
/// in Tine's image, on the sandbox's disk).
pub const WORKSPACE: &str = "/workspace";

/// The endpoint.
pub struct Microsandbox;

/// `sandbox_start`'s `config`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct StartConfig {
    /// "microsandbox/python" or "microsandbox/node" (both: the default
    /// template, which has Python 3 and Node.js), or the name of a Tine
    /// template.
    #[schemars(length(max = 255))]
    pub image: Option<String>,
    /// Memory limit in MiB.
    #[schemars(range(min = 64, max = 1048576))]
    pub memory: Option<u64>,
    /// Number of CPUs.
    #[schemars(range(min = 1, max = 64))]
    pub cpus: Option<u64>,
    /// Volumes as "VOLUME:GUEST_PATH": a Tine volume (volume_create on
    /// /mcp) mounted at GUEST_PATH; host paths are not mounted.
    #[serde(default)]
    #[schemars(length(max = 16), inner(length(max = 4200)))]
    pub volumes: Vec<String>,
    /// Ports as "HOST:GUEST" or "PORT" (the same on both sides), on the
    /// server host's loopback.
    #[serde(default)]
    #[schemars(length(max = 16), inner(length(max = 64)))]
    pub ports: Vec<String>,
    /// Environment variables as "KEY=VALUE".
    #[serde(default)]
    #[schemars(length(max = 256), inner(length(max = 32768)))]
    pub envs: Vec<String>,
}

/// `sandbox_start`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Start {
    /// The sandbox's name: 1-63 lowercase letters, digits, '-' and '_'.
    #[schemars(length(min = 1, max = 63))]
    pub sandbox: String,
    /// Its namespace (kept as the label "namespace"; default "default").
    #[schemars(length(max = 63))]
    pub namespace: Option<String>,
    /// How to make it.
    #[serde(default)]
    pub config: Option<StartConfig>,
}

/// A sandbox by name.
// Some fields are read only as the seed\'s shape (their docs say so).
#[allow(dead_code)]
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Named {
    /// The sandbox's name.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox: String,
    /// Its namespace (names are unique across namespaces here).
    #[schemars(length(max = 63))]
    pub namespace: Option<String>,
}

/// `sandbox_run_code`.
// Some fields are read only as the seed\'s shape (their docs say so).
#[allow(dead_code)]
#[derive(Debug, Deserialize, JsonSchema)]
pub struct RunCode {
    /// The sandbox's name.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox: String,
    /// Its namespace.
    #[schemars(length(max = 63))]
    pub namespace: Option<String>,
    /// The code.
    #[schemars(length(max = 4194304))]
    pub code: String,
    /// Programming language: "python", or "nodejs" ("node", "javascript").
    #[schemars(length(max = 32))]
    pub language: String,
    /// Seconds before the cell is stopped (default 60).
    #[schemars(range(min = 1, max = 86400))]
    pub timeout: Option<u32>,
}

/// `sandbox_run_command`.
// Some fields are read only as the seed\'s shape (their docs say so).
#[allow(dead_code)]
#[derive(Debug, Deserialize, JsonSchema)]
pub struct RunCommand {
    /// The sandbox's name.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox: String,
    /// Its namespace.
    #[schemars(length(max = 63))]
    pub namespace: Option<String>,
    /// The program (run without a shell).
    #[schemars(length(min = 1, max = 4096))]
    pub command: String,
    /// Its arguments.
    #[serde(default)]
    #[schemars(length(max = 4095), inner(length(max = 131071)))]
    pub args: Vec<String>,
    /// Seconds before it is killed (default 60).
    #[schemars(range(min = 1, max = 86400))]
    pub timeout: Option<u32>,
}

/// `sandbox_get_metrics`.
// Some fields are read only as the seed\'s shape (their docs say so).
#[allow(dead_code)]
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Metrics {
    /// The namespace, or "*" for all.
    #[schemars(length(max = 63))]
    pub namespace: Option<String>,
    /// One sandbox's name (default: every sandbox of the namespace).
    #[schemars(length(max = 128))]
    pub sandbox: Option<String>,
}

const START: &str = "Start a sandbox (a Linux microVM with Python 3 and Node.js) named sandbox in namespace. \
    config: image (\"microsandbox/python\", \"microsandbox/node\" or a Tine template), memory (MiB), cpus, \
    volumes (\"VOLUME:/path\", Tine volumes), ports (\"8080:80\"), envs (\"KEY=VALUE\"). Differs from \
    microsandbox: names are unique across namespaces, and a name in use is refused until sandbox_stop.";
const STOP: &str = "Stop a sandbox and remove it with its files (start it again to get a fresh one).";
const RUN_CODE: &str = "Run code in a sandbox's persistent interpreter (state is kept between calls): language \
    \"python\" or \"nodejs\". Returns status, language and output: the lines printed, each with its stream \
    (stdout or stderr; an exception's traceback comes on stderr).";
const RUN_COMMAND: &str = "Run a program (command, with args, no shell: use command \"bash\" with args \
    [\"-c\", \"...\"] for a shell line) in a sandbox. Returns command, args, exit_code, success and output lines \
    with their stream.";
const METRICS: &str = "Metrics of the sandboxes of a namespace (\"*\": all), or of one: name, namespace, running, \
    cpu_usage (% of one CPU since the last reading), memory_usage (MiB used in the guest) and disk_usage (bytes \
    used on its disk).";

/// `image` as a native template: `None` for the default.
fn template_of(image: Option<&str>) -> Option<String> {
    match image {
        None | Some("microsandbox/python" | "microsandbox/node" | "") => None,
        Some(other) => Some(other.to_string()),
    }
}

/// A microsandbox port ("HOST:GUEST" or "PORT") as the native "HOST:GUEST".
fn port_of(p: &str) -> String {
    if p.contains(':') {
        p.to_string()
    } else {
        format!("{p}:{p}")
    }
}

/// The native language of a microsandbox one.
fn language_of(tool: &str, language: &str) -> Result<&'static str, SeedError> {
    match language.to_ascii_lowercase().as_str() {
        "python" | "python3" => Ok("python"),
        "node" | "nodejs" | "javascript" => Ok("javascript"),
        other => Err(SeedError::Unsupported {
            tool: tool.to_string(),
            why: format!("Unsupported language: {other} (use \"python\" or \"nodejs\")"),
        }),
    }
}

/// `text` as microsandbox's output lines of `stream` (a final newline
/// ends the last line, it does not start another).
fn lines(stream: &str, text: &str, out: &mut Vec<Value>) {
    if text.is_empty() {
        return;
    }
    for line in text.strip_suffix('\n').unwrap_or(text).split('\n') {
        out.push(json!({ "stream": stream, "text": line }));
    }
}

/// A native result's stdout and stderr as output lines.
fn output(native: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    lines("stdout", native["stdout"].as_str().unwrap_or_default(), &mut out);
    lines("stderr", native["stderr"].as_str().unwrap_or_default(), &mut out);
    out
}

impl Seed for Microsandbox {
    fn name(&self) -> &'static str {
        "microsandbox"
    }

    fn instructions(&self) -> &'static str {
        "Tine, serving microsandbox's MCP tools: start a named sandbox with sandbox_start, run code and \
         commands in it by name, stop it with sandbox_stop. Interpreter state persists between \
         sandbox_run_code calls. The same sandboxes are on this server's /mcp with Tine's own tools."
    }

    fn tools(&self) -> Vec<Tool> {
        vec![
            tool::<Start>("sandbox_start", START),
            tool::<Named>("sandbox_stop", STOP),
            tool::<RunCode>("sandbox_run_code", RUN_CODE),
            tool::<RunCommand>("sandbox_run_command", RUN_COMMAND),
            tool::<Metrics>("sandbox_get_metrics", METRICS),
        ]
    }

    fn plan(&self, name: &str, args: Value) -> Result<NativeCall, SeedError> {
        Ok(match name {
            "sandbox_start" => {
                let a: Start = parse(name, args)?;
                let config = a.config.unwrap_or_default();
                let mut volumes = Vec::new();
                for v in &config.volumes {
                    match v.split_once(':') {
                        Some((volume, path)) if !volume.starts_with('/') => {
                            volumes.push(json!({ "name": volume, "path": path }))
                        }
                        _ => {
                            return Err(SeedError::Unsupported {
                                tool: name.into(),
                                why: format!(
                                    "volume {v:?}: host directories are not mounted; make a volume with volume_create \
                                     on /mcp and pass \"NAME:/guest/path\""
                                ),
                            })
                        }
                    }
                }
                let namespace = a.namespace.unwrap_or_else(|| "default".into());
                NativeCall::new(
                    "sandbox_create",
                    json!({
                        "name": a.sandbox,
                        "labels": { NAMESPACE_LABEL: namespace },
                        "template": template_of(config.image.as_deref()),
                        "memory_mib": config.memory,
                        "vcpus": config.cpus,
                        "env": env_map(&config.envs),
                        "ports": config.ports.iter().map(|p| port_of(p)).collect::<Vec<_>>(),
                        "volumes": volumes,
                        // microsandbox's images work in /workspace (its
                        // guide lists it and sets PYTHONPATH to it).
                        "working_dir": WORKSPACE,
                    }),
                )
            }
            "sandbox_stop" => {
                let a: Named = parse(name, args)?;
                NativeCall::new("sandbox_kill", json!({ "sandbox_id": a.sandbox }))
            }
            "sandbox_run_code" => {
                let a: RunCode = parse(name, args)?;
                NativeCall::new(
                    "sandbox_run_code",
                    json!({
                        "sandbox_id": a.sandbox,
                        "language": language_of(name, &a.language)?,
                        "code": a.code,
                        "timeout_secs": a.timeout,
                    }),
                )
            }
            "sandbox_run_command" => {
                let a: RunCommand = parse(name, args)?;
                let argv: Vec<String> = std::iter::once(a.command).chain(a.args).collect();
                NativeCall::new(
                    "sandbox_exec",
                    json!({ "sandbox_id": a.sandbox, "argv": argv, "timeout_secs": a.timeout }),
                )
            }
            "sandbox_get_metrics" => {
                let a: Metrics = parse(name, args)?;
                let labels = match a.namespace.as_deref() {
                    None | Some("*") => json!({}),
                    Some(ns) => json!({ NAMESPACE_LABEL: ns }),
                };
                NativeCall::new("sandbox_list", json!({ "usage": true, "labels": labels }))
            }
            other => return Err(SeedError::UnknownTool(other.to_string())),
        })
    }

    fn answer(&self, name: &str, args: &Value, _step: usize, native: Value) -> Result<Step, SeedError> {
        let text = |v: Value| Ok(Step::Done(Answer::text_json(&v)));
        match name {
            "sandbox_start" => {
                text(Value::String(format!("Sandbox {} started successfully", args["sandbox"].as_str().unwrap_or(""))))
            }
            "sandbox_stop" => {
                text(Value::String(format!("Sandbox {} stopped successfully", args["sandbox"].as_str().unwrap_or(""))))
            }
            "sandbox_run_code" => {
                let mut out = output(&native);
                if let Some(tb) = native["error"]["traceback"].as_str().filter(|t| !t.is_empty()) {
                    lines("stderr", tb, &mut out);
                } else if let Some(e) = native["error"].as_object() {
                    let line = format!("{}: {}", e["name"].as_str().unwrap_or(""), e["message"].as_str().unwrap_or(""));
                    lines("stderr", &line, &mut out);
                }
                text(json!({ "status": "success", "language": args["language"], "output": out }))
            }
            "sandbox_run_command" => {
                // A signal (or a timeout) ends it without an exit code:
                // microsandbox reports 1 then.
                let code = field(name, &native, "exit_code")?.as_i64().unwrap_or(1);
                text(json!({
                    "command": args["command"],
                    "args": args.get("args").cloned().unwrap_or_else(|| json!([])),
                    "exit_code": code,
                    "success": code == 0,
                    "output": output(&native),
                }))
            }
            "sandbox_get_metrics" => {
                let want = args.get("sandbox").and_then(Value::as_str);
                let sandboxes: Vec<Value> = field(name, &native, "sandboxes")?
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|sb| sb["labels"].get(NAMESPACE_LABEL).is_some() || args["namespace"] == "*")
                    .map(|sb| {
                        let name = sb["name"].as_str().or(sb["sandbox_id"].as_str()).unwrap_or_default();
                        let usage = &sb["usage"];
                        let memory = usage["guest_memory_used_bytes"].as_u64().or(usage["host_memory_bytes"].as_u64());
                        let disk = match (usage["disk_size_bytes"].as_u64(), usage["disk_free_bytes"].as_u64()) {
                            (Some(size), Some(free)) => Some(size.saturating_sub(free)),
                            _ => usage["disk_host_bytes"].as_u64(),
                        };
                        json!({
                            "namespace": sb["labels"].get(NAMESPACE_LABEL).cloned().unwrap_or_else(|| json!("default")),
                            "name": name,
                            "running": sb["state"] == "running",
                            "cpu_usage": usage["cpu_percent"],
                            "memory_usage": memory.map(|b| b >> 20),
                            "disk_usage": disk,
                        })
                    })
                    .filter(|m| want.is_none_or(|w| m["name"] == w))
                    .collect();
                text(json!({ "sandboxes": sandboxes }))
            }
            other => Err(SeedError::UnknownTool(other.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// microsandbox's documented calls become these native calls.
    #[test]
    fn documented_calls_map_to_native_calls() {
        let m = Microsandbox;
        let start = m
            .plan(
                "sandbox_start",
                json!({"sandbox": "my-python-env", "namespace": "default",
                       "config": {"image": "microsandbox/python", "memory": 512, "cpus": 1,
                                  "ports": ["8080:80", "9000"], "envs": ["A=1", "B=x=y"]}}),
            )
            .unwrap();
        assert_eq!(
            start,
            NativeCall::new(
                "sandbox_create",
                json!({"name": "my-python-env", "labels": {"namespace": "default"}, "memory_mib": 512, "vcpus": 1,
                       "env": {"A": "1", "B": "x=y"}, "ports": ["8080:80", "9000:9000"], "volumes": [],
                       "working_dir": "/workspace"})
            )
        );
        let code = m
            .plan(
                "sandbox_run_code",
                json!({"sandbox": "my-python-env", "namespace": "default", "code": "print(1)", "language": "nodejs"}),
            )
            .unwrap();
        assert_eq!(code.args, json!({"sandbox_id": "my-python-env", "language": "javascript", "code": "print(1)"}));
        let cmd = m
            .plan(
                "sandbox_run_command",
                json!({"sandbox": "s", "namespace": "default", "command": "ls", "args": ["-la", "/"]}),
            )
            .unwrap();
        assert_eq!(cmd, NativeCall::new("sandbox_exec", json!({"sandbox_id": "s", "argv": ["ls", "-la", "/"]})));
        let e = m.plan("sandbox_run_code", json!({"sandbox": "s", "code": "", "language": "ruby"})).unwrap_err();
        assert!(e.to_string().contains("Unsupported language: ruby"), "{e}");
        let e =
            m.plan("sandbox_start", json!({"sandbox": "s", "config": {"volumes": ["/home/me:/data"]}})).unwrap_err();
        assert!(e.to_string().contains("volume_create"), "{e}");
        assert!(m.plan("sandbox_start", json!({"namespace": "x"})).is_err(), "sandbox is required");
    }

    #[test]
    fn output_lines_keep_their_stream() {
        let native = json!({"stdout": "a\nb\n", "stderr": "oops\n", "exit_code": null});
        let Step::Done(a) = Microsandbox.answer("sandbox_run_command", &json!({"command": "x"}), 0, native).unwrap()
        else {
            panic!("one step")
        };
        let v: Value = serde_json::from_str(&a.text).unwrap();
        assert_eq!(v["exit_code"], 1, "a signal is exit code 1");
        assert_eq!(
            v["output"],
            json!([{"stream": "stdout", "text": "a"}, {"stream": "stdout", "text": "b"},
                   {"stream": "stderr", "text": "oops"}])
        );
        assert!(a.structured.is_none(), "microsandbox sends text only");
    }
}
