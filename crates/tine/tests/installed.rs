//! What `scripts/setup.sh` leaves in place for a plain `tine` command: the
//! kernel and root filesystem it built, installed in the default data
//! directory's `images/` with their build-input hashes, which `tine
//! doctor` (no arguments) finds, reports and passes.
//!
//! `scripts/test.sh` runs setup first and sets
//! `TINE_REQUIRE_INSTALLED_IMAGES`; without it (setup not run for this
//! user) the test skips with a loud line.

use std::path::PathBuf;
use std::process::Command;

/// The default data directory, as `tine` and `scripts/setup.sh` pick it.
fn default_data_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/var/lib/tine");
    }
    match std::env::var_os("XDG_DATA_HOME").filter(|x| !x.is_empty()) {
        Some(x) => PathBuf::from(x).join("tine"),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".local/share/tine"),
    }
}

#[test]
fn doctor_finds_the_images_setup_installed() {
    let test = "tine::installed doctor_finds_the_images_setup_installed";
    let images = default_data_dir().join("images");
    let inputs = images.join("build-inputs");
    if !inputs.exists() {
        assert!(
            std::env::var_os("TINE_REQUIRE_INSTALLED_IMAGES").is_none(),
            "{test}: {} is missing after scripts/setup.sh",
            inputs.display()
        );
        eprintln!("SKIPPED {test}: {} is missing (scripts/setup.sh installs the images)", inputs.display());
        return;
    }
    let listed = std::fs::read_to_string(&inputs).expect("read build-inputs");
    // The installed kernel is the one setup just built (scripts/test.sh
    // passes its path in TINE_KERNEL, a name ending in its inputs hash).
    if let Some(kernel) = std::env::var_os("TINE_KERNEL").map(PathBuf::from) {
        let name = kernel.file_name().unwrap().to_string_lossy().to_string();
        let hash = name.rsplit('-').next().unwrap();
        assert!(listed.lines().any(|l| l.starts_with(&format!("vmlinux {hash} "))), "{name} in\n{listed}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_tine")).arg("doctor").output().expect("run tine doctor");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "tine doctor failed:\n{text}");
    for (check, file) in [("guest kernel", "vmlinux"), ("root filesystem", "rootfs.ext4")] {
        let line = text.lines().find(|l| l.contains(check)).unwrap_or_else(|| panic!("a {check} line in\n{text}"));
        let hash = listed
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{file} ")))
            .and_then(|rest| rest.split(' ').next())
            .unwrap_or_else(|| panic!("{file} in\n{listed}"));
        assert!(line.starts_with("ok"), "{line}");
        assert!(line.contains(&images.join(file).display().to_string()), "{line}");
        assert!(line.contains(&format!("build inputs {hash}")), "{line}");
    }
}

/// `tine image build` with no `--agent` installs the agent of the
/// installed root filesystem (the one this daemon's guests run).
#[test]
fn image_build_takes_the_agent_from_the_installed_rootfs() {
    let test = "tine::installed image_build_takes_the_agent_from_the_installed_rootfs";
    let rootfs = default_data_dir().join("images/rootfs.ext4");
    if !rootfs.exists() {
        assert!(std::env::var_os("TINE_REQUIRE_INSTALLED_IMAGES").is_none(), "{test}: {} is missing", rootfs.display());
        eprintln!("SKIPPED {test}: {} is missing (scripts/setup.sh installs the images)", rootfs.display());
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let layout = testkit::oci::layout(
        &d.path().join("layout"),
        &[testkit::oci::Layer::new().file("etc/motd", b"hi").tar()],
        serde_json::json!({}),
    );
    let out = d.path().join("base.ext4");
    let o = Command::new(env!("CARGO_BIN_EXE_tine"))
        .args(["image", "build"])
        .arg(&layout)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run tine image build");
    assert!(o.status.success(), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    let dump = |image: &std::path::Path, to: &std::path::Path| {
        tine_image::agent_from_rootfs(image, to).unwrap();
        std::fs::read(to).unwrap()
    };
    let installed = dump(&rootfs, &d.path().join("a"));
    assert!(installed.len() > 1 << 20, "the static agent, {} bytes", installed.len());
    assert!(installed == dump(&out, &d.path().join("b")), "the image's agent is the installed one");
}
