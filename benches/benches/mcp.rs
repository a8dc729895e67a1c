//! Through MCP, as a client sees it: `sandbox_create` until the sandbox
//! is ready (a cold boot; templates come later), and the round trip of
//! `sandbox_exec` running `true` (`bash -c true`: bash's start-up is most
//! of it on hosts where guest system calls are slow), and of
//! `sandbox_list`, which stays on the host. A real `tine server start --dev`
//! subprocess and rmcp's Streamable HTTP client.
//!
//! `cargo bench -p tine-benches --bench mcp`; `MCP_CREATES=N` (default 5)
//! and `MCP_EXECS=N` (default 20) set the runs.

use std::time::{Duration, Instant};

use serde_json::json;
use tine_benches::median;
use testkit::mcp::{call, tine_binary, TineServer};

fn runs(var: &str, default: usize) -> usize {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !testkit::kvm_available("bench mcp") {
        return;
    }
    let creates = runs("MCP_CREATES", 5);
    let execs = runs("MCP_EXECS", 20);
    let server = TineServer::start(&tine_binary(), None, "[limits]\nboot_timeout_secs = 900\n");
    let client = server.client().await;

    let mut create_times = Vec::new();
    let mut exec_times = Vec::new();
    let mut list_times = Vec::new();
    for i in 0..creates {
        let t = Instant::now();
        let info = call(&client, "sandbox_create", json!({})).await.expect("sandbox_create");
        let took = t.elapsed();
        let id = info["sandbox_id"].as_str().unwrap().to_string();
        eprintln!("create {i}: {:.0} ms (guest boot_ms {})", took.as_secs_f64() * 1e3, info["boot_ms"]);
        create_times.push(took);
        if i == 0 {
            for _ in 0..execs {
                let t = Instant::now();
                let x = call(&client, "sandbox_exec", json!({"sandbox_id": id, "command": "true"})).await.unwrap();
                exec_times.push(t.elapsed());
                assert_eq!(x["exit_code"], 0);
            }
            // The MCP layer alone: a tool that does not reach the guest.
            for _ in 0..execs {
                let t = Instant::now();
                call(&client, "sandbox_list", json!({})).await.unwrap();
                list_times.push(t.elapsed());
            }
        }
        call(&client, "sandbox_kill", json!({"sandbox_id": id})).await.expect("sandbox_kill");
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!("sandbox_create to ready (cold boot), median of {creates}: {:.0} ms", ms(median(&create_times)));
    println!(
        "sandbox_exec `true` round trip through MCP, median of {execs}: {:.0} ms (min {:.0}, max {:.0})",
        ms(median(&exec_times)),
        ms(*exec_times.iter().min().unwrap()),
        ms(*exec_times.iter().max().unwrap())
    );
    println!(
        "sandbox_list round trip (MCP and HTTP only), median of {execs}: {:.2} ms",
        ms(median(&list_times))
    );
}
