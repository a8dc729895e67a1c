//! Density (issue 31): how many sandboxes one host keeps, running idle or
//! hibernated, through the real server and MCP.
//!
//! `DENSITY_KEPT` sandboxes (default 1000) are created one by one from the
//! default template with `max_sandboxes = DENSITY_RUNNING` (default 50):
//! past the cap, each create hibernates the least recently used idle
//! sandbox to make room (`pressure_min_idle_secs = 0`), so the host ends
//! with `DENSITY_RUNNING` running and the rest hibernated. Reported: the
//! create times (below and past the cap), the server's memory (PSS, which
//! splits the template's shared pages among the sandboxes that map them)
//! per running idle sandbox, the kept state's disk use per hibernated
//! sandbox (allocated blocks; the template's pinned base, shared, apart),
//! `sandbox_list` latency (target: under 100 ms with 1000 kept), and the
//! first-created sandbox, hibernated longest, answering an exec.
//!
//! `cargo bench -p tine-benches --bench density` (about 20 min here for
//! 1000; `DENSITY_KEPT=200` for a quick look).

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::mcp::{call, tine_binary, TineServer};
use tine_benches::{env_or, median, mib, process_pss, quantile, record};

/// Bytes allocated under `dir` (recursively; `st_blocks`), and the part
/// under a directory named `skip` (the pinned bases).
fn allocated(dir: &Path, skip: &str) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let (mut total, mut skipped) = (0, 0);
    let Ok(entries) = std::fs::read_dir(dir) else { return (0, 0) };
    for e in entries.flatten() {
        let Ok(m) = e.metadata() else { continue };
        if m.is_dir() {
            let (t, s) = allocated(&e.path(), skip);
            total += t;
            skipped += if e.file_name() == skip { t } else { s };
        } else {
            total += m.blocks() * 512;
        }
    }
    (total, skipped)
}

/// A sample of the server's `/metrics` (0 when absent).
async fn metric(server: &TineServer, series: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", server.base)).await.unwrap().text().await.unwrap();
    let prefix = format!("{series} ");
    text.lines().find_map(|l| l.strip_prefix(prefix.as_str())).map_or(0.0, |n| n.parse().unwrap_or(0.0))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _changes = tine_benches::report_changes_at_end("density");
    if !testkit::kvm_available("bench density") {
        return;
    }
    let kept: usize = env_or("DENSITY_KEPT", 1000);
    let running: usize = env_or("DENSITY_RUNNING", 50).min(kept);
    let config = format!(
        "[limits]\nboot_timeout_secs = 900\nmax_sandboxes = {running}\nmax_kept_sandboxes = {}\n\
         pressure_min_idle_secs = 0\n[pool]\nsize = 0\n",
        kept.max(running)
    );
    let server = TineServer::start_with_default_template(&tine_binary(), None, &config);
    let client = server.client().await;
    let pss_before = process_pss(server.pid());
    println!("density: {kept} sandboxes, {running} running at most; server PSS {:.0} MiB", mib(pss_before));

    let (mut below, mut past) = (Vec::new(), Vec::new());
    let mut first = None;
    let t0 = Instant::now();
    for i in 0..kept {
        let t = Instant::now();
        let r = call(&client, "sandbox_create", json!({}))
            .await
            .unwrap_or_else(|e| panic!("create {} of {kept} failed: {e}", i + 1));
        let took = t.elapsed();
        first.get_or_insert_with(|| r["sandbox_id"].as_str().unwrap().to_string());
        if i < running { &mut below } else { &mut past }.push(took);
        if (i + 1) % 50 == 0 {
            println!("  {} created in {:.0} s", i + 1, t0.elapsed().as_secs_f64());
        }
    }
    let first = first.expect("a sandbox");
    for (what, v) in [("create_below_cap", &below), ("create_past_cap", &past)] {
        if v.is_empty() {
            continue;
        }
        let (p50, p99) = (ms(median(v)), ms(quantile(v, 0.99)));
        println!("{what}: p50 {p50:.0} ms, p99 {p99:.0} ms ({} creates)", v.len());
        record("density", &format!("{what}.p50"), p50, "ms");
        record("density", &format!("{what}.p99"), p99, "ms");
    }

    let n_running = metric(&server, "tine_sandboxes{state=\"running\"}").await;
    let n_hibernated = metric(&server, "tine_sandboxes{state=\"hibernated\"}").await;
    println!("kept: {n_running} running, {n_hibernated} hibernated");
    assert_eq!(n_running + n_hibernated, kept as f64, "every sandbox is kept");

    // Memory per running idle sandbox: the server's PSS growth over the
    // running ones (hibernated ones hold none).
    let pss = process_pss(server.pid());
    let per_running = mib(pss.saturating_sub(pss_before)) / n_running.max(1.0);
    println!("server PSS {:.0} MiB: {per_running:.1} MiB per running idle sandbox", mib(pss));
    record("density", "memory_per_running_idle", per_running, "MiB");
    let (disk, bases) = allocated(&server.data_dir.join("kept"), ".bases");
    let per_hibernated = mib(disk - bases) / n_hibernated.max(1.0);
    println!(
        "kept state {:.0} MiB ({:.0} MiB of pinned bases): {per_hibernated:.2} MiB per hibernated sandbox",
        mib(disk),
        mib(bases)
    );
    record("density", "disk_per_hibernated", per_hibernated, "MiB");

    let mut lists = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        let r = call(&client, "sandbox_list", json!({})).await.expect("sandbox_list");
        lists.push(t.elapsed());
        assert_eq!(r["total"], kept, "{}", r["total"]);
    }
    let (p50, max) = (ms(median(&lists)), ms(*lists.iter().max().unwrap()));
    println!("sandbox_list with {kept} kept: median {p50:.1} ms, max {max:.1} ms (10 calls)");
    record("density", "sandbox_list.p50", p50, "ms");
    record("density", "sandbox_list.max", max, "ms");

    let t = Instant::now();
    let r = call(&client, "sandbox_exec", json!({"sandbox_id": first, "command": "echo back"}))
        .await
        .expect("the first sandbox, hibernated longest, answers");
    assert_eq!(r["stdout"], "back\n", "{r}");
    println!("{first}, hibernated longest, answered its exec in {:.0} ms", ms(t.elapsed()));
    record("density", "resume_to_exec", ms(t.elapsed()), "ms");
}
