//! Firecracker, driven through its API socket, for side-by-side benches.
//!
//! A bench takes the binary from `FIRECRACKER=/path/to/firecracker` (built
//! by hand from its source, see `docs/hosts.md`: a project script cannot
//! download it) and skips Firecracker's column without one. It runs with
//! `--no-seccomp` (a build for the gnu target has only an allow-all
//! filter) and no jailer. The guest is Tine's: the same kernel, root
//! filesystem (read-only, the agent as init), command line (without Tine's
//! power-off port option), 1 vCPU and vsock CID 3 through a hybrid-vsock
//! Unix socket, which Tine's agent client speaks as it does to Tine.
//!
//! API: Firecracker's `swagger/firecracker.yaml` (v1.16): `PUT
//! /boot-source`, `/drives/{id}`, `/machine-config`, `/vsock`,
//! `/actions`, `PATCH /vm`, `PUT /snapshot/create`, `/snapshot/load`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// The binary `FIRECRACKER` names, when it exists.
pub fn binary() -> Option<PathBuf> {
    std::env::var_os("FIRECRACKER").map(PathBuf::from).filter(|p| p.exists())
}

/// One Firecracker process and its API socket; killed when dropped.
pub struct Firecracker {
    child: Child,
    api: reqwest::Client,
}

impl Firecracker {
    /// Starts `binary` with its API socket at `<dir>/<name>.api` and its
    /// log (errors only) at `<dir>/<name>.log`; waits up to 10 s for the
    /// socket. Panics when it does not come (a bench, not a service).
    pub async fn start(binary: &Path, dir: &Path, name: &str) -> Firecracker {
        let sock = dir.join(format!("{name}.api"));
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).expect("create the log");
        let child = Command::new(binary)
            .arg("--api-sock")
            .arg(&sock)
            .args(["--no-seccomp", "--level", "Error", "--id", name])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start firecracker");
        let since = Instant::now();
        while !sock.exists() {
            assert!(since.elapsed() < Duration::from_secs(10), "no API socket {}", sock.display());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let api = reqwest::Client::builder().unix_socket(sock).build().expect("an HTTP client");
        Firecracker { child, api }
    }

    /// Sends one API request and returns how long Firecracker took to
    /// answer it. Panics with its answer on an HTTP error.
    pub async fn call(&self, method: reqwest::Method, path: &str, body: Value) -> Duration {
        let t = Instant::now();
        let resp = self
            .api
            .request(method.clone(), format!("http://localhost{path}"))
            .json(&body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let took = t.elapsed();
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        assert!(status.is_success(), "{method} {path}: {status} {text}");
        took
    }

    /// `PUT path body`.
    pub async fn put(&self, path: &str, body: Value) -> Duration {
        self.call(reqwest::Method::PUT, path, body).await
    }

    /// Pauses (`true`) or resumes the VM (`PATCH /vm`).
    pub async fn set_paused(&self, paused: bool) -> Duration {
        let state = if paused { "Paused" } else { "Resumed" };
        self.call(reqwest::Method::PATCH, "/vm", json!({ "state": state })).await
    }

    /// Configures and starts Tine's agent guest (as
    /// `testkit::agent_vm_config`): `memory_mib` of RAM, dirty-page
    /// tracking on (for diff snapshots), vsock at `vsock`.
    pub async fn boot_agent_guest(&self, memory_mib: u64, vsock: &Path) {
        let mut cfg = testkit::agent_vm_config("firecracker", vsock);
        cfg.profile = vmm::HostProfile::detect();
        let cmdline: Vec<String> = cfg
            .full_cmdline()
            .split_whitespace()
            .filter(|w| !w.starts_with("tine_poweroff="))
            .map(String::from)
            .collect();
        self.put("/boot-source", json!({ "kernel_image_path": testkit::kernel(), "boot_args": cmdline.join(" ") }))
            .await;
        self.put(
            "/drives/rootfs",
            json!({ "drive_id": "rootfs", "path_on_host": testkit::rootfs(), "is_root_device": true,
                    "is_read_only": true }),
        )
        .await;
        self.put("/machine-config", json!({ "vcpu_count": 1, "mem_size_mib": memory_mib, "track_dirty_pages": true }))
            .await;
        self.put("/vsock", json!({ "guest_cid": 3, "uds_path": vsock })).await;
        self.put("/actions", json!({ "action_type": "InstanceStart" })).await;
    }

    /// Writes a snapshot of the paused VM: `kind` `Full` or `Diff` (the
    /// pages written since the last snapshot). Returns the time of the
    /// API call.
    pub async fn snapshot(&self, kind: &str, state: &Path, memory: &Path) -> Duration {
        self.put("/snapshot/create", json!({ "snapshot_type": kind, "snapshot_path": state, "mem_file_path": memory }))
            .await
    }

    /// Loads a full snapshot into this (fresh) process from files and
    /// resumes it. Returns the time of the API call.
    pub async fn load(&self, state: &Path, memory: &Path) -> Duration {
        self.put(
            "/snapshot/load",
            json!({ "snapshot_path": state, "mem_backend": { "backend_type": "File", "backend_path": memory },
                    "resume_vm": true }),
        )
        .await
    }
}

impl Drop for Firecracker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Bytes of `path` on disk (allocated blocks: a diff snapshot's memory
/// file is sparse).
pub fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map(|m| m.blocks() * 512).unwrap_or(0)
}
