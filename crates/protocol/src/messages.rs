//! The request and response types, with the limits both sides enforce.

use serde::{Deserialize, Serialize};

/// Default `exec`/`python` timeout (ms).
pub const DEFAULT_TIMEOUT_MS: u32 = 60_000;
/// Largest `exec`/`python` timeout (ms): 10 minutes.
pub const MAX_TIMEOUT_MS: u32 = 600_000;
/// Default cap on each of stdout and stderr (bytes).
pub const DEFAULT_OUTPUT_LIMIT: u32 = 32 * 1024;
/// Largest cap on each of stdout and stderr (bytes).
pub const MAX_OUTPUT_LIMIT: u32 = 4 << 20;
/// Largest file chunk one read or write moves (bytes); larger files go in
/// several requests (offset/length).
pub const MAX_FILE_CHUNK: u64 = 8 << 20;
/// After a Python cell's timeout the agent interrupts it (SIGINT); a cell
/// still running this long after that is killed with its interpreter (ms).
pub const PYTHON_KILL_GRACE_MS: u32 = 5_000;
/// A Python cell whose SIGINT is still pending at the end of
/// [`PYTHON_KILL_GRACE_MS`] (the interpreter has not run since: the host or
/// guest is too loaded to schedule it, see `SigPnd`/`ShdPnd` in proc(5)) is
/// not killed: the agent keeps waiting for it to run, at most this much
/// longer (ms), before it kills the interpreter after all.
pub const PYTHON_PENDING_SIGINT_MAX_MS: u32 = 60_000;
/// Deadline of starting the Python interpreter (ms), counted apart from the
/// cell's timeout: a cell's timeout starts once the interpreter is ready.
pub const PYTHON_START_TIMEOUT_MS: u32 = 120_000;
/// Most bytes (UTF-8) of a cell's `repr` value, and of an exception's
/// message and traceback, that the agent sends (64 KiB); longer ones are
/// cut on a character boundary (see [`CellReply::value_truncated`]).
pub const PYTHON_VALUE_LIMIT: u32 = 64 * 1024;
/// Bytes of entropy a reseed carries at most.
pub const MAX_ENTROPY_BYTES: usize = 512;
/// Most entries one [`Manifest`] holds; past it the agent sets
/// `truncated`. Also the most paths one `Manifest` request should name.
pub const MAX_MANIFEST_ENTRIES: usize = 100_000;
/// Regular files larger than this (bytes, 256 MiB) are not hashed: their
/// [`ManifestEntry::sha256`] is `None` (size and mode are still given).
pub const MAX_HASHED_FILE_BYTES: u64 = 256 << 20;
/// Bytes each background process keeps of each of its stdout and stderr
/// (256 KiB): the newest ones; older bytes fall out of the buffer and are
/// counted ([`StreamState::buffer_start`]).
pub const PROCESS_BUFFER_BYTES: usize = 256 << 10;
/// Most entries of the agent's process table (running or ended). A spawn
/// into a full table evicts the oldest ended entry, or fails with
/// [`AgentError::TooManyProcesses`] when all are running.
pub const MAX_PROCESSES: usize = 32;
/// Most output bytes one [`Op::ProcessOutput`] returns (256 KiB).
pub const MAX_PROCESS_CHUNK: u32 = 256 << 10;
/// Most bytes of initial stdin a [`Spawn`] carries (64 KiB: fits an empty
/// pipe, so the agent writes it without blocking).
pub const MAX_SPAWN_STDIN: usize = 64 << 10;
/// Most bytes one [`Op::ProcessWrite`] carries (1 MiB).
pub const MAX_PROCESS_WRITE: usize = 1 << 20;
/// Most bytes of a [`WaitFor`] text or pattern.
pub const MAX_WAIT_PATTERN_BYTES: usize = 1024;
/// Most bytes of [`WaitMatch::line`] (the line around a match; cut).
pub const WAIT_LINE_BYTES: usize = 4096;
/// Most bytes of each output tail in a [`Progress`] frame and in
/// [`ProcessWaited`] (the last lines, cut to whole lines when possible).
pub const PROGRESS_TAIL_BYTES: usize = 1024;
/// Shortest interval between two [`Progress`] frames (ms); smaller
/// `progress_ms` values are raised to it.
pub const MIN_PROGRESS_MS: u32 = 500;
/// Most bytes of [`ProcessInfo::command`] (the command line, cut on a
/// character boundary).
pub const PROCESS_COMMAND_BYTES: usize = 1024;
/// The default delay (ms) between a SIGTERM to a background process and the
/// SIGKILL that follows when members of its group are still alive.
pub const KILL_ESCALATE_MS: u32 = 3000;
/// Most variables of a sandbox environment ([`Op::SetEnv`]).
pub const MAX_SANDBOX_ENV_VARS: usize = 256;
/// Most bytes of a sandbox environment: every name and value, plus one
/// byte each for `=` and the terminating NUL, as `execve(2)` counts them
/// (64 KiB).
pub const MAX_SANDBOX_ENV_BYTES: usize = 64 << 10;

/// Checks a sandbox environment ([`Op::SetEnv`]) against the limits both
/// sides enforce: names of 1-256 bytes of `[A-Za-z0-9_]` not starting
/// with a digit (POSIX.1-2017 XBD 8.1's portable names), values without
/// NUL, at most [`MAX_SANDBOX_ENV_VARS`] variables and
/// [`MAX_SANDBOX_ENV_BYTES`] in all, no name twice.
///
/// Errors: [`AgentError::InvalidRequest`] naming the first offending
/// variable (its name quoted cut to 64 bytes).
pub fn check_sandbox_env(env: &[(String, String)]) -> Result<(), AgentError> {
    let invalid = |reason: String| AgentError::InvalidRequest { reason };
    if env.len() > MAX_SANDBOX_ENV_VARS {
        return Err(invalid(format!("{} environment variables: at most {MAX_SANDBOX_ENV_VARS}", env.len())));
    }
    let mut total = 0usize;
    for (i, (name, value)) in env.iter().enumerate() {
        let quoted: String = name.chars().take(64).collect();
        let portable = !name.is_empty()
            && name.len() <= 256
            && !name.as_bytes()[0].is_ascii_digit()
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !portable {
            return Err(invalid(format!(
                "environment variable name {quoted:?}: use 1-256 letters, digits and '_', not starting with a digit"
            )));
        }
        if value.contains('\0') {
            return Err(invalid(format!("environment variable {quoted}: the value holds a NUL byte")));
        }
        if env[..i].iter().any(|(n, _)| n == name) {
            return Err(invalid(format!("environment variable {quoted} is given twice")));
        }
        total = total.saturating_add(name.len() + value.len() + 2);
    }
    if total > MAX_SANDBOX_ENV_BYTES {
        return Err(invalid(format!("the environment has {total} bytes: at most {MAX_SANDBOX_ENV_BYTES}")));
    }
    Ok(())
}

/// The timeout (ms) and output cap (bytes) a request asks for, with 0
/// meaning the defaults ([`DEFAULT_TIMEOUT_MS`], [`DEFAULT_OUTPUT_LIMIT`]).
///
/// Errors: [`AgentError::InvalidRequest`] past [`MAX_TIMEOUT_MS`] or
/// [`MAX_OUTPUT_LIMIT`].
pub fn effective_limits(timeout_ms: u32, output_limit: u32) -> Result<(u32, u32), AgentError> {
    let invalid = |reason: String| AgentError::InvalidRequest { reason };
    let timeout = match timeout_ms {
        0 => DEFAULT_TIMEOUT_MS,
        t if t > MAX_TIMEOUT_MS => {
            return Err(invalid(format!("timeout {t} ms is over the {MAX_TIMEOUT_MS} ms limit")))
        }
        t => t,
    };
    let limit = match output_limit {
        0 => DEFAULT_OUTPUT_LIMIT,
        l if l > MAX_OUTPUT_LIMIT => return Err(invalid(format!("output limit {l} is over {MAX_OUTPUT_LIMIT} bytes"))),
        l => l,
    };
    Ok((timeout, limit))
}

/// The longest a `python` call with cell timeout `timeout_ms` (0: the
/// default) can take in the agent (ms): the interpreter's start
/// ([`PYTHON_START_TIMEOUT_MS`]), the cell's timeout, the grace after SIGINT
/// ([`PYTHON_KILL_GRACE_MS`]) and the wait while that SIGINT is pending
/// ([`PYTHON_PENDING_SIGINT_MAX_MS`]). A host waits this long plus the
/// round trip.
pub fn python_agent_budget_ms(timeout_ms: u32) -> u64 {
    let timeout = if timeout_ms == 0 { DEFAULT_TIMEOUT_MS } else { timeout_ms };
    u64::from(PYTHON_START_TIMEOUT_MS)
        + u64::from(timeout)
        + u64::from(PYTHON_KILL_GRACE_MS)
        + u64::from(PYTHON_PENDING_SIGINT_MAX_MS)
}

/// A request from the host; answered by a [`Response`] with the same `id`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Chosen by the host, unique among its requests in flight.
    pub id: u64,
    /// What to do.
    pub op: Op,
}

/// The agent's answer to the [`Request`] with the same `id`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Response {
    /// The request's id.
    pub id: u64,
    /// What happened.
    pub result: Result<Reply, AgentError>,
}

/// Operations.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// Liveness and version check.
    Ping,
    /// Run a command.
    Exec(Exec),
    /// Run code in the sandbox's persistent Python interpreter.
    Python(Cell),
    /// Read (part of) a file.
    ReadFile(ReadFile),
    /// Write a file.
    WriteFile(WriteFile),
    /// List a directory.
    ListDir {
        /// Absolute path.
        path: String,
    },
    /// Stat a path (not following a final symlink).
    Stat {
        /// Absolute path.
        path: String,
    },
    /// Remove a file, or a directory (`recursive` for a non-empty one).
    Remove {
        /// Absolute path.
        path: String,
        /// Remove a directory and everything below it.
        recursive: bool,
    },
    /// Make a directory.
    Mkdir {
        /// Absolute path.
        path: String,
        /// Make missing parents too; no error if it exists.
        parents: bool,
        /// Permission bits (e.g. 0o755).
        mode: u32,
    },
    /// Agent and guest facts.
    Info,
    /// After a restore or branch: mix host entropy into the kernel RNG
    /// (RNDADDENTROPY, then a reseed) and set the clock.
    Reseed(Reseed),
    /// The sandbox's changed paths, as a [`Manifest`] of the merged view
    /// (the file system as the sandbox sees it, symlinks not followed).
    ///
    /// With `paths: None`: every path in the root overlay's upper layer
    /// (what the sandbox added, changed or deleted since its image) and
    /// everything under `/tmp`. Errors: [`AgentError::Unsupported`] when
    /// the root is not an overlay.
    ///
    /// With `paths: Some(list)`: exactly those paths (absolute, no `..`
    /// component; else [`AgentError::InvalidRequest`]), each reported
    /// `Absent` when it does not exist. At most [`MAX_MANIFEST_ENTRIES`]
    /// are answered (then `truncated` is set); the request must fit in a
    /// frame.
    Manifest {
        /// The paths to report, or `None` for the changed ones.
        paths: Option<Vec<String>>,
    },
    /// Start the persistent Python interpreter (if it is not running) and
    /// run a warm-up in it that leaves the cells' namespace empty, so that
    /// a snapshot taken next holds a ready interpreter with its pages
    /// faulted in. Answered [`Reply::PythonWarm`]; errors as `Python`
    /// ([`AgentError::Unsupported`] without python3).
    PythonWarmUp,
    /// As [`Op::Exec`], with interim [`Reply::Progress`] frames (same
    /// request id) every `progress_ms` (at least [`MIN_PROGRESS_MS`]) while
    /// the command runs, then the final [`Reply::Exec`].
    ExecWithProgress {
        /// The command.
        exec: Exec,
        /// Interval between progress frames (ms).
        progress_ms: u32,
    },
    /// Start a background process (it outlives the request); answered
    /// [`Reply::Process`]. Errors: [`AgentError::TooManyProcesses`],
    /// [`AgentError::TooLarge`] for stdin over [`MAX_SPAWN_STDIN`], as
    /// `Exec` for a program that cannot start.
    Spawn(Spawn),
    /// The process table; answered [`Reply::Processes`] (at most
    /// [`MAX_PROCESSES`], by id).
    ProcessList,
    /// A page of a background process's output; answered
    /// [`Reply::ProcessOutput`]. Errors: [`AgentError::NoSuchProcess`].
    ProcessOutput(ProcessOutputRequest),
    /// Wait until a text or pattern appears in a background process's
    /// output, it ends, or the timeout passes; interim [`Reply::Progress`]
    /// frames when `progress_ms > 0`, then [`Reply::ProcessWaited`].
    /// Errors: [`AgentError::NoSuchProcess`], [`AgentError::InvalidRequest`]
    /// (pattern, timeout).
    ProcessWait(ProcessWait),
    /// Write to a background process's stdin (and/or close it); answered
    /// [`Reply::ProcessWritten`].
    ProcessWrite(ProcessWrite),
    /// Send `signal` to a background process's group (and its marked
    /// descendants); with `escalate_ms > 0`, SIGKILL them after that long if
    /// any remain. Answered [`Reply::Process`].
    ProcessSignal {
        /// The process's id in the table.
        id: u64,
        /// The signal number (1..=64).
        signal: i32,
        /// Delay before SIGKILL (ms); 0: no escalation.
        escalate_ms: u32,
    },
    /// Replace the sandbox environment: variables that every later exec,
    /// background process and the Python interpreter get, under the
    /// agent's defaults' names and below a request's own `env` (which
    /// wins). The interpreter's `os.environ` follows before its next cell;
    /// processes already running keep theirs. An empty list clears it.
    /// Answered [`Reply::Done`]. Errors: as [`check_sandbox_env`].
    SetEnv {
        /// The variables, names unique.
        env: Vec<(String, String)>,
    },
    /// Rename `from` to `to` (rename(2): atomic within one file system; a
    /// file at `to` is replaced). Answered [`Reply::Done`]. Errors:
    /// `InvalidRequest` for a relative path, `NotFound`,
    /// `PermissionDenied`, `IsADirectory`, `Io` (e.g. across file systems).
    Rename {
        /// Absolute path of what is renamed.
        from: String,
        /// Absolute path of its new name.
        to: String,
    },
    /// Run code in the sandbox's persistent Node.js interpreter; same
    /// request and reply shapes as [`Op::Python`] ([`Reply::Python`], with
    /// `value` from `util.inspect`, a returned promise awaited within the
    /// cell's timeout, and `exception.traceback` holding the JS stack). The
    /// same limits apply ([`PYTHON_START_TIMEOUT_MS`], [`PYTHON_KILL_GRACE_MS`],
    /// [`PYTHON_VALUE_LIMIT`], [`python_agent_budget_ms`]). Errors:
    /// [`AgentError::Unsupported`] when the image has no `node`.
    Node(Cell),
    /// Set who every later exec, background process and interpreter runs
    /// as, and where: an OCI image's `User` and `WorkingDir` (OCI image
    /// spec, config.md, "Properties"). Kept in the agent's memory like the
    /// sandbox environment, so snapshots, templates and branch children
    /// carry it. A running interpreter is restarted (empty) on its next
    /// cell; processes already running keep theirs. File operations stay
    /// root's. Answered [`Reply::ProcessDefaults`] with the defaults it
    /// replaced (so a caller can run as root for a while and put them
    /// back); the same defaults again change nothing (a running
    /// interpreter is kept). Errors: `InvalidRequest` for a
    /// user or group the guest's `/etc/passwd` or `/etc/group` lacks, or a
    /// relative or too long working directory; `Io` when the working
    /// directory cannot be made. On an error nothing changes.
    SetProcessDefaults(ProcessDefaults),
    /// Mount the ext4 file system of the disk whose serial (virtio-blk
    /// GET_ID, `/sys/block/vdX/serial`) is [`Mount::serial`] at
    /// [`Mount::path`], made if missing (a volume put in a device slot
    /// while the VM runs). Waits up to [`MOUNT_WAIT_MS`] for the kernel to
    /// see the disk's new capacity. Answered [`Reply::Done`]. Errors:
    /// `InvalidRequest` (a relative or too long path, no disk of that
    /// serial), `Io` (the disk still has no capacity after the wait, the
    /// mount point cannot be made, the mount failed: its errno).
    Mount(Mount),
    /// Unmount the file system at `path` after writing out what it holds
    /// (`syncfs`), so that its disk can be taken out. Answered
    /// [`Reply::Done`]; nothing mounted there is `Done` too. Errors: `Io`
    /// (busy: a process still uses it, the errno).
    Unmount {
        /// The mount point.
        path: String,
    },
    /// Trust `pem` (CA certificates, PEM) beside the guest's own store,
    /// for the server's CAs (its secret broker's, the operator's extra
    /// ones): writes [`TRUST_BUNDLE`] (the guest's system bundle, then the
    /// certificates of `pem` it lacks) and [`TRUST_EXTRA`] (`pem` alone),
    /// and points every later exec, background process and interpreter at
    /// them: `SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`, `CURL_CA_BUNDLE`,
    /// `PIP_CERT`, `GIT_SSL_CAINFO` name the bundle, `NODE_EXTRA_CA_CERTS`
    /// the extra file (Node.js adds it to its own roots), under the
    /// sandbox environment (which may set them otherwise). The host sends
    /// it at every start and restore, so templates do not depend on it;
    /// an empty `pem` takes the variables away. Answered [`Reply::Done`].
    /// Errors: `InvalidRequest` (not PEM, over [`MAX_TRUST_BYTES`]), `Io`.
    InstallTrust {
        /// The certificates (PEM).
        pem: String,
    },
    /// Replace the host's environment: variables the server sets for the
    /// whole sandbox apart from the client's ([`Op::SetEnv`]), such as its
    /// secrets' placeholders. They are above the sandbox environment and
    /// below a request's own `env`; otherwise as [`Op::SetEnv`] (limits,
    /// the interpreters following, kept in the agent's memory). Answered
    /// [`Reply::Done`].
    SetHostEnv {
        /// The variables, names unique.
        env: Vec<(String, String)>,
    },
    /// Cancel request `id` of this connection, when it is an
    /// [`Op::Exec`] or [`Op::ExecWithProgress`] still running: its
    /// command's process group is killed (SIGKILL) as at its timeout, and
    /// its answer follows as usual (status `Signal(9)`, with the output
    /// written until then). Answered [`Reply::Cancelled`], whether or not
    /// such a request was running (it may have ended meanwhile): the
    /// cancel and the request's own answer come in either order. An agent
    /// of an earlier release answers `Unsupported` and the command runs
    /// on to its end or timeout.
    Cancel {
        /// The id of the request to cancel.
        id: u64,
    },
}

/// The trust bundle [`Op::InstallTrust`] writes: the guest's own CA
/// certificates and the server's.
pub const TRUST_BUNDLE: &str = "/run/tine/ca-certificates.crt";
/// The server's CA certificates alone ([`Op::InstallTrust`]).
pub const TRUST_EXTRA: &str = "/run/tine/extra-ca.pem";
/// Most bytes of [`Op::InstallTrust`]'s `pem` (4 MiB).
pub const MAX_TRUST_BYTES: usize = 4 << 20;

/// A disk to mount ([`Op::Mount`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mount {
    /// The disk's serial (at most 20 bytes, virtio-blk's GET_ID).
    pub serial: String,
    /// The absolute mount point (at most [`MAX_WORKING_DIR_BYTES`] bytes).
    pub path: String,
    /// Mount read-only (`MS_RDONLY`; the device refuses writes too).
    pub read_only: bool,
}

/// How long [`Op::Mount`] waits for the disk's capacity to show (ms).
pub const MOUNT_WAIT_MS: u64 = 10_000;

/// Who processes run as and where ([`Op::SetProcessDefaults`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessDefaults {
    /// OCI `User`: `user`, `uid`, `user:group`, `uid:gid`, `user:gid` or
    /// `uid:group` (at most [`MAX_USER_BYTES`] bytes); names are looked
    /// up in the guest's `/etc/passwd` and `/etc/group`; the user's
    /// supplementary groups are those `/etc/group` lists it in. `None` or
    /// empty: root.
    pub user: Option<String>,
    /// OCI `WorkingDir`: the absolute directory a command without its own
    /// `cwd` starts in, and the interpreters' (at most
    /// [`MAX_WORKING_DIR_BYTES`] bytes); made if missing (as `mkdir -p`;
    /// the last directory, when made, is the user's). `None` or empty: `/`
    /// for commands, the user's home for the interpreters (root's
    /// `/root`; a uid `/etc/passwd` lacks has `/`, and gid 0, as runc
    /// gives it).
    pub working_dir: Option<String>,
}

/// Longest [`ProcessDefaults::user`], bytes.
pub const MAX_USER_BYTES: usize = 256;
/// Longest [`ProcessDefaults::working_dir`], bytes (Linux `PATH_MAX` less
/// its NUL).
pub const MAX_WORKING_DIR_BYTES: usize = 4095;

/// `spawn`: start a background process in its own process group, with
/// piped stdin, stdout and stderr.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Spawn {
    /// The command.
    pub command: Command,
    /// Working directory (default `/`).
    pub cwd: Option<String>,
    /// Extra environment variables (after the agent's defaults, e.g.
    /// `PYTHONUNBUFFERED=1`).
    pub env: Vec<(String, String)>,
    /// Initial stdin (at most [`MAX_SPAWN_STDIN`] bytes).
    #[serde(with = "serde_bytes")]
    pub stdin: Vec<u8>,
    /// Close stdin after the initial bytes (else it stays open for
    /// [`Op::ProcessWrite`]).
    pub close_stdin: bool,
}

/// One of a process's output streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StreamKind {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// Which output streams a wait watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StreamSet {
    /// Standard output only.
    Stdout,
    /// Standard error only.
    Stderr,
    /// Both.
    Both,
}

/// `process_output`: read a page of one stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessOutputRequest {
    /// The process's id.
    pub id: u64,
    /// Which stream.
    pub stream: StreamKind,
    /// Stream offset (bytes since the process started) to read from;
    /// `None`: the oldest byte still held.
    pub offset: Option<u64>,
    /// Most bytes to return (clamped to [`MAX_PROCESS_CHUNK`]; 0 = that).
    pub max_bytes: u32,
}

/// What a wait waits for in the output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WaitFor {
    /// This text (bytes, may span lines), at most [`MAX_WAIT_PATTERN_BYTES`].
    Text(String),
    /// A regular expression (Rust `regex` syntax, matched against each
    /// line without its newline, and the unterminated last line), at most
    /// [`MAX_WAIT_PATTERN_BYTES`].
    Regex(String),
}

/// `process_wait`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessWait {
    /// The process's id.
    pub id: u64,
    /// Give up after this long (ms; 0: [`DEFAULT_TIMEOUT_MS`]; at most
    /// [`MAX_TIMEOUT_MS`]).
    pub timeout_ms: u32,
    /// What to wait for; `None`: the process's end.
    pub until: Option<WaitFor>,
    /// Which streams to search.
    pub streams: StreamSet,
    /// Stdout offset to search from (0: everything still held).
    pub stdout_from: u64,
    /// Stderr offset to search from (0: everything still held).
    pub stderr_from: u64,
    /// Interval of interim [`Reply::Progress`] frames (ms); 0: none.
    pub progress_ms: u32,
}

/// `process_write`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessWrite {
    /// The process's id.
    pub id: u64,
    /// Bytes to write (at most [`MAX_PROCESS_WRITE`]).
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// Close stdin after writing (EOF to the process).
    pub close: bool,
    /// Give up writing after this long (ms; 0: 10 s); a partial write
    /// returns the count written.
    pub timeout_ms: u32,
}

/// What `exec` runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// `bash -c <script>`.
    Shell(String),
    /// A program and its arguments, no shell.
    Argv(Vec<String>),
}

/// `exec`: run a command in its own process group.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Exec {
    /// The command.
    pub command: Command,
    /// Working directory (default `/`).
    pub cwd: Option<String>,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
    /// Bytes fed to stdin (then closed).
    #[serde(with = "serde_bytes")]
    pub stdin: Vec<u8>,
    /// Kill the whole process group after this long (ms), at most [`MAX_TIMEOUT_MS`].
    pub timeout_ms: u32,
    /// Keep at most this many bytes of each of stdout and stderr.
    pub output_limit: u32,
}

/// A cell of code for a sandbox's persistent interpreter, of either
/// language (`Op::Python`, `Op::Node`; the operations keep their names on
/// the wire, the type is language-neutral).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cell {
    /// The code; the value of a final expression is returned.
    pub code: String,
    /// Interrupt the cell after this long (ms); the state is kept.
    pub timeout_ms: u32,
    /// Keep at most this many bytes of each of stdout and stderr.
    pub output_limit: u32,
}

/// `read_file`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReadFile {
    /// Absolute path.
    pub path: String,
    /// Byte offset.
    pub offset: u64,
    /// Bytes to read (default: to the end); more than [`MAX_FILE_CHUNK`]
    /// is an error.
    pub length: Option<u64>,
}

/// `write_file`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WriteFile {
    /// Absolute path.
    pub path: String,
    /// The bytes (at most [`MAX_FILE_CHUNK`]).
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// Permission bits for a new file (default 0o644).
    pub mode: Option<u32>,
    /// Append instead of replacing.
    pub append: bool,
    /// Create missing parent directories.
    pub create_parents: bool,
}

/// `reseed`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reseed {
    /// Host randomness (at most [`MAX_ENTROPY_BYTES`]).
    #[serde(with = "serde_bytes")]
    pub entropy: Vec<u8>,
    /// The host's wall clock, ns since the Unix epoch.
    pub unix_time_ns: u64,
}

/// Successful answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    /// To `Ping`.
    Pong {
        /// The agent's version string.
        agent_version: String,
    },
    /// To `Exec`.
    Exec(ExecReply),
    /// To `Python`.
    Python(CellReply),
    /// To `ReadFile`.
    File(FileData),
    /// To `WriteFile`: bytes written.
    Written {
        /// Bytes written.
        bytes: u64,
    },
    /// To `ListDir`, sorted by name.
    Entries(Vec<DirEntry>),
    /// To `Stat`.
    Stat(FileStat),
    /// To `Info`.
    Info(AgentInfo),
    /// To `Remove`, `Mkdir`, `Reseed`.
    Done,
    /// To `Manifest`.
    Manifest(Manifest),
    /// To `PythonWarmUp`.
    PythonWarm {
        /// How long starting the interpreter took (ms), or `None` when it
        /// was running already.
        interpreter_start_ms: Option<u64>,
    },
    /// Interim frame of `ExecWithProgress` and of `ProcessWait` with
    /// `progress_ms > 0`: the request is still running; its final answer
    /// follows with the same id.
    Progress(Progress),
    /// To `Spawn` and `ProcessSignal`.
    Process(ProcessInfo),
    /// To `ProcessList`, by id.
    Processes(Vec<ProcessInfo>),
    /// To `ProcessOutput`.
    ProcessOutput(ProcessOutput),
    /// To `ProcessWait`.
    ProcessWaited(ProcessWaited),
    /// To `ProcessWrite`.
    ProcessWritten {
        /// Bytes written (fewer than asked on a timeout or a closed pipe).
        bytes: u64,
        /// The process after the write.
        info: ProcessInfo,
    },
    /// To `SetProcessDefaults`: the defaults it replaced (empty values
    /// as none).
    ProcessDefaults(ProcessDefaults),
    /// To `Cancel`.
    Cancelled {
        /// A running request of that id was cancelled (its command's
        /// process group was sent SIGKILL); `false`: none was running.
        found: bool,
    },
}

/// A running request's progress.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// Time since the request started (ms).
    pub elapsed_ms: u64,
    /// Stdout bytes produced so far.
    pub stdout_bytes: u64,
    /// Stderr bytes produced so far.
    pub stderr_bytes: u64,
    /// The last lines of stdout, at most [`PROGRESS_TAIL_BYTES`].
    #[serde(with = "serde_bytes")]
    pub stdout_tail: Vec<u8>,
    /// The last lines of stderr, at most [`PROGRESS_TAIL_BYTES`].
    #[serde(with = "serde_bytes")]
    pub stderr_tail: Vec<u8>,
}

/// One output stream of a background process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamState {
    /// Bytes the stream produced.
    pub total_bytes: u64,
    /// Offset of the oldest byte still held = bytes that fell out of the
    /// buffer ([`PROCESS_BUFFER_BYTES`]).
    pub buffer_start: u64,
    /// The stream reached EOF.
    pub closed: bool,
}

/// A background process, as the agent's table holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessInfo {
    /// Id in the guest's table (1, 2, ...; never reused in a guest).
    pub id: u64,
    /// The command line (at most [`PROCESS_COMMAND_BYTES`]).
    pub command: String,
    /// The leader's pid, which is also its process group id.
    pub pid: i32,
    /// How the leader ended; `None` while it runs (`Code` or `Signal`).
    pub status: Option<ExitStatus>,
    /// Some member of its process group is alive.
    pub group_alive: bool,
    /// Start time, ms since the Unix epoch (the guest's clock).
    pub started_unix_ms: u64,
    /// End time of the leader, ms since the Unix epoch.
    pub ended_unix_ms: Option<u64>,
    /// Standard output.
    pub stdout: StreamState,
    /// Standard error.
    pub stderr: StreamState,
    /// Stdin is still open for writes.
    pub stdin_open: bool,
}

/// A page of a background process's output.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessOutput {
    /// The process.
    pub info: ProcessInfo,
    /// The stream read.
    pub stream: StreamKind,
    /// Stream offset of `data[0]`.
    pub offset: u64,
    /// The bytes (at most the request's `max_bytes`).
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// Bytes between the offset asked for and `offset` that fell out of
    /// the buffer.
    pub skipped: u64,
}

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WaitOutcome {
    /// The text or pattern appeared.
    Matched,
    /// The process ended (and its output streams closed, or 1 s passed).
    Exited,
    /// The timeout passed.
    TimedOut,
}

/// Where a wait's text or pattern appeared.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WaitMatch {
    /// The stream.
    pub stream: StreamKind,
    /// Stream offset of the match's first byte.
    pub offset: u64,
    /// Stream offset just past the match (search from here to find the
    /// next one).
    pub end: u64,
    /// The line holding the match (at most [`WAIT_LINE_BYTES`]).
    #[serde(with = "serde_bytes")]
    pub line: Vec<u8>,
}

/// `process_wait`'s result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessWaited {
    /// Why the wait ended.
    pub outcome: WaitOutcome,
    /// The match, for [`WaitOutcome::Matched`].
    pub found: Option<WaitMatch>,
    /// The process at the end of the wait.
    pub info: ProcessInfo,
    /// The last lines of stdout, at most [`PROGRESS_TAIL_BYTES`].
    #[serde(with = "serde_bytes")]
    pub stdout_tail: Vec<u8>,
    /// The last lines of stderr, at most [`PROGRESS_TAIL_BYTES`].
    #[serde(with = "serde_bytes")]
    pub stderr_tail: Vec<u8>,
    /// How long the wait took (ms).
    pub waited_ms: u64,
    /// Bytes that fell out of the buffer before they were searched.
    pub missed: u64,
    /// (stdout, stderr) offsets a later wait for the same text or pattern
    /// searches from, so that no byte this wait did not search is skipped:
    /// after a match, its end (a text) or its line's end (a pattern); else
    /// the start of what the search still held back (a text's possible
    /// beginning, an unfinished line); a stream not searched keeps its
    /// `from`. Without a text or pattern: the streams' totals.
    pub resume: [u64; 2],
}

/// Captured output of one stream.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Output {
    /// The first `output_limit` bytes.
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// Whether bytes were dropped.
    pub truncated: bool,
    /// All bytes the stream produced.
    pub total_bytes: u64,
}

/// How a process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitStatus {
    /// Exited with this code.
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
    /// Killed (with its process group) at the timeout.
    TimedOut,
}

/// `exec`'s result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExecReply {
    /// How it ended.
    pub status: ExitStatus,
    /// Standard output.
    pub stdout: Output,
    /// Standard error.
    pub stderr: Output,
    /// Wall time (ms).
    pub duration_ms: u64,
}

/// A cell's exception: a Python exception or a JavaScript error.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellException {
    /// Exception type name ("ZeroDivisionError"; JS: the error's `name`).
    pub name: String,
    /// `str(exception)` (JS: the error's `message`).
    pub message: String,
    /// The formatted traceback (JS: the error's `stack`).
    pub traceback: String,
}

/// A cell's result, in either language; the interpreter's state is kept
/// in every case.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CellReply {
    /// `repr()` of the final expression's value, if the cell ended with one
    /// (and it was not None; JS: `util.inspect()`, not `undefined`).
    pub value: Option<String>,
    /// Standard output.
    pub stdout: Output,
    /// Standard error.
    pub stderr: Output,
    /// The exception the cell raised, if any.
    pub exception: Option<CellException>,
    /// The cell was interrupted at its timeout.
    pub timed_out: bool,
    /// `value` was cut to [`PYTHON_VALUE_LIMIT`] bytes (on a UTF-8
    /// character boundary).
    pub value_truncated: bool,
    /// The whole `repr` value's length in bytes (UTF-8); 0 without a value.
    pub value_bytes: u64,
    /// How long this call spent starting the interpreter (ms; not counted
    /// in the cell's timeout), or `None` when it was running already (a
    /// sandbox restored from a template made by Tine gets a started one).
    pub interpreter_start_ms: Option<u64>,
}

/// File bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileData {
    /// The bytes read.
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// The file's whole size.
    pub size: u64,
}

/// Kinds of directory entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Anything else (device, socket, FIFO).
    Other,
}

/// `stat` facts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    /// Kind.
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    /// Modification time, ms since the Unix epoch.
    pub mtime_ms: i64,
}

/// One entry of a listing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// File name.
    pub name: String,
    /// Its facts.
    pub stat: FileStat,
}

/// What a [`ManifestEntry`]'s path is in the merged view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum EntryKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Anything else (device, socket, FIFO).
    Other,
    /// Nothing is there (deleted, whited out, or never existed; also when
    /// an ancestor is not a directory, or the path cannot be looked up).
    Absent,
}

/// One path of a [`Manifest`], as the sandbox sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Absolute path in the sandbox (`/etc/hosts`). File names that are
    /// not UTF-8 are converted lossily (U+FFFD).
    pub path: String,
    /// What is there.
    pub kind: EntryKind,
    /// Bytes: a file's length, a symlink's target length; 0 for
    /// directories (their size is file-system bookkeeping) and `Absent`.
    pub size: u64,
    /// Permission bits including setuid, setgid and sticky (`mode & 0o7777`);
    /// 0 for `Absent`.
    pub mode: u32,
    /// SHA-256, lowercase hex (64 characters): of the contents of a regular
    /// file of at most [`MAX_HASHED_FILE_BYTES`], of the target string of a
    /// symlink; `None` for everything else or when the file cannot be read.
    pub sha256: Option<String>,
}

impl ManifestEntry {
    /// An upper bound of this entry's encoded size (bytes), for keeping a
    /// [`Manifest`] reply under [`MAX_FRAME_BYTES`](crate::MAX_FRAME_BYTES).
    pub fn encoded_len_bound(&self) -> usize {
        // CBOR (RFC 8949 section 3): the map's header (1), its five keys
        // with their headers (27), the path (header <= 9), the kind (a
        // variant name of at most 8 bytes, header 1), size (<= 9), mode
        // (<= 5), the hash (header <= 9, or 1 for null). Version 4's
        // postcard encoding is smaller, so this bounds it too.
        1 + 27 + 9 + self.path.len() + 9 + 9 + 5 + 9 + self.sha256.as_ref().map_or(0, String::len)
    }
}

/// The answer to [`Op::Manifest`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Sorted by `path` (byte order), no duplicates.
    pub entries: Vec<ManifestEntry>,
    /// Entries were left out: more than [`MAX_MANIFEST_ENTRIES`], or more
    /// than a frame holds (the last ones in path order are dropped then).
    pub truncated: bool,
}

/// `info`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AgentInfo {
    /// The agent's version.
    pub agent_version: String,
    /// Protocol version.
    pub protocol_version: u16,
    /// Time since the agent started (ms).
    pub uptime_ms: u64,
    /// Guest RAM (bytes) and what is available.
    pub mem_total: u64,
    /// Available guest RAM (bytes).
    pub mem_available: u64,
    /// Root filesystem size and free space (bytes).
    pub disk_total: u64,
    /// Free space on the root filesystem (bytes).
    pub disk_free: u64,
    /// 1, 5 and 15 minute load averages.
    pub load: [f32; 3],
}

/// Why a request failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum AgentError {
    /// The request is malformed or out of limits.
    #[error("invalid request: {reason}")]
    InvalidRequest {
        /// What is wrong.
        reason: String,
    },
    /// No such file or directory.
    #[error("{path}: no such file or directory")]
    NotFound {
        /// The path.
        path: String,
    },
    /// Permission denied.
    #[error("{path}: permission denied")]
    PermissionDenied {
        /// The path.
        path: String,
    },
    /// The path exists already.
    #[error("{path}: already exists")]
    AlreadyExists {
        /// The path.
        path: String,
    },
    /// A directory was expected.
    #[error("{path}: not a directory")]
    NotADirectory {
        /// The path.
        path: String,
    },
    /// A file was expected.
    #[error("{path}: is a directory")]
    IsADirectory {
        /// The path.
        path: String,
    },
    /// More bytes than a limit allows.
    #[error("{size} bytes exceed the limit of {limit}")]
    TooLarge {
        /// The size asked for.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The guest is out of space.
    #[error("no space left on the guest's disk")]
    NoSpace,
    /// Another I/O error.
    #[error("I/O error: {message}")]
    Io {
        /// The OS error text.
        message: String,
    },
    /// The operation is not available (e.g. no python3 in the image).
    #[error("unsupported: {reason}")]
    Unsupported {
        /// Why.
        reason: String,
    },
    /// The process table has no such id (never spawned, or evicted).
    #[error("no background process p{id}")]
    NoSuchProcess {
        /// The id asked for.
        id: u64,
    },
    /// The process table is full of running processes.
    #[error("{max} background processes are running already")]
    TooManyProcesses {
        /// The table's size ([`MAX_PROCESSES`]).
        max: u32,
    },
}
