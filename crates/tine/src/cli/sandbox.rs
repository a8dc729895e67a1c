//! `tine sandbox ls|create|exec|python|cp|branch|kill|logs`: sandboxes on a
//! running server, over MCP ([`super::remote::Session`]), for people
//! (tables) and scripts (`--json`: the tool's structured result).
//!
//! `exec` exits with the command's exit code (128 + the signal that killed
//! it; 124 at its timeout, as timeout(1)); Ctrl-C cancels the call, which
//! kills the command in the guest, and exits 130. `cp` moves a file of any
//! size through a signed URL (`sandbox_files_url`), streamed both ways.
//! Tool errors print the server's message and exit 2.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::{json, Value};

use super::remote::{
    human_bytes, human_duration, number, pairs, print_json, table, text, utc_time, Outcome, RemoteArgs, RemoteError,
    Session, INTERRUPTED_EXIT,
};

/// Exit code of a command that ran out of its timeout (as timeout(1)).
const TIMED_OUT_EXIT: u8 = 124;
/// Largest stdin `exec --stdin` and `python -` read (the tool's 8 MiB).
const MAX_STDIN_BYTES: u64 = 8 << 20;
/// Bytes per chunk of a file upload.
const UPLOAD_CHUNK: usize = 1 << 20;
/// How often `logs --follow` asks for new records.
const FOLLOW_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

// `tine sandbox ...` with the server's flags (no doc comment: clap would
// read it).
#[derive(Args)]
pub(super) struct SandboxArgs {
    #[command(flatten)]
    remote: RemoteArgs,
    #[command(subcommand)]
    command: SandboxCommand,
}

// The subcommands.
#[derive(Subcommand)]
enum SandboxCommand {
    /// List the sandboxes (sandbox_list).
    Ls {
        /// Only those with this label (KEY=VALUE; repeatable, all must match).
        #[arg(long = "label")]
        labels: Vec<String>,
    },
    /// Create a sandbox and print its id (sandbox_create).
    Create(CreateArgs),
    /// Run a command in a sandbox and exit with its exit code
    /// (sandbox_exec). The words after -- are joined with spaces and run
    /// by bash, as ssh does (`-- 'ls /tmp; exit 3'`); with --no-shell they
    /// are the program and its arguments. Ctrl-C kills the command.
    Exec(ExecArgs),
    /// Run Python code in the sandbox's persistent interpreter
    /// (sandbox_run_python); CODE "-" reads it from stdin.
    Python {
        /// The sandbox.
        sandbox: String,
        /// The code (the value of a final expression is printed).
        code: String,
        /// Interrupt it after this many seconds (at most 600) [default: 60].
        #[arg(long)]
        timeout: Option<u32>,
    },
    /// Copy a file between here and a sandbox, any size: `cp ./f ID:/root/f`
    /// or `cp ID:/root/f ./f` (through a signed URL, sandbox_files_url).
    Cp {
        /// The source: a local path, or SANDBOX:/absolute/path.
        source: String,
        /// The destination: a local path (a directory keeps the name), or
        /// SANDBOX:/absolute/path (ending in / keeps the name).
        destination: String,
    },
    /// Branch a running sandbox into N copy-on-write children
    /// (sandbox_branch).
    Branch {
        /// The sandbox.
        sandbox: String,
        /// How many children.
        n: u32,
    },
    /// Kill sandboxes (sandbox_kill).
    Kill {
        /// The sandboxes.
        #[arg(required = true)]
        sandboxes: Vec<String>,
    },
    /// A sandbox's network log: each connection and DNS query with its
    /// verdict (sandbox_network_log).
    Logs {
        /// The sandbox.
        sandbox: String,
        /// Only records from this time on (ms since the Unix epoch).
        #[arg(long)]
        since_ms: Option<u64>,
        /// At most this many records per call (at most 200).
        #[arg(long)]
        limit: Option<u32>,
        /// Keep printing new records until Ctrl-C.
        #[arg(long, short)]
        follow: bool,
    },
}

// `tine sandbox create`'s flags.
#[derive(Args)]
struct CreateArgs {
    /// The template to restore from [default: the server's default].
    #[arg(long)]
    template: Option<String>,
    /// vCPUs.
    #[arg(long)]
    vcpus: Option<u32>,
    /// Guest memory (MiB).
    #[arg(long)]
    memory_mib: Option<u64>,
    /// The sandbox's own disk (MiB).
    #[arg(long)]
    disk_mib: Option<u64>,
    /// A label (KEY=VALUE; repeatable).
    #[arg(long = "label")]
    labels: Vec<String>,
    /// An environment variable for everything the sandbox runs
    /// (KEY=VALUE; repeatable).
    #[arg(long = "env")]
    env: Vec<String>,
    /// Hibernate or kill it after this many seconds without a call.
    #[arg(long)]
    idle_timeout_secs: Option<u64>,
}

// `tine sandbox exec`'s flags.
#[derive(Args)]
struct ExecArgs {
    /// The sandbox.
    sandbox: String,
    /// The command (after --).
    #[arg(last = true, required = true)]
    command: Vec<String>,
    /// Kill the command after this many seconds (at most 600) [default: 60].
    #[arg(long)]
    timeout: Option<u32>,
    /// Working directory in the sandbox [default: /].
    #[arg(long)]
    cwd: Option<String>,
    /// An extra environment variable (KEY=VALUE; repeatable).
    #[arg(long = "env")]
    env: Vec<String>,
    /// Run the words as a program and its arguments, without a shell.
    #[arg(long)]
    no_shell: bool,
    /// Feed this command's stdin to the command (at most 8 MiB).
    #[arg(long, short = 'i')]
    stdin: bool,
}

/// Checks what can be checked of `command` before a session is opened.
///
/// Errors: [`RemoteError::Usage`].
fn check(command: &SandboxCommand) -> Result<(), RemoteError> {
    match command {
        SandboxCommand::Ls { labels } => pairs("label", labels).map(drop),
        SandboxCommand::Create(c) => pairs("label", &c.labels).and_then(|_| pairs("env", &c.env)).map(drop),
        SandboxCommand::Exec(e) => pairs("env", &e.env).map(drop),
        SandboxCommand::Cp { source, destination } => {
            sides(Place::parse(source)?, Place::parse(destination)?).map(drop)
        }
        _ => Ok(()),
    }
}

/// Runs `tine sandbox ...`; errors are printed here with their exit codes.
pub(super) fn run(args: SandboxArgs) -> anyhow::Result<ExitCode> {
    if let Err(e) = check(&args.command) {
        return Ok(e.report());
    }
    let session = match Session::open(&args.remote) {
        Ok(s) => s,
        Err(e) => return Ok(e.report()),
    };
    let json = args.remote.json;
    let r = match args.command {
        SandboxCommand::Ls { labels } => ls(&session, &labels, json),
        SandboxCommand::Create(c) => create(&session, c, json),
        SandboxCommand::Exec(e) => exec(&session, e, json),
        SandboxCommand::Python { sandbox, code, timeout } => python(&session, &sandbox, code, timeout, json),
        SandboxCommand::Cp { source, destination } => cp(&session, &source, &destination, json),
        SandboxCommand::Branch { sandbox, n } => branch(&session, &sandbox, n, json),
        SandboxCommand::Kill { sandboxes } => kill(&session, &sandboxes, json),
        SandboxCommand::Logs { sandbox, since_ms, limit, follow } => {
            logs(&session, &sandbox, since_ms, limit, follow, json)
        }
    };
    Ok(r.unwrap_or_else(|e| e.report()))
}

/// The labels of a sandbox info as `k=v,k=v`.
fn labels_of(info: &Value) -> String {
    let Some(m) = info.get("labels").and_then(Value::as_object) else { return String::new() };
    m.iter().map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default())).collect::<Vec<_>>().join(",")
}

/// The table of sandbox infos: id, state, template, shape, uptime, labels.
fn sandbox_table(infos: &[Value]) -> String {
    let rows: Vec<Vec<String>> = infos
        .iter()
        .map(|s| {
            vec![
                text(s, "sandbox_id").to_owned(),
                text(s, "state").to_owned(),
                s.get("template").and_then(Value::as_str).unwrap_or("-").to_owned(),
                number(s, "vcpus").to_string(),
                human_bytes(number(s, "memory_mib") << 20),
                human_duration(number(s, "uptime_ms")),
                labels_of(s),
            ]
        })
        .collect();
    table(&["ID", "STATE", "TEMPLATE", "VCPUS", "MEMORY", "UPTIME", "LABELS"], &rows)
}

fn ls(session: &Session, labels: &[String], json: bool) -> Result<ExitCode, RemoteError> {
    let labels = pairs("label", labels)?;
    let mut args = json!({});
    if !labels.is_empty() {
        args["labels"] = Value::Object(labels);
    }
    let r = session.call("sandbox_list", args)?;
    if json {
        print_json(&r);
    } else {
        let infos = r.get("sandboxes").and_then(Value::as_array).cloned().unwrap_or_default();
        print!("{}", sandbox_table(&infos));
    }
    Ok(ExitCode::SUCCESS)
}

fn create(session: &Session, c: CreateArgs, json: bool) -> Result<ExitCode, RemoteError> {
    let mut args = json!({});
    if let Some(t) = c.template {
        args["template"] = t.into();
    }
    if let Some(v) = c.vcpus {
        args["vcpus"] = v.into();
    }
    if let Some(m) = c.memory_mib {
        args["memory_mib"] = m.into();
    }
    if let Some(d) = c.disk_mib {
        args["disk_mib"] = d.into();
    }
    if let Some(i) = c.idle_timeout_secs {
        args["idle_timeout_secs"] = i.into();
    }
    let labels = pairs("label", &c.labels)?;
    if !labels.is_empty() {
        args["labels"] = Value::Object(labels);
    }
    let env = pairs("env", &c.env)?;
    if !env.is_empty() {
        args["env"] = Value::Object(env);
    }
    let r = session.call("sandbox_create", args)?;
    if json {
        print_json(&r);
    } else {
        println!("{}", text(&r, "sandbox_id"));
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads this process's stdin whole, at most [`MAX_STDIN_BYTES`], as text.
fn read_stdin() -> Result<String, RemoteError> {
    let mut buf = Vec::new();
    std::io::stdin()
        .take(MAX_STDIN_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(|source| RemoteError::Io { what: "read stdin".into(), source })?;
    if buf.len() as u64 > MAX_STDIN_BYTES {
        return Err(RemoteError::Usage(format!(
            "stdin holds more than {} (the tool's limit)",
            human_bytes(MAX_STDIN_BYTES)
        )));
    }
    String::from_utf8(buf).map_err(|_| RemoteError::Usage("stdin is not UTF-8 text (the tool takes text)".into()))
}

/// The exit code of an exec's result: its exit code, 128 + its signal,
/// [`TIMED_OUT_EXIT`] at its timeout.
fn exec_exit(r: &Value) -> u8 {
    if r.get("timed_out").and_then(Value::as_bool) == Some(true) {
        return TIMED_OUT_EXIT;
    }
    if let Some(code) = r.get("exit_code").and_then(Value::as_i64) {
        return u8::try_from(code.rem_euclid(256)).unwrap_or(1);
    }
    if let Some(signal) = r.get("signal").and_then(Value::as_i64) {
        return u8::try_from((128 + signal).clamp(0, 255)).unwrap_or(1);
    }
    1
}

fn exec(session: &Session, e: ExecArgs, json: bool) -> Result<ExitCode, RemoteError> {
    let mut args = json!({ "sandbox_id": e.sandbox });
    if e.no_shell {
        args["argv"] = json!(e.command);
    } else {
        args["command"] = e.command.join(" ").into();
    }
    if let Some(t) = e.timeout {
        args["timeout_secs"] = t.into();
    }
    if let Some(c) = e.cwd {
        args["cwd"] = c.into();
    }
    let env = pairs("env", &e.env)?;
    if !env.is_empty() {
        args["env"] = Value::Object(env);
    }
    if e.stdin {
        args["stdin"] = read_stdin()?.into();
    }
    let r = match session.call_interruptible("sandbox_exec", args)? {
        Outcome::Done(r) => r,
        Outcome::Interrupted => {
            eprintln!("tine: interrupted: the command was stopped in the sandbox");
            return Ok(ExitCode::from(INTERRUPTED_EXIT));
        }
    };
    if json {
        print_json(&r);
    } else {
        // Write errors (a closed pipe) do not change the exit code.
        let _ = std::io::stdout().write_all(text(&r, "stdout").as_bytes());
        let _ = std::io::stderr().write_all(text(&r, "stderr").as_bytes());
        if r.get("truncated").and_then(Value::as_bool) == Some(true) {
            eprintln!(
                "tine: output cut (stdout {} and stderr {} in all): redirect it to a file in the sandbox and \
                 `tine sandbox cp` it here",
                human_bytes(number(&r, "stdout_bytes")),
                human_bytes(number(&r, "stderr_bytes"))
            );
        }
        if r.get("timed_out").and_then(Value::as_bool) == Some(true) {
            eprintln!("tine: the command was killed at its timeout (--timeout, at most 600 s)");
        }
    }
    Ok(ExitCode::from(exec_exit(&r)))
}

fn python(
    session: &Session,
    sandbox: &str,
    code: String,
    timeout: Option<u32>,
    json: bool,
) -> Result<ExitCode, RemoteError> {
    let code = if code == "-" { read_stdin()? } else { code };
    let mut args = json!({ "sandbox_id": sandbox, "code": code });
    if let Some(t) = timeout {
        args["timeout_secs"] = t.into();
    }
    let r = session.call("sandbox_run_python", args)?;
    if json {
        print_json(&r);
        return Ok(ExitCode::SUCCESS);
    }
    let _ = std::io::stdout().write_all(text(&r, "stdout").as_bytes());
    let _ = std::io::stderr().write_all(text(&r, "stderr").as_bytes());
    if let Some(v) = r.get("result").and_then(Value::as_str) {
        println!("{v}");
    }
    if r.get("timed_out").and_then(Value::as_bool) == Some(true) {
        eprintln!("tine: the cell was interrupted at its timeout (the interpreter's state is kept)");
        return Ok(ExitCode::from(TIMED_OUT_EXIT));
    }
    if let Some(err) = r.get("error").filter(|e| !e.is_null()) {
        let traceback = text(err, "traceback");
        if traceback.is_empty() {
            eprintln!("{}: {}", text(err, "name"), text(err, "message"));
        } else {
            eprint!("{traceback}");
            if !traceback.ends_with('\n') {
                eprintln!();
            }
        }
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// One side of `tine sandbox cp`.
#[derive(Debug, PartialEq, Eq)]
enum Place {
    /// A path here.
    Local(PathBuf),
    /// A path in a sandbox.
    Remote {
        /// The sandbox.
        sandbox: String,
        /// The absolute path in it.
        path: String,
    },
}

impl Place {
    /// `arg` as scp reads it: `SANDBOX:PATH` when the part before the
    /// first `:` is not empty and holds no `/`, else a local path (write
    /// `./a:b` for a local file with a colon).
    ///
    /// Errors: [`RemoteError::Usage`] for a sandbox path that is not
    /// absolute.
    fn parse(arg: &str) -> Result<Place, RemoteError> {
        match arg.split_once(':') {
            Some((sandbox, path)) if !sandbox.is_empty() && !sandbox.contains('/') => {
                if !path.starts_with('/') {
                    return Err(RemoteError::Usage(format!(
                        "{arg:?}: the path in the sandbox must be absolute, as in {sandbox}:/{}",
                        path.trim_start_matches("./")
                    )));
                }
                Ok(Place::Remote { sandbox: sandbox.to_owned(), path: path.to_owned() })
            }
            _ => Ok(Place::Local(PathBuf::from(arg))),
        }
    }
}

/// The last component of `path` (a file name), if it has one.
fn file_name(path: &str) -> Option<&str> {
    path.trim_end_matches('/').rsplit('/').next().filter(|n| !n.is_empty() && *n != "." && *n != "..")
}

/// Where an upload of `local` to sandbox path `path` goes: `path`, or
/// within it when it ends in `/`.
fn upload_target(local: &Path, path: &str) -> Result<String, RemoteError> {
    if !path.ends_with('/') {
        return Ok(path.to_owned());
    }
    let name = local.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        RemoteError::Usage(format!("{}: no file name to keep; name the file in the sandbox", local.display()))
    })?;
    Ok(format!("{path}{name}"))
}

/// Where a download of sandbox path `path` to `local` goes: `local`, or
/// within it when it is a directory (or ends in `/`).
fn download_target(path: &str, local: &Path) -> Result<PathBuf, RemoteError> {
    let is_dir = local.is_dir() || local.as_os_str().to_string_lossy().ends_with('/');
    if !is_dir {
        return Ok(local.to_path_buf());
    }
    let name = file_name(path)
        .ok_or_else(|| RemoteError::Usage(format!("{path}: no file name to keep; name the local file")))?;
    Ok(local.join(name))
}

/// A signed URL for `method` on `path` in `sandbox` (sandbox_files_url).
fn files_url(session: &Session, sandbox: &str, path: &str, method: &str) -> Result<String, RemoteError> {
    let r = session.call("sandbox_files_url", json!({ "sandbox_id": sandbox, "path": path, "method": method }))?;
    match r.get("url").and_then(Value::as_str) {
        Some(u) => Ok(u.to_owned()),
        None => Err(RemoteError::Transfer("sandbox_files_url answered without a url".into())),
    }
}

/// A refused transfer's message: the server's JSON `message`, else the body.
async fn refusal(what: &str, response: reqwest::Response) -> RemoteError {
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    let message = serde_json::from_str::<Value>(&body)
        .ok()
        .and_then(|v| v.get("message").and_then(Value::as_str).map(str::to_owned))
        .unwrap_or(body);
    RemoteError::Transfer(format!("{what}: the server answered {status}: {message}"))
}

/// Which way a copy goes.
enum Copy {
    /// A local file into a sandbox.
    Up { local: PathBuf, sandbox: String, path: String },
    /// A sandbox's file to here.
    Down { sandbox: String, path: String, local: PathBuf },
}

/// The copy from `from` to `to`: exactly one of them in a sandbox.
///
/// Errors: [`RemoteError::Usage`] for two local or two sandbox paths.
fn sides(from: Place, to: Place) -> Result<Copy, RemoteError> {
    match (from, to) {
        (Place::Local(local), Place::Remote { sandbox, path }) => Ok(Copy::Up { local, sandbox, path }),
        (Place::Remote { sandbox, path }, Place::Local(local)) => Ok(Copy::Down { sandbox, path, local }),
        (Place::Local(_), Place::Local(_)) => {
            Err(RemoteError::Usage("both paths are local: name the sandbox side as SANDBOX:/path".into()))
        }
        (Place::Remote { .. }, Place::Remote { .. }) => Err(RemoteError::Usage(
            "both paths are in sandboxes: copy to here first, then on (sandbox to sandbox is not direct)".into(),
        )),
    }
}

fn cp(session: &Session, source: &str, destination: &str, json: bool) -> Result<ExitCode, RemoteError> {
    let (bytes, from_s, to_s) = match sides(Place::parse(source)?, Place::parse(destination)?)? {
        Copy::Up { local, sandbox, path } => {
            let path = upload_target(&local, &path)?;
            let bytes = upload(session, &local, &sandbox, &path)?;
            (bytes, local.display().to_string(), format!("{sandbox}:{path}"))
        }
        Copy::Down { sandbox, path, local } => {
            let local = download_target(&path, &local)?;
            let bytes = download(session, &sandbox, &path, &local)?;
            (bytes, format!("{sandbox}:{path}"), local.display().to_string())
        }
    };
    if json {
        print_json(&json!({ "source": from_s, "destination": to_s, "bytes": bytes }));
    }
    Ok(ExitCode::SUCCESS)
}

/// Streams local file `local` into `path` in `sandbox`; the bytes sent.
fn upload(session: &Session, local: &Path, sandbox: &str, path: &str) -> Result<u64, RemoteError> {
    let io = |what: &str| {
        let what = format!("{what} {}", local.display());
        move |source| RemoteError::Io { what, source }
    };
    let file = std::fs::File::open(local).map_err(io("open"))?;
    let meta = file.metadata().map_err(io("stat"))?;
    if !meta.is_file() {
        return Err(RemoteError::Usage(format!(
            "{} is not a regular file (copy a directory as an archive: tar -czf d.tgz DIR)",
            local.display()
        )));
    }
    let len = meta.len();
    let url = files_url(session, sandbox, path, "PUT")?;
    session.block_on(async {
        let file = tokio::fs::File::from_std(file);
        let chunks = futures_util::stream::unfold(file, |mut f| async move {
            use tokio::io::AsyncReadExt;
            let mut buf = vec![0u8; UPLOAD_CHUNK];
            match f.read(&mut buf).await {
                Ok(0) => None,
                Ok(n) => {
                    buf.truncate(n);
                    Some((Ok::<_, std::io::Error>(bytes::Bytes::from(buf)), f))
                }
                Err(e) => Some((Err(e), f)),
            }
        });
        let response = session
            .http
            .put(&url)
            .header(reqwest::header::CONTENT_LENGTH, len)
            .body(reqwest::Body::wrap_stream(chunks))
            .send()
            .await
            .map_err(|e| RemoteError::Transfer(format!("upload to {sandbox}:{path}: {e}")))?;
        if !response.status().is_success() {
            return Err(refusal(&format!("upload to {sandbox}:{path}"), response).await);
        }
        Ok(len)
    })
}

/// Streams `path` in `sandbox` into local file `local` (through a file
/// beside it, renamed when whole: a failed download leaves nothing); the
/// bytes received.
fn download(session: &Session, sandbox: &str, path: &str, local: &Path) -> Result<u64, RemoteError> {
    let url = files_url(session, sandbox, path, "GET")?;
    let name = local.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let part = local.with_file_name(format!(".{name}.tine-part-{}", std::process::id()));
    let r = session.block_on(async {
        use tokio::io::AsyncWriteExt;
        let what = format!("download of {sandbox}:{path}");
        let mut response =
            session.http.get(&url).send().await.map_err(|e| RemoteError::Transfer(format!("{what}: {e}")))?;
        if !response.status().is_success() {
            return Err(refusal(&what, response).await);
        }
        let expected = response.content_length();
        let io = |source| RemoteError::Io { what: format!("write {}", part.display()), source };
        let mut out = tokio::fs::File::create(&part).await.map_err(io)?;
        let mut got = 0u64;
        while let Some(chunk) = response.chunk().await.map_err(|e| RemoteError::Transfer(format!("{what}: {e}")))? {
            out.write_all(&chunk).await.map_err(io)?;
            got += chunk.len() as u64;
        }
        out.flush().await.map_err(io)?;
        out.sync_all().await.map_err(io)?;
        if let Some(n) = expected.filter(|n| *n != got) {
            return Err(RemoteError::Transfer(format!("{what}: the server sent {got} of {n} bytes")));
        }
        Ok(got)
    });
    match r {
        Ok(n) => {
            std::fs::rename(&part, local)
                .map_err(|source| RemoteError::Io { what: format!("rename onto {}", local.display()), source })?;
            Ok(n)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&part);
            Err(e)
        }
    }
}

fn branch(session: &Session, sandbox: &str, n: u32, json: bool) -> Result<ExitCode, RemoteError> {
    let r = session.call("sandbox_branch", json!({ "sandbox_id": sandbox, "n": n }))?;
    if json {
        print_json(&r);
        return Ok(ExitCode::SUCCESS);
    }
    let children = r.get("children").and_then(Value::as_array).cloned().unwrap_or_default();
    print!("{}", sandbox_table(&children));
    let ms = |k: &str| r.get(k).and_then(Value::as_f64).unwrap_or_default();
    eprintln!(
        "tine: {} children of {sandbox} ready in {} ms ({}, source paused {:.1} ms)",
        children.len(),
        number(&r, "ready_ms"),
        text(&r, "mode"),
        ms("pause_ms")
    );
    Ok(ExitCode::SUCCESS)
}

fn kill(session: &Session, sandboxes: &[String], json: bool) -> Result<ExitCode, RemoteError> {
    let mut results = Vec::new();
    let mut failed = None;
    for id in sandboxes {
        match session.call("sandbox_kill", json!({ "sandbox_id": id })) {
            Ok(r) => {
                if !json {
                    println!("killed {id}");
                }
                results.push(r);
            }
            Err(e) => failed = Some(e.report()),
        }
    }
    if json {
        print_json(&Value::Array(results));
    }
    Ok(failed.unwrap_or(ExitCode::SUCCESS))
}

/// The rows of network log records.
fn log_rows(records: &[Value]) -> Vec<Vec<String>> {
    records
        .iter()
        .map(|r| {
            let port = number(r, "port");
            let dest = match r.get("domain").and_then(Value::as_str) {
                Some(d) => format!("{d} ({}:{port})", text(r, "addr")),
                None => format!("{}:{port}", text(r, "addr")),
            };
            vec![
                utc_time(number(r, "time_ms")),
                text(r, "protocol").to_owned(),
                text(r, "direction").to_owned(),
                dest,
                if r.get("allowed").and_then(Value::as_bool) == Some(true) { "allowed" } else { "denied" }.to_owned(),
                text(r, "rule").to_owned(),
                human_bytes(number(r, "bytes_out")),
                human_bytes(number(r, "bytes_in")),
            ]
        })
        .collect()
}

const LOG_HEADERS: [&str; 8] = ["TIME (UTC)", "PROTO", "DIRECTION", "DESTINATION", "VERDICT", "RULE", "OUT", "IN"];

fn logs(
    session: &Session,
    sandbox: &str,
    since_ms: Option<u64>,
    limit: Option<u32>,
    follow: bool,
    json: bool,
) -> Result<ExitCode, RemoteError> {
    let mut since = since_ms.unwrap_or(0);
    // Records come again when a page ends at a time others share: the
    // last id printed keeps them from printing twice.
    let mut last_id = 0u64;
    let mut header = !json;
    loop {
        let mut args = json!({ "sandbox_id": sandbox, "since_ms": since });
        if let Some(l) = limit {
            args["limit"] = l.into();
        }
        let r = session.call("sandbox_network_log", args)?;
        let fresh: Vec<Value> = r
            .get("records")
            .and_then(Value::as_array)
            .map(|v| v.iter().filter(|rec| number(rec, "id") > last_id).cloned().collect())
            .unwrap_or_default();
        if json && !follow {
            print_json(&r);
            return Ok(ExitCode::SUCCESS);
        }
        if json {
            for rec in &fresh {
                println!("{rec}");
            }
        } else {
            let t = table(&LOG_HEADERS, &log_rows(&fresh));
            // The header once; in follow mode each batch aligns alone.
            let body: String = t.lines().skip(usize::from(!header)).map(|l| format!("{l}\n")).collect();
            if header || !fresh.is_empty() {
                print!("{body}");
            }
            header = false;
        }
        let _ = std::io::stdout().flush();
        if let Some(rec) = fresh.last() {
            last_id = number(rec, "id");
            since = since.max(number(rec, "time_ms"));
        }
        let more = r.get("next_since_ms").and_then(Value::as_u64);
        if let Some(next) = more {
            since = since.max(next);
            if !fresh.is_empty() {
                continue;
            }
        }
        if !follow {
            if number(&r, "dropped") > 0 && !json {
                eprintln!("tine: {} older records fell out of the sandbox's bounded log", number(&r, "dropped"));
            }
            return Ok(ExitCode::SUCCESS);
        }
        let interrupted = session.block_on(async {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => true,
                () = tokio::time::sleep(FOLLOW_EVERY) => false,
            }
        });
        if interrupted {
            return Ok(ExitCode::SUCCESS);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote(sandbox: &str, path: &str) -> Place {
        Place::Remote { sandbox: sandbox.into(), path: path.into() }
    }

    #[test]
    fn cp_paths_are_read_as_scp_reads_them() {
        assert_eq!(Place::parse("sb-h1-4q0c:/root/f").unwrap(), remote("sb-h1-4q0c", "/root/f"));
        assert_eq!(Place::parse("sb-3:/a:b").unwrap(), remote("sb-3", "/a:b"));
        assert_eq!(Place::parse("./f").unwrap(), Place::Local("./f".into()));
        assert_eq!(Place::parse("./a:b").unwrap(), Place::Local("./a:b".into()));
        assert_eq!(Place::parse("/tmp/x:y").unwrap(), Place::Local("/tmp/x:y".into()));
        assert_eq!(Place::parse(":x").unwrap(), Place::Local(":x".into()));
        assert_eq!(Place::parse("f").unwrap(), Place::Local("f".into()));
        let e = Place::parse("sb-3:root/f").unwrap_err().to_string();
        assert!(e.contains("must be absolute") && e.contains("sb-3:/root/f"), "{e}");
        assert!(Place::parse("sb-3:").is_err());
    }

    #[test]
    fn cp_keeps_the_file_name_for_directories() {
        assert_eq!(upload_target(Path::new("./data/f.bin"), "/root/").unwrap(), "/root/f.bin");
        assert_eq!(upload_target(Path::new("./f.bin"), "/root/g").unwrap(), "/root/g");
        assert!(upload_target(Path::new("/"), "/root/").is_err());
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(download_target("/root/f.bin", dir.path()).unwrap(), dir.path().join("f.bin"));
        assert_eq!(download_target("/root/f.bin", Path::new("out/")).unwrap(), Path::new("out/f.bin"));
        assert_eq!(download_target("/root/f.bin", Path::new("./g")).unwrap(), Path::new("./g"));
        assert!(download_target("/", dir.path()).is_err());
        assert_eq!(file_name("/root/d/"), Some("d"));
    }

    #[test]
    fn exec_exit_codes_follow_the_command() {
        assert_eq!(exec_exit(&json!({"exit_code": 0, "timed_out": false})), 0);
        assert_eq!(exec_exit(&json!({"exit_code": 3, "timed_out": false})), 3);
        assert_eq!(exec_exit(&json!({"exit_code": 256 + 7})), 7);
        assert_eq!(exec_exit(&json!({"exit_code": -1})), 255);
        assert_eq!(exec_exit(&json!({"exit_code": null, "signal": 9, "timed_out": false})), 137);
        assert_eq!(exec_exit(&json!({"exit_code": null, "signal": null, "timed_out": true})), 124);
        assert_eq!(exec_exit(&json!({})), 1);
    }

    #[test]
    fn sandbox_tables_show_shape_uptime_and_labels() {
        let infos = [json!({
            "sandbox_id": "sb-h1-1", "state": "running", "template": "default", "vcpus": 1,
            "memory_mib": 512, "uptime_ms": 192_000, "labels": {"team": "a", "x": "y"}
        })];
        let t = sandbox_table(&infos);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0].split_whitespace().collect::<Vec<_>>(), LS_HEADERS);
        assert_eq!(
            lines[1].split_whitespace().collect::<Vec<_>>(),
            ["sb-h1-1", "running", "default", "1", "512.0", "MiB", "3m12s", "team=a,x=y"]
        );
    }

    const LS_HEADERS: [&str; 7] = ["ID", "STATE", "TEMPLATE", "VCPUS", "MEMORY", "UPTIME", "LABELS"];

    #[test]
    fn the_command_line_parses() {
        use clap::Parser;
        #[derive(Parser)]
        struct T {
            #[command(subcommand)]
            c: SandboxCommand,
        }
        let t = T::try_parse_from(["t", "exec", "sb-1", "--timeout", "9", "--", "exit", "3"]).unwrap();
        let SandboxCommand::Exec(e) = t.c else { panic!("not exec") };
        assert_eq!((e.sandbox.as_str(), e.command.join(" "), e.timeout), ("sb-1", "exit 3".into(), Some(9)));
        // Flags after -- belong to the command.
        let t = T::try_parse_from(["t", "exec", "sb-1", "--", "ls", "--json"]).unwrap();
        let SandboxCommand::Exec(e) = t.c else { panic!("not exec") };
        assert_eq!(e.command, ["ls", "--json"]);
        assert!(T::try_parse_from(["t", "exec", "sb-1"]).is_err(), "a command is required");
        assert!(T::try_parse_from(["t", "kill"]).is_err(), "a sandbox is required");
    }
}
