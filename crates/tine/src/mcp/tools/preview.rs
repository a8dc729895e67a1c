//! The preview family: `sandbox_preview_url` (a URL on this server that
//! reaches a port in the sandbox, [`crate::preview`]) and
//! `sandbox_preview_revoke`.

use rmcp::handler::server::wrapper::Parameters;
use rmcp::service::RequestContext;
use rmcp::{tool, tool_router, Json, RoleServer};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::mcp::bounds::MAX_ID_CHARS;
use crate::mcp::errors::ToolError;
use crate::mcp::TineMcp;
use crate::preview::{proxy, Preview, PreviewError, DEFAULT_TTL_SECS, MAX_TTL_SECS};

/// The URL forms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PreviewForm {
    /// `<scheme>://<preview_id>.<domain>/`: an origin of its own.
    Host,
    /// `<server>/preview/<preview_id>/`: shares the server's origin;
    /// apps that use absolute paths break.
    Path,
}

/// `sandbox_preview_url`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PreviewUrlParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// The guest port a server listens on (on 0.0.0.0, not 127.0.0.1).
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    /// No token: anyone with the URL can open it (default false).
    #[serde(default)]
    pub public: bool,
    /// Seconds the URL works (default 86400, at most 2592000).
    #[schemars(range(min = 1, max = MAX_TTL_SECS))]
    pub ttl_secs: Option<u64>,
    /// "host" (default where the server has a preview domain) or "path".
    pub form: Option<PreviewForm>,
}

/// `sandbox_preview_revoke`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PreviewRevokeParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Revoke this preview only.
    #[schemars(length(min = 12, max = 12), pattern("^[0-9a-v]{12}$"))]
    pub preview_id: Option<String>,
    /// Revoke the previews of this port only.
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<u16>,
}

/// `sandbox_preview_url`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct PreviewUrlResult {
    /// The URL to open (with its token unless public).
    pub url: String,
    /// The preview.
    #[serde(flatten)]
    pub preview: Preview,
    /// The URL's form.
    pub form: PreviewForm,
    /// What to tell the person who opens it.
    pub note: String,
}

/// `sandbox_preview_revoke`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct PreviewRevokeResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// The previews that no longer work.
    pub revoked: Vec<Preview>,
    /// The sandbox's previews that still work.
    pub remaining: Vec<Preview>,
}

#[tool_router(router = preview_router, vis = "pub(super)")]
impl TineMcp {
    #[tool(
        description = "Get a URL that shows a server in the sandbox (web app, notebook, API; WebSockets and \
                       streaming pass) to a person's browser. Start the server first on 0.0.0.0, not 127.0.0.1 \
                       (sandbox_exec with background: true). The URL carries a token unless public; it works for \
                       ttl_secs (default 24 h) or until sandbox_preview_revoke, and wakes a hibernated sandbox.",
        annotations(title = "Preview URL", read_only_hint = false, destructive_hint = false, open_world_hint = false)
    )]
    async fn sandbox_preview_url(
        &self,
        Parameters(p): Parameters<PreviewUrlParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<PreviewUrlResult>, ToolError> {
        let previews = &self.previews;
        let forms = &previews.forms;
        if forms.host.is_none() && !forms.path {
            return Err(PreviewError::Off.into());
        }
        if p.port == 0 {
            return Err(PreviewError::BadPort.into());
        }
        let public_allowed = match self.caller() {
            crate::auth::Principal::Tenant(t) => t.public_previews.unwrap_or(previews.config.public),
            crate::auth::Principal::Admin => previews.config.public,
        };
        if p.public && !public_allowed {
            return Err(PreviewError::PublicOff.into());
        }
        let ttl = p.ttl_secs.unwrap_or(DEFAULT_TTL_SECS);
        if !(1..=MAX_TTL_SECS).contains(&ttl) {
            return Err(PreviewError::BadTtl(ttl).into());
        }
        let form = match p.form {
            Some(PreviewForm::Host) if forms.host.is_none() => return Err(PreviewError::FormOff("host").into()),
            Some(PreviewForm::Path) if !forms.path => return Err(PreviewError::FormOff("path").into()),
            Some(f) => f,
            None if forms.host.is_some() => PreviewForm::Host,
            None => PreviewForm::Path,
        };
        let id = self.target(p.sandbox_id).await?;
        let tenant = self.manager.tenant_of(&id).flatten();
        let preview = previews.store.create(&id, p.port, tenant.as_deref(), p.public, ttl)?;
        let token = (!p.public).then(|| previews.tokens.sign(&preview, &self.url_grant(&id)));
        let url = proxy::url(forms, &preview, token.as_deref(), form == PreviewForm::Host, &self.url_base(&ctx));
        let mut note =
            format!("Opens port {} of sandbox {id} in a browser; a server must listen there on 0.0.0.0.", preview.port);
        if form == PreviewForm::Path {
            note.push_str(" A path-based URL: apps that load absolute paths (/static/...) break under it.");
        }
        if !p.public {
            note.push_str(" The URL's token is a credential: share it only with who should see the app.");
        }
        crate::audit::change("preview URL made", &format!("{id}:{} {}", preview.port, preview.preview_id));
        Ok(Json(PreviewUrlResult { url, preview, form, note }))
    }

    #[tool(
        description = "Revoke preview URLs of a sandbox so they stop working at once: one (preview_id), those of a \
                       port, or all of them (neither given). Answers what was revoked and what still works.",
        annotations(
            title = "Revoke preview URLs",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_preview_revoke(
        &self,
        Parameters(p): Parameters<PreviewRevokeParams>,
    ) -> Result<Json<PreviewRevokeResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let store = &self.previews.store;
        let revoked = store.revoke(&id, |x| {
            p.preview_id.as_deref().is_none_or(|want| x.preview_id == want) && p.port.is_none_or(|want| x.port == want)
        })?;
        if let Some(want) = &p.preview_id {
            if revoked.is_empty() {
                return Err(PreviewError::NotFound(want.clone()).into());
            }
        }
        for r in &revoked {
            crate::audit::change("preview URL revoked", &format!("{id}:{} {}", r.port, r.preview_id));
        }
        Ok(Json(PreviewRevokeResult { remaining: store.of_sandbox(&id), sandbox_id: id, revoked }))
    }
}
