//! The warm pool end to end (issue 18): `tine server start` with
//! `[pool] size = 2` as a subprocess, real guests and a real MCP client.
//! Sandboxes handed out one after another are ready at once, each with
//! fresh entropy (the kernel's and a Python cell's `random`) and the
//! host's clock, distinct from one another (ids, files); the spec's labels
//! and environment apply (which shapes the pool serves is the manager's
//! unit test `only_the_default_shape_is_poolable`); the pool refills and `/healthz` shows its level; pooled
//! sandboxes are not listed. `sandbox_exec { argv }` runs a program
//! without a shell.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use testkit::mcp::{call, TineServer};

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tine"))
}

async fn stdout_of(client: &rmcp::Peer<rmcp::RoleClient>, sb: &str, command: &str) -> String {
    let x = call(client, "sandbox_exec", json!({"sandbox_id": sb, "command": command})).await.unwrap();
    assert_eq!(x["exit_code"], 0, "{command}: {x}");
    x["stdout"].as_str().unwrap().trim().to_string()
}

fn host_unix_secs() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pooled_sandboxes_are_fresh_and_distinct() {
    if !testkit::kvm_available("pooled_sandboxes_are_fresh_and_distinct") {
        return;
    }
    let server = TineServer::start_with_default_template(
        binary(),
        None,
        "[limits]\nboot_timeout_secs = 900\n[pool]\nsize = 2\n",
    );
    server.wait_for_pool(2, Duration::from_secs(600));
    let h = server.healthz();
    assert_eq!(h["pool"], json!({"size": 2, "ready": 2, "filling": false}), "{h}");
    assert_eq!(h["sandboxes"], 0, "pooled sandboxes are not counted as the server's sandboxes: {h}");
    let client = server.client().await;

    // Two creates one after another: both from the pool.
    let mut sandboxes: Vec<Value> = Vec::new();
    for i in 0..2 {
        let info = call(
            &client,
            "sandbox_create",
            json!({"labels": {"n": i.to_string()}, "env": {"POOL_TEST": format!("value-{i}")}}),
        )
        .await
        .unwrap();
        assert_eq!(info["from_pool"], true, "create {i} came from the pool: {info}");
        assert_eq!(info["state"], "running", "{info}");
        assert_eq!(info["template"], "default", "{info}");
        assert_eq!(info["labels"]["n"], i.to_string(), "{info}");
        sandboxes.push(info);
    }
    let ids: Vec<String> = sandboxes.iter().map(|s| s["sandbox_id"].as_str().unwrap().to_string()).collect();
    assert_ne!(ids[0], ids[1]);

    let mut entropy = BTreeSet::new();
    let mut python_random = BTreeSet::new();
    for (i, id) in ids.iter().enumerate() {
        // The spec's environment, in exec and in Python; the guest's clock
        // is the host's (the reseed at hand-out sets it), in the shell
        // (bash's builtin `$EPOCHREALTIME`: no process to start) and in
        // Python.
        let shell = stdout_of(&client, id, "echo \"$POOL_TEST $EPOCHREALTIME\"").await;
        let (value, date) = shell.split_once(' ').unwrap_or_else(|| panic!("{shell}"));
        assert_eq!(value, format!("value-{i}"));
        let date: f64 = date.parse().unwrap_or_else(|e| panic!("$EPOCHREALTIME in {shell}: {e}"));
        assert!((date - host_unix_secs()).abs() < 30.0, "{id}: the shell's clock says {date}");
        let v = call(
            &client,
            "sandbox_run_python",
            json!({"sandbox_id": id, "code": "import os, random, time\n(os.environ['POOL_TEST'], random.getrandbits(64), time.time(), os.urandom(16).hex())"}),
        )
        .await
        .unwrap();
        let value = v["result"].as_str().unwrap_or_default().to_string();
        assert!(value.contains(&format!("'value-{i}'")), "Python sees the environment: {v}");
        let fields: Vec<&str> = value.trim_matches(|c| c == '(' || c == ')').split(", ").collect();
        python_random.insert(fields[1].to_string());
        let guest_secs: f64 = fields[2].parse().unwrap_or_else(|e| panic!("time.time() in {value}: {e}"));
        let skew = (guest_secs - host_unix_secs()).abs();
        assert!(skew < 30.0, "{id}'s clock is {skew:.1} s off the host's");
        // Fresh kernel entropy (getrandom(2), the CRNG behind /dev/urandom):
        // no two sandboxes read the same bytes.
        entropy.insert(fields[3].trim_matches('\'').to_string());
        // Their files are their own.
        call(&client, "sandbox_files_write", json!({"sandbox_id": id, "path": "/root/who", "content": id}))
            .await
            .unwrap();
    }
    assert_eq!(entropy.len(), 2, "each pooled sandbox has its own entropy: {entropy:?}");
    assert_eq!(python_random.len(), 2, "each pooled sandbox's Python random differs: {python_random:?}");
    for id in &ids {
        let r = call(&client, "sandbox_files_read", json!({"sandbox_id": id, "path": "/root/who"})).await.unwrap();
        assert_eq!(r["content"], id.as_str(), "{id} sees only its own file");
    }

    // argv: a program without a shell (no expansion, no quoting), and the
    // errors for both or neither of command and argv.
    let x = call(&client, "sandbox_exec", json!({"sandbox_id": ids[0], "argv": ["printf", "%s|", "a b", "$HOME"]}))
        .await
        .unwrap();
    assert_eq!((x["exit_code"].as_i64(), x["stdout"].as_str()), (Some(0), Some("a b|$HOME|")), "{x}");
    let both = call(&client, "sandbox_exec", json!({"sandbox_id": ids[0], "command": "true", "argv": ["true"]})).await;
    assert!(both.as_ref().is_err_and(|e| e.contains("not both")), "{both:?}");
    let neither = call(&client, "sandbox_exec", json!({"sandbox_id": ids[0]})).await;
    assert!(neither.as_ref().is_err_and(|e| e.contains("give command")), "{neither:?}");
    let missing = call(&client, "sandbox_exec", json!({"sandbox_id": ids[0], "argv": ["no-such-program"]})).await;
    assert!(missing.as_ref().is_err_and(|e| e.contains("no-such-program")), "{missing:?}");

    // Listed: the two handed out, not the pool's.
    let l = call(&client, "sandbox_list", json!({})).await.unwrap();
    let listed: BTreeSet<String> =
        l["sandboxes"].as_array().unwrap().iter().map(|s| s["sandbox_id"].as_str().unwrap().to_string()).collect();
    assert_eq!(listed, ids.iter().cloned().collect::<BTreeSet<_>>(), "{l}");

    // The pool refills behind the hand-outs.
    server.wait_for_pool(2, Duration::from_secs(600));
    let third = call(&client, "sandbox_create", json!({})).await.unwrap();
    assert_eq!(third["from_pool"], true, "{third}");
    let third_id = third["sandbox_id"].as_str().unwrap().to_string();
    assert!(!ids.contains(&third_id));
    let e = call(&client, "sandbox_files_read", json!({"sandbox_id": third_id, "path": "/root/who"})).await;
    assert!(e.as_ref().is_err_and(|e| e.contains("/root/who")), "the third has no file of the others: {e:?}");

    // (Which shapes the pool serves is the manager's unit test
    // `only_the_default_shape_is_poolable`: another shape is a cold boot.)
    for id in ids.iter().chain([&third_id]) {
        call(&client, "sandbox_kill", json!({"sandbox_id": id})).await.unwrap();
    }
    server.wait_for_pool(2, Duration::from_secs(600));
    assert_eq!(server.healthz()["sandboxes"], 0);
}
