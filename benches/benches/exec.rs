//! Where an exec's time goes: the round trip through MCP of
//! `sandbox_exec { argv: ["/bin/true"] }` (no shell) and of
//! `sandbox_exec { command: "true" }` (`bash -c true`), against the
//! guest's own timing of the same program (a loop of `/bin/true` timed
//! inside the guest: fork, exec, wait), a call that reaches the agent
//! without starting a process (`sandbox_files_read` of a small file) and
//! one that stays on the host (`sandbox_list`). The agent's overhead per
//! exec is the argv round trip less the guest's own time, in ms and as a
//! ratio.
//!
//! `cargo bench -p tine-benches --bench exec`; `EXEC_RUNS=N` (default 20).

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::mcp::{call, tine_binary, TineServer};
use tine_benches::{quantile, record};

async fn timed(client: &testkit::mcp::McpClient, n: usize, tool: &str, args: Value) -> Vec<Duration> {
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let r = call(client, tool, args.clone()).await.unwrap_or_else(|e| panic!("{tool}: {e}"));
        times.push(t.elapsed());
        if tool == "sandbox_exec" {
            assert_eq!(r["exit_code"], 0, "{r}");
        }
    }
    times
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _changes = tine_benches::report_changes_at_end("exec");
    if !testkit::kvm_available("bench exec") {
        return;
    }
    let n: usize = std::env::var("EXEC_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let server = TineServer::start_with_default_template(&tine_binary(), None, "[limits]\nboot_timeout_secs = 900\n");
    let client = server.client().await;
    let info = call(&client, "sandbox_create", json!({})).await.expect("sandbox_create");
    let id = info["sandbox_id"].as_str().unwrap().to_string();
    // Fault in the paths once (first touches after a restore are slow).
    for _ in 0..3 {
        call(&client, "sandbox_exec", json!({"sandbox_id": id, "argv": ["/bin/true"]})).await.unwrap();
        call(&client, "sandbox_exec", json!({"sandbox_id": id, "command": "true"})).await.unwrap();
    }

    let argv = timed(&client, n, "sandbox_exec", json!({"sandbox_id": id, "argv": ["/bin/true"]})).await;
    let shell = timed(&client, n, "sandbox_exec", json!({"sandbox_id": id, "command": "true"})).await;
    let read = timed(&client, n, "sandbox_files_read", json!({"sandbox_id": id, "path": "/etc/hostname"})).await;
    let list = timed(&client, n, "sandbox_list", json!({})).await;
    // The guest's own time for /bin/true: a loop of `loops` runs timed by
    // bash inside the guest (`%R`: real seconds, three decimals).
    // (Each fork and exec is slow on nested hosts: over 1 s here.)
    let loops = 5;
    let script = format!("TIMEFORMAT=%R; time (for i in $(seq {loops}); do /bin/true; done)");
    let x =
        call(&client, "sandbox_exec", json!({"sandbox_id": id, "command": script, "timeout_secs": 600})).await.unwrap();
    let guest_secs: f64 =
        x["stderr"].as_str().unwrap_or_default().trim().parse().unwrap_or_else(|e| panic!("{x}: {e}"));
    let guest_ms = guest_secs * 1e3 / f64::from(loops);
    call(&client, "sandbox_kill", json!({"sandbox_id": id})).await.unwrap();

    let p50 = |t: &[Duration]| ms(quantile(t, 0.5));
    let rows = [
        ("sandbox_exec.argv_true", &argv, "sandbox_exec argv [/bin/true]"),
        ("sandbox_exec.bash_true", &shell, "sandbox_exec command `true` (bash -c)"),
        ("sandbox_files_read.small", &read, "sandbox_files_read /etc/hostname (agent, no process)"),
        ("sandbox_list", &list, "sandbox_list (host only)"),
    ];
    for (name, times, what) in rows {
        let (m, p99) = (p50(times), ms(quantile(times, 0.99)));
        println!("{what}: p50 {m:.1} ms, p99 {p99:.1} ms ({n} runs)");
        record("exec", &format!("{name}.p50"), m, "ms");
        record("exec", &format!("{name}.p99"), p99, "ms");
    }
    println!("/bin/true inside the guest (fork, exec, wait; {loops} runs timed by bash): {guest_ms:.2} ms each");
    record("exec", "guest.bin_true", guest_ms, "ms");
    let overhead = p50(&argv) - guest_ms;
    println!(
        "agent and transport overhead per exec: {overhead:.1} ms (argv round trip / guest time: {:.1}x); \
         of which MCP and HTTP: {:.1} ms; bash start-up: {:.1} ms",
        p50(&argv) / guest_ms,
        p50(&list),
        p50(&shell) - p50(&argv)
    );
    record("exec", "overhead.argv_true", overhead, "ms");
    record("exec", "ratio.argv_true_over_guest", p50(&argv) / guest_ms, "x");
    record("exec", "bash_startup", p50(&shell) - p50(&argv), "ms");
}
