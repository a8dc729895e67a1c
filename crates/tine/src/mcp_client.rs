//! The MCP client side, in one place: rmcp's Streamable HTTP client over
//! reqwest, as the cluster uses it to forward calls to a peer host
//! (`cluster::forward`) and the command line uses it to talk to a running
//! server (`tine sandbox ...`, `tine template ls|rm`, the `tine mcp stdio`
//! bridge).
//!
//! - [`Endpoint`]: where the server is and the bearer token, from
//!   `--url`/`$TINE_URL` and `--token-file`/`$TINE_TOKEN_FILE`/`$TINE_TOKEN`
//!   (the flags of `tine port-forward`).
//! - [`transport_config`] and [`connect`]: a session (`initialize`) within
//!   a bound.
//! - [`call_tool`]: one `tools/call` that a future can cancel; the
//!   cancellation is sent as `notifications/cancelled` (MCP 2025-11-25,
//!   basic/utilities/cancellation) and waited for, so that the server has
//!   it before the caller goes on (or exits).

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use axum::http::{HeaderName, HeaderValue};
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CallToolResult, CancelledNotification, CancelledNotificationParam,
    ClientNotification, ClientRequest, ServerResult,
};
use rmcp::service::{Peer, PeerRequestOptions, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{RoleClient, ServiceExt};

/// The server a command talks to when neither `--url` nor `$TINE_URL`
/// names one: a `--dev` server's default address.
pub const DEFAULT_URL: &str = "http://127.0.0.1:5555";

/// How long [`call_tool`] waits for its `notifications/cancelled` to be
/// taken by the server (the POST answered) before it gives up on it.
const CANCEL_SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// A connected MCP client session.
pub type Client = RunningService<RoleClient, ()>;

/// Errors of the MCP client.
#[derive(Debug, thiserror::Error)]
pub enum McpClientError {
    /// The server URL is not an `http://` or `https://` URL.
    #[error("bad server URL {url:?}: {reason} (give http://HOST:PORT or https://HOST, with or without /mcp)")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// Why.
        reason: String,
    },
    /// The token file cannot be read.
    #[error("cannot read the token file {path}: {source}")]
    TokenFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A header value that HTTP cannot carry.
    #[error("bad {name} header value: {reason}")]
    Header {
        /// The header.
        name: &'static str,
        /// Why.
        reason: String,
    },
    /// The session could not be started (`initialize` failed).
    #[error("cannot start an MCP session at {url}: {reason}")]
    Connect {
        /// The MCP endpoint.
        url: String,
        /// Why (the transport's error: refused connection, 401, ...).
        reason: String,
    },
    /// No `initialize` answer within the bound.
    #[error("no MCP initialize answer from {url} within {secs} s")]
    InitializeTimeout {
        /// The MCP endpoint.
        url: String,
        /// The bound.
        secs: u64,
    },
    /// The call failed at the protocol level (a tool error is a result).
    #[error("{tool}: {reason}")]
    Call {
        /// The tool.
        tool: String,
        /// Why.
        reason: String,
    },
    /// The caller cancelled the call; the server was told.
    #[error("{tool} was cancelled")]
    Cancelled {
        /// The tool.
        tool: String,
    },
}

/// Where a server is and how to authenticate to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// The base URL, without `/mcp` or a trailing `/`
    /// (`http://127.0.0.1:5555`).
    pub base: String,
    /// The bearer token (the operator's or a tenant's API key); `None`
    /// for a `--dev` server.
    pub token: Option<String>,
}

impl Endpoint {
    /// The endpoint of `url` (else `$TINE_URL`, else [`DEFAULT_URL`]; a
    /// base URL or one ending in `/mcp`) with the token in `token_file`
    /// (else `$TINE_TOKEN_FILE`, else `$TINE_TOKEN`; none: no token).
    ///
    /// Errors: [`McpClientError::BadUrl`], [`McpClientError::TokenFile`].
    pub fn resolve(url: Option<String>, token_file: Option<PathBuf>) -> Result<Endpoint, McpClientError> {
        let url = url.or_else(|| std::env::var("TINE_URL").ok().filter(|u| !u.is_empty()));
        let token_file =
            token_file.or_else(|| std::env::var_os("TINE_TOKEN_FILE").filter(|f| !f.is_empty()).map(PathBuf::from));
        let token = match token_file {
            Some(path) => Some(
                std::fs::read_to_string(&path)
                    .map_err(|source| McpClientError::TokenFile { path, source })?
                    .trim()
                    .to_owned(),
            ),
            None => std::env::var("TINE_TOKEN").ok().map(|t| t.trim().to_owned()),
        };
        Ok(Endpoint { base: base_url(url.as_deref().unwrap_or(DEFAULT_URL))?, token: token.filter(|t| !t.is_empty()) })
    }

    /// The MCP endpoint: `<base>/mcp`.
    pub fn mcp_url(&self) -> String {
        format!("{}/mcp", self.base)
    }

    /// A new session with the server, within `timeout`.
    ///
    /// Errors: as [`connect`].
    pub async fn connect(&self, http: reqwest::Client, timeout: Duration) -> Result<Client, McpClientError> {
        connect(http, transport_config(&self.mcp_url(), self.token.as_deref(), [])?, timeout).await
    }
}

/// The base URL of `url`: `http(s)://host[:port][/prefix]` without a
/// trailing `/` or `/mcp`.
///
/// Errors: [`McpClientError::BadUrl`] for another scheme or no host.
pub fn base_url(url: &str) -> Result<String, McpClientError> {
    let bad = |reason: &str| McpClientError::BadUrl { url: url.to_owned(), reason: reason.to_owned() };
    let parsed = reqwest::Url::parse(url).map_err(|e| bad(&e.to_string()))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(bad("the scheme must be http or https"));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(bad("a query or fragment has no place in it"));
    }
    let base = url.trim_end_matches('/');
    Ok(base.strip_suffix("/mcp").unwrap_or(base).trim_end_matches('/').to_owned())
}

/// The transport configuration of the MCP endpoint `mcp_url` with bearer
/// `token` (if any) and `headers` on every request.
///
/// Errors: [`McpClientError::Header`] for a value HTTP cannot carry.
pub fn transport_config(
    mcp_url: &str,
    token: Option<&str>,
    headers: impl IntoIterator<Item = (&'static str, String)>,
) -> Result<StreamableHttpClientTransportConfig, McpClientError> {
    let mut config = StreamableHttpClientTransportConfig::with_uri(mcp_url.to_owned());
    if let Some(t) = token {
        config = config.auth_header(t.to_owned());
    }
    for (name, value) in headers {
        let value =
            HeaderValue::from_str(&value).map_err(|e| McpClientError::Header { name, reason: e.to_string() })?;
        config.custom_headers.insert(HeaderName::from_static(name), value);
    }
    Ok(config)
}

/// A new MCP session over `http` with `config`'s endpoint, its
/// `initialize` answered within `timeout`.
///
/// Errors: [`McpClientError::Connect`], [`McpClientError::InitializeTimeout`].
pub async fn connect(
    http: reqwest::Client,
    config: StreamableHttpClientTransportConfig,
    timeout: Duration,
) -> Result<Client, McpClientError> {
    let url = config.uri.to_string();
    let transport = StreamableHttpClientTransport::with_client(http, config);
    tokio::time::timeout(timeout, ().serve(transport))
        .await
        .map_err(|_| McpClientError::InitializeTimeout { url: url.clone(), secs: timeout.as_secs() })?
        .map_err(|e| {
            let reason = match &e {
                // The HTTP error and its causes, without the transport's
                // type name.
                rmcp::service::ClientInitializeError::TransportError { error, .. } => causes(error.error.as_ref()),
                other => other.to_string(),
            };
            McpClientError::Connect { url, reason }
        })
}

/// `e` and its sources, `: `-separated, each said once (a source whose
/// text its error already holds is left out).
pub fn causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = s.source();
    }
    out
}

/// Calls a tool on `peer`. When `cancel` resolves before the result, the
/// server is sent `notifications/cancelled` for the request (waited for up
/// to 10 s: the notification's POST answered) and the call ends with
/// [`McpClientError::Cancelled`]; the server then stops the call's work
/// (a `sandbox_exec`'s command is killed in the guest).
///
/// Errors: [`McpClientError::Call`] (protocol errors; a tool's own error
/// is a result with `is_error`), [`McpClientError::Cancelled`].
pub async fn call_tool(
    peer: &Peer<RoleClient>,
    params: CallToolRequestParams,
    cancel: impl Future<Output = ()>,
) -> Result<CallToolResult, McpClientError> {
    let tool = params.name.to_string();
    let failed = |e: rmcp::ServiceError| McpClientError::Call { tool: tool.clone(), reason: e.to_string() };
    let request = ClientRequest::CallToolRequest(CallToolRequest::new(params));
    let handle = peer.send_request_with_option(request, PeerRequestOptions::no_options()).await.map_err(failed)?;
    let id = handle.id.clone();
    tokio::select! {
        r = handle.await_response() => match r.map_err(failed)? {
            ServerResult::CallToolResult(r) => Ok(r),
            _ => Err(McpClientError::Call { tool, reason: "the server answered with another kind of result".into() }),
        },
        () = cancel => {
            let notification = ClientNotification::CancelledNotification(CancelledNotification::new(
                CancelledNotificationParam::new(Some(id), Some("cancelled by the client".into())),
            ));
            match tokio::time::timeout(CANCEL_SEND_TIMEOUT, peer.send_notification(notification)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!("{tool}: the cancellation was not sent: {e}"),
                Err(_) => tracing::warn!("{tool}: the cancellation was not taken within {CANCEL_SEND_TIMEOUT:?}"),
            }
            Err(McpClientError::Cancelled { tool })
        }
    }
}

/// The tool's outcome: its structured content (or `null`), or the text of
/// a tool error (`is_error`).
pub fn tool_outcome(r: CallToolResult) -> Result<serde_json::Value, String> {
    if r.is_error == Some(true) {
        let text: Vec<String> = r.content.iter().filter_map(|c| c.as_text().map(|t| t.text.clone())).collect();
        return Err(text.join("\n"));
    }
    Ok(r.structured_content.unwrap_or(serde_json::Value::Null))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_lose_mcp_and_trailing_slashes() {
        for (given, base) in [
            ("http://127.0.0.1:5555", "http://127.0.0.1:5555"),
            ("http://127.0.0.1:5555/", "http://127.0.0.1:5555"),
            ("http://127.0.0.1:5555/mcp", "http://127.0.0.1:5555"),
            ("https://tine.example.com/mcp/", "https://tine.example.com"),
            ("https://example.com/tine/mcp", "https://example.com/tine"),
        ] {
            assert_eq!(base_url(given).unwrap(), base, "{given}");
        }
        for bad in ["127.0.0.1:5555", "ftp://h/", "http://", "http://h/mcp?x=1", "not a url"] {
            let e = base_url(bad).unwrap_err().to_string();
            assert!(e.contains("bad server URL"), "{bad}: {e}");
        }
    }

    #[test]
    fn causes_are_said_once_each() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] Mid);
        #[derive(Debug, thiserror::Error)]
        #[error("mid: inner")]
        struct Mid(#[source] std::io::Error);
        let e = Outer(Mid(std::io::Error::other("inner")));
        assert_eq!(causes(&e), "outer: mid: inner");
    }

    #[test]
    fn headers_that_http_cannot_carry_are_refused() {
        let c = transport_config("http://h/mcp", Some("t"), [("x-tine-tenant", "acme".to_string())]).unwrap();
        assert_eq!(c.custom_headers.len(), 1);
        let e = transport_config("http://h/mcp", None, [("x-tine-tenant", "a\nb".to_string())]).unwrap_err();
        assert!(e.to_string().contains("x-tine-tenant"), "{e}");
    }
}
