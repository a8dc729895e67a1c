//! Test and benchmark support for Tine: finds (or builds) the guest
//! kernel, builds the test initramfs from `guest/init.c`, and makes tiny
//! ELF images of raw code for guests that misbehave on purpose.

pub mod cpio;

pub mod mcp;
pub mod oci;
pub mod tls;

use vmm::devices::ConsoleTail;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("workspace root")
}

/// Sends the VMM's log (warnings and up, or `RUST_LOG`) to stderr, once
/// per process, so a failing test shows what the VMM complained about.
pub fn logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_test_writer()
            .try_init();
    });
}

/// Runs `f`; if it panics, prints the last 40 lines of `console` (the
/// guest's side of the story) and re-raises the panic.
pub fn with_console_on_panic<T>(console: &ConsoleTail, f: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("---- guest console (last 40 lines) ----\n{}\n----", console.last_lines(40));
            std::panic::resume_unwind(e)
        }
    }
}

/// Whether this host reaches the Python package index its pip uses
/// (`pypi.org:443`; the host's pip configuration names no other index),
/// for tests that `pip install` inside a sandbox and skip loudly without it.
pub fn package_index_reachable() -> bool {
    use std::net::{TcpStream, ToSocketAddrs};
    let Ok(addrs) = ("pypi.org", 443).to_socket_addrs() else { return false };
    addrs.into_iter().any(|a| TcpStream::connect_timeout(&a, std::time::Duration::from_secs(5)).is_ok())
}

/// Whether the tests move their full sizes (`TINE_TEST_FULL` set): the
/// sizes the issues name, which take minutes each on a host that emulates
/// the guest's kernel. Unset (CI, `scripts/test.sh`), transfers are smaller
/// but still many times every buffer they cross.
pub fn full_size() -> bool {
    std::env::var_os("TINE_TEST_FULL").is_some()
}

/// Whether `/dev/kvm` can be opened. When it cannot, prints a loud SKIPPED
/// line naming `test` so that a skipped KVM test is never mistaken for a
/// pass; CI machines have KVM, so there the tests run.
pub fn kvm_available(test: &str) -> bool {
    logging();
    match std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
        Ok(_) => true,
        Err(e) => {
            eprintln!("\n!!!!!!!! SKIPPED {test}: /dev/kvm is not usable here ({e}); this test needs KVM !!!!!!!!\n");
            false
        }
    }
}

/// Whether the host's hugetlbfs pool has `bytes` of free 2 MiB huge pages
/// available ([`vmm::memory::HugePagePool`]) for `test`. Without them the test
/// is skipped with a loud message, unless `TINE_REQUIRE_HUGE_PAGES=1` says
/// the pool was reserved for the tests (`scripts/test.sh` does, as root):
/// then it panics.
pub fn huge_pages_available(test: &str, bytes: u64) -> bool {
    let free = vmm::memory::HugePagePool::read().unwrap_or_default().available;
    if free * (2 << 20) >= bytes {
        return true;
    }
    let msg =
        format!("{test} needs {} free 2 MiB huge pages, the host has {free} (sysctl vm.nr_hugepages)", bytes >> 21);
    assert!(std::env::var("TINE_REQUIRE_HUGE_PAGES").as_deref() != Ok("1"), "{msg}");
    eprintln!("\n!!!!!!!! SKIPPED {msg} !!!!!!!!\n");
    false
}

/// The guest kernel: `$TINE_KERNEL` if set, else the one
/// `kernel-config/build-kernel.sh` builds for this host (cached; a build
/// takes minutes the first time).
pub fn kernel() -> PathBuf {
    static KERNEL: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    KERNEL
        .get_or_init(|| {
            if let Some(k) = std::env::var_os("TINE_KERNEL").filter(|v| !v.is_empty()) {
                return PathBuf::from(k);
            }
            run_build_script("kernel-config/build-kernel.sh", &[])
        })
        .clone()
}

/// Runs one of the repository's build scripts (path relative to the
/// workspace root) and returns the path it prints on its last line.
fn run_build_script(script: &str, args: &[&Path]) -> PathBuf {
    let out = Command::new("bash")
        .arg(workspace_root().join(script))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {script}: {e}"));
    assert!(out.status.success(), "{script} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    PathBuf::from(stdout.lines().last().unwrap_or_else(|| panic!("{script} printed no path")).trim())
}

/// Takes an exclusive `flock(2)` on `path` (created if missing), waiting
/// for it: for state that test binaries running at the same time share
/// on disk. The lock is held until the returned file is dropped.
pub fn lock_file(path: &Path) -> std::fs::File {
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("cannot open lock file {}: {e}", path.display()));
    f.lock().unwrap_or_else(|e| panic!("cannot lock {}: {e}", path.display()));
    f
}

/// The bzImage built beside [`kernel`] (`$TINE_BZIMAGE` if set).
pub fn bzimage() -> PathBuf {
    if let Some(k) = std::env::var_os("TINE_BZIMAGE").filter(|v| !v.is_empty()) {
        return PathBuf::from(k);
    }
    let vmlinux = kernel();
    let name = vmlinux.file_name().expect("kernel file name").to_string_lossy().replacen("vmlinux", "bzImage", 1);
    vmlinux.with_file_name(name)
}

/// Console line the test init prints first.
pub const INIT_MARKER: &str = "TINE-INIT-MARKER ready";
/// Prefix of the test init's /proc/cpuinfo summary line.
pub const INIT_CPUINFO: &str = "TINE-INIT-CPUINFO processors=";

/// Compiles `guest/init.c` into a static, libc-free executable at `out`.
pub fn build_test_init(out: &Path) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("guest/init.c");
    let status = Command::new("cc")
        .args(["-static", "-nostdlib", "-ffreestanding", "-fno-stack-protector", "-fno-builtin", "-O2", "-o"])
        .arg(out)
        .arg(&src)
        .status()
        .expect("run cc");
    assert!(status.success(), "cc failed to build {}", src.display());
}

/// Builds the test initramfs in `dir`: `/init` (the test init), `/proc`,
/// `/dev` and `/dev/console`. Returns the archive's path.
pub fn build_test_initramfs(dir: &Path) -> PathBuf {
    let init = dir.join("init.bin");
    build_test_init(&init);
    let mut w = cpio::Writer::new();
    w.dir("dev", 0o755);
    w.dir("proc", 0o755);
    w.char_device("dev/console", 0o600, 5, 1);
    w.file("init", 0o755, &std::fs::read(&init).expect("read init"));
    let path = dir.join("initramfs.cpio");
    std::fs::write(&path, w.finish()).expect("write initramfs");
    path
}

/// Builds an ext4 root filesystem image of `size_mib` MiB in `dir` with
/// `mkfs.ext4 -d` (no mount needed): `/sbin/init` (the test init),
/// `/dev`, `/proc`, `/sys`. Returns the image's path.
pub fn build_test_rootfs(dir: &Path, size_mib: u64) -> PathBuf {
    let root = dir.join("rootfs");
    for d in ["dev", "proc", "sys", "sbin"] {
        std::fs::create_dir_all(root.join(d)).expect("create rootfs dirs");
    }
    build_test_init(&root.join("sbin/init"));
    mkfs_ext4(&root, &dir.join("rootfs.ext4"), size_mib)
}

/// Writes the tree `root` into a new ext4 image `image` of `size_mib` MiB
/// with `mkfs.ext4 -d`; returns the image's path.
fn mkfs_ext4(root: &Path, image: &Path, size_mib: u64) -> PathBuf {
    let f = std::fs::File::create(image).expect("create image");
    f.set_len(size_mib << 20).expect("size image");
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(root)
        .arg(image)
        .output()
        .expect("run mkfs.ext4 (e2fsprogs)");
    assert!(out.status.success(), "mkfs.ext4 failed: {}", String::from_utf8_lossy(&out.stderr));
    image.to_path_buf()
}

/// The guest root filesystem image `rootfs/build-rootfs.sh` builds
/// (Debian with python3 and the agent; cached), or `$TINE_ROOTFS`. Looked
/// up once per process (each look-up runs cargo for the agent and the
/// script; servers and VM configurations ask for it at every start).
pub fn rootfs() -> PathBuf {
    static ROOTFS: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    ROOTFS
        .get_or_init(|| {
            if let Some(r) = std::env::var_os("TINE_ROOTFS").filter(|v| !v.is_empty()) {
                return PathBuf::from(r);
            }
            run_build_script("rootfs/build-rootfs.sh", &[&build_agent()])
        })
        .clone()
}

/// A VM of the Debian rootfs with the guest agent as init: 512 MiB,
/// 1 vCPU, the rootfs read-only as `/dev/vda`, vsock CID 3 with its Unix
/// socket at `uds`.
pub fn agent_vm_config(name: &str, uds: &Path) -> vmm::VmConfig {
    let mut config = vmm::VmConfig::new(name, kernel());
    config.memory_mib = 512;
    config.disks = vec![vmm::DiskConfig::raw(rootfs(), true, "root")];
    config.vsock = Some(vmm::VsockConfig { cid: 3, uds_path: uds.to_path_buf() });
    config.cmdline = "root=/dev/vda ro rootfstype=ext4".into();
    config
}

/// The guest of the vsock exchange (see init.c): the test rootfs on a
/// read-only virtio-blk root, vsock CID 3 with its Unix socket in `dir`,
/// and init listening on `port`. Returns the config and the socket path.
pub fn vsock_exchange_guest(dir: &Path, name: &str, port: u32) -> (vmm::VmConfig, PathBuf) {
    let uds = dir.join("vm.vsock");
    let mut config = vmm::VmConfig::new(name, kernel());
    let rootfs = build_test_rootfs(dir, 16);
    config.disks = vec![vmm::DiskConfig::raw(rootfs, true, "tine-root")];
    config.vsock = Some(vmm::VsockConfig { cid: 3, uds_path: uds.clone() });
    config.cmdline = format!("root=/dev/vda ro rootfstype=ext4 tine_init_vsock={port}");
    (config, uds)
}

/// Builds the guest agent as a static executable (its own target dir, so
/// the static flags do not rebuild the host's crates). Returns its path.
pub fn build_agent() -> PathBuf {
    let root = workspace_root();
    let target_dir = root.join("target/guest");
    let out = Command::new("cargo")
        .args(["build", "--release", "-q", "-p", "tine-agent", "--target", "x86_64-unknown-linux-gnu", "--target-dir"])
        .arg(&target_dir)
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        .current_dir(&root)
        .output()
        .expect("run cargo");
    assert!(out.status.success(), "building the agent failed:\n{}", String::from_utf8_lossy(&out.stderr));
    target_dir.join("x86_64-unknown-linux-gnu/release/tine-agent")
}

/// The guest agent built with `--features protocol-v4`: it speaks only
/// protocol version 4, as the release before version 5 did (the fixture
/// of a sandbox made by that release). `scripts/setup.sh` builds it; it is
/// not built here, because building it uplifts over the path
/// [`build_agent`] returns while other tests may be copying it.
pub fn protocol_v4_agent() -> PathBuf {
    let path = workspace_root().join("target/guest/x86_64-unknown-linux-gnu/release/tine-agent-protocol-v4");
    assert!(path.exists(), "{} is missing: scripts/setup.sh builds it", path.display());
    path
}

/// A blocking wrapper over the guest agent's client
/// ([`tine_agent_client::AgentClient`]) for tests that are not async: it
/// runs the client on a runtime of its own. Agent errors come back typed;
/// any other failure (connection, timeout) panics, as suits a test.
pub struct BlockingAgent {
    runtime: tokio::runtime::Runtime,
    client: std::sync::Arc<tine_agent_client::AgentClient>,
    next_id: u64,
    answers_tx: std::sync::mpsc::Sender<(u64, Result<tine_protocol::Reply, tine_agent_client::ClientError>)>,
    answers: std::sync::mpsc::Receiver<(u64, Result<tine_protocol::Reply, tine_agent_client::ClientError>)>,
}

impl BlockingAgent {
    /// Longest wait for one answer.
    pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

    /// Connects to the agent through the VM's hybrid-vsock socket `uds`
    /// (port [`tine_protocol::AGENT_PORT`]).
    ///
    /// Errors: those of [`tine_agent_client::AgentClient::connect`].
    pub fn connect(uds: &Path) -> Result<Self, tine_agent_client::ClientError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let client = runtime.block_on(tine_agent_client::AgentClient::connect(uds, tine_protocol::AGENT_PORT))?;
        let (answers_tx, answers) = std::sync::mpsc::channel();
        Ok(BlockingAgent { runtime, client: std::sync::Arc::new(client), next_id: 1, answers_tx, answers })
    }

    /// Sends `op` without waiting; returns an id [`BlockingAgent::recv`]
    /// reports its answer under.
    pub fn send(&mut self, op: tine_protocol::Op) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let (client, tx) = (self.client.clone(), self.answers_tx.clone());
        self.runtime.spawn(async move {
            let _ = tx.send((id, client.call(op, Self::CALL_TIMEOUT).await));
        });
        id
    }

    /// The next answer to arrive, whichever request it answers. Panics on
    /// a failure other than the agent's typed errors.
    pub fn recv(&mut self) -> tine_protocol::Response {
        let (id, result) = self.answers.recv().expect("an answer");
        let result = match result {
            Ok(reply) => Ok(reply),
            Err(tine_agent_client::ClientError::Agent(e)) => Err(e),
            Err(e) => panic!("request {id}: {e}"),
        };
        tine_protocol::Response { id, result }
    }

    /// Sends `op` and waits for its answer.
    pub fn call(&mut self, op: tine_protocol::Op) -> Result<tine_protocol::Reply, tine_protocol::AgentError> {
        let id = self.send(op);
        let resp = self.recv();
        assert_eq!(resp.id, id, "an answer to another request");
        resp.result
    }
}

/// Console line the test init prints after its disk check.
pub const INIT_DISK_OK: &str = "TINE-INIT-DISK ok serial=";

/// The byte the host sends at offset `i` of the vsock exchange (as in init.c).
pub fn host_pattern(i: u64) -> u8 {
    (i.wrapping_mul(31).wrapping_add(i >> 9)) as u8
}

/// The byte the guest sends at offset `i` of the vsock exchange.
pub fn guest_pattern(i: u64) -> u8 {
    (i.wrapping_mul(17).wrapping_add(i >> 11).wrapping_add(5)) as u8
}

/// Fills `buf` with `pattern(off + i)`.
fn fill(buf: &mut [u8], off: u64, pattern: fn(u64) -> u8) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(off + i as u64);
    }
}

/// Panics unless `buf[i] == pattern(off + i)` for every `i`.
fn check(buf: &[u8], off: u64, pattern: fn(u64) -> u8, from: &str) {
    for (i, b) in buf.iter().enumerate() {
        assert_eq!(*b, pattern(off + i as u64), "byte {} from the {from}", off + i as u64);
    }
}

/// Timings of one run of the vsock exchange protocol (see init.c).
#[derive(Debug)]
pub struct ExchangeStats {
    /// Bytes each way.
    pub bytes: u64,
    /// Time to send `bytes` to the peer (it checks them).
    pub to_peer: std::time::Duration,
    /// Time to receive and check `bytes` from the peer.
    pub from_peer: std::time::Duration,
    /// 1-byte round trips, sorted.
    pub rtts: Vec<std::time::Duration>,
}

impl ExchangeStats {
    /// MB/s (10^6 bytes) host to peer.
    pub fn to_peer_mbps(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.to_peer.as_secs_f64()
    }
    /// MB/s peer to host.
    pub fn from_peer_mbps(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.from_peer.as_secs_f64()
    }
    /// Median round trip.
    pub fn rtt_median(&self) -> std::time::Duration {
        self.rtts.get(self.rtts.len() / 2).copied().unwrap_or_default()
    }
}

/// The host side of the exchange protocol of init.c's `vsock_exchange`:
/// sends `bytes` of [`host_pattern`], receives `bytes` and checks each
/// against [`guest_pattern`] (panics on a mismatch or early close), then
/// times `pings` 1-byte round trips.
pub fn exchange<S: std::io::Read + std::io::Write>(s: &mut S, bytes: u64, pings: u64) -> ExchangeStats {
    use std::time::Instant;
    let t0 = Instant::now();
    s.write_all(&bytes.to_le_bytes()).unwrap();
    let mut chunk = vec![0u8; 1 << 20];
    let mut off = 0u64;
    while off < bytes {
        let len = (bytes - off).min(chunk.len() as u64) as usize;
        fill(&mut chunk[..len], off, host_pattern);
        s.write_all(&chunk[..len]).unwrap();
        off += len as u64;
    }
    let t1 = Instant::now();
    let mut off = 0u64;
    while off < bytes {
        let want = (bytes - off).min(chunk.len() as u64) as usize;
        let got = s.read(&mut chunk[..want]).unwrap();
        assert!(got > 0, "the peer closed after {off} of {bytes} bytes");
        check(&chunk[..got], off, guest_pattern, "peer");
        off += got as u64;
    }
    let t2 = Instant::now();
    s.write_all(&pings.to_le_bytes()).unwrap();
    let mut rtts = Vec::with_capacity(pings as usize);
    for i in 0..pings {
        let b = [i as u8];
        let t = Instant::now();
        s.write_all(&b).unwrap();
        let mut r = [0u8; 1];
        s.read_exact(&mut r).unwrap();
        rtts.push(t.elapsed());
        assert_eq!(r, b);
    }
    rtts.sort();
    ExchangeStats { bytes, to_peer: t1 - t0, from_peer: t2 - t1, rtts }
}

/// The peer side of the exchange (what init.c does in the guest), for a
/// host-only baseline over a Unix socket pair.
pub fn exchange_peer<S: std::io::Read + std::io::Write>(s: &mut S) {
    let mut n = [0u8; 8];
    s.read_exact(&mut n).unwrap();
    let n = u64::from_le_bytes(n);
    let mut buf = vec![0u8; 64 * 1024];
    let mut off = 0u64;
    while off < n {
        let want = (n - off).min(buf.len() as u64) as usize;
        let got = s.read(&mut buf[..want]).unwrap();
        assert!(got > 0, "the host closed after {off} of {n} bytes");
        check(&buf[..got], off, host_pattern, "host");
        off += got as u64;
    }
    let mut off = 0u64;
    while off < n {
        let len = (n - off).min(buf.len() as u64) as usize;
        fill(&mut buf[..len], off, guest_pattern);
        s.write_all(&buf[..len]).unwrap();
        off += len as u64;
    }
    let mut m = [0u8; 8];
    s.read_exact(&mut m).unwrap();
    for _ in 0..u64::from_le_bytes(m) {
        let mut b = [0u8; 1];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
    }
}

/// Connects to guest vsock `port` through the VM's hybrid-vsock Unix
/// socket `uds` (`CONNECT <port>\n`, then `OK <host port>\n`). Returns the
/// stream and the host port.
pub fn vsock_connect(uds: &Path, port: u32) -> std::io::Result<(std::os::unix::net::UnixStream, u32)> {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(uds)?;
    s.write_all(format!("CONNECT {port}\n").as_bytes())?;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        if s.read(&mut b)? == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "closed before OK"));
        }
        if b[0] == b'\n' {
            break;
        }
        line.push(b[0]);
        if line.len() > 32 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "reply line too long"));
        }
    }
    let line = String::from_utf8_lossy(&line).into_owned();
    let host_port = line
        .strip_prefix("OK ")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("bad reply '{line}'")))?;
    Ok((s, host_port))
}

/// An ELF64 executable with one loadable segment holding `code` at
/// physical and virtual address `addr`, entered at `addr`: a "kernel" that
/// runs exactly these bytes.
pub fn raw_code_elf(code: &[u8], addr: u64) -> Vec<u8> {
    const EHDR: u64 = 64;
    const PHDR: u64 = 56;
    let mut e = Vec::new();
    e.extend_from_slice(b"\x7fELF");
    e.extend_from_slice(&[2, 1, 1, 0]); // 64-bit, little endian, version 1, SysV
    e.extend_from_slice(&[0; 8]);
    e.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e.extend_from_slice(&0x3eu16.to_le_bytes()); // x86-64
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&addr.to_le_bytes()); // e_entry
    e.extend_from_slice(&EHDR.to_le_bytes()); // e_phoff
    e.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    e.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    e.extend_from_slice(&(EHDR as u16).to_le_bytes());
    e.extend_from_slice(&(PHDR as u16).to_le_bytes());
    e.extend_from_slice(&1u16.to_le_bytes()); // e_phnum
    e.extend_from_slice(&64u16.to_le_bytes()); // e_shentsize
    e.extend_from_slice(&0u16.to_le_bytes()); // e_shnum
    e.extend_from_slice(&0u16.to_le_bytes()); // e_shstrndx
    let offset = EHDR + PHDR;
    e.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    e.extend_from_slice(&5u32.to_le_bytes()); // R+X
    e.extend_from_slice(&offset.to_le_bytes());
    e.extend_from_slice(&addr.to_le_bytes()); // p_vaddr
    e.extend_from_slice(&addr.to_le_bytes()); // p_paddr
    e.extend_from_slice(&(code.len() as u64).to_le_bytes());
    e.extend_from_slice(&(code.len() as u64).to_le_bytes());
    e.extend_from_slice(&0x1000u64.to_le_bytes());
    e.extend_from_slice(code);
    e
}
