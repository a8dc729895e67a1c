//! Protocol version 4, frozen: the message types as the release before
//! version 5 sent them (postcard, positional), so that a host of this
//! release can talk to a guest agent of that one (a sandbox hibernated or a
//! template made by it) and an agent of this release to a host rolled back
//! to it. Do not change these types: a change here breaks that release's
//! peers. Their meaning is documented on the current types in
//! [`crate::messages`], which had the same shapes at version 4.
//!
//! Between versions, messages are re-shaped by field and variant name
//! ([`to_v4_request`], [`from_v4_response`], and the agent's pair): a
//! field version 4 lacks is dropped, one it has and a newer version lacks
//! takes its default, and an operation version 4 lacks is refused.

#![allow(missing_docs)]

use serde::{Deserialize, Serialize};

use crate::ProtocolError;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub id: u64,
    pub op: Op,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Response {
    pub id: u64,
    pub result: Result<Reply, AgentError>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    Ping,
    Exec(Exec),
    Python(Python),
    ReadFile(ReadFile),
    WriteFile(WriteFile),
    ListDir { path: String },
    Stat { path: String },
    Remove { path: String, recursive: bool },
    Mkdir { path: String, parents: bool, mode: u32 },
    Info,
    Reseed(Reseed),
    Manifest { paths: Option<Vec<String>> },
    PythonWarmUp,
    ExecWithProgress { exec: Exec, progress_ms: u32 },
    Spawn(Spawn),
    ProcessList,
    ProcessOutput(ProcessOutputRequest),
    ProcessWait(ProcessWait),
    ProcessWrite(ProcessWrite),
    ProcessSignal { id: u64, signal: i32, escalate_ms: u32 },
    SetEnv { env: Vec<(String, String)> },
    Rename { from: String, to: String },
    Node(Python),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Spawn {
    pub command: Command,
    pub cwd: Option<String>,
    pub env: Vec<(String, String)>,
    #[serde(with = "serde_bytes")]
    pub stdin: Vec<u8>,
    pub close_stdin: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StreamKind {
    Stdout,
    Stderr,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StreamSet {
    Stdout,
    Stderr,
    Both,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessOutputRequest {
    pub id: u64,
    pub stream: StreamKind,
    pub offset: Option<u64>,
    pub max_bytes: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WaitFor {
    Text(String),
    Regex(String),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessWait {
    pub id: u64,
    pub timeout_ms: u32,
    pub until: Option<WaitFor>,
    pub streams: StreamSet,
    pub stdout_from: u64,
    pub stderr_from: u64,
    pub progress_ms: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessWrite {
    pub id: u64,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    pub close: bool,
    pub timeout_ms: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Command {
    Shell(String),
    Argv(Vec<String>),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Exec {
    pub command: Command,
    pub cwd: Option<String>,
    pub env: Vec<(String, String)>,
    #[serde(with = "serde_bytes")]
    pub stdin: Vec<u8>,
    pub timeout_ms: u32,
    pub output_limit: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Python {
    pub code: String,
    pub timeout_ms: u32,
    pub output_limit: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReadFile {
    pub path: String,
    pub offset: u64,
    pub length: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WriteFile {
    pub path: String,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    pub mode: Option<u32>,
    pub append: bool,
    pub create_parents: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reseed {
    #[serde(with = "serde_bytes")]
    pub entropy: Vec<u8>,
    pub unix_time_ns: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    Pong { agent_version: String },
    Exec(ExecReply),
    Python(PythonReply),
    File(FileData),
    Written { bytes: u64 },
    Entries(Vec<DirEntry>),
    Stat(FileStat),
    Info(AgentInfo),
    Done,
    Manifest(Manifest),
    PythonWarm { interpreter_start_ms: Option<u64> },
    Progress(Progress),
    Process(ProcessInfo),
    Processes(Vec<ProcessInfo>),
    ProcessOutput(ProcessOutput),
    ProcessWaited(ProcessWaited),
    ProcessWritten { bytes: u64, info: ProcessInfo },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub elapsed_ms: u64,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    #[serde(with = "serde_bytes")]
    pub stdout_tail: Vec<u8>,
    #[serde(with = "serde_bytes")]
    pub stderr_tail: Vec<u8>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamState {
    pub total_bytes: u64,
    pub buffer_start: u64,
    pub closed: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub id: u64,
    pub command: String,
    pub pid: i32,
    pub status: Option<ExitStatus>,
    pub group_alive: bool,
    pub started_unix_ms: u64,
    pub ended_unix_ms: Option<u64>,
    pub stdout: StreamState,
    pub stderr: StreamState,
    pub stdin_open: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessOutput {
    pub info: ProcessInfo,
    pub stream: StreamKind,
    pub offset: u64,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    pub skipped: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WaitOutcome {
    Matched,
    Exited,
    TimedOut,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WaitMatch {
    pub stream: StreamKind,
    pub offset: u64,
    pub end: u64,
    #[serde(with = "serde_bytes")]
    pub line: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessWaited {
    pub outcome: WaitOutcome,
    pub found: Option<WaitMatch>,
    pub info: ProcessInfo,
    #[serde(with = "serde_bytes")]
    pub stdout_tail: Vec<u8>,
    #[serde(with = "serde_bytes")]
    pub stderr_tail: Vec<u8>,
    pub waited_ms: u64,
    pub missed: u64,
    pub resume: [u64; 2],
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Output {
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    pub truncated: bool,
    pub total_bytes: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitStatus {
    Code(i32),
    Signal(i32),
    TimedOut,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExecReply {
    pub status: ExitStatus,
    pub stdout: Output,
    pub stderr: Output,
    pub duration_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PythonException {
    pub name: String,
    pub message: String,
    pub traceback: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PythonReply {
    pub value: Option<String>,
    pub stdout: Output,
    pub stderr: Output,
    pub exception: Option<PythonException>,
    pub timed_out: bool,
    pub value_truncated: bool,
    pub value_bytes: u64,
    pub interpreter_start_ms: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileData {
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    pub size: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    pub kind: FileKind,
    pub size: u64,
    pub mode: u32,
    pub mtime_ms: i64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    pub stat: FileStat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    Other,
    Absent,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestEntry {
    pub path: String,
    pub kind: EntryKind,
    pub size: u64,
    pub mode: u32,
    pub sha256: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub entries: Vec<ManifestEntry>,
    pub truncated: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AgentInfo {
    pub agent_version: String,
    pub protocol_version: u16,
    pub uptime_ms: u64,
    pub mem_total: u64,
    pub mem_available: u64,
    pub disk_total: u64,
    pub disk_free: u64,
    pub load: [f32; 3],
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AgentError {
    InvalidRequest { reason: String },
    NotFound { path: String },
    PermissionDenied { path: String },
    AlreadyExists { path: String },
    NotADirectory { path: String },
    IsADirectory { path: String },
    TooLarge { size: u64, limit: u64 },
    NoSpace,
    Io { message: String },
    Unsupported { reason: String },
    NoSuchProcess { id: u64 },
    TooManyProcesses { max: u32 },
}

/// The version number of these frames.
pub const VERSION: u16 = 4;

/// Re-shapes a message into the type of another version by field and
/// variant name (through a CBOR value).
fn reshape<T: Serialize, U: serde::de::DeserializeOwned>(msg: &T) -> Result<U, String> {
    ciborium::Value::serialized(msg).map_err(|e| e.to_string())?.deserialized().map_err(|e| e.to_string())
}

/// A current request as version 4 sends it.
///
/// Errors: [`ProtocolError::UnknownOp`] for an operation version 4 lacks.
pub fn to_v4_request(req: &crate::Request) -> Result<Request, ProtocolError> {
    reshape(req).map_err(|e| ProtocolError::UnknownOp {
        id: req.id,
        reason: format!("the agent speaks protocol version {VERSION}, which lacks this operation: {e}"),
    })
}

/// A version 4 request as the current types hold it.
///
/// Errors: [`ProtocolError::UnknownOp`] (the current types lack one of
/// its shapes, which would be a defect of a later version).
pub fn from_v4_request(req: &Request) -> Result<crate::Request, ProtocolError> {
    reshape(req).map_err(|e| ProtocolError::UnknownOp { id: req.id, reason: e })
}

/// A current response as version 4 sends it: a reply version 4 lacks
/// becomes [`AgentError::Unsupported`] for the same id.
pub fn to_v4_response(resp: &crate::Response) -> Response {
    reshape(resp).unwrap_or_else(|e| Response {
        id: resp.id,
        result: Err(AgentError::Unsupported { reason: format!("protocol version {VERSION} has no such reply: {e}") }),
    })
}

/// A version 4 response as the current types hold it.
///
/// Errors: [`ProtocolError::Decode`] (a shape the current types lack).
pub fn from_v4_response(resp: &Response) -> Result<crate::Response, ProtocolError> {
    reshape(resp).map_err(ProtocolError::Decode)
}
