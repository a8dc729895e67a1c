//! The command line against a running server: `tine sandbox ...` and
//! `tine template ls` as people and scripts run them (the real binary, its
//! exit codes, tables and `--json`), Ctrl-C during `tine sandbox exec`
//! killing the command in the guest, and `tine mcp stdio --url` driven by
//! the official MCP Python SDK's stdio transport. One `--dev` server serves
//! every test here (started by the first, stopped at the binary's exit);
//! each test makes its own sandboxes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use testkit::mcp::{call, connect, python_sdk, typescript_sdk, TineServer};

const CONFIG: &str = "[limits]\nboot_timeout_secs = 1200\n";

/// The server the tests share ([`TineServer::shared`]).
fn server() -> Arc<TineServer> {
    TineServer::shared(binary(), CONFIG)
}

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tine"))
}

/// `tine ARGS` against `server` (through $TINE_URL, as people set it),
/// with no token in the environment.
fn tine_command(server: &TineServer, args: &[&str]) -> Command {
    let mut c = Command::new(binary());
    c.args(args)
        .env("TINE_URL", &server.base)
        .env_remove("TINE_TOKEN")
        .env_remove("TINE_TOKEN_FILE")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null());
    c
}

/// Runs `tine ARGS` to its end and logs what it did.
fn tine(server: &TineServer, args: &[&str]) -> Output {
    let t = Instant::now();
    let out = tine_command(server, args).output().expect("run tine");
    eprintln!(
        "$ tine {} -> {} in {:.1} s\n{}{}",
        args.join(" "),
        out.status,
        t.elapsed().as_secs_f64(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `tine ARGS`'s stdout, which must have succeeded.
fn tine_ok(server: &TineServer, args: &[&str]) -> String {
    let out = tine(server, args);
    assert!(out.status.success(), "tine {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// `tine ARGS --json`'s output, parsed.
fn tine_json(server: &TineServer, args: &[&str]) -> Value {
    let mut args = args.to_vec();
    args.push("--json");
    let out = tine_ok(server, &args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("tine {args:?}: not JSON ({e}): {out}"))
}

/// The ids in `sandbox_list`'s JSON.
fn listed(list: &Value) -> Vec<String> {
    list["sandboxes"].as_array().expect("sandboxes").iter().map(|s| s["sandbox_id"].as_str().unwrap().into()).collect()
}

/// Create, exec with the remote exit code, Python, ls as JSON and as a
/// table, branch, kill; `tine template ls`; a tool error exits 2.
#[test]
fn sandboxes_from_the_command_line() {
    if !testkit::kvm_available("sandboxes_from_the_command_line") {
        return;
    }
    let server = server();
    let t = Instant::now();
    let id = tine_ok(&server, &["sandbox", "create", "--label", "tine-test=cli"]).trim().to_string();
    assert!(id.starts_with("sb-"), "{id}");

    let out = tine(&server, &["sandbox", "exec", &id, "--", "echo", "hello;", "exit", "3"]);
    assert_eq!(out.status.code(), Some(3), "the remote exit code");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n");
    // A program without a shell, fed this command's stdin.
    let mut cat = tine_command(&server, &["sandbox", "exec", &id, "--no-shell", "--stdin", "--", "/bin/cat"]);
    let mut cat = cat.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("spawn tine");
    std::io::Write::write_all(cat.stdin.as_mut().unwrap(), b"fed through stdin\n").unwrap();
    drop(cat.stdin.take());
    let out = cat.wait_with_output().unwrap();
    assert_eq!((out.status.code(), String::from_utf8_lossy(&out.stdout).as_ref()), (Some(0), "fed through stdin\n"));

    assert_eq!(tine_ok(&server, &["sandbox", "python", &id, "x = 6 * 7\nx"]), "42\n");

    let list = tine_json(&server, &["sandbox", "ls", "--label", "tine-test=cli"]);
    assert_eq!(listed(&list), std::slice::from_ref(&id));
    let table = tine_ok(&server, &["sandbox", "ls"]);
    let header = table.lines().next().unwrap_or_default();
    assert!(header.starts_with("ID") && header.contains("STATE") && header.ends_with("LABELS"), "{table}");
    assert!(table.lines().any(|l| l.starts_with(&id) && l.contains("running") && l.contains("tine-test=cli")));

    let branch = tine_json(&server, &["sandbox", "branch", &id, "1"]);
    let children = branch["children"].as_array().expect("children");
    assert_eq!(children.len(), 1, "{branch}");
    let child = children[0]["sandbox_id"].as_str().unwrap().to_string();
    // The child has the parent's Python state.
    assert_eq!(tine_ok(&server, &["sandbox", "python", &child, "x + 1"]), "43\n");

    // The network log: no traffic yet, the table's header alone.
    let log = tine_json(&server, &["sandbox", "logs", &id]);
    assert_eq!((log["sandbox_id"].as_str(), log["records"].as_array().map(Vec::len)), (Some(id.as_str()), Some(0)));
    assert!(tine_ok(&server, &["sandbox", "logs", &id]).starts_with("TIME (UTC)  PROTO"));

    let templates = tine_json(&server, &["template", "ls"]);
    let names: Vec<&str> =
        templates["templates"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"default"), "{templates}");
    assert!(tine_ok(&server, &["template", "ls"]).lines().any(|l| l.starts_with("default ") && l.contains("ready")));

    let out = tine(&server, &["template", "rm", "no-such-template"]);
    assert_eq!(out.status.code(), Some(2), "a tool error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("template_delete: "), "{out:?}");

    let killed = tine_ok(&server, &["sandbox", "kill", &child, &id]);
    assert_eq!(killed, format!("killed {child}\nkilled {id}\n"));
    assert!(listed(&tine_json(&server, &["sandbox", "ls"])).iter().all(|s| *s != id && *s != child));

    // A tool error: the server's message, exit 2.
    let out = tine(&server, &["sandbox", "exec", &id, "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tine: error: sandbox_exec:") && err.contains(&id), "{err}");
    // No server: says where it looked and what to try, exit 1.
    let out = Command::new(binary())
        .args(["sandbox", "ls", "--url", &format!("http://127.0.0.1:{}", testkit::mcp::free_port())])
        .env_remove("TINE_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is a server running there?"), "{out:?}");
    eprintln!("sandboxes_from_the_command_line: {:.1} s", t.elapsed().as_secs_f64());
}

/// The SHA-256 of a file, hex.
fn sha256_file(path: &Path) -> String {
    let mut h = Sha256::new();
    let mut f = std::fs::File::open(path).expect("open");
    std::io::copy(&mut f, &mut h).expect("read");
    format!("{:x}", h.finalize())
}

/// A file of 2 MiB (twice what one tool result may carry; 64 MiB with
/// TINE_TEST_FULL) goes up and comes back through `tine sandbox cp`, whole;
/// into a directory it keeps its name.
#[test]
fn cp_moves_files_both_ways() {
    if !testkit::kvm_available("cp_moves_files_both_ways") {
        return;
    }
    let server = server();
    let t = Instant::now();
    let mib: usize = if testkit::full_size() { 64 } else { 2 };
    let dir = tempfile::tempdir().unwrap();
    let up = dir.path().join("up.bin");
    // Incompressible, from a seeded generator (xorshift).
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..mib << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(&up, &data).unwrap();
    let id = tine_ok(&server, &["sandbox", "create"]).trim().to_string();

    let copied = tine_json(&server, &["sandbox", "cp", up.to_str().unwrap(), &format!("{id}:/root/")]);
    assert_eq!(copied["bytes"], json!(data.len()), "{copied}");
    assert_eq!(copied["destination"], json!(format!("{id}:/root/up.bin")));
    let down = dir.path().join("down.bin");
    tine_ok(&server, &["sandbox", "cp", &format!("{id}:/root/up.bin"), down.to_str().unwrap()]);
    assert_eq!(sha256_file(&down), sha256_file(&up), "the file came back changed");
    // Into a directory, under its own name; no part file is left.
    let into = dir.path().join("into");
    std::fs::create_dir(&into).unwrap();
    tine_ok(&server, &["sandbox", "cp", &format!("{id}:/root/up.bin"), into.to_str().unwrap()]);
    assert_eq!(std::fs::metadata(into.join("up.bin")).unwrap().len(), data.len() as u64);
    assert_eq!(std::fs::read_dir(&into).unwrap().count(), 1);

    // A missing file: the server's refusal, and nothing left here.
    let out = tine(&server, &["sandbox", "cp", &format!("{id}:/root/missing"), dir.path().join("m").to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/root/missing"), "{out:?}");
    assert!(!dir.path().join("m").exists());
    assert!(std::fs::read_dir(dir.path()).unwrap().all(|e| !e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .contains("tine-part")));
    tine_ok(&server, &["sandbox", "kill", &id]);
    eprintln!("cp_moves_files_both_ways: {mib} MiB each way in {:.1} s", t.elapsed().as_secs_f64());
}

/// Polls `f` every 250 ms until it gives `Some`, at most `limit`.
async fn eventually<T>(limit: Duration, what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Ctrl-C (SIGINT) to `tine sandbox exec` during a long command: the CLI
/// exits 130 and the command's process group is killed in the guest (its
/// shell and the shell's `sleep` leave the guest's /proc; the marker the
/// shell would write after the sleep never appears).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_stops_the_command_in_the_sandbox() {
    if !testkit::kvm_available("ctrl_c_stops_the_command_in_the_sandbox") {
        return;
    }
    let server = tokio::task::spawn_blocking(server).await.unwrap();
    let t = Instant::now();
    let client = connect(&server.url, None).await;
    let created = call(&client, "sandbox_create", json!({})).await.expect("create");
    let id = created["sandbox_id"].as_str().unwrap().to_string();

    let script = "sleep 600 & echo $$ $! > /tmp/pids; wait; echo survived > /tmp/survived";
    let mut child = tine_command(&server, &["sandbox", "exec", &id, "--timeout", "600", "--", script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tine sandbox exec");
    // The command runs once its shell wrote its pid and its sleep's (read
    // by the agent: no process starts for it).
    let pids = eventually(Duration::from_secs(120), "the command's pid file", async || {
        let r = call(&client, "sandbox_files_read", json!({"sandbox_id": id, "path": "/tmp/pids"})).await.ok()?;
        let pids: Vec<u32> = r["content"].as_str()?.split_whitespace().filter_map(|p| p.parse().ok()).collect();
        (pids.len() == 2).then_some(pids)
    })
    .await;
    // SAFETY: kill(2) of the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let interrupted = Instant::now();
    let status =
        eventually(Duration::from_secs(60), "the CLI's exit after SIGINT", async || child.try_wait().unwrap()).await;
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    eprintln!("tine sandbox exec exited {status} {:.1} s after SIGINT: {stderr}", interrupted.elapsed().as_secs_f64());
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");

    // The shell and its sleep leave the guest's /proc.
    for pid in pids {
        eventually(Duration::from_secs(60), &format!("the end of the cancelled command's {pid}"), async || {
            let r =
                call(&client, "sandbox_files_list", json!({"sandbox_id": id, "path": format!("/proc/{pid}")})).await;
            r.is_err().then_some(())
        })
        .await;
    }
    eprintln!("the command's group was gone from the guest {:.1} s after SIGINT", interrupted.elapsed().as_secs_f64());
    let r = call(&client, "sandbox_files_read", json!({"sandbox_id": id, "path": "/tmp/survived"})).await;
    assert!(r.is_err(), "the cancelled command went on: {r:?}");
    call(&client, "sandbox_kill", json!({"sandbox_id": id})).await.expect("kill");
    eprintln!("ctrl_c_stops_the_command_in_the_sandbox: {:.1} s", t.elapsed().as_secs_f64());
}

/// The official Python SDK's `stdio_client` starts `tine mcp stdio --url`:
/// initialize, tools/list, create, a Python cell, kill, the session's own
/// sandbox; closing stdin ends the bridge (exit 0, on its own) and the
/// session, whose own sandbox is then killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdio_bridge_serves_the_python_sdk() {
    if !testkit::kvm_available("stdio_bridge_serves_the_python_sdk") {
        return;
    }
    let Some(python) = python_sdk("stdio_bridge_serves_the_python_sdk") else {
        return;
    };
    let server = tokio::task::spawn_blocking(server).await.unwrap();
    let t = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let status_file: PathBuf = dir.path().join("bridge-status");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/stdio_bridge.py");
    let out = tokio::process::Command::new(&python)
        .arg(&script)
        .arg(&status_file)
        .arg(binary())
        .args(["mcp", "stdio", "--url", &server.url])
        .env("RUST_LOG", "warn")
        .env_remove("TINE_TOKEN")
        .output()
        .await
        .expect("run the Python client");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("--- Python stdio client ({:.1} s) stdout:\n{stdout}\n--- stderr:\n{stderr}", t.elapsed().as_secs_f64());
    assert!(out.status.success(), "the Python client failed: {}", out.status);
    assert_eq!(stdout.lines().last(), Some("ALL OK"));
    let status = std::fs::read_to_string(&status_file).unwrap_or_default();
    assert_eq!(status.trim(), "exit 0", "the bridge did not exit on its own when its stdin closed");
    let own =
        stdout.lines().find_map(|l| l.strip_prefix("SESSION_SANDBOX ")).expect("the session's sandbox").to_string();
    // The session ended with the bridge: its own sandbox goes.
    let client = connect(&server.url, None).await;
    eventually(Duration::from_secs(60), "the end of the bridged session's own sandbox", async || {
        let r = call(&client, "sandbox_list", json!({})).await.expect("list");
        r["sandboxes"].as_array()?.iter().all(|s| s["sandbox_id"] != json!(own)).then_some(())
    })
    .await;
    eprintln!("stdio_bridge_serves_the_python_sdk: {:.1} s", t.elapsed().as_secs_f64());
}

/// The official TypeScript SDK's `StdioClientTransport` starts `tine mcp
/// stdio --url`: initialize, tools/list, create, a Python cell, kill;
/// closing stdin ends the bridge on its own (exit 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdio_bridge_serves_the_typescript_sdk() {
    if !testkit::kvm_available("stdio_bridge_serves_the_typescript_sdk") {
        return;
    }
    let Some(node_modules) = typescript_sdk("stdio_bridge_serves_the_typescript_sdk") else {
        return;
    };
    let server = tokio::task::spawn_blocking(server).await.unwrap();
    let t = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let status_file = dir.path().join("bridge-status");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/js/stdio_bridge.cjs");
    let out = tokio::process::Command::new("node")
        .arg(&script)
        .arg(binary())
        .arg(&server.url)
        .arg(&status_file)
        .env("NODE_PATH", &node_modules)
        .env("RUST_LOG", "warn")
        .env_remove("TINE_TOKEN")
        .output()
        .await
        .expect("run node");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!(
        "--- TypeScript stdio client ({:.1} s) stdout:\n{stdout}\n--- stderr:\n{stderr}",
        t.elapsed().as_secs_f64()
    );
    assert!(out.status.success(), "the TypeScript client failed: {}", out.status);
    assert_eq!(stdout.lines().last(), Some("ALL OK"));
    let status = std::fs::read_to_string(&status_file).unwrap_or_default();
    assert_eq!(status.trim(), "exit 0", "the bridge did not exit on its own when its stdin closed");
    eprintln!("stdio_bridge_serves_the_typescript_sdk: {:.1} s", t.elapsed().as_secs_f64());
}

/// `tine mcp stdio` without `--url`: the server in the client's own
/// subprocess, on a data directory of its own (with a copy of the run's
/// default template), driven by the Python SDK as the bridge is; when the
/// client closes stdin the process exits 0 on its own, having killed the
/// session's own sandbox (nothing is left to keep).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdio_in_process_serves_the_python_sdk() {
    if !testkit::kvm_available("stdio_in_process_serves_the_python_sdk") {
        return;
    }
    let Some(python) = python_sdk("stdio_in_process_serves_the_python_sdk") else {
        return;
    };
    // The shared server's start makes (or finds) the run's default template.
    let _server = tokio::task::spawn_blocking(server).await.unwrap();
    let t = Instant::now();
    let dir = tempfile::Builder::new().prefix("tine-stdio").tempdir_in("/tmp").unwrap();
    let data = dir.path().join("data");
    let config = format!("{}\n[pool]\nsize = 0\n", testkit::mcp::shared_setup(CONFIG));
    let seed = testkit::mcp::default_template_seed(binary(), &testkit::mcp::shared_setup(CONFIG));
    {
        let _lock = testkit::lock_file(&testkit::mcp::seed_lock(&seed));
        std::fs::create_dir_all(data.join("templates")).unwrap();
        assert!(testkit::mcp::copy_dir(&seed, &data.join("templates/default")), "copy {}", seed.display());
    }
    let config_path = dir.path().join("tine.toml");
    std::fs::write(&config_path, config).unwrap();
    let status_file = dir.path().join("status");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/stdio_bridge.py");
    let out = tokio::process::Command::new(&python)
        .arg(&script)
        .arg(&status_file)
        .arg(binary())
        .args(["mcp", "stdio", "--data-dir"])
        .arg(&data)
        .arg("--config")
        .arg(&config_path)
        .arg("--kernel")
        .arg(testkit::kernel())
        .arg("--rootfs")
        .arg(testkit::rootfs())
        .output()
        .await
        .expect("run the Python client");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!(
        "--- Python stdio client, in-process server ({:.1} s) stdout:\n{stdout}\n--- stderr:\n{stderr}",
        t.elapsed().as_secs_f64()
    );
    assert!(out.status.success(), "the Python client failed: {}", out.status);
    assert_eq!(stdout.lines().last(), Some("ALL OK"));
    let status = std::fs::read_to_string(&status_file).unwrap_or_default();
    assert_eq!(status.trim(), "exit 0", "tine mcp stdio did not exit on its own when its stdin closed");
    assert!(stderr.contains("killing the sandbox it made on first use"), "the session's own sandbox was not killed");
    assert!(stderr.contains("0 sandboxes hibernated"), "sandboxes were left running or kept");
    eprintln!("stdio_in_process_serves_the_python_sdk: {:.1} s", t.elapsed().as_secs_f64());
}
