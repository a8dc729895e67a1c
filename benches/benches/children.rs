//! Branching through MCP, as a client sees it: the time until all `n`
//! children of a sandbox are ready (`sandbox_branch` returns once every
//! child's agent has answered and been reseeded) for n = 1, 8, 32, 100, and
//! the host memory each idle child costs (growth of the server process's
//! PSS, and each child's resident guest RAM as `sandbox_info` reports it).
//! A real `tine server start --dev` subprocess; the source is restored from
//! the default template and has run a Python cell.
//!
//! `cargo bench -p tine-benches --bench children`. `CHILDREN_NS` (default
//! `1,8,32,100`), `CHILDREN_IDLE_SECS` (default 10: how long the children
//! idle before memory is read).

use std::time::{Duration, Instant};

use serde_json::json;
use testkit::mcp::{call, tine_binary, TineServer};

use tine_benches::{env_list, mib, process_pss, record};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _changes = tine_benches::report_changes_at_end("children");
    if !testkit::kvm_available("bench children") {
        return;
    }
    let ns: Vec<usize> = env_list("CHILDREN_NS", "1,8,32,100");
    let idle: u64 = std::env::var("CHILDREN_IDLE_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    let max = ns.iter().max().copied().unwrap_or(1) + 1;
    let config = format!("[limits]\nboot_timeout_secs = 1800\nmax_sandboxes = {max}\n");
    let server = TineServer::start(&tine_binary(), None, &config);
    let client = server.client().await;
    let source = call(&client, "sandbox_create", json!({})).await.expect("create the source");
    let src = source["sandbox_id"].as_str().unwrap().to_string();
    call(&client, "sandbox_run_python", json!({"sandbox_id": src, "code": "import json, hashlib\nstate = list(range(100000))\nlen(state)", "timeout_secs": 600}))
        .await
        .expect("python in the source");
    let mut rows = Vec::new();
    for &n in &ns {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let before = process_pss(server.pid());
        let t = Instant::now();
        let b = call(&client, "sandbox_branch", json!({"sandbox_id": src, "n": n})).await.expect("sandbox_branch");
        let took = t.elapsed();
        let kids: Vec<String> =
            b["children"].as_array().unwrap().iter().map(|c| c["sandbox_id"].as_str().unwrap().to_string()).collect();
        assert_eq!(kids.len(), n);
        tokio::time::sleep(Duration::from_secs(idle)).await;
        let after = process_pss(server.pid());
        let mut rss = Vec::new();
        for id in &kids {
            let info = call(&client, "sandbox_info", json!({"sandbox_id": id})).await.expect("sandbox_info");
            rss.push(info["usage"]["host_memory_bytes"].as_u64().unwrap_or(0));
        }
        rss.sort();
        let (client_ms, copied) = (took.as_secs_f64() * 1e3, mib(b["memory_copied_bytes"].as_u64().unwrap_or(0)));
        let (pss_per_child, rss_p50) = (mib(after.saturating_sub(before)) / n as f64, mib(rss[rss.len() / 2]));
        let row = format!(
            "n = {n:>3}: all children ready in {client_ms:>8.0} ms (client), server says {} ms; mode {}, source paused {} ms, copy {} ms ({copied:.1} MiB); \
             per idle child after {idle} s: server PSS +{pss_per_child:.2} MiB, guest RAM RSS median {rss_p50:.1} MiB",
            b["ready_ms"],
            b["mode"],
            b["pause_ms"],
            b["copy_ms"],
        );
        eprintln!("{row}");
        // Recorded as each row is measured (the rows are printed at the end).
        record("children", &format!("sandbox_branch.all_ready.client.n_{n}"), client_ms, "ms");
        // The server's figures as it reported them; one it left out is not recorded.
        for (key, name) in [("ready_ms", "all_ready.server"), ("pause_ms", "source_pause"), ("copy_ms", "copy")] {
            if let Some(v) = b[key].as_f64() {
                record("children", &format!("sandbox_branch.{name}.n_{n}"), v, "ms");
            }
        }
        record("children", &format!("sandbox_branch.memory_copied.n_{n}"), copied, "MiB");
        record("children", &format!("idle_child.server_pss_growth.n_{n}"), pss_per_child, "MiB");
        record("children", &format!("idle_child.guest_ram_rss.p50.n_{n}"), rss_p50, "MiB");
        rows.push(row);
        for id in &kids {
            call(&client, "sandbox_kill", json!({"sandbox_id": id})).await.expect("kill a child");
        }
    }
    println!("\nsandbox_branch through MCP (source: a default-template sandbox, 512 MiB, 1 vCPU):");
    for r in rows {
        println!("{r}");
    }
}
