//! A fake VM backend for unit tests: no KVM, no kernel, no guest. A fake
//! VM's "agent" is a thread answering the agent protocol (`tine_protocol`
//! framing, after the hybrid-vsock `CONNECT <port>` handshake) on the Unix
//! socket the manager connects to. Its guest has a tiny in-memory file
//! system and a background process table (entries only, no processes),
//! which a branch point copies and a snapshot leaves alone; tests can make
//! a start fail or a guest crash. `ExecWithProgress` and `ProcessWait`
//! with progress send two fixed progress frames before their answer.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tine_protocol::{
    read_message, write_message, AgentError, AgentInfo, CellReply, Command, ExecReply, ExitStatus, FileData, Op,
    Output, ProcessInfo, ProcessOutput, ProcessWaited, Progress, Reply, Request, Response, StreamState, WaitOutcome,
    MAX_PROCESSES,
};
use vmm::BranchMode;

use super::backend::{
    BackendError, Base, BranchPoint, ExitWatch, Hibernation, VmBackend, VmEnd, VmHandle, VmSource, VmSpec,
};
use crate::lock;

/// A fake guest's files: path -> contents.
type Files = BTreeMap<String, Vec<u8>>;

/// A fake guest's background process table.
#[derive(Clone, Debug)]
struct Procs {
    next_id: u64,
    table: BTreeMap<u64, ProcessInfo>,
}

impl Default for Procs {
    fn default() -> Self {
        Procs { next_id: 1, table: BTreeMap::new() }
    }
}

/// What a fake branch point holds: the guest's files and process table.
type Image = (Files, Procs);

/// The file a fake hibernation writes: the guest's files as JSON.
pub(crate) const FAKE_HIBERNATION: &str = "fake-hibernation.json";

/// Starts fake VMs; tests reach them by name (the sandbox id).
#[derive(Default)]
pub(crate) struct FakeBackend {
    /// Starts still to fail.
    fail_starts: AtomicUsize,
    /// Hibernations still to fail (as a full disk would).
    fail_hibernations: Arc<AtomicUsize>,
    /// Every VM started, by name.
    vms: Mutex<BTreeMap<String, Arc<Shared>>>,
    /// What every VM holds of its own (MiB); 0: unknown.
    own_mib: Arc<std::sync::atomic::AtomicU64>,
}

impl FakeBackend {
    /// Makes the next `n` hibernations fail with ENOSPC.
    pub fn fail_next_hibernations(&self, n: usize) {
        self.fail_hibernations.store(n, Ordering::SeqCst);
    }

    /// Makes every VM report `mib` MiB of its own memory (0: unknown).
    pub fn set_own_memory_mib(&self, mib: u64) {
        self.own_mib.store(mib, Ordering::SeqCst);
    }

    /// Makes the next `n` starts fail.
    pub fn fail_next_starts(&self, n: usize) {
        self.fail_starts.store(n, Ordering::SeqCst);
    }

    /// Makes VM `name`'s guest crash (a guest fault), as a kernel panic would.
    pub fn crash(&self, name: &str) {
        let vm = lock(&self.vms).get(name).cloned().expect("a fake VM of that name");
        vm.end(Some(VmEnd::GuestFault("the fake guest crashed".into())));
    }

    /// How many fake VMs have not ended.
    pub fn live_vms(&self) -> usize {
        lock(&self.vms).values().filter(|vm| !vm.is_ended()).count()
    }

    /// VM `name`'s host environment (`Op::SetHostEnv`) as last set.
    pub fn host_env(&self, name: &str) -> Vec<(String, String)> {
        lock(&self.vms).get(name).map(|vm| lock(&vm.host_env).clone()).unwrap_or_default()
    }

    /// Whether VM `name`'s vCPUs are parked.
    pub fn is_paused(&self, name: &str) -> bool {
        lock(&self.vms).get(name).is_some_and(|vm| vm.paused.load(Ordering::SeqCst))
    }
}

impl VmBackend for FakeBackend {
    fn start(&self, spec: &VmSpec, source: &VmSource) -> Result<Box<dyn VmHandle>, BackendError> {
        let failing = self.fail_starts.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if failing.is_ok() {
            return Err(BackendError::new(std::io::Error::other("the fake VM refused to start")));
        }
        let (files, procs) = match source {
            VmSource::Boot | VmSource::Template(_) => Image::default(),
            VmSource::Branch(image) => image
                .downcast_ref::<Image>()
                .cloned()
                .ok_or_else(|| BackendError::new(std::io::Error::other("not a fake branch point")))?,
            // A fake hibernation keeps the guest's files, not its processes.
            VmSource::Hibernated { dir, .. } => {
                let bytes = std::fs::read(dir.join(FAKE_HIBERNATION)).map_err(BackendError::new)?;
                let files: Files = serde_json::from_slice(&bytes).map_err(BackendError::new)?;
                (files, Procs::default())
            }
        };
        let listener = UnixListener::bind(&spec.agent_socket).map_err(BackendError::new)?;
        let shared = Arc::new(Shared {
            memory_bytes: spec.memory_mib << 20,
            files: Mutex::new(files),
            procs: Mutex::new(procs),
            ..Shared::default()
        });
        let agent = shared.clone();
        std::thread::Builder::new()
            .name(format!("fake-agent-{}", spec.name))
            .spawn(move || agent.serve(listener))
            .map_err(BackendError::new)?;
        lock(&self.vms).insert(spec.name.clone(), shared.clone());
        Ok(Box::new(FakeVm {
            shared,
            started: Instant::now(),
            agent_socket: spec.agent_socket.clone(),
            fail_hibernations: self.fail_hibernations.clone(),
            own_mib: self.own_mib.clone(),
        }))
    }
}

/// What a fake VM and its agent share.
#[derive(Default)]
struct Shared {
    /// How it ended, once it did.
    end: Mutex<Option<VmEnd>>,
    ended: Condvar,
    paused: AtomicBool,
    memory_bytes: u64,
    files: Mutex<Files>,
    procs: Mutex<Procs>,
    /// The host environment the agent was given.
    host_env: Mutex<Vec<(String, String)>>,
    /// The agent's connections, shut down when the VM ends.
    connections: Mutex<Vec<UnixStream>>,
}

impl Shared {
    /// Ends the VM (if it has not ended): records `end`, wakes the
    /// watchers and cuts the agent's connections.
    fn end(&self, end: Option<VmEnd>) {
        let mut e = lock(&self.end);
        if e.is_none() {
            *e = Some(end.unwrap_or(VmEnd::Stopped));
        }
        self.ended.notify_all();
        drop(e);
        for c in lock(&self.connections).drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }

    fn is_ended(&self) -> bool {
        lock(&self.end).is_some()
    }

    /// Accepts connections until the VM ends.
    fn serve(self: Arc<Self>, listener: UnixListener) {
        for stream in listener.incoming() {
            if self.is_ended() {
                return;
            }
            let Ok(stream) = stream else { return };
            if let Ok(c) = stream.try_clone() {
                lock(&self.connections).push(c);
            }
            let me = self.clone();
            std::thread::spawn(move || me.connection(stream));
        }
    }

    /// One connection: the handshake, then requests until it closes.
    fn connection(&self, stream: UnixStream) {
        let Ok(mut writer) = stream.try_clone() else { return };
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        if reader.read_line(&mut line).is_err() || !line.starts_with("CONNECT ") {
            return;
        }
        if writer.write_all(b"OK 1073741824\n").is_err() {
            return;
        }
        while let Ok(Request { id, op }) = read_message::<_, Request>(&mut reader) {
            let mut progress = |p: Progress| {
                let _ = write_message(&mut writer, &Response { id, result: Ok(Reply::Progress(p)) });
            };
            let result = self.answer(op, &mut progress);
            if write_message(&mut writer, &Response { id, result }).is_err() {
                return;
            }
        }
    }

    /// The fake guest's answer to `op`; interim frames go to `progress`.
    fn answer(&self, op: Op, progress: &mut dyn FnMut(Progress)) -> Result<Reply, AgentError> {
        let output = |data: Vec<u8>| Output { total_bytes: data.len() as u64, data, truncated: false };
        let two_frames = |progress: &mut dyn FnMut(Progress)| {
            for (elapsed_ms, tail) in [(2000, &b"line1\n"[..]), (4000, &b"line1\nline2\n"[..])] {
                progress(Progress {
                    elapsed_ms,
                    stdout_bytes: tail.len() as u64,
                    stderr_bytes: 0,
                    stdout_tail: tail.to_vec(),
                    stderr_tail: Vec::new(),
                });
            }
        };
        let entry = |id: u64| lock(&self.procs).table.get(&id).cloned().ok_or(AgentError::NoSuchProcess { id });
        Ok(match op {
            Op::ExecWithProgress { exec, .. } => {
                two_frames(progress);
                return self.answer(Op::Exec(exec), progress);
            }
            Op::Spawn(sp) => {
                let mut procs = lock(&self.procs);
                if procs.table.len() >= MAX_PROCESSES {
                    return Err(AgentError::TooManyProcesses { max: MAX_PROCESSES as u32 });
                }
                let id = procs.next_id;
                procs.next_id += 1;
                let command = match sp.command {
                    Command::Shell(s) => s,
                    Command::Argv(a) => a.join(" "),
                };
                let info = ProcessInfo {
                    id,
                    command,
                    pid: 100 + id as i32,
                    status: None,
                    group_alive: true,
                    started_unix_ms: 1,
                    ended_unix_ms: None,
                    stdout: StreamState::default(),
                    stderr: StreamState::default(),
                    stdin_open: !sp.close_stdin,
                };
                procs.table.insert(id, info.clone());
                Reply::Process(info)
            }
            Op::ProcessList => Reply::Processes(lock(&self.procs).table.values().cloned().collect()),
            Op::ProcessOutput(r) => Reply::ProcessOutput(ProcessOutput {
                info: entry(r.id)?,
                stream: r.stream,
                offset: 0,
                data: Vec::new(),
                skipped: 0,
            }),
            Op::ProcessWait(w) => {
                let info = entry(w.id)?;
                if w.progress_ms > 0 {
                    two_frames(progress);
                }
                Reply::ProcessWaited(ProcessWaited {
                    outcome: WaitOutcome::TimedOut,
                    found: None,
                    info,
                    stdout_tail: Vec::new(),
                    stderr_tail: Vec::new(),
                    waited_ms: u64::from(w.timeout_ms),
                    missed: 0,
                    resume: [w.stdout_from, w.stderr_from],
                })
            }
            Op::ProcessWrite(w) => {
                let bytes = w.data.len() as u64;
                let mut procs = lock(&self.procs);
                let info = procs.table.get_mut(&w.id).ok_or(AgentError::NoSuchProcess { id: w.id })?;
                info.stdin_open &= !w.close;
                Reply::ProcessWritten { bytes, info: info.clone() }
            }
            Op::ProcessSignal { id, signal, .. } => {
                let mut procs = lock(&self.procs);
                let info = procs.table.get_mut(&id).ok_or(AgentError::NoSuchProcess { id })?;
                info.status = Some(ExitStatus::Signal(signal));
                info.group_alive = false;
                info.ended_unix_ms = Some(2);
                Reply::Process(info.clone())
            }
            Op::Ping => Reply::Pong { agent_version: "fake".into() },
            Op::Reseed(_) => Reply::Done,
            Op::Rename { from, to } => {
                let mut files = lock(&self.files);
                let data = files.remove(&from).ok_or(AgentError::NotFound { path: from })?;
                files.insert(to, data);
                Reply::Done
            }
            Op::SetEnv { env } => {
                tine_protocol::check_sandbox_env(&env)?;
                Reply::Done
            }
            Op::SetHostEnv { env } => {
                tine_protocol::check_sandbox_env(&env)?;
                *lock(&self.host_env) = env;
                Reply::Done
            }
            Op::InstallTrust { .. } => Reply::Done,
            Op::SetProcessDefaults(_) => Reply::ProcessDefaults(tine_protocol::ProcessDefaults::default()),
            Op::Info => Reply::Info(AgentInfo {
                agent_version: "fake".into(),
                protocol_version: tine_protocol::PROTOCOL_VERSION,
                uptime_ms: 0,
                mem_total: self.memory_bytes,
                mem_available: self.memory_bytes / 2,
                disk_total: 1 << 30,
                disk_free: 1 << 29,
                load: [0.0; 3],
            }),
            Op::Exec(e) => {
                // `sleep <secs>` takes that long, for tests of calls in flight.
                let sleep = match &e.command {
                    tine_protocol::Command::Shell(script) => script.strip_prefix("sleep "),
                    tine_protocol::Command::Argv(_) => None,
                };
                if let Some(secs) = sleep.and_then(|s| s.parse::<u64>().ok()) {
                    std::thread::sleep(Duration::from_secs(secs));
                }
                Reply::Exec(ExecReply {
                    status: ExitStatus::Code(0),
                    stdout: output(format!("{:?}", e.command).into_bytes()),
                    stderr: output(Vec::new()),
                    duration_ms: 0,
                })
            }
            Op::Python(p) | Op::Node(p) => Reply::Python(CellReply {
                value: Some(p.code),
                stdout: output(Vec::new()),
                stderr: output(Vec::new()),
                exception: None,
                timed_out: false,
                value_truncated: false,
                value_bytes: 0,
                interpreter_start_ms: None,
            }),
            Op::PythonWarmUp => Reply::PythonWarm { interpreter_start_ms: Some(0) },
            Op::WriteFile(w) => {
                let bytes = w.data.len() as u64;
                let mut files = lock(&self.files);
                let f = files.entry(w.path).or_default();
                if !w.append {
                    f.clear();
                }
                f.extend_from_slice(&w.data);
                Reply::Written { bytes }
            }
            Op::ReadFile(r) => match lock(&self.files).get(&r.path) {
                Some(data) => Reply::File(FileData { data: data.clone(), size: data.len() as u64 }),
                None => return Err(AgentError::NotFound { path: r.path }),
            },
            other => {
                return Err(AgentError::InvalidRequest { reason: format!("the fake agent does not serve {other:?}") })
            }
        })
    }
}

impl ExitWatch for Arc<Shared> {
    fn wait(&self, timeout: Option<Duration>) -> bool {
        let end = lock(&self.end);
        match timeout {
            None => self.ended.wait_while(end, |e| e.is_none()).map(|e| e.is_some()).unwrap_or(true),
            Some(t) => self.ended.wait_timeout_while(end, t, |e| e.is_none()).map(|(e, _)| e.is_some()).unwrap_or(true),
        }
    }

    fn is_stopped(&self) -> bool {
        self.is_ended()
    }
}

/// A fake running VM.
struct FakeVm {
    shared: Arc<Shared>,
    started: Instant,
    agent_socket: PathBuf,
    fail_hibernations: Arc<AtomicUsize>,
    own_mib: Arc<std::sync::atomic::AtomicU64>,
}

impl VmHandle for FakeVm {
    fn started(&self) -> Instant {
        self.started
    }

    fn agent_socket(&self) -> &Path {
        &self.agent_socket
    }

    fn exit_watch(&self) -> Box<dyn ExitWatch> {
        Box::new(self.shared.clone())
    }

    fn console_tail(&self, _lines: usize) -> String {
        "fake console".into()
    }

    fn cpu_time(&self) -> Duration {
        self.started.elapsed() / 100
    }

    fn resident_memory_bytes(&self) -> u64 {
        self.shared.memory_bytes / 4
    }

    fn own_memory_bytes(&self) -> Option<u64> {
        Some(self.own_mib.load(Ordering::SeqCst) << 20).filter(|&b| b > 0)
    }

    fn working_set(&self) -> Result<vmm::WorkingSet, BackendError> {
        Ok(vmm::WorkingSet { read: vec![(0, 4096)], ..vmm::WorkingSet::default() })
    }

    fn pause(&self, _timeout: Duration) -> Result<Duration, BackendError> {
        if self.shared.is_ended() {
            return Err(BackendError::new(std::io::Error::other("the fake VM has ended")));
        }
        self.shared.paused.store(true, Ordering::SeqCst);
        Ok(Duration::from_micros(1))
    }

    fn resume(&self) {
        self.shared.paused.store(false, Ordering::SeqCst);
    }

    fn is_paused(&self) -> bool {
        self.shared.paused.load(Ordering::SeqCst)
    }

    fn snapshot(&self, dir: &Path) -> Result<(), BackendError> {
        std::fs::write(dir.join("fake-snapshot"), b"").map_err(BackendError::new)
    }

    fn hibernate(&self, dir: &Path, base: &Base) -> Result<Hibernation, BackendError> {
        if !self.is_paused() {
            return Err(BackendError::new(std::io::Error::other("the fake VM is not paused")));
        }
        let bytes = serde_json::to_vec(&*lock(&self.shared.files)).map_err(BackendError::new)?;
        // Half a file, then a full disk.
        std::fs::write(dir.join(FAKE_HIBERNATION), &bytes[..bytes.len() / 2]).map_err(BackendError::new)?;
        if self.fail_hibernations.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            return Err(BackendError::new(std::io::Error::from(std::io::ErrorKind::StorageFull)));
        }
        std::fs::write(dir.join(FAKE_HIBERNATION), &bytes).map_err(BackendError::new)?;
        let based = !matches!(base, Base::None);
        Ok(Hibernation { based, bytes: bytes.len() as u64, took: Duration::from_micros(3) })
    }

    fn disks(&self) -> Vec<(u64, tine_storage::ChainSpec)> {
        Vec::new()
    }

    fn branch(&self, _pause_timeout: Duration) -> Result<BranchPoint, BackendError> {
        let image: Image = (lock(&self.shared.files).clone(), lock(&self.shared.procs).clone());
        Ok(BranchPoint {
            image: Arc::new(image),
            mode: BranchMode::CopyWhilePaused,
            fallback_reason: Some("a fake VM".into()),
            pause: Duration::from_micros(1),
            total: Duration::from_micros(2),
            // As if a quarter of the guest's memory were non-zero.
            bytes_written: self.shared.memory_bytes / 4,
            pages_copied_before_write: 0,
        })
    }

    fn stop(&mut self) -> VmEnd {
        self.shared.end(None);
        // Wake the accept loop so it sees the end.
        let _ = UnixStream::connect(&self.agent_socket);
        lock(&self.shared.end).replace(VmEnd::Stopped).unwrap_or(VmEnd::Stopped)
    }
}
