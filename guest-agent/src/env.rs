//! The sandbox environment: variables set for the whole sandbox
//! (`Op::SetEnv`) that every exec, background process and the Python and
//! Node.js interpreters get, below a request's own `env`.
//!
//! It lives in the agent's memory, so a snapshot, a template and a branch
//! child carry it like the rest of the guest. Each change bumps a
//! generation; an interpreter compares it with the one it last applied
//! (see [`crate::interp`]).
//!
//! Below it lies the environment of a root login shell on Debian
//! ([`LOGIN_ENV`]), which PID 1 sets for itself at start
//! ([`set_login_defaults`]) so that the agent and everything it starts
//! inherit it. Two layers are the server's own: the trust variables
//! (`Op::InstallTrust`, [`set_trust`]: where the CA bundle is) and the
//! host environment (`Op::SetHostEnv`, [`set_host`]: its secrets'
//! placeholders). A command's environment is the login defaults, the
//! trust variables, the sandbox environment, the host environment, then
//! the call's own `env`, each above the one before.

use std::sync::Mutex;

use tine_protocol::{check_sandbox_env, AgentError};

/// The environment of a root login on Debian 12 and 13 (`/etc/login.defs`'s
/// `ENV_SUPATH`, `/etc/passwd`'s home and shell), with `LANG` for UTF-8
/// text, `TERM=dumb` (output goes to a pipe, not a terminal) and
/// `NODE_PATH` for packages `npm install -g` puts in
/// `/usr/local/lib/node_modules` (Debian's Node.js does not look there by
/// itself).
pub const LOGIN_ENV: [(&str, &str); 8] = [
    ("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
    ("HOME", "/root"),
    ("USER", "root"),
    ("LOGNAME", "root"),
    ("SHELL", "/bin/bash"),
    ("LANG", "C.UTF-8"),
    ("TERM", "dumb"),
    ("NODE_PATH", "/usr/local/lib/node_modules"),
];

/// Sets [`LOGIN_ENV`] in this process's environment, replacing what the
/// kernel gave init (`HOME=/`, `TERM=linux`; kept: the rest, such as
/// `GLIBC_TUNABLES` of the host profile). For PID 1 at start only, while it
/// is the only thread (`setenv(3)` is not thread-safe): the agent forked
/// from it and every process it starts inherit the result.
pub fn set_login_defaults() {
    for (name, value) in LOGIN_ENV {
        std::env::set_var(name, value);
    }
}

/// The login default of variable `name`, if it has one: what a name the
/// sandbox environment no longer sets goes back to.
pub fn login_default(name: &str) -> Option<&'static str> {
    LOGIN_ENV.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
}

/// The layers and their generation (0: never set).
struct SandboxEnv {
    generation: u64,
    /// `Op::InstallTrust`'s variables.
    trust: Vec<(String, String)>,
    /// `Op::SetEnv`'s.
    vars: Vec<(String, String)>,
    /// `Op::SetHostEnv`'s.
    host: Vec<(String, String)>,
}

static ENV: Mutex<SandboxEnv> =
    Mutex::new(SandboxEnv { generation: 0, trust: Vec::new(), vars: Vec::new(), host: Vec::new() });

/// Replaces one layer with `vars` (checked as [`check_sandbox_env`]).
fn set_layer(
    vars: Vec<(String, String)>,
    layer: fn(&mut SandboxEnv) -> &mut Vec<(String, String)>,
) -> Result<(), AgentError> {
    check_sandbox_env(&vars)?;
    let mut env = ENV.lock().unwrap_or_else(|p| p.into_inner());
    env.generation += 1;
    *layer(&mut env) = vars;
    Ok(())
}

/// Replaces the sandbox environment.
///
/// Errors: `InvalidRequest` as [`check_sandbox_env`]; the old environment
/// then stays.
pub fn set(vars: Vec<(String, String)>) -> Result<(), AgentError> {
    set_layer(vars, |e| &mut e.vars)
}

/// Replaces the host environment (`Op::SetHostEnv`).
///
/// Errors: as [`set`].
pub fn set_host(vars: Vec<(String, String)>) -> Result<(), AgentError> {
    set_layer(vars, |e| &mut e.host)
}

/// Replaces the trust variables ([`crate::trust`]).
///
/// Errors: as [`set`].
pub fn set_trust(vars: Vec<(String, String)>) -> Result<(), AgentError> {
    set_layer(vars, |e| &mut e.trust)
}

/// The current variables, the layers merged (a later layer's name
/// replaces an earlier one's, in the earlier's place), and their
/// generation.
pub fn current() -> (u64, Vec<(String, String)>) {
    let env = ENV.lock().unwrap_or_else(|p| p.into_inner());
    let mut merged: Vec<(String, String)> = Vec::with_capacity(env.trust.len() + env.vars.len() + env.host.len());
    for (name, value) in env.trust.iter().chain(&env.vars).chain(&env.host) {
        match merged.iter_mut().find(|(n, _)| n == name) {
            Some(slot) => slot.1 = value.clone(),
            None => merged.push((name.clone(), value.clone())),
        }
    }
    (env.generation, merged)
}

#[cfg(test)]
mod tests {
    use tine_protocol::{Cell, Command, Exec, WaitOutcome};

    use super::*;

    /// The environment is one per process: its tests take this.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn exec_stdout(script: &str, env: &[(&str, &str)]) -> String {
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let exec = Exec {
            command: Command::Shell(script.into()),
            cwd: None,
            env,
            stdin: vec![],
            timeout_ms: 20_000,
            output_limit: 0,
        };
        String::from_utf8(crate::exec::run(exec, None, None).expect("exec runs").stdout.data).unwrap()
    }

    #[test]
    fn set_replaces_and_bad_input_keeps_the_old() {
        let _s = serial();
        set(vec![("A".into(), "1".into()), ("B".into(), "2".into())]).unwrap();
        let (g, vars) = current();
        assert_eq!(vars, [("A".into(), "1".into()), ("B".into(), "2".into())]);
        assert!(matches!(set(vec![("A=B".into(), "x".into())]), Err(AgentError::InvalidRequest { .. })));
        assert_eq!(current(), (g, vars), "a refused set changes nothing");
        set(vec![]).unwrap();
        assert_eq!(current(), (g + 1, vec![]));
    }

    #[test]
    fn the_layers_stack_trust_then_sandbox_then_host() {
        let _s = serial();
        let kv = |k: &str, v: &str| (k.to_string(), v.to_string());
        set_trust(vec![kv("SSL_CERT_FILE", "/run/tine/ca"), kv("A", "trust")]).unwrap();
        set(vec![kv("A", "sandbox"), kv("KEY", "user's")]).unwrap();
        set_host(vec![kv("KEY", "placeholder")]).unwrap();
        let (g, vars) = current();
        assert_eq!(vars, [kv("SSL_CERT_FILE", "/run/tine/ca"), kv("A", "sandbox"), kv("KEY", "placeholder")]);
        // The client's own SetEnv leaves the host's layer as it is.
        set(vec![]).unwrap();
        assert_eq!(
            current(),
            (g + 1, vec![kv("SSL_CERT_FILE", "/run/tine/ca"), kv("A", "trust"), kv("KEY", "placeholder")])
        );
        set_host(vec![]).unwrap();
        set_trust(vec![]).unwrap();
        assert_eq!(current().1, vec![]);
    }

    /// Exec, a background process and the Python interpreter see the
    /// sandbox environment under a request's own `env`, and follow a
    /// change (a name dropped is gone from `os.environ` too). Needs python3
    /// on the host for the last part (skipped loudly without it).
    #[test]
    fn exec_processes_and_python_follow_the_environment() {
        let _s = serial();
        let _p = crate::procs::tests::serial();
        set(vec![("TINE_T_A".into(), "from-sandbox".into()), ("TINE_T_B".into(), "b".into())]).unwrap();
        assert_eq!(exec_stdout("echo $TINE_T_A-$TINE_T_B", &[]), "from-sandbox-b\n");
        assert_eq!(exec_stdout("echo $TINE_T_A", &[("TINE_T_A", "from-call")]), "from-call\n", "the call's env wins");
        let (id, _k) = crate::procs::tests::start("echo bg:$TINE_T_A");
        let w = crate::procs::tests::wait_for(id, None, (0, 0), 20_000);
        assert_eq!((w.outcome, w.stdout_tail.as_slice()), (WaitOutcome::Exited, b"bg:from-sandbox\n".as_slice()));
        let python = std::process::Command::new("python3").arg("-c").arg("pass").status().is_ok();
        let cell = |code: &str| {
            let r = crate::python::run(Cell { code: code.into(), timeout_ms: 20_000, output_limit: 0 }).unwrap();
            r.value.unwrap_or_default()
        };
        if python {
            assert_eq!(
                cell("import os\n(os.environ.get('TINE_T_A'), os.environ.get('TINE_T_B'))"),
                "('from-sandbox', 'b')"
            );
        }
        set(vec![("TINE_T_A".into(), "changed".into())]).unwrap();
        assert_eq!(exec_stdout("echo $TINE_T_A-${TINE_T_B:-unset}", &[]), "changed-unset\n");
        if python {
            let seen = "(os.environ.get('TINE_T_A'), os.environ.get('TINE_T_B'), os.popen('echo $TINE_T_A').read())";
            assert_eq!(cell(seen), "('changed', None, 'changed\\n')");
        } else {
            eprintln!("SKIPPED (python part): python3 is not installed on this host");
        }
        set(vec![]).unwrap();
    }

    /// The Node.js interpreter's `process.env`, and the processes it
    /// starts, follow the sandbox environment. Skipped loudly without node.
    #[test]
    fn node_follows_the_environment() {
        let _s = serial();
        let _n = crate::node::tests::serial();
        if !crate::node::tests::have_node() {
            return;
        }
        let cell = |code: &str| {
            let r = crate::node::run(Cell { code: code.into(), timeout_ms: 20_000, output_limit: 0 }).unwrap();
            assert!(r.exception.is_none(), "{r:?}");
            (r.value.unwrap_or_default(), String::from_utf8_lossy(&r.stdout.data).to_string())
        };
        set(vec![("TINE_T_A".into(), "from-sandbox".into()), ("TINE_T_B".into(), "b".into())]).unwrap();
        assert_eq!(cell("[process.env.TINE_T_A, process.env.TINE_T_B]").0, "[ 'from-sandbox', 'b' ]");
        set(vec![("TINE_T_A".into(), "changed".into())]).unwrap();
        let seen = "require('child_process').execSync('echo $TINE_T_A', {stdio: 'inherit'}); \
                    [process.env.TINE_T_A, 'TINE_T_B' in process.env]";
        assert_eq!(cell(seen), ("[ 'changed', false ]".into(), "changed\n".into()));
        set(vec![]).unwrap();
        assert_eq!(cell("'TINE_T_A' in process.env").0, "false");
    }
}
