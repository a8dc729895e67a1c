//! Scrubbing responses: a secret's value never reaches the guest.
//!
//! The broker swaps a placeholder for a secret's value on the way out
//! ([`crate::swap`]); a host may send the value back (an echo service
//! such as httpbin's `/headers`, CORS reflection, an error page saying
//! `Incorrect API key: sk-...`). So on every brokered connection of a
//! sandbox with bindings, each occurrence of a bound secret's value in a
//! response — status reason, header values, body, trailers, WebSocket
//! messages — is replaced by its placeholder, in each of the forms a
//! response may carry it ([`forms`]): raw, percent-encoded, JSON-escaped,
//! hex, base64 (standard and URL-safe, also inside a longer base64 string
//! at each of the three byte offsets) and, where the request's
//! `Authorization: Basic` named a user, base64 of `user:value`.
//!
//! - Bodies are scrubbed as they stream ([`Scrubber`]): a window of the
//!   longest form's length less one byte is held back between chunks, so
//!   a value split across chunks (HTTP/1.1 chunks, HTTP/2 DATA frames,
//!   TCP segments) is still found; the scrubber works on body frames, so
//!   content-length, chunked (with trailers) and HTTP/2 bodies alike.
//!   Replacing changes the length: `Content-Length` (and digests of the
//!   body) are dropped and hyper frames the body (chunked, or HTTP/2
//!   DATA frames).
//! - The guest's `Accept-Encoding` is narrowed to the codings the broker
//!   decodes (gzip, deflate, br, zstd; `identity` if none is left), the
//!   body is decoded before it is scrubbed and sent to the guest
//!   identity-encoded, without `Content-Encoding`; a body in any other
//!   coding is refused (502) rather than passed on unread.
//! - `Range`/`If-Range` are taken off requests, so the host answers the
//!   whole representation (RFC 9110 §14.2 lets a server ignore `Range`):
//!   a range could cut a value at its edge, where no form of it matches,
//!   and a scrubbed `206` would not fit its `Content-Range`.
//! - WebSocket (RFC 6455): the guest's `Sec-WebSocket-Extensions` is
//!   dropped (no permessage-deflate), the host's frames are parsed and
//!   each message's payload scrubbed as it streams, sent on as fragments
//!   of the same message; a frame with RSV bits or a bad opcode ends the
//!   connection. Other upgrades (opaque bytes) are refused (502).
//!
//! Every find is logged ([`BrokerEvent::EchoScrubbed`], once per response
//! or message and secret; never the value).

use std::io::Write;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use aho_corasick::{AhoCorasick, MatchKind};
use base64::Engine;
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame};
use hyper::header::{HeaderMap, HeaderValue, ACCEPT_ENCODING, AUTHORIZATION, CONTENT_ENCODING, CONTENT_LENGTH};
use hyper::http::request::Parts;
use hyper::{Response, StatusCode};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::swap::Binding;
use crate::{BrokerEvent, FlowHooks};

/// A response body as the guest gets it.
pub(crate) type Body = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// Encoded forms shorter than this (bytes) are not looked for (the raw
/// value always is): a short base64 middle or hex string would match
/// unrelated text.
pub const MIN_FORM: usize = 4;

/// The content codings the broker decodes (RFC 9110 §8.4.1; `x-gzip` is
/// read as `gzip`).
pub const CODINGS: [&str; 4] = ["gzip", "deflate", "br", "zstd"];

/// The most bytes of a WebSocket frame's payload read at once.
const WS_READ: usize = 16 * 1024;

/// Errors of scrubbing.
#[derive(Debug, thiserror::Error)]
pub enum ScrubError {
    /// The response's content coding is not one of [`CODINGS`].
    #[error("the response's content coding {0:?} cannot be decoded, so it cannot be scrubbed of secrets")]
    Encoding(String),
    /// An upgrade to another protocol than WebSocket.
    #[error("an upgrade to {0:?} cannot be scrubbed of secrets (WebSocket can)")]
    Upgrade(String),
    /// The needles do not make an automaton (too many or too long).
    #[error("the scrubber's patterns: {0}")]
    Patterns(#[from] aho_corasick::BuildError),
    /// A body that does not decode as its `Content-Encoding` says.
    #[error("decoding the response body ({coding}): {source}")]
    Decode {
        /// The coding.
        coding: &'static str,
        /// What failed.
        source: std::io::Error,
    },
    /// A WebSocket frame the broker cannot pass scrubbed.
    #[error("WebSocket: {0}")]
    WebSocket(&'static str),
    /// Reading or writing a WebSocket side.
    #[error("WebSocket: {0}")]
    Io(#[from] std::io::Error),
}

/// Percent-encodes `bytes` (upper or lower case hex), leaving ASCII
/// alphanumerics and the bytes of `keep` as they are.
fn percent(bytes: &[u8], keep: &[u8], upper: bool, plus: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() * 3);
    for &b in bytes {
        if b.is_ascii_alphanumeric() || keep.contains(&b) {
            out.push(b);
        } else if plus && b == b' ' {
            out.push(b'+');
        } else if upper {
            out.extend_from_slice(format!("%{b:02X}").as_bytes());
        } else {
            out.extend_from_slice(format!("%{b:02x}").as_bytes());
        }
    }
    out
}

/// How [`json`] escapes beyond what JSON requires.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Json {
    /// `"`, `\` and control characters only (serde_json, JavaScript).
    Plain,
    /// Also `/` as `\/` (PHP).
    Slash,
    /// Also `<`, `>`, `&`, U+2028, U+2029 as `\u` (Go's encoding/json).
    Html,
    /// Also every non-ASCII character as `\u` (UTF-16; Python's json).
    Ascii,
}

/// `bytes` as the inside of a JSON string (RFC 8259 §7).
fn json(bytes: &[u8], how: Json) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() + 8);
    let u = |out: &mut Vec<u8>, c: u32| out.extend_from_slice(format!("\\u{c:04x}").as_bytes());
    let text = std::str::from_utf8(bytes).ok();
    if how == Json::Ascii || how == Json::Html {
        let Some(text) = text else { return bytes.to_vec() };
        for c in text.chars() {
            match c {
                '"' => out.extend_from_slice(b"\\\""),
                '\\' => out.extend_from_slice(b"\\\\"),
                '\n' => out.extend_from_slice(b"\\n"),
                '\r' => out.extend_from_slice(b"\\r"),
                '\t' => out.extend_from_slice(b"\\t"),
                c if (c as u32) < 0x20 => u(&mut out, c as u32),
                '<' | '>' | '&' | '\u{2028}' | '\u{2029}' if how == Json::Html => u(&mut out, c as u32),
                c if !c.is_ascii() && how == Json::Ascii => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        u(&mut out, u32::from(*unit));
                    }
                }
                c => {
                    let mut b = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
                }
            }
        }
        return out;
    }
    for &b in bytes {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'/' if how == Json::Slash => out.extend_from_slice(b"\\/"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            b if b < 0x20 => u(&mut out, u32::from(b)),
            b => out.push(b),
        }
    }
    out
}

/// The base64 characters of `bytes` that do not depend on what is around
/// it when it starts `offset` (0, 1, 2) bytes into a 3-byte group of a
/// longer base64 string: the characters whose 6 bits all fall inside it.
fn base64_middle(engine: &base64::engine::GeneralPurpose, bytes: &[u8], offset: usize) -> Vec<u8> {
    let mut padded = vec![0u8; offset];
    padded.extend_from_slice(bytes);
    let all = engine.encode(&padded).into_bytes();
    let first = (8 * offset).div_ceil(6);
    let end = (8 * (offset + bytes.len())) / 6;
    all.get(first..end).map(<[u8]>::to_vec).unwrap_or_default()
}

/// The forms a response may carry `bytes` in, each named, in a fixed
/// order (so a value's and its placeholder's forms pair up by index):
/// raw; percent-encoded (RFC 3986 upper and lower case hex,
/// `encodeURIComponent`, form encoding with `+`); JSON-escaped (plain,
/// `\/`, Go's HTML-safe, ASCII-only); hex (lower, upper); base64
/// (RFC 4648 §4 padded whole, and the stable middle at offsets 0, 1, 2;
/// the same in the URL-safe alphabet, §5).
pub fn forms(bytes: &[u8]) -> Vec<(&'static str, Vec<u8>)> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    let unreserved = b"-._~";
    let hex = |upper: bool| -> Vec<u8> {
        bytes.iter().flat_map(|b| if upper { format!("{b:02X}") } else { format!("{b:02x}") }.into_bytes()).collect()
    };
    vec![
        ("raw", bytes.to_vec()),
        ("percent", percent(bytes, unreserved, true, false)),
        ("percent-lower", percent(bytes, unreserved, false, false)),
        ("percent-component", percent(bytes, b"-._~!'()*", true, false)),
        ("form", percent(bytes, b"*-._", true, true)),
        ("json", json(bytes, Json::Plain)),
        ("json-slash", json(bytes, Json::Slash)),
        ("json-html", json(bytes, Json::Html)),
        ("json-ascii", json(bytes, Json::Ascii)),
        ("hex", hex(false)),
        ("hex-upper", hex(true)),
        ("base64", STANDARD.encode(bytes).into_bytes()),
        ("base64-0", base64_middle(&STANDARD_NO_PAD, bytes, 0)),
        ("base64-1", base64_middle(&STANDARD_NO_PAD, bytes, 1)),
        ("base64-2", base64_middle(&STANDARD_NO_PAD, bytes, 2)),
        ("base64url", URL_SAFE.encode(bytes).into_bytes()),
        ("base64url-0", base64_middle(&URL_SAFE_NO_PAD, bytes, 0)),
        ("base64url-1", base64_middle(&URL_SAFE_NO_PAD, bytes, 1)),
        ("base64url-2", base64_middle(&URL_SAFE_NO_PAD, bytes, 2)),
    ]
}

/// What a sandbox's responses are scrubbed of: every form of every bound
/// value, each with its placeholder's same form.
pub struct Needles {
    ac: AhoCorasick,
    with: Vec<Vec<u8>>,
    /// The secret (index into `names`) of each needle.
    secret: Vec<usize>,
    names: Vec<String>,
    /// The longest needle (bytes).
    longest: usize,
}

impl std::fmt::Debug for Needles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Needles").field("secrets", &self.names).field("needles", &self.with.len()).finish()
    }
}

impl Needles {
    /// The needles of `bindings` and, for each `(i, user)` of `users`,
    /// of `user:value` of `bindings[i]` (HTTP Basic, RFC 7617); `None`
    /// if there is nothing to look for.
    ///
    /// Errors: [`ScrubError::Patterns`].
    pub fn new(bindings: &[Arc<Binding>], users: &[(usize, Vec<u8>)]) -> Result<Option<Self>, ScrubError> {
        let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut secret = Vec::new();
        let mut names: Vec<String> = Vec::new();
        let mut add = |value: &[u8], placeholder: &[u8], name: &str| {
            if value.is_empty() || value == placeholder {
                return;
            }
            let index = names.iter().position(|n| n == name).unwrap_or_else(|| {
                names.push(name.to_string());
                names.len() - 1
            });
            for ((form, v), (_, p)) in forms(value).into_iter().zip(forms(placeholder)) {
                if (form != "raw" && v.len() < MIN_FORM) || pairs.iter().any(|(n, _)| *n == v) {
                    continue;
                }
                pairs.push((v, p));
                secret.push(index);
            }
        };
        for b in bindings {
            add(b.value.expose(), b.placeholder.as_bytes(), &b.secret);
        }
        for (i, user) in users {
            let Some(b) = bindings.get(*i) else { continue };
            let mut value = user.clone();
            value.push(b':');
            let mut placeholder = value.clone();
            value.extend_from_slice(b.value.expose());
            placeholder.extend_from_slice(b.placeholder.as_bytes());
            add(&value, &placeholder, &b.secret);
        }
        if pairs.is_empty() {
            return Ok(None);
        }
        let longest = pairs.iter().map(|(n, _)| n.len()).max().unwrap_or(1);
        let ac = AhoCorasick::builder().match_kind(MatchKind::LeftmostLongest).build(pairs.iter().map(|(n, _)| n))?;
        Ok(Some(Needles { ac, with: pairs.into_iter().map(|(_, p)| p).collect(), secret, names, longest }))
    }

    /// The carry-over window a [`Scrubber`] holds back (bytes): the
    /// longest needle less one.
    pub fn window(&self) -> usize {
        self.longest - 1
    }

    /// `bytes` scrubbed whole; `None` if nothing was found. Also marks
    /// the secrets found in `found` (by index of [`Needles::names`]).
    fn scrub(&self, bytes: &[u8], found: &mut [bool]) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        let (consumed, hit) = self.run(bytes, bytes.len(), &mut out, found);
        out.extend_from_slice(&bytes[consumed..]);
        hit.then_some(out)
    }

    /// Writes `buf` to `out` with each match that starts before `limit`
    /// replaced; returns how far `buf` was consumed (at least `limit`
    /// unless a match ran past it; the rest is for the next round) and
    /// whether anything matched.
    fn run(&self, buf: &[u8], limit: usize, out: &mut Vec<u8>, found: &mut [bool]) -> (usize, bool) {
        let mut pos = 0;
        let mut hit = false;
        for m in self.ac.find_iter(buf) {
            if m.start() >= limit {
                break;
            }
            out.extend_from_slice(&buf[pos..m.start()]);
            out.extend_from_slice(&self.with[m.pattern().as_usize()]);
            if let Some(f) = found.get_mut(self.secret[m.pattern().as_usize()]) {
                *f = true;
            }
            pos = m.end();
            hit = true;
        }
        let upto = pos.max(limit.min(buf.len()));
        out.extend_from_slice(&buf[pos..upto]);
        (upto, hit)
    }

    /// The secrets' names (what [`Scrubber::take_found`] reports).
    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// A stream's scrubber: feed it chunks ([`Scrubber::push`]), then
/// [`Scrubber::finish`]. It holds back at most [`Needles::window`] bytes,
/// so a needle split across chunks at any byte is found.
#[derive(Debug)]
pub struct Scrubber {
    needles: Arc<Needles>,
    carry: Vec<u8>,
    found: Vec<bool>,
    reported: Vec<bool>,
}

impl Scrubber {
    /// A scrubber of `needles`.
    pub fn new(needles: Arc<Needles>) -> Self {
        let n = needles.names.len();
        Scrubber { needles, carry: Vec::new(), found: vec![false; n], reported: vec![false; n] }
    }

    /// The next chunk: what may go on now (its bytes and the carry's,
    /// scrubbed, less a new carry).
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        self.carry.extend_from_slice(chunk);
        let buf = std::mem::take(&mut self.carry);
        // A needle starting before `limit` lies whole in `buf`.
        let limit = buf.len().saturating_sub(self.needles.window());
        let mut out = Vec::with_capacity(buf.len());
        let (consumed, _) = self.needles.run(&buf, limit, &mut out, &mut self.found);
        self.carry = buf[consumed..].to_vec();
        out
    }

    /// The end of the stream: the carry, scrubbed.
    pub fn finish(&mut self) -> Vec<u8> {
        let buf = std::mem::take(&mut self.carry);
        self.needles.scrub(&buf, &mut self.found).unwrap_or(buf)
    }

    /// Scrubs `bytes` whole (a header value) with this scrubber's
    /// record of finds; `None` if nothing was found.
    fn whole(&mut self, bytes: &[u8]) -> Option<Vec<u8>> {
        self.needles.scrub(bytes, &mut self.found)
    }

    /// The secrets (names) found since the last call.
    pub fn take_found(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, (f, r)) in self.found.iter().zip(self.reported.iter_mut()).enumerate() {
            if *f && !*r {
                *r = true;
                out.push(self.needles.names[i].clone());
            }
        }
        out
    }
}

/// Where a scrub's finds are logged.
#[derive(Clone)]
pub(crate) struct Report {
    hooks: Arc<dyn FlowHooks>,
    host: String,
    path: String,
}

impl Report {
    fn found(&self, scrubber: &mut Scrubber) {
        let secrets = scrubber.take_found();
        if !secrets.is_empty() {
            tracing::debug!(host = %self.host, path = %self.path, ?secrets, "broker: a secret's value echoed back was scrubbed");
            self.hooks.event(BrokerEvent::EchoScrubbed { host: self.host.clone(), path: self.path.clone(), secrets });
        }
    }
}

/// One request's scrub: the needles of the sandbox's bindings at the
/// time of the request.
pub(crate) struct Scrub {
    needles: Arc<Needles>,
    report: Report,
    /// A `HEAD` request (its response has no body).
    head: bool,
}

/// Prepares the scrub of the response to a request (`parts`, already
/// swapped) to `host` at `path`: narrows `Accept-Encoding`, drops
/// `Range`/`If-Range` and `Sec-WebSocket-Extensions`, learns Basic users.
/// `None` if there is nothing to scrub (no bindings).
///
/// Errors: [`ScrubError::Upgrade`] (an upgrade to another protocol than
/// WebSocket), [`ScrubError::Patterns`].
pub(crate) fn request(
    parts: &mut Parts,
    bindings: &[Arc<Binding>],
    hooks: &Arc<dyn FlowHooks>,
    host: &str,
    path: &str,
) -> Result<Option<Scrub>, ScrubError> {
    if let Some(up) = parts.headers.get(hyper::header::UPGRADE) {
        let text = String::from_utf8_lossy(up.as_bytes()).to_string();
        if !text.split(',').any(|p| p.trim().split('/').next().is_some_and(|n| n.eq_ignore_ascii_case("websocket"))) {
            if bindings.is_empty() {
                return Ok(None);
            }
            return Err(ScrubError::Upgrade(text.chars().take(40).collect()));
        }
    }
    let users = basic_users(&parts.headers, bindings);
    let Some(needles) = Needles::new(bindings, &users)? else { return Ok(None) };
    let accept = accept_encoding(parts.headers.get(ACCEPT_ENCODING));
    parts.headers.insert(ACCEPT_ENCODING, accept);
    parts.headers.remove(hyper::header::RANGE);
    parts.headers.remove(hyper::header::IF_RANGE);
    parts.headers.remove(hyper::header::SEC_WEBSOCKET_EXTENSIONS);
    Ok(Some(Scrub {
        needles: Arc::new(needles),
        report: Report { hooks: hooks.clone(), host: host.to_string(), path: path.to_string() },
        head: parts.method == hyper::Method::HEAD,
    }))
}

/// The users of `Authorization: Basic` values (RFC 7617) whose password
/// is a binding's value (by index of `bindings`).
fn basic_users(headers: &HeaderMap, bindings: &[Arc<Binding>]) -> Vec<(usize, Vec<u8>)> {
    let mut out = Vec::new();
    for v in headers.get_all(AUTHORIZATION).iter().chain(headers.get_all(hyper::header::PROXY_AUTHORIZATION)) {
        let v = v.as_bytes();
        let Some(b64) = v.get(..6).filter(|p| p.eq_ignore_ascii_case(b"basic ")).map(|_| &v[6..]) else { continue };
        let Ok(plain) = base64::engine::general_purpose::STANDARD.decode(b64.trim_ascii()) else { continue };
        let Some(colon) = plain.iter().position(|&b| b == b':') else { continue };
        let (user, pass) = (&plain[..colon], &plain[colon + 1..]);
        for (i, b) in bindings.iter().enumerate() {
            if b.value.expose() == pass && !out.iter().any(|(j, u): &(usize, Vec<u8>)| *j == i && u == user) {
                out.push((i, user.to_vec()));
            }
        }
    }
    out
}

/// The guest's `Accept-Encoding` narrowed to [`CODINGS`] (those it
/// accepts, `q=0` refused, `*` all of them); `identity` if none is left
/// or it sent none.
fn accept_encoding(guest: Option<&HeaderValue>) -> HeaderValue {
    let mut keep: Vec<&str> = Vec::new();
    let text = guest.and_then(|v| v.to_str().ok()).unwrap_or_default();
    for item in text.split(',') {
        let mut it = item.split(';');
        let coding = it.next().unwrap_or_default().trim().to_ascii_lowercase();
        let refused = it.any(|p| {
            let p = p.trim();
            let q = p.strip_prefix("q=").or_else(|| p.strip_prefix("Q="));
            q.is_some_and(|q| q.trim().parse::<f32>().is_ok_and(|q| q <= 0.0))
        });
        if refused {
            continue;
        }
        let coding = if coding == "x-gzip" { "gzip".to_string() } else { coding };
        for c in CODINGS {
            if (coding == "*" || coding == c) && !keep.contains(&c) {
                keep.push(c);
            }
        }
    }
    if keep.is_empty() {
        HeaderValue::from_static("identity")
    } else {
        HeaderValue::from_str(&keep.join(", ")).unwrap_or(HeaderValue::from_static("identity"))
    }
}

/// A response passed on as it is (no bindings).
fn pass<B>(resp: Response<B>) -> Response<Body>
where
    B: HttpBody<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    resp.map(|b| b.map_err(Into::into).boxed())
}

/// The response as the guest gets it: with `scrub`, its reason phrase,
/// headers and (decoded) body scrubbed; without, as it came.
///
/// Errors: [`ScrubError::Encoding`]: a body in a coding the broker does
/// not decode (answer 502).
pub(crate) fn response<B>(scrub: Option<&Scrub>, resp: Response<B>) -> Result<Response<Body>, ScrubError>
where
    B: HttpBody<Data = Bytes> + Send + Sync + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let Some(scrub) = scrub else { return Ok(pass(resp)) };
    let (mut parts, body) = resp.into_parts();
    let mut scrubber = Scrubber::new(scrub.needles.clone());
    // hyper sends a reason phrase on as the host wrote it.
    let reason = parts.extensions.get::<hyper::ext::ReasonPhrase>().and_then(|r| scrubber.whole(r.as_bytes()));
    if let Some(new) = reason {
        match hyper::ext::ReasonPhrase::try_from(new) {
            Ok(r) => {
                parts.extensions.insert(r);
            }
            Err(_) => {
                parts.extensions.remove::<hyper::ext::ReasonPhrase>();
            }
        }
    }
    scrub_headers(&mut parts.headers, &mut scrubber);
    scrub.report.found(&mut scrubber);
    let status = parts.status;
    let bodyless = scrub.head
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    if bodyless {
        return Ok(pass(Response::from_parts(parts, body)));
    }
    let mut decoders = Vec::new();
    for v in parts.headers.get_all(CONTENT_ENCODING) {
        let text = String::from_utf8_lossy(v.as_bytes()).to_ascii_lowercase();
        for coding in text.split(',').map(str::trim).filter(|c| !c.is_empty() && *c != "identity") {
            decoders.push(Decoder::new(coding)?);
        }
    }
    // Applied last, decoded first.
    decoders.reverse();
    parts.headers.remove(CONTENT_ENCODING);
    parts.headers.remove(CONTENT_LENGTH);
    for digest in ["content-md5", "content-digest", "repr-digest"] {
        parts.headers.remove(digest);
    }
    let body = ScrubBody { inner: body, decoders, scrubber, report: scrub.report.clone(), trailers: None, done: false };
    Ok(Response::from_parts(parts, body.boxed()))
}

/// Scrubs every value of `headers` (a header whose scrubbed value is not
/// a header value any more is dropped).
fn scrub_headers(headers: &mut HeaderMap, scrubber: &mut Scrubber) {
    let names: Vec<_> = headers.keys().cloned().collect();
    for name in names {
        let values: Vec<HeaderValue> = headers.get_all(&name).iter().cloned().collect();
        let mut changed = false;
        let mut new = Vec::with_capacity(values.len());
        for v in values {
            match scrubber.whole(v.as_bytes()) {
                Some(s) => {
                    changed = true;
                    if let Ok(hv) = HeaderValue::from_bytes(&s) {
                        new.push(hv);
                    }
                }
                None => new.push(v),
            }
        }
        if changed {
            headers.remove(&name);
            for v in new {
                headers.append(name.clone(), v);
            }
        }
    }
}

/// A content coding's decoder, fed chunk by chunk.
enum Decoder {
    Gzip(flate2::write::MultiGzDecoder<Vec<u8>>),
    /// `deflate` is zlib (RFC 9110 §8.4.1.2), though some servers send
    /// raw deflate: told apart by the first two bytes.
    DeflateStart(Vec<u8>),
    Zlib(flate2::write::ZlibDecoder<Vec<u8>>),
    RawDeflate(flate2::write::DeflateDecoder<Vec<u8>>),
    Br(Option<Box<brotli_decompressor::DecompressorWriter<Vec<u8>>>>),
    Zstd(Box<zstd::stream::write::Decoder<'static, Vec<u8>>>),
}

impl Decoder {
    /// The decoder of `coding` (lower case).
    ///
    /// Errors: [`ScrubError::Encoding`].
    fn new(coding: &str) -> Result<Self, ScrubError> {
        Ok(match coding {
            "gzip" | "x-gzip" => Decoder::Gzip(flate2::write::MultiGzDecoder::new(Vec::new())),
            "deflate" => Decoder::DeflateStart(Vec::new()),
            "br" => Decoder::Br(Some(Box::new(brotli_decompressor::DecompressorWriter::new(Vec::new(), 4096)))),
            "zstd" => Decoder::Zstd(Box::new(
                zstd::stream::write::Decoder::new(Vec::new()).map_err(|_| ScrubError::Encoding(coding.into()))?,
            )),
            other => return Err(ScrubError::Encoding(other.chars().take(40).collect())),
        })
    }

    fn name(&self) -> &'static str {
        match self {
            Decoder::Gzip(_) => "gzip",
            Decoder::DeflateStart(_) | Decoder::Zlib(_) | Decoder::RawDeflate(_) => "deflate",
            Decoder::Br(_) => "br",
            Decoder::Zstd(_) => "zstd",
        }
    }

    /// Decodes `input`; with `last`, also ends the stream. Returns what
    /// came out.
    fn feed(&mut self, input: &[u8], last: bool) -> std::io::Result<Vec<u8>> {
        fn step<W: Write>(
            w: &mut W,
            input: &[u8],
            out: impl FnOnce(&mut W) -> &mut Vec<u8>,
        ) -> std::io::Result<Vec<u8>> {
            w.write_all(input)?;
            w.flush()?;
            Ok(std::mem::take(out(w)))
        }
        if let Decoder::DeflateStart(held) = self {
            held.extend_from_slice(input);
            if held.len() < 2 && !last {
                return Ok(Vec::new());
            }
            let held = std::mem::take(held);
            // RFC 1950 §2.2: CM 8 and the check bits.
            let zlib =
                held.len() >= 2 && held[0] & 0x0f == 8 && ((u16::from(held[0]) << 8) | u16::from(held[1])) % 31 == 0;
            *self = if zlib {
                Decoder::Zlib(flate2::write::ZlibDecoder::new(Vec::new()))
            } else {
                Decoder::RawDeflate(flate2::write::DeflateDecoder::new(Vec::new()))
            };
            return self.feed(&held, last);
        }
        let mut out = match self {
            Decoder::Gzip(d) => step(d, input, |d| d.get_mut())?,
            Decoder::Zlib(d) => step(d, input, |d| d.get_mut())?,
            Decoder::RawDeflate(d) => step(d, input, |d| d.get_mut())?,
            Decoder::Br(Some(d)) => step(d.as_mut(), input, |d| d.get_mut())?,
            Decoder::Br(None) => Vec::new(),
            Decoder::Zstd(d) => step(d.as_mut(), input, |d| d.get_mut())?,
            Decoder::DeflateStart(_) => Vec::new(),
        };
        if last {
            match self {
                Decoder::Gzip(d) => {
                    d.try_finish()?;
                    out.append(d.get_mut());
                }
                Decoder::Zlib(d) => {
                    d.try_finish()?;
                    out.append(d.get_mut());
                }
                Decoder::RawDeflate(d) => {
                    d.try_finish()?;
                    out.append(d.get_mut());
                }
                Decoder::Br(d) => {
                    if let Some(d) = d.take() {
                        let mut rest = d.into_inner().map_err(|_| {
                            std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the brotli stream is cut short")
                        })?;
                        out.append(&mut rest);
                    }
                }
                Decoder::Zstd(d) => {
                    d.flush()?;
                    out.append(d.get_mut());
                }
                Decoder::DeflateStart(_) => {}
            }
        }
        Ok(out)
    }
}

/// A response body decoded and scrubbed frame by frame.
struct ScrubBody<B> {
    inner: B,
    decoders: Vec<Decoder>,
    scrubber: Scrubber,
    report: Report,
    /// Trailers held back while the last data goes out.
    trailers: Option<HeaderMap>,
    done: bool,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<B> ScrubBody<B> {
    /// `data` decoded (ending the codings with `last`).
    fn decode(&mut self, data: &[u8], last: bool) -> Result<Vec<u8>, BoxError> {
        let mut buf = data.to_vec();
        for d in &mut self.decoders {
            buf = d.feed(&buf, last).map_err(|source| ScrubError::Decode { coding: d.name(), source })?;
        }
        Ok(buf)
    }

    /// The end of the body: what the codings and the scrubber still hold.
    fn end(&mut self) -> Result<Vec<u8>, BoxError> {
        let plain = self.decode(&[], true)?;
        let mut out = self.scrubber.push(&plain);
        out.extend(self.scrubber.finish());
        self.report.found(&mut self.scrubber);
        self.done = true;
        Ok(out)
    }
}

impl<B> HttpBody for ScrubBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if let Some(t) = this.trailers.take() {
                return Poll::Ready(Some(Ok(Frame::trailers(t))));
            }
            if this.done {
                return Poll::Ready(None);
            }
            let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
                Poll::Ready(None) => {
                    let rest = match this.end() {
                        Ok(r) => r,
                        Err(e) => return Poll::Ready(Some(Err(e))),
                    };
                    if rest.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(rest)))));
                }
                Poll::Ready(Some(Ok(f))) => f,
            };
            match frame.into_data() {
                Ok(data) => {
                    let plain = match this.decode(&data, false) {
                        Ok(p) => p,
                        Err(e) => return Poll::Ready(Some(Err(e))),
                    };
                    let out = this.scrubber.push(&plain);
                    this.report.found(&mut this.scrubber);
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                    }
                }
                Err(frame) => {
                    let Ok(mut trailers) = frame.into_trailers() else { continue };
                    scrub_headers(&mut trailers, &mut this.scrubber);
                    let rest = match this.end() {
                        Ok(r) => r,
                        Err(e) => return Poll::Ready(Some(Err(e))),
                    };
                    if rest.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                    }
                    this.trailers = Some(trailers);
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(rest)))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.trailers.is_none()
    }
}

/// A WebSocket's scrub (what an upgraded connection needs of a
/// [`Scrub`]).
pub(crate) struct WebSocketScrub {
    needles: Arc<Needles>,
    report: Report,
}

impl Scrub {
    /// For the WebSocket this request upgrades to.
    pub(crate) fn websocket(&self) -> WebSocketScrub {
        WebSocketScrub { needles: self.needles.clone(), report: self.report.clone() }
    }
}

/// Joins an upgraded guest connection and its upstream: with `scrub`,
/// the host's WebSocket messages scrubbed on their way to the guest (the
/// guest's pass as they are); without, both ways as they are.
pub(crate) async fn splice<G, U>(scrub: Option<WebSocketScrub>, mut guest: G, mut up: U)
where
    G: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    let Some(scrub) = scrub else {
        let _ = tokio::io::copy_bidirectional(&mut guest, &mut up).await;
        return;
    };
    let (mut gr, mut gw) = tokio::io::split(guest);
    let (ur, mut uw) = tokio::io::split(up);
    let down = async {
        let r = websocket_down(&scrub, ur, &mut gw).await;
        let _ = gw.shutdown().await;
        r
    };
    let upward = async {
        let _ = tokio::io::copy(&mut gr, &mut uw).await;
        let _ = uw.shutdown().await;
    };
    tokio::pin!(down, upward);
    let r = tokio::select! {
        r = &mut down => r,
        () = &mut upward => down.await,
    };
    if let Err(e) = r {
        tracing::debug!(host = %scrub.report.host, "broker: WebSocket ended: {e}");
    }
}

/// Writes one unmasked frame (RFC 6455 §5.2).
async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, fin: bool, opcode: u8, payload: &[u8]) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(10);
    head.push(if fin { 0x80 } else { 0 } | opcode);
    match payload.len() {
        n if n < 126 => head.push(n as u8),
        n if n <= usize::from(u16::MAX) => {
            head.push(126);
            head.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            head.push(127);
            head.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    w.write_all(&head).await?;
    w.write_all(payload).await
}

/// The host's side of a WebSocket: frames read from `r`, each message's
/// payload scrubbed as it streams and written to `w` as fragments of the
/// same message; control frames scrubbed whole. Ends at the host's EOF.
///
/// Errors: [`ScrubError::WebSocket`] (RSV bits, a reserved opcode, a
/// control frame over 125 bytes or fragmented, a continuation outside a
/// message), [`ScrubError::Io`].
async fn websocket_down<R, W>(scrub: &WebSocketScrub, mut r: R, w: &mut W) -> Result<(), ScrubError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // The message in progress: its opcode, whether a fragment went out, its scrubber.
    let mut message: Option<(u8, bool, Scrubber)> = None;
    let mut buf = vec![0u8; WS_READ];
    loop {
        let mut h = [0u8; 2];
        match r.read_exact(&mut h).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let (fin, rsv, opcode, masked) = (h[0] & 0x80 != 0, h[0] & 0x70, h[0] & 0x0f, h[1] & 0x80 != 0);
        if rsv != 0 {
            return Err(ScrubError::WebSocket("a frame with RSV bits (an extension the broker did not let through)"));
        }
        let len: u64 = match h[1] & 0x7f {
            126 => u64::from(r.read_u16().await?),
            127 => r.read_u64().await?,
            n => u64::from(n),
        };
        let mut mask = [0u8; 4];
        if masked {
            r.read_exact(&mut mask).await?;
        }
        let mut at = 0usize;
        let mut unmask = |bytes: &mut [u8]| {
            if masked {
                for b in bytes {
                    *b ^= mask[at % 4];
                    at += 1;
                }
            }
        };
        if opcode >= 8 {
            if len > 125 || !fin || opcode > 10 {
                return Err(ScrubError::WebSocket("a bad control frame"));
            }
            let mut payload = vec![0u8; len as usize];
            r.read_exact(&mut payload).await?;
            unmask(&mut payload);
            let mut scrubber = Scrubber::new(scrub.needles.clone());
            let payload = if opcode == 8 && payload.len() > 2 {
                let mut p = payload[..2].to_vec();
                p.extend(scrubber.whole(&payload[2..]).unwrap_or_else(|| payload[2..].to_vec()));
                // A close reason that no longer fits goes.
                if p.len() > 125 {
                    p.truncate(2);
                }
                p
            } else {
                let p = scrubber.whole(&payload).unwrap_or(payload);
                if p.len() > 125 {
                    Vec::new()
                } else {
                    p
                }
            };
            scrub.report.found(&mut scrubber);
            write_frame(w, true, opcode, &payload).await?;
            w.flush().await?;
            continue;
        }
        match (opcode, &message) {
            (1 | 2, None) => message = Some((opcode, false, Scrubber::new(scrub.needles.clone()))),
            (0, Some(_)) => {}
            _ => return Err(ScrubError::WebSocket("a data frame out of order or with a reserved opcode")),
        }
        let Some((msg_opcode, sent, scrubber)) = message.as_mut() else { continue };
        let mut left = len;
        while left > 0 {
            let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
            r.read_exact(&mut buf[..n]).await?;
            unmask(&mut buf[..n]);
            left -= n as u64;
            let out = scrubber.push(&buf[..n]);
            if !out.is_empty() {
                write_frame(w, false, if *sent { 0 } else { *msg_opcode }, &out).await?;
                *sent = true;
            }
        }
        if fin {
            let out = scrubber.finish();
            write_frame(w, true, if *sent { 0 } else { *msg_opcode }, &out).await?;
            scrub.report.found(scrubber);
            message = None;
        }
        w.flush().await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swap::{HostPattern, SecretValue};

    const VALUE: &[u8] = b"sk-proj/Abc+123 \"q\"&x";
    const PLACEHOLDER: &str = "tine_placeholder_0123456789abcdef";

    fn needles(value: &[u8], users: &[(usize, Vec<u8>)]) -> Arc<Needles> {
        let b = Arc::new(Binding {
            secret: "api".into(),
            placeholder: PLACEHOLDER.into(),
            value: Arc::new(SecretValue::new(value.to_vec())),
            hosts: vec![HostPattern::parse("api.test").unwrap()],
            header: None,
            format: None,
            in_query: false,
            in_body: false,
            any_header: false,
        });
        Arc::new(Needles::new(&[b], users).unwrap().unwrap())
    }

    /// `text` pushed through a scrubber in the pieces `cuts` make.
    fn streamed(n: &Arc<Needles>, text: &[u8], cuts: &[usize]) -> (Vec<u8>, Vec<String>) {
        let mut s = Scrubber::new(n.clone());
        let mut out = Vec::new();
        let mut from = 0;
        for &c in cuts.iter().chain(std::iter::once(&text.len())) {
            out.extend(s.push(&text[from..c]));
            assert!(s.carry.len() <= n.window(), "the carry stays within the window");
            from = c;
        }
        out.extend(s.finish());
        (out, s.take_found())
    }

    #[test]
    fn every_form_split_at_every_offset_is_scrubbed() {
        let n = needles(VALUE, &[]);
        let ph = forms(PLACEHOLDER.as_bytes());
        for (i, (form, v)) in forms(VALUE).into_iter().enumerate() {
            if form.starts_with("base64") && form != "base64" && form != "base64url" {
                continue; // inside a longer string: below
            }
            let text = [b"before ".as_slice(), &v, b" after"].concat();
            let want = [b"before ".as_slice(), &ph[i].1, b" after"].concat();
            for cut in 0..=text.len() {
                let (out, found) = streamed(&n, &text, &[cut]);
                assert_eq!(out, want, "{form} cut at {cut}");
                assert_eq!(found, vec!["api"], "{form}");
            }
        }
        // Two cuts, one byte apart, anywhere.
        let text = [b"x".as_slice(), VALUE, b"y", VALUE].concat();
        for a in 0..text.len() {
            let (out, _) = streamed(&n, &text, &[a, a + 1]);
            assert_eq!(out, format!("x{PLACEHOLDER}y{PLACEHOLDER}").as_bytes(), "cuts at {a}, {}", a + 1);
        }
    }

    #[test]
    fn base64_inside_a_longer_string_is_scrubbed_at_every_offset() {
        use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
        let n = needles(VALUE, &[]);
        for prefix in ["", "a", "ab", "abc", "{\"k\":\"", "user:"] {
            for suffix in ["", "z", "zz", "\"}"] {
                let plain = [prefix.as_bytes(), VALUE, suffix.as_bytes()].concat();
                for encoded in [STANDARD.encode(&plain), URL_SAFE_NO_PAD.encode(&plain)] {
                    let text = format!("data: {encoded}\n");
                    for cut in 0..=text.len() {
                        let (out, found) = streamed(&n, text.as_bytes(), &[cut]);
                        assert_eq!(found, vec!["api"], "{prefix:?}+{suffix:?} {encoded} cut at {cut}");
                        // What is left decodes to no part of the value's bytes longer than two.
                        let out = String::from_utf8(out).unwrap();
                        let body = out.trim_start_matches("data: ").trim_end();
                        let decoded = STANDARD
                            .decode(body.trim_end_matches('='))
                            .or_else(|_| {
                                base64::engine::general_purpose::STANDARD_NO_PAD.decode(body.trim_end_matches('='))
                            })
                            .or_else(|_| URL_SAFE_NO_PAD.decode(body.trim_end_matches('=')))
                            .unwrap_or_default();
                        assert!(!swap_contains(&decoded, &VALUE[2..VALUE.len() - 2]), "{prefix:?} {body}");
                        assert!(!out.contains(&encoded), "{out}");
                    }
                }
            }
        }
    }

    fn swap_contains(hay: &[u8], needle: &[u8]) -> bool {
        crate::swap::contains(hay, needle)
    }

    #[test]
    fn a_basic_users_pair_becomes_the_placeholders() {
        use base64::engine::general_purpose::STANDARD;
        let n = needles(b"hunter2-long-password", &[(0, b"alice".to_vec())]);
        let text = format!("Authorization: Basic {}", STANDARD.encode("alice:hunter2-long-password"));
        let (out, found) = streamed(&n, text.as_bytes(), &[25]);
        let want = format!("Authorization: Basic {}", STANDARD.encode(format!("alice:{PLACEHOLDER}")));
        assert_eq!(String::from_utf8(out).unwrap(), want, "decodes to alice:placeholder");
        assert_eq!(found, vec!["api"]);
    }

    #[test]
    fn text_without_a_value_passes_unchanged_and_unreported() {
        let n = needles(VALUE, &[]);
        let text = b"sk-proj/Abc+12 nothing here, just text: 736b2d70726f6a";
        let (out, found) = streamed(&n, text, &[3, 10, 11]);
        assert_eq!(out, text);
        assert!(found.is_empty());
        assert!(Needles::new(&[], &[]).unwrap().is_none(), "no bindings, no needles");
    }

    #[test]
    fn accept_encoding_is_narrowed_to_what_the_broker_decodes() {
        let ae = |s: Option<&str>| accept_encoding(s.map(|s| HeaderValue::from_str(s).unwrap()).as_ref());
        assert_eq!(ae(Some("gzip, deflate, br, compress;q=1")), "gzip, deflate, br");
        assert_eq!(ae(Some("zstd;q=0.5, gzip;q=0, compress")), "zstd");
        assert_eq!(ae(Some("x-gzip")), "gzip");
        assert_eq!(ae(Some("*")), "gzip, deflate, br, zstd");
        assert_eq!(ae(Some("compress")), "identity");
        assert_eq!(ae(None), "identity");
    }

    #[test]
    fn decoders_decode_in_pieces() {
        let plain: Vec<u8> = b"hello scrubber ".iter().cycle().take(5000).copied().collect();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&plain).unwrap();
        let gz = gz.finish().unwrap();
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(&plain).unwrap();
        let z = z.finish().unwrap();
        let mut raw = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
        raw.write_all(&plain).unwrap();
        let raw = raw.finish().unwrap();
        let zs = zstd::stream::encode_all(plain.as_slice(), 3).unwrap();
        for (coding, data) in [("gzip", gz), ("deflate", z), ("deflate", raw), ("zstd", zs)] {
            let mut d = Decoder::new(coding).unwrap();
            let mut out = Vec::new();
            for piece in data.chunks(7) {
                out.extend(d.feed(piece, false).unwrap());
            }
            out.extend(d.feed(&[], true).unwrap());
            assert_eq!(out, plain, "{coding}");
        }
        assert!(matches!(Decoder::new("compress"), Err(ScrubError::Encoding(_))));
    }
}
