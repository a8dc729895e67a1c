//! Tenants end to end: `tine tenant add` makes two tenants' keys, one
//! server serves both over real MCP sessions with real guests, and
//! neither sees, uses or changes what is the other's; the operator's
//! token sees both. Every tool that names a sandbox or process is called
//! by tenant B with tenant A's ids and must answer exactly as it answers
//! for ids that do not exist.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use testkit::mcp::{call, connect, TineServer};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

const TOKEN: &str = "tenants-test-operator-token-0123456789abcdef";

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tine"))
}

/// `tine tenant ARGS --tenants-file FILE`; its stdout (a key for `add`
/// and `rotate-key`).
fn tenant_cli(file: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new(binary())
        .arg("tenant")
        .args(args)
        .arg("--tenants-file")
        .arg(file)
        .output()
        .expect("run tine tenant");
    assert!(out.status.success(), "tine tenant {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The arguments of a required parameter the walk fills that are not ids.
fn filler(tool: &str, name: &str) -> Value {
    match name {
        "path" => json!("/tmp/walk.txt"),
        "content" | "data" | "code" => json!("1"),
        "data_base64" => json!("MQ=="),
        "name" => json!("walk"),
        "n" => json!(1),
        "language" => json!("python"),
        "method" => json!("GET"),
        "stream" => json!("stdout"),
        "port" => json!(8000),
        _ => panic!("{tool}: the tenant walk has no value for its required argument {name}; add one"),
    }
}

/// A guest listener on port 7000 (a thread of the sandbox's warm
/// interpreter) that holds each forwarded connection open until its
/// client's end closes, then closes it.
const HOLDER: &str = "import socket, threading
forward_holder = socket.socket()
forward_holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
forward_holder.bind(('0.0.0.0', 7000))
forward_holder.listen(16)
def forward_hold(c):
    while c.recv(4096):
        pass
    c.close()
def forward_accept(s):
    while True:
        c, _ = s.accept()
        threading.Thread(target=forward_hold, args=(c,), daemon=True).start()
threading.Thread(target=forward_accept, args=(forward_holder,), daemon=True).start()
";

/// A port forward to `port` of `sandbox` with `key` over a raw connection:
/// the answer's status, its head and body as text, and the connection
/// (the forward's, after a 101).
async fn raw_forward(server: &TineServer, sandbox: &str, port: u16, key: &str) -> (u16, String, TcpStream) {
    let addr = server.base.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let request = format!(
        "GET /ports/{sandbox}/{port} HTTP/1.1\r\nHost: {addr}\r\nConnection: upgrade\r\nUpgrade: \
         tine-port-forward\r\nAuthorization: Bearer {key}\r\n\r\n"
    );
    s.write_all(request.as_bytes()).await.expect("send");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let text = String::from_utf8_lossy(&got).to_string();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("a status line");
            let length = head
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string()))
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(0);
            if status == 101 || body.len() >= length {
                return (status, text, s);
            }
        }
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => panic!("the port forward's connection closed: {text}"),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => panic!("no answer to a port forward within 60 s: {text}"),
        }
    }
}

/// `text` with every id of `from` replaced by the one at the same place
/// of `to`.
fn replaced(text: &str, from: &[String], to: &[String]) -> String {
    from.iter().zip(to).fold(text.to_string(), |t, (a, b)| t.replace(a.as_str(), b))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tenants_see_and_touch_only_their_own() {
    if !testkit::kvm_available("tenants_see_and_touch_only_their_own") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let tenants: PathBuf = dir.path().join("tenants.toml");
    let key_a = tenant_cli(&tenants, &["add", "acme"]);
    // Eight requests open at once: its session's calls and stream fit,
    // and port forwards count against it too (checked last).
    let key_b = tenant_cli(&tenants, &["add", "beta", "--max-running", "1", "--max-streams", "8"]);
    assert!(key_a.starts_with("tine_") && key_a != key_b);
    // Beta's ceiling: nothing but pypi.org.
    let mut text = std::fs::read_to_string(&tenants).unwrap();
    text.push_str("\n[tenant.beta.network]\negress = \"deny\"\nallow = [\"pypi.org\"]\n");
    std::fs::write(&tenants, text).unwrap();
    let config = format!("[limits]\nboot_timeout_secs = 1200\n[auth]\ntenants_file = \"{}\"\n", tenants.display());
    let server = TineServer::start_with_default_template(binary(), Some(TOKEN), &config);
    let a = connect(&server.url, Some(&key_a)).await;
    let b = connect(&server.url, Some(&key_b)).await;
    let admin = connect(&server.url, Some(TOKEN)).await;

    // A's objects: a sandbox, a file, a background process, a template,
    // a file URL.
    // Host ports are the operator's to give: a tenant's create with ports
    // is refused before any VM starts ([ports] tenants is off by default).
    let e = call(&a, "sandbox_create", json!({"ports": ["18080:80"]})).await.unwrap_err();
    assert!(e.contains("publishing host ports is not allowed for this tenant"), "{e}");
    let sa = call(&a, "sandbox_create", json!({})).await.unwrap();
    assert_eq!(sa["tenant"], "acme", "{sa}");
    let id_a = sa["sandbox_id"].as_str().unwrap().to_string();
    call(&a, "sandbox_files_write", json!({"sandbox_id": id_a, "path": "/tmp/a.txt", "content": "acme's"}))
        .await
        .unwrap();
    let proc_a = call(&a, "sandbox_exec", json!({"sandbox_id": id_a, "command": "sleep 600", "background": true}))
        .await
        .unwrap()["process_id"]
        .as_str()
        .unwrap()
        .to_string();
    let snap = call(&a, "sandbox_snapshot", json!({"sandbox_id": id_a, "name": "data"})).await.unwrap();
    assert_eq!(snap["name"], "data", "a tenant sees its template under its own name: {snap}");
    let url = call(&a, "sandbox_files_url", json!({"sandbox_id": id_a, "path": "/tmp/a.txt", "method": "GET"}))
        .await
        .unwrap()["url"]
        .as_str()
        .unwrap()
        .to_string();
    let http = reqwest::Client::new();
    assert_eq!(http.get(&url).send().await.unwrap().text().await.unwrap(), "acme's");
    // A port forward into A's sandbox: A may, B gets what a missing
    // sandbox gets.
    let (host_part, _) = id_a.rsplit_once('-').unwrap();
    let ghost = format!("{host_part}-999999");
    let forward = |sandbox: &str, key: &str| {
        http.get(format!("{}/ports/{sandbox}/80", server.base))
            .header("connection", "upgrade")
            .header("upgrade", "tine-port-forward")
            .bearer_auth(key)
            .send()
    };
    assert_eq!(forward(&id_a, &key_a).await.unwrap().status(), 101);
    let theirs = forward(&id_a, &key_b).await.unwrap();
    let missing = forward(&ghost, &key_b).await.unwrap();
    assert_eq!((theirs.status().as_u16(), missing.status().as_u16()), (404, 404));
    assert_eq!(
        theirs.text().await.unwrap().replace(&id_a, "ID"),
        missing.text().await.unwrap().replace(&ghost, "ID"),
        "B learns nothing of A's sandbox from a port forward"
    );

    // B walks every tool that names a sandbox or process with A's ids, then
    // with ids that do not exist: the answers are the same.
    let a_ids = vec![proc_a.clone(), id_a.clone()];
    let ghost_ids = vec![format!("{ghost}:p1"), ghost.clone()];
    let tools = b.list_all_tools().await.unwrap();
    let mut walked = Vec::new();
    for t in &tools {
        let props = t.input_schema.get("properties").and_then(Value::as_object).cloned().unwrap_or_default();
        let ids: Vec<&str> = ["sandbox_id", "process_id", "a", "b", "winner", "parent"]
            .into_iter()
            .filter(|k| props.contains_key(*k))
            .collect();
        if ids.is_empty() {
            continue;
        }
        let required: Vec<String> = t
            .input_schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
            .unwrap_or_default();
        let mut args = Map::new();
        for r in required.iter().filter(|r| !ids.contains(&r.as_str())) {
            args.insert(r.clone(), filler(&t.name, r));
        }
        for k in &ids {
            let v = if *k == "process_id" { proc_a.clone() } else { id_a.clone() };
            args.insert(k.to_string(), json!(v));
        }
        let theirs = call(&b, &t.name, Value::Object(args.clone())).await;
        let e = theirs.expect_err(&format!("{}: B used A's sandbox", t.name));
        let ghost_args: Map<String, Value> = args
            .into_iter()
            .map(|(k, v)| match v.as_str() {
                Some(s) if a_ids.iter().any(|i| i == s) => (k, json!(replaced(s, &a_ids, &ghost_ids))),
                _ => (k, v),
            })
            .collect();
        let unknown = call(&b, &t.name, Value::Object(ghost_args)).await.expect_err("an unknown id fails");
        assert_eq!(replaced(&e, &a_ids, &ghost_ids), unknown, "{}: A's id must look like an unknown one", t.name);
        walked.push(t.name.to_string());
    }
    assert!(walked.len() >= 20, "the walk covered {walked:?}");
    eprintln!("tenants: B was refused A's ids by {} tools: {}", walked.len(), walked.join(" "));
    // A's sandbox, process and file are as they were.
    let r = call(&a, "sandbox_exec", json!({"sandbox_id": id_a, "command": "cat /tmp/a.txt"})).await.unwrap();
    assert_eq!(r["stdout"], "acme's");
    let p = call(&a, "sandbox_process_list", json!({"sandbox_id": id_a})).await.unwrap();
    assert!(p.to_string().contains(&proc_a), "{p}");

    // Lists: each tenant sees its own, the operator both.
    let sb = call(&b, "sandbox_create", json!({})).await.unwrap();
    let id_b = sb["sandbox_id"].as_str().unwrap().to_string();
    let listed = |v: &Value| -> Vec<String> {
        v["sandboxes"].as_array().unwrap().iter().map(|s| s["sandbox_id"].as_str().unwrap().to_string()).collect()
    };
    assert_eq!(listed(&call(&b, "sandbox_list", json!({})).await.unwrap()), [id_b.as_str()]);
    assert_eq!(listed(&call(&a, "sandbox_list", json!({})).await.unwrap()), [id_a.as_str()]);
    let all = listed(&call(&admin, "sandbox_list", json!({})).await.unwrap());
    assert!(all.contains(&id_a) && all.contains(&id_b), "{all:?}");

    // Templates: A's "data" is A's; B has none of that name, cannot delete
    // A's, and makes a "data" of its own beside it.
    let names = |v: &Value| -> Vec<String> {
        v["templates"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap().to_string()).collect()
    };
    assert!(names(&call(&a, "template_list", json!({})).await.unwrap()).contains(&"data".to_string()));
    let b_templates = names(&call(&b, "template_list", json!({})).await.unwrap());
    assert!(!b_templates.contains(&"data".to_string()) && b_templates.contains(&"default".to_string()));
    let e = call(&b, "template_delete", json!({"name": "data"})).await.unwrap_err();
    assert!(e.starts_with("no template \"data\""), "{e}");
    let e = call(&b, "template_delete", json!({"name": "default"})).await.unwrap_err();
    assert!(e.starts_with("no template \"default\""), "the server's templates are not a tenant's to delete: {e}");
    call(&b, "sandbox_snapshot", json!({"sandbox_id": id_b, "name": "data"})).await.unwrap();
    let all_templates = names(&call(&admin, "template_list", json!({})).await.unwrap());
    assert!(
        all_templates.contains(&"acme~data".to_string()) && all_templates.contains(&"beta~data".to_string()),
        "{all_templates:?}"
    );

    // Quota: beta may run one sandbox.
    let e = call(&b, "sandbox_create", json!({})).await.unwrap_err();
    assert!(e.contains("tenant beta is at its quota of live sandboxes: 1 in use"), "{e}");

    // Ceiling: beta's sandbox may not widen past it; inside it works, and
    // the ceiling is enforced beside the sandbox's own policy.
    let e = call(&b, "sandbox_update", json!({"sandbox_id": id_b, "network": {"egress": "allow"}})).await.unwrap_err();
    assert!(e.contains("allows more than the operator's ceiling"), "{e}");
    let e = call(
        &b,
        "sandbox_update",
        json!({"sandbox_id": id_b, "network": {"egress": "deny", "allow": ["example.com"]}}),
    )
    .await
    .unwrap_err();
    assert!(e.contains("example.com"), "{e}");
    let info = call(&b, "sandbox_info", json!({"sandbox_id": id_b})).await.unwrap();
    assert_eq!(info["network_ceiling"]["egress"], "deny", "{info}");
    // Its own policy allows everything (the server's default), the ceiling
    // does not: a DNS query for another name is refused by the ceiling.
    call(&b, "sandbox_exec", json!({"sandbox_id": id_b, "command": "getent hosts example.org || true"})).await.unwrap();
    let log = call(&b, "sandbox_network_log", json!({"sandbox_id": id_b})).await.unwrap();
    assert!(log.to_string().contains("ceiling:egress:deny"), "{log}");
    let ok =
        call(&b, "sandbox_update", json!({"sandbox_id": id_b, "network": {"egress": "deny", "allow": ["pypi.org"]}}))
            .await
            .unwrap();
    assert_eq!(ok["network"]["allow"], json!(["pypi.org"]), "{ok}");

    // A session is its opener's: B's key on A's session is an unknown session.
    let session = raw_session(&http, &server.url, &key_a).await;
    let hijack = raw_list(&http, &server.url, &key_b, &session).await;
    assert_eq!(hijack.status(), 404, "another tenant's session");
    assert_eq!(raw_list(&http, &server.url, &key_a, &session).await.status(), 200);

    // A's key rotated: its old key and the URL signed for its sandbox stop
    // working once the server has read the file again.
    let new_key = tenant_cli(&tenants, &["rotate-key", "acme"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = raw_initialize(&http, &server.url, &key_a).await.status();
        if status == 401 {
            break;
        }
        assert!(Instant::now() < deadline, "the old key still works ({status})");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(http.get(&url).send().await.unwrap().status(), 403, "a URL of the old key");
    let a2 = connect(&server.url, Some(&new_key)).await;
    assert_eq!(listed(&call(&a2, "sandbox_list", json!({})).await.unwrap()), [id_a.as_str()]);

    // A's data that outlives its sandboxes: a volume and a secret.
    call(&a2, "volume_create", json!({"name": "keep", "size_gib": 1})).await.unwrap();
    let data_dir = server.data_dir.to_str().unwrap();
    let volume = server.data_dir.join("kept/volumes/acme~keep");
    assert!(volume.is_dir(), "{} is where acme's volume is", volume.display());
    let secret = std::process::Command::new(binary())
        .args(["secret", "set", "acme-token", "--tenant", "acme", "--hosts", "api.example.com", "--data-dir", data_dir])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write as _;
            c.stdin.take().unwrap().write_all(b"sk-acme")?;
            c.wait()
        })
        .unwrap();
    assert!(secret.success());
    let acme_secrets = || {
        let out = std::process::Command::new(binary()).args(["secret", "ls", "--data-dir", data_dir]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let all: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
        all.iter().filter(|s| s["owner"] == "tenant:acme").count()
    };
    assert_eq!(acme_secrets(), 1);

    // Removed keeping its data: its sandboxes and templates go, its
    // volume and secret stay for the operator, and the name is reserved.
    tenant_cli(&tenants, &["remove", "acme", "--yes", "--keep-data", "--data-dir", data_dir]);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let all = listed(&call(&admin, "sandbox_list", json!({})).await.unwrap());
        let templates = names(&call(&admin, "template_list", json!({})).await.unwrap());
        if !all.contains(&id_a) && !templates.contains(&"acme~data".to_string()) {
            assert!(all.contains(&id_b), "beta's sandbox stays");
            break;
        }
        assert!(Instant::now() < deadline, "acme's objects are still there: {all:?} {templates:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(volume.is_dir(), "--keep-data keeps the volume");
    assert_eq!(acme_secrets(), 1, "--keep-data keeps the secret");
    let refused = std::process::Command::new(binary())
        .args(["tenant", "add", "acme", "--data-dir", data_dir, "--tenants-file"])
        .arg(&tenants)
        .output()
        .unwrap();
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && why.contains("tine tenant purge acme --yes"), "{why}");
    // Purged: the secret goes at once, the volume when the server reads
    // the file; then the name can be added again, and the new acme
    // inherits nothing.
    tenant_cli(&tenants, &["purge", "acme", "--yes", "--data-dir", data_dir]);
    assert_eq!(acme_secrets(), 0, "purge deletes the tenant's secrets");
    let deadline = Instant::now() + Duration::from_secs(60);
    while volume.exists() {
        assert!(Instant::now() < deadline, "the server did not delete acme's volume");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let key_a3 = tenant_cli(&tenants, &["add", "acme", "--data-dir", data_dir]);
    // The server knows the new key once it has read the file again.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = raw_initialize(&http, &server.url, &key_a3).await.status();
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "the new acme's key does not work ({status})");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let a3 = connect(&server.url, Some(&key_a3)).await;
    let vols = call(&a3, "volume_list", json!({})).await.unwrap();
    assert!(!vols.to_string().contains("keep"), "a new tenant of the name inherits a volume: {vols}");
    let _ = a3.cancel().await;
    // Open port forwards count against B's quota of requests open at once
    // (8): held open to a guest port that holds them, they fill it beside
    // B's session, and the next is refused with 429 until one closes.
    let r = call(&b, "sandbox_run_python", json!({"sandbox_id": id_b, "code": HOLDER})).await.unwrap();
    assert!(r.get("exception").is_none_or(Value::is_null), "{r}");
    let mut held = Vec::new();
    let refusal = loop {
        let (status, text, stream) = raw_forward(&server, &id_b, 7000, &key_b).await;
        match status {
            101 => held.push(stream),
            429 => break text,
            s => panic!("a port forward answered {s}: {text}"),
        }
        assert!(held.len() <= 8, "{} port forwards open past beta's --max-streams 8", held.len());
    };
    assert!(!held.is_empty(), "not one port forward opened: {refusal}");
    assert!(
        refusal.contains("tenant beta is at its quota of requests open at once") && refusal.contains("port forwards"),
        "{refusal}"
    );
    held.pop();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, text, stream) = raw_forward(&server, &id_b, 7000, &key_b).await;
        if status == 101 {
            held.push(stream);
            break;
        }
        assert!(Instant::now() < deadline, "no place freed by a closed port forward: {status} {text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(held);
    for c in [a, b, admin, a2] {
        let _ = c.cancel().await;
    }
}

/// `POST /mcp` `initialize` with bearer `key`.
async fn raw_initialize(http: &reqwest::Client, url: &str, key: &str) -> reqwest::Response {
    http.post(url)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .bearer_auth(key)
        .body(
            json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "raw", "version": "0"}}})
            .to_string(),
        )
        .send()
        .await
        .expect("POST /mcp")
}

/// A new session of `key`'s (initialized); its id.
async fn raw_session(http: &reqwest::Client, url: &str, key: &str) -> String {
    let r = raw_initialize(http, url, key).await;
    assert_eq!(r.status(), 200);
    let id = r.headers()["mcp-session-id"].to_str().unwrap().to_string();
    let done = http
        .post(url)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-session-id", &id)
        .header("mcp-protocol-version", "2025-06-18")
        .bearer_auth(key)
        .body(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}).to_string())
        .send()
        .await
        .unwrap();
    assert!(done.status().is_success(), "{}", done.status());
    id
}

/// `tools/list` on session `session` with bearer `key`.
async fn raw_list(http: &reqwest::Client, url: &str, key: &str, session: &str) -> reqwest::Response {
    http.post(url)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-session-id", session)
        .header("mcp-protocol-version", "2025-06-18")
        .bearer_auth(key)
        .body(json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}).to_string())
        .send()
        .await
        .unwrap()
}

/// A tenant's template build is the tenant's like its other sandboxes
/// (issue 58, item 5): its builder runs under the tenant's network ceiling
/// (a setup step reaches no host outside it) and counts in its quota of
/// live sandboxes. `outside.test` is the host's loopback, allowed by the
/// server's default policy and not by the tenant's ceiling; a listener the
/// test runs there counts the connections that reach it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenants_template_build_keeps_its_ceiling_and_quota() {
    if !testkit::kvm_available("a_tenants_template_build_keeps_its_ceiling_and_quota") {
        return;
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let reached = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    {
        let reached = reached.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if conn.is_ok() {
                    reached.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            }
        });
    }
    let dir = tempfile::tempdir().unwrap();
    let tenants: PathBuf = dir.path().join("tenants.toml");
    let key = tenant_cli(&tenants, &["add", "builder", "--max-running", "1"]);
    let mut text = std::fs::read_to_string(&tenants).unwrap();
    text.push_str("\n[tenant.builder.network]\negress = \"deny\"\nallow = [\"pypi.org\"]\n");
    std::fs::write(&tenants, text).unwrap();
    let config = format!(
        "[limits]\nboot_timeout_secs = 1200\n[auth]\ntenants_file = \"{}\"\n\
         [network]\npermit_ranges = [\"127.0.0.1/32\"]\n[network.hosts]\n\"outside.test\" = \"10.0.2.2\"\n",
        tenants.display()
    );
    let server = TineServer::start_with_default_template(binary(), Some(TOKEN), &config);
    let admin = connect(&server.url, Some(TOKEN)).await;
    let b = connect(&server.url, Some(&key)).await;

    // The operator's sandbox is under the server's default policy: the
    // same command reaches the listener (what shows the test's network
    // reaches it at all).
    let dial = format!(": 3<>/dev/tcp/outside.test/{port}");
    let own = call(&admin, "sandbox_create", json!({})).await.unwrap();
    let x = call(&admin, "sandbox_exec", json!({"sandbox_id": own["sandbox_id"], "command": dial})).await.unwrap();
    assert_eq!(x["exit_code"], 0, "{x}");
    call(&admin, "sandbox_kill", json!({"sandbox_id": own["sandbox_id"]})).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while reached.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the operator's connection did not reach the listener");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The tenant's own sandbox: the same dial is refused by its ceiling.
    let sb = call(&b, "sandbox_create", json!({})).await.unwrap();
    let x = call(&b, "sandbox_exec", json!({"sandbox_id": sb["sandbox_id"], "command": dial})).await.unwrap();
    assert_ne!(x["exit_code"], 0, "the tenant's sandbox dialled outside its ceiling: {x}");
    assert_eq!(reached.load(std::sync::atomic::Ordering::SeqCst), 1, "{x}");

    // Quota: with its one live sandbox running, its build's builder is one
    // too many.
    let r = call(&b, "template_create", json!({"name": "over", "setup": ["true"], "wait_secs": 600})).await;
    let over = match r {
        Ok(v) => v["error"].as_str().map(str::to_string).unwrap_or_else(|| panic!("the build ran past the quota: {v}")),
        Err(e) => e,
    };
    assert!(over.contains("tenant builder is at its quota of live sandboxes"), "{over}");
    call(&b, "sandbox_kill", json!({"sandbox_id": sb["sandbox_id"]})).await.unwrap();

    // Its build: the step runs under the tenant's ceiling and fails.
    let r = call(&b, "template_create", json!({"name": "escape", "setup": [dial], "wait_secs": 600})).await;
    let failed = r.unwrap_or_else(|e| panic!("template_create: {e}"));
    assert_eq!(
        reached.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the tenant's setup step reached a host outside its ceiling: {failed}"
    );
    assert_eq!(failed["state"], "failed", "a step outside the ceiling fails the build: {failed}");
    for c in [admin, b] {
        let _ = c.cancel().await;
    }
}
