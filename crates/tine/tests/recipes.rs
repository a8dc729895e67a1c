//! Templates from a recipe end to end (issue 17): `tine server start` as a
//! subprocess, real guests and a real MCP client. A recipe that writes a
//! file, sets an environment variable and runs setup steps is built,
//! listed while it builds and when ready, and used: a sandbox from it has
//! the files and the environment in exec, a background process and
//! Python (JavaScript's environment: `processes.rs`). A failing step is reported with its output; failed and
//! ready templates are deleted. A recipe that runs `pip install` through
//! the sandbox network is in `packages.rs` (one pip run serves both: it is
//! minutes of guest work here).
//!
//! A template from an OCI image: busybox, pushed to a real
//! `docker-registry` on a loopback port, pulled, made a base image,
//! booted, set up and snapshotted; a sandbox from it runs on that base
//! with the image's `Env`; references that are paths, or name nothing,
//! are refused with a message.
//!
//! Its server's default template is a copy of the one the run's first
//! server built (the recipes reach no registry but the test's own).

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use testkit::mcp::{call, call_with_progress, TineServer};

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tine"))
}

/// The listing of template `name` (the entry with `state`, if several).
async fn listed(client: &rmcp::Peer<rmcp::RoleClient>, name: &str, state: &str) -> Option<Value> {
    let l = call(client, "template_list", json!({})).await.unwrap();
    l["templates"].as_array().unwrap().iter().find(|t| t["name"] == name && t["state"] == state).cloned()
}

async fn stdout_of(client: &rmcp::Peer<rmcp::RoleClient>, sb: &str, command: &str) -> String {
    let x = call(client, "sandbox_exec", json!({"sandbox_id": sb, "command": command})).await.unwrap();
    x["stdout"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn templates_from_recipes() {
    if !testkit::kvm_available("templates_from_recipes") {
        return;
    }
    let registry = testkit::oci::Registry::start("templates_from_recipes");
    let images = match &registry {
        Some(r) => format!("[images]\ninsecure_registries = [\"{}\"]\n", r.addr),
        None => String::new(),
    };
    let server = TineServer::start_with_default_template(
        binary(),
        None,
        &format!("[limits]\nboot_timeout_secs = 1200\n{images}"),
    );
    let (client, rec) = server.recording_client().await;

    // A recipe, built in the background: listed as building, then ready.
    let started = call(
        &client,
        "template_create",
        json!({
            "name": "made-by-recipe",
            "env": {"GREETING": "from-the-recipe"},
            "files": {"/etc/tine-recipe.txt": "written by the recipe\n"},
            "setup": ["echo step-one > /root/step.txt", "echo \"$GREETING\" > /root/greeting.txt && cat /etc/tine-recipe.txt"],
        }),
    )
    .await
    .unwrap();
    assert_eq!(started["state"], "building", "{started}");
    assert!(listed(&client, "made-by-recipe", "building").await.is_some(), "listed while it builds");
    let again = call(&client, "template_create", json!({"name": "made-by-recipe", "setup": ["true"]})).await;
    assert!(again.unwrap_err().contains("is being built"), "a second build of the name is refused");
    let mut ready = None;
    for _ in 0..600 {
        if let Some(t) = listed(&client, "made-by-recipe", "ready").await {
            ready = Some(t);
            break;
        }
        if let Some(t) = listed(&client, "made-by-recipe", "failed").await {
            panic!("the recipe failed: {t}");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let ready = ready.expect("the recipe's template became ready within 10 minutes");
    assert_eq!(ready["memory_mib"], 512, "{ready}");

    // A sandbox from it has the files and the environment everywhere.
    let sb = call(&client, "sandbox_create", json!({"template": "made-by-recipe"})).await.unwrap()["sandbox_id"]
        .as_str()
        .unwrap()
        .to_string();
    let files = "cat /etc/tine-recipe.txt /root/step.txt /root/greeting.txt; echo \"env:$GREETING\"";
    assert_eq!(
        stdout_of(&client, &sb, files).await,
        "written by the recipe\nstep-one\nfrom-the-recipe\nenv:from-the-recipe\n"
    );
    let bg =
        call(&client, "sandbox_exec", json!({"sandbox_id": sb, "command": "echo bg:$GREETING", "background": true}))
            .await
            .unwrap();
    let w = call(
        &client,
        "sandbox_process_wait",
        json!({"process_id": bg["process_id"], "until_text": "bg:", "timeout_secs": 60}),
    )
    .await
    .unwrap();
    assert_eq!(w["matched"]["line"], "bg:from-the-recipe", "{w}");
    let py =
        call(&client, "sandbox_run_python", json!({"sandbox_id": sb, "code": "import os\nos.environ['GREETING']"}))
            .await
            .unwrap();
    assert_eq!(py["result"], "'from-the-recipe'", "{py}");
    // Node gets the same agent-held environment (processes.rs checks the
    // sandbox environment in JavaScript; a first Node start is a minute
    // here, which the template from an image below takes instead).
    call(&client, "sandbox_kill", json!({"sandbox_id": sb})).await.unwrap();

    // A failing step stops the build and is reported with its output.
    let (failed, token) = call_with_progress(
        &client,
        "template_create",
        json!({"name": "broken", "setup": ["echo fine", "echo before-the-error; echo oops >&2; exit 3", "echo never"],
               "wait_secs": 600}),
    )
    .await;
    let failed = failed.unwrap();
    let steps: Vec<String> = rec.progress_for(&token).into_iter().filter_map(|p| p.message).collect();
    assert!(!steps.is_empty(), "a waited build reports progress");
    eprintln!("build progress: {steps:?}");
    assert_eq!(failed["state"], "failed", "{failed}");
    let why = failed["error"].as_str().unwrap();
    for part in ["step 2", "exit code 3", "before-the-error", "oops"] {
        assert!(why.contains(part), "{part:?} missing from {why}");
    }
    assert!(listed(&client, "broken", "failed").await.is_some());
    let e = call(&client, "sandbox_create", json!({"template": "broken"})).await.unwrap_err();
    assert!(e.contains("broken"), "{e}");
    call(&client, "template_delete", json!({"name": "broken"})).await.expect("a failed build's record is deleted");
    assert!(listed(&client, "broken", "failed").await.is_none());

    // Delete the ready one: no sandbox can start from it any more.
    call(&client, "template_delete", json!({"name": "made-by-recipe"})).await.unwrap();
    let e = call(&client, "sandbox_create", json!({"template": "made-by-recipe"})).await.unwrap_err();
    assert!(e.contains("made-by-recipe"), "{e}");

    if let Some(registry) = &registry {
        template_from_an_image(&client, registry).await;
    }
    client.cancel().await.expect("close the session");
}

/// `template_create { image }` against the test's registry.
async fn template_from_an_image(client: &rmcp::Peer<rmcp::RoleClient>, registry: &testkit::oci::Registry) {
    let d = tempfile::tempdir().unwrap();
    registry.push_layout(&testkit::oci::busybox_layout(d.path()), "tools/busybox", "1").await;
    let image = format!("{}/tools/busybox:1", registry.addr);

    for (bad, why) in
        [("/var/lib/tine/images/rootfs.ext4", "give a registry reference"), ("a b", "give a registry reference")]
    {
        let e = call(client, "template_create", json!({"name": "bad-image", "image": bad})).await.unwrap_err();
        assert!(e.contains(why), "{bad}: {e}");
    }
    let e =
        call(client, "template_create", json!({"name": "both", "image": image, "from": "default"})).await.unwrap_err();
    assert!(e.contains("not both"), "{e}");
    let missing = call(
        client,
        "template_create",
        json!({"name": "no-such-image", "image": format!("{}/tools/none:1", registry.addr), "wait_secs": 120}),
    )
    .await
    .unwrap();
    assert_eq!(missing["state"], "failed", "{missing}");
    assert!(missing["error"].as_str().unwrap().contains("pulling the manifest"), "{missing}");
    call(client, "template_delete", json!({"name": "no-such-image"})).await.unwrap();
    // A registry on this host that the operator did not list.
    let private = call(
        client,
        "template_create",
        json!({"name": "private-image", "image": "localhost:9/tools/none:1", "wait_secs": 120}),
    )
    .await
    .unwrap();
    assert_eq!(private["state"], "failed", "{private}");
    assert!(private["error"].as_str().unwrap().contains("private_registries"), "{private}");
    call(client, "template_delete", json!({"name": "private-image"})).await.unwrap();

    let t0 = std::time::Instant::now();
    let built = call(
        client,
        "template_create",
        json!({"name": "from-image", "image": image, "env": {"GREETING": "from-the-recipe"},
               "setup": ["echo \"set up in $(cat /etc/motd)\" > /etc/built"], "wait_secs": 600}),
    )
    .await
    .unwrap();
    assert_eq!(built["state"], "ready", "{built}");
    eprintln!("template from the busybox image: {:.0} s", t0.elapsed().as_secs_f64());
    let sb = call(client, "sandbox_create", json!({"template": "from-image"})).await.unwrap()["sandbox_id"]
        .as_str()
        .unwrap()
        .to_string();
    // The image's files and Env, the recipe's env and setup, Tine's
    // agent: the root is the image's, not Debian's.
    let out = stdout_of(
        client,
        &sb,
        "cat /etc/built /etc/motd; echo \"$PATH $GREETING\"; test -e /usr/bin/python3 || echo no-debian; \
         readlink /bin/sh",
    )
    .await;
    assert_eq!(out, "set up in busybox image\nbusybox image\n/bin from-the-recipe\nno-debian\nbusybox\n");
    // The image's User and WorkingDir (made, as the image lacks it) for
    // exec and background processes; the setup ran as root.
    // The directory made for it is the user's, and so are its output pipes.
    let who = "id -u; id -G; pwd; echo $HOME $USER; stat -c %U /etc/built .; echo by-path > /dev/stdout";
    assert_eq!(
        stdout_of(client, &sb, who).await,
        "1000\n1000 2000\n/home/app/work\n/home/app app\nroot\napp\nby-path\n"
    );
    let bg = call(
        client,
        "sandbox_exec",
        json!({"sandbox_id": sb, "command": "echo bg: $(id -u) $PWD", "background": true}),
    )
    .await
    .unwrap();
    let w = call(client, "sandbox_process_wait", json!({"process_id": bg["process_id"], "until_text": "bg:"})).await;
    assert_eq!(w.unwrap()["matched"]["line"], "bg: 1000 /home/app/work");
    // No Python in the image: the REPL says so.
    let e = call(client, "sandbox_run_code", json!({"sandbox_id": sb, "language": "python", "code": "1"}))
        .await
        .unwrap_err();
    assert!(e.contains("python3 is not installed"), "{e}");
    call(client, "sandbox_kill", json!({"sandbox_id": sb})).await.unwrap();
    call(client, "template_delete", json!({"name": "from-image"})).await.unwrap();
}
