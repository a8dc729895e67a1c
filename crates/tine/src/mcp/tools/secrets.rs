//! The secret family: `secret_list` (what secrets the caller may bind,
//! metadata only). Secrets are set on the host (`tine secret set`), never
//! over MCP; `sandbox_create { secrets }` and `sandbox_update { secrets }`
//! bind them ([`crate::secrets`]).

use rmcp::{tool, tool_router, Json};
use schemars::JsonSchema;
use serde::Serialize;

use crate::mcp::errors::ToolError;
use crate::mcp::TineMcp;
use crate::secrets::SecretInfo;

/// `secret_list`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct SecretListResult {
    /// The secrets the caller may bind: name, owner, hosts (never values).
    pub secrets: Vec<SecretInfo>,
}

#[tool_router(router = secrets_router, vis = "pub(crate)")]
impl TineMcp {
    #[tool(
        description = "List the secrets you may give a sandbox (name, owner, hosts; never values). Bind one with \
                       sandbox_create or sandbox_update { secrets: { ENV_NAME: \"name\" } }: ENV_NAME then holds a \
                       placeholder that the server replaces with the value only in HTTPS requests to the \
                       secret's hosts.",
        annotations(title = "List secrets", read_only_hint = true, open_world_hint = false)
    )]
    async fn secret_list(&self) -> Result<Json<SecretListResult>, ToolError> {
        let caller = self.caller();
        let secrets = self.secrets.as_ref().map(|s| s.visible(caller.tenant())).unwrap_or_default();
        Ok(Json(SecretListResult { secrets }))
    }
}
