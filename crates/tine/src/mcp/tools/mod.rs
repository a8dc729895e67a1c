//! The tools, by family: one file each, each an `impl TineMcp` block with
//! its own `#[tool_router]` (`<family>_router`), its tools' parameter and
//! result types beside them. [`router`] puts the families together; the
//! handler that runs them, and what every tool uses (the caller, the
//! session's sandbox, the owner check), are in [`crate::mcp`].
//!
//! - [`sandboxes`]: `sandbox_create`, `_list`, `_info`, `_update`, `_kill`,
//!   `_pause`, `_resume`, `_snapshot`, `_branch`, `_diff`, `_merge_into`.
//! - [`templates`]: `template_list`, `template_create`, `template_delete`.
//! - [`code`]: `sandbox_exec`, `sandbox_run_python`, `sandbox_run_code`.
//! - [`files`]: `sandbox_files_read`, `_write`, `_list`, `_url`,
//!   `sandbox_upload`, `sandbox_download`, `sandbox_download_dir`.
//! - [`processes`]: `sandbox_process_list`, `_output`, `_wait`, `_write`,
//!   `_kill` (the background processes `sandbox_exec` starts).
//! - [`network`]: `sandbox_network_log`, and the network policy
//!   `sandbox_create` and `sandbox_update` take.
//! - [`volumes`]: `volume_create`, `volume_list`, `volume_delete`.
//! - [`preview`]: `sandbox_preview_url`, `sandbox_preview_revoke`.
//! - [`secrets`]: `secret_list` (binding is `sandbox_create`'s and
//!   `sandbox_update`'s `secrets`).
//!
//! `tools/list` is sorted by name whatever the order here (rmcp's
//! `ToolRouter::list_all`).

mod code;
mod common;
mod files;
mod network;
mod preview;
mod processes;
mod sandboxes;
mod secrets;
mod templates;
mod volumes;

use rmcp::handler::server::router::tool::ToolRouter;

use super::TineMcp;

/// Every tool, as its family declares it (schemas as schemars makes them;
/// [`crate::mcp`] standardizes them once).
pub(super) fn router() -> ToolRouter<TineMcp> {
    TineMcp::sandboxes_router()
        + TineMcp::templates_router()
        + TineMcp::code_router()
        + TineMcp::files_router()
        + TineMcp::processes_router()
        + TineMcp::network_router()
        + TineMcp::volumes_router()
        + TineMcp::preview_router()
        + TineMcp::secrets_router()
}
