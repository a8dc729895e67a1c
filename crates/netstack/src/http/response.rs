//! The host-to-guest bytes of a plain-HTTP connection taken answer by
//! answer (RFC 9112 §4 and §6-7), read for one thing: whether the server
//! agreed when a request asked it to leave HTTP/1.x (a 101 to an
//! `Upgrade`, RFC 9110 §7.8 and §15.2.2; a 2xx to a `CONNECT`, RFC 9110
//! §9.3.6). Until it is known, the guest's bytes after such a request are
//! held by the gate (`crate::stack`); after a 101 (or 2xx) they are
//! another protocol, after any other final answer they are requests again
//! and judged as before.
//!
//! The bytes come from a server the guest chose and are read, never
//! changed: they go on to the guest as they are. Nothing here panics; the
//! state between two reads is a few integers, the requests still waiting
//! for an answer (at most [`MAX_ASKED`]) and at most [`MAX_HEAD_BYTES`]
//! of a head (or chunk-size line, or trailer section) cut between reads.
//!
//! Answers are framed as RFC 9112 §6.3 says: none for a `HEAD`, a 1xx, a
//! 204 or a 304; chunked when the last transfer coding is `chunked`;
//! `Content-Length` bytes otherwise. An answer that can only end with the
//! connection (no length, another transfer coding), one that could be
//! framed two ways, an answer nobody asked for and bytes that are not
//! HTTP/1.x leave the stream *lost*: nothing more is read, no request
//! waits for an answer any more, and the gate looks at what the guest
//! sends next as requests (a server that switched protocols without a
//! readable 101 gets the guest's next bytes judged as HTTP).

use std::collections::VecDeque;

use super::{chunk_size, Ask, MAX_CHUNK_LINE, MAX_HEADERS, MAX_HEAD_BYTES};

/// Requests waiting for their answers, at most (pipelined on one
/// connection); one more loses the stream.
pub const MAX_ASKED: usize = 256;

/// What became of the request that asked to leave HTTP/1.x.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The server agreed: what follows, both ways, is another protocol.
    Switched,
    /// It answered otherwise (or its answer could not be read): the
    /// connection stays HTTP/1.x.
    Stayed,
}

/// Where the stream stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    /// An answer's status line and header section.
    Head,
    /// This many bytes of body, then (`chunk`) the CRLF after chunk data,
    /// or the next head.
    Data { left: u64, chunk: bool },
    /// A chunk-size line.
    ChunkLine,
    /// The CRLF after a chunk's data.
    ChunkEnd,
    /// The trailer section after the last chunk.
    Trailers,
    /// Switched to another protocol: nothing more is read.
    Switched,
    /// Not readable any more (see the module doc).
    Lost,
}

/// The answers of one plain-HTTP connection; [`ResponseStream::asked`]
/// is told of each request as it goes to the host, in order, and
/// [`ResponseStream::read`] is shown every byte the host sends, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResponseStream {
    /// What each request sent and not yet answered asked, oldest first.
    asked: VecDeque<Ask>,
    at: At,
    /// The start of a head, chunk-size line, chunk end or trailer section
    /// that a read cut: at most [`MAX_HEAD_BYTES`].
    carry: Vec<u8>,
}

impl Default for ResponseStream {
    fn default() -> Self {
        Self::new()
    }
}

/// What one structural element (head, chunk line, ...) at the start of the
/// carried bytes gave.
enum Element {
    /// Not whole yet.
    Partial,
    /// Whole, this many bytes long; the stream has moved past it.
    Whole(usize),
}

impl ResponseStream {
    /// A connection before its first answer.
    pub fn new() -> Self {
        Self { asked: VecDeque::new(), at: At::Head, carry: Vec::new() }
    }

    /// A request asking `ask` went to the host.
    pub fn asked(&mut self, ask: Ask) {
        if matches!(self.at, At::Lost | At::Switched) {
            return;
        }
        if self.asked.len() >= MAX_ASKED {
            self.lose();
        } else {
            self.asked.push_back(ask);
        }
    }

    /// The host sent bytes before the first request: its answers cannot
    /// be told apart, nothing is read.
    pub fn asked_unreadable(&mut self) {
        self.lose();
    }

    /// Whether a request that asked to leave HTTP/1.x waits for its
    /// answer (the guest's bytes after it are held meanwhile).
    pub fn switch_waiting(&self) -> bool {
        !matches!(self.at, At::Lost | At::Switched)
            && self.asked.iter().any(|a| matches!(a, Ask::Upgrade | Ask::Connect))
    }

    /// Whether the server switched protocols.
    pub fn switched(&self) -> bool {
        self.at == At::Switched
    }

    /// Reads `bytes`, the next the host sent. `Some`: the answer to the
    /// request that asked to leave HTTP/1.x is known (or can no longer be,
    /// [`Answer::Stayed`]).
    pub fn read(&mut self, bytes: &[u8]) -> Option<Answer> {
        let waiting = self.switch_waiting();
        let mut rest = bytes;
        while !rest.is_empty() {
            match self.at {
                At::Switched | At::Lost => break,
                At::Data { left, chunk } => {
                    let take = usize::try_from(left).unwrap_or(usize::MAX).min(rest.len());
                    rest = rest.get(take..).unwrap_or(&[]);
                    let left = left - take as u64;
                    self.at = match (left, chunk) {
                        (0, true) => At::ChunkEnd,
                        (0, false) => At::Head,
                        (left, chunk) => At::Data { left, chunk },
                    };
                }
                At::Head | At::ChunkLine | At::ChunkEnd | At::Trailers => {
                    let before = self.carry.len();
                    let room = MAX_HEAD_BYTES.saturating_sub(before);
                    let shown = rest.get(..room.min(rest.len())).unwrap_or(rest);
                    self.carry.extend_from_slice(shown);
                    match self.element() {
                        Element::Whole(len) => {
                            let used = len.saturating_sub(before);
                            rest = rest.get(used..).unwrap_or(&[]);
                            self.carry.clear();
                        }
                        Element::Partial if self.carry.len() >= MAX_HEAD_BYTES => self.lose(),
                        Element::Partial => rest = &[],
                    }
                }
            }
        }
        match (waiting, self.at) {
            (true, At::Switched) => Some(Answer::Switched),
            (true, _) if !self.switch_waiting() => Some(Answer::Stayed),
            _ => None,
        }
    }

    /// Nothing more is read.
    fn lose(&mut self) {
        self.at = At::Lost;
        self.asked.clear();
        self.carry = Vec::new();
    }

    /// Looks at the element at the start of `self.carry`.
    fn element(&mut self) -> Element {
        match self.at {
            At::Head => self.head(),
            At::ChunkLine => {
                let window = self.carry.get(..MAX_CHUNK_LINE).unwrap_or(&self.carry);
                let Some(cr) = window.windows(2).position(|w| w == b"\r\n") else {
                    if window.len() >= MAX_CHUNK_LINE {
                        self.lose();
                        return Element::Whole(0);
                    }
                    return Element::Partial;
                };
                match window.get(..cr).and_then(chunk_size) {
                    None => self.lose(),
                    Some(0) => self.at = At::Trailers,
                    Some(left) => self.at = At::Data { left, chunk: true },
                }
                Element::Whole(cr + 2)
            }
            At::ChunkEnd => match self.carry.get(..2) {
                Some(b"\r\n") => {
                    self.at = At::ChunkLine;
                    Element::Whole(2)
                }
                None if self.carry.as_slice() == b"\r" => Element::Partial,
                _ => {
                    self.lose();
                    Element::Whole(0)
                }
            },
            At::Trailers => {
                let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
                match httparse::parse_headers(&self.carry, &mut headers) {
                    Ok(httparse::Status::Complete((n, _))) if n > 0 => {
                        self.at = At::Head;
                        Element::Whole(n)
                    }
                    Ok(httparse::Status::Partial) => Element::Partial,
                    _ => {
                        self.lose();
                        Element::Whole(0)
                    }
                }
            }
            At::Data { .. } | At::Switched | At::Lost => Element::Whole(0),
        }
    }

    /// Looks at the answer head at the start of `self.carry`.
    fn head(&mut self) -> Element {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut headers);
        let len = match resp.parse(&self.carry) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Element::Partial,
            Err(_) => {
                self.lose();
                return Element::Whole(0);
            }
        };
        let (Some(code), Some(&ask)) = (resp.code, self.asked.front()) else {
            // An answer no request asked for.
            self.lose();
            return Element::Whole(len);
        };
        if code == 101 {
            if ask == Ask::Upgrade {
                self.asked.clear();
                self.at = At::Switched;
            } else {
                self.lose();
            }
            return Element::Whole(len);
        }
        if (100..200).contains(&code) {
            // Interim (100 Continue, 103 Early Hints): the final answer
            // follows.
            return Element::Whole(len);
        }
        if ask == Ask::Connect && (200..300).contains(&code) {
            self.asked.clear();
            self.at = At::Switched;
            return Element::Whole(len);
        }
        self.asked.pop_front();
        if ask == Ask::AnswerWithoutBody || code == 204 || code == 304 {
            self.at = At::Head;
            return Element::Whole(len);
        }
        match framing(resp.headers) {
            Some(Framing::Chunked) => self.at = At::ChunkLine,
            Some(Framing::Length(0)) => self.at = At::Head,
            Some(Framing::Length(left)) => self.at = At::Data { left, chunk: false },
            Some(Framing::UntilClose) | None => self.lose(),
        }
        Element::Whole(len)
    }
}

/// How an answer's body is framed (RFC 9112 §6.3, after the cases that
/// have none).
enum Framing {
    Chunked,
    Length(u64),
    /// It ends with the connection.
    UntilClose,
}

/// The framing the answer's `headers` give; `None` where it could be read
/// two ways (both headers, differing lengths, a length that is not a
/// number).
fn framing(headers: &[httparse::Header<'_>]) -> Option<Framing> {
    match super::framing_fields(headers)? {
        (Some(_), Some(_)) => None,
        (Some(true), None) => Some(Framing::Chunked),
        (Some(false), None) | (None, None) => Some(Framing::UntilClose),
        (None, Some(n)) => Some(Framing::Length(n)),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// `bytes` read in pieces of `piece` bytes: the first answer given.
    fn read_in(s: &mut ResponseStream, bytes: &[u8], piece: usize) -> Option<Answer> {
        let mut first = None;
        for part in bytes.chunks(piece.max(1)) {
            let a = s.read(part);
            first = first.or(a);
        }
        first
    }

    fn stream(asks: &[Ask]) -> ResponseStream {
        let mut s = ResponseStream::new();
        for &a in asks {
            s.asked(a);
        }
        s
    }

    #[test]
    fn a_101_to_the_upgrade_switches_after_the_answers_before_it() {
        // Earlier pipelined answers: one chunked, whose data looks like a
        // 101; one to a HEAD with a length and no body; then the 101.
        let fake = "HTTP/1.1 101 Switching Protocols\r\n\r\n";
        let bytes = format!(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{fake}\r\n0\r\nX-T: 1\r\n\r\n\
HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n\
HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n\x01\x05hello",
            fake.len()
        );
        for piece in [1, 2, 3, 7, 64, bytes.len()] {
            let mut s = stream(&[Ask::Answer, Ask::AnswerWithoutBody, Ask::Upgrade]);
            assert!(s.switch_waiting());
            assert_eq!(read_in(&mut s, bytes.as_bytes(), piece), Some(Answer::Switched), "pieces of {piece}");
            assert!(s.switched() && !s.switch_waiting());
        }
        // Before the 101 arrives, nothing is decided.
        let mut s = stream(&[Ask::Answer, Ask::Upgrade]);
        assert_eq!(s.read(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nHTTP/"), None);
        assert!(s.switch_waiting());
    }

    #[test]
    fn any_other_final_answer_keeps_the_connection_http() {
        // Interim answers first, then a refusal with a body; the next
        // answer is read as an answer again.
        let mut s = stream(&[Ask::Upgrade]);
        let refusal = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n\
HTTP/1.1 426 Upgrade Required\r\nContent-Length: 36\r\n\r\nHTTP/1.1 101 Switching Protocols\r\n\r\n";
        assert_eq!(s.read(refusal), Some(Answer::Stayed));
        assert!(!s.switch_waiting() && !s.switched());
        s.asked(Ask::Upgrade);
        assert_eq!(s.read(b"HTTP/1.1 101 Switching Protocols\r\n\r\n"), Some(Answer::Switched));
        // CONNECT: a 2xx makes a tunnel, anything else does not.
        let mut s = stream(&[Ask::Connect]);
        assert_eq!(s.read(b"HTTP/1.1 200 Connection established\r\n\r\n"), Some(Answer::Switched));
        let mut s = stream(&[Ask::Connect]);
        assert_eq!(
            s.read(b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n"),
            Some(Answer::Stayed)
        );
        // 204 and 304 have no body whatever they say.
        let mut s = stream(&[Ask::Answer, Ask::Answer, Ask::Upgrade]);
        let bytes = b"HTTP/1.1 204 No Content\r\nContent-Length: 10\r\n\r\nHTTP/1.1 304 Not Modified\r\n\r\n\
HTTP/1.1 101 Switching Protocols\r\n\r\n";
        assert_eq!(s.read(bytes), Some(Answer::Switched));
    }

    #[test]
    fn what_cannot_be_read_loses_the_stream_and_nothing_waits() {
        let lost: &[(&[Ask], &[u8])] = &[
            // A 101 nobody asked for.
            (&[Ask::Answer, Ask::Upgrade], b"HTTP/1.1 101 Switching Protocols\r\n\r\n"),
            // A body that ends with the connection.
            (&[Ask::Answer, Ask::Upgrade], b"HTTP/1.1 200 OK\r\n\r\nHTTP/1.1 101 Switching Protocols\r\n\r\n"),
            (&[Ask::Answer, Ask::Upgrade], b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"),
            // Framed two ways.
            (
                &[Ask::Answer, Ask::Upgrade],
                b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            ),
            (&[Ask::Answer, Ask::Upgrade], b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n"),
            // Not HTTP, a bad chunk, an answer with no request.
            (&[Ask::Upgrade], b"SSH-2.0-OpenSSH_9.6\r\n"),
            (&[Ask::Answer, Ask::Upgrade], b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
            (&[], b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
        ];
        for (asks, bytes) in lost {
            let mut s = stream(asks);
            let waiting = s.switch_waiting();
            let answer = s.read(bytes);
            assert!(!s.switched() && !s.switch_waiting(), "{:?}", String::from_utf8_lossy(bytes));
            assert_eq!(answer, waiting.then_some(Answer::Stayed));
            // Later requests wait for nothing.
            s.asked(Ask::Upgrade);
            assert!(!s.switch_waiting());
        }
        // A head longer than the bound, and too many requests waiting.
        let mut s = stream(&[Ask::Upgrade]);
        let mut long = b"HTTP/1.1 200 OK\r\nX: ".to_vec();
        long.resize(MAX_HEAD_BYTES + 1, b'a');
        assert_eq!(s.read(&long), Some(Answer::Stayed));
        let mut s = stream(&[Ask::Answer; MAX_ASKED]);
        s.asked(Ask::Upgrade);
        assert!(!s.switch_waiting());
    }

    proptest! {
        #[test]
        fn any_bytes_in_any_pieces_read_alike_and_never_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..600),
            piece in 1usize..40,
        ) {
            let mut whole = stream(&[Ask::Answer, Ask::Upgrade]);
            let a = whole.read(&bytes);
            let mut parts = stream(&[Ask::Answer, Ask::Upgrade]);
            prop_assert_eq!(read_in(&mut parts, &bytes, piece), a);
            prop_assert_eq!(parts, whole);
        }

        #[test]
        fn answers_in_any_pieces_read_alike(piece in 1usize..80, len in 0usize..300, chunked: bool) {
            let body = "x".repeat(len);
            let first = match (chunked, len) {
                (true, 0) => "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_string(),
                (true, _) => format!("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{len:x}\r\n{body}\r\n0\r\n\r\n"),
                (false, _) => format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\n\r\n{body}"),
            };
            let bytes = format!("{first}HTTP/1.1 101 Switching Protocols\r\n\r\n");
            let mut s = stream(&[Ask::Answer, Ask::Upgrade]);
            prop_assert_eq!(read_in(&mut s, bytes.as_bytes(), piece), Some(Answer::Switched));
        }
    }
}
