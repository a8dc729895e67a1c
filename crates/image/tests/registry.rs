//! Pulls from a real registry (Debian's docker-registry on a loopback
//! port): a multi-platform image by tag, its platform's manifest by
//! digest, blobs reused from an earlier pull, a missing tag and a blob
//! altered in the registry's storage refused, and the pulled layout built
//! into a base image. Then from a fake registry (a small HTTP server on
//! loopback that records every request) that names a token service or
//! redirects blobs to another port, answers errors with text, declares
//! huge layers or sends more than it declares: what the pull reaches,
//! reads and stages is bounded.

use std::path::Path;
use std::sync::{Arc, Mutex};

use testkit::oci::*;
use tine_image::registry::{pull, pull_staged, Auth, HostPolicy, PullLimits, PullRequest, RegistryError};
use tine_image::{build, BuildRequest, Limits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn pull_into(
    registry: &Registry,
    reference: &str,
    layout: &Path,
) -> Result<tine_image::registry::Pulled, String> {
    let insecure = vec![registry.addr.clone()];
    let mut heard = Vec::new();
    let hosts = HostPolicy::default();
    let r = pull(
        &PullRequest {
            reference,
            auth: Auth::Anonymous,
            insecure: &insecure,
            layout,
            hosts: &hosts,
            limits: PullLimits::default(),
        },
        &mut |s| heard.push(s.to_string()),
    )
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

/// One request a [`Fake`] server took.
#[derive(Clone, Debug)]
struct Seen {
    /// The path and query.
    path: String,
    /// Its `Authorization` header.
    auth: Option<String>,
}

/// An answer of a [`Fake`] server.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Sent with `Content-Length` (else the body ends with the connection).
    length: bool,
}

impl Answer {
    fn ok(body: &[u8]) -> Answer {
        Answer { status: 200, headers: vec![], body: body.to_vec(), length: true }
    }
    fn status(status: u16, headers: &[(&str, &str)], body: &[u8]) -> Answer {
        Answer {
            status,
            headers: headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            body: body.to_vec(),
            length: true,
        }
    }
}

type Handler = Arc<dyn Fn(&Seen) -> Answer + Send + Sync>;

/// A tiny HTTP/1.1 server on a loopback port: one request per connection,
/// each recorded, answered by its handler.
struct Fake {
    /// `127.0.0.1:<port>`.
    addr: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    handler: Arc<Mutex<Handler>>,
}

impl Fake {
    async fn start() -> Fake {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let handler: Arc<Mutex<Handler>> = Arc::new(Mutex::new(Arc::new(|_: &Seen| Answer::status(404, &[], b""))));
        let (s, h) = (seen.clone(), handler.clone());
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (s, h) = (s.clone(), h.lock().unwrap().clone());
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65536 {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let text = String::from_utf8_lossy(&head).to_string();
                    let path = text.split_whitespace().nth(1).unwrap_or("").to_string();
                    let auth = text
                        .lines()
                        .find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("authorization")))
                        .map(|(_, v)| v.trim().to_string());
                    let request = Seen { path, auth };
                    s.lock().unwrap().push(request.clone());
                    let a = h(&request);
                    let mut out = format!("HTTP/1.1 {} X\r\nConnection: close\r\n", a.status);
                    if a.length {
                        out.push_str(&format!("Content-Length: {}\r\n", a.body.len()));
                    }
                    for (k, v) in &a.headers {
                        out.push_str(&format!("{k}: {v}\r\n"));
                    }
                    out.push_str("\r\n");
                    let _ = conn.write_all(out.as_bytes()).await;
                    let _ = conn.write_all(&a.body).await;
                    let _ = conn.shutdown().await;
                });
            }
        });
        Fake { addr, seen, handler }
    }

    fn answer(&self, f: impl Fn(&Seen) -> Answer + Send + Sync + 'static) {
        *self.handler.lock().unwrap() = Arc::new(f);
        self.seen.lock().unwrap().clear();
    }

    fn clear(&self) {
        self.seen.lock().unwrap().clear();
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// A one-layer image as a registry serves it: manifest, configuration,
/// layer and their digests.
struct Image {
    manifest: Vec<u8>,
    config: Vec<u8>,
    config_digest: String,
    layer: Vec<u8>,
    layer_digest: String,
}

/// The image, its manifest declaring `layer_size` for its layer (its
/// true size when `None`) and carrying `padding` bytes of annotation.
fn image(layer_size: Option<u64>, padding: usize) -> Image {
    let layer = Layer::new().file("etc/os", b"fake").tar();
    let layer_digest = sha256(&layer);
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]}, "config": {},
    }))
    .unwrap();
    let config_digest = sha256(&config);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest,
                    "size": layer_size.unwrap_or(layer.len() as u64)}],
        "annotations": {"padding": "x".repeat(padding)},
    }))
    .unwrap();
    Image { manifest, config, config_digest, layer, layer_digest }
}

/// Answers the image's manifest, configuration and layer at `team/app:1`
/// (the layer through `layer`, which may redirect or misbehave); the
/// manifest only to `Bearer good` when `token_realm` is given (a `401`
/// naming it otherwise).
fn registry_answers(
    img: &Image,
    token_realm: Option<String>,
    layer: impl Fn(&Seen, &Image) -> Answer + Send + Sync + 'static,
) -> impl Fn(&Seen) -> Answer + Send + Sync + 'static {
    let img = Image {
        manifest: img.manifest.clone(),
        config: img.config.clone(),
        config_digest: img.config_digest.clone(),
        layer: img.layer.clone(),
        layer_digest: img.layer_digest.clone(),
    };
    move |r: &Seen| {
        if let Some(realm) = &token_realm {
            if r.auth.as_deref() != Some("Bearer good") {
                let challenge = format!("Bearer realm=\"{realm}\",service=\"fake\"");
                return Answer::status(401, &[("WWW-Authenticate", challenge.as_str())], b"{}");
            }
        }
        if r.path == "/v2/team/app/manifests/1" {
            Answer::status(200, &[("Content-Type", "application/vnd.oci.image.manifest.v1+json")], &img.manifest)
        } else if r.path == format!("/v2/team/app/blobs/{}", img.config_digest) {
            Answer::ok(&img.config)
        } else if r.path == format!("/v2/team/app/blobs/{}", img.layer_digest) {
            layer(r, &img)
        } else {
            Answer::status(404, &[], b"")
        }
    }
}

/// Pulls `reg`'s `team/app:1` into `layout` (both fakes spoken to over
/// plain HTTP) with `hosts` and `limits`.
async fn fake_pull(
    reg: &Fake,
    other: &Fake,
    hosts: &HostPolicy,
    limits: PullLimits,
    auth: Auth,
    layout: &Path,
) -> Result<tine_image::registry::Pulled, RegistryError> {
    let reference = format!("{}/team/app:1", reg.addr);
    let insecure = vec![reg.addr.clone(), other.addr.clone(), other.addr.replace("127.0.0.1", "localhost")];
    pull(&PullRequest { reference: &reference, auth, insecure: &insecure, layout, hosts, limits }, &mut |_| {}).await
}

/// A judge that refuses loopback addresses, as the server's does.
fn no_loopback() -> HostPolicy {
    HostPolicy {
        refuse_address: Some(Arc::new(|ip: std::net::IpAddr| ip.is_loopback().then(|| "loopback".to_string()))),
        ..HostPolicy::default()
    }
}

/// A token realm or a redirect naming another port (another host, to the
/// pull) is refused unless the operator allows that host, and nothing is
/// sent there; allowed, the token service's token is used and the
/// redirect is followed without the registry's credentials. An allowed
/// host on a refused address (an IP literal, or a name resolving to
/// one) is refused too unless the operator lists it as private.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_realms_and_redirects_reach_only_allowed_hosts() {
    let reg = Fake::start().await;
    let other = Fake::start().await;
    other.answer(|r: &Seen| {
        if r.path.starts_with("/token") {
            Answer::ok(br#"{"token":"good"}"#)
        } else {
            Answer::ok(&image(None, 0).layer)
        }
    });
    let d = tempfile::tempdir().unwrap();
    let img = image(None, 0);
    let direct = |_: &Seen, img: &Image| Answer::ok(&img.layer);
    let allowed = HostPolicy { allowed_hosts: vec![other.addr.clone()], ..HostPolicy::default() };

    // A token realm on the other port.
    let realm = format!("http://{}/token", other.addr);
    reg.answer(registry_answers(&img, Some(realm.clone()), direct));
    let e =
        fake_pull(&reg, &other, &HostPolicy::default(), PullLimits::default(), Auth::Anonymous, &d.path().join("a"))
            .await
            .unwrap_err();
    assert!(matches!(e, RegistryError::Refused { .. }), "{e}");
    let e = e.to_string();
    assert!(e.contains(&other.addr) && e.contains("allowed_hosts") && e.contains("token service"), "{e}");
    assert!(other.seen().is_empty(), "the token service was asked: {:?}", other.seen());
    // Allowed: the token is fetched and used.
    reg.answer(registry_answers(&img, Some(realm.clone()), direct));
    let pulled =
        fake_pull(&reg, &other, &allowed, PullLimits::default(), Auth::Anonymous, &d.path().join("b")).await.unwrap();
    assert_eq!(pulled.fetched, 2);
    let asked = other.seen();
    assert!(asked.len() == 1 && asked[0].path.starts_with("/token?"), "{asked:?}");
    assert!(asked[0].path.contains("scope=repository%3Ateam%2Fapp%3Apull"), "{asked:?}");
    assert!(reg.seen().iter().any(|r| r.auth.as_deref() == Some("Bearer good")));

    // A blob redirected to the other port.
    other.answer(|_: &Seen| Answer::ok(&image(None, 0).layer));
    let to = format!("http://{}/storage/layer", other.addr);
    reg.answer(registry_answers(&img, None, move |_, _| Answer::status(307, &[("Location", to.as_str())], b"")));
    let e =
        fake_pull(&reg, &other, &HostPolicy::default(), PullLimits::default(), Auth::Anonymous, &d.path().join("c"))
            .await
            .unwrap_err();
    assert!(matches!(e, RegistryError::Refused { .. }), "{e}");
    let e = e.to_string();
    assert!(e.contains(&other.addr) && e.contains(&img.layer_digest) && e.contains("allowed_hosts"), "{e}");
    assert!(other.seen().is_empty(), "the redirect was followed: {:?}", other.seen());
    // Allowed: followed, the registry's credentials not sent along.
    reg.clear();
    let pulled = fake_pull(
        &reg,
        &other,
        &allowed,
        PullLimits::default(),
        Auth::Bearer("registry-secret".into()),
        &d.path().join("d"),
    )
    .await
    .unwrap();
    assert_eq!(pulled.fetched, 2);
    let asked = other.seen();
    assert!(asked.len() == 1 && asked[0].path == "/storage/layer" && asked[0].auth.is_none(), "{asked:?}");
    assert!(reg.seen().iter().all(|r| r.auth.as_deref() == Some("Bearer registry-secret")));

    // Allowed hosts on loopback, with a judge refusing loopback (the
    // registry itself listed as private): an IP literal, then a name.
    let judged = |allowed: &str| HostPolicy {
        allowed_hosts: vec![allowed.to_string()],
        private_hosts: vec![reg.addr.clone()],
        ..no_loopback()
    };
    for (realm_host, says) in
        [(other.addr.clone(), "127.0.0.1 is loopback"), (other.addr.replace("127.0.0.1", "localhost"), "resolves to")]
    {
        let realm = format!("http://{realm_host}/token");
        reg.answer(registry_answers(&img, Some(realm), direct));
        other.answer(|_: &Seen| Answer::ok(br#"{"token":"good"}"#));
        let e =
            fake_pull(&reg, &other, &judged(&realm_host), PullLimits::default(), Auth::Anonymous, &d.path().join("e"))
                .await
                .unwrap_err()
                .to_string();
        assert!(e.contains(says) && e.contains("loopback") && e.contains("private_registries"), "{realm_host}: {e}");
        assert!(other.seen().is_empty(), "{realm_host}: {:?}", other.seen());
    }
    // The registry itself on loopback, not listed as private: nothing sent.
    reg.answer(registry_answers(&img, None, direct));
    let e = fake_pull(&reg, &other, &no_loopback(), PullLimits::default(), Auth::Anonymous, &d.path().join("f"))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("loopback"), "{e}");
    assert!(reg.seen().is_empty(), "{:?}", reg.seen());
}

/// An error answer comes back as its status: the registry's text (which
/// could be anything it fetched) is not passed on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_answers_are_a_status_only() {
    let reg = Fake::start().await;
    let other = Fake::start().await;
    let d = tempfile::tempdir().unwrap();
    reg.answer(|_: &Seen| Answer::status(403, &[], b"SECRET-INTERNAL-ANSWER ".repeat(100).as_slice()));
    let e = fake_pull(&reg, &other, &HostPolicy::default(), PullLimits::default(), Auth::Anonymous, d.path())
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("HTTP 403") && e.contains("the manifest"), "{e}");
    assert!(!e.contains("SECRET"), "{e}");
}

/// Sizes are bounded: a manifest larger than the document limit, a
/// layer declared larger than the blob limit (refused before any blob
/// is asked for), a blob longer than its manifest declares (with and
/// without `Content-Length`: cut off, no partial file left); a staged
/// pull's directory is gone after a failed pull, and after its build.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sizes_are_checked_before_and_while_fetching() {
    let reg = Fake::start().await;
    let other = Fake::start().await;
    let d = tempfile::tempdir().unwrap();
    let hosts = HostPolicy::default();
    let direct = |_: &Seen, img: &Image| Answer::ok(&img.layer);
    let blob_asked = |reg: &Fake| reg.seen().iter().any(|r| r.path.contains("/blobs/"));
    let partials = |layout: &Path| {
        std::fs::read_dir(layout.join("blobs/sha256"))
            .map(|d| d.filter_map(Result::ok).filter(|e| e.file_name().to_string_lossy().contains("partial")).count())
            .unwrap_or(0)
    };

    // A manifest past max_document_bytes.
    reg.answer(registry_answers(&image(None, 8192), None, direct));
    let limits = PullLimits { max_document_bytes: 4096, ..PullLimits::default() };
    let e = fake_pull(&reg, &other, &hosts, limits, Auth::Anonymous, &d.path().join("a")).await.unwrap_err();
    assert!(matches!(e, RegistryError::TooLarge { which: "max_document_bytes", .. }), "{e}");

    // A 64 GiB layer: refused before staging.
    let huge = image(Some(64 << 30), 0);
    reg.answer(registry_answers(&huge, None, direct));
    let layout = d.path().join("b");
    let e = fake_pull(&reg, &other, &hosts, PullLimits::default(), Auth::Anonymous, &layout).await.unwrap_err();
    assert!(matches!(e, RegistryError::TooLarge { size, which: "max_blob_bytes", .. } if size == 64 << 30), "{e}");
    assert!(e.to_string().contains(&huge.layer_digest), "{e}");
    assert!(!blob_asked(&reg), "a blob was asked for: {:?}", reg.seen());
    // The total too.
    let limits = PullLimits { max_total_bytes: 1000, ..PullLimits::default() };
    let img = image(None, 0);
    reg.answer(registry_answers(&img, None, direct));
    let e = fake_pull(&reg, &other, &hosts, limits, Auth::Anonymous, &layout).await.unwrap_err();
    assert!(matches!(e, RegistryError::TooLarge { which: "max_total_bytes", .. }), "{e}");
    assert!(!blob_asked(&reg), "a blob was asked for: {:?}", reg.seen());

    // A layer longer than declared, with Content-Length and without.
    for length in [true, false] {
        reg.answer(registry_answers(&img, None, move |_, img| {
            let mut body = img.layer.clone();
            body.extend_from_slice(&[0u8; 4096]);
            Answer { status: 200, headers: vec![], body, length }
        }));
        let layout = d.path().join(format!("c{length}"));
        let e = fake_pull(&reg, &other, &hosts, PullLimits::default(), Auth::Anonymous, &layout).await.unwrap_err();
        let e = e.to_string();
        assert!(e.contains(&img.layer_digest) && e.contains("bytes or more"), "{length}: {e}");
        assert_eq!(partials(&layout), 0, "{length}");
        assert!(!layout.join("blobs/sha256").join(img.layer_digest.trim_start_matches("sha256:")).exists());
    }

    // Staged: gone after a failed pull; after a good one, when dropped.
    let layout = d.path().join("staged");
    let reference = format!("{}/team/app:1", reg.addr);
    let insecure = vec![reg.addr.clone()];
    let request = PullRequest {
        reference: &reference,
        auth: Auth::Anonymous,
        insecure: &insecure,
        layout: &layout,
        hosts: &hosts,
        limits: PullLimits::default(),
    };
    reg.answer(registry_answers(&img, None, |_, _| Answer::status(500, &[], b"")));
    let e = pull_staged(&request, &mut |_| {}).await.unwrap_err().to_string();
    assert!(e.contains("HTTP 500"), "{e}");
    assert!(!layout.exists(), "the failed pull's layout is left");
    reg.answer(registry_answers(&img, None, direct));
    let staged = pull_staged(&request, &mut |_| {}).await.unwrap();
    assert_eq!(staged.pulled.fetched, 2);
    assert!(staged.layout().join("index.json").exists());
    drop(staged);
    assert!(!layout.exists(), "the staged layout is left after its build");
}
