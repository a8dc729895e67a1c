//! The protocol between Tine's host and the guest agent (over vsock).
//!
//! # Frames
//! Every message is one frame: a 4-byte little-endian length `L`, then
//! `L` bytes: a 2-byte little-endian protocol version ([`PROTOCOL_VERSION`])
//! and the message. From version 5 the message is CBOR (RFC 8949, with
//! serde: structs as maps keyed by field name, enums by variant name,
//! `serde_bytes` fields as byte strings). Version 4 was postcard
//! (positional); [`Wire::V4`] still speaks it with the frozen types of
//! [`v4`]. `L` is at most [`MAX_FRAME_BYTES`]; a reader checks it before
//! allocating, so a peer cannot make the other side allocate more than
//! that per frame.
//!
//! # Versions, from 5 on
//! A new field is `#[serde(default)]` (an older peer does not send it),
//! unknown fields are ignored (a newer peer sends them), and no message
//! type denies unknown fields, in both directions. An operation the agent
//! does not know is answered for its request id with
//! [`AgentError::Unsupported`] ([`Wire::decode_request`] gives that id); a
//! reply the host does not know fails that call only. The host learns the
//! agent's version when it connects (a version 4 agent answers a version 5
//! frame with a version 4 frame) and keeps it for the connection.
//!
//! # Messages
//! The host sends [`Request`]s, the agent answers each with a
//! [`Response`] carrying the same `id`; several requests may be in flight
//! on one connection and answers may come in any order. Failures are
//! typed ([`AgentError`]), never strings to parse. The one exception to
//! "one answer per request": [`Op::ExecWithProgress`] and
//! [`Op::ProcessWait`] (with `progress_ms > 0`) send interim
//! [`Reply::Progress`] frames with the request's id before their final
//! answer. [`Op::Cancel`] names another request of the same connection
//! (an exec in flight, whose command is then killed); it is answered at
//! once, and the cancelled request's own answer follows as usual.

#![deny(missing_docs)]

pub mod messages;
pub mod v4;

use std::io::{Read, Write};

use serde::de::DeserializeOwned;
use serde::Serialize;

pub use messages::*;

/// The protocol version this crate speaks. 2: `Op::PythonWarmUp`,
/// `Reply::PythonWarm` and `CellReply`'s `value_truncated`, `value_bytes`
/// and `interpreter_start_ms` (postcard is positional, so a new field is a
/// new version). 3: background processes (`Op::Spawn` .. `Op::ProcessSignal`,
/// their replies and errors) and progress frames (`Op::ExecWithProgress`,
/// `Reply::Progress`). 4: the sandbox environment (`Op::SetEnv`),
/// `ProcessWaited::resume`, `Op::Rename` and the persistent Node.js
/// interpreter (`Op::Node`). 5: CBOR in place of postcard, so that fields
/// and operations can be added without a new version (see "Versions").
pub const PROTOCOL_VERSION: u16 = 5;
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
    Decode(String),
    /// A request whose id decodes but whose operation this side does not
    /// know (a newer peer's), or one the peer's version lacks: answered
    /// for `id` with [`AgentError::Unsupported`].
    #[error("request {id}: {reason}")]
    UnknownOp {
        /// The request's id.
        id: u64,
        /// Why (the operation's name when it is known).
        reason: String,
    },
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

/// Encodes `msg` as a whole frame (length, version, body) of the current
/// version ([`PROTOCOL_VERSION`], CBOR).
///
/// Errors: [`ProtocolError::Encode`], [`ProtocolError::FrameTooLarge`] for a
/// body over [`MAX_FRAME_BYTES`].
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtocolError> {
    let mut out = frame_start(PROTOCOL_VERSION);
    ciborium::into_writer(msg, &mut out).map_err(|e| ProtocolError::Encode(e.to_string()))?;
    frame_end(out)
}

/// A frame's length prefix (filled in by [`frame_end`]) and `version`.
fn frame_start(version: u16) -> Vec<u8> {
    let mut out = vec![0u8; LENGTH_BYTES];
    out.extend_from_slice(&version.to_le_bytes());
    out
}

/// Checks the body's size and writes the length prefix.
fn frame_end(mut out: Vec<u8>) -> Result<Vec<u8>, ProtocolError> {
    let body = out.len() - LENGTH_BYTES;
    if body > MAX_FRAME_BYTES {
        return Err(ProtocolError::FrameTooLarge { len: body as u64, max: MAX_FRAME_BYTES });
    }
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

/// The version field of a frame body.
///
/// Errors: [`ProtocolError::FrameTooShort`].
pub fn body_version(body: &[u8]) -> Result<u16, ProtocolError> {
    match body {
        [a, b, ..] => Ok(u16::from_le_bytes([*a, *b])),
        _ => Err(ProtocolError::FrameTooShort(body.len())),
    }
}

/// Decodes a frame body (version + message) of the current version.
///
/// Errors: [`ProtocolError::FrameTooShort`], [`ProtocolError::VersionMismatch`],
/// [`ProtocolError::Decode`].
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ProtocolError> {
    let theirs = body_version(body)?;
    if theirs != PROTOCOL_VERSION {
        return Err(ProtocolError::VersionMismatch { ours: PROTOCOL_VERSION, theirs });
    }
    cbor(&body[VERSION_BYTES..])
}

/// Decodes one CBOR message (nesting at most 256 deep, ciborium's limit;
/// byte and text strings grow with the input, never by a declared length).
fn cbor<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ProtocolError> {
    ciborium::from_reader(bytes).map_err(|e| ProtocolError::Decode(e.to_string()))
}

/// A protocol version one connection speaks: chosen by the host when it
/// connects (see "Versions"), by the agent from each request's frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    /// Version 5 ([`PROTOCOL_VERSION`]): CBOR, tolerant of added fields
    /// and operations.
    V5,
    /// Version 4: postcard with the frozen types of [`v4`], for an agent
    /// of the release before (a sandbox or template it made) or a host
    /// rolled back to it.
    V4,
}

impl Wire {
    /// The versions this crate speaks, newest first.
    pub const ALL: [Wire; 2] = [Wire::V5, Wire::V4];

    /// The version number in this wire's frames.
    pub fn version(self) -> u16 {
        match self {
            Wire::V5 => PROTOCOL_VERSION,
            Wire::V4 => v4::VERSION,
        }
    }

    /// The wire of a version number, if this crate speaks it.
    pub fn of_version(version: u16) -> Option<Wire> {
        Wire::ALL.into_iter().find(|w| w.version() == version)
    }

    /// Encodes a request as a whole frame.
    ///
    /// Errors: [`ProtocolError::UnknownOp`] for an operation this version
    /// lacks (nothing is sent), and those of [`encode`].
    pub fn encode_request(self, req: &Request) -> Result<Vec<u8>, ProtocolError> {
        match self {
            Wire::V5 => encode(req),
            Wire::V4 => {
                let old = v4::to_v4_request(req)?;
                postcard_frame(&old)
            }
        }
    }

    /// Decodes a request frame's body. An operation this side does not
    /// know is [`ProtocolError::UnknownOp`] with the request's id, to be
    /// answered.
    ///
    /// Errors: [`ProtocolError::FrameTooShort`],
    /// [`ProtocolError::VersionMismatch`], [`ProtocolError::Decode`] (no
    /// id could be read), [`ProtocolError::UnknownOp`].
    pub fn decode_request(self, body: &[u8]) -> Result<Request, ProtocolError> {
        self.check(body)?;
        match self {
            Wire::V5 => {
                let raw: RawRequest = cbor(&body[VERSION_BYTES..])?;
                raw.op.deserialized().map(|op| Request { id: raw.id, op }).map_err(|e| ProtocolError::UnknownOp {
                    id: raw.id,
                    reason: format!(
                        "this agent (protocol version {PROTOCOL_VERSION}) does not know the operation: {e}"
                    ),
                })
            }
            Wire::V4 => {
                let old: v4::Request = postcard_body(body)?;
                v4::from_v4_request(&old)
            }
        }
    }

    /// Encodes a response as a whole frame. A reply this version lacks is
    /// sent as [`AgentError::Unsupported`] for the same id.
    ///
    /// Errors: those of [`encode`].
    pub fn encode_response(self, resp: &Response) -> Result<Vec<u8>, ProtocolError> {
        match self {
            Wire::V5 => encode(resp),
            Wire::V4 => {
                let old = v4::to_v4_response(resp);
                postcard_frame(&old)
            }
        }
    }

    /// Decodes a response frame's body.
    ///
    /// Errors: [`ProtocolError::FrameTooShort`],
    /// [`ProtocolError::VersionMismatch`], [`ProtocolError::Decode`]
    /// (a reply of a kind this side does not know included).
    pub fn decode_response(self, body: &[u8]) -> Result<Response, ProtocolError> {
        self.check(body)?;
        match self {
            Wire::V5 => cbor(&body[VERSION_BYTES..]),
            Wire::V4 => {
                let old: v4::Response = postcard_body(body)?;
                v4::from_v4_response(&old)
            }
        }
    }

    /// Checks that `body` is a frame of this wire's version.
    fn check(self, body: &[u8]) -> Result<(), ProtocolError> {
        let theirs = body_version(body)?;
        if theirs != self.version() {
            return Err(ProtocolError::VersionMismatch { ours: self.version(), theirs });
        }
        Ok(())
    }
}

/// A whole version 4 frame of `msg` (postcard).
fn postcard_frame<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtocolError> {
    let out = postcard::to_extend(msg, frame_start(v4::VERSION)).map_err(|e| ProtocolError::Encode(e.to_string()))?;
    frame_end(out)
}

/// The version 4 message (postcard) of a frame body already checked.
fn postcard_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ProtocolError> {
    postcard::from_bytes(&body[VERSION_BYTES..]).map_err(|e| ProtocolError::Decode(e.to_string()))
}

/// A version 5 request with its operation not yet decoded, so that an
/// unknown operation still gives the id to answer.
#[derive(serde::Deserialize)]
struct RawRequest {
    id: u64,
    op: ciborium::Value,
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
