//! The template family: `template_list`, `template_create` (a template
//! built from a recipe, in the background) and `template_delete`. A
//! tenant's templates are stored as `<tenant>~<name>` and shown under
//! their plain names ([`TineMcp`]'s `own_template`, `resolve_template`,
//! `shown_template`); `sandbox_snapshot`, which makes a template of a
//! running sandbox, is in the sandbox family.

use std::collections::BTreeMap;
use std::time::Duration;

use rmcp::handler::server::wrapper::Parameters;
use rmcp::service::RequestContext;
use rmcp::{tool, tool_router, Json, RoleServer};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tine_sandbox::{Recipe, SetupStep, TemplateInfo};

use super::common::env_map;
use crate::mcp::bounds::{
    string_map, DEFAULT_MAX_MEMORY_MIB, DEFAULT_MAX_VCPUS, MAX_COMMAND_CHARS, MAX_NAME_CHARS, MAX_PATH_CHARS,
    MAX_TEXT_CHARS, MAX_TIMEOUT_SECS, MIN_MEMORY_MIB, NAME_PATTERN,
};
use crate::mcp::errors::ToolError;
use crate::mcp::progress::Reporter;
use crate::mcp::{budget, TineMcp};

/// Longest `template_create { wait_secs }` waits (s): 10 minutes.
pub const MAX_TEMPLATE_WAIT_SECS: u64 = 600;

/// Schema of a recipe's files, path -> content (the contents' total is
/// checked in bytes by the manager).
fn files_map(schema: &mut schemars::Schema) {
    string_map::<{ tine_sandbox::MAX_FILES as u64 }, MAX_PATH_CHARS, MAX_TEXT_CHARS>(schema);
}

/// `template_create`: a recipe (see README "Templates from a recipe").
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TemplateCreateParams {
    /// The new template's name: 1-63 lowercase letters, digits, '-' or '_'
    /// (not "default" nor "tine-*"); an existing one is replaced when the
    /// build succeeds.
    #[schemars(length(min = 1, max = MAX_NAME_CHARS), pattern(NAME_PATTERN))]
    pub name: String,
    /// The template to start from (default: "default").
    #[schemars(length(min = 1, max = MAX_NAME_CHARS), pattern(NAME_PATTERN))]
    pub from: Option<String>,
    /// Or an OCI image to boot instead of a template: a registry reference
    /// (registry.example:5000/team/app:tag), linux/amd64. Its Env is the
    /// template's environment under `env`. Not with `from`.
    #[schemars(length(min = 1, max = tine_sandbox::images::MAX_REFERENCE_BYTES))]
    pub image: Option<String>,
    /// vCPUs (default: from's).
    #[schemars(range(min = 1, max = DEFAULT_MAX_VCPUS))]
    pub vcpus: Option<u64>,
    /// Guest memory in MiB (default: from's).
    #[schemars(range(min = MIN_MEMORY_MIB, max = DEFAULT_MAX_MEMORY_MIB))]
    pub memory_mib: Option<u64>,
    /// Environment variables of the template's sandboxes (and of the setup
    /// commands).
    #[serde(default)]
    #[schemars(transform = env_map)]
    pub env: BTreeMap<String, String>,
    /// Files written before the setup: absolute path -> UTF-8 content (at
    /// most 256 files, 8 MiB in all).
    #[serde(default)]
    #[schemars(transform = files_map)]
    pub files: BTreeMap<String, String>,
    /// Bash commands run in order (at most 64); the first that fails or
    /// times out stops the build (reported with its output).
    #[serde(default)]
    #[schemars(length(max = tine_sandbox::MAX_STEPS), inner(length(max = MAX_COMMAND_CHARS)))]
    pub setup: Vec<String>,
    /// Deadline of each setup command (seconds; default 600, at most 600).
    #[schemars(range(min = 1, max = MAX_TIMEOUT_SECS))]
    pub step_timeout_secs: Option<u32>,
    /// Wait up to this many seconds for the build (reporting progress when
    /// the request has a progressToken); default 0: return at once with
    /// state "building" and follow it with template_list. At most 600.
    #[schemars(range(max = MAX_TEMPLATE_WAIT_SECS))]
    pub wait_secs: Option<u64>,
}

/// `template_delete`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct TemplateDeleteParams {
    /// The template to delete (not `default` or `tine-*`: the server's own).
    #[schemars(length(min = 1, max = MAX_NAME_CHARS), pattern(NAME_PATTERN))]
    pub name: String,
}

/// `template_list`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct TemplateListResult {
    /// Every template, by name; the first ones only if `truncated`.
    pub templates: Vec<TemplateInfo>,
    /// Templates were left out to fit the result budget.
    pub truncated: bool,
}

/// `template_delete`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct TemplateDeleteResult {
    /// The template that is gone.
    pub name: String,
    /// Always true.
    pub deleted: bool,
}

#[tool_router(router = templates_router, vis = "pub(super)")]
impl TineMcp {
    #[tool(
        description = "List templates: snapshots of a ready sandbox that sandbox_create { template } starts from \
                       in a fraction of a boot's time. 'default' is what sandbox_create uses when none is named.",
        annotations(title = "List templates", read_only_hint = true, open_world_hint = false)
    )]
    async fn template_list(&self) -> Result<Json<TemplateListResult>, ToolError> {
        let caller = self.caller();
        let mut templates: Vec<TemplateInfo> = self
            .manager
            .templates()
            .into_iter()
            .filter(|t| match tine_sandbox::templates::split_qualified(&t.name).0 {
                None => true,
                owner => caller.owns(owner),
            })
            .map(|t| self.shown_template(t))
            .collect();
        let truncated = budget::fit_list(&mut templates, budget::CONTENT_BUDGET - 64) > 0;
        Ok(Json(TemplateListResult { templates, truncated }))
    }

    #[tool(
        description = "Build a template from a recipe in the background: start a sandbox from `from` (default: \
                       the default template) or boot an OCI `image`, with env, write files, run each setup command in order (each with its \
                       own deadline; the first failure stops the build and is reported with its output), and \
                       snapshot the result as `name`. Returns at once with state \"building\" (or waits up to \
                       wait_secs); template_list shows building (with the step), ready or failed (with the \
                       reason). Then sandbox_create { template: name }.",
        annotations(
            title = "Build template",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = true
        )
    )]
    async fn template_create(
        &self,
        Parameters(p): Parameters<TemplateCreateParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<TemplateInfo>, ToolError> {
        let recipe = Recipe {
            name: self.own_template(&p.name),
            from: p.from.map(|f| self.resolve_template(&f)),
            image: p.image,
            vcpus: p.vcpus,
            memory_mib: p.memory_mib,
            env: p.env,
            files: p.files,
            setup: p.setup.into_iter().map(SetupStep::Command).collect(),
            step_timeout_secs: p.step_timeout_secs,
        };
        let name = recipe.name.clone();
        let started = self.manager.start_template_build(recipe, &self.cx())?;
        let wait = Duration::from_secs(p.wait_secs.unwrap_or(0).min(MAX_TEMPLATE_WAIT_SECS));
        if wait.is_zero() {
            return Ok(Json(self.shown_template(started)));
        }
        let info = Reporter::around(&ctx, self.cx(), async |cx| {
            self.manager.wait_template_build(&name, wait, &cx.progress).await
        })
        .await?;
        Ok(Json(self.shown_template(info)))
    }

    #[tool(
        description = "Delete a template made with sandbox_snapshot. Sandboxes made from it keep running. \
                       'default' and names starting with 'tine-' are the server's and cannot be deleted.",
        annotations(
            title = "Delete template",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn template_delete(
        &self,
        Parameters(p): Parameters<TemplateDeleteParams>,
    ) -> Result<Json<TemplateDeleteResult>, ToolError> {
        self.manager.template_delete(&self.own_template(&p.name)).await.map_err(ToolError::from)?;
        Ok(Json(TemplateDeleteResult { name: p.name, deleted: true }))
    }
}
