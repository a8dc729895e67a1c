//! The messages an agent sees when a tool call fails: [`ToolError`], and
//! the "what to do next" hint the MCP layer adds to each domain error
//! ([`SandboxError`], [`TemplateError`]). The domain says what happened;
//! only this file names MCP tools.

use rmcp::model::{ContentBlock, IntoContents};
use tine_sandbox::{SandboxError, SandboxState, TemplateError};

/// Why a tool call failed; becomes the text of a tool result with
/// `isError: true`.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// The sandbox manager refused or failed; shown with a hint.
    #[error("{}", with_hint(.0))]
    Sandbox(#[from] SandboxError),
    /// `timeout_secs` is out of range.
    #[error("timeout_secs must be 1..={max}, got {got}")]
    Timeout {
        /// Asked for (s).
        got: u32,
        /// The limit (s).
        max: u32,
    },
    /// `sandbox_exec` with both or neither of `command` and `argv`, or an
    /// empty or too long `argv`.
    #[error("{0}")]
    ExecCommand(&'static str),
    /// `sandbox_kill` without an id, and the session has no sandbox.
    #[error("this session has no sandbox of its own to kill")]
    NoOwnSandbox,
    /// `sandbox_files_read` on a file that is not UTF-8.
    #[error("{path} is not UTF-8 text (invalid byte at offset {offset}); use sandbox_download for binary files")]
    NotUtf8 {
        /// The file.
        path: String,
        /// The first invalid byte's offset in the file.
        offset: u64,
    },
    /// `sandbox_upload`'s `data_base64` does not decode.
    #[error("data_base64 is not valid base64: {0}")]
    Base64(#[from] base64::DecodeError),
    /// A file URL cannot be made.
    #[error("{0}")]
    Url(#[from] crate::files_url::UrlError),
    /// A preview URL cannot be made or revoked.
    #[error("{0}")]
    Preview(#[from] crate::preview::PreviewError),
    /// `sandbox_create { count }` cannot be made as asked.
    #[error("{0}")]
    Spawn(String),
    /// `sandbox_create { ports }` cannot publish a port.
    #[error("{0}")]
    Ports(#[from] crate::published_ports::PublishError),
    /// A GET URL for something that is not a regular file.
    #[error("{path} is not a regular file; sandbox_download_dir packs a directory")]
    NotAFile {
        /// The path.
        path: String,
    },
    /// `sandbox_download_dir` of something that is not a directory.
    #[error("{path} is not a directory; use sandbox_files_url or sandbox_download for a file")]
    NotADir {
        /// The path.
        path: String,
    },
    /// `tar` failed in the guest.
    #[error("tar failed in the sandbox: {stderr}")]
    Tar {
        /// Its stderr (cut).
        stderr: String,
    },
    /// `sandbox_upload`'s data or `sandbox_files_write`'s content is larger
    /// than one call may write.
    #[error("{bytes} bytes exceed the 8 MiB one call may write; sandbox_files_url moves a file of any size")]
    WriteTooLargeForOneCall {
        /// The decoded size (bytes).
        bytes: usize,
    },
    /// `sandbox_exec { background: true }` with `timeout_secs`.
    #[error(
        "timeout_secs does not apply to background: true (a background process runs until it ends or is \
         killed); wait for it with sandbox_process_wait {{ timeout_secs }}, stop it with sandbox_process_kill"
    )]
    BackgroundTimeout,
    /// A background process's first stdin is too large.
    #[error(
        "stdin of a background process is at most {max} bytes, got {bytes}; send the rest with sandbox_process_write"
    )]
    SpawnStdinTooLarge {
        /// Given (bytes).
        bytes: usize,
        /// The limit (bytes).
        max: usize,
    },
    /// `sandbox_process_write` data too large.
    #[error("data is at most {max} bytes per call, got {bytes}; split it over several sandbox_process_write calls")]
    WriteTooLarge {
        /// Given (bytes).
        bytes: usize,
        /// The limit (bytes).
        max: usize,
    },
    /// `sandbox_process_wait` with both `until_text` and `until_regex`.
    #[error("give until_text or until_regex, not both")]
    TwoPatterns,
    /// A wait pattern over the limit.
    #[error("until_text and until_regex are at most {max} bytes, got {bytes}")]
    PatternTooLong {
        /// Given (bytes).
        bytes: usize,
        /// The limit (bytes).
        max: usize,
    },
    /// A `network` policy wider than the caller's ceiling.
    #[error(
        "this network policy allows more than the operator's ceiling for your key: {why}; ask within it \
         (sandbox_info shows it as network_ceiling)"
    )]
    AboveCeiling {
        /// What exceeds it.
        why: String,
    },
    /// `sandbox_process_kill`'s signal is not one it knows.
    #[error("unknown signal {0:?}; use TERM, KILL, INT, HUP, QUIT, USR1, USR2, STOP, CONT or a number 1..=64")]
    Signal(String),
}

impl IntoContents for ToolError {
    fn into_contents(self) -> Vec<ContentBlock> {
        vec![ContentBlock::text(self.to_string())]
    }
}

/// A domain error's message followed by the MCP hint for it, if any.
///
/// A message that already ends in the same hint (a domain error from
/// before the hints moved here) is not repeated.
pub fn with_hint(e: &SandboxError) -> String {
    let message = e.to_string();
    match sandbox_hint(e) {
        Some(hint) if !message.ends_with(&hint) => message + &hint,
        _ => message,
    }
}

/// What an agent can do about `e`, as a suffix to its message (starting
/// with its own separator), or `None` if there is nothing to add.
pub fn sandbox_hint(e: &SandboxError) -> Option<String> {
    let hint = match e {
        SandboxError::NotFound(_) => "; call sandbox_list to see the live ones, or sandbox_create for a new one",
        SandboxError::TooMany { .. } => {
            "; hibernate one you are not using (sandbox_pause with to_disk: true) or kill one (sandbox_kill) first"
        }
        SandboxError::TooManyKept { .. } => {
            "; kill sandboxes you no longer need (sandbox_kill; sandbox_list shows them)"
        }
        SandboxError::TemplateDisk { .. } => {
            "; leave out disk_mib, or leave out template to boot a sandbox of that disk"
        }
        SandboxError::DiskBudget { .. } => {
            "; kill sandboxes you no longer need (sandbox_kill; hibernated ones hold their disks too), or ask the \
             operator for a larger [limits] disk_budget_mib"
        }
        SandboxError::Starting(_) => "; try again in a few seconds",
        SandboxError::BadState { state: SandboxState::Paused, .. } => {
            "; call sandbox_resume, or just sandbox_exec, which resumes it"
        }
        SandboxError::NotRunning { .. } => ". Kill it and create a new one",
        SandboxError::Hibernate { .. } => {
            "; it keeps running: pause it in memory (sandbox_pause without to_disk), or ask the operator to free \
             disk space in the server's data directory"
        }
        SandboxError::Wake { .. } => {
            "; its saved state is kept for the operator; kill it (sandbox_kill) and create a new one"
        }
        SandboxError::TemplateShape { .. } => {
            "; leave out vcpus and memory_mib, or make a template of the shape you need"
        }
        SandboxError::NotDescendant { .. } => {
            "; merge a sandbox into the one it was branched from, or an ancestor of it"
        }
        SandboxError::Gone { .. } => "; call sandbox_list to see the live ones",
        SandboxError::Network(_) => {
            "; each allow/deny entry is a domain (example.com), a wildcard (*.example.com), an IP address or a CIDR \
             (203.0.113.0/24)"
        }
        SandboxError::OverBudget(_) => {
            "; kill sandboxes you no longer need (sandbox_kill) or hibernate them (sandbox_pause with to_disk: true), \
             ask for less memory_mib, or try again later"
        }
        SandboxError::HostMemoryLow { .. } => {
            "; hibernate sandboxes you are not using (sandbox_pause with to_disk: true) or kill them (sandbox_kill), \
             or try again later"
        }
        SandboxError::BadProcessId(_) | SandboxError::NoSuchProcess { .. } => {
            "; process ids look like sb-3:p7, see sandbox_process_list"
        }
        SandboxError::TooManyProcesses { .. } => "; kill one with sandbox_process_kill",
        SandboxError::Template(t) => return template_hint(t),
        _ => return None,
    };
    Some(hint.to_string())
}

/// What an agent can do about a template error, as [`sandbox_hint`].
pub fn template_hint(e: &TemplateError) -> Option<String> {
    Some(match e {
        TemplateError::NotFound(_) => "; call template_list to see them, or sandbox_snapshot to make one".into(),
        TemplateError::Exists(_) => "; choose another name".into(),
        TemplateError::Stale { .. } => {
            "; make it again (sandbox_snapshot, or `tine template build` for the default)".into()
        }
        TemplateError::Meta { .. } => "; delete that directory and make it again".into(),
        TemplateError::Reserved(_) => {
            "; choose a name that is not \"default\" and does not start with \"tine-\"".into()
        }
        TemplateError::OverBudget(_) => "; kill sandboxes you no longer need (sandbox_kill), or try again later".into(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use tine_sandbox::LimitsError;

    use super::*;

    /// Each domain error as an agent reads it: what happened, then what to do.
    fn cases() -> Vec<(SandboxError, &'static str)> {
        let template = |e| SandboxError::Template(e);
        vec![
            (
                SandboxError::NotFound("sb-9".into()),
                "no sandbox sb-9; call sandbox_list to see the live ones, or sandbox_create for a new one",
            ),
            (
                SandboxError::TooMany { live: 4, max: 4 },
                "4 sandboxes are running and none is idle enough to hibernate, the limit is 4; hibernate one you are \
                 not using (sandbox_pause with to_disk: true) or kill one (sandbox_kill) first",
            ),
            (
                SandboxError::TooManyKept { kept: 1000, max: 1000 },
                "1000 sandboxes are kept (running, hibernated or failed), the limit is 1000; kill sandboxes you no \
                 longer need (sandbox_kill; sandbox_list shows them)",
            ),
            (SandboxError::Starting("sb-2".into()), "sandbox sb-2 is still starting; try again in a few seconds"),
            (
                SandboxError::NotRunning {
                    id: "sb-3".into(),
                    state: SandboxState::Failed,
                    reason: "kernel panic".into(),
                },
                "sandbox sb-3 is Failed and cannot run anything: kernel panic. Kill it and create a new one",
            ),
            (
                SandboxError::TemplateShape { name: "py".into(), vcpus: 2, memory_mib: 1024 },
                "template \"py\" makes sandboxes of 2 vCPUs and 1024 MiB; leave out vcpus and memory_mib, or make a \
                 template of the shape you need",
            ),
            (
                SandboxError::NotDescendant { winner: "sb-5".into(), parent: "sb-1".into(), lineage: "sb-4".into() },
                "sandbox sb-5 was not branched from sb-1 (its lineage: sb-4); merge a sandbox into the one it was \
                 branched from, or an ancestor of it",
            ),
            (
                template(TemplateError::NotFound("py".into())),
                "no template \"py\"; call template_list to see them, or sandbox_snapshot to make one",
            ),
            (
                template(TemplateError::Exists("py".into())),
                "a template named \"py\" exists already; choose another name",
            ),
            (
                template(TemplateError::Stale { name: "py".into(), what: "guest kernel" }),
                "template \"py\" was made from another guest kernel than the server uses now; make it again \
                 (sandbox_snapshot, or `tine template build` for the default)",
            ),
            (
                template(TemplateError::Meta {
                    name: "py".into(),
                    dir: PathBuf::from("/data/templates/py"),
                    reason: "missing template.json".into(),
                }),
                "template \"py\" is damaged (/data/templates/py): missing template.json; delete that directory and make it \
                 again",
            ),
            (
                template(TemplateError::Reserved("default".into())),
                "template name \"default\" is reserved for the server (\"default\" and names starting with \"tine-\"); \
                 choose a name that is not \"default\" and does not start with \"tine-\"",
            ),
            (
                SandboxError::OverBudget(tine_sandbox::OverBudget {
                    budget_mib: 1024,
                    used: tine_sandbox::BudgetUse { sandboxes: (2, 1024), ..Default::default() },
                    what: "create",
                    needed_mib: 512,
                }),
                "memory budget 1024 MiB: 2 sandboxes use 1024 MiB, 0 templates 0 MiB, 0 branch points 0 MiB; this \
                 create needs 512 MiB; kill sandboxes you no longer need (sandbox_kill) or hibernate them \
                 (sandbox_pause with to_disk: true), ask for less memory_mib, or try again later",
            ),
            (
                SandboxError::HostMemoryLow { available_mib: 500, floor_mib: 614, what: "create" },
                "the host has 500 MiB of memory available, below the server's floor of 614 MiB (half its watermark), \
                 and no sandbox is idle enough to hibernate: this create was refused; hibernate sandboxes you are not \
                 using (sandbox_pause with to_disk: true) or kill them (sandbox_kill), or try again later",
            ),
            (
                SandboxError::Gone { id: "sb-2".into(), reason: "merged into sb-1".into() },
                "sandbox sb-2 no longer exists: merged into sb-1; call sandbox_list to see the live ones",
            ),
            // Nothing to add: the message says it all.
            (SandboxError::Limits(LimitsError::Vcpus { got: 99, max: 8 }), "vcpus must be 1..=8, got 99"),
            (SandboxError::ShuttingDown, "the server is shutting down"),
        ]
    }

    #[test]
    fn each_domain_error_gets_its_hint_once() {
        for (e, want) in cases() {
            assert_eq!(with_hint(&e), want, "{e:?}");
            assert_eq!(ToolError::from(e).to_string(), want);
        }
    }

    #[test]
    fn hints_say_what_to_do_not_what_happened() {
        for (e, want) in cases() {
            if let Some(hint) = sandbox_hint(&e) {
                assert!(want.ends_with(&hint), "{e:?}: {hint:?}");
                assert!(hint.starts_with("; ") || hint.starts_with(". "), "{hint:?} continues the message");
            }
        }
        let paused = SandboxError::BadState { id: "sb-1".into(), state: SandboxState::Paused, what: "x" };
        assert!(with_hint(&paused).ends_with("; call sandbox_resume, or just sandbox_exec, which resumes it"));
        let stopped = SandboxError::BadState { id: "sb-1".into(), state: SandboxState::Stopped, what: "pause" };
        assert_eq!(sandbox_hint(&stopped), None);
    }

    /// Process errors (their messages are the manager's) end in a hint
    /// naming the process tools.
    fn process_errors() -> Vec<(SandboxError, &'static str)> {
        let ids = "; process ids look like sb-3:p7, see sandbox_process_list";
        vec![
            (SandboxError::BadProcessId("p7".into()), ids),
            (SandboxError::NoSuchProcess { process_id: "sb-3:p9".into() }, ids),
            (SandboxError::TooManyProcesses { id: "sb-3".into(), max: 32 }, "; kill one with sandbox_process_kill"),
        ]
    }

    #[test]
    fn process_errors_say_where_ids_come_from() {
        for (e, hint) in process_errors() {
            let text = with_hint(&e);
            assert!(text.ends_with(hint) && text.len() > hint.len(), "{text}");
            assert_eq!(text.matches(hint).count(), 1, "{text}");
        }
    }

    #[test]
    fn hints_name_only_tools_that_exist() {
        let tools: Vec<String> = super::super::router().list_all().into_iter().map(|t| t.name.into()).collect();
        let paused = SandboxError::BadState { id: "sb-1".into(), state: SandboxState::Paused, what: "x" };
        let process = process_errors();
        let hints = cases()
            .iter()
            .map(|(e, _)| e)
            .chain([&paused])
            .chain(process.iter().map(|(e, _)| e))
            .filter_map(sandbox_hint)
            .collect::<Vec<_>>();
        for hint in &hints {
            for word in hint.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("sandbox_") || word.starts_with("template_") {
                    assert!(tools.iter().any(|t| t == word), "{hint:?} names {word}, which is no tool");
                }
            }
        }
    }

    #[test]
    fn tool_errors_are_text_content() {
        let contents = ToolError::NoOwnSandbox.into_contents();
        assert_eq!(contents.len(), 1);
        assert_eq!(
            contents[0].as_text().map(|t| t.text.as_str()),
            Some("this session has no sandbox of its own to kill")
        );
    }
}
