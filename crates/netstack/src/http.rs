//! HTTP/1.x as the egress policy sees it: request heads (RFC 9112 §2-3)
//! and the guest-to-host byte stream of a plain-HTTP connection taken
//! request by request ([`RequestStream`]), so that every request's host is
//! judged, not only the first one's.
//!
//! The bytes come from the guest and are hostile: every read is
//! bounds-checked, nothing here panics, a head is looked at only up to
//! [`MAX_HEAD_BYTES`] and a chunk-size line up to [`MAX_CHUNK_LINE`], and
//! the state between two looks is a few integers.
//!
//! What the view takes as framing (RFC 9112 §6): a request with
//! `Transfer-Encoding` whose last coding is `chunked` has a chunked body
//! (§7.1: chunk-size lines, chunk data, each followed by CRLF, a last
//! chunk of size 0 and a trailer section); a request with one
//! `Content-Length` (equal values repeated count as one) has that many
//! bytes of body; a request with neither has none (§6.3). Anything that
//! could be framed two ways is [`Step::Malformed`] rather than guessed at
//! (a server that frames it the other way would see a request we did not):
//! both headers at once, differing or non-numeric lengths, a
//! `Transfer-Encoding` not ending in `chunked`, a bad chunk line, chunk
//! data not followed by CRLF.
//!
//! Where the view may end: a `CONNECT` request (§3.2.3: a 2xx answer
//! makes the connection a tunnel) and a request with an `Upgrade` header
//! (RFC 9110 §7.8: a 101 answer switches protocols) ask the server to
//! leave HTTP/1.x ([`Head::ask`]). Whether it did is in the host-to-guest
//! stream, which [`response::ResponseStream`] reads; until then the bytes
//! after such a request are held, and after any other answer they are
//! requests again.

use crate::host_name;

pub mod response;

/// A request head's length, at most (bytes): one longer is
/// [`Step::Malformed`].
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// A chunk-size line's length with its extensions, at most (bytes).
pub const MAX_CHUNK_LINE: usize = 1024;
/// Header fields parsed in a head or a trailer section, at most.
pub const MAX_HEADERS: usize = 64;
/// An HTTP method's length, at most, before the bytes count as not HTTP
/// (the longest registered methods are 17 bytes: `BASELINE-CONTROL`,
/// `VERSION-CONTROL`...).
const MAX_METHOD_LEN: usize = 20;
/// A name's length, at most (RFC 1035 §2.3.4: 253 bytes as text; a little
/// more for a port or brackets).
const MAX_NAME_LEN: usize = 262;

/// How a request's body is framed (RFC 9112 §6.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Body {
    /// No body.
    None,
    /// This many bytes.
    Length(u64),
    /// Chunked (RFC 9112 §7.1).
    Chunked,
}

/// A whole request head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Head {
    /// Its length in bytes, up to and with the empty line that ends it.
    pub len: usize,
    /// The names it carries, in the form names are compared in
    /// ([`host_name::fold`], no port, an IPv6 literal without brackets):
    /// the host of an absolute-form or authority-form target (RFC 9112
    /// §3.2.2-3) first, then each non-empty `Host` value. Empty: none.
    pub names: Vec<String>,
    /// How its body is framed.
    pub body: Body,
    /// What it asks of the connection, and so how its answer is read.
    pub ask: Ask,
}

/// What a request asks of its connection (RFC 9112 §6.3, RFC 9110 §7.8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ask {
    /// An answer; its body framed as usual.
    Answer,
    /// `HEAD`: an answer without a body, whatever its framing headers say.
    AnswerWithoutBody,
    /// `Upgrade`: a 101 answer switches the connection to another
    /// protocol, any other final answer leaves it HTTP/1.x.
    Upgrade,
    /// `CONNECT`: a 2xx answer makes it a tunnel.
    Connect,
}

/// What [`parse_head`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parsed {
    /// A whole, well-formed head.
    Head(Head),
    /// A head so far: wait for more (up to [`MAX_HEAD_BYTES`]).
    Partial,
    /// The bytes do not start like an HTTP/1.x request line.
    NotHttp,
    /// An HTTP/1.x request that is not well-formed, or whose body's framing
    /// is ambiguous, or a head longer than [`MAX_HEAD_BYTES`].
    Malformed,
}

/// Parses the request head at the start of `bytes` (RFC 9112 §2.2: empty
/// lines before the request line are skipped).
pub fn parse_head(bytes: &[u8]) -> Parsed {
    let window = bytes.get(..MAX_HEAD_BYTES).unwrap_or(bytes);
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(window) {
        Ok(httparse::Status::Complete(len)) => head(&req, len).map_or(Parsed::Malformed, Parsed::Head),
        Ok(httparse::Status::Partial) => {
            let start = window.iter().position(|&b| b != b'\r' && b != b'\n').unwrap_or(window.len());
            let method = window.get(start..).unwrap_or(&[]);
            let method_len = method.iter().position(|&b| b == b' ').unwrap_or(method.len());
            if method_len > MAX_METHOD_LEN {
                // httparse waits for more on any run of token bytes; a
                // method longer than any real one is not HTTP.
                Parsed::NotHttp
            } else if window.len() >= MAX_HEAD_BYTES {
                Parsed::Malformed
            } else {
                Parsed::Partial
            }
        }
        Err(httparse::Error::Token | httparse::Error::Version) if req.method.is_none() || req.version.is_none() => {
            Parsed::NotHttp
        }
        Err(_) => Parsed::Malformed,
    }
}

/// The [`Head`] of a parsed request of `len` bytes; `None` if malformed.
fn head(req: &httparse::Request<'_, '_>, len: usize) -> Option<Head> {
    let method = req.method?;
    let connect = method.eq_ignore_ascii_case("CONNECT");
    let mut names = Vec::new();
    if let Some(target) = req.path {
        if let Some(host) = target_host(target, connect)? {
            names.push(host);
        }
    }
    let mut upgrade = false;
    for h in req.headers.iter() {
        let value = h.value.trim_ascii();
        if h.name.eq_ignore_ascii_case("host") {
            if !value.is_empty() {
                names.push(normal_name(host_without_port(value)?)?);
            }
        } else if h.name.eq_ignore_ascii_case("upgrade") {
            upgrade = true;
        }
    }
    let (transfer, lengths) = framing_fields(req.headers)?;
    let body = match (transfer, lengths) {
        (Some(_), Some(_)) | (Some(false), None) => return None,
        (Some(true), None) => Body::Chunked,
        (None, Some(0) | None) => Body::None,
        (None, Some(n)) => Body::Length(n),
    };
    let ask = if connect {
        Ask::Connect
    } else if upgrade {
        Ask::Upgrade
    } else if method == "HEAD" {
        // Methods are case-sensitive (RFC 9110 §9.1): `head` is another
        // method, answered with a body.
        Ask::AnswerWithoutBody
    } else {
        Ask::Answer
    };
    Some(Head { len, names, body, ask })
}

/// The framing fields of a head's `headers` (RFC 9112 §6.1-6.2), for
/// requests and answers alike: whether the last coding of the last
/// `Transfer-Encoding` is `chunked` (`None`: no such field) and the
/// `Content-Length` (equal values repeated count as one); `None` where
/// the lengths differ or are not decimal numbers.
fn framing_fields(headers: &[httparse::Header<'_>]) -> Option<(Option<bool>, Option<u64>)> {
    let mut length: Option<u64> = None;
    let mut chunked: Option<bool> = None;
    for h in headers {
        let value = h.value.trim_ascii();
        if h.name.eq_ignore_ascii_case("content-length") {
            for part in value.split(|&b| b == b',') {
                let n = decimal(part.trim_ascii())?;
                if length.is_some_and(|l| l != n) {
                    return None;
                }
                length = Some(n);
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            let last = value.rsplit(|&b| b == b',').next().unwrap_or(&[]).trim_ascii();
            chunked = Some(last.eq_ignore_ascii_case(b"chunked"));
        }
    }
    Some((chunked, length))
}

/// The host of a request target: `Some(None)` for origin-form (`/x`) and
/// asterisk-form (`*`), `Some(Some(host))` for absolute-form
/// (`http://host:port/x`) and, for CONNECT, authority-form (`host:port`);
/// `None` if malformed (RFC 9112 §3.2).
fn target_host(target: &str, connect: bool) -> Option<Option<String>> {
    let t = target.as_bytes();
    if connect {
        return normal_name(host_without_port(t)?).map(Some);
    }
    if t.first() == Some(&b'/') || t == b"*" {
        return Some(None);
    }
    let scheme_end = t.windows(3).position(|w| w == b"://")?;
    let scheme = t.get(..scheme_end)?;
    if scheme.is_empty() || !scheme.iter().all(|c| c.is_ascii_alphanumeric() || b"+-.".contains(c)) {
        return None;
    }
    let rest = t.get(scheme_end + 3..)?;
    let end = rest.iter().position(|c| b"/?#".contains(c)).unwrap_or(rest.len());
    let authority = rest.get(..end)?;
    // RFC 3986 §3.2: userinfo ends at the last '@'.
    let host_port = match authority.iter().rposition(|&b| b == b'@') {
        Some(i) => authority.get(i + 1..)?,
        None => authority,
    };
    normal_name(host_without_port(host_port)?).map(Some)
}

/// `s` as a decimal number (RFC 9110 §8.6: `1*DIGIT`); `None` if empty,
/// not digits, or past `u64`.
fn decimal(s: &[u8]) -> Option<u64> {
    if s.is_empty() {
        return None;
    }
    s.iter().try_fold(
        0u64,
        |n, &c| {
            if c.is_ascii_digit() {
                n.checked_mul(10)?.checked_add(u64::from(c - b'0'))
            } else {
                None
            }
        },
    )
}

/// `name` in the compared form ([`host_name::fold`]); `None` if empty, too
/// long or not printable ASCII.
pub(crate) fn normal_name(name: &[u8]) -> Option<String> {
    if name.len() > MAX_NAME_LEN || !name.iter().all(|c| c.is_ascii_graphic()) {
        return None;
    }
    host_name::fold(std::str::from_utf8(name).ok()?)
}

/// The host of a `Host` value or an authority (RFC 9110 §7.2: `uri-host
/// [ ":" port ]`), trimmed; an IPv6 literal loses its brackets.
pub(crate) fn host_without_port(value: &[u8]) -> Option<&[u8]> {
    let v = value.trim_ascii();
    if let Some(inner) = v.strip_prefix(b"[") {
        let end = inner.iter().position(|&b| b == b']')?;
        let after = inner.get(end + 1..)?;
        if !(after.is_empty() || is_port_suffix(after)) {
            return None;
        }
        return inner.get(..end);
    }
    match v.iter().rposition(|&b| b == b':') {
        Some(i) => {
            let (host, port) = v.split_at(i);
            if is_port_suffix(port) {
                Some(host)
            } else {
                None
            }
        }
        None => Some(v),
    }
}

/// Whether `s` is `:` followed by digits only (an empty port is allowed,
/// RFC 3986 §3.2.3).
fn is_port_suffix(s: &[u8]) -> bool {
    s.strip_prefix(b":").is_some_and(|p| p.iter().all(u8::is_ascii_digit))
}

/// What comes next in the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    /// A request head.
    Head,
    /// This many bytes of body (more than 0).
    Body(u64),
    /// A chunk-size line.
    ChunkLine,
    /// The CRLF after a chunk's data.
    ChunkEnd,
    /// The trailer section after the last chunk.
    Trailers,
}

/// The guest-to-host bytes of one plain-HTTP connection, request by
/// request: [`RequestStream::next`] is shown the bytes from where the last
/// step ended and says what they are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestStream {
    at: At,
}

/// One step through the stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// This many bytes (more than 0; may be more than were shown: a body)
    /// go on without a look.
    Pass(u64),
    /// A request head: its names to judge; then its bytes go on. After a
    /// head that asks [`Ask::Upgrade`] or [`Ask::Connect`], the stream is HTTP only if the
    /// server's answer says so.
    Head(Head),
    /// The bytes shown are not enough to tell: show more.
    NeedMore,
    /// Not well-formed (see the module doc), or bytes that do not start a
    /// request where one must start.
    Malformed,
}

impl Default for RequestStream {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestStream {
    /// A stream at the start of a request head.
    pub fn new() -> Self {
        Self { at: At::Head }
    }

    /// Whether the stream stands where a request head starts (not in a
    /// body).
    pub fn at_head(&self) -> bool {
        self.at == At::Head
    }

    /// Moves the stream past `head` (parsed where the stream stood): to
    /// its body, if it has one, else to the next head.
    pub fn after_head(&mut self, head: &Head) {
        self.at = match head.body {
            Body::None | Body::Length(0) => At::Head,
            Body::Length(n) => At::Body(n),
            Body::Chunked => At::ChunkLine,
        };
    }

    /// The next step, given `bytes`: the stream from where the last step
    /// ended (after the bytes it passed). After [`Step::NeedMore`] the same
    /// position is looked at again; after [`Step::Malformed`] the stream is
    /// lost (the caller ends the view).
    pub fn next(&mut self, bytes: &[u8]) -> Step {
        match self.at {
            At::Head => match parse_head(bytes) {
                Parsed::Head(head) => {
                    self.after_head(&head);
                    Step::Head(head)
                }
                Parsed::Partial => Step::NeedMore,
                Parsed::NotHttp | Parsed::Malformed => Step::Malformed,
            },
            At::Body(n) => {
                self.at = At::Head;
                Step::Pass(n)
            }
            At::ChunkLine => {
                let window = bytes.get(..MAX_CHUNK_LINE).unwrap_or(bytes);
                let Some(cr) = window.windows(2).position(|w| w == b"\r\n") else {
                    return if window.len() >= MAX_CHUNK_LINE { Step::Malformed } else { Step::NeedMore };
                };
                let Some(size) = window.get(..cr).and_then(chunk_size) else {
                    return Step::Malformed;
                };
                let line = cr as u64 + 2;
                if size == 0 {
                    self.at = At::Trailers;
                    Step::Pass(line)
                } else {
                    self.at = At::ChunkEnd;
                    Step::Pass(line.saturating_add(size))
                }
            }
            At::ChunkEnd => match bytes.get(..2) {
                None if bytes.len() < 2 && bytes.iter().eq(b"\r\n".iter().take(bytes.len())) => Step::NeedMore,
                Some(b"\r\n") => {
                    self.at = At::ChunkLine;
                    Step::Pass(2)
                }
                _ => Step::Malformed,
            },
            At::Trailers => {
                let window = bytes.get(..MAX_HEAD_BYTES).unwrap_or(bytes);
                let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
                match httparse::parse_headers(window, &mut headers) {
                    Ok(httparse::Status::Complete((n, _))) if n > 0 => {
                        self.at = At::Head;
                        Step::Pass(n as u64)
                    }
                    Ok(httparse::Status::Partial) if window.len() < MAX_HEAD_BYTES => Step::NeedMore,
                    _ => Step::Malformed,
                }
            }
        }
    }
}

/// The size of a chunk-size line without its CRLF (RFC 9112 §7.1:
/// `1*HEXDIG [ chunk-ext ]`, the extensions after `;`, with optional white
/// space before it); `None` if malformed or past `u64`.
fn chunk_size(line: &[u8]) -> Option<u64> {
    let digits = line.iter().take_while(|c| c.is_ascii_hexdigit()).count();
    if digits == 0 || digits > 16 {
        return None;
    }
    let rest = line.get(digits..)?;
    let ext = rest.trim_ascii_start();
    if !(ext.is_empty() || ext.first() == Some(&b';')) || rest.iter().any(|&b| b == b'\r' || b == b'\n') {
        return None;
    }
    line.get(..digits)?.iter().try_fold(0u64, |n, &c| {
        let d = char::from(c).to_digit(16)?;
        n.checked_mul(16)?.checked_add(u64::from(d))
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn head_of(bytes: &[u8]) -> Head {
        match parse_head(bytes) {
            Parsed::Head(h) => h,
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(bytes)),
        }
    }

    fn names(bytes: &[u8]) -> Vec<String> {
        head_of(bytes).names
    }

    #[test]
    fn heads_give_their_names_framing_and_length() {
        let req = b"GET /simple/ HTTP/1.1\r\nUser-Agent: pip\r\nhost: PyPI.org:8080\r\n\r\nrest";
        let h = head_of(req);
        assert_eq!(
            (h.len, h.names, h.body, h.ask),
            (req.len() - 4, vec!["pypi.org".to_string()], Body::None, Ask::Answer)
        );
        for n in 1..req.len() - 4 {
            assert_eq!(parse_head(&req[..n]), Parsed::Partial, "prefix of {n} bytes");
        }
        // Absolute-form: the target's host first (RFC 9112 §3.2.2), then Host.
        assert_eq!(
            names(b"GET http://user:pw@Evil.example:81/x?y HTTP/1.1\r\nHost: good.example\r\n\r\n"),
            ["evil.example", "good.example"]
        );
        assert_eq!(names(b"GET https://[2001:db8::1]/ HTTP/1.1\r\n\r\n"), ["2001:db8::1"]);
        // CONNECT: authority-form, and the view may end.
        let h = head_of(b"CONNECT tunnel.example:443 HTTP/1.1\r\nHost: tunnel.example:443\r\n\r\n");
        assert_eq!(
            (h.names.as_slice(), h.ask),
            (&["tunnel.example".to_string(), "tunnel.example".into()][..], Ask::Connect)
        );
        let ws = head_of(b"GET /ws HTTP/1.1\r\nHost: a.example\r\nUpgrade: websocket\r\n\r\n");
        assert_eq!(ws.ask, Ask::Upgrade);
        assert_eq!(head_of(b"HEAD / HTTP/1.1\r\n\r\n").ask, Ask::AnswerWithoutBody);
        assert_eq!(head_of(b"head / HTTP/1.1\r\n\r\n").ask, Ask::Answer, "methods are case-sensitive");
        assert!(names(b"OPTIONS * HTTP/1.1\r\n\r\n").is_empty());
        assert!(names(b"GET / HTTP/1.0\r\nHost:   \r\n\r\n").is_empty(), "an empty Host names nothing");
        // Two Host fields: both are names (each will be judged).
        assert_eq!(names(b"GET / HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n\r\n"), ["a.example", "b.example"]);
        // Framing.
        let body = |h: &[u8]| head_of(h).body;
        assert_eq!(body(b"POST / HTTP/1.1\r\nContent-Length: 12\r\n\r\n"), Body::Length(12));
        assert_eq!(body(b"POST / HTTP/1.1\r\nContent-Length: 5, 5\r\nContent-Length: 5\r\n\r\n"), Body::Length(5));
        assert_eq!(body(b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n"), Body::None);
        assert_eq!(body(b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, Chunked\r\n\r\n"), Body::Chunked);
    }

    #[test]
    fn what_is_not_a_well_formed_request() {
        let malformed: &[&[u8]] = &[
            b"POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a.example:x\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: [::1]x\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n",
            b"GET http:/x HTTP/1.1\r\n\r\n",
            b"GET example.com/ HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nBad Header: x\r\n\r\n",
        ];
        for m in malformed {
            assert_eq!(parse_head(m), Parsed::Malformed, "{:?}", String::from_utf8_lossy(m));
        }
        for n in [
            &b"SSH-2.0-OpenSSH_9.6\r\n"[..],
            b"\x00\x01\x02binary",
            b"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
            b"EHLO mail.example\r\n",
        ] {
            assert_eq!(parse_head(n), Parsed::NotHttp, "{:?}", String::from_utf8_lossy(n));
        }
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            many.extend_from_slice(format!("X-{i}: y\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(parse_head(&many), Parsed::Malformed);
        let mut long = b"GET /".to_vec();
        long.resize(MAX_HEAD_BYTES + 10, b'a');
        assert_eq!(parse_head(&long[..MAX_HEAD_BYTES - 1]), Parsed::Partial);
        assert_eq!(parse_head(&long), Parsed::Malformed);
    }

    /// Walks `stream` over `bytes` as a caller would, showing at most
    /// `window` bytes at a time: the heads' names, and whether it ended
    /// malformed.
    fn walk(bytes: &[u8], window: usize) -> (Vec<Vec<String>>, bool) {
        let mut s = RequestStream::new();
        let (mut at, mut heads) = (0usize, Vec::new());
        while at < bytes.len() {
            let shown = &bytes[at..bytes.len().min(at + window)];
            match s.next(shown) {
                Step::Pass(n) => at = at.saturating_add(usize::try_from(n).unwrap()),
                Step::Head(h) => {
                    at += h.len;
                    heads.push(h.names);
                }
                Step::NeedMore => {
                    assert!(shown.len() < window && at + shown.len() == bytes.len(), "stuck at {at}");
                    break;
                }
                Step::Malformed => return (heads, true),
            }
        }
        (heads, false)
    }

    #[test]
    fn a_keep_alive_stream_is_taken_request_by_request() {
        let hidden = "GET / HTTP/1.1\r\nHost: hidden.example\r\n\r\n";
        let chunk = "Host: hidden.example\r\n\r\n";
        let stream = format!(
            "POST /a HTTP/1.1\r\nHost: one.example\r\nContent-Length: {}\r\n\r\n{hidden}\
POST /b HTTP/1.1\r\nHost: two.example\r\nTransfer-Encoding: chunked\r\n\r\n\
5;ext=1\r\nGET /\r\n{:x}\r\n{chunk}\r\n0\r\nTrailer: x\r\n\r\n\
\r\nGET http://three.example/ HTTP/1.1\r\nHost: two.example\r\n\r\n",
            hidden.len(),
            chunk.len()
        );
        let stream = stream.as_bytes();
        let want = vec![
            vec!["one.example".to_string()],
            vec!["two.example".into()],
            vec!["three.example".into(), "two.example".into()],
        ];
        // The request in the first body and the one in the chunk are body
        // bytes, not requests; a window need only hold the longest head.
        for window in [16 * 1024, 100, 70] {
            assert_eq!(walk(stream, window), (want.clone(), false), "window {window}");
        }
        // Chunk framing errors.
        for bad in [&b"zz\r\n"[..], b"5\r\nhelloXX", b"12345678901234567\r\n", b"5 x\r\n"] {
            let mut s = RequestStream { at: At::ChunkLine };
            let mut at = 0;
            let got = loop {
                match s.next(&bad[at..]) {
                    Step::Pass(n) => at += usize::try_from(n).unwrap(),
                    other => break other,
                }
                if at >= bad.len() {
                    break Step::NeedMore;
                }
            };
            assert_eq!(got, Step::Malformed, "{:?}", String::from_utf8_lossy(bad));
        }
        let mut s = RequestStream { at: At::ChunkLine };
        assert_eq!(s.next(&[b'1'; MAX_CHUNK_LINE]), Step::Malformed);
        let mut s = RequestStream { at: At::ChunkEnd };
        assert_eq!(s.next(b"\r"), Step::NeedMore);
        assert_eq!(s.next(b"\n"), Step::Malformed);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn random_streams_never_panic_or_pass_nothing(
            bytes in proptest::collection::vec(any::<u8>(), 0..512),
            window in 1usize..600,
            start in 0usize..5,
        ) {
            let mut s = RequestStream { at: [At::Head, At::Body(3), At::ChunkLine, At::ChunkEnd, At::Trailers][start] };
            let mut at = 0usize;
            for _ in 0..1000 {
                let shown = &bytes[at.min(bytes.len())..bytes.len().min(at.saturating_add(window))];
                match s.next(shown) {
                    Step::Pass(n) => {
                        prop_assert!(n > 0);
                        at = at.saturating_add(usize::try_from(n).unwrap_or(usize::MAX));
                    }
                    Step::Head(h) => {
                        prop_assert!(h.len > 0 && h.len <= shown.len());
                        at += h.len;
                    }
                    Step::NeedMore | Step::Malformed => break,
                }
                if at >= bytes.len() {
                    break;
                }
            }
        }

        #[test]
        fn random_heads_never_panic(
            target in "[ -~]{0,60}",
            host in "[ -~]{0,60}",
            junk in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut v = format!("GET {target} HTTP/1.1\r\nHost: {host}\r\n").into_bytes();
            v.extend_from_slice(&junk);
            let _ = parse_head(&v);
        }
    }
}
