//! Load and soak against a real `tine server start --dev` with default
//! limits: many MCP sessions at once, and many create/exec/kill and
//! branch/kill cycles. The server's thread and fd counts must come back to
//! where they started, and under load every session either finishes its
//! trivial work or gets an immediate, clear limit error.
//!
//! CI runs the 24-session test and a short soak; the soak's full size (500
//! create and 50 branch cycles) runs on demand:
//! `cargo test --release -p tine --test load -- --ignored soak_full --nocapture`.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::mcp::{call, TineServer};

/// One server at a time on the host's two cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tine"))
}

/// Threads, open fds and resident memory (KiB) of a process, from
/// `/proc/<pid>/{task,fd,status}` (proc(5)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Usage {
    threads: usize,
    fds: usize,
    rss_kib: u64,
}

fn usage(pid: u32) -> Usage {
    let count = |d: &str| std::fs::read_dir(format!("/proc/{pid}/{d}")).map(|r| r.count()).unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Usage { threads: count("task"), fds: count("fd"), rss_kib }
}

/// Waits (up to 90 s: idle tokio blocking threads linger 10 s) until the
/// server has no more threads and fds than at `baseline`; panics with both
/// counts otherwise.
async fn settles_to(pid: u32, baseline: Usage, what: &str) -> Usage {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let now = usage(pid);
        if now.threads <= baseline.threads && now.fds <= baseline.fds {
            return now;
        }
        if Instant::now() > deadline {
            let fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
                .map(|d| {
                    d.flatten()
                        .map(|e| std::fs::read_link(e.path()).map(|p| p.display().to_string()).unwrap_or_default())
                        .collect()
                })
                .unwrap_or_default();
            panic!("after {what}: {now:?}, baseline {baseline:?}; open fds: {fds:#?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Starts a `--dev` server with default limits (only the boot timeout is
/// raised for slow nested hosts) and waits for its default template.
fn server() -> TineServer {
    TineServer::start_with_default_template(binary(), None, "[limits]\nboot_timeout_secs = 1200\n")
}

/// Whether a tool error is one of the server's limits speaking (not a
/// timeout or a failure of work that was admitted).
fn is_limit_error(e: &str) -> bool {
    let e = e.to_ascii_lowercase();
    (e.contains("limit") || e.contains("budget")) && !e.contains("timed out") && !e.contains("timeout")
}

/// The load test: 24 sessions at once, each a create, a one-line
/// Python cell, an exec and a kill, against default limits (16 live
/// sandboxes).
async fn twenty_four_sessions_at_once(server: &TineServer) {
    let pid = server.pid();
    // One warm-up cycle first: the first restore loads the default
    // template (a memfd the server keeps), which is not a leak.
    let client = server.client().await;
    let c = call(&client, "sandbox_create", json!({})).await.expect("warm-up create");
    call(&client, "sandbox_kill", json!({"sandbox_id": c["sandbox_id"]})).await.expect("warm-up kill");
    let _ = client.cancel().await;
    let before = settles_to(pid, usage(pid), "the warm-up cycle").await;

    let t = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..24u32 {
        let client = server.client().await;
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let created = match call(&client, "sandbox_create", json!({})).await {
                Ok(c) => c,
                Err(e) => {
                    let after = started.elapsed();
                    assert!(is_limit_error(&e), "session {i}: create failed with a non-limit error: {e}");
                    assert!(after < Duration::from_secs(30), "session {i}: the limit error took {after:?}: {e}");
                    let _ = client.cancel().await;
                    return (i, Err(e));
                }
            };
            let id = created["sandbox_id"].as_str().expect("sandbox_id").to_string();
            // Generous timeouts: 24 guests restored at once fault in their
            // pages together, and a first call took up to 68 s here beside
            // another test binary (docs/hosts.md).
            let v = call(&client, "sandbox_run_python", json!({"code": format!("{i}*2"), "timeout_secs": 600}))
                .await
                .unwrap_or_else(|e| panic!("session {i}: python in {id}: {e}"));
            assert_eq!(v["result"], (i * 2).to_string(), "session {i}: {v}");
            assert_eq!(v["sandbox_id"], id.as_str(), "session {i}: the cell ran in the session's sandbox: {v}");
            let x = call(&client, "sandbox_exec", json!({"command": format!("echo s{i}"), "timeout_secs": 600}))
                .await
                .unwrap_or_else(|e| panic!("session {i}: exec in {id}: {e}"));
            assert_eq!(x["stdout"], format!("s{i}\n"), "session {i}: {x}");
            call(&client, "sandbox_kill", json!({"sandbox_id": id}))
                .await
                .unwrap_or_else(|e| panic!("session {i}: kill {id}: {e}"));
            let _ = client.cancel().await;
            (i, Ok(started.elapsed()))
        }));
    }
    let mut done = Vec::new();
    let mut refused = Vec::new();
    for task in tasks {
        match task.await.expect("session task") {
            (i, Ok(took)) => done.push((i, took)),
            (i, Err(e)) => refused.push((i, e)),
        }
    }
    eprintln!(
        "24 sessions in {:.1} s: {} completed (slowest {:.1} s), {} refused by a limit{}",
        t.elapsed().as_secs_f64(),
        done.len(),
        done.iter().map(|(_, d)| d.as_secs_f64()).fold(0.0, f64::max),
        refused.len(),
        refused.first().map(|(i, e)| format!(" (session {i}: {e})")).unwrap_or_default()
    );
    assert!(done.len() >= 8, "at least some sessions must get through: {refused:#?}");
    let after = settles_to(pid, before, "24 sessions").await;
    eprintln!("server before {before:?}, after {after:?}");
    let health: Value = reqwest::get(format!("{}/healthz", server.base)).await.unwrap().json().await.unwrap();
    assert_eq!(health["status"], "ok", "{health}");
}

/// Runs `creates` create/exec/kill cycles (template restores) and
/// `branches` branch/kill cycles on one server; checks that its threads and
/// fds come back to the start and its RSS grows by less than `rss_noise_kib`.
async fn soak(server: &TineServer, creates: usize, branches: usize, rss_noise_kib: u64) {
    let pid = server.pid();
    let client = server.client().await;
    // One warm-up cycle first: the first restore maps the template and
    // starts the server's pools, which are not a leak.
    let c = call(&client, "sandbox_create", json!({})).await.expect("create");
    call(&client, "sandbox_kill", json!({"sandbox_id": c["sandbox_id"]})).await.expect("kill");
    let before = settles_to(pid, usage(pid), "the warm-up cycle").await;

    let t = Instant::now();
    for i in 0..creates {
        let c = call(&client, "sandbox_create", json!({})).await.unwrap_or_else(|e| panic!("cycle {i}: create: {e}"));
        let id = c["sandbox_id"].as_str().unwrap().to_string();
        let x = call(&client, "sandbox_exec", json!({"sandbox_id": id, "command": format!("echo {i}")}))
            .await
            .unwrap_or_else(|e| panic!("cycle {i}: exec in {id}: {e}"));
        assert_eq!(x["stdout"], format!("{i}\n"), "cycle {i}");
        call(&client, "sandbox_kill", json!({"sandbox_id": id})).await.unwrap_or_else(|e| panic!("cycle {i}: {e}"));
    }
    let creates_s = t.elapsed().as_secs_f64();

    let t = Instant::now();
    let parent = call(&client, "sandbox_create", json!({})).await.expect("create the branch parent");
    let parent = parent["sandbox_id"].as_str().unwrap().to_string();
    call(&client, "sandbox_run_python", json!({"sandbox_id": parent, "code": "state = 7"})).await.expect("python");
    for i in 0..branches {
        let b = call(&client, "sandbox_branch", json!({"sandbox_id": parent, "n": 1}))
            .await
            .unwrap_or_else(|e| panic!("branch cycle {i}: {e}"));
        let kid = b["children"][0]["sandbox_id"].as_str().expect("child id").to_string();
        let v = call(&client, "sandbox_run_python", json!({"sandbox_id": kid, "code": "state"}))
            .await
            .unwrap_or_else(|e| panic!("branch cycle {i}: python in {kid}: {e}"));
        assert_eq!(v["result"], "7", "branch cycle {i}: {v}");
        call(&client, "sandbox_kill", json!({"sandbox_id": kid})).await.unwrap_or_else(|e| panic!("{i}: {e}"));
    }
    call(&client, "sandbox_kill", json!({"sandbox_id": parent})).await.expect("kill the branch parent");
    let branches_s = t.elapsed().as_secs_f64();

    let after = settles_to(pid, before, "the soak").await;
    let grew = after.rss_kib.saturating_sub(before.rss_kib);
    eprintln!(
        "soak: {creates} create/exec/kill cycles in {creates_s:.1} s ({:.0} ms each), {branches} branch/kill \
         cycles in {branches_s:.1} s; server before {before:?}, after {after:?}, RSS grew {grew} KiB",
        creates_s * 1000.0 / creates.max(1) as f64
    );
    assert!(grew < rss_noise_kib, "RSS grew {grew} KiB over {creates}+{branches} cycles (bound {rss_noise_kib} KiB)");
}

/// What CI runs, on one server (one default template build): the issue's
/// 24 sessions at once, then the soak's short version (4 create cycles
/// and 2 branch cycles; a cycle is about 4 s of guest work here, and the
/// threads and fds must come back exactly, so a per-cycle leak of either
/// shows after one cycle). RSS noise bound: 32 MiB (allocator arenas and
/// the tokio pools settle into it; a per-cycle leak of a guest's memory,
/// 512 MiB, would not fit). `soak_full` is the long run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_four_sessions_then_short_soak() {
    if !testkit::kvm_available("twenty_four_sessions_then_short_soak") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let server = server();
    twenty_four_sessions_at_once(&server).await;
    soak(&server, 4, 2, 32 << 10).await;
}

/// The full soak (500 create cycles, 50 branch cycles); on demand.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "about an hour on a nested host; run on demand"]
async fn soak_full() {
    if !testkit::kvm_available("soak_full") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let server = server();
    soak(&server, 500, 50, 64 << 10).await;
}
