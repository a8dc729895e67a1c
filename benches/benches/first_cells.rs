//! The load scenario of issue 14: `SESSIONS` MCP sessions at once (default
//! 16), each `sandbox_create` (restored from the default template) then
//! `sandbox_run_python` of `i*2`, against a real `tine server start --dev`
//! with default limits (a longer boot timeout for the template's cold
//! boot only). Measures, asserts nothing: per session the create and the
//! cell's round trip, which cells answered correctly, and the failures.
//!
//! `cargo bench -p tine-benches --bench first_cells`; `SESSIONS=N`;
//! `TINE_BIN` picks the server binary (to compare builds).

use std::time::{Duration, Instant};

use serde_json::json;
use testkit::mcp::{call, tine_binary, TineServer};
use tine_benches::{median, record};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _changes = tine_benches::report_changes_at_end("first_cells");
    if !testkit::kvm_available("bench first_cells") {
        return;
    }
    let sessions: usize = std::env::var("SESSIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(16);
    let server = TineServer::start(&tine_binary(), None, "[limits]\nboot_timeout_secs = 1200\n");
    server.wait_for_default_template(Duration::from_secs(1800));
    eprintln!("first_cells: default template ready; {sessions} sessions at once");

    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..sessions {
        let client = server.client().await;
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let created = call(&client, "sandbox_create", json!({})).await;
            let create = t.elapsed();
            let id = match created {
                Ok(v) => v["sandbox_id"].as_str().unwrap_or_default().to_string(),
                Err(e) => return (i, create, None, Err(format!("create: {e}"))),
            };
            let t = Instant::now();
            let cell = call(&client, "sandbox_run_python", json!({"sandbox_id": id, "code": format!("{i}*2")})).await;
            let cell_time = t.elapsed();
            let r = match cell {
                Ok(v) if v["result"] == json!((i * 2).to_string()) && v["error"].is_null() => Ok(()),
                Ok(v) => Err(format!("cell: {v}")),
                Err(e) => Err(format!("cell: {e}")),
            };
            let _ = call(&client, "sandbox_kill", json!({"sandbox_id": id})).await;
            let _ = client.cancel().await;
            (i, create, Some(cell_time), r)
        }));
    }
    let mut creates = Vec::new();
    let mut cells = Vec::new();
    let mut ok = 0;
    for t in tasks {
        let (i, create, cell, r) = t.await.expect("session task");
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        creates.push(create);
        if let Some(c) = cell {
            cells.push(c);
        }
        match r {
            Ok(()) => ok += 1,
            Err(e) => eprintln!("first_cells: session {i}: {}", e.chars().take(300).collect::<String>()),
        }
        eprintln!("first_cells: session {i}: create {:.0} ms, cell {:?} ms", ms(create), cell.map(|c| ms(c).round()));
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let max = |v: &[Duration]| ms(v.iter().max().copied().unwrap_or_default());
    let med = |v: &[Duration]| if v.is_empty() { 0.0 } else { ms(median(v)) };
    let wall = started.elapsed().as_secs_f64();
    println!(
        "first_cells: {ok}/{sessions} correct in {wall:.1} s; create median {:.0} ms max {:.0} ms; \
         cell median {:.0} ms max {:.0} ms",
        med(&creates),
        max(&creates),
        med(&cells),
        max(&cells),
    );
    // The number of sessions at once is part of each name: it is the load.
    let load = format!("sessions_{sessions}");
    record("first_cells", &format!("sessions.correct.{load}"), ok as f64, "count");
    record("first_cells", &format!("all_sessions.wall.{load}"), wall, "s");
    // A median or maximum of no samples (printed as 0) is not recorded.
    for (what, samples) in [("sandbox_create", &creates), ("first_cell", &cells)] {
        if !samples.is_empty() {
            record("first_cells", &format!("{what}.p50.{load}"), med(samples), "ms");
            record("first_cells", &format!("{what}.max.{load}"), max(samples), "ms");
        }
    }
}
