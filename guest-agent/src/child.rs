//! Child processes: how `exec`, background processes and the Python and
//! Node.js interpreters start what they run, in one place. Each gets the
//! command's argv ([`argv`]), a process group of its own, its working
//! directory, its environment (the login defaults the agent inherited,
//! the user's identity, the sandbox environment of [`crate::env`]), and
//! the user and groups it runs as; a failed start and an exit status are
//! mapped the same way for all of them ([`start_error`], [`exit_status`]).
//!
//! Who and where come from the process defaults ([`set_defaults`],
//! `Op::SetProcessDefaults`): an OCI image's `User` and `WorkingDir`
//! (OCI image spec, config.md). They live in the agent's memory like the
//! sandbox environment, so a snapshot, a template and a branch child
//! carry them. Without them commands run as root, in `/` (exec,
//! background processes) or `/root` (the interpreters).
//!
//! Running as another user follows what container runtimes do (runc's
//! `libcontainer/user`): a uid `/etc/passwd` lacks runs with gid 0 and
//! `HOME=/`; the pipes the agent made for the child's fds 0-2 are given
//! to the user, so that it can open `/dev/stdout` and friends (pipes are
//! mode 0600, owned by their maker).

use std::os::fd::RawFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::Command as Process;
use std::sync::Mutex;

use tine_protocol::{AgentError, Command, ExitStatus, ProcessDefaults, MAX_USER_BYTES, MAX_WORKING_DIR_BYTES};

/// The shell for `Command::Shell`: bash where the image has it, else sh.
pub fn shell() -> &'static str {
    if Path::new("/bin/bash").exists() {
        "/bin/bash"
    } else {
        "/bin/sh"
    }
}

/// The argv of `command`: a shell script runs as `shell -c script`.
///
/// Errors: `InvalidRequest` for an empty argv.
pub fn argv(command: Command) -> Result<Vec<String>, AgentError> {
    match command {
        Command::Shell(script) => Ok(vec![shell().to_string(), "-c".into(), script]),
        Command::Argv(v) if !v.is_empty() => Ok(v),
        Command::Argv(_) => Err(AgentError::InvalidRequest { reason: "empty argv".into() }),
    }
}

/// A user as processes run: ids, supplementary groups, and the names a
/// login would set (`HOME`, `USER`, `LOGNAME`) where `/etc/passwd` has
/// the user.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Identity {
    uid: libc::uid_t,
    gid: libc::gid_t,
    groups: Vec<libc::gid_t>,
    name: Option<String>,
    home: Option<String>,
}

/// The process defaults as given (empty values as none), the user
/// resolved, and their generation (bumped at every change, so an
/// interpreter started under older ones is replaced).
struct Defaults {
    generation: u64,
    given: ProcessDefaults,
    identity: Option<Identity>,
}

static DEFAULTS: Mutex<Defaults> =
    Mutex::new(Defaults { generation: 0, given: ProcessDefaults { user: None, working_dir: None }, identity: None });

fn defaults() -> std::sync::MutexGuard<'static, Defaults> {
    DEFAULTS.lock().unwrap_or_else(|p| p.into_inner())
}

fn invalid(reason: String) -> AgentError {
    AgentError::InvalidRequest { reason }
}

/// One `name:x:id:...` line of `/etc/passwd` or `/etc/group` (passwd(5),
/// group(5)), split on `:`.
fn entries(path: &str) -> Vec<Vec<String>> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split(':').map(str::to_string).collect())
        .collect()
}

/// Resolves an OCI `User` (`user`, `uid`, `user:group`, `uid:gid`, ...)
/// against `passwd` and `group` (the files' entries, see [`entries`]).
fn resolve(user: &str, passwd: &[Vec<String>], group: &[Vec<String>]) -> Result<Identity, AgentError> {
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    // A passwd entry by name, or by uid for a number.
    let by_user = passwd.iter().find(|e| e.len() >= 7 && (e[0] == u || (u.parse::<u32>().is_ok() && e[2] == u)));
    let uid = match (u.parse::<libc::uid_t>(), by_user) {
        (Ok(n), _) => n,
        (Err(_), Some(e)) => e[2].parse().map_err(|_| invalid(format!("/etc/passwd has a bad uid for user {u}")))?,
        (Err(_), None) => return Err(invalid(format!("user {u:?} is not in the image's /etc/passwd"))),
    };
    let gid = match g {
        Some(g) => match g.parse::<libc::gid_t>() {
            Ok(n) => n,
            Err(_) => group
                .iter()
                .find(|e| e.len() >= 3 && e[0] == g)
                .and_then(|e| e[2].parse().ok())
                .ok_or_else(|| invalid(format!("group {g:?} is not in the image's /etc/group")))?,
        },
        // The user's primary group; a uid with no entry runs with gid 0, as
        // runc and Docker run it (images made for any uid, e.g. OpenShift's,
        // make their directories group-0 writable).
        None => match by_user {
            Some(e) => e[3].parse().map_err(|_| invalid(format!("/etc/passwd has a bad gid for user {u}")))?,
            None => 0,
        },
    };
    let name = by_user.map(|e| e[0].clone());
    let mut groups = vec![gid];
    if let Some(name) = &name {
        for e in group.iter().filter(|e| e.len() >= 4) {
            if e[3].split(',').any(|m| m == name) {
                if let Ok(id) = e[2].parse() {
                    if !groups.contains(&id) {
                        groups.push(id);
                    }
                }
            }
        }
    }
    // No entry, or an empty home: `/`, as runc sets it.
    let home = by_user.map(|e| e[5].clone()).filter(|h| !h.is_empty());
    Ok(Identity { uid, gid, groups, name, home })
}

/// Checks a working directory and makes it if missing (as `mkdir -p`; the
/// last directory, when made here, is given to `owner`'s uid and gid).
///
/// Errors: `InvalidRequest` for a relative or too long path; `Io` when it
/// cannot be made.
fn make_working_dir(w: &str, owner: Option<&Identity>) -> Result<(), AgentError> {
    if !w.starts_with('/') || w.len() > MAX_WORKING_DIR_BYTES || w.contains('\0') {
        return Err(invalid(format!(
            "the working directory must be an absolute path of at most {MAX_WORKING_DIR_BYTES} bytes: {w:?}"
        )));
    }
    let existed = Path::new(w).is_dir();
    let io = |e: std::io::Error| AgentError::Io { message: format!("cannot make the working directory {w}: {e}") };
    std::fs::create_dir_all(w).map_err(io)?;
    if let (false, Some(id)) = (existed, owner) {
        std::os::unix::fs::chown(w, Some(id.uid), Some(id.gid)).map_err(io)?;
    }
    Ok(())
}

/// Sets the process defaults (`Op::SetProcessDefaults`); returns the ones
/// they replace (empty values as none).
///
/// Errors: `InvalidRequest` for a user or group the guest's files lack, a
/// value too long, or a relative working directory; `Io` when the working
/// directory cannot be made. On an error nothing changes.
pub fn set_defaults(d: ProcessDefaults) -> Result<ProcessDefaults, AgentError> {
    // Empty is none.
    let d = ProcessDefaults {
        user: d.user.filter(|u| !u.is_empty()),
        working_dir: d.working_dir.filter(|w| !w.is_empty()),
    };
    let identity = match &d.user {
        Some(u) if u.len() > MAX_USER_BYTES || u.contains('\0') => {
            return Err(invalid(format!("a user is at most {MAX_USER_BYTES} bytes, without NUL")));
        }
        Some(u) => Some(resolve(u, &entries("/etc/passwd"), &entries("/etc/group"))?),
        None => None,
    };
    if let Some(w) = &d.working_dir {
        make_working_dir(w, identity.as_ref())?;
    }
    let mut current = defaults();
    // The same defaults again change nothing: a running interpreter is
    // kept (a recipe build sets root's around its setup every time).
    if current.given == d {
        return Ok(d);
    }
    current.generation += 1;
    current.identity = identity;
    Ok(std::mem::replace(&mut current.given, d))
}

/// The defaults' generation (0: never set).
pub fn generation() -> u64 {
    defaults().generation
}

/// Where a command starts when its request names no directory.
#[derive(Clone, Copy)]
pub enum Home {
    /// `/` (exec, background processes).
    Root,
    /// The user's home directory if it exists, else `/` (interpreters).
    User,
}

/// A command ready to [`spawn`]: `argv[0]` with the rest as arguments, in
/// its own process group, with the user's identity variables and `env`
/// (the sandbox environment) over the inherited login defaults, running as
/// the default user, to whom its fds 0-2 and the inherited fds `shared` are
/// given when they are pipes or sockets. Returns it with the directory it
/// is to start in: `cwd`, else the default working directory, else as
/// `home` says (for [`spawn`] and [`start_error`]). The caller sets stdio
/// and adds its own variables.
pub fn command(
    argv: &[String],
    cwd: Option<&str>,
    home: Home,
    env: &[(String, String)],
    shared: &[RawFd],
) -> (Process, String) {
    command_under(&defaults(), argv, cwd, home, env, shared)
}

/// [`command`] under the defaults `d`.
fn command_under(
    d: &Defaults,
    argv: &[String],
    cwd: Option<&str>,
    home: Home,
    env: &[(String, String)],
    shared: &[RawFd],
) -> (Process, String) {
    // Root's home without a user; a user's from its passwd entry, else `/`.
    let user_home = match &d.identity {
        Some(i) => i.home.clone().unwrap_or_else(|| "/".into()),
        None => "/root".into(),
    };
    let dir = match (cwd, &d.given.working_dir, home) {
        (Some(c), _, _) => c.to_string(),
        (None, Some(w), _) => w.clone(),
        (None, None, Home::User) if Path::new(&user_home).is_dir() => user_home.clone(),
        (None, None, _) => "/".into(),
    };
    let mut p = Process::new(&argv[0]);
    p.args(&argv[1..]).process_group(0);
    if let Some(id) = &d.identity {
        p.env("HOME", &user_home);
        if let Some(name) = &id.name {
            p.env("USER", name).env("LOGNAME", name);
        }
        run_as(&mut p, id, shared);
    }
    p.envs(env.iter().map(|(k, v)| (k, v)));
    (p, dir)
}

/// Starts `p` (made by [`command`]) in `dir`.
///
/// The directory is not given to `p` (`Command::current_dir`): with it,
/// std's statically linked build, which the agent is, cannot find glibc's
/// `posix_spawn_file_actions_addchdir_np` and forks the whole agent
/// instead of spawning (`clone(2)` without `CLONE_VM`; with `CLONE_VM |
/// CLONE_VFORK` otherwise, strace). A fork costs a copy-on-write fault for
/// every agent page written before the exec, and a guest page fault is
/// milliseconds where guest kernel mode is emulated (docs/hosts.md). So
/// the calling thread takes a working directory of its own once
/// (unshare(2) `CLONE_FS`: only its cwd, root and umask stop being shared
/// with the agent's other threads), changes to `dir`, spawns (the child
/// starts where its parent thread is) and goes back. Commands that drop
/// to another user, or keep fds open (`pre_exec`), still fork, in `dir`
/// all the same.
///
/// Errors: chdir(2)'s for `dir` (`NotFound`, `NotADirectory`, ...; see
/// [`start_error`]), then the spawn's.
pub fn spawn(p: &mut Process, dir: &str) -> std::io::Result<std::process::Child> {
    thread_local! {
        /// Whether this thread has its own working directory (unshare(2)).
        static OWN_CWD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if !OWN_CWD.get() {
        // SAFETY: unshare(2) with CLONE_FS only: the calling thread gets a
        // copy of its filesystem attributes; no memory is involved.
        if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
            // Not allowed here (a seccomp filter, say): the fork path.
            return p.current_dir(dir).spawn();
        }
        OWN_CWD.set(true);
    }
    let Ok(back) = std::fs::File::open(".") else {
        // No way back from `dir` (the thread's directory went away?).
        return p.current_dir(dir).spawn();
    };
    std::env::set_current_dir(dir)?;
    let spawned = p.spawn();
    // SAFETY: fchdir(2) on an fd this function opened and still owns.
    if unsafe { libc::fchdir(std::os::fd::AsRawFd::as_raw_fd(&back)) } != 0 {
        eprintln!("tine-agent: cannot go back to the thread's directory: {}", std::io::Error::last_os_error());
    }
    spawned
}

/// Makes `p` drop to `id` in the child before exec: fds 0-2 and `shared`
/// given to the user where they are pipes or sockets (fchown(2)), then
/// supplementary groups, the gid and the uid (the order setuid(2)
/// requires: after it the process may no longer change groups).
fn run_as(p: &mut Process, id: &Identity, shared: &[RawFd]) {
    let (uid, gid, groups) = (id.uid, id.gid, id.groups.clone());
    let mut fds = vec![0, 1, 2];
    fds.extend_from_slice(shared);
    // SAFETY: the closure runs in the forked child before exec; it only
    // makes the fstat(2), fchown(2), setgroups(2), setgid(2) and setuid(2)
    // system calls, which are async-signal-safe, on data moved into it
    // before the fork (`st` is on the stack); it allocates nothing.
    unsafe {
        p.pre_exec(move || {
            for &fd in &fds {
                let mut st: libc::stat = std::mem::zeroed();
                if libc::fstat(fd, &mut st) == 0
                    && matches!(st.st_mode & libc::S_IFMT, libc::S_IFIFO | libc::S_IFSOCK)
                    && libc::fchown(fd, uid, gid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0 || libc::setgid(gid) != 0 || libc::setuid(uid) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The error of a command that could not start: `NotADirectory` when its
/// directory is missing, `NotFound`/`PermissionDenied` naming the program,
/// `InvalidRequest` for an argument with a NUL, `Io` otherwise.
pub fn start_error(e: std::io::Error, program: &str, cwd: &str) -> AgentError {
    match e.kind() {
        std::io::ErrorKind::NotFound if !Path::new(cwd).is_dir() => AgentError::NotADirectory { path: cwd.into() },
        std::io::ErrorKind::NotFound => AgentError::NotFound { path: program.into() },
        std::io::ErrorKind::PermissionDenied => AgentError::PermissionDenied { path: program.into() },
        std::io::ErrorKind::InvalidInput => invalid(format!("cannot start {program}: {e}")),
        _ => AgentError::Io { message: format!("cannot start {program}: {e}") },
    }
}

/// Makes `fd` (a pipe to or from a child) non-blocking: fcntl(2)
/// F_SETFL with `O_NONBLOCK` added to its flags.
///
/// Errors: fcntl's.
pub fn set_nonblocking(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: fcntl(2) F_GETFL/F_SETFL on an fd the caller owns; they take
    // and return plain ints.
    let ok = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) >= 0
    };
    if ok {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A process's end: its exit code, or the signal that ended it.
pub fn exit_status(s: std::process::ExitStatus) -> ExitStatus {
    match (s.code(), s.signal()) {
        (Some(c), _) => ExitStatus::Code(c),
        (None, Some(sig)) => ExitStatus::Signal(sig),
        (None, None) => ExitStatus::Code(-1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `p` started by [`spawn`] in `dir`, its stdout and stderr captured.
    fn output(p: &mut Process, dir: &str) -> std::process::Output {
        p.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        spawn(p, dir).unwrap().wait_with_output().unwrap()
    }

    /// A spawn in a directory starts the child there and leaves the
    /// spawning thread, and the process's other threads, where they were;
    /// a missing directory is `NotADirectory`.
    #[test]
    fn a_spawn_in_a_directory_moves_no_other_thread() {
        let before = std::env::current_dir().unwrap();
        let pwd = ["pwd".to_string()];
        let (out, after) = std::thread::spawn(move || {
            let (mut p, dir) = command_under(&under(None, None), &pwd, Some("/tmp"), Home::Root, &[], &[]);
            (output(&mut p, &dir), std::env::current_dir().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "/tmp\n");
        assert_eq!((after, std::env::current_dir().unwrap()), (before.clone(), before));
        let (mut p, dir) =
            command_under(&under(None, None), &["pwd".into()], Some("/no/such/dir"), Home::Root, &[], &[]);
        let e = spawn(&mut p, &dir).unwrap_err();
        assert!(matches!(start_error(e, "pwd", &dir), AgentError::NotADirectory { .. }));
    }

    fn lines(s: &str) -> Vec<Vec<String>> {
        s.lines().map(|l| l.split(':').map(str::to_string).collect()).collect()
    }

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n";
    const GROUP: &str = "root:x:0:\napp:x:1000:\nextra:x:2000:other,app\nnone:x:3000:other\n";

    fn under(identity: Option<Identity>, working_dir: Option<&str>) -> Defaults {
        Defaults {
            generation: 1,
            given: ProcessDefaults { user: None, working_dir: working_dir.map(str::to_string) },
            identity,
        }
    }

    #[test]
    fn users_resolve_as_oci_says() {
        let (p, g) = (lines(PASSWD), lines(GROUP));
        let app = resolve("app", &p, &g).unwrap();
        assert_eq!((app.uid, app.gid, app.groups.clone()), (1000, 1000, vec![1000, 2000]));
        assert_eq!((app.name.as_deref(), app.home.as_deref()), (Some("app"), Some("/home/app")));
        // A uid in passwd is that user; one that is not runs with gid 0 and
        // no home, as runc runs it.
        assert_eq!(resolve("1000", &p, &g).unwrap(), app);
        let anon = resolve("4242", &p, &g).unwrap();
        assert_eq!((anon.uid, anon.gid, anon.groups, anon.name, anon.home), (4242, 0, vec![0], None, None));
        // user:group by name and by number.
        let ug = resolve("app:extra", &p, &g).unwrap();
        assert_eq!((ug.uid, ug.gid), (1000, 2000));
        assert_eq!(resolve("1000:3000", &p, &g).unwrap().gid, 3000);
        for (bad, says) in
            [("nobody", "not in the image's /etc/passwd"), ("app:staff", "not in the image's /etc/group")]
        {
            let e = resolve(bad, &p, &g).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    /// Refused defaults leave the current ones, and so do the same ones
    /// again (no other test changes them: the Node and Python tests'
    /// interpreters would restart).
    #[test]
    fn bad_defaults_change_nothing() {
        let before = generation();
        let empty = ProcessDefaults { user: Some(String::new()), working_dir: None };
        assert_eq!(set_defaults(empty).unwrap(), ProcessDefaults::default());
        assert_eq!(generation(), before, "root's defaults again");
        for d in [
            ProcessDefaults { user: Some("no-such-user-here".into()), working_dir: None },
            ProcessDefaults { user: None, working_dir: Some("relative/dir".into()) },
            ProcessDefaults { user: Some("x".repeat(MAX_USER_BYTES + 1)), working_dir: None },
        ] {
            assert!(matches!(set_defaults(d.clone()), Err(AgentError::InvalidRequest { .. })), "{d:?}");
        }
        assert_eq!(generation(), before);
    }

    /// A working directory is made if missing (given to the user) and is
    /// where commands without a `cwd` start; a request's `cwd` still wins;
    /// without one, `/`.
    #[test]
    fn the_working_directory_is_made_and_used() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("a/b");
        let work = work.to_str().unwrap();
        let owner = Identity { uid: 4242, gid: 4343, groups: vec![4343], name: None, home: None };
        make_working_dir(work, Some(&owner)).unwrap();
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(work).unwrap();
        // SAFETY: getuid(2) has no preconditions.
        if unsafe { libc::getuid() } == 0 {
            assert_eq!((m.uid(), m.gid()), (4242, 4343), "the made directory is the user's");
        }
        make_working_dir(work, None).unwrap();
        assert!(matches!(make_working_dir("rel", None), Err(AgentError::InvalidRequest { .. })));
        let pwd = |d: &Defaults, cwd: Option<&str>| {
            let (mut p, dir) = command_under(d, &["pwd".to_string()], cwd, Home::Root, &[], &[]);
            String::from_utf8(output(&mut p, &dir).stdout).unwrap()
        };
        assert_eq!(pwd(&under(None, Some(work)), None), format!("{work}\n"));
        assert_eq!(pwd(&under(None, Some(work)), Some("/tmp")), "/tmp\n");
        assert_eq!(pwd(&under(None, None), None), "/\n");
    }

    /// As root (the agent is), a command runs as the default user with its
    /// groups and login names, can open its own stdout by path (the pipe
    /// was given to it), and the sandbox environment still wins; a uid
    /// without a passwd entry has `HOME=/`.
    #[test]
    fn commands_run_as_the_user() {
        // SAFETY: getuid(2) has no preconditions.
        if unsafe { libc::getuid() } != 0 {
            eprintln!("skipped: changing user needs root, as the agent in a guest is");
            return;
        }
        let id = Identity {
            uid: 65534,
            gid: 65533,
            groups: vec![65533, 4242],
            name: Some("someone".into()),
            home: Some("/nonexistent-home".into()),
        };
        let script =
            "id -u; id -g; id -G; echo $USER $LOGNAME $HOME $EXTRA; pwd; echo by-path > /dev/stdout".to_string();
        let env = [("EXTRA".to_string(), "x".to_string()), ("LOGNAME".to_string(), "mine".to_string())];
        let argv = ["sh".to_string(), "-c".to_string(), script];
        let (mut p, dir) = command_under(&under(Some(id), None), &argv, None, Home::User, &env, &[]);
        let out = output(&mut p, &dir);
        assert_eq!(dir, "/", "a home that does not exist is not a working directory");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "65534\n65533\n65533 4242\nsomeone mine /nonexistent-home x\n/\nby-path\n",
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let anon = resolve("4242", &[], &[]).unwrap();
        let argv = ["sh".to_string(), "-c".to_string(), "id -u; id -g; echo $HOME".to_string()];
        let (mut p, dir) = command_under(&under(Some(anon), None), &argv, None, Home::Root, &[], &[]);
        assert_eq!(String::from_utf8_lossy(&output(&mut p, &dir).stdout), "4242\n0\n/\n");
    }
}
