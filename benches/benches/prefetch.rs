//! The first calls after a restore, with and without working-set prefetch
//! (`[templates] prefetch`), beside a warm exec, through MCP: for each of
//! `PREFETCH_CREATES` (default 5) sandboxes, `sandbox_create` (restore to
//! ready), the first `sandbox_exec` of `true`, the first Python cell
//! (`1 + 1`) and then three more execs of `true` (the warm exec: their
//! median). Two servers one after the other, same machine, same run; the
//! pool is off in both so every create restores.
//!
//! `cargo bench -p tine-benches --bench prefetch`;
//! `PREFETCH_BACKING=userfaultfd` restores through userfaultfd instead of
//! the private mapping (`[templates] memory_backing`).

use std::time::{Duration, Instant};

use serde_json::json;
use testkit::mcp::{call, tine_binary, TineServer};
use tine_benches::{median, record};

/// Create, first exec, first cell and warm exec times of `n` sandboxes.
async fn firsts(server: &TineServer, n: usize) -> [Vec<Duration>; 4] {
    let client = server.client().await;
    let mut out: [Vec<Duration>; 4] = Default::default();
    for i in 0..n {
        let t = Instant::now();
        let info = call(&client, "sandbox_create", json!({})).await.expect("sandbox_create");
        out[0].push(t.elapsed());
        let id = info["sandbox_id"].as_str().unwrap().to_string();
        let exec = json!({"sandbox_id": id, "command": "true"});
        let t = Instant::now();
        let x = call(&client, "sandbox_exec", exec.clone()).await.unwrap();
        assert_eq!(x["exit_code"], 0, "{x}");
        out[1].push(t.elapsed());
        let t = Instant::now();
        let v = call(&client, "sandbox_run_python", json!({"sandbox_id": id, "code": "1 + 1"})).await.unwrap();
        assert_eq!(v["result"], "2", "{v}");
        out[2].push(t.elapsed());
        let mut warm = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            call(&client, "sandbox_exec", exec.clone()).await.unwrap();
            warm.push(t.elapsed());
        }
        out[3].push(median(&warm));
        let ms = |d: &Duration| d.as_secs_f64() * 1e3;
        eprintln!(
            "sandbox {i}: create {:.0} ms, first exec {:.0} ms, first cell {:.0} ms, warm exec {:.0} ms",
            ms(&out[0][i]),
            ms(&out[1][i]),
            ms(&out[2][i]),
            ms(&out[3][i])
        );
        call(&client, "sandbox_kill", json!({"sandbox_id": id})).await.unwrap();
    }
    out
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _changes = tine_benches::report_changes_at_end("prefetch");
    if !testkit::kvm_available("bench prefetch") {
        return;
    }
    let n = std::env::var("PREFETCH_CREATES").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let backing = std::env::var("PREFETCH_BACKING").unwrap_or_else(|_| "private".into());
    let mut warm_all = Vec::new();
    for prefetch in [true, false] {
        let config = format!(
            "[limits]\nboot_timeout_secs = 900\n[templates]\nprefetch = {prefetch}\nmemory_backing = \"{backing}\"\n"
        );
        let server = TineServer::start_with_default_template(&tine_binary(), None, &config);
        let [create, exec, cell, warm] = firsts(&server, n).await;
        drop(server);
        let mode = format!("{backing}.{}", if prefetch { "prefetch" } else { "no_prefetch" });
        let (c, e, p, w) = (ms(median(&create)), ms(median(&exec)), ms(median(&cell)), ms(median(&warm)));
        println!(
            "{mode}: create {c:.0} ms, first exec {e:.0} ms, first Python cell {p:.0} ms, warm exec {w:.0} ms \
             (medians of {n}); first exec / warm exec {:.2}x",
            e / w
        );
        record("prefetch", &format!("sandbox_create.{mode}.p50"), c, "ms");
        record("prefetch", &format!("first_exec.{mode}.p50"), e, "ms");
        record("prefetch", &format!("first_cell.{mode}.p50"), p, "ms");
        record("prefetch", &format!("warm_exec.{mode}.p50"), w, "ms");
        record("prefetch", &format!("ratio.first_exec_over_warm.{mode}"), e / w, "x");
        warm_all.extend(warm);
    }
    println!("warm exec over both servers, median: {:.0} ms", ms(median(&warm_all)));
}
