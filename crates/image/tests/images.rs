//! Images to base images: layers applied as a runtime would (whiteouts,
//! opaque directories, links), hostile layers refused or kept inside
//! the image, digests checked, every source format read, and ext4 images
//! whose owners, modes, devices and attributes are the headers', built by
//! root and by an unprivileged user. No KVM: the images are read back
//! with debugfs and checked with e2fsck (the boot of an image is the
//! template tests').

use std::path::{Path, PathBuf};

use testkit::oci::*;
use tine_image::layers::LayerError;
use tine_image::{build, BuildRequest, ImageError, Limits, Node, Tree};

fn tree(dir: &Path, layers: &[Vec<u8>], limits: Limits) -> Result<Tree, LayerError> {
    let mut t = Tree::new(&dir.join("staging"), limits)?;
    for (i, l) in layers.iter().enumerate() {
        t.apply_tar(i, &mut l.as_slice())?;
    }
    Ok(t)
}

fn content(t: &Tree, path: &str) -> Vec<u8> {
    match t.get(path) {
        Some(Node::File(id)) => std::fs::read(&t.file(*id).staged).unwrap(),
        other => panic!("{path}: {other:?}"),
    }
}

/// A file standing in for the guest agent: the tests check where it is
/// installed and with what mode, not that it runs.
fn agent(dir: &Path) -> PathBuf {
    let p = dir.join("agent-input");
    std::fs::write(&p, b"\x7fELF stand-in for the static agent").unwrap();
    p
}

fn build_image(dir: &Path, image: &Path, reference: Option<&str>) -> Result<tine_image::Built, ImageError> {
    let agent = agent(dir);
    let out = dir.join("base.ext4");
    build(
        &BuildRequest {
            image,
            reference,
            agent: &agent,
            out: &out,
            work: &dir.join("work"),
            limits: Limits::default(),
        },
        &mut |_| {},
    )
}

#[test]
fn whiteouts_opaque_directories_and_links_apply_as_a_runtime_does() {
    let d = tempfile::tempdir().unwrap();
    let l0 = Layer::new()
        .dir("etc/", 0o755, (0, 0))
        .file("etc/keep", b"lower")
        .file("etc/gone", b"lower")
        .file("usr/lib/a", b"a")
        .file("opt/d/x", b"x")
        .file("opt/d/sub/y", b"y")
        .file_as("bin/sh", b"shell", 0o755, (0, 0))
        .hardlink("bin/sh2", "bin/sh")
        .symlink("lib", "usr/lib", (0, 0))
        .file("data/old", b"old")
        .file("srv/old", b"old")
        .tar();
    let l1 = Layer::new()
        .file("etc/.wh.gone", b"")
        .file("opt/d/new", b"new")
        .file("opt/d/.wh..wh..opq", b"")
        .file("lib/c", b"through the link")
        .file("bin/.wh.sh", b"")
        .file("data/z", b"same layer")
        .file("data/.wh.z", b"")
        .dir("etc/", 0o700, (0, 0))
        // A whiteout of a directory this layer also writes into: the
        // lower files go, this layer's stay (OCI layer.md).
        .file("srv/new", b"new")
        .file(".wh.srv", b"")
        // Markers twice: applied once.
        .file("opt/d/.wh..wh..opq", b"")
        .pax(true, &[("comment", b"a global header, skipped")])
        .pax(false, &[("path", b"pax/long/name"), ("uid", b"4242"), ("mtime", b"1700000000.5")])
        .file("short", b"named by PAX")
        .file_mtime("future", b"far", u64::MAX / 2)
        .tar();
    let t = tree(d.path(), &[l0, l1], Limits::default()).unwrap();
    assert_eq!(content(&t, "srv/new"), b"new");
    assert!(t.get("srv/old").is_none(), "the whiteout hid the lower file under the directory");
    assert_eq!(content(&t, "pax/long/name"), b"named by PAX");
    assert!(t.get("short").is_none());
    match t.get("pax/long/name") {
        Some(Node::File(id)) => assert_eq!((t.file(*id).meta.uid, t.file(*id).meta.mtime), (4242, 1_700_000_000)),
        other => panic!("{other:?}"),
    }
    assert_eq!(content(&t, "etc/keep"), b"lower");
    assert!(t.get("etc/gone").is_none(), "a whiteout deletes the lower file");
    assert!(
        matches!(t.get("etc"), Some(Node::Dir(m)) if m.mode == 0o700),
        "a directory over a directory takes its metadata"
    );
    assert!(
        t.get("opt/d/x").is_none() && t.get("opt/d/sub/y").is_none() && t.get("opt/d/sub").is_none(),
        "opaque hides the lower children"
    );
    assert_eq!(content(&t, "opt/d/new"), b"new", "opaque does not hide its own layer's files");
    assert_eq!(content(&t, "usr/lib/c"), b"through the link", "a symlinked parent is followed inside the tree");
    assert!(matches!(t.get("lib"), Some(Node::Symlink { .. })));
    assert!(t.get("bin/sh").is_none());
    assert_eq!(content(&t, "bin/sh2"), b"shell", "a hard link keeps the file when its other name goes");
    assert_eq!(content(&t, "data/z"), b"same layer", "a whiteout does not hide its own layer's file");
    assert_eq!(content(&t, "data/old"), b"old");
}

#[test]
fn hostile_layers_are_refused_or_stay_inside_the_image() {
    let d = tempfile::tempdir().unwrap();
    let refused = |name: &str, layer: Vec<u8>, want: &str| {
        let e =
            tree(&d.path().join(name), &[layer], Limits::default()).err().unwrap_or_else(|| panic!("{name}: applied"));
        assert!(e.to_string().contains(want), "{name}: {e}");
    };
    refused("dotdot", Layer::new().raw_file(b"../etc/passwd", b"x").tar(), "leaves the image's root");
    refused("dotdot-inner", Layer::new().raw_file(b"a/../../x", b"x").tar(), "leaves the image's root");
    refused("through-a-file", Layer::new().file("f", b"f").file("f/x", b"x").tar(), "is not a directory");
    refused("dangling-hardlink", Layer::new().hardlink("x", "nowhere").tar(), "which no layer so far has made");
    refused("whiteout-dotdot", Layer::new().file("tmp/.wh...", b"").tar(), "a whiteout of no name");
    refused(
        "huge-pax",
        Layer::new().pax(false, &[("comment", &vec![b'x'; 2 << 20])]).file("a", b"a").tar(),
        "a PAX extended header (bytes) is over",
    );
    refused("deep", Layer::new().long_file(&format!("{}f", "d/".repeat(300)), b"x").tar(), "components");
    refused("hardlink-escape", Layer::new().hardlink("x", "../../etc/shadow").tar(), "leaves the image's root");
    refused(
        "symlink-loop",
        Layer::new().symlink("a", "b", (0, 0)).symlink("b", "a", (0, 0)).file("a/x", b"x").tar(),
        "symbolic links along its path",
    );
    let e = tree(
        &d.path().join("entries"),
        &[(0..20).fold(Layer::new(), |l, i| l.file(&format!("f{i}"), b"x")).tar()],
        Limits { max_entries: 10, ..Limits::default() },
    )
    .err()
    .unwrap();
    assert!(matches!(e, LayerError::Limit { .. }), "{e}");
    let e = tree(
        &d.path().join("bytes"),
        &[Layer::new().file("a", &[1; 3000]).file("b", &[2; 3000]).tar()],
        Limits { max_file_bytes: 5000, ..Limits::default() },
    )
    .err()
    .unwrap();
    assert!(matches!(e, LayerError::Limit { .. }), "{e}");

    // Links that point out of the root resolve inside it: an absolute
    // path and a path climbing above "/" both land in the image's /etc.
    let t = tree(
        &d.path().join("escape"),
        &[Layer::new()
            .symlink("up", "../../../../../../etc", (0, 0))
            .symlink("abs", "/etc", (0, 0))
            .file("up/passwd", b"image passwd")
            .file("abs/shadow", b"image shadow")
            .long_file(&format!("deep/{}/leaf", "n".repeat(150)), b"long name")
            .tar()],
        Limits::default(),
    )
    .unwrap();
    assert_eq!(content(&t, "etc/passwd"), b"image passwd");
    assert_eq!(content(&t, "etc/shadow"), b"image shadow");
    assert_eq!(content(&t, &format!("deep/{}/leaf", "n".repeat(150))), b"long name");
    for (path, _) in t.nodes() {
        assert!(!path.starts_with(b"/") && !path.split(|b| *b == b'/').any(|c| c == b".."), "{path:?}");
    }
}

#[test]
fn base_image_has_the_headers_owners_modes_devices_and_attributes() {
    let d = tempfile::tempdir().unwrap();
    let base = Layer::new()
        .dir("usr/", 0o755, (0, 0))
        .dir("usr/bin/", 0o755, (0, 0))
        .symlink("bin", "usr/bin", (0, 0))
        .file_as("usr/bin/su", b"setuid", 0o4755, (0, 0))
        .dir("home/", 0o755, (0, 0))
        .dir("home/app/", 0o700, (1000, 1000))
        .file_as("home/app/secret", b"mine", 0o600, (1000, 1000))
        .symlink("home/app/link", "secret", (1000, 1000))
        .hardlink("home/app/same", "home/app/secret")
        .dir("var/", 0o755, (0, 0))
        .dir("var/shared/", 0o2775, (0, 50))
        .dir("tmp/", 0o1777, (0, 0))
        .device("dev/null", tar::EntryType::Char, (1, 3), 0o666)
        .device("dev/loop0", tar::EntryType::Block, (7, 0), 0o660)
        .device("run/pipe", tar::EntryType::Fifo, (0, 0), 0o600)
        .file_xattrs(
            "usr/bin/ping",
            b"ping",
            &[
                ("user.tine", b"hello"),
                (
                    "security.capability",
                    b"\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00",
                ),
            ],
        )
        .file("etc/resolv.conf", b"nameserver 192.0.2.1\n")
        .tar();
    let top = Layer::new().file("bin/added", b"via /bin").file("etc/.wh.hostname", b"").tar();
    let config = serde_json::json!({
        "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "APP=1"],
        "WorkingDir": "/home/app",
        "User": "1000:1000",
        "Entrypoint": ["/usr/bin/su"],
        "Cmd": ["-c", "true"],
    });
    let layout = layout(&d.path().join("layout"), &[base, top], config);
    let built = build_image(d.path(), &layout, None).unwrap();
    let img = d.path().join("base.ext4");
    fsck_clean(&img);

    assert_eq!(built.layers, 2);
    assert_eq!(built.run.env, vec!["PATH=/usr/local/bin:/usr/bin:/bin".to_string(), "APP=1".into()]);
    assert_eq!(built.run.working_dir.as_deref(), Some("/home/app"));
    assert_eq!(built.run.user.as_deref(), Some("1000:1000"));
    assert_eq!(built.run.entrypoint, vec!["/usr/bin/su".to_string()]);

    assert_eq!(stat(&img, "/usr/bin/su"), ("regular".into(), "04755".into(), 0, 0));
    assert_eq!(stat(&img, "/home/app"), ("directory".into(), "0700".into(), 1000, 1000));
    assert_eq!(stat(&img, "/home/app/secret"), ("regular".into(), "0600".into(), 1000, 1000));
    assert_eq!(stat(&img, "/home/app/link").0, "symlink");
    assert_eq!(stat(&img, "/home/app/link").2, 1000);
    assert_eq!(stat(&img, "/var/shared"), ("directory".into(), "02775".into(), 0, 50));
    assert_eq!(stat(&img, "/tmp"), ("directory".into(), "01777".into(), 0, 0));
    assert_eq!(stat(&img, "/dev/null"), ("character".into(), "0666".into(), 0, 0));
    assert!(
        debugfs(&img, "stat /dev/null").contains("Device major/minor number: 01:03"),
        "{}",
        debugfs(&img, "stat /dev/null")
    );
    assert_eq!(stat(&img, "/dev/loop0"), ("block".into(), "0660".into(), 0, 0));
    assert_eq!(stat(&img, "/run/pipe"), ("FIFO".into(), "0600".into(), 0, 0));
    let links = debugfs(&img, "stat /home/app/same");
    assert!(links.contains("Links: 2"), "hard link: {links}");
    let attrs = debugfs(&img, "ea_list /usr/bin/ping");
    assert!(attrs.contains("user.tine (5) = \"hello\"") && attrs.contains("security.capability (20)"), "{attrs}");
    assert_eq!(debugfs(&img, "cat /usr/bin/added"), "via /bin");
    assert!(debugfs(&img, "stat /bin").contains("Type: symlink"), "the image's /bin link is kept");

    // Tine's files: the agent as init, the mount points, the network's.
    assert_eq!(stat(&img, tine_image::AGENT_PATH), ("regular".into(), "0755".into(), 0, 0));
    assert!(debugfs(&img, &format!("cat {}", tine_image::AGENT_PATH)).starts_with("\x7fELF"));
    for (dir, _) in tine_image::MOUNT_POINTS {
        assert_eq!(stat(&img, &format!("/{dir}")).0, "directory", "/{dir}");
    }
    assert_eq!(debugfs(&img, "cat /etc/resolv.conf"), tine_image::RESOLV_CONF);
    assert_eq!(debugfs(&img, "cat /etc/hostname"), "tine\n");
    assert!(built.written.debugfs_commands > 0);
}

#[test]
fn every_blob_is_checked_against_its_digest() {
    let d = tempfile::tempdir().unwrap();
    let layers = [Layer::new().file("a", b"original bytes").tar()];
    let dir = layout(&d.path().join("layout"), &layers, serde_json::json!({}));
    // One byte of the layer blob changed, same size.
    let blobs: Vec<PathBuf> = std::fs::read_dir(dir.join("blobs/sha256")).unwrap().map(|e| e.unwrap().path()).collect();
    let layer_blob = blobs.iter().find(|p| std::fs::read(p).unwrap().starts_with(&[0x1f, 0x8b])).unwrap();
    let mut bytes = std::fs::read(layer_blob).unwrap();
    bytes[5] ^= 0xff; // the gzip header's MTIME: decompression still works
    std::fs::write(layer_blob, &bytes).unwrap();
    let e = build_image(d.path(), &dir, None).unwrap_err().to_string();
    assert!(e.contains("layer 0: blob digest is sha256:"), "{e}");
    assert!(!d.path().join("base.ext4").exists(), "no image from a corrupt layer");
    // A byte of the compressed data: the decoder stops it first.
    let n = bytes.len();
    bytes[n - 12] ^= 0xff;
    std::fs::write(layer_blob, &bytes).unwrap();
    let e = build_image(d.path(), &dir, None).unwrap_err().to_string();
    assert!(e.contains("layer 0") && e.contains("corrupt"), "{e}");

    // A configuration whose diff_id does not match the layer.
    let dir2 = d.path().join("layout2");
    std::fs::create_dir_all(&dir2).unwrap();
    let other = [Layer::new().file("a", b"other bytes").tar()];
    let cfg = config_json(&other, serde_json::json!({}));
    let m = add_image(&dir2, &layers, serde_json::json!({}), "amd64");
    // Swap the manifest's config for the wrong one.
    let mpath = dir2.join("blobs/sha256").join(m["digest"].as_str().unwrap().trim_start_matches("sha256:"));
    let mut manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    let cdigest = sha256(&cfg);
    std::fs::write(dir2.join("blobs/sha256").join(cdigest.trim_start_matches("sha256:")), &cfg).unwrap();
    manifest["config"]["digest"] = cdigest.into();
    manifest["config"]["size"] = cfg.len().into();
    let mbytes = serde_json::to_vec(&manifest).unwrap();
    let mdigest = sha256(&mbytes);
    std::fs::write(dir2.join("blobs/sha256").join(mdigest.trim_start_matches("sha256:")), &mbytes).unwrap();
    write_index(
        &dir2,
        vec![
            serde_json::json!({"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": mdigest, "size": mbytes.len()}),
        ],
    );
    let e = build_image(d.path(), &dir2, None).unwrap_err().to_string();
    assert!(e.contains("diff_id"), "{e}");

    // The index names a manifest whose bytes were altered.
    std::fs::write(dir2.join("blobs/sha256").join(mdigest.trim_start_matches("sha256:")), b"{}").unwrap();
    let e = build_image(d.path(), &dir2, None).unwrap_err().to_string();
    assert!(e.contains("manifest") && e.contains("mismatch"), "{e}");
}

#[test]
fn oci_archives_docker_archives_and_multi_platform_indexes_are_read() {
    let d = tempfile::tempdir().unwrap();
    let amd = [Layer::new().file("which", b"amd64").tar()];
    let arm = [Layer::new().file("which", b"arm64").tar()];
    let dir = d.path().join("multi");
    std::fs::create_dir_all(&dir).unwrap();
    let a = add_image(&dir, &arm, serde_json::json!({}), "arm64");
    let b = add_image(&dir, &amd, serde_json::json!({"Env": ["X=1"]}), "amd64");
    write_index(&dir, vec![a, b]);
    let built = build_image(d.path(), &dir, None).unwrap();
    assert_eq!(debugfs(&d.path().join("base.ext4"), "cat /which"), "amd64");
    assert_eq!(built.run.env, vec!["X=1".to_string()]);

    let e = build_image(d.path(), &dir, Some("team/app:9")).unwrap_err().to_string();
    assert!(
        e.contains("has no image team/app:9") && e.contains("none annotated"),
        "a reference that names nothing: {e}"
    );

    let archive = d.path().join("oci.tar");
    tar_dir(&dir, &archive);
    build_image(d.path(), &archive, None).unwrap();
    assert_eq!(debugfs(&d.path().join("base.ext4"), "cat /which"), "amd64");

    let docker = d.path().join("docker.tar");
    docker_archive(&docker, &amd, serde_json::json!({"User": "nobody"}), "team/app:1");
    let built = build_image(d.path(), &docker, Some("team/app:1")).unwrap();
    assert_eq!(debugfs(&d.path().join("base.ext4"), "cat /which"), "amd64");
    assert_eq!(built.run.user.as_deref(), Some("nobody"));
    let e = build_image(d.path(), &docker, Some("team/app:2")).unwrap_err().to_string();
    assert!(e.contains("no image team/app:2") && e.contains("team/app:1"), "{e}");

    let arm_only = d.path().join("arm");
    std::fs::create_dir_all(&arm_only).unwrap();
    let a = add_image(&arm_only, &arm, serde_json::json!({}), "arm64");
    write_index(&arm_only, vec![a]);
    let e = build_image(d.path(), &arm_only, None).unwrap_err().to_string();
    assert!(e.contains("no manifest for linux/amd64") && e.contains("linux/arm64"), "{e}");

    let e = build_image(d.path(), d.path(), None).unwrap_err().to_string();
    assert!(e.contains("not an OCI image layout"), "{e}");
}

#[test]
fn names_the_image_writer_cannot_quote_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let dir = layout(&d.path().join("layout"), &[Layer::new().file("a\"b", b"x").tar()], serde_json::json!({}));
    let e = build_image(d.path(), &dir, None).unwrap_err().to_string();
    assert!(e.contains("double quote"), "{e}");
    let dir =
        layout(&d.path().join("layout2"), &[Layer::new().file("a\nsif /etc uid 5", b"x").tar()], serde_json::json!({}));
    let e = build_image(d.path(), &dir, None).unwrap_err().to_string();
    assert!(e.contains("control character"), "{e}");
}

/// The daemon runs as the unprivileged `tine` user with umask 0077: the
/// same build by `nobody` with that umask (this test re-runs itself under
/// setpriv when run as root) gives root-owned files, setuid bits, device
/// nodes and 0755 directories all the same.
#[test]
fn an_unprivileged_build_keeps_the_headers_owners() {
    const CHILD: &str = "TINE_IMAGE_UNPRIVILEGED_DIR";
    if let Ok(dir) = std::env::var(CHILD) {
        // The server's umask (crates/tine cli/manager.rs): the image's
        // modes must not follow it.
        // SAFETY: umask(2) only sets this process's file mode creation mask.
        unsafe { libc::umask(0o077) };
        let dir = PathBuf::from(dir);
        build_image(&dir, &dir.join("layout"), None).unwrap();
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let layers = [Layer::new()
        .file_as("usr/bin/sudo", b"sudo", 0o4755, (0, 0))
        .file_as("home/u/f", b"f", 0o640, (1000, 100))
        .device("dev/zero", tar::EntryType::Char, (1, 5), 0o666)
        .tar()];
    layout(&d.path().join("layout"), &layers, serde_json::json!({}));
    let root = unsafe_free_euid() == 0;
    let mut cmd = if root {
        // Everything the child writes is in `d`, open to it.
        std::process::Command::new("chmod").args(["-R", "a+rwX"]).arg(d.path()).status().unwrap();
        let mut c = std::process::Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"]).arg(std::env::current_exe().unwrap());
        c
    } else {
        std::process::Command::new(std::env::current_exe().unwrap())
    };
    let out = cmd
        .args(["--exact", "an_unprivileged_build_keeps_the_headers_owners", "--nocapture"])
        .env(CHILD, d.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let img = d.path().join("base.ext4");
    let meta = std::fs::metadata(&img).unwrap();
    if root {
        use std::os::unix::fs::MetadataExt;
        assert_eq!(meta.uid(), 65534, "the child, not root, wrote the image");
    }
    fsck_clean(&img);
    assert_eq!(stat(&img, "/usr/bin/sudo"), ("regular".into(), "04755".into(), 0, 0));
    assert_eq!(stat(&img, "/home/u/f"), ("regular".into(), "0640".into(), 1000, 100));
    assert_eq!(stat(&img, "/dev/zero"), ("character".into(), "0666".into(), 0, 0));
    assert_eq!(stat(&img, "/usr"), ("directory".into(), "0755".into(), 0, 0));
    assert_eq!(stat(&img, "/"), ("directory".into(), "0755".into(), 0, 0));
}

/// The effective uid, from /proc (no unsafe call for it).
fn unsafe_free_euid() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    line.split_whitespace().nth(2).unwrap().parse().unwrap()
}
