//! `sandbox_create` through MCP with the warm pool against without it,
//! same machine, same run: p50 and p99 of `POOL_CREATES` (default 20)
//! creates each. With the pool, every create waits first until the pool
//! is full again (`/healthz`), so it times a hand-out (MCP, the reseed
//! round trip to the guest, the environment), not a refill; without it,
//! every create restores from the default template. Each sandbox is
//! killed before the next create. Also the time the pool takes to refill
//! one sandbox (restore to agent ready, from `/healthz`).
//!
//! `cargo bench -p tine-benches --bench pool`.

use std::time::{Duration, Instant};

use serde_json::json;
use testkit::mcp::{call, tine_binary, TineServer};
use tine_benches::{median, quantile, record};

const CONFIG: &str = "[limits]\nboot_timeout_secs = 900\n";

/// `n` creates on `server`, each killed after; with `pooled`, each waits
/// for a full pool first. Returns the create times and the refill times.
async fn creates(server: &TineServer, n: usize, pooled: bool) -> (Vec<Duration>, Vec<Duration>) {
    let client = server.client().await;
    let (mut times, mut refills) = (Vec::new(), Vec::new());
    for i in 0..n {
        if pooled {
            let t = Instant::now();
            server.wait_for_pool(2, Duration::from_secs(600));
            if i > 0 {
                refills.push(t.elapsed());
            }
        }
        let t = Instant::now();
        let info = call(&client, "sandbox_create", json!({})).await.expect("sandbox_create");
        let took = t.elapsed();
        assert_eq!(info["from_pool"].as_bool().unwrap_or(false), pooled, "{info}");
        assert_eq!(info["template"], "default", "{info}");
        eprintln!("create {i} ({}): {:.1} ms", if pooled { "pool" } else { "restore" }, took.as_secs_f64() * 1e3);
        times.push(took);
        let id = info["sandbox_id"].as_str().unwrap();
        call(&client, "sandbox_kill", json!({"sandbox_id": id})).await.expect("sandbox_kill");
    }
    (times, refills)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _changes = tine_benches::report_changes_at_end("pool");
    if !testkit::kvm_available("bench pool") {
        return;
    }
    let n = std::env::var("POOL_CREATES").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;

    let server = TineServer::start_with_default_template(&tine_binary(), None, &format!("{CONFIG}[pool]\nsize = 2\n"));
    let (pool, refills) = creates(&server, n, true).await;
    drop(server);
    let server = TineServer::start_with_default_template(&tine_binary(), None, &format!("{CONFIG}[pool]\nsize = 0\n"));
    let (restore, _) = creates(&server, n, false).await;
    drop(server);

    for (what, times) in [("pool", &pool), ("restore", &restore)] {
        let (p50, p99) = (ms(quantile(times, 0.5)), ms(quantile(times, 0.99)));
        println!("sandbox_create through MCP, {what}, {n} creates: p50 {p50:.1} ms, p99 {p99:.1} ms");
        record("pool", &format!("sandbox_create.{what}.p50"), p50, "ms");
        record("pool", &format!("sandbox_create.{what}.p99"), p99, "ms");
    }
    let ratio = ms(quantile(&restore, 0.5)) / ms(quantile(&pool, 0.5));
    println!("restore / pool, p50: {ratio:.0}x");
    record("pool", "ratio.sandbox_create.p50.restore_over_pool", ratio, "x");
    let refill = ms(median(&refills));
    println!("pool refill after a hand-out and a kill (wait until 2 ready), median: {refill:.0} ms");
    record("pool", "refill.p50", refill, "ms");
}
