//! The name a connection's first bytes carry: the TLS ClientHello's SNI
//! (RFC 6066 §3) or the HTTP/1.x `Host` header (RFC 9112 §3.2).
//!
//! STUB: the policy helper fills in the logic (see /work/wt/DESIGN-15.md).

/// What the first bytes of a connection say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sniffed {
    /// A name was found (lower-case, without port).
    Name(String),
    /// The bytes are TLS or HTTP but incomplete: wait for more (up to
    /// [`MAX_SNIFF_BYTES`]).
    NeedMore,
    /// Not TLS/HTTP, or no name in it.
    NoName,
}

/// Bytes looked at, at most; past this the connection counts as `NoName`.
pub const MAX_SNIFF_BYTES: usize = 16 * 1024;

/// Looks at a connection's first bytes.
pub fn sniff(_first: &[u8]) -> Sniffed {
    todo!("policy helper")
}
