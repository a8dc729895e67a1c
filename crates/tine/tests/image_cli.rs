//! `tine image build` as an operator runs it: from an OCI layout (the
//! agent given) and from a real registry over plain HTTP (the agent taken
//! from the installed root filesystem when there is one), the result read
//! back with debugfs; a source that is neither a path nor a pullable
//! reference fails with a message. No guest boots here: the image's boot
//! is vmm's agent test (`testkit::oci::busybox_image_rootfs`).

use std::path::Path;
use std::process::{Command, Output};

use testkit::oci::*;

fn tine(args: &[&str], data_dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tine"))
        .args(args)
        .arg("--data-dir")
        .arg(data_dir)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn image_build_from_a_layout_and_from_a_registry() {
    let d = tempfile::tempdir().unwrap();
    let layers = [
        Layer::new().file_as("usr/bin/tool", b"tool", 0o4711, (0, 0)).tar(),
        Layer::new().file("etc/motd", b"hello from the image\n").tar(),
    ];
    let layout_dir =
        layout(&d.path().join("layout"), &layers, serde_json::json!({"Env": ["A=1"], "WorkingDir": "/srv"}));
    let agent = d.path().join("agent");
    std::fs::write(&agent, b"agent bytes").unwrap();
    let out = d.path().join("out/base.ext4");
    let o = tine(
        &[
            "image",
            "build",
            layout_dir.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--agent",
            agent.to_str().unwrap(),
        ],
        d.path(),
    );
    assert!(o.status.success(), "{}", text(&o));
    let said = text(&o);
    assert!(
        said.contains("2 layers") && said.contains("\"working_dir\":\"/srv\"") && said.contains("tine vm run"),
        "{said}"
    );
    fsck_clean(&out);
    assert_eq!(debugfs(&out, "cat /etc/motd"), "hello from the image\n");
    assert_eq!(stat(&out, "/usr/bin/tool"), ("regular".into(), "04711".into(), 0, 0));
    assert_eq!(debugfs(&out, &format!("cat {}", tine_image::AGENT_PATH)), "agent bytes");
    let leftovers: Vec<_> = std::fs::read_dir(out.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("base.ext4")], "the work directory is removed");

    // Port 9 (discard) on loopback: nothing listens, the pull fails at once.
    let o = tine(
        &[
            "image",
            "build",
            "127.0.0.1:9/no/such:tag",
            "--out",
            out.to_str().unwrap(),
            "--agent",
            agent.to_str().unwrap(),
            "--insecure-registry",
            "127.0.0.1:9",
        ],
        d.path(),
    );
    assert!(!o.status.success());
    assert!(text(&o).contains("tine: error: pulling the manifest of 127.0.0.1:9/no/such:tag"), "{}", text(&o));
    // No --agent and no installed root filesystem to take it from.
    let o = tine(&["image", "build", layout_dir.to_str().unwrap(), "--out", out.to_str().unwrap()], d.path());
    assert!(!o.status.success() && text(&o).contains("give --agent"), "{}", text(&o));

    let Some(registry) = Registry::start("image_build_from_a_layout_and_from_a_registry") else { return };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(registry.push_layout(&layout_dir, "team/tool", "v1"));
    let reference = format!("{}/team/tool:v1", registry.addr);
    let out2 = d.path().join("pulled.ext4");
    let from_registry = || {
        let args = ["image", "build", &reference, "--out", out2.to_str().unwrap(), "--agent", agent.to_str().unwrap()];
        tine(&[&args[..], &["--insecure-registry", &registry.addr]].concat(), d.path())
    };
    let o = from_registry();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("3 blobs fetched"), "{}", text(&o));
    assert_eq!(debugfs(&out2, "cat /etc/motd"), "hello from the image\n");
    // The pull is kept in the data directory: a second build fetches nothing.
    let o = from_registry();
    assert!(o.status.success() && text(&o).contains("0 blobs fetched (0 bytes), 3 already here"), "{}", text(&o));
}

/// `tine template build --image`: a reference needs a name; credentials in
/// `[[images.auth]]` are read when their registry is pulled from (a bad
/// file is named); a registry on this host that the operator did not list
/// is refused before any pull or boot.
#[test]
fn template_build_from_an_image_reference() {
    let d = tempfile::tempdir().unwrap();
    // Non-empty stand-ins: nothing boots in these cases.
    let (kernel, rootfs) = (d.path().join("vmlinux"), d.path().join("rootfs.ext4"));
    std::fs::write(&kernel, b"ELF").unwrap();
    std::fs::write(&rootfs, b"ext4").unwrap();
    let template = |extra: &[&str], config: &str| {
        let file = d.path().join("tine.toml");
        std::fs::write(&file, config).unwrap();
        let args = ["template", "build", "--kernel", kernel.to_str().unwrap(), "--rootfs", rootfs.to_str().unwrap()];
        tine(&[&args[..], extra, &["--config", file.to_str().unwrap()]].concat(), d.path())
    };
    let o = template(&["--image", "127.0.0.1:9/team/app:1"], "");
    assert!(!o.status.success() && text(&o).contains("--image needs --name"), "{}", text(&o));
    let auth = "[images]\ninsecure_registries = [\"127.0.0.1:9\"]\n[[images.auth]]\nregistry = \"127.0.0.1:9\"\n\
                username = \"bot\"\npassword_file = \"/nonexistent/pw\"\n";
    let o = template(&["--image", "127.0.0.1:9/team/app:1", "--name", "app"], auth);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("[[images.auth]] for registry \"127.0.0.1:9\": /nonexistent/pw"), "{}", text(&o));
    // A server checks them at its start, before it listens.
    let file = d.path().join("tine.toml");
    let server = ["server", "start", "--dev", "--listen", "127.0.0.1:0", "--config", file.to_str().unwrap()];
    let o = tine(&server, d.path());
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("[[images.auth]] for registry \"127.0.0.1:9\": /nonexistent/pw"), "{}", text(&o));
    let o = template(&["--image", "127.0.0.1:9/team/app:1", "--name", "app"], "");
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("private_registries"), "{}", text(&o));
}
