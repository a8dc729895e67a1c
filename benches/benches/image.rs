//! An OCI image to a ready template through MCP (issue 33): for each size
//! in `IMAGE_BENCH_MIB` (default `100,500`), an image of the busybox
//! layers (`testkit::oci::busybox_layout`) and one more layer holding that
//! many MiB of incompressible pseudo-random files (gzip'd, the same bytes
//! every run) is pushed to a local registry (Debian's `docker-registry` on
//! a loopback port) and made a template by `template_create { image }` on
//! a real `tine server start`:
//!
//! - **cold**: a fresh server, whose layer cache and base images are
//!   empty: the pull, the base image (`tine_image::build`), the builder's
//!   cold boot, its snapshot and the working-set recording;
//! - **cached**: the template deleted and made again from the same image:
//!   the manifest only is fetched (the blobs are in the layout already)
//!   and the base image is reused, so it is the boot and the snapshot;
//! - **shared**: a second tag of the repository, the same layers and one
//!   small one more: only the new layer and the configuration are
//!   fetched, the base image is built again (a new manifest digest).
//!
//! Each is timed from `template_create` (which returns at once, state
//! `building`) until `template_list` shows the template ready and no
//! build of it; `template_list`'s build step, polled every 100 ms, splits
//! the total into the pull, the base image, the boot (to the snapshot), the
//! snapshot and the working-set recording (to within the poll interval).
//! `IMAGE_BENCH_RUNS` (default 1) runs of the three, each on a fresh
//! server; the medians are printed and recorded.
//!
//! `cargo bench -p tine-benches --bench image`; skipped (loudly) without
//! `/dev/kvm` or without `/usr/bin/docker-registry`.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::mcp::{call, tine_binary, McpClient, TineServer};
use testkit::oci::{gzip, sha256, Layer, Registry};
use tine_benches::{env_list, env_or, median, record};

/// The parts of a build, in order, as `template_list`'s step shows them.
const PHASES: [&str; 5] = ["pull", "base image", "boot", "snapshot", "working set"];

/// Which of [`PHASES`] a build step belongs to; `PHASES.len()` once the
/// build is over.
fn phase_of(step: &str) -> usize {
    if step.starts_with("pulling ") || step.starts_with("starting the builder") {
        0
    } else if step.starts_with("making ") || step.starts_with("base image of ") {
        1
    } else if step.starts_with("snapshotting ") {
        3
    } else if step.starts_with("recording the working set") {
        4
    } else if step.starts_with("template ") && step.ends_with(" ready") {
        PHASES.len()
    } else {
        // "booting the builder sandbox from image ..." and whatever the
        // builder does before its snapshot.
        2
    }
}

/// One build: its total and the share of each of [`PHASES`].
struct Build {
    total: Duration,
    phases: [Duration; PHASES.len()],
}

/// `template_create { name, image }`, then `template_list` every 100 ms
/// until the template is ready; panics when the build fails or takes
/// over 20 minutes.
async fn build(client: &McpClient, name: &str, image: &str) -> Build {
    let t0 = Instant::now();
    let started =
        call(client, "template_create", json!({"name": name, "image": image})).await.expect("template_create");
    assert_eq!(started["state"], "building", "{started}");
    // ends[k]: when a step past phase k was first seen.
    let mut ends: [Option<Duration>; PHASES.len()] = [None; PHASES.len()];
    let mut last_step = String::new();
    let total = loop {
        let list = call(client, "template_list", json!({})).await.expect("template_list");
        let seen = t0.elapsed();
        let entries: Vec<&Value> =
            list["templates"].as_array().expect("templates").iter().filter(|t| t["name"] == name).collect();
        if let Some(failed) = entries.iter().find(|t| t["state"] == "failed") {
            panic!("the template from {image} failed: {failed}");
        }
        let building = entries.iter().find(|t| t["state"] == "building");
        let phase = match building {
            Some(b) => {
                let step = b["step"].as_str().unwrap_or_default();
                if step != last_step {
                    eprintln!("  {:7.1} s  {step}", seen.as_secs_f64());
                    last_step = step.to_string();
                }
                phase_of(step)
            }
            None if entries.iter().any(|t| t["state"] == "ready") => PHASES.len(),
            None => panic!("template {name} is neither building nor ready: {list}"),
        };
        for end in ends.iter_mut().take(phase) {
            end.get_or_insert(seen);
        }
        if phase == PHASES.len() {
            break seen;
        }
        assert!(seen < Duration::from_secs(1200), "template {name} not ready within 20 minutes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut phases = [Duration::ZERO; PHASES.len()];
    let mut from = Duration::ZERO;
    for (k, end) in ends.iter().enumerate() {
        let end = end.unwrap_or(total);
        phases[k] = end.saturating_sub(from);
        from = end;
    }
    Build { total, phases }
}

/// `mib` MiB of pseudo-random bytes (xorshift64*, seeded by `seed`): the
/// same bytes every run, which gzip cannot shrink.
fn random_bytes(mib: u64, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity((mib << 20) as usize);
    for _ in 0..(mib << 20) / 8 {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out
}

/// Writes `bytes` as a blob of the OCI layout `layout`; its descriptor
/// (`mediaType` `media_type`).
fn put_blob(layout: &Path, media_type: &str, bytes: &[u8]) -> Value {
    let digest = sha256(bytes);
    let path = layout.join("blobs/sha256").join(digest.trim_start_matches("sha256:"));
    std::fs::write(&path, bytes).expect("write a blob");
    json!({"mediaType": media_type, "digest": digest, "size": bytes.len()})
}

/// Adds `tar` (an uncompressed layer) to the OCI layout `layout`,
/// gzip'd: its `diff_id` and descriptor.
fn add_layer(layout: &Path, tar: &[u8]) -> (String, Value) {
    (sha256(tar), put_blob(layout, "application/vnd.oci.image.layer.v1.tar+gzip", &gzip(tar)))
}

/// Makes the layout `layout` (the busybox image, whose manifest `base`
/// describes) name one image: the busybox layers and `extra` (from
/// [`add_layer`]) on top. Blobs stay, so the images share them.
fn write_image(layout: &Path, base: &Value, extra: &[&(String, Value)]) {
    let blob = |d: &Value| {
        let hex = d["digest"].as_str().expect("digest").trim_start_matches("sha256:");
        std::fs::read(layout.join("blobs/sha256").join(hex)).expect("read a blob")
    };
    let base_manifest: Value = serde_json::from_slice(&blob(base)).expect("busybox manifest");
    let mut config: Value = serde_json::from_slice(&blob(&base_manifest["config"])).expect("busybox config");
    let mut layers = base_manifest["layers"].as_array().expect("layers").clone();
    for (diff_id, desc) in extra {
        config["rootfs"]["diff_ids"].as_array_mut().expect("diff_ids").push(diff_id.clone().into());
        layers.push(desc.clone());
    }
    let config = put_blob(
        layout,
        "application/vnd.oci.image.config.v1+json",
        &serde_json::to_vec(&config).expect("config JSON"),
    );
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config,
        "layers": layers,
    });
    let mut desc = put_blob(
        layout,
        "application/vnd.oci.image.manifest.v1+json",
        &serde_json::to_vec(&manifest).expect("manifest JSON"),
    );
    desc["platform"] = json!({"architecture": "amd64", "os": "linux"});
    testkit::oci::write_index(layout, vec![desc]);
}

/// The layer of `mib` MiB of pseudo-random data, as files of 4 MiB under
/// `/opt/bench`.
fn data_layer(mib: u64) -> Vec<u8> {
    let data = random_bytes(mib, mib);
    let mut layer = Layer::new().dir("opt/", 0o755, (0, 0)).dir("opt/bench/", 0o755, (0, 0));
    for (i, chunk) in data.chunks(4 << 20).enumerate() {
        layer = layer.file(&format!("opt/bench/blob-{i:04}.bin"), chunk);
    }
    layer.tar()
}

/// Pushes `<addr>/bench/img<mib>:v1` (busybox and the data layer) and
/// `:v2` (the same and a small layer more).
async fn push_images(registry: &Registry, mib: u64) {
    let t = Instant::now();
    let dir = tempfile::tempdir().expect("temp dir");
    let layout = testkit::oci::busybox_layout(dir.path());
    let index: Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).expect("index.json")).expect("index JSON");
    let base = index["manifests"][0].clone();
    let data = add_layer(&layout, &data_layer(mib));
    let repository = format!("bench/img{mib}");
    write_image(&layout, &base, &[&data]);
    registry.push_layout(&layout, &repository, "v1").await;
    let small = Layer::new().dir("etc/", 0o755, (0, 0)).file("etc/bench-v2", b"the second tag\n").tar();
    write_image(&layout, &base, &[&data, &add_layer(&layout, &small)]);
    registry.push_layout(&layout, &repository, "v2").await;
    eprintln!(
        "pushed {}/{repository}:v1 and :v2 ({mib} MiB layer, {} bytes gzip'd) in {:.1} s",
        registry.addr,
        data.1["size"],
        t.elapsed().as_secs_f64()
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _changes = tine_benches::report_changes_at_end("image");
    if !testkit::kvm_available("bench image") {
        return;
    }
    let Some(registry) = Registry::start("bench image") else { return };
    let sizes: Vec<u64> = env_list("IMAGE_BENCH_MIB", "100,500");
    let runs: usize = env_or("IMAGE_BENCH_RUNS", 1);
    let config = format!(
        "[limits]\nboot_timeout_secs = 1200\n[templates]\nbuild_default = false\n\
         [images]\ninsecure_registries = [\"{}\"]\n",
        registry.addr
    );
    let cases = ["cold", "cached", "shared"];
    // results[size][case]: the builds of every run.
    let mut results: Vec<Vec<Vec<Build>>> = Vec::new();
    for &mib in &sizes {
        push_images(&registry, mib).await;
        let mut per_case: Vec<Vec<Build>> = cases.iter().map(|_| Vec::new()).collect();
        for run in 0..runs {
            // A fresh data directory: no layers, no base images.
            let server = TineServer::start(&tine_binary(), None, &config);
            let client = server.client().await;
            let (v1, v2) =
                (format!("{}/bench/img{mib}:v1", registry.addr), format!("{}/bench/img{mib}:v2", registry.addr));
            let name = format!("img{mib}");
            for (case, (template, image)) in
                cases.iter().zip([(&name, &v1), (&name, &v1), (&format!("{name}-v2"), &v2)])
            {
                eprintln!("{mib} MiB, run {run}, {case}: template_create {{ name: {template}, image: {image} }}");
                if *case == "cached" {
                    call(&client, "template_delete", json!({"name": template})).await.expect("template_delete");
                }
                let b = build(&client, template, image).await;
                eprintln!("{mib} MiB, run {run}, {case}: ready in {:.1} s", b.total.as_secs_f64());
                per_case[cases.iter().position(|c| c == case).unwrap()].push(b);
            }
            drop(client);
            drop(server);
        }
        results.push(per_case);
    }

    let secs = |d: Duration| d.as_secs_f64();
    println!();
    println!("An image to a ready template through MCP, median of {runs} run(s), seconds:");
    let mut header = format!("| {:>8} | {:<6} | {:>7} |", "image", "case", "total");
    for p in PHASES {
        header.push_str(&format!(" {p:>11} |"));
    }
    println!("{header}");
    println!("|{}", "---|".repeat(3 + PHASES.len()));
    for (mib, per_case) in sizes.iter().zip(&results) {
        for (case, builds) in cases.iter().zip(per_case) {
            let total = secs(median(&builds.iter().map(|b| b.total).collect::<Vec<_>>()));
            let mut row = format!("| {:>4} MiB | {case:<6} | {total:>7.1} |", mib);
            record("image", &format!("template_from_image.{mib}mib.{case}.total"), total, "s");
            for (k, p) in PHASES.iter().enumerate() {
                let v = secs(median(&builds.iter().map(|b| b.phases[k]).collect::<Vec<_>>()));
                row.push_str(&format!(" {v:>11.1} |"));
                record("image", &format!("template_from_image.{mib}mib.{case}.{}", p.replace(' ', "_")), v, "s");
            }
            println!("{row}");
        }
    }
}
