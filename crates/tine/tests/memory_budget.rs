//! Memory admission against the real server: `tine server start` with a
//! small guest-memory budget, a real microVM, a real MCP client. Creates
//! and branches beyond the budget fail at once with an error that names
//! the budget and what uses it; the server and the running sandbox go on;
//! a kill gives the memory back.

use std::path::Path;
use std::time::Instant;

use serde_json::json;
use testkit::mcp::{call, TineServer};

const TOKEN: &str = "budget-test-token-0123456789abcdef0123456789abcdef";
/// Room for the loaded default template (512 MiB) and one 512 MiB
/// sandbox, not two, each counted by its size (a headroom past its size;
/// `memory_pressure.rs` and the fake backend's tests cover counting by
/// measured use). The default template is a copy of the one the run's
/// first server built: sandboxes restore from it, no guest boots.
const CONFIG: &str = "[limits]\nboot_timeout_secs = 1200\nmemory_budget_mib = 1280\nmemory_headroom_mib = 8192\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn creates_beyond_the_memory_budget_fail_at_once_and_the_server_stays_up() {
    if !testkit::kvm_available("creates_beyond_the_memory_budget_fail_at_once_and_the_server_stays_up") {
        return;
    }
    let server = TineServer::start_with_default_template(Path::new(env!("CARGO_BIN_EXE_tine")), Some(TOKEN), CONFIG);
    let client = server.client().await;
    let t = Instant::now();
    let a = call(&client, "sandbox_create", json!({})).await.expect("the first create fits");
    let a = a["sandbox_id"].as_str().unwrap().to_string();
    eprintln!("first create (a restore from the default template): {:.1} s", t.elapsed().as_secs_f64());

    let t = Instant::now();
    let e = call(&client, "sandbox_create", json!({})).await.unwrap_err();
    let refused_in = t.elapsed();
    eprintln!("over-budget create refused in {refused_in:?}: {e}");
    assert!(
        e.contains(
            "memory budget 1280 MiB: 1 sandboxes use 512 MiB, 1 templates 512 MiB, 0 branch points 0 MiB; \
             this create needs 512 MiB"
        ),
        "{e}"
    );
    assert!(e.contains("sandbox_kill"), "the error says what to do: {e}");
    let e = call(&client, "sandbox_branch", json!({"sandbox_id": a, "n": 1})).await.unwrap_err();
    assert!(e.contains("memory budget 1280 MiB") && e.contains("this branch needs 1024 MiB"), "{e}");

    // The server and the sandbox go on; nothing was left half-made.
    let health = reqwest::get(format!("{}/healthz", server.base)).await.unwrap();
    assert_eq!(health.status(), 200);
    let list = call(&client, "sandbox_list", json!({})).await.unwrap();
    assert_eq!(list["sandboxes"].as_array().unwrap().len(), 1, "{list}");
    let r = call(&client, "sandbox_exec", json!({"sandbox_id": a, "command": "echo still here"})).await.unwrap();
    assert!(r.to_string().contains("still here"), "{r}");
    let entries = std::fs::read_dir(server.data_dir.join("sandboxes")).unwrap().count();
    assert_eq!(entries, 1, "only the running sandbox has files");

    // A kill gives its 512 MiB back: no sandbox uses any. (A create that
    // does not fit unloads the templates no restore is using, the default
    // one included, and tries again: this one, larger than the budget,
    // does not fit regardless; a 1024 MiB one would now boot a guest.)
    call(&client, "sandbox_kill", json!({"sandbox_id": a})).await.unwrap();
    let e = call(&client, "sandbox_create", json!({"memory_mib": 1536})).await.unwrap_err();
    assert!(e.contains("memory budget 1280 MiB: 0 sandboxes use 0 MiB") && e.contains("needs 1536 MiB"), "{e}");
}
