//! OCI images for the tests: tar layers written entry by entry (hostile
//! ones too: raw names, PAX records), OCI image layouts, OCI archives and
//! `docker save` archives around them, a busybox image with the guest
//! agent built into a base image by `tine-image`, and readers of the ext4
//! images built (debugfs, e2fsck).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// A tar layer built entry by entry.
pub struct Layer {
    b: tar::Builder<Vec<u8>>,
}

impl Default for Layer {
    fn default() -> Self {
        Self::new()
    }
}

impl Layer {
    pub fn new() -> Self {
        Layer { b: tar::Builder::new(Vec::new()) }
    }

    /// An entry whose name is written into the header as given (no
    /// checks: `..`, absolute paths), with PAX extended attributes.
    fn raw(
        &mut self,
        name: &[u8],
        kind: tar::EntryType,
        (mode, owner): (u32, (u64, u64)),
        link: &[u8],
        data: &[u8],
        xattrs: &[(&str, &[u8])],
    ) {
        if !xattrs.is_empty() {
            let keys: Vec<String> = xattrs.iter().map(|(k, _)| format!("SCHILY.xattr.{k}")).collect();
            let records: Vec<(&str, &[u8])> =
                keys.iter().map(String::as_str).zip(xattrs.iter().map(|(_, v)| *v)).collect();
            self.append_pax(false, &records);
        }
        let mut h = tar::Header::new_ustar();
        assert!(name.len() <= 100);
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(owner.0);
        h.set_gid(owner.1);
        h.set_mtime(1_700_000_000);
        h.set_size(data.len() as u64);
        if !link.is_empty() {
            h.as_old_mut().linkname[..link.len()].copy_from_slice(link);
        }
        h.set_cksum();
        self.b.append(&h, data).unwrap();
    }

    /// A PAX header (`x`, or `g` for a global one) with `records` as is
    /// (`key=value`), before whatever entry comes next.
    pub fn pax(mut self, global: bool, records: &[(&str, &[u8])]) -> Self {
        self.append_pax(global, records);
        self
    }

    fn append_pax(&mut self, global: bool, records: &[(&str, &[u8])]) {
        let mut data = Vec::new();
        for (k, v) in records {
            let body_len = 1 + k.len() + 1 + v.len() + 1;
            // The record's length counts its own digits.
            let mut len = body_len + 1;
            while len != body_len + len.to_string().len() {
                len = body_len + len.to_string().len();
            }
            data.extend_from_slice(format!("{len} {k}=").as_bytes());
            data.extend_from_slice(v);
            data.push(b'\n');
        }
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(if global { tar::EntryType::XGlobalHeader } else { tar::EntryType::XHeader });
        h.set_size(data.len() as u64);
        h.as_old_mut().name[..9].copy_from_slice(b"PaxHeader");
        h.set_cksum();
        self.b.append(&h, data.as_slice()).unwrap();
    }
    /// A file with the given modification time (seconds; any u64, as a
    /// GNU header's base-256 field holds).
    pub fn file_mtime(mut self, name: &str, data: &[u8], mtime: u64) -> Self {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(mtime);
        h.set_size(data.len() as u64);
        h.set_entry_type(tar::EntryType::Regular);
        self.b.append_data(&mut h, name, data).unwrap();
        self
    }
    pub fn dir(mut self, name: &str, mode: u32, owner: (u64, u64)) -> Self {
        self.raw(name.as_bytes(), tar::EntryType::Directory, (mode, owner), b"", b"", &[]);
        self
    }
    pub fn file(mut self, name: &str, data: &[u8]) -> Self {
        self.raw(name.as_bytes(), tar::EntryType::Regular, (0o644, (0, 0)), b"", data, &[]);
        self
    }
    pub fn file_as(mut self, name: &str, data: &[u8], mode: u32, owner: (u64, u64)) -> Self {
        self.raw(name.as_bytes(), tar::EntryType::Regular, (mode, owner), b"", data, &[]);
        self
    }
    pub fn file_xattrs(mut self, name: &str, data: &[u8], xattrs: &[(&str, &[u8])]) -> Self {
        self.raw(name.as_bytes(), tar::EntryType::Regular, (0o644, (0, 0)), b"", data, xattrs);
        self
    }
    pub fn raw_file(mut self, name: &[u8], data: &[u8]) -> Self {
        self.raw(name, tar::EntryType::Regular, (0o644, (0, 0)), b"", data, &[]);
        self
    }
    pub fn symlink(mut self, name: &str, target: &str, owner: (u64, u64)) -> Self {
        self.raw(name.as_bytes(), tar::EntryType::Symlink, (0o777, owner), target.as_bytes(), b"", &[]);
        self
    }
    pub fn hardlink(mut self, name: &str, target: &str) -> Self {
        self.raw(name.as_bytes(), tar::EntryType::Link, (0o644, (0, 0)), target.as_bytes(), b"", &[]);
        self
    }
    pub fn device(mut self, name: &str, kind: tar::EntryType, rdev: (u32, u32), mode: u32) -> Self {
        let mut h = tar::Header::new_ustar();
        h.set_path(name).unwrap();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_size(0);
        h.set_device_major(rdev.0).unwrap();
        h.set_device_minor(rdev.1).unwrap();
        h.set_cksum();
        self.b.append(&h, &[][..]).unwrap();
        self
    }
    /// A file with a path longer than a header's 100 bytes (a GNU long
    /// name entry).
    pub fn long_file(mut self, name: &str, data: &[u8]) -> Self {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_size(data.len() as u64);
        h.set_entry_type(tar::EntryType::Regular);
        self.b.append_data(&mut h, name, data).unwrap();
        self
    }
    pub fn tar(self) -> Vec<u8> {
        self.b.into_inner().unwrap()
    }
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn put_blob(dir: &Path, bytes: &[u8]) -> (String, u64) {
    let digest = sha256(bytes);
    let path = dir.join("blobs/sha256").join(digest.trim_start_matches("sha256:"));
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
    (digest, bytes.len() as u64)
}

/// The image configuration JSON for `layers` (uncompressed tars).
pub fn config_json(layers: &[Vec<u8>], config: serde_json::Value) -> Vec<u8> {
    let diff_ids: Vec<String> = layers.iter().map(|l| sha256(l)).collect();
    serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .unwrap()
}

/// Adds an image (its config, layers gzip-compressed, manifest) to the
/// layout at `dir`; returns the manifest's descriptor JSON.
pub fn add_image(dir: &Path, layers: &[Vec<u8>], config: serde_json::Value, arch: &str) -> serde_json::Value {
    let (cdigest, csize) = put_blob(dir, &config_json(layers, config));
    let layer_descs: Vec<serde_json::Value> = layers
        .iter()
        .map(|l| {
            let (d, s) = put_blob(dir, &gzip(l));
            serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d, "size": s})
        })
        .collect();
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cdigest, "size": csize},
        "layers": layer_descs,
    }))
    .unwrap();
    let (mdigest, msize) = put_blob(dir, &manifest);
    serde_json::json!({
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": mdigest,
        "size": msize,
        "platform": {"architecture": arch, "os": "linux"},
    })
}

/// Writes an OCI image layout at `dir` holding the images `manifests`
/// (descriptors from [`add_image`]).
pub fn write_index(dir: &Path, manifests: Vec<serde_json::Value>) {
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    let index = serde_json::json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests});
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
}

/// An OCI layout with one linux/amd64 image.
pub fn layout(dir: &Path, layers: &[Vec<u8>], config: serde_json::Value) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let m = add_image(dir, layers, config, "amd64");
    write_index(dir, vec![m]);
    dir.to_path_buf()
}

/// A tar archive of the directory `dir` (an OCI archive of a layout).
pub fn tar_dir(dir: &Path, out: &Path) {
    let mut b = tar::Builder::new(std::fs::File::create(out).unwrap());
    b.append_dir_all(".", dir).unwrap();
    b.finish().unwrap();
}

/// A `docker save` archive (Docker image spec v1.2): uncompressed
/// `<n>/layer.tar`, `<hex>.json`, `manifest.json`.
pub fn docker_archive(out: &Path, layers: &[Vec<u8>], config: serde_json::Value, tag: &str) {
    let cfg = config_json(layers, config);
    let cname = format!("{}.json", sha256(&cfg).trim_start_matches("sha256:"));
    let mut b = tar::Builder::new(std::fs::File::create(out).unwrap());
    let mut add = |name: &str, data: &[u8]| {
        let mut h = tar::Header::new_ustar();
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(data.len() as u64);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, name, data).unwrap();
    };
    let mut names = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let name = format!("layer{i}/layer.tar");
        add(&name, l);
        names.push(name);
    }
    add(&cname, &cfg);
    let manifest = serde_json::json!([{"Config": cname, "RepoTags": [tag], "Layers": names}]);
    add("manifest.json", &serde_json::to_vec(&manifest).unwrap());
    b.finish().unwrap();
}

/// `debugfs -R CMD IMAGE`'s standard output.
pub fn debugfs(image: &Path, cmd: &str) -> String {
    let out = Command::new("debugfs").arg("-R").arg(cmd).arg(image).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What `stat` of debugfs says of a path: (type, mode octal string, uid, gid).
pub fn stat(image: &Path, path: &str) -> (String, String, u32, u32) {
    let s = debugfs(image, &format!("stat \"{path}\""));
    let field = |after: &str| -> String {
        let i = s.find(after).unwrap_or_else(|| panic!("no {after:?} in stat {path}: {s}"));
        s[i + after.len()..].split_whitespace().next().unwrap().to_string()
    };
    (field("Type:"), field("Mode:"), field("User:").parse().unwrap(), field("Group:").parse().unwrap())
}

/// `e2fsck -fn`: the image is a consistent filesystem.
pub fn fsck_clean(image: &Path) {
    let out = Command::new("e2fsck").arg("-fn").arg(image).output().unwrap();
    assert!(
        out.status.success(),
        "e2fsck -fn {}: {}\n{}",
        image.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
}

/// The kernel command line of a guest whose root is a base image built
/// by `tine-image` (the agent is init at its own path, not `/sbin/init`,
/// which belongs to the image).
pub const IMAGE_CMDLINE: &str = "root=/dev/vda ro rootfstype=ext4 init=/usr/local/sbin/tine-agent";

/// Writes, at `dir/busybox-layout`, the image `busybox` as a registry
/// would hold it: one uncompressed layer with Debian's static busybox as
/// `/bin/busybox` and its applets as links, a second (gzip) with
/// `/etc/motd`, a user `app` (1000, also in group `extra`, 2000) and its
/// home; the configuration has `PATH=/bin`, `User` `app` and `WorkingDir`
/// `/home/app/work` (which the image lacks). Returns the OCI layout's
/// directory.
pub fn busybox_layout(dir: &Path) -> PathBuf {
    let busybox = Path::new("/bin/busybox");
    assert!(busybox.exists(), "/bin/busybox is missing: apt-get install busybox-static (scripts/setup.sh does)");
    let list = Command::new(busybox).arg("--list").output().expect("busybox --list");
    let mut layer = Layer::new().dir("bin/", 0o755, (0, 0)).file_as(
        "bin/busybox",
        &std::fs::read(busybox).expect("read busybox"),
        0o755,
        (0, 0),
    );
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if applet != "busybox" && !applet.is_empty() {
            layer = layer.symlink(&format!("bin/{applet}"), "busybox", (0, 0));
        }
    }
    let etc = Layer::new()
        .dir("etc/", 0o755, (0, 0))
        .file("etc/motd", b"busybox image\n")
        .file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n")
        .file("etc/group", b"root:x:0:\napp:x:1000:\nextra:x:2000:app\n")
        .dir("home/", 0o755, (0, 0))
        .dir("home/app/", 0o755, (1000, 1000));
    let layout_dir = dir.join("busybox-layout");
    let config =
        serde_json::json!({"Env": ["PATH=/bin"], "Cmd": ["sh"], "User": "app", "WorkingDir": "/home/app/work"});
    layout(&layout_dir, &[layer.tar(), etc.tar()], config);
    layout_dir
}

/// The base image `tine_image::build` makes, in `dir`, of
/// [`busybox_layout`] with the guest agent ([`crate::build_agent`]). Boot
/// it with [`IMAGE_CMDLINE`]. Returns the ext4 image's path.
pub fn busybox_image_rootfs(dir: &Path) -> PathBuf {
    let layout_dir = busybox_layout(dir);
    let out = dir.join("busybox-image.ext4");
    let agent = crate::build_agent();
    tine_image::build(
        &tine_image::BuildRequest {
            image: &layout_dir,
            reference: None,
            agent: &agent,
            out: &out,
            work: dir,
            limits: tine_image::Limits::default(),
        },
        &mut |_| {},
    )
    .expect("build the busybox base image");
    out
}

/// A Docker registry (Debian's `docker-registry`, the CNCF distribution
/// registry 2.8) serving plain HTTP on a loopback port, storing in a
/// temporary directory; stopped when dropped.
pub struct Registry {
    child: std::process::Child,
    /// `127.0.0.1:<port>`.
    pub addr: String,
    /// Where it stores repositories and blobs
    /// (`docker/registry/v2/blobs/sha256/<2 hex>/<hex>/data`).
    pub storage: PathBuf,
    _dir: tempfile::TempDir,
}

impl Registry {
    /// Starts one; `None` (with a loud message) when `docker-registry` is
    /// not installed, unless `TINE_REQUIRE_REGISTRY` is set (scripts/test.sh
    /// sets it: setup.sh installs the package), when it panics.
    pub fn start(test: &str) -> Option<Registry> {
        let bin = Path::new("/usr/bin/docker-registry");
        if !bin.exists() {
            assert!(
                std::env::var_os("TINE_REQUIRE_REGISTRY").is_none(),
                "{test}: /usr/bin/docker-registry is missing and TINE_REQUIRE_REGISTRY is set: apt-get install docker-registry (scripts/setup.sh does)"
            );
            eprintln!("SKIPPED {test}: /usr/bin/docker-registry is missing (apt-get install docker-registry)");
            return None;
        }
        let dir = tempfile::tempdir().expect("registry dir");
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        let storage = dir.path().join("storage");
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n",
                storage.display()
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.path().join("registry.log")).unwrap();
        let child = Command::new(bin)
            .arg("serve")
            .arg(&config)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start docker-registry");
        let registry = Registry { child, addr, storage, _dir: dir };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            if registry.get("/v2/").starts_with("HTTP/1.1 200") {
                return Some(registry);
            }
            assert!(
                std::time::Instant::now() < deadline,
                "docker-registry did not answer on {} within 30 s: {}",
                registry.addr,
                std::fs::read_to_string(registry._dir.path().join("registry.log")).unwrap_or_default()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// A GET of `path`: the response's status line and headers and body
    /// ("" when the registry does not answer).
    pub fn get(&self, path: &str) -> String {
        use std::io::Read;
        let Ok(mut s) = std::net::TcpStream::connect(&self.addr) else { return String::new() };
        let _ = write!(s, "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n", self.addr);
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    }

    /// Pushes the OCI layout at `layout` (its index's manifests and, under
    /// an index, every platform's manifest, configuration and layers) as
    /// `<addr>/<repository>:<tag>`.
    pub async fn push_layout(&self, layout: &Path, repository: &str, tag: &str) {
        let client = oci_client::Client::new(oci_client::client::ClientConfig {
            protocol: oci_client::client::ClientProtocol::Http,
            ..Default::default()
        });
        let auth = oci_client::secrets::RegistryAuth::Anonymous;
        let blob = |d: &str| std::fs::read(layout.join("blobs/sha256").join(d.trim_start_matches("sha256:"))).unwrap();
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
        let reference: oci_client::Reference = format!("{}/{repository}:{tag}", self.addr).parse().unwrap();
        // The index's manifests, each pushed by digest; then the index by
        // tag when it names several, else the one manifest by tag.
        let manifests = index["manifests"].as_array().unwrap().clone();
        for m in &manifests {
            let digest = m["digest"].as_str().unwrap();
            let bytes = blob(digest);
            let manifest: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            let descs = std::iter::once(&manifest["config"]).chain(manifest["layers"].as_array().unwrap().iter());
            for d in descs {
                let digest = d["digest"].as_str().unwrap();
                client.auth(&reference, &auth, oci_client::RegistryOperation::Push).await.unwrap();
                client.push_blob(&reference, blob(digest), digest).await.unwrap();
            }
            let content_type = m["mediaType"].as_str().unwrap().parse().unwrap();
            client
                .push_manifest_raw(&reference.clone_with_digest(digest.to_string()), bytes, content_type)
                .await
                .unwrap();
        }
        let (top, content_type) = if manifests.len() == 1 {
            (blob(manifests[0]["digest"].as_str().unwrap()), manifests[0]["mediaType"].as_str().unwrap().to_string())
        } else {
            (std::fs::read(layout.join("index.json")).unwrap(), "application/vnd.oci.image.index.v1+json".to_string())
        };
        client.push_manifest_raw(&reference, top, content_type.parse().unwrap()).await.unwrap();
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
