//! Pulls from a real registry (Debian's docker-registry on a loopback
//! port): a multi-platform image by tag, its platform's manifest by
//! digest, blobs reused from an earlier pull, a missing tag and a blob
//! altered in the registry's storage refused, and the pulled layout built
//! into a base image.

use std::path::Path;

use testkit::oci::*;
use tine_image::registry::{pull, Auth, PullRequest};
use tine_image::{build, BuildRequest, Limits};

async fn pull_into(
    registry: &Registry,
    reference: &str,
    layout: &Path,
) -> Result<tine_image::registry::Pulled, String> {
    let insecure = vec![registry.addr.clone()];
    let mut heard = Vec::new();
    let r = pull(&PullRequest { reference, auth: Auth::Anonymous, insecure: &insecure, layout }, &mut |s| {
        heard.push(s.to_string())
    })
    .await
    .map_err(|e| e.to_string());
    if r.is_ok() {
        assert_eq!(heard.first().map(String::as_str), Some("manifest"), "progress: {heard:?}");
    }
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_are_pulled_checked_and_built() {
    let Some(registry) = Registry::start("images_are_pulled_checked_and_built") else { return };
    let d = tempfile::tempdir().unwrap();
    let amd = [
        Layer::new().file("etc/os", b"base").file("etc/old", b"old").tar(),
        Layer::new().file("etc/.wh.old", b"").file_as("app/run", b"#!/bin/sh\n", 0o755, (1000, 1000)).tar(),
    ];
    let arm = [Layer::new().file("etc/os", b"arm").tar()];
    let src = d.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let a = add_image(&src, &arm, serde_json::json!({}), "arm64");
    let b = add_image(&src, &amd, serde_json::json!({"Env": ["APP=1"], "WorkingDir": "/app", "User": "1000"}), "amd64");
    write_index(&src, vec![a, b]);
    registry.push_layout(&src, "team/app", "1").await;

    let reference = format!("{}/team/app:1", registry.addr);
    let layout = d.path().join("pulled");
    let pulled = pull_into(&registry, &reference, &layout).await.unwrap();
    assert_eq!((pulled.fetched, pulled.reused), (3, 0), "the configuration and two layers: {pulled:?}");
    // Again into the same directory: nothing fetched.
    let again = pull_into(&registry, &reference, &layout).await.unwrap();
    assert_eq!((again.fetched, again.reused), (0, 3), "{again:?}");
    assert_eq!(again.digest, pulled.digest);

    let agent = d.path().join("agent-input");
    std::fs::write(&agent, b"agent").unwrap();
    let out = d.path().join("base.ext4");
    let built = build(
        &BuildRequest {
            image: &layout,
            reference: Some(&reference),
            agent: &agent,
            out: &out,
            work: d.path(),
            limits: Limits::default(),
        },
        &mut |_| {},
    )
    .unwrap();
    fsck_clean(&out);
    assert_eq!(debugfs(&out, "cat /etc/os"), "base", "the amd64 image, not arm64");
    assert!(debugfs(&out, "stat /etc/old").is_empty(), "the upper layer's whiteout applied");
    assert_eq!(stat(&out, "/app/run"), ("regular".into(), "0755".into(), 1000, 1000));
    assert_eq!(built.run.user.as_deref(), Some("1000"));
    assert_eq!(built.run.working_dir.as_deref(), Some("/app"));

    // Errors say what failed.
    let e = pull_into(&registry, &format!("{}/team/app:2", registry.addr), &d.path().join("none")).await.unwrap_err();
    assert!(e.contains("team/app:2") && e.contains("manifest"), "{e}");
    let e = pull_into(&registry, "not a reference!", &d.path().join("none")).await.unwrap_err();
    assert!(e.contains("not an image reference"), "{e}");

    // A layer altered in the registry's storage: the pull refuses it.
    let layer_digest = {
        let manifest: serde_json::Value = serde_json::from_str(&{
            let index: serde_json::Value =
                serde_json::from_slice(&std::fs::read(src.join("index.json")).unwrap()).unwrap();
            let m = index["manifests"][1]["digest"].as_str().unwrap().trim_start_matches("sha256:").to_string();
            String::from_utf8(std::fs::read(src.join("blobs/sha256").join(m)).unwrap()).unwrap()
        })
        .unwrap();
        manifest["layers"][1]["digest"].as_str().unwrap().trim_start_matches("sha256:").to_string()
    };
    let stored = registry
        .storage
        .join("docker/registry/v2/blobs/sha256")
        .join(&layer_digest[..2])
        .join(&layer_digest)
        .join("data");
    let mut bytes = std::fs::read(&stored).unwrap();
    bytes[5] ^= 0xff;
    std::fs::write(&stored, &bytes).unwrap();
    let e = pull_into(&registry, &reference, &d.path().join("fresh")).await.unwrap_err();
    assert!(e.contains(&layer_digest) && e.to_lowercase().contains("digest"), "{e}");
}
