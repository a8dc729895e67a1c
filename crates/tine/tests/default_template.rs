//! The default template's build at a server's start (a cold boot), end to
//! end: `tine server start` as a subprocess, a real guest and real MCP
//! clients. The first create waits for the build and says so in progress
//! notifications, through rmcp and through the official Python SDK's
//! progress callback (`tests/py/progress.py`, which also makes a sandbox
//! and runs a 3 s exec with progress while the build goes on).
//!
//! The template built here is the one the run's other servers copy
//! (`TineServer::start_cold`) when this test comes first, as
//! `scripts/run-tests.py` has it: the run then builds the default
//! template once.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::mcp::{call, call_with_progress, TineServer};

const CONFIG: &str = "[limits]\nboot_timeout_secs = 1200\nmax_sandboxes = 12\n";

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tine"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_first_create_waits_for_the_default_template_with_progress() {
    if !testkit::kvm_available("the_first_create_waits_for_the_default_template_with_progress") {
        return;
    }
    let (server, shared) = TineServer::start_cold(binary(), None, CONFIG);
    eprintln!("this build is the run's copy of the default template: {}", shared.is_first());
    let (client, recorder) = server.recording_client().await;

    // The official Python SDK's client makes its first sandbox at the same
    // time, with a progress callback; it waits on the same template build,
    // so this costs no boot of its own.
    let sdk = testkit::mcp::python_sdk("the_first_create_waits_for_the_default_template_with_progress").map(|python| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/progress.py");
        let url = server.url.clone();
        tokio::task::spawn_blocking(move || std::process::Command::new(python).arg(script).arg(url).output())
    });

    // The first create waits for the default template the server builds at
    // start, then restores from it; it reports progress while it waits.
    let t = Instant::now();
    let (source, token) = call_with_progress(&client, "sandbox_create", json!({})).await;
    let source = source.expect("create the first sandbox");
    eprintln!("first sandbox_create (default template built meanwhile): {:.1} s", t.elapsed().as_secs_f64());
    assert_eq!(source["template"], "default", "{source}");
    // The notifications come before the result on the request's stream;
    // the client handler may still be recording the last ones.
    let deadline = Instant::now() + Duration::from_secs(5);
    while recorder.progress_for(&token).len() < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let progress = recorder.progress_for(&token);
    assert!(progress.len() >= 2, "progress notifications during a cold create: {progress:?}");
    assert!(progress.windows(2).all(|w| w[0].progress < w[1].progress), "{progress:?}");
    assert!(
        progress.iter().filter_map(|p| p.message.as_deref()).any(|m| m.contains("template") || m.contains("boot")),
        "the messages say what the create waits for: {progress:?}"
    );
    if let Some(sdk) = sdk {
        let out = sdk.await.unwrap().expect("run the Python client");
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        eprintln!("--- progress.py stdout:\n{stdout}\n--- stderr:\n{stderr}");
        assert!(out.status.success() && stdout.lines().last() == Some("PROGRESS OK"), "progress.py: {}", out.status);
    }

    // The run's later servers copy this template instead of building theirs.
    shared.share(&server);
    call(&client, "sandbox_kill", json!({"sandbox_id": source["sandbox_id"]})).await.expect("kill");
}
