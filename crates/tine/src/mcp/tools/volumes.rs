//! The volume family: `volume_create`, `volume_list`, `volume_delete`.
//! A volume is a disk that outlives the sandboxes that use it
//! ([`tine_sandbox::volumes`]); `sandbox_create { volumes }` attaches it.
//! It belongs to the caller's tenant.

use rmcp::handler::server::wrapper::Parameters;
use rmcp::{tool, tool_router, Json};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tine_sandbox::volumes::VolumeInfo;

use crate::mcp::bounds::{MAX_NAME_CHARS, NAME_PATTERN};
use crate::mcp::errors::ToolError;
use crate::mcp::TineMcp;

/// The schema's bound on `size_gib` (1 PiB); the server's own,
/// `limits.max_volume_gib`, is checked when the volume is made.
const MAX_VOLUME_GIB: u64 = 1 << 20;

/// `volume_create`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VolumeCreateParams {
    /// The volume's name: 1-63 lowercase letters, digits, '-' or '_'.
    #[schemars(length(min = 1, max = MAX_NAME_CHARS), pattern(NAME_PATTERN))]
    pub name: String,
    /// Its size in GiB (sparse: the host holds only what is written); the
    /// server's limit is in limits.max_volume_gib.
    #[schemars(range(min = 1, max = MAX_VOLUME_GIB))]
    pub size_gib: u64,
}

/// `volume_delete`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VolumeDeleteParams {
    /// The volume to delete, with its data.
    #[schemars(length(min = 1, max = MAX_NAME_CHARS), pattern(NAME_PATTERN))]
    pub name: String,
}

/// `volume_list`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct VolumeListResult {
    /// The caller's volumes, by name.
    pub volumes: Vec<VolumeInfo>,
}

/// `volume_delete`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct VolumeDeleteResult {
    /// The volume that is gone.
    pub name: String,
    /// Always true.
    pub deleted: bool,
}

#[tool_router(router = volumes_router, vis = "pub(super)")]
impl TineMcp {
    #[tool(
        description = "Create a volume: an empty disk (ext4) that outlives sandboxes. Attach it with \
                       sandbox_create { volumes: [{ name, path }] }: one sandbox may write it at a time (until it \
                       is killed), any number may read it (read_only: true).",
        annotations(
            title = "Create volume",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn volume_create(
        &self,
        Parameters(p): Parameters<VolumeCreateParams>,
    ) -> Result<Json<VolumeInfo>, ToolError> {
        let info = self.manager.volume_create(&self.cx(), &p.name, p.size_gib).await.map_err(ToolError::from)?;
        Ok(Json(info))
    }

    #[tool(
        description = "List your volumes: size, bytes used on the host, and which sandbox writes or reads each.",
        annotations(title = "List volumes", read_only_hint = true, open_world_hint = false)
    )]
    async fn volume_list(&self) -> Result<Json<VolumeListResult>, ToolError> {
        Ok(Json(VolumeListResult { volumes: self.manager.volume_list(&self.cx()) }))
    }

    #[tool(
        description = "Delete a volume and its data. Refused while a sandbox has it attached (a hibernated one \
                       too): kill those first.",
        annotations(
            title = "Delete volume",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn volume_delete(
        &self,
        Parameters(p): Parameters<VolumeDeleteParams>,
    ) -> Result<Json<VolumeDeleteResult>, ToolError> {
        self.manager.volume_delete(&self.cx(), &p.name).await.map_err(ToolError::from)?;
        Ok(Json(VolumeDeleteResult { name: p.name, deleted: true }))
    }
}
