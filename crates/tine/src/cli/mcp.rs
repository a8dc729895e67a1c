//! `tine mcp stdio`: MCP over stdin and stdout, for clients that start
//! their servers as subprocesses (Claude Desktop, the SDKs' stdio
//! transports).
//!
//! With `--url`, a bridge to a running server: each JSON-RPC message read
//! from stdin (one per line, MCP 2025-11-25 "Transports", stdio) is sent
//! over rmcp's Streamable HTTP client ([`crate::mcp_client`], with the
//! token handling of the other commands), and each message the server sends
//! (responses, progress and log notifications) is written to stdout. The
//! bridge keeps no state of its own: the session (`Mcp-Session-Id`), its
//! protocol version and its streams are the HTTP transport's. When stdin
//! closes, the bridge ends the session (`DELETE /mcp`: the sandbox it made
//! on first use is killed) and exits 0; when the server goes away it exits
//! with 1. A request that cannot be sent is answered on stdout with a
//! JSON-RPC error saying why.
//!
//! Without `--url`, the server itself in this process for the one client
//! (`cli::server::start_stdio`, needing KVM and the images as `tine server
//! start` does).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use rmcp::model::{ErrorData, RequestId, ServerJsonRpcMessage};
use rmcp::transport::async_rw::AsyncRwTransport;
use rmcp::transport::{StreamableHttpClientTransport, Transport};
use rmcp::RoleServer;

use super::ImageArgs;
use crate::mcp_client::{self, Endpoint};

/// How long the bridge waits for the session's end (`DELETE /mcp`) after
/// stdin closed: clients wait a little before they kill a stdio server
/// (the Python SDK 2 s).
const CLOSE_TIMEOUT: Duration = Duration::from_millis(1500);

// `tine mcp ...`.
#[derive(Subcommand)]
pub(super) enum McpCommand {
    /// Serve MCP on stdin/stdout: with --url, a bridge to that server's
    /// Streamable HTTP endpoint; without, an in-process server for this
    /// one client (needs KVM and the images, as `tine server start`).
    Stdio(StdioArgs),
}

// `tine mcp stdio`'s flags.
#[derive(Args)]
pub(super) struct StdioArgs {
    /// The server to bridge to, with or without /mcp (e.g.
    /// http://127.0.0.1:5555); without it, the server runs in this process.
    #[arg(long)]
    url: Option<String>,
    /// With --url: a file holding the bearer token [default:
    /// $TINE_TOKEN_FILE, else the token in $TINE_TOKEN; none: no token, as
    /// a --dev server takes].
    #[arg(long, requires = "url")]
    token_file: Option<PathBuf>,
    /// Without --url: the in-process server's configuration and images.
    #[command(flatten)]
    images: ImageArgs,
}

/// Errors of the bridge.
#[derive(Debug, thiserror::Error)]
enum BridgeError {
    /// The server URL or token.
    #[error(transparent)]
    Client(#[from] mcp_client::McpClientError),
    /// Standard output cannot be written (the client is gone).
    #[error("cannot write to stdout: {0}")]
    Stdout(std::io::Error),
    /// The HTTP transport ended while the client was still there.
    #[error("the connection to {0} ended (is the server still running?)")]
    ServerGone(String),
    /// The runtime or HTTP client could not be made.
    #[error("{0}")]
    Setup(String),
}

impl McpCommand {
    /// Whether it bridges to a running server (`--url`).
    pub(super) fn is_bridge(&self) -> bool {
        let McpCommand::Stdio(args) = self;
        args.url.is_some()
    }
}

/// Runs `tine mcp stdio`.
pub(super) fn run(cmd: McpCommand) -> anyhow::Result<ExitCode> {
    let McpCommand::Stdio(args) = cmd;
    let Some(url) = args.url else {
        return super::server::start_stdio(args.images);
    };
    match bridge(Endpoint::resolve(Some(url), args.token_file)) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("tine: mcp stdio: {e}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// The bridge between stdio and `endpoint`, until stdin closes.
///
/// Errors: [`BridgeError`].
fn bridge(endpoint: Result<Endpoint, mcp_client::McpClientError>) -> Result<(), BridgeError> {
    let endpoint = endpoint?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| BridgeError::Setup(format!("cannot start the async runtime: {e}")))?;
    let r = runtime.block_on(pump(endpoint));
    // A stdin read still blocked on a thread must not hold the exit.
    runtime.shutdown_timeout(Duration::from_millis(200));
    r
}

/// Moves messages both ways until stdin closes (then ends the HTTP
/// session) or the server goes.
async fn pump(endpoint: Endpoint) -> Result<(), BridgeError> {
    let url = endpoint.mcp_url();
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| BridgeError::Setup(format!("HTTP client: {e}")))?;
    let config = mcp_client::transport_config(&url, endpoint.token.as_deref(), [])?;
    let mut remote = StreamableHttpClientTransport::with_client(http, config);
    let (stdin, stdout) = rmcp::transport::stdio_pipes();
    let mut local = AsyncRwTransport::<RoleServer, _, _>::new_server(stdin, stdout);
    // Requests the HTTP side could not send: answered with an error here.
    let (failed_tx, mut failed_rx) = tokio::sync::mpsc::channel::<(RequestId, String)>(64);
    let mut sends = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            biased;
            Some((id, why)) = failed_rx.recv() => {
                let error = ErrorData::internal_error(format!("tine mcp stdio: {url}: {why}"), None);
                local.send(ServerJsonRpcMessage::error(error, Some(id))).await.map_err(BridgeError::Stdout)?;
            }
            from_server = remote.receive() => match from_server {
                Some(m) => local.send(m).await.map_err(BridgeError::Stdout)?,
                None => {
                    // What could not be sent is said before going.
                    drop(failed_tx);
                    let _ = tokio::time::timeout(Duration::from_secs(2), async {
                        while sends.join_next().await.is_some() {}
                    })
                    .await;
                    while let Ok((id, why)) = failed_rx.try_recv() {
                        let error = ErrorData::internal_error(format!("tine mcp stdio: {url}: {why}"), None);
                        let _ = local.send(ServerJsonRpcMessage::error(error, Some(id))).await;
                    }
                    return Err(BridgeError::ServerGone(url));
                }
            },
            from_client = local.receive() => match from_client {
                Some(m) => {
                    let id = match &m {
                        rmcp::model::JsonRpcMessage::Request(r) => Some(r.id.clone()),
                        _ => None,
                    };
                    let send = remote.send(m);
                    let failed = failed_tx.clone();
                    sends.spawn(async move {
                        if let Err(e) = send.await {
                            match id {
                                Some(id) => {
                                    let _ = failed.send((id, e.to_string())).await;
                                }
                                None => tracing::warn!("tine mcp stdio: a notification was not sent: {e}"),
                            }
                        }
                    });
                }
                None => {
                    // stdin closed: the client is done; so is its session
                    // (once what it sent last is on its way).
                    let _ = tokio::time::timeout(Duration::from_millis(300), async {
                        while sends.join_next().await.is_some() {}
                    })
                    .await;
                    let _ = tokio::time::timeout(CLOSE_TIMEOUT, remote.close()).await;
                    return Ok(());
                }
            },
            Some(_) = sends.join_next(), if !sends.is_empty() => {}
        }
    }
}
