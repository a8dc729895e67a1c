//! End-to-end: `tine server start` as a subprocess, real microVMs, and a
//! real MCP client over Streamable HTTP.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};
use testkit::mcp::{call, try_call, TineServer};

/// The tests here share the host's two cores; one at a time keeps boot
/// times sane.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const TOKEN: &str = "e2e-test-token-0123456789abcdef0123456789abcdef";
/// Slow hosts (nested, emulated kernel mode) restore guests side by side
/// in minutes, not seconds.
const CONFIG: &str = "[limits]\nboot_timeout_secs = 1200\nmax_sandboxes = 12\n";

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tine"))
}

/// The JSON-RPC message in a Streamable HTTP response (JSON or SSE).
fn rpc_body(text: &str) -> Value {
    if let Ok(v) = serde_json::from_str(text) {
        return v;
    }
    let data = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim)
        .find(|d| d.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON-RPC message in {text:?}"));
    serde_json::from_str(data).unwrap()
}

async fn raw_initialize(http: &reqwest::Client, url: &str, token: &str, version: &str) -> reqwest::Response {
    http.post(url)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(
            json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": version, "capabilities": {},
                "clientInfo": {"name": "raw", "version": "0"}}})
            .to_string(),
        )
        .bearer_auth(token)
        .send()
        .await
        .expect("POST /mcp")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mcp_end_to_end() {
    if !testkit::kvm_available("mcp_end_to_end") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut server = TineServer::start_with_default_template(binary(), Some(TOKEN), CONFIG);
    let http = reqwest::Client::new();

    // The 401 Bearer challenge, the Host check and the body limit are tested
    // without KVM on the router (src/server/tests.rs); here, over a real
    // socket: /healthz is open, and a foreign Host is refused.
    let health = http.get(format!("{}/healthz", server.base)).send().await.unwrap();
    assert_eq!(health.status(), 200);
    // Without the token it says only that the server is up.
    assert_eq!(health.json::<Value>().await.unwrap(), json!({"status": "ok"}));
    let health = http.get(format!("{}/healthz", server.base)).bearer_auth(TOKEN).send().await.unwrap();
    // (The default template's build VM may be counted while it runs.)
    assert!(health.json::<Value>().await.unwrap()["sandboxes"].is_u64(), "the sandbox count with the token");
    // A Host header outside the allowed list is refused (DNS rebinding).
    let r = http
        .post(&server.url)
        .header("host", "evil.example")
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);

    // Both protocol versions negotiate as asked.
    for version in ["2025-06-18", "2025-11-25"] {
        let r = raw_initialize(&http, &server.url, TOKEN, version).await;
        assert_eq!(r.status(), 200);
        assert!(r.headers().get("mcp-session-id").is_some(), "a session id for {version}");
        let body = rpc_body(&r.text().await.unwrap());
        assert_eq!(body["result"]["protocolVersion"], version, "{body}");
        assert_eq!(body["result"]["serverInfo"]["name"], "tine");
    }

    let client = server.client().await;
    let tools = client.list_all_tools().await.expect("tools/list");
    let names: BTreeSet<String> = tools.iter().map(|t| t.name.to_string()).collect();
    for want in [
        "sandbox_create",
        "sandbox_list",
        "sandbox_info",
        "sandbox_kill",
        "sandbox_exec",
        "sandbox_run_python",
        "sandbox_files_read",
        "sandbox_files_write",
        "sandbox_files_list",
        "sandbox_upload",
        "sandbox_download",
        "sandbox_pause",
        "sandbox_resume",
        "sandbox_snapshot",
        "template_list",
        "template_delete",
        "sandbox_update",
        "sandbox_network_log",
    ] {
        assert!(names.contains(want), "missing tool {want}: {names:?}");
    }
    let tool = |n: &str| tools.iter().find(|t| t.name == n).unwrap().clone();
    assert_eq!(tool("sandbox_list").annotations.unwrap().read_only_hint, Some(true));
    assert_eq!(tool("sandbox_kill").annotations.unwrap().destructive_hint, Some(true));
    assert!(tool("sandbox_exec").output_schema.is_some(), "structured output has a schema");
    let d = tool("sandbox_create").description.unwrap_or_default();
    assert!(d.contains("Network: "), "sandbox_create's description says what network sandboxes have: {d}");
    // The core toolset, as a client that asks for it sees it on a server
    // with a network: at most 12 tools and 10,000 characters of
    // descriptions and input schemas.
    let core = testkit::mcp::connect(&format!("{}?tools=core", server.url), Some(TOKEN)).await;
    let core_tools = core.list_all_tools().await.expect("tools/list of core");
    let cost: usize = core_tools
        .iter()
        .map(|t| t.description.as_deref().map_or(0, str::len) + serde_json::to_string(&*t.input_schema).unwrap().len())
        .sum();
    eprintln!("core toolset: {} tools, {cost} characters (full: {} tools)", core_tools.len(), tools.len());
    assert!(core_tools.len() <= 12 && cost <= 10_000, "core: {} tools, {cost} characters", core_tools.len());
    // Its maps are arrays of {name, value}, as strict clients send them.
    let r = call(
        &core,
        "sandbox_exec",
        json!({"command": "echo $GREETING", "env": [{"name": "GREETING", "value": "pairs"}]}),
    )
    .await
    .expect("exec with env as pairs");
    assert_eq!(r["stdout"], "pairs\n", "{r}");
    let e = call(&core, "sandbox_process_list", json!({})).await.unwrap_err();
    assert!(e.contains("not in this connection's toolset (core)"), "{e}");
    let _ = core.cancel().await;

    // Bad input: a tool error that says what to do, or a protocol error; the
    // server stays up.
    let e = call(&client, "sandbox_exec", json!({"sandbox_id": "sb-999", "command": "true"})).await.unwrap_err();
    assert!(e.contains("no sandbox sb-999") && e.contains("sandbox_list"), "{e}");
    match try_call(&client, "sandbox_exec", json!({"sandbox_id": "sb-1"})).await {
        Err(e) => assert!(e.to_string().contains("command"), "{e}"),
        Ok(r) => {
            assert_eq!(r.is_error, Some(true), "a call without `command` fails");
            assert!(format!("{:?}", r.content).contains("command"), "{r:?}");
        }
    }
    let e = call(&client, "sandbox_create", json!({"vcpus": 99})).await.unwrap_err();
    assert!(e.contains("vcpus (99) is greater than the maximum of 8"), "{e}");
    let e = call(&client, "sandbox_upload", json!({"path": "/x", "data_base64": "!!"})).await.unwrap_err();
    assert!(e.contains("base64"), "{e}");

    // An explicit sandbox.
    let t = Instant::now();
    let created =
        call(&client, "sandbox_create", json!({"labels": {"suite": "e2e"}, "name": "e2e-box"})).await.expect("create");
    eprintln!("sandbox_create: {:.1} s", t.elapsed().as_secs_f64());
    let id = created["sandbox_id"].as_str().unwrap().to_string();
    assert_eq!((created["state"].as_str(), created["name"].as_str()), (Some("running"), Some("e2e-box")));
    let e = call(&client, "sandbox_create", json!({"name": "e2e-box"})).await.unwrap_err();
    assert!(e.contains("a sandbox named \"e2e-box\" exists already"), "{e}");
    assert_eq!(created["vcpus"], 1);
    assert_eq!(created["memory_mib"], 512);

    // Its name is taken wherever its id is.
    let v = call(&client, "sandbox_run_python", json!({"sandbox_id": "e2e-box", "code": "import sys; sys.version"}))
        .await
        .unwrap();
    assert!(v["result"].as_str().unwrap().starts_with("'3."), "{v}");
    call(&client, "sandbox_run_python", json!({"sandbox_id": id, "code": "x = 41"})).await.unwrap();
    let v = call(&client, "sandbox_run_python", json!({"sandbox_id": id, "code": "x += 1\nprint('x is', x)\nx"}))
        .await
        .unwrap();
    assert_eq!(v["result"], "42");
    assert_eq!(v["stdout"], "x is 42\n");
    let v = call(&client, "sandbox_run_python", json!({"sandbox_id": id, "code": "1/0"})).await.unwrap();
    assert_eq!(v["error"]["name"], "ZeroDivisionError");

    let w = call(
        &client,
        "sandbox_files_write",
        json!({"sandbox_id": id, "path": "/work/notes/hello.txt", "content": "hello from MCP\n"}),
    )
    .await
    .unwrap();
    assert_eq!(w["bytes_written"], 15);
    let r =
        call(&client, "sandbox_files_read", json!({"sandbox_id": id, "path": "/work/notes/hello.txt"})).await.unwrap();
    assert_eq!(r["content"], "hello from MCP\n");
    assert_eq!(r["remaining"], 0);
    let l = call(&client, "sandbox_files_list", json!({"sandbox_id": id, "path": "/work/notes"})).await.unwrap();
    assert_eq!(l["entries"][0]["name"], "hello.txt");
    assert_eq!(l["entries"][0]["kind"], "file");
    let e = call(&client, "sandbox_files_read", json!({"sandbox_id": id, "path": "/nope"})).await.unwrap_err();
    assert!(e.contains("/nope: no such file"), "{e}");

    let blob: Vec<u8> = (0..70_000u32).map(|i| (i * 7 % 256) as u8).collect();
    let b64 = base64::engine::general_purpose::STANDARD;
    let up = call(
        &client,
        "sandbox_upload",
        json!({"sandbox_id": id, "path": "/tmp/blob", "data_base64": b64.encode(&blob)}),
    )
    .await
    .unwrap();
    assert_eq!(up["bytes_written"], 70_000);
    let down = call(&client, "sandbox_download", json!({"sandbox_id": id, "path": "/tmp/blob"})).await.unwrap();
    assert_eq!(b64.decode(down["data_base64"].as_str().unwrap()).unwrap(), blob);
    let e = call(&client, "sandbox_files_read", json!({"sandbox_id": id, "path": "/tmp/blob"})).await.unwrap_err();
    assert!(e.contains("sandbox_download"), "{e}");

    let x = call(
        &client,
        "sandbox_exec",
        json!({"sandbox_id": id, "command": "echo $((6*7)) $GREETING; cat; echo oops >&2; exit 3",
               "env": {"GREETING": "hi"}, "stdin": "from stdin\n"}),
    )
    .await
    .unwrap();
    assert_eq!(x["exit_code"], 3, "{x}");
    assert_eq!(x["stdout"], "42 hi\nfrom stdin\n");
    assert_eq!(x["stderr"], "oops\n");
    let x = call(&client, "sandbox_exec", json!({"sandbox_id": id, "command": "sleep 30", "timeout_secs": 2}))
        .await
        .unwrap();
    assert_eq!(x["timed_out"], true, "{x}");

    let list = call(&client, "sandbox_list", json!({"labels": {"suite": "e2e"}, "usage": true})).await.unwrap();
    let ids: Vec<&str> =
        list["sandboxes"].as_array().unwrap().iter().map(|s| s["sandbox_id"].as_str().unwrap()).collect();
    assert_eq!(ids, vec![id.as_str()]);
    assert_eq!(list["sandboxes"][0]["name"], "e2e-box");
    let usage = &list["sandboxes"][0]["usage"];
    assert!(usage["cpu_percent"].is_number() && usage["host_memory_bytes"].as_u64() > Some(1 << 20), "{list}");
    // Spawn N: two of the default template in one call.
    let spawned = call(&client, "sandbox_create", json!({"count": 2, "labels": {"suite": "spawn"}})).await.unwrap();
    let made: Vec<String> = spawned["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["sandbox_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(made.len(), 2, "{spawned}");
    assert!(spawned["spawn_ms"].is_u64() && spawned["spawn_error"].is_null(), "{spawned}");
    eprintln!("sandbox_create {{ count: 2 }}: {} ms", spawned["spawn_ms"]);
    for s in &made {
        call(&client, "sandbox_kill", json!({"sandbox_id": s})).await.unwrap();
    }
    let none = call(&client, "sandbox_list", json!({"labels": {"suite": "other"}})).await.unwrap();
    assert!(none["sandboxes"].as_array().unwrap().is_empty());
    let info = call(&client, "sandbox_info", json!({"sandbox_id": id})).await.unwrap();
    assert_eq!(info["state"], "running");
    assert!(info["usage"]["cpu_time_ms"].as_u64().unwrap() > 0, "{info}");
    assert!(info["usage"]["host_memory_bytes"].as_u64().unwrap() > 1 << 20, "{info}");
    assert!(info["usage"]["guest_memory_total_bytes"].as_u64().unwrap() > 256 << 20, "{info}");

    // Pause, then a command resumes the sandbox by itself.
    let p = call(&client, "sandbox_pause", json!({"sandbox_id": id})).await.unwrap();
    assert_eq!(p["state"], "paused", "{p}");
    let p = call(&client, "sandbox_info", json!({"sandbox_id": id})).await.unwrap();
    assert_eq!(p["state"], "paused", "{p}");
    let x = call(&client, "sandbox_exec", json!({"sandbox_id": id, "command": "echo back"})).await.unwrap();
    assert_eq!(x["stdout"], "back\n");
    let p = call(&client, "sandbox_pause", json!({"sandbox_id": id})).await.unwrap();
    assert_eq!(p["state"], "paused");
    let r = call(&client, "sandbox_resume", json!({"sandbox_id": id})).await.unwrap();
    assert_eq!(r["state"], "running");

    let k = call(&client, "sandbox_kill", json!({"sandbox_id": "e2e-box"})).await.unwrap();
    assert_eq!((k["killed"].as_bool(), k["sandbox_id"].as_str()), (Some(true), Some(id.as_str())), "killed by name");
    let e = call(&client, "sandbox_exec", json!({"sandbox_id": id, "command": "true"})).await.unwrap_err();
    assert!(e.contains(&format!("no sandbox {id}")), "{e}");
    assert!(!server.data_dir.join("sandboxes").join(&id).exists(), "the killed sandbox's files are gone");

    // The session's own sandbox: no sandbox_id at all.
    let x = call(&client, "sandbox_exec", json!({"command": "cat /proc/sys/kernel/hostname; echo ok"})).await.unwrap();
    assert_eq!(x["exit_code"], 0, "{x}");
    let own = x["sandbox_id"].as_str().unwrap().to_string();
    assert_ne!(own, id);
    call(&client, "sandbox_run_python", json!({"code": "y = 'kept'"})).await.unwrap();
    let v = call(&client, "sandbox_run_python", json!({"code": "y"})).await.unwrap();
    assert_eq!(v["result"], "'kept'");
    assert_eq!(v["sandbox_id"], own.as_str());

    // SIGTERM with the session's sandbox alive: clean exit, no files left.
    assert!(server.data_dir.join("sandboxes").join(&own).exists());
    let status = server.terminate();
    assert!(status.success(), "{status:?}");
    let left: Vec<_> = std::fs::read_dir(server.data_dir.join("sandboxes")).unwrap().collect();
    assert!(left.is_empty(), "files left after SIGTERM: {left:?}");
}

/// What of the server's VMs is still there: thread names, fds to KVM,
/// guest memory or sandbox files.
fn vm_leftovers(pid: u32, data_dir: &Path) -> Vec<String> {
    let mut left = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let comm = comm.trim();
        if comm.starts_with("vcpu") || comm.starts_with("devices-") || comm.starts_with("mon-") {
            left.push(format!("thread {comm}"));
        }
    }
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
        let target = std::fs::read_link(fd.path()).map(|p| p.display().to_string()).unwrap_or_default();
        let sandbox_file = target.contains(&data_dir.join("sandboxes").display().to_string());
        if target.contains("kvm") || target.contains("tine-guest-ram") || sandbox_file {
            left.push(format!("fd {} -> {target}", fd.file_name().to_string_lossy()));
        }
    }
    for e in std::fs::read_dir(data_dir.join("sandboxes")).unwrap().flatten() {
        left.push(format!("file {}", e.path().display()));
    }
    left
}

/// Two sessions at once, each working in the sandbox its first call made;
/// the first ends it with `sandbox_kill`, the second by ending the MCP
/// session (DELETE /mcp), which kills the session's own sandbox. Nothing of
/// either VM is left in the server (threads, fds, files), and `/healthz`
/// counts no sandbox. (Many concurrent sessions are `load.rs`; a guest
/// crash is `processes.rs`; the reaper's idle hibernation is `keep.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sessions_end_with_their_sandboxes() {
    if !testkit::kvm_available("sessions_end_with_their_sandboxes") {
        return;
    }
    let _serial = SERIAL.lock().await;
    // The baseline is taken once the default template is there (and any
    // build VM gone).
    let server = TineServer::start_with_default_template(binary(), None, CONFIG);
    let pid = server.pid();
    let before = vm_leftovers(pid, &server.data_dir);
    assert!(before.is_empty(), "{before:?}");

    let mut tasks = Vec::new();
    for i in 0..2u32 {
        let client = server.client().await;
        tasks.push(tokio::spawn(async move {
            // Builtins only: the check is the session's sandbox, not a
            // process start.
            let command = format!("echo session-{i}; echo $(({i} * 1000))");
            let x = call(&client, "sandbox_exec", json!({"command": command, "timeout_secs": 600}))
                .await
                .unwrap_or_else(|e| panic!("session {i}: {e}"));
            assert_eq!(x["stdout"], format!("session-{i}\n{}\n", i * 1000), "session {i}: {x}");
            (client, x["sandbox_id"].as_str().unwrap().to_string())
        }));
    }
    let mut sessions = Vec::new();
    for task in tasks {
        sessions.push(task.await.expect("session task"));
    }
    assert_ne!(sessions[0].1, sessions[1].1, "each session has its own sandbox");

    let (ending, ending_id) = sessions.pop().unwrap();
    let (killer, killed_id) = sessions.pop().unwrap();
    let k = call(&killer, "sandbox_kill", json!({})).await.expect("kill the session's sandbox");
    assert_eq!(k["sandbox_id"], killed_id.as_str());
    ending.cancel().await.expect("end the MCP session");

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = vm_leftovers(pid, &server.data_dir);
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "left after both sessions ended ({ending_id}): {left:#?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let health: Value = reqwest::get(format!("{}/healthz", server.base)).await.unwrap().json().await.unwrap();
    assert_eq!(health["sandboxes"], 0, "{health}");
    let list = call(&killer, "sandbox_list", json!({})).await.expect("list");
    assert_eq!(list["sandboxes"].as_array().map(Vec::len), Some(0), "{list}");
}

/// The template test: a sandbox with Python state and a file is
/// saved as a template; three sandboxes made from it have both; writes stay
/// in the sandbox that made them; every sandbox draws its own randomness.
/// Then damaged templates are refused with a clear error while the server
/// goes on. (The first create's wait for the default template's build, with
/// progress, is `default_template.rs`: this server copies that template.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn templates_end_to_end() {
    if !testkit::kvm_available("templates_end_to_end") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let server = TineServer::start_with_default_template(binary(), None, CONFIG);
    let client = server.client().await;

    let source = call(&client, "sandbox_create", json!({})).await.expect("create the source");
    assert_eq!(source["template"], "default", "{source}");
    let src = source["sandbox_id"].as_str().unwrap().to_string();
    let py = |id: &str, code: &str| json!({"sandbox_id": id, "code": code});
    let v = call(&client, "sandbox_run_python", py(&src, "x = 1234\nnote = 'from the source'\nx")).await.unwrap();
    assert_eq!(v["result"], "1234", "{v}");
    call(
        &client,
        "sandbox_files_write",
        json!({"sandbox_id": src, "path": "/root/work/state.txt", "content": "made before the snapshot\n"}),
    )
    .await
    .expect("write");

    let tpl =
        call(&client, "sandbox_snapshot", json!({"sandbox_id": src, "name": "with-state"})).await.expect("snapshot");
    assert_eq!(tpl["name"], "with-state");
    assert_eq!(tpl["source_sandbox"], src.as_str());
    assert_eq!(tpl["memory_mib"], 512);
    let e = call(&client, "sandbox_snapshot", json!({"sandbox_id": src, "name": "with-state"})).await.unwrap_err();
    assert!(e.contains("exists already"), "{e}");
    let e = call(&client, "sandbox_snapshot", json!({"sandbox_id": src, "name": "../x"})).await.unwrap_err();
    assert!(e.contains("name (\"../x\") does not match"), "{e}");
    let list = call(&client, "template_list", json!({})).await.unwrap();
    let names: Vec<&str> = list["templates"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["default", "with-state"], "{list}");
    // The server's template names are not the clients' to write or delete.
    for name in ["default", "tine-x"] {
        let e = call(&client, "sandbox_snapshot", json!({"sandbox_id": src, "name": name})).await.unwrap_err();
        assert!(e.contains("reserved for the server"), "{e}");
        let e = call(&client, "template_delete", json!({"name": name})).await.unwrap_err();
        assert!(e.contains("reserved for the server"), "{e}");
    }

    // Three sandboxes from the template, at once.
    let t = Instant::now();
    let shared = std::sync::Arc::new(client);
    let creates: Vec<_> = (0..3)
        .map(|_| {
            let c = shared.clone();
            tokio::spawn(async move { call(&c, "sandbox_create", json!({"template": "with-state"})).await })
        })
        .collect();
    let mut kids = Vec::new();
    for c in creates {
        let info = c.await.unwrap().expect("create from the template");
        assert_eq!(info["template"], "with-state");
        kids.push(info["sandbox_id"].as_str().unwrap().to_string());
    }
    let client = std::sync::Arc::into_inner(shared).expect("the create tasks are done");
    eprintln!("three sandboxes from the template: {:.1} s", t.elapsed().as_secs_f64());
    for id in &kids {
        let v = call(&client, "sandbox_run_python", py(id, "(x, note)")).await.unwrap();
        assert_eq!(v["result"], "(1234, 'from the source')", "{id}: {v}");
        let f = call(&client, "sandbox_files_read", json!({"sandbox_id": id, "path": "/root/work/state.txt"}))
            .await
            .unwrap();
        assert_eq!(f["content"], "made before the snapshot\n", "{id}");
    }

    // A write in one is seen by no other, nor by the source.
    let (first, others) = kids.split_first().unwrap();
    call(
        &client,
        "sandbox_files_write",
        json!({"sandbox_id": first, "path": "/root/work/only-here.txt", "content": "x"}),
    )
    .await
    .unwrap();
    call(&client, "sandbox_run_python", py(first, "x = -1")).await.unwrap();
    for id in others.iter().chain(std::iter::once(&src)) {
        let e = call(&client, "sandbox_files_read", json!({"sandbox_id": id, "path": "/root/work/only-here.txt"}))
            .await
            .unwrap_err();
        assert!(e.to_lowercase().contains("no such file") || e.contains("not found"), "{id}: {e}");
        let v = call(&client, "sandbox_run_python", py(id, "x")).await.unwrap();
        assert_eq!(v["result"], "1234", "{id}");
    }

    // Fresh randomness everywhere: os.urandom differs in all four.
    let mut seen = BTreeSet::new();
    for id in kids.iter().chain(std::iter::once(&src)) {
        let v = call(&client, "sandbox_run_python", py(id, "import os; os.urandom(16).hex()")).await.unwrap();
        let r = v["result"].as_str().unwrap().to_string();
        assert!(seen.insert(r.clone()), "{id} drew {r} again");
    }
    assert_eq!(seen.len(), 4);

    // Damaged templates: refused with a clear error, the server goes on.
    let dir = server.data_dir.join("templates");
    let copy = |name: &str| {
        let to = dir.join(name);
        std::fs::create_dir(&to).unwrap();
        for f in ["state", "memory", "template.json"] {
            std::fs::copy(dir.join("with-state").join(f), to.join(f)).unwrap();
        }
        let meta = std::fs::read_to_string(to.join("template.json"))
            .unwrap()
            .replace("\"with-state\"", &format!("\"{name}\""));
        std::fs::write(to.join("template.json"), meta).unwrap();
        to
    };
    let flipped = copy("flipped");
    let mem = std::fs::OpenOptions::new().read(true).write(true).open(flipped.join("memory")).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 1];
        mem.read_exact_at(&mut b, 1 << 20).unwrap();
        mem.write_all_at(&[b[0] ^ 1], 1 << 20).unwrap();
    }
    let e = call(&client, "sandbox_create", json!({"template": "flipped"})).await.unwrap_err();
    assert!(e.contains("corrupted") && e.contains("flipped"), "{e}");
    let short = copy("short");
    let len = std::fs::metadata(short.join("state")).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(short.join("state")).unwrap().set_len(len / 2).unwrap();
    let e = call(&client, "sandbox_create", json!({"template": "short"})).await.unwrap_err();
    assert!(e.contains("truncated"), "{e}");
    let e = call(&client, "sandbox_create", json!({"template": "no-such"})).await.unwrap_err();
    assert!(e.contains("template_list"), "{e}");
    let e = call(&client, "sandbox_create", json!({"template": "with-state", "memory_mib": 1024})).await.unwrap_err();
    assert!(e.contains("512 MiB"), "{e}");
    let list = call(&client, "sandbox_list", json!({})).await.unwrap();
    assert_eq!(list["sandboxes"].as_array().unwrap().len(), 4, "no sandbox was left from the failed creates: {list}");
    let v =
        call(&client, "sandbox_exec", json!({"sandbox_id": src, "command": "cat /root/work/state.txt"})).await.unwrap();
    assert_eq!(v["stdout"], "made before the snapshot\n");
}

/// Issue 7's scenario through MCP: Python `x = 1` and a file in a source;
/// branch into 4; each child gets its own `x` and file; the source keeps
/// its own; `sandbox_diff` of two children lists exactly the paths that
/// differ; one child merged into the source gives the source its `x` and
/// file, and the other children are untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn branch_diff_merge_end_to_end() {
    if !testkit::kvm_available("branch_diff_merge_end_to_end") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let server = TineServer::start_with_default_template(binary(), None, CONFIG);
    let client = server.client().await;
    let py = |id: &str, code: &str| json!({"sandbox_id": id, "code": code, "timeout_secs": 600});
    let write = |id: &str, path: &str, content: &str| json!({"sandbox_id": id, "path": path, "content": content});
    let exists =
        |id: &str, path: &str| json!({"sandbox_id": id, "command": format!("test -e {path} && echo yes || echo no")});

    let source = call(&client, "sandbox_create", json!({})).await.expect("create the source");
    let src = source["sandbox_id"].as_str().unwrap().to_string();
    let v = call(&client, "sandbox_run_python", py(&src, "x = 1\nx")).await.unwrap();
    assert_eq!(v["result"], "1", "{v}");
    call(&client, "sandbox_files_write", write(&src, "/root/work/source.txt", "from the source\n"))
        .await
        .expect("write");

    let t = Instant::now();
    let b = call(&client, "sandbox_branch", json!({"sandbox_id": src, "n": 4})).await.expect("branch");
    eprintln!("sandbox_branch n=4 in {:.2} s: {b}", t.elapsed().as_secs_f64());
    assert_eq!(b["mode"], "write_protect", "a sandbox restored from a template can be write-protected: {b}");
    let kids: Vec<String> =
        b["children"].as_array().unwrap().iter().map(|c| c["sandbox_id"].as_str().unwrap().to_string()).collect();
    assert_eq!(kids.len(), 4, "{b}");
    assert!(b["pause_ms"].as_f64().unwrap() < 1000.0, "{b}");

    // Each child starts with the source's state, then goes its own way.
    for (i, id) in kids.iter().enumerate() {
        let v = call(&client, "sandbox_run_python", py(id, &format!("before = x\nx = {}\n(before, x)", 100 + i)))
            .await
            .unwrap();
        assert_eq!(v["result"], format!("(1, {})", 100 + i), "{id}: {v}");
        let f = call(&client, "sandbox_files_read", json!({"sandbox_id": id, "path": "/root/work/source.txt"}))
            .await
            .unwrap();
        assert_eq!(f["content"], "from the source\n", "{id}");
        call(&client, "sandbox_files_write", write(id, &format!("/root/work/child{i}.txt"), &format!("child {i}\n")))
            .await
            .unwrap();
    }
    for (i, id) in kids.iter().enumerate() {
        let v = call(&client, "sandbox_run_python", py(id, "x")).await.unwrap();
        assert_eq!(v["result"], format!("{}", 100 + i), "{id}: {v}");
        // Every child's file, in one exec: only its own is there.
        let each = "for j in 0 1 2 3; do test -e /root/work/child$j.txt && echo yes || echo no; done";
        let v = call(&client, "sandbox_exec", json!({"sandbox_id": id, "command": each})).await.unwrap();
        let want: String = (0..kids.len()).map(|j| if i == j { "yes\n" } else { "no\n" }).collect();
        assert_eq!(v["stdout"], want, "{id}: child0..3.txt");
    }
    let v = call(&client, "sandbox_run_python", py(&src, "x")).await.unwrap();
    assert_eq!(v["result"], "1", "the source is unchanged: {v}");
    let v = call(
        &client,
        "sandbox_exec",
        json!({"sandbox_id": src, "command": "cat /root/work/source.txt; ls /root/work"}),
    )
    .await
    .unwrap();
    assert_eq!(v["stdout"], "from the source\nsource.txt\n", "{v}");

    // Lineage.
    let info = call(&client, "sandbox_info", json!({"sandbox_id": src})).await.unwrap();
    assert_eq!(info["lineage"]["children"], json!(kids), "{info}");
    let info = call(&client, "sandbox_info", json!({"sandbox_id": kids[0]})).await.unwrap();
    assert_eq!(info["lineage"]["parent"], src.as_str(), "{info}");
    assert!(info["lineage"]["branched_at_ms"].as_u64().is_some(), "{info}");

    // The diff of two children: exactly their two files.
    let d = call(&client, "sandbox_diff", json!({"a": kids[0], "b": kids[1], "unified": true})).await.expect("diff");
    eprintln!("diff: {d}");
    let paths = |k: &str| -> Vec<String> {
        d[k].as_array().unwrap().iter().map(|c| c["path"].as_str().unwrap().to_string()).collect()
    };
    assert_eq!(paths("added"), ["/root/work/child1.txt"], "{d}");
    assert_eq!(paths("removed"), ["/root/work/child0.txt"], "{d}");
    assert_eq!(paths("modified"), Vec::<String>::new(), "{d}");
    let added = &d["added"][0];
    assert_eq!(added["b"]["size"], 8, "{d}");
    assert!(added["unified_diff"].as_str().is_some_and(|u| u.contains("+child 1")), "{d}");
    // A file changed in one child shows as modified.
    call(&client, "sandbox_files_write", write(&kids[1], "/root/work/source.txt", "changed in child 1\n"))
        .await
        .unwrap();
    let d = call(&client, "sandbox_diff", json!({"a": kids[0], "b": kids[1]})).await.expect("diff");
    let modified: Vec<&str> = d["modified"].as_array().unwrap().iter().map(|c| c["path"].as_str().unwrap()).collect();
    assert_eq!(modified, ["/root/work/source.txt"], "{d}");

    // Bad requests get clear errors and change nothing.
    let e = call(&client, "sandbox_branch", json!({"sandbox_id": src, "n": 0})).await.unwrap_err();
    assert!(e.contains("n (0) is less than the minimum of 1"), "{e}");
    let e = call(&client, "sandbox_branch", json!({"sandbox_id": src, "n": 100})).await.unwrap_err();
    assert!(e.contains("n (100) is greater than the maximum of 12"), "{e}");
    // Within the schema's bound but past the room left: the manager refuses.
    let e = call(&client, "sandbox_branch", json!({"sandbox_id": src, "n": 12})).await.unwrap_err();
    assert!(e.contains("n must be"), "{e}");
    let e = call(&client, "sandbox_merge_into", json!({"winner": kids[0], "parent": kids[1]})).await.unwrap_err();
    assert!(e.contains("was not branched from"), "{e}");
    let e = call(&client, "sandbox_diff", json!({"a": kids[0], "b": "sb-999"})).await.unwrap_err();
    assert!(e.contains("no sandbox sb-999"), "{e}");

    // A paused sandbox is copied as it stands (no write protection
    // needed), and says so; it stays paused.
    call(&client, "sandbox_pause", json!({"sandbox_id": kids[3]})).await.expect("pause");
    let b =
        call(&client, "sandbox_branch", json!({"sandbox_id": kids[3], "n": 1})).await.expect("branch a paused sandbox");
    assert_eq!(b["mode"], "copy_while_paused", "{b}");
    assert!(b["fallback_reason"].as_str().is_some_and(|r| r.contains("paused")), "{b}");
    let info = call(&client, "sandbox_info", json!({"sandbox_id": kids[3]})).await.unwrap();
    assert_eq!(info["state"], "paused", "{info}");
    let grandchild = b["children"][0]["sandbox_id"].as_str().unwrap().to_string();
    let v = call(&client, "sandbox_run_python", py(&grandchild, "x")).await.unwrap();
    assert_eq!(v["result"], "103", "{v}");
    call(&client, "sandbox_kill", json!({"sandbox_id": grandchild})).await.expect("kill the grandchild");
    let info = call(&client, "sandbox_info", json!({"sandbox_id": kids[3]})).await.unwrap();
    assert!(info["lineage"].get("children").is_none(), "a killed child leaves its parent's list: {info}");

    // Merge child 2 into the source.
    let m = call(&client, "sandbox_merge_into", json!({"winner": kids[2], "parent": src})).await.expect("merge");
    assert_eq!(m["sandbox_id"], src.as_str(), "{m}");
    assert_eq!(m["lineage"]["merged_from"], kids[2].as_str(), "{m}");
    let v = call(&client, "sandbox_run_python", py(&src, "x")).await.unwrap();
    assert_eq!(v["result"], "102", "the source now has child 2's state: {v}");
    let v = call(&client, "sandbox_exec", exists(&src, "/root/work/child2.txt")).await.unwrap();
    assert_eq!(v["stdout"], "yes\n");
    let e = call(&client, "sandbox_info", json!({"sandbox_id": kids[2]})).await.unwrap_err();
    assert!(e.contains("no sandbox"), "the winner's id is gone: {e}");
    let info = call(&client, "sandbox_info", json!({"sandbox_id": src})).await.unwrap();
    assert_eq!(info["lineage"]["children"], json!([kids[0], kids[1], kids[3]]), "{info}");
    for (i, id) in kids.iter().enumerate().filter(|(i, _)| *i != 2) {
        let v = call(&client, "sandbox_run_python", py(id, "x")).await.unwrap();
        assert_eq!(v["result"], format!("{}", 100 + i), "sibling {id} is untouched: {v}");
    }
    let list = call(&client, "sandbox_list", json!({})).await.unwrap();
    assert_eq!(list["sandboxes"].as_array().unwrap().len(), 4, "{list}");
    // The merged sandbox can be branched again.
    let b = call(&client, "sandbox_branch", json!({"sandbox_id": src, "n": 1})).await.expect("branch after merge");
    let kid = b["children"][0]["sandbox_id"].as_str().unwrap().to_string();
    let v = call(&client, "sandbox_run_python", py(&kid, "x")).await.unwrap();
    assert_eq!(v["result"], "102", "{v}");
}
