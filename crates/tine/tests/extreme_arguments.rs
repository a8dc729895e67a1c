//! Every tool with extreme arguments, through a real MCP client against a
//! real server with real guests: the server keeps answering, a known-good
//! sandbox keeps its Python state, and the daemon's own memory (outside
//! guest RAM) stays bounded.
//!
//! The walk takes the tool list the server sends (`tools/list`), so a tool
//! added later is walked without editing this file. For each tool it
//! builds a valid base call from the tool's input schema (an explicit
//! `sandbox_id`, so no session sandbox is made; the walker's own sandbox,
//! or a throwaway one for destructive tools), then replaces one argument
//! at a time (nested ones too, such as `network.allow`) with extreme
//! values: for numbers 0, -1, 2^31, 2^53, 2^63, 2^64 and 1.5; for strings
//! 1 MiB of text, a NUL and a path that is no path; for lists and maps
//! 10,000 entries. Where a value breaks a bound the schema states, the call
//! must be refused with a message naming the argument and the bound. After
//! every call: `/healthz` answers and the server's own memory (all but
//! guest RAM) is within 64 MiB of what it was before the walk; after each
//! tool's calls, the walker's sandbox still answers a Python cell with its
//! variable (once per tool, not per call: a cell is half a second of guest
//! work here, and some 400 calls are walked).

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use testkit::mcp::{call, try_call, TineServer};

/// The live-sandbox cap of the test server: `sandbox_branch`'s `n` has
/// this as its schema maximum.
const MAX_SANDBOXES: u64 = 8;
/// How far the server's own memory may grow over the walk (bytes).
const RSS_SLACK: u64 = 64 << 20;
/// Entries of the lists and maps sent.
const MANY: usize = 10_000;

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tine"))
}

/// The ids the base calls name.
struct Ids {
    /// The walker's own sandbox, with `walker_state = 42` in Python.
    walker: String,
    /// A throwaway sandbox, for destructive tools.
    throwaway: String,
    /// A branch child of `throwaway` (a merge's winner).
    child: String,
    /// A background `cat` in the walker's sandbox (stdin open).
    cat: String,
    /// A background process of the walker's sandbox that has ended.
    done: String,
}

/// Optional arguments a base call gives anyway: an explicit sandbox (no
/// session sandbox is made), short timeouts, a recipe's missing `from`
/// (so an accepted `template_create` starts no guest), a command.
const NAMED_OPTIONAL: [&str; 4] = ["sandbox_id", "timeout_secs", "from", "command"];

/// Tools whose base call targets the throwaway sandbox.
const DESTRUCTIVE: [&str; 3] = ["sandbox_kill", "sandbox_merge_into", "template_delete"];

/// A schema with its `$ref` followed into `defs`.
fn resolve<'a>(schema: &'a Value, defs: &'a Value) -> &'a Value {
    match schema.get("$ref").and_then(Value::as_str) {
        Some(r) => &defs[r.trim_start_matches("#/$defs/")],
        None => schema,
    }
}

/// The non-null alternatives of a schema (an `Option` is `anyOf` with
/// null; an untagged enum is `anyOf` of its forms), `$ref`s followed.
fn forms<'a>(schema: &'a Value, defs: &'a Value) -> Vec<&'a Value> {
    let s = resolve(schema, defs);
    if let Some(alts) = s.get("anyOf").or_else(|| s.get("oneOf")).and_then(Value::as_array) {
        if alts.iter().all(|a| a.get("const").is_some() || a.get("enum").is_some()) {
            return vec![s];
        }
        return alts.iter().flat_map(|a| forms(a, defs)).collect();
    }
    let is_null = s.get("type").and_then(Value::as_str) == Some("null");
    if is_null {
        Vec::new()
    } else {
        vec![s]
    }
}

/// Whether `schema` admits type `t` (`type` a name or a list).
fn has_type(schema: &Value, t: &str) -> bool {
    match schema.get("type") {
        Some(Value::String(s)) => s == t,
        Some(Value::Array(a)) => a.iter().any(|v| v == t),
        _ => false,
    }
}

/// A valid value for argument `name` of `tool`, from the ids or its schema.
fn base_value(tool: &str, name: &str, schema: &Value, defs: &Value, ids: &Ids) -> Value {
    let destructive = DESTRUCTIVE.contains(&tool);
    let by_name = match name {
        "sandbox_id" if destructive => Some(json!(ids.throwaway)),
        "sandbox_id" | "a" => Some(json!(ids.walker)),
        "b" | "parent" => Some(json!(ids.throwaway)),
        "winner" => Some(json!(ids.child)),
        "process_id" if matches!(tool, "sandbox_process_wait" | "sandbox_process_output") => Some(json!(ids.done)),
        "process_id" => Some(json!(ids.cat)),
        "path" if tool == "sandbox_download_dir" => Some(json!("/tmp/walker")),
        "path" => Some(json!("/tmp/walker/file.txt")),
        "name" => Some(json!("walker-x")),
        // A recipe from a template that does not exist: a build that an
        // accepted call starts fails at once, without a guest.
        "from" => Some(json!("walker-missing")),
        "setup" => Some(json!(["true"])),
        "command" => Some(json!("true")),
        "code" => Some(json!("1")),
        "content" | "data" => Some(json!("x\n")),
        "data_base64" => Some(json!("eA==")),
        // A cell of 1 MiB takes seconds here (its bytes are copied and
        // parsed in a guest whose page faults are emulated); one past its
        // timeout and the 5 s grace after SIGINT restarts the interpreter
        // empty, as documented, and the walker's variable with it.
        "timeout_secs" if matches!(tool, "sandbox_run_code" | "sandbox_run_python") => Some(json!(120)),
        "timeout_secs" => Some(json!(5)),
        _ => None,
    };
    if let Some(v) = by_name {
        return v;
    }
    let form = forms(schema, defs).into_iter().next().unwrap_or(schema);
    if let Some(first) = form.get("enum").and_then(|e| e.get(0)) {
        return first.clone();
    }
    if let Some(first) = form.get("oneOf").and_then(|o| o.get(0)).and_then(|c| c.get("const")) {
        return first.clone();
    }
    if has_type(form, "integer") || has_type(form, "number") {
        return form.get("minimum").cloned().unwrap_or(json!(1));
    }
    if has_type(form, "string") {
        return json!("x");
    }
    if has_type(form, "boolean") {
        return json!(false);
    }
    if has_type(form, "array") {
        return json!([]);
    }
    json!({})
}

/// One extreme value for an argument, and the bound (if any) it breaks.
struct Extreme {
    label: String,
    value: Value,
    breaks: Option<&'static str>,
}

/// The extreme values for an argument of schema `form`.
fn extremes(form: &Value) -> Vec<Extreme> {
    let mut out = Vec::new();
    let num = |k: &str| form.get(k).and_then(Value::as_f64);
    if has_type(form, "integer") || has_type(form, "number") {
        let integer = has_type(form, "integer");
        let two64: Value = serde_json::from_str("18446744073709551616").unwrap();
        let values: [(&str, Value); 7] = [
            ("0", json!(0)),
            ("-1", json!(-1)),
            ("2^31", json!(1u64 << 31)),
            ("2^53", json!(1u64 << 53)),
            ("2^63", json!(1u64 << 63)),
            ("2^64", two64),
            ("1.5", json!(1.5)),
        ];
        for (label, value) in values {
            let x = value.as_f64().unwrap();
            let breaks = if integer && x.fract() != 0.0 {
                Some("not of type")
            } else if num("minimum").is_some_and(|m| x < m) {
                Some("less than the minimum")
            } else if num("maximum").is_some_and(|m| x > m) {
                Some("greater than the maximum")
            } else {
                None
            };
            out.push(Extreme { label: label.into(), value, breaks });
        }
    }
    // A choice of names (an enum) gets the strings too; it has no length
    // bound of its own to expect in the refusal.
    let choice = form.get("enum").is_some() || form.get("oneOf").is_some();
    if has_type(form, "string") || choice {
        let max = num("maxLength");
        let too_long = |chars: usize| max.is_some_and(|m| chars as f64 > m);
        let mib = "x".repeat(1 << 20);
        out.push(Extreme {
            label: "1 MiB".into(),
            breaks: too_long(1 << 20).then_some("longer than"),
            value: json!(mib),
        });
        out.push(Extreme { label: "NUL".into(), value: json!("\0"), breaks: None });
        out.push(Extreme { label: "bad path".into(), value: json!("../\0/..//x\n"), breaks: None });
    }
    if has_type(form, "array") {
        let max = num("maxItems");
        out.push(Extreme {
            label: format!("{MANY} items"),
            value: Value::Array(vec![json!("x"); MANY]),
            breaks: max.is_some_and(|m| MANY as f64 > m).then_some("more than"),
        });
    }
    if has_type(form, "object") && form.get("additionalProperties").is_some_and(Value::is_object) {
        let max = num("maxProperties");
        let map: Map<String, Value> = (0..MANY).map(|i| (format!("K{i}"), json!("v"))).collect();
        out.push(Extreme {
            label: format!("{MANY} entries"),
            value: Value::Object(map),
            breaks: max.is_some_and(|m| MANY as f64 > m).then_some("more than"),
        });
    }
    out
}

/// Every argument path of a schema's properties (`["network", "allow"]`
/// for a nested one) with its forms.
fn argument_paths(props: &Map<String, Value>, defs: &Value, at: Vec<String>, out: &mut Vec<(Vec<String>, Value)>) {
    for (name, schema) in props {
        let mut path = at.clone();
        path.push(name.clone());
        for form in forms(schema, defs) {
            if let Some(inner) = form.get("properties").and_then(Value::as_object) {
                argument_paths(inner, defs, path.clone(), out);
            } else {
                out.push((path.clone(), form.clone()));
            }
        }
    }
}

/// `args` with `value` at `path` (objects made on the way).
fn with_value(args: &Value, path: &[String], value: Value) -> Value {
    let mut out = args.clone();
    let mut cur = &mut out;
    for key in &path[..path.len() - 1] {
        let obj = cur.as_object_mut().unwrap();
        cur = obj.entry(key.clone()).or_insert_with(|| json!({}));
        if !cur.is_object() {
            *cur = json!({});
        }
    }
    cur.as_object_mut().unwrap().insert(path[path.len() - 1].clone(), value);
    out
}

/// The live sandbox ids.
async fn live_ids(client: &testkit::mcp::McpClient) -> BTreeSet<String> {
    let l = call(client, "sandbox_list", json!({})).await.expect("sandbox_list");
    l["sandboxes"].as_array().unwrap().iter().map(|s| s["sandbox_id"].as_str().unwrap().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_tool_survives_extreme_arguments() {
    if !testkit::kvm_available("every_tool_survives_extreme_arguments") {
        return;
    }
    let config = format!("[limits]\nboot_timeout_secs = 1200\nmax_sandboxes = {MAX_SANDBOXES}\n");
    let server = TineServer::start_with_default_template(binary(), None, &config);
    let client = server.client().await;
    let create = async || {
        call(&client, "sandbox_create", json!({})).await.expect("create")["sandbox_id"].as_str().unwrap().to_string()
    };
    let walker = create().await;
    let py = call(&client, "sandbox_run_python", json!({"sandbox_id": walker, "code": "walker_state = 42"})).await;
    py.expect("set the walker's variable");
    let x = call(
        &client,
        "sandbox_exec",
        json!({"sandbox_id": walker, "command": "mkdir -p /tmp/walker && echo hello > /tmp/walker/file.txt"}),
    )
    .await
    .expect("exec");
    assert_eq!(x["exit_code"], 0, "{x}");
    let bg = async |command: &str| {
        let p = call(&client, "sandbox_exec", json!({"sandbox_id": walker, "command": command, "background": true}));
        p.await.expect("background")["process_id"].as_str().unwrap().to_string()
    };
    let cat = bg("cat > /dev/null").await;
    let done = bg("echo done").await;
    let w = call(&client, "sandbox_process_wait", json!({"process_id": done, "timeout_secs": 120})).await.unwrap();
    assert_eq!(w["outcome"], "exited", "{w}");
    let throwaway = create().await;
    let b = call(&client, "sandbox_branch", json!({"sandbox_id": throwaway, "n": 1})).await.expect("branch");
    let child = b["children"][0]["sandbox_id"].as_str().unwrap().to_string();
    let ids = Ids { walker: walker.clone(), throwaway, child, cat, done };
    let known = live_ids(&client).await;

    // The server answers, and the known-good sandbox keeps its state; the
    // server's own memory is measured once the walk's own set-up is done.
    let answers = |after: &str| {
        let h = server.healthz();
        assert_eq!(h["status"], "ok", "after {after}: {h}");
    };
    let keeps_state = async |after: &str| {
        let r = call(&client, "sandbox_run_python", json!({"sandbox_id": walker, "code": "walker_state"})).await;
        assert_eq!(r.unwrap_or_else(|e| panic!("after {after}: {e}"))["result"], "42", "after {after}");
    };
    answers("the set-up");
    keeps_state("the set-up").await;
    let rss_before = server.own_rss_bytes();

    let tools = client.list_all_tools().await.expect("tools/list");
    assert!(tools.len() >= 25, "{} tools", tools.len());
    let started = Instant::now();
    let (mut calls, mut refused_by_bound, mut max_rss) = (0, 0, rss_before);
    let mut walked = BTreeSet::new();
    for tool in &tools {
        let schema = Value::Object((*tool.input_schema).clone());
        let defs = schema.get("$defs").cloned().unwrap_or(Value::Null);
        let props = schema["properties"].as_object().cloned().unwrap_or_default();
        let required: BTreeSet<&str> =
            schema["required"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        let mut base = Map::new();
        for (name, s) in &props {
            if required.contains(name.as_str()) || NAMED_OPTIONAL.contains(&name.as_str()) {
                base.insert(name.clone(), base_value(&tool.name, name, s, &defs, &ids));
            }
        }
        let base = Value::Object(base);
        let mut paths = Vec::new();
        argument_paths(&props, &defs, Vec::new(), &mut paths);
        for (path, form) in paths {
            for ext in extremes(&form) {
                let args = with_value(&base, &path, ext.value);
                let what = format!("{} {} = {}", tool.name, path.join("."), ext.label);
                let r = tokio::time::timeout(Duration::from_secs(120), try_call(&client, &tool.name, args))
                    .await
                    .unwrap_or_else(|_| panic!("{what}: no answer within 120 s"));
                calls += 1;
                walked.insert(tool.name.to_string());
                if let Some(bound) = ext.breaks {
                    let text = match &r {
                        Ok(r) if r.is_error == Some(true) => {
                            r.content.iter().filter_map(|c| c.as_text()).map(|t| t.text.clone()).collect::<String>()
                        }
                        other => panic!("{what} breaks a bound ({bound}) and was not refused: {other:?}"),
                    };
                    let arg = path.join(".");
                    assert!(
                        text.contains(&format!("{arg} (")) && text.contains(bound) && text.len() < 1024,
                        "{what}: the refusal must name the argument and the bound ({bound}): {text}"
                    );
                    refused_by_bound += 1;
                }
                if let Err(e) = &r {
                    // A protocol-level refusal is an answer too; a broken
                    // transport is not.
                    let e = e.to_string();
                    assert!(!e.contains("Transport") && !e.contains("closed"), "{what}: {e}");
                }
                answers(&what);
                let rss = server.own_rss_bytes();
                max_rss = max_rss.max(rss);
                assert!(
                    rss <= rss_before + RSS_SLACK,
                    "{what}: the server's own memory grew from {} MiB to {} MiB",
                    rss_before >> 20,
                    rss >> 20
                );
            }
        }
        keeps_state(&format!("the calls of {}", tool.name)).await;
        // An accepted call must not leave a sandbox behind: kill new ones.
        for id in live_ids(&client).await.difference(&known) {
            eprintln!("{}: killing {id}, made by an accepted call", tool.name);
            let _ = call(&client, "sandbox_kill", json!({"sandbox_id": id})).await;
        }
    }
    eprintln!(
        "extreme_arguments: {calls} calls over {} tools in {:.0} s, {refused_by_bound} refused by a schema bound; \
         own memory {} MiB before, at most {} MiB",
        walked.len(),
        started.elapsed().as_secs_f64(),
        rss_before >> 20,
        max_rss >> 20
    );
    for must in ["sandbox_branch", "sandbox_create", "sandbox_exec", "sandbox_files_read", "template_create"] {
        assert!(walked.contains(must), "{must} was walked");
    }

    // sandbox_branch's n at its extremes, one by one: refused naming the
    // bound, nothing reserved (no child made, no id used).
    let before = (server.healthz()["sandboxes"].clone(), live_ids(&client).await);
    for n in [json!(1u64 << 63), serde_json::from_str("18446744073709551616").unwrap(), json!(-1), json!(1.5)] {
        let r = try_call(&client, "sandbox_branch", json!({"sandbox_id": ids.walker, "n": n})).await.unwrap();
        assert_eq!(r.is_error, Some(true), "n = {n}");
        let text = r.content[0].as_text().unwrap().text.clone();
        let bound = format!("greater than the maximum of {MAX_SANDBOXES}");
        assert!(
            text.starts_with("sandbox_branch: n (")
                && (text.contains(&bound)
                    || text.contains("less than the minimum of 1")
                    || text.contains("not of type")),
            "n = {n}: {text}"
        );
    }
    assert_eq!((server.healthz()["sandboxes"].clone(), live_ids(&client).await), before, "no child was reserved");
    let rss = server.own_rss_bytes();
    assert!(rss <= rss_before + RSS_SLACK, "the refused branches grew the server to {} MiB", rss >> 20);
    // A branch the cap admits still works, and its child's id is the next.
    let b = call(&client, "sandbox_branch", json!({"sandbox_id": ids.walker, "n": 1})).await.expect("branch n = 1");
    let c = b["children"][0]["sandbox_id"].as_str().unwrap().to_string();
    let r = call(&client, "sandbox_run_python", json!({"sandbox_id": c, "code": "walker_state"})).await.unwrap();
    assert_eq!(r["result"], "42", "the child has the walker's state");
}
