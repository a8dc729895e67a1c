//! Through MCP, as a client sees it: `sandbox_create` until the sandbox
//! is ready, by a cold boot (a server with `[templates] build_default =
//! false`) and restored from the default template (a second server, which
//! builds it first), and the round trip of
//! `sandbox_exec` running `true` (`bash -c true`: bash's start-up is most
//! of it on hosts where guest system calls are slow), and of
//! `sandbox_list`, which stays on the host. A real `tine server start --dev`
//! subprocess and rmcp's Streamable HTTP client.
//!
//! `cargo bench -p tine-benches --bench mcp`; `MCP_CREATES=N` (default 5
//! cold boots), `MCP_RESTORES=N` (default 10 template creates) and
//! `MCP_EXECS=N` (default 20) set the runs.

use std::time::{Duration, Instant};

use serde_json::json;
use testkit::mcp::{call, tine_binary, TineServer};
use tine_benches::{median, record};

fn runs(var: &str, default: usize) -> usize {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _changes = tine_benches::report_changes_at_end("mcp");
    if !testkit::kvm_available("bench mcp") {
        return;
    }
    let creates = runs("MCP_CREATES", 5);
    let restores = runs("MCP_RESTORES", 10);
    let execs = runs("MCP_EXECS", 20);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;

    // Cold boots.
    let cold = TineServer::start(
        &tine_binary(),
        None,
        "[limits]\nboot_timeout_secs = 900\n[templates]\nbuild_default = false\n",
    );
    let client = cold.client().await;
    let mut create_times = Vec::new();
    let mut exec_times = Vec::new();
    let mut list_times = Vec::new();
    for i in 0..creates {
        let t = Instant::now();
        let info = call(&client, "sandbox_create", json!({})).await.expect("sandbox_create");
        let took = t.elapsed();
        assert!(info.get("template").is_none(), "a cold boot: {info}");
        let id = info["sandbox_id"].as_str().unwrap().to_string();
        eprintln!("cold create {i}: {:.0} ms (guest boot_ms {})", ms(took), info["boot_ms"]);
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
    drop(client);
    drop(cold);

    // From the default template, which the server builds at start.
    let warm = TineServer::start(&tine_binary(), None, "[limits]\nboot_timeout_secs = 900\n");
    let client = warm.client().await;
    let t = Instant::now();
    loop {
        let l = call(&client, "template_list", json!({})).await.unwrap();
        if l["templates"].as_array().is_some_and(|a| a.iter().any(|t| t["name"] == "default")) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(900), "no default template after 900 s");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!("default template built in {:.0} ms after start", ms(t.elapsed()));
    let mut restore_times = Vec::new();
    for i in 0..restores {
        let t = Instant::now();
        let info = call(&client, "sandbox_create", json!({})).await.expect("sandbox_create from the template");
        let took = t.elapsed();
        assert_eq!(info["template"], "default", "{info}");
        let id = info["sandbox_id"].as_str().unwrap().to_string();
        eprintln!("template create {i}: {:.0} ms", ms(took));
        restore_times.push(took);
        let x = call(&client, "sandbox_exec", json!({"sandbox_id": id, "command": "true"})).await.unwrap();
        assert_eq!(x["exit_code"], 0);
        call(&client, "sandbox_kill", json!({"sandbox_id": id})).await.expect("sandbox_kill");
    }

    let (cold_ms, warm_ms) = (ms(median(&create_times)), ms(median(&restore_times)));
    println!("sandbox_create to ready, cold boot, median of {creates}: {cold_ms:.0} ms");
    record("mcp", "sandbox_create.cold.p50", cold_ms, "ms");
    let (warm_min, warm_max) = (ms(*restore_times.iter().min().unwrap()), ms(*restore_times.iter().max().unwrap()));
    println!("sandbox_create to ready, from the default template, median of {restores}: {warm_ms:.0} ms (min {warm_min:.0}, max {warm_max:.0})");
    record("mcp", "sandbox_create.template.p50", warm_ms, "ms");
    record("mcp", "sandbox_create.template.min", warm_min, "ms");
    record("mcp", "sandbox_create.template.max", warm_max, "ms");
    println!("cold boot / template: {:.1}x", cold_ms / warm_ms);
    record("mcp", "ratio.sandbox_create.p50.cold_over_template", cold_ms / warm_ms, "x");
    let (exec_p50, exec_min, exec_max) =
        (ms(median(&exec_times)), ms(*exec_times.iter().min().unwrap()), ms(*exec_times.iter().max().unwrap()));
    println!(
        "sandbox_exec `true` round trip through MCP, median of {execs}: {exec_p50:.0} ms (min {exec_min:.0}, max {exec_max:.0})"
    );
    record("mcp", "sandbox_exec.true.p50", exec_p50, "ms");
    record("mcp", "sandbox_exec.true.min", exec_min, "ms");
    record("mcp", "sandbox_exec.true.max", exec_max, "ms");
    let list_p50 = ms(median(&list_times));
    println!("sandbox_list round trip (MCP and HTTP only), median of {execs}: {list_p50:.2} ms");
    record("mcp", "sandbox_list.p50", list_p50, "ms");
}
