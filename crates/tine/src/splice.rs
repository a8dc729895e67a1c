//! Splicing an upgraded HTTP/1.1 connection (RFC 9110 §7.8) with another
//! byte stream, both ways until both close: a port forward's client and
//! its guest connection ([`crate::port_forward`]), a preview's WebSocket
//! and the guest's or the peer host's upgraded connection
//! ([`crate::preview`]).

use std::future::Future;

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};

/// Why a splice ended early.
#[derive(Debug, thiserror::Error)]
pub enum SpliceError {
    /// The client's side never became a byte stream.
    #[error("the client's upgrade failed: {0}")]
    Client(hyper::Error),
    /// The other side never became a byte stream.
    #[error("the other side failed: {0}")]
    Other(String),
    /// Copying failed (a reset, a broken pipe).
    #[error("{0}")]
    Io(std::io::Error),
}

/// Waits for the client's upgrade and `other` at once, then copies both
/// ways until both directions are closed (a half-close is passed on).
/// Returns the bytes moved from the client to `other` and back.
///
/// Errors: [`SpliceError`].
pub async fn splice<S, E>(
    client: OnUpgrade,
    other: impl Future<Output = Result<S, E>>,
) -> Result<(u64, u64), SpliceError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    E: std::fmt::Display,
{
    let (client, other) = tokio::join!(client, other);
    let mut client = TokioIo::new(client.map_err(SpliceError::Client)?);
    let mut other = other.map_err(|e| SpliceError::Other(e.to_string()))?;
    tokio::io::copy_bidirectional(&mut client, &mut other).await.map_err(SpliceError::Io)
}
