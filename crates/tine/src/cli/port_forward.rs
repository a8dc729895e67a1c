//! `tine port-forward SANDBOX GUEST_PORT [LOCAL]`: listens on this machine
//! and carries each accepted TCP connection into the sandbox's guest port
//! through the server's HTTP API (`crate::port_forward`), with the
//! caller's bearer token, so it works against a server on another machine
//! and behind a TLS proxy. Runs until interrupted.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use reqwest::header::{CONNECTION, UPGRADE};
use reqwest::StatusCode;
use tokio::net::{TcpListener, TcpStream};

use crate::mcp_client::Endpoint;
use crate::port_forward::{path, PROTOCOL};

#[derive(Args)]
pub(super) struct PortForwardArgs {
    /// The sandbox's id.
    sandbox: String,
    /// The TCP port inside the guest.
    guest_port: u16,
    /// Where to listen here: PORT or ADDR:PORT (port 0: any free port,
    /// printed) [default: 127.0.0.1:GUEST_PORT]. Another address than
    /// loopback lets other machines reach the guest's port.
    local: Option<String>,
    /// The server's URL [default: $TINE_URL, else http://127.0.0.1:5555].
    #[arg(long)]
    url: Option<String>,
    /// A file holding the bearer token (the operator's or a tenant's API
    /// key) [default: $TINE_TOKEN_FILE, else the token in $TINE_TOKEN;
    /// none: no token, as a --dev server takes].
    #[arg(long)]
    token_file: Option<PathBuf>,
}

/// The local address `local` names (`PORT` means loopback).
fn local_addr(local: Option<&str>, guest_port: u16) -> anyhow::Result<SocketAddr> {
    match local {
        None => Ok(SocketAddr::from(([127, 0, 0, 1], guest_port))),
        Some(s) => match s.parse::<u16>() {
            Ok(port) => Ok(SocketAddr::from(([127, 0, 0, 1], port))),
            Err(_) => s.parse().with_context(|| format!("{s:?} is neither a port nor ADDR:PORT")),
        },
    }
}

/// Runs the forward until Ctrl-C; prints `forwarding ADDR -> SANDBOX:PORT`
/// on stdout once listening.
///
/// Errors: a bad address, URL or token file; the local port cannot be
/// bound.
pub(super) fn run(args: PortForwardArgs) -> anyhow::Result<ExitCode> {
    let Endpoint { base, token } = Endpoint::resolve(args.url, args.token_file)?;
    let url = reqwest::Url::parse(&format!("{base}{}", path(&args.sandbox, args.guest_port)))
        .with_context(|| format!("bad server URL {base:?}"))?;
    let local = local_addr(args.local.as_deref(), args.guest_port)?;
    let client = reqwest::Client::builder().http1_only().build().context("HTTP client")?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async move {
        let listener = TcpListener::bind(local).await.with_context(|| format!("listen on {local}"))?;
        let bound = listener.local_addr()?;
        println!("forwarding {bound} -> {}:{}", args.sandbox, args.guest_port);
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => return Ok(ExitCode::SUCCESS),
                accepted = listener.accept() => {
                    let (conn, peer) = match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            eprintln!("tine: port-forward: accept: {e}");
                            continue;
                        }
                    };
                    let (client, url, token) = (client.clone(), url.clone(), token.clone());
                    tokio::spawn(async move {
                        if let Err(e) = carry(conn, &client, url, token.as_deref()).await {
                            eprintln!("tine: port-forward: connection from {peer}: {e:#}");
                        }
                    });
                }
            }
        }
    })
}

/// Carries one local connection through an upgraded request to `url`.
async fn carry(
    mut local: TcpStream,
    client: &reqwest::Client,
    url: reqwest::Url,
    token: Option<&str>,
) -> anyhow::Result<()> {
    let mut request = client.get(url).header(CONNECTION, "upgrade").header(UPGRADE, PROTOCOL);
    if let Some(t) = token {
        request = request.bearer_auth(t);
    }
    let response = request.send().await.context("reach the server")?;
    let status = response.status();
    if status != StatusCode::SWITCHING_PROTOCOLS {
        let body = response.text().await.unwrap_or_default();
        let message = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(str::to_owned))
            .unwrap_or(body);
        anyhow::bail!("the server refused ({status}): {message}");
    }
    let mut remote = response.upgrade().await.context("upgrade")?;
    let (up, down) = tokio::io::copy_bidirectional(&mut local, &mut remote).await?;
    if up + down == 0 {
        eprintln!("tine: port-forward: the guest closed the connection at once (is anything listening on the port?)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_takes_a_port_or_an_address() {
        assert_eq!(local_addr(None, 8080).unwrap(), "127.0.0.1:8080".parse().unwrap());
        assert_eq!(local_addr(Some("9000"), 80).unwrap(), "127.0.0.1:9000".parse().unwrap());
        assert_eq!(local_addr(Some("0.0.0.0:9000"), 80).unwrap(), "0.0.0.0:9000".parse().unwrap());
        assert!(local_addr(Some("nine"), 80).is_err());
    }
}
