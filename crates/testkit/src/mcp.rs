//! A real `tine server start` subprocess and a real MCP client (rmcp's
//! Streamable HTTP client over reqwest), for tests and benches.

// MCP logging (`notifications/message`) is in the 2025-11-25 specification the
// server implements; rmcp marks it deprecated for the 2026-07-28 draft (SEP-2577).
#![allow(deprecated)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::sync::{Arc, Mutex};

use rmcp::model::{CallToolRequestParams, CallToolResult, LoggingMessageNotificationParam, ProgressNotificationParam};
use rmcp::service::{NotificationContext, Peer, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::ClientHandler;
use rmcp::{RoleClient, ServiceExt};
use serde_json::Value;

/// A connected MCP client.
pub type McpClient = RunningService<RoleClient, ()>;

/// A connected MCP client that records the server's notifications.
pub type RecordingClient = RunningService<RoleClient, Recorder>;

/// A client handler keeping every `notifications/progress` and
/// `notifications/message` it receives (MCP 2025-11-25, basic/utilities/
/// progress and server/utilities/logging), in arrival order. Clones share
/// the lists.
#[derive(Clone, Default)]
pub struct Recorder {
    /// Progress notifications.
    pub progress: Arc<Mutex<Vec<ProgressNotificationParam>>>,
    /// Log messages.
    pub logs: Arc<Mutex<Vec<LoggingMessageNotificationParam>>>,
}

impl Recorder {
    /// The progress notifications for `token` so far.
    pub fn progress_for(&self, token: &str) -> Vec<ProgressNotificationParam> {
        self.progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|p| p.progress_token.0.to_string() == token)
            .cloned()
            .collect()
    }

    /// Waits up to `timeout` for a log message that `pred` accepts; the
    /// first such message, or `None`.
    pub async fn eventually_logged(
        &self,
        timeout: Duration,
        pred: impl Fn(&LoggingMessageNotificationParam) -> bool,
    ) -> Option<LoggingMessageNotificationParam> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(m) = self.logs.lock().unwrap_or_else(|p| p.into_inner()).iter().find(|m| pred(m)) {
                return Some(m.clone());
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl ClientHandler for Recorder {
    async fn on_progress(&self, params: ProgressNotificationParam, _cx: NotificationContext<RoleClient>) {
        self.progress.lock().unwrap_or_else(|p| p.into_inner()).push(params);
    }

    async fn on_logging_message(&self, params: LoggingMessageNotificationParam, _cx: NotificationContext<RoleClient>) {
        self.logs.lock().unwrap_or_else(|p| p.into_inner()).push(params);
    }
}

/// The `tine` binary, built in release mode by `cargo build -p tine` (for
/// the benches). The tests of crate `tine` must use Cargo's
/// `CARGO_BIN_EXE_tine` instead: `-p tine` unifies features differently
/// from a workspace build, so this relinks `target/release/tine` under
/// the other test binaries of a run.
pub fn tine_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("TINE_BIN").filter(|v| !v.is_empty()) {
        return PathBuf::from(p);
    }
    let root = crate::workspace_root();
    let status = Command::new(env!("CARGO"))
        .current_dir(&root)
        .args(["build", "--release", "-q", "-p", "tine"])
        .status()
        .expect("run cargo build -p tine");
    assert!(status.success(), "cargo build -p tine failed");
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
    target.join("release/tine")
}

/// A running server; SIGTERM and wait on drop.
pub struct TineServer {
    child: Option<Child>,
    /// `http://127.0.0.1:<port>/mcp`.
    pub url: String,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// The data directory.
    pub data_dir: PathBuf,
    /// The bearer token (`None`: `--dev`).
    pub token: Option<String>,
    /// The command that started it, for [`TineServer::restart`].
    command: ServerCommand,
    _dir: tempfile::TempDir,
}

/// How a test server is started (again, after a restart).
struct ServerCommand {
    binary: PathBuf,
    data_dir: PathBuf,
    config_path: PathBuf,
    port: u16,
    token_file: Option<PathBuf>,
    /// Where its standard error is copied as well as to the test's
    /// ([`TineServer::log`]).
    log: PathBuf,
}

impl ServerCommand {
    /// Starts the server and waits until it says it listens.
    fn spawn(&self) -> Child {
        let mut cmd = Command::new(&self.binary);
        cmd.args(["server", "start", "--listen", &format!("127.0.0.1:{}", self.port)])
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--config")
            .arg(&self.config_path)
            .arg("--kernel")
            .arg(crate::kernel())
            .arg("--rootfs")
            .arg(crate::rootfs())
            .env_remove("TINE_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        match &self.token_file {
            Some(f) => cmd.arg("--token-file").arg(f),
            None => cmd.arg("--dev"),
        };
        let mut child = cmd.spawn().expect("spawn tine server");
        // Standard error to the test's and to the log file.
        let mut stderr = child.stderr.take().expect("stderr");
        let mut log =
            std::fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("open the server log");
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            let mut buf = [0u8; 8192];
            while let Ok(n @ 1..) = stderr.read(&mut buf) {
                let _ = std::io::stderr().write_all(&buf[..n]);
                let _ = log.write_all(&buf[..n]);
            }
        });
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        loop {
            match lines.next() {
                Some(Ok(l)) if l.starts_with("tine: listening on") => break,
                Some(Ok(_)) => continue,
                _ => {
                    let status = child.wait();
                    panic!("tine server exited before listening: {status:?}");
                }
            }
        }
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines.by_ref() {});
        child
    }
}

/// How [`TineServer::restart`] stops the server first.
#[derive(Clone, Copy, Debug)]
pub enum Stop {
    /// SIGTERM, as `systemctl restart` does: the server hibernates its
    /// sandboxes and exits.
    Term,
    /// SIGKILL, as an OOM kill or a crash would.
    Kill,
}

/// `config` with `line` (a `key = value` setting) in its `[table]`, placed
/// right after the table's header, or in a `[table]` added at the end when
/// it has none; `config` as it is when some line already sets `key`.
fn with_setting(config: &str, table: &str, key: &str, line: &str) -> String {
    if config.lines().any(|l| l.trim().starts_with(key)) {
        return config.to_string();
    }
    let header = format!("[{table}]");
    let mut out = String::new();
    let mut added = false;
    for l in config.lines() {
        out.push_str(l);
        out.push('\n');
        if !added && l.trim() == header {
            out.push_str(line);
            out.push('\n');
            added = true;
        }
    }
    if !added {
        out.push_str(&format!("{header}\n{line}\n"));
    }
    out
}

/// The sandbox disk (MiB) of the run's shared default template
/// ([`TineServer::start_with_default_template`]): 256, small enough that
/// `storage.rs` fills it in seconds on a sandbox restored from it (a
/// sandbox of another size is a cold boot); with `TINE_TEST_FULL`, the
/// server's default (10 GiB), for `TINE_DISK_TEST_MIB` past the guest's
/// RAM. No other test writes more than a few MiB to a sandbox's root.
pub fn shared_disk_mib() -> u64 {
    if crate::full_size() {
        10240
    } else {
        256
    }
}

/// `config` as the run's seeded servers have it: `[limits]
/// default_disk_mib` of [`shared_disk_mib`] unless `config` names a size.
pub fn shared_setup(config: &str) -> String {
    let line = format!("default_disk_mib = {}", shared_disk_mib());
    with_setting(config, "limits", "default_disk_mib", &line)
}

/// A TCP port free on 127.0.0.1 now (the kernel's pick).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("bind a free port").port()
}

/// The server the tests of one test binary share
/// ([`TineServer::shared`]).
static SHARED: Mutex<Option<Arc<TineServer>>> = Mutex::new(None);

extern "C" fn stop_shared() {
    let server = SHARED.lock().unwrap_or_else(|p| p.into_inner()).take();
    drop(server);
}

impl TineServer {
    /// Starts `binary server start` with a fresh data directory, the test
    /// kernel and rootfs, and `config` (TOML) as its configuration file;
    /// `token`: bearer auth with that token, else `--dev`; without a
    /// `[pool]` table in `config`, the warm pool is off. Returns once the
    /// server says it listens.
    pub fn start(binary: &Path, token: Option<&str>, config: &str) -> TineServer {
        Self::start_seeded(binary, token, config, None, free_port())
    }

    /// [`TineServer::start`], listening on 127.0.0.1:`port` (for a
    /// configuration that names the server's own URL, such as
    /// `[auth.oauth] resource`).
    pub fn start_on(binary: &Path, token: Option<&str>, config: &str, port: u16) -> TineServer {
        Self::start_seeded(binary, token, config, None, port)
    }

    /// Like [`TineServer::start`], then waits for the default template;
    /// but when an earlier server of this test run (same `binary`, kernel
    /// and rootfs, by file identity, and the same guest set-up in `config`:
    /// its CA certificates) built one, its copy is put in the new
    /// data directory first, so the server loads it (checking its
    /// checksums and image identities, and rebuilding it if they do not
    /// match) instead of a cold boot of a minute or more. `config` gets the
    /// host's CA bundle and the run's disk size ([`shared_setup`]) unless
    /// it names its own, so that the servers of a run share one build. Tests that are
    /// about the default template's build use [`TineServer::start_cold`]
    /// (whose build is the run's copy when it comes first) or
    /// [`TineServer::start`].
    ///
    /// Test binaries run at the same time (scripts/run-tests.py): a lock
    /// file beside the copies makes the first server build while the
    /// others wait for its copy, and keeps a copy from being replaced while
    /// another server copies it.
    pub fn start_with_default_template(binary: &Path, token: Option<&str>, config: &str) -> TineServer {
        Self::start_with_default_template_on(binary, token, config, free_port())
    }

    /// The `--dev` server with the default template that every test of
    /// this test binary shares: started by the first that asks
    /// ([`TineServer::start_with_default_template`] with `config`, which
    /// every caller passes the same), stopped when the binary exits (an
    /// `atexit` handler: libtest has no teardown). Each test makes its own
    /// sandboxes.
    pub fn shared(binary: &Path, config: &str) -> Arc<TineServer> {
        let mut slot = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = slot.as_ref() {
            return s.clone();
        }
        let s = Arc::new(TineServer::start_with_default_template(binary, None, config));
        // SAFETY: atexit(3) registers a function without arguments that
        // runs once at the process's normal exit; `stop_shared` only
        // touches Rust statics.
        unsafe { libc::atexit(stop_shared) };
        *slot = Some(s.clone());
        s
    }

    /// [`TineServer::start_with_default_template`], listening on
    /// 127.0.0.1:`port`.
    pub fn start_with_default_template_on(binary: &Path, token: Option<&str>, config: &str, port: u16) -> TineServer {
        let config = &shared_setup(config);
        let seed = default_template_seed(binary, config);
        let _lock = crate::lock_file(&seed_lock(&seed));
        let seeded = seed.join("template.json").exists();
        let server = Self::start_seeded(binary, token, config, seeded.then_some(seed.as_path()), port);
        server.wait_for_default_template(Duration::from_secs(1200));
        if !seeded {
            keep_seed(&server.data_dir.join("templates/default"), &seed);
        }
        server
    }

    /// [`TineServer::start`] for a test of the default template's build
    /// (a cold boot at the server's start, which the server always does
    /// here), with the guest set-up of
    /// [`TineServer::start_with_default_template`] (`config` with the
    /// host's CA bundle). When this test run has no copy of that template
    /// yet, the build becomes the run's copy: the returned
    /// [`SharedTemplate`] holds the lock that servers wanting the copy wait
    /// on until [`SharedTemplate::share`] (or its drop), so that the run
    /// builds the default template once.
    pub fn start_cold(binary: &Path, token: Option<&str>, config: &str) -> (TineServer, SharedTemplate) {
        let config = &shared_setup(config);
        let seed = default_template_seed(binary, config);
        let lock = crate::lock_file(&seed_lock(&seed));
        let lock = (!seed.join("template.json").exists()).then_some(lock);
        let server = Self::start_seeded(binary, token, config, None, free_port());
        (server, SharedTemplate { seed, lock })
    }

    /// [`TineServer::start`], with `default_template` (a template
    /// directory) copied in as the data directory's default template.
    fn start_seeded(
        binary: &Path,
        token: Option<&str>,
        config: &str,
        default_template: Option<&Path>,
        port: u16,
    ) -> TineServer {
        let dir = tempfile::Builder::new().prefix("tine-srv").tempdir_in("/tmp").expect("temp dir");
        let data_dir = dir.path().join("data");
        if let Some(seed) = default_template {
            let templates = data_dir.join("templates");
            std::fs::create_dir_all(&templates).expect("make the templates directory");
            assert!(copy_dir(seed, &templates.join("default")), "copy the default template from {}", seed.display());
        }
        let config_path = dir.path().join("tine.toml");
        // The warm pool (on by default) restores sandboxes in the
        // background; a test that does not name it runs without one, so
        // its guests do not compete with idle pooled ones for the CPUs.
        let config =
            if config.contains("[pool]") { config.to_string() } else { format!("{config}\n[pool]\nsize = 0\n") };
        std::fs::write(&config_path, config).expect("write config");
        let token_file = token.map(|t| {
            let f = dir.path().join("token");
            std::fs::write(&f, t).expect("write token");
            // The server refuses token files others can read.
            std::fs::set_permissions(&f, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod");
            f
        });
        let log = dir.path().join("server.log");
        let command = ServerCommand {
            binary: binary.to_path_buf(),
            data_dir: data_dir.clone(),
            config_path,
            port,
            token_file,
            log,
        };
        let child = command.spawn();
        TineServer {
            child: Some(child),
            url: format!("http://127.0.0.1:{port}/mcp"),
            base: format!("http://127.0.0.1:{port}"),
            data_dir,
            token: token.map(str::to_string),
            command,
            _dir: dir,
        }
    }

    /// What the server wrote to its standard error so far (its log, from
    /// its first start on).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.command.log).unwrap_or_default()
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// The server's resident memory outside guest RAM (bytes):
    /// [`own_rss_kib`] of its process.
    pub fn own_rss_bytes(&self) -> u64 {
        own_rss_kib(self.pid()) * 1024
    }

    /// Waits until the server's background build of the default template
    /// (a cold boot, started with the server) has written the template and
    /// removed its build VM's directory; panics after `timeout`, or as
    /// soon as a build was seen to end without a template (the server has
    /// logged why; it does not retry). Tests that count the server's VMs or
    /// files take their baseline after this.
    pub fn wait_for_default_template(&self, timeout: Duration) {
        let meta = self.data_dir.join("templates/default/template.json");
        let building = || {
            std::fs::read_dir(self.data_dir.join("sandboxes"))
                .map(|d| d.flatten().any(|e| e.file_name().to_string_lossy().starts_with("template-")))
                .unwrap_or(false)
        };
        let t = Instant::now();
        let mut seen_building = false;
        loop {
            let now_building = building();
            if meta.exists() && !now_building {
                return;
            }
            // The template is written before its build VM's directory goes.
            assert!(
                !(seen_building && !now_building && !meta.exists()),
                "the server's default template build failed after {:.0} s (its log above says why)",
                t.elapsed().as_secs_f64()
            );
            seen_building |= now_building;
            assert!(t.elapsed() < timeout, "no default template within {timeout:?} of the server's start");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `GET /healthz` with the server's token (so it answers in full), as
    /// JSON; panics when the server does not answer 200 with JSON.
    pub fn healthz(&self) -> Value {
        use std::io::{Read, Write};
        let addr = self.base.trim_start_matches("http://").to_string();
        let mut s = std::net::TcpStream::connect(&addr).expect("connect to the server");
        s.set_read_timeout(Some(Duration::from_secs(30))).expect("read timeout");
        let auth = self.token.as_ref().map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
        write!(s, "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n").expect("send");
        let mut resp = String::new();
        s.read_to_string(&mut resp).expect("read the answer");
        assert!(resp.starts_with("HTTP/1.1 200"), "GET /healthz: {resp}");
        let body = resp.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or_default();
        serde_json::from_str(body).unwrap_or_else(|e| panic!("GET /healthz body {body:?}: {e}"))
    }

    /// Waits until `/healthz` shows the warm pool with `ready` sandboxes
    /// ready; panics after `timeout` with the last answer.
    pub fn wait_for_pool(&self, ready: u64, timeout: Duration) {
        let t = Instant::now();
        loop {
            let h = self.healthz();
            if h["pool"]["ready"].as_u64() == Some(ready) {
                return;
            }
            assert!(t.elapsed() < timeout, "the pool did not reach {ready} ready in {timeout:?}: {h}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Connects and initializes a new MCP session.
    pub async fn client(&self) -> McpClient {
        connect(&self.url, self.token.as_deref()).await
    }

    /// A client that records the server's progress and log notifications
    /// (see [`Recorder`]), and the recorder.
    pub async fn recording_client(&self) -> (RecordingClient, Recorder) {
        let mut config = StreamableHttpClientTransportConfig::with_uri(self.url.clone());
        if let Some(t) = &self.token {
            config = config.auth_header(t.clone());
        }
        let recorder = Recorder::default();
        let client =
            recorder.clone().serve(StreamableHttpClientTransport::from_config(config)).await.expect("MCP initialize");
        (client, recorder)
    }

    /// Stops the server (`stop`) and starts it again on the same data
    /// directory, configuration, port and token; returns the stopped
    /// server's exit status and how long its stop took.
    pub fn restart(&mut self, stop: Stop) -> (std::process::ExitStatus, Duration) {
        let mut child = self.child.take().expect("server already stopped");
        let t = Instant::now();
        let status = match stop {
            Stop::Term => sigterm_and_wait(child, Duration::from_secs(120))
                .unwrap_or_else(|| panic!("the server did not exit within 120 s of SIGTERM")),
            Stop::Kill => {
                child.kill().expect("SIGKILL the server");
                child.wait().expect("wait for the server")
            }
        };
        let took = t.elapsed();
        self.child = Some(self.command.spawn());
        (status, took)
    }

    /// Sends SIGTERM and waits (up to 120 s) for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let child = self.child.take().expect("server already stopped");
        sigterm_and_wait(child, Duration::from_secs(120))
            .unwrap_or_else(|| panic!("the server did not exit within 120 s of SIGTERM"))
    }
}

/// Resident memory of process `pid` outside guest RAM (KiB): the sum of
/// `Rss` over its mappings (proc(5) `smaps`) but those of guest memory
/// (memfds named `tine-*`: guest RAM, loaded templates, branch points; a
/// template's `memory` file mapped copy-on-write). 0 when the process is
/// gone.
pub fn own_rss_kib(pid: u32) -> u64 {
    let Ok(smaps) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) else { return 0 };
    let mut guest = false;
    let mut total = 0;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or_default();
        if first.contains('-') && first.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
            let path = line.split_whitespace().nth(5).unwrap_or_default();
            guest = path.starts_with("/memfd:tine-") || path.ends_with("/memory");
        } else if first == "Rss:" && !guest {
            total += words.next().and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
        }
    }
    total
}

/// Where this test run keeps a copy of the default template built by
/// `binary` from the test kernel and rootfs for servers of `config`: next
/// to the binary, in a directory per guest set-up (the configuration's
/// lines that change the default template's guest: the
/// network's `enabled` and the sandbox disk's `default_disk_mib`; "plain"
/// when it has none), under a key made
/// of the three files' identities (size, mtime, inode). A seed that does
/// not fit after all (another bundle behind the same path, say) is found
/// stale by the server, which rebuilds it. The sandbox manager's own tests
/// (crate tine-sandbox) share it: their manager has the seeded servers'
/// guest set-up, and `binary` is where cargo puts `tine` beside them.
pub fn default_template_seed(binary: &Path, config: &str) -> PathBuf {
    use std::hash::{Hash, Hasher};
    use std::os::unix::fs::MetadataExt;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for f in [binary.to_path_buf(), crate::kernel(), crate::rootfs()] {
        f.hash(&mut h);
        if let Ok(m) = std::fs::metadata(&f) {
            (m.len(), m.mtime(), m.mtime_nsec(), m.ino()).hash(&mut h);
        }
    }
    let variant = setup_variant(config);
    let dir = binary.parent().unwrap_or(Path::new("/tmp")).join("tine-test-templates").join(variant);
    dir.join(format!("{:016x}", h.finish()))
}

/// The directory name of `config`'s guest set-up among the copies of
/// [`default_template_seed`]: a hash of its lines that change the default
/// template's guest, in sorted order (where [`shared_setup`] puts its
/// lines depends on the tables the configuration has, not the guest).
fn setup_variant(config: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut setup: Vec<&str> = config
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("enabled") || l.starts_with("default_disk_mib"))
        .collect();
    setup.sort_unstable();
    if setup.is_empty() {
        return "plain".to_string();
    }
    let mut v = std::collections::hash_map::DefaultHasher::new();
    setup.hash(&mut v);
    format!("setup-{:016x}", v.finish())
}

/// The run's copy of the default template, claimed by a server that
/// builds it cold ([`TineServer::start_cold`]).
pub struct SharedTemplate {
    /// Where the copy goes ([`default_template_seed`]).
    seed: PathBuf,
    /// The lock beside it, held when there was no copy: servers that want
    /// one wait for this build's.
    lock: Option<std::fs::File>,
}

impl SharedTemplate {
    /// Whether this build becomes the run's copy (there was none).
    pub fn is_first(&self) -> bool {
        self.lock.is_some()
    }

    /// Waits for `server`'s default template; when this build is the
    /// run's first, keeps a copy of it for the run's later servers and
    /// lets them go on.
    pub fn share(self, server: &TineServer) {
        server.wait_for_default_template(Duration::from_secs(1200));
        if self.lock.is_some() {
            keep_seed(&server.data_dir.join("templates/default"), &self.seed);
        }
    }
}

/// The lock file of the copies beside `seed` (one per guest set-up).
/// Whoever looks for a copy or makes one holds it: test binaries run at
/// the same time.
pub fn seed_lock(seed: &Path) -> PathBuf {
    seed.parent().expect("seed parent").with_extension("lock")
}

/// Keeps a copy of `template` (a default template's directory) at `seed`
/// for the run's next servers and managers; its caller holds the lock of
/// [`seed_lock`]. Only the newest key is kept.
pub fn keep_seed(template: &Path, seed: &Path) {
    let parent = seed.parent().expect("seed parent");
    if let Ok(d) = std::fs::read_dir(parent) {
        for e in d.flatten() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    let tmp = parent.join(format!(".tmp-{}", std::process::id()));
    let _ = std::fs::create_dir_all(parent);
    if copy_dir(template, &tmp) {
        let _ = std::fs::rename(&tmp, seed);
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Copies directory `from` to `to` (which must not exist), keeping sparse
/// files sparse (`cp -a --sparse=always`); whether it worked.
pub fn copy_dir(from: &Path, to: &Path) -> bool {
    Command::new("cp").arg("-a").arg("--sparse=always").arg(from).arg(to).status().is_ok_and(|s| s.success())
}

/// Sends SIGTERM to `child` and waits up to `timeout` for it; kills it
/// (and returns `None`) if it is still there then.
fn sigterm_and_wait(mut child: Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

impl Drop for TineServer {
    fn drop(&mut self) {
        if let Some(child) = self.child.take() {
            sigterm_and_wait(child, Duration::from_secs(60));
        }
    }
}

/// Connects to the MCP endpoint `url` (with bearer `token`, if any) and
/// initializes a new session; panics when that fails.
pub async fn connect(url: &str, token: Option<&str>) -> McpClient {
    let mut config = StreamableHttpClientTransportConfig::with_uri(url.to_string());
    if let Some(t) = token {
        config = config.auth_header(t.to_string());
    }
    let transport = StreamableHttpClientTransport::from_config(config);
    ().serve(transport).await.unwrap_or_else(|e| panic!("MCP initialize at {url}: {e}"))
}

/// Calls a tool; `Err(text)` for a tool error (`isError`), panics on a
/// protocol error.
pub async fn call(client: &Peer<RoleClient>, tool: &str, args: Value) -> Result<Value, String> {
    let r = try_call(client, tool, args).await.unwrap_or_else(|e| panic!("{tool}: protocol error: {e}"));
    tool_value(tool, r)
}

/// The text of file `path` in sandbox `id` (`sandbox_files_read`, up to
/// the tool's read limit), read by the agent: no process starts, where a
/// `cat` costs seconds in a guest whose kernel is emulated
/// (docs/hosts.md). Resumes a hibernated sandbox as any call does. Panics
/// on a tool error, naming the file.
pub async fn read_file(client: &Peer<RoleClient>, id: &str, path: &str) -> String {
    let r = call(client, "sandbox_files_read", serde_json::json!({"sandbox_id": id, "path": path})).await;
    r.unwrap_or_else(|e| panic!("read {path} in {id}: {e}"))["content"].as_str().unwrap_or_default().to_string()
}

/// Calls a tool and returns its result (as [`call`]) with the request's
/// progress token (`_meta.progressToken`, as text): rmcp gives every
/// request a token of its own and replaces any set by the caller, so the
/// token to look for in a [`Recorder`] is the one it chose.
pub async fn call_with_progress(client: &Peer<RoleClient>, tool: &str, args: Value) -> (Result<Value, String>, String) {
    let request =
        rmcp::model::ClientRequest::CallToolRequest(rmcp::model::CallToolRequest::new(tool_params(tool, args)));
    let handle = client
        .send_request_with_option(request, rmcp::service::PeerRequestOptions::no_options())
        .await
        .unwrap_or_else(|e| panic!("{tool}: protocol error: {e}"));
    let token = handle.progress_token.0.to_string();
    let r = match handle.await_response().await.unwrap_or_else(|e| panic!("{tool}: protocol error: {e}")) {
        rmcp::model::ServerResult::CallToolResult(r) => r,
        other => panic!("{tool}: unexpected response {other:?}"),
    };
    (tool_value(tool, r), token)
}

/// Calls a tool and returns the raw result or the protocol error.
pub async fn try_call(
    client: &Peer<RoleClient>,
    tool: &str,
    args: Value,
) -> Result<CallToolResult, rmcp::ServiceError> {
    client.call_tool(tool_params(tool, args)).await
}

fn tool_params(tool: &str, args: Value) -> CallToolRequestParams {
    let args = match args {
        Value::Object(m) => m,
        Value::Null => Default::default(),
        other => panic!("tool arguments must be an object, got {other}"),
    };
    CallToolRequestParams::new(tool.to_string()).with_arguments(args)
}

/// A tool result's structured content, or its error text.
pub fn tool_value(tool: &str, r: CallToolResult) -> Result<Value, String> {
    let text = r.content.iter().filter_map(|c| c.as_text().map(|t| t.text.clone())).collect::<Vec<_>>().join("\n");
    if r.is_error == Some(true) {
        return Err(text);
    }
    Ok(r.structured_content.unwrap_or_else(|| panic!("{tool}: no structuredContent in {text}")))
}

/// The Python interpreter of the venv with the official MCP Python SDK
/// (`mcp` 2.3, made by `scripts/setup.sh`): `$TINE_PY_VENV/bin/python`,
/// else `~/.cache/tine/venv/bin/python` (`$XDG_CACHE_HOME` honoured).
///
/// `None` with a loud SKIPPED line naming `test` when there is none,
/// unless `$TINE_REQUIRE_PY_SDK` or `$CI` is set (scripts/test.sh sets
/// the first): then it panics, so the test cannot silently pass there.
pub fn python_sdk(test: &str) -> Option<PathBuf> {
    let venv = cache_tool("TINE_PY_VENV", "venv");
    let python = venv.join("bin/python");
    let has_sdk = Command::new(&python)
        .args(["-c", "import importlib.metadata as m, sys; sys.exit(not m.version('mcp').startswith('2.3.'))"])
        .status()
        .is_ok_and(|s| s.success());
    if has_sdk {
        return Some(python);
    }
    skip_unless_required(
        test,
        &format!("no venv with the MCP Python SDK 2.3 at {} (run scripts/setup.sh)", venv.display()),
    )
}

/// The venv of [`python_sdk`] (same place) when Python package `package`
/// is installed there at exactly `version` (`scripts/setup.sh` pins it):
/// the venv's directory. `None` with a loud SKIPPED line naming `test`
/// otherwise, or a panic where the tools must be there (as [`python_sdk`]).
pub fn python_venv_with(test: &str, package: &str, version: &str) -> Option<PathBuf> {
    let venv = cache_tool("TINE_PY_VENV", "venv");
    let check = format!("import importlib.metadata as m, sys; sys.exit(m.version({package:?}) != {version:?})");
    if Command::new(venv.join("bin/python")).args(["-c", &check]).status().is_ok_and(|s| s.success()) {
        return Some(venv);
    }
    skip_unless_required(
        test,
        &format!("no venv with {package} {version} at {} (run scripts/setup.sh)", venv.display()),
    )
}

/// `$var` if set, else `~/.cache/tine/<name>` (`$XDG_CACHE_HOME` honoured):
/// where scripts/setup.sh puts the client tools.
fn cache_tool(var: &str, name: &str) -> PathBuf {
    std::env::var_os(var).filter(|v| !v.is_empty()).map(PathBuf::from).unwrap_or_else(|| {
        let cache = std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache"));
        cache.join("tine").join(name)
    })
}

/// `None` after a loud SKIPPED line, or a panic where the tools must be
/// there (`$TINE_REQUIRE_PY_SDK` or `$CI` set, as scripts/test.sh does).
fn skip_unless_required<T>(test: &str, why: &str) -> Option<T> {
    let required = ["TINE_REQUIRE_PY_SDK", "CI"].iter().any(|v| std::env::var_os(v).is_some_and(|v| !v.is_empty()));
    assert!(!required, "{test}: {why}");
    eprintln!("\n!!!!!!!! SKIPPED {test}: {why} !!!!!!!!\n");
    None
}

/// The official MCP conformance suite's command (npm package
/// `@modelcontextprotocol/conformance`, installed by `scripts/setup.sh` at
/// `$TINE_CONFORMANCE` or `~/.cache/tine/conformance`). `None` with a loud
/// SKIPPED line when it is missing, unless required (as [`python_sdk`]).
pub fn conformance_suite(test: &str) -> Option<PathBuf> {
    let dir = cache_tool("TINE_CONFORMANCE", "conformance");
    let bin = dir.join("node_modules/.bin/conformance");
    if bin.exists() {
        return Some(bin);
    }
    skip_unless_required(test, &format!("no MCP conformance suite at {} (run scripts/setup.sh)", dir.display()))
}

/// The official MCP TypeScript SDK's install (npm package
/// `@modelcontextprotocol/sdk` 1.32.2, installed by `scripts/setup.sh` at
/// `$TINE_TS_SDK` or `~/.cache/tine/ts-sdk`): its `node_modules`
/// directory, for `NODE_PATH`. `None` with a loud SKIPPED line when it is
/// missing, unless required (as [`python_sdk`]).
pub fn typescript_sdk(test: &str) -> Option<PathBuf> {
    let dir = cache_tool("TINE_TS_SDK", "ts-sdk").join("node_modules");
    let package = dir.join("@modelcontextprotocol/sdk/package.json");
    let version = std::fs::read_to_string(&package)
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v["version"].as_str().map(str::to_string));
    if version.as_deref() == Some("1.32.2") {
        return Some(dir);
    }
    skip_unless_required(test, &format!("no MCP TypeScript SDK 1.32.2 at {} (run scripts/setup.sh)", dir.display()))
}

/// Runs one server scenario of the conformance suite (`bin server --url
/// URL --scenario S`, at most 120 s). `Ok(output)` when it passed; `Err`
/// with its output when it failed, did not end in time or did not start.
pub fn run_conformance_scenario(bin: &Path, url: &str, scenario: &str) -> Result<String, String> {
    // coreutils' timeout: the scenario's own waits are shorter; this bounds a hang.
    let out = Command::new("timeout")
        .arg("120")
        .arg(bin)
        .args(["server", "--url", url, "--scenario", scenario])
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    match out.status.code() {
        Some(0) if text.contains(" 0 failed") => Ok(text),
        Some(124) => Err(format!("scenario {scenario} did not end within 120 s:\n{text}")),
        _ => Err(format!("scenario {scenario} failed ({}):\n{text}", out.status)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(config: &str) -> Vec<String> {
        let t: toml::Table = config.parse().expect("valid TOML");
        let l = t.get("limits").and_then(|l| l.as_table()).cloned().unwrap_or_default();
        l.iter().map(|(k, v)| format!("{k}={v}")).collect()
    }

    #[test]
    fn shared_setup_adds_the_disk_size_once() {
        let disk = format!("default_disk_mib={}", shared_disk_mib());
        let c = shared_setup("[limits]\nboot_timeout_secs = 1200\n[pool]\nsize = 0");
        assert_eq!(limits(&c), ["boot_timeout_secs=1200".to_string(), disk.clone()], "{c}");
        let c = shared_setup("[pool]\nsize = 0");
        assert_eq!(limits(&c), std::slice::from_ref(&disk), "{c}");
        assert_eq!(limits(&shared_setup("")), [disk], "a config with no tables");
        let own = shared_setup("[limits]\ndefault_disk_mib = 512\n");
        assert_eq!(limits(&own), ["default_disk_mib=512".to_string()], "{own}");
    }

    #[test]
    fn configurations_of_one_guest_set_up_share_a_seed() {
        let seed = |c: &str| setup_variant(&shared_setup(c));
        let plain = seed("");
        // network.rs's: a [network] table and a sub-table after it.
        let network = "[network]\npermit_ranges = [\"127.0.0.0/8\"]\nmax_connections = 32\n\
                       [network.hosts]\n\"files.test\" = \"10.0.2.2\"\n";
        for c in
            ["[limits]\nboot_timeout_secs = 1200\n", "[pool]\nsize = 2\n", "[network]\negress = \"deny\"\n", network]
        {
            assert_eq!(seed(c), plain, "{c}");
        }
        assert_ne!(seed("[limits]\ndefault_disk_mib = 512\n"), plain);
    }
}
