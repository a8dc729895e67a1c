//! The protocol between Tine's host and the guest agent (over vsock).
//!
//! # Frames
//! Every message is one frame: a 4-byte little-endian length `L`, then
//! `L` bytes: a 2-byte little-endian protocol version ([`PROTOCOL_VERSION`])
//! and the message encoded with postcard (serde). `L` is at most
//! [`MAX_FRAME_BYTES`]; a reader checks it before allocating, so a peer
//! cannot make the other side allocate more than that per frame.
//!
//! # Messages
//! The host sends [`Request`]s, the agent answers each with a
//! [`Response`] carrying the same `id`; several requests may be in flight
//! on one connection and answers may come in any order. Failures are
//! typed ([`AgentError`]), never strings to parse. The one exception to
//! "one answer per request": [`Op::ExecWithProgress`] and
//! [`Op::ProcessWait`] (with `progress_ms > 0`) send interim
//! [`Reply::Progress`] frames with the request's id before their final
//! answer.

#![deny(missing_docs)]

pub mod messages;

use std::io::{Read, Write};

use serde::de::DeserializeOwned;
use serde::Serialize;

pub use messages::*;

/// The protocol version this crate speaks. 2: `Op::PythonWarmUp`,
/// `Reply::PythonWarm` and `PythonReply`'s `value_truncated`, `value_bytes`
/// and `interpreter_start_ms` (postcard is positional, so a new field is a
/// new version). 3: background processes (`Op::Spawn` .. `Op::ProcessSignal`,
/// their replies and errors) and progress frames (`Op::ExecWithProgress`,
/// `Reply::Progress`). 4: the sandbox environment (`Op::SetEnv`),
/// `ProcessWaited::resume`, `Op::Rename` and the persistent Node.js
/// interpreter (`Op::Node`).
pub const PROTOCOL_VERSION: u16 = 4;
/// The guest vsock port the agent listens on (the host connects to it
/// through the VM's hybrid-vsock socket with `CONNECT <port>\n`).
pub const AGENT_PORT: u32 = 1024;
/// Largest frame body (version + message), bytes.
pub const MAX_FRAME_BYTES: usize = 16 << 20;
/// Bytes of the length prefix.
pub const LENGTH_BYTES: usize = 4;
/// Bytes of the version field.
pub const VERSION_BYTES: usize = 2;

/// Errors of framing and encoding.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// A frame announced more than [`MAX_FRAME_BYTES`].
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    FrameTooLarge {
        /// The announced length.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// A frame too short to hold the version.
    #[error("frame of {0} bytes is too short for a version field")]
    FrameTooShort(usize),
    /// The peer speaks another protocol version.
    #[error("peer speaks protocol version {theirs}, this side {ours}")]
    VersionMismatch {
        /// Our version.
        ours: u16,
        /// Theirs.
        theirs: u16,
    },
    /// The message does not decode.
    #[error("malformed message: {0}")]
    Decode(postcard::Error),
    /// The message cannot be encoded (or is too large).
    #[error("cannot encode message: {0}")]
    Encode(String),
    /// The connection closed between frames.
    #[error("connection closed")]
    Closed,
    /// An I/O error.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

/// Encodes `msg` as a whole frame (length, version, body).
///
/// Errors: [`ProtocolError::Encode`], [`ProtocolError::FrameTooLarge`] for a
/// body over [`MAX_FRAME_BYTES`].
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtocolError> {
    let mut out = vec![0u8; LENGTH_BYTES];
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    let out = postcard::to_extend(msg, out).map_err(|e| ProtocolError::Encode(e.to_string()))?;
    let body = out.len() - LENGTH_BYTES;
    if body > MAX_FRAME_BYTES {
        return Err(ProtocolError::FrameTooLarge { len: body as u64, max: MAX_FRAME_BYTES });
    }
    let mut out = out;
    out[..LENGTH_BYTES].copy_from_slice(&(body as u32).to_le_bytes());
    Ok(out)
}

/// Checks a length prefix; returns the body length.
///
/// Errors: [`ProtocolError::FrameTooLarge`], [`ProtocolError::FrameTooShort`].
pub fn body_len(prefix: [u8; LENGTH_BYTES]) -> Result<usize, ProtocolError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(ProtocolError::FrameTooLarge { len: len as u64, max: MAX_FRAME_BYTES });
    }
    if len < VERSION_BYTES {
        return Err(ProtocolError::FrameTooShort(len));
    }
    Ok(len)
}

/// Decodes a frame body (version + message).
///
/// Errors: [`ProtocolError::FrameTooShort`], [`ProtocolError::VersionMismatch`],
/// [`ProtocolError::Decode`].
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ProtocolError> {
    if body.len() < VERSION_BYTES {
        return Err(ProtocolError::FrameTooShort(body.len()));
    }
    let theirs = u16::from_le_bytes([body[0], body[1]]);
    if theirs != PROTOCOL_VERSION {
        return Err(ProtocolError::VersionMismatch { ours: PROTOCOL_VERSION, theirs });
    }
    postcard::from_bytes(&body[VERSION_BYTES..]).map_err(ProtocolError::Decode)
}

/// Reads one frame's body from `r` (blocking). The length is checked
/// before the body is allocated.
///
/// Errors: [`ProtocolError::Closed`] on EOF before a frame,
/// [`ProtocolError::FrameTooLarge`], [`ProtocolError::FrameTooShort`],
/// [`ProtocolError::Io`] (EOF inside a frame included).
pub fn read_body<R: Read>(r: &mut R) -> Result<Vec<u8>, ProtocolError> {
    let mut prefix = [0u8; LENGTH_BYTES];
    let mut got = 0;
    while got < LENGTH_BYTES {
        match r.read(&mut prefix[got..]) {
            Ok(0) if got == 0 => return Err(ProtocolError::Closed),
            Ok(0) => return Err(ProtocolError::Io(std::io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = body_len(prefix)?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(body)
}

/// Reads and decodes one message from `r`.
///
/// Errors: those of [`read_body`] and [`decode_body`].
pub fn read_message<R: Read, T: DeserializeOwned>(r: &mut R) -> Result<T, ProtocolError> {
    decode_body(&read_body(r)?)
}

/// Encodes and writes one message to `w`.
///
/// Errors: [`ProtocolError::Encode`], [`ProtocolError::FrameTooLarge`],
/// [`ProtocolError::Io`].
pub fn write_message<W: Write, T: Serialize>(w: &mut W, msg: &T) -> Result<(), ProtocolError> {
    w.write_all(&encode(msg)?)?;
    Ok(())
}

#[cfg(test)]
mod tests;
