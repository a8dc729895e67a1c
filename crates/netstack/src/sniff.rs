//! What a connection's first bytes are: a TLS ClientHello and its SNI
//! (RFC 6066 §3), an HTTP/1.x request head ([`crate::http`]), or
//! neither.
//!
//! The bytes come from the guest and are hostile: every read is
//! bounds-checked, nothing here panics, and nothing allocates more than
//! [`MAX_SNIFF_BYTES`] (plus the names found).
//!
//! A ClientHello with more than one `host_name` (forbidden: RFC 6066 §3)
//! gives the first. What the stack does with the answer (and what a
//! domain rule guarantees) is in `stack::gate`.

use crate::http::{self, Head, Parsed};

/// What the first bytes of a connection say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sniffed {
    /// A whole TLS ClientHello, with its SNI `host_name` (lower-case,
    /// without a trailing dot; `None`: no `server_name` extension, or no
    /// usable `host_name` in it).
    ClientHello(Option<String>),
    /// A whole HTTP/1.x request head.
    Request(Head),
    /// The bytes are TLS or HTTP but incomplete: wait for more (up to
    /// [`MAX_SNIFF_BYTES`]).
    NeedMore,
    /// TLS or HTTP/1.x, but not well-formed, or a ClientHello or request
    /// head that does not fit in [`MAX_SNIFF_BYTES`]; `tls`: it started as
    /// a TLS record.
    Malformed {
        /// The bytes started as a TLS handshake record.
        tls: bool,
    },
    /// Neither TLS nor HTTP/1.x.
    Other,
}

/// Bytes looked at, at most; past this an incomplete message is
/// [`Sniffed::Malformed`].
pub const MAX_SNIFF_BYTES: usize = 16 * 1024;

/// TLS record content type `handshake` (RFC 8446 §5.1).
pub const CONTENT_HANDSHAKE: u8 = 22;
/// Handshake message type `client_hello` (RFC 8446 §4).
const HANDSHAKE_CLIENT_HELLO: u8 = 1;
/// Extension type `server_name` (RFC 6066 §3).
const EXT_SERVER_NAME: u16 = 0;
/// `NameType` `host_name` (RFC 6066 §3).
const NAME_TYPE_HOST_NAME: u8 = 0;
/// A TLS record's payload, at most (RFC 8446 §5.1: 2^14).
const MAX_RECORD_PAYLOAD: usize = 1 << 14;

/// Looks at a connection's first bytes (all of them so far, from the
/// first byte on): a TLS ClientHello (a record of type 22) or an HTTP/1.x
/// request head.
///
/// [`Sniffed::NeedMore`] only while `first` is shorter than
/// [`MAX_SNIFF_BYTES`]; from there on an incomplete message is
/// [`Sniffed::Malformed`].
pub fn sniff(first: &[u8]) -> Sniffed {
    let first = first.get(..MAX_SNIFF_BYTES).unwrap_or(first);
    let found = match first.first() {
        None => Sniffed::NeedMore,
        Some(&CONTENT_HANDSHAKE) => sniff_tls(first),
        Some(_) => match http::parse_head(first) {
            Parsed::Head(head) => Sniffed::Request(head),
            Parsed::Partial => Sniffed::NeedMore,
            Parsed::NotHttp => Sniffed::Other,
            Parsed::Malformed => Sniffed::Malformed { tls: false },
        },
    };
    if found == Sniffed::NeedMore && first.len() >= MAX_SNIFF_BYTES {
        Sniffed::Malformed { tls: first.first() == Some(&CONTENT_HANDSHAKE) }
    } else {
        found
    }
}

/// A bounds-checked big-endian reader over a byte slice.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.buf.len() {
            return None;
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).and_then(|b| b.first().copied())
    }

    fn u16(&mut self) -> Option<u16> {
        let b = self.take(2)?;
        Some(u16::from_be_bytes([*b.first()?, *b.get(1)?]))
    }

    fn u24(&mut self) -> Option<usize> {
        let b = self.take(3)?;
        Some(usize::from(*b.first()?) << 16 | usize::from(*b.get(1)?) << 8 | usize::from(*b.get(2)?))
    }

    /// A vector with a `len_bytes`-byte length prefix (RFC 8446 §3.4).
    fn vec8(&mut self) -> Option<&'a [u8]> {
        let n = self.u8()?;
        self.take(usize::from(n))
    }

    fn vec16(&mut self) -> Option<&'a [u8]> {
        let n = self.u16()?;
        self.take(usize::from(n))
    }

    fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// The SNI of a ClientHello, which may span several handshake records
/// (RFC 8446 §5.1: handshake messages may be fragmented over records).
fn sniff_tls(bytes: &[u8]) -> Sniffed {
    // The handshake bytes of the records so far (at most MAX_SNIFF_BYTES,
    // as `bytes` is).
    let mut handshake: Vec<u8> = Vec::new();
    // Whether something other than a handshake record came after the
    // records so far: the ClientHello cannot grow any more.
    let mut ended = false;
    let mut rest = Reader::new(bytes);
    while !rest.is_empty() {
        let Some(header) = rest.take(5) else {
            // A record header cut short: check what there is of it.
            let partial = rest.buf;
            if partial.first() != Some(&CONTENT_HANDSHAKE) || partial.get(1).is_some_and(|&m| m != 3) {
                ended = true;
            }
            break;
        };
        let mut h = Reader::new(header);
        let (Some(kind), Some(major), Some(_minor), Some(len)) = (h.u8(), h.u8(), h.u8(), h.u16()) else {
            ended = true;
            break;
        };
        let len = usize::from(len);
        // Handshake records with a 3.x legacy version (RFC 8446 §5.1,
        // Appendix D); anything else (e.g. the change_cipher_spec or early
        // data a client may send right after its hello) ends the hello.
        if kind != CONTENT_HANDSHAKE || major != 3 || len == 0 || len > MAX_RECORD_PAYLOAD {
            ended = true;
            break;
        }
        let payload = match rest.take(len) {
            Some(p) => p,
            None => {
                // The last record is still coming: parse what there is.
                let p = rest.buf;
                rest = Reader::new(&[]);
                p
            }
        };
        handshake.extend_from_slice(payload);
    }
    match client_hello_sni(&handshake) {
        Sniffed::NeedMore if ended => Sniffed::Malformed { tls: true },
        found => found,
    }
}

/// The SNI in a handshake message stream that starts with a ClientHello
/// (RFC 8446 §4.1.2).
fn client_hello_sni(handshake: &[u8]) -> Sniffed {
    let mut r = Reader::new(handshake);
    let Some(kind) = r.u8() else {
        return Sniffed::NeedMore;
    };
    if kind != HANDSHAKE_CLIENT_HELLO {
        return Sniffed::Malformed { tls: true };
    }
    let Some(len) = r.u24() else {
        return Sniffed::NeedMore;
    };
    // 4 header bytes + 5 of the first record: a message that cannot fit
    // in what we look at never completes.
    if len.saturating_add(9) > MAX_SNIFF_BYTES {
        return Sniffed::Malformed { tls: true };
    }
    let Some(body) = r.take(len) else {
        return Sniffed::NeedMore;
    };
    match client_hello_body_sni(body) {
        Some(name) => Sniffed::ClientHello(name),
        None => Sniffed::Malformed { tls: true },
    }
}

/// `Some(Some(name))`: the `host_name`; `Some(None)`: a well-formed hello
/// without one; `None`: malformed.
fn client_hello_body_sni(body: &[u8]) -> Option<Option<String>> {
    let mut r = Reader::new(body);
    let _legacy_version = r.u16()?;
    let _random = r.take(32)?;
    let _session_id = r.vec8()?;
    let _cipher_suites = r.vec16()?;
    let _compression = r.vec8()?;
    if r.is_empty() {
        // No extensions (allowed before TLS 1.3): no SNI.
        return Some(None);
    }
    let mut exts = Reader::new(r.vec16()?);
    while !exts.is_empty() {
        let kind = exts.u16()?;
        let data = exts.vec16()?;
        if kind != EXT_SERVER_NAME {
            continue;
        }
        let mut ext = Reader::new(data);
        let mut list = Reader::new(ext.vec16()?);
        while !list.is_empty() {
            let name_type = list.u8()?;
            let name = list.vec16()?;
            if name_type == NAME_TYPE_HOST_NAME {
                return Some(http::normal_name(name));
            }
        }
        return Some(None);
    }
    Some(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The answer as the name check sees it: a name, more needed, or none.
    #[derive(Debug, PartialEq, Eq)]
    enum Old {
        Name(String),
        NeedMore,
        NoName,
    }

    /// [`super::sniff`], told as [`Old`].
    fn sniff(bytes: &[u8]) -> Old {
        match super::sniff(bytes) {
            Sniffed::ClientHello(Some(n)) => Old::Name(n),
            Sniffed::Request(h) => h.names.first().cloned().map_or(Old::NoName, Old::Name),
            Sniffed::NeedMore => Old::NeedMore,
            Sniffed::ClientHello(None) | Sniffed::Malformed { .. } | Sniffed::Other => Old::NoName,
        }
    }

    #[test]
    fn what_kind_of_nothing() {
        let no_sni = records(&hello_message(Some(&[(16u16, vec16(&[2, b'h', b'2']))])), 1 << 14);
        assert_eq!(super::sniff(&no_sni), Sniffed::ClientHello(None));
        assert_eq!(super::sniff(&records(&hello_message(None), 1 << 14)), Sniffed::ClientHello(None));
        assert_eq!(super::sniff(&[22, 3, 1, 0, 0]), Sniffed::Malformed { tls: true });
        assert_eq!(super::sniff(b"SSH-2.0-OpenSSH_9.6\r\n"), Sniffed::Other);
        assert_eq!(super::sniff(b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n"), Sniffed::Malformed { tls: false });
        let mut long = b"GET /".to_vec();
        long.resize(MAX_SNIFF_BYTES, b'a');
        assert_eq!(super::sniff(&long), Sniffed::Malformed { tls: false });
        match super::sniff(b"GET / HTTP/1.1\r\nHost: a.example\r\nContent-Length: 3\r\n\r\nabc") {
            Sniffed::Request(h) => assert_eq!((h.len, h.body), (54, crate::http::Body::Length(3))),
            other => panic!("{other:?}"),
        }
    }

    /// A ClientHello `openssl s_client -connect 127.0.0.1:<port>
    /// -servername example.test` (OpenSSL 3.0.19) sent to a listener on
    /// this machine's loopback: one record, 318 bytes.
    const OPENSSL_HELLO_HEX: &[&str] = &[
        "1603010139010001350303dfdabf74fb1f2d7c954f524e6a5f288ad216e0",
        "3b36071adbb4923242adf884fc202a5d06051be2541dd25549fe48d0aa7d",
        "cfd983eeb0903010112e0f567a7911f9003e130213031301c02cc030009f",
        "cca9cca8ccaac02bc02f009ec024c028006bc023c0270067c00ac0140039",
        "c009c0130033009d009c003d003c0035002f00ff010000ae00000011000f",
        "00000c6578616d706c652e74657374000b000403000102000a0016001400",
        "1d0017001e00190018010001010102010301040023000000160000001700",
        "00000d002a0028040305030603080708080809080a080b08040805080604",
        "0105010601030303010302040205020602002b0009080304030303020301",
        "002d00020101003300260024001d0020580c21ab6f8793e8bfdca4e60a20",
        "10c79c65eb095c205220600ad01b5146107c",
    ];

    fn openssl_hello() -> Vec<u8> {
        let hex: String = OPENSSL_HELLO_HEX.concat();
        (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect()
    }

    fn vec16(body: &[u8]) -> Vec<u8> {
        let mut v = u16::try_from(body.len()).unwrap().to_be_bytes().to_vec();
        v.extend_from_slice(body);
        v
    }

    /// A ClientHello handshake message built from RFC 8446 §4.1.2 with
    /// the given extensions (`None`: no extensions block at all).
    fn hello_message(extensions: Option<&[(u16, Vec<u8>)]>) -> Vec<u8> {
        let mut body = vec![3, 3]; // legacy_version TLS 1.2
        body.extend_from_slice(&[0xab; 32]); // random
        body.push(32); // legacy_session_id
        body.extend_from_slice(&[0x11; 32]);
        body.extend_from_slice(&vec16(&[0x13, 0x01, 0x13, 0x02])); // cipher_suites
        body.extend_from_slice(&[1, 0]); // legacy_compression_methods: null
        if let Some(exts) = extensions {
            let mut all = Vec::new();
            for (kind, data) in exts {
                all.extend_from_slice(&kind.to_be_bytes());
                all.extend_from_slice(&vec16(data));
            }
            body.extend_from_slice(&vec16(&all));
        }
        let mut msg = vec![HANDSHAKE_CLIENT_HELLO];
        msg.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes()[1..]);
        msg.extend_from_slice(&body);
        msg
    }

    /// The server_name extension's data (RFC 6066 §3) with these entries.
    fn server_name_ext(names: &[(u8, &[u8])]) -> (u16, Vec<u8>) {
        let mut list = Vec::new();
        for (kind, name) in names {
            list.push(*kind);
            list.extend_from_slice(&vec16(name));
        }
        (EXT_SERVER_NAME, vec16(&list))
    }

    /// `msg` in handshake records of at most `chunk` bytes each.
    fn records(msg: &[u8], chunk: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for part in msg.chunks(chunk) {
            out.extend_from_slice(&[CONTENT_HANDSHAKE, 3, 1]);
            out.extend_from_slice(&vec16(part));
        }
        out
    }

    fn name(s: &str) -> Old {
        Old::Name(s.to_string())
    }

    #[test]
    fn openssl_client_hello_gives_sni_and_every_prefix_needs_more() {
        let hello = openssl_hello();
        assert_eq!(hello.len(), 318);
        assert_eq!(sniff(&hello), name("example.test"));
        for n in 0..hello.len() {
            assert_eq!(sniff(&hello[..n]), Old::NeedMore, "prefix of {n} bytes");
        }
        // Bytes after the hello (a change_cipher_spec record, early data)
        // do not change the answer.
        let mut more = hello.clone();
        more.extend_from_slice(&[20, 3, 3, 0, 1, 1, 23, 3, 3, 0, 2, 0xde, 0xad]);
        assert_eq!(sniff(&more), name("example.test"));
    }

    #[test]
    fn hand_built_hellos() {
        let sni = server_name_ext(&[(0, b"Files.PythonHosted.ORG.")]);
        let alpn = (16u16, vec16(&[2, b'h', b'2']));
        let msg = hello_message(Some(&[alpn.clone(), sni.clone()]));
        assert_eq!(sniff(&records(&msg, 1 << 14)), name("files.pythonhosted.org"));
        // Fragmented over records of 7 bytes (RFC 8446 §5.1 allows it).
        let frag = records(&msg, 7);
        assert_eq!(sniff(&frag), name("files.pythonhosted.org"));
        for n in 0..frag.len() {
            assert_eq!(sniff(&frag[..n]), Old::NeedMore, "prefix of {n} bytes");
        }
        // A non-handshake record before the hello is whole: no name.
        let mut cut = records(&msg[..20], 1 << 14);
        cut.extend_from_slice(&[23, 3, 3, 0, 1, 0]);
        assert_eq!(sniff(&cut), Old::NoName);
        // No server_name extension, no extensions at all.
        assert_eq!(sniff(&records(&hello_message(Some(&[alpn])), 1 << 14)), Old::NoName);
        assert_eq!(sniff(&records(&hello_message(None), 1 << 14)), Old::NoName);
        // A name type other than host_name is skipped.
        let other = server_name_ext(&[(7, b"x"), (0, b"b.example")]);
        assert_eq!(sniff(&records(&hello_message(Some(&[other])), 100)), name("b.example"));
        // Empty, binary or over-long names are no name.
        for bad in [&b""[..], b"a\x00b", b"a b.example", &[b'a'; 300]] {
            let ext = server_name_ext(&[(0, bad)]);
            assert_eq!(sniff(&records(&hello_message(Some(&[ext])), 1 << 14)), Old::NoName);
        }
        // An extension whose length runs past the block: malformed.
        let mut msg = hello_message(Some(&[sni]));
        let n = msg.len();
        msg[n - 3] = 0xff;
        assert_eq!(sniff(&records(&msg, 1 << 14)), Old::NoName);
    }

    #[test]
    fn not_a_client_hello() {
        // A ServerHello-typed message, an SSLv2-style hello, a record with
        // version 2.x, a zero-length record, an oversized record.
        let mut server_hello = hello_message(None);
        server_hello[0] = 2;
        assert_eq!(sniff(&records(&server_hello, 1 << 14)), Old::NoName);
        assert_eq!(sniff(&[0x80, 0x2e, 0x01, 0x03, 0x01]), Old::NoName);
        assert_eq!(sniff(&[22, 2, 0, 0, 4, 1, 0, 0, 0]), Old::NoName);
        assert_eq!(sniff(&[22, 2]), Old::NoName);
        assert_eq!(sniff(&[22, 3, 1, 0, 0]), Old::NoName);
        assert_eq!(sniff(&[22, 3, 1, 0x40, 0x01]), Old::NoName);
        // A hello announcing more than fits in MAX_SNIFF_BYTES.
        assert_eq!(sniff(&[22, 3, 1, 0x40, 0x00, 1, 0x00, 0x40, 0x00]), Old::NoName);
        // A valid-looking record stream that does not complete within the
        // limit: a 16 KiB hello in 7-byte records.
        let mut big = vec![1, 0, 0x3f, 0x00];
        big.resize(4 + 0x3f00, 0);
        let stream = records(&big, 7);
        assert!(stream.len() > MAX_SNIFF_BYTES);
        assert_eq!(sniff(&stream[..MAX_SNIFF_BYTES - 1]), Old::NeedMore);
        assert_eq!(sniff(&stream), Old::NoName);
    }

    #[test]
    fn http_host() {
        let req = b"GET /simple/ HTTP/1.1\r\nUser-Agent: pip\r\nhost: PyPI.org:8080\r\nAccept: */*\r\n\r\n";
        assert_eq!(sniff(req), name("pypi.org"));
        for n in 1..req.len() {
            assert_eq!(sniff(&req[..n]), Old::NeedMore, "prefix of {n} bytes");
        }
        assert_eq!(sniff(b""), Old::NeedMore);
        let cases: &[(&[u8], Old)] = &[
            (b"POST /x HTTP/1.0\r\nHost: example.com.\r\n\r\nbody", name("example.com")),
            (b"GET / HTTP/1.1\r\nHost:  [::1]:80 \r\n\r\n", name("::1")),
            (b"GET / HTTP/1.1\r\nHost: [2001:db8::1]\r\n\r\n", name("2001:db8::1")),
            (b"GET / HTTP/1.1\r\nHost: 203.0.113.1:\r\n\r\n", name("203.0.113.1")),
            (b"GET http://a.example/ HTTP/1.1\r\nHost: a.example\r\n\r\n", name("a.example")),
            (b"GET / HTTP/1.0\r\nAccept: */*\r\n\r\n", Old::NoName),
            (b"GET / HTTP/1.1\r\nHost: \r\n\r\n", Old::NoName),
            (b"GET / HTTP/1.1\r\nHost: a.example:x\r\n\r\n", Old::NoName),
            (b"GET / HTTP/1.1\r\nHost: [::1]x\r\n\r\n", Old::NoName),
            (b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", Old::NoName),
            (b"SSH-2.0-OpenSSH_9.6\r\n", Old::NoName),
            (b"EHLO mail.example\r\n", Old::NoName),
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", Old::NoName),
            (b"\x00\x01\x02binary", Old::NoName),
            (b"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", Old::NoName),
        ];
        for (bytes, want) in cases {
            assert_eq!(&sniff(bytes), want, "{:?}", String::from_utf8_lossy(bytes));
        }
        // More headers than parsed: no name (the request is not judged by
        // a Host we did not read).
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..=crate::http::MAX_HEADERS {
            many.extend_from_slice(format!("X-{i}: y\r\n").as_bytes());
        }
        many.extend_from_slice(b"Host: a.example\r\n\r\n");
        assert_eq!(sniff(&many), Old::NoName);
        // A request head longer than MAX_SNIFF_BYTES.
        let mut long = b"GET /".to_vec();
        long.resize(MAX_SNIFF_BYTES + 10, b'a');
        assert_eq!(sniff(&long[..MAX_SNIFF_BYTES - 1]), Old::NeedMore);
        assert_eq!(sniff(&long), Old::NoName);
    }

    /// `sniff` never panics, and never asks for more past the limit.
    fn check_total(bytes: &[u8]) -> Old {
        let got = sniff(bytes);
        if bytes.len() >= MAX_SNIFF_BYTES {
            assert_ne!(got, Old::NeedMore);
        }
        got
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            check_total(&bytes);
        }

        #[test]
        fn random_after_tls_header_never_panic(
            minor in 0u8..5,
            bytes in proptest::collection::vec(any::<u8>(), 0..2048),
        ) {
            let mut v = vec![CONTENT_HANDSHAKE, 3, minor];
            v.extend_from_slice(&bytes);
            check_total(&v);
        }

        #[test]
        fn mutated_real_hello_never_panics(
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
            cut in any::<prop::sample::Index>(),
            chunk in 1usize..400,
        ) {
            let hello = openssl_hello();
            // Re-record the message into random-sized records, then flip
            // bytes and truncate.
            let mut v = records(&hello[5..], chunk);
            for (at, byte) in &flips {
                let i = at.index(v.len());
                v[i] = *byte;
            }
            let end = cut.index(v.len() + 1);
            check_total(&v[..end]);
        }

        #[test]
        fn long_inputs_never_need_more(
            kind in 0usize..3,
            fill in any::<u8>(),
            extra in 0usize..64,
        ) {
            let prefix: &[u8] = match kind {
                0 => &[CONTENT_HANDSHAKE, 3, 1, 0x3f, 0xff, 1, 0, 0x3f, 0xfb],
                1 => b"GET /",
                _ => b"",
            };
            let mut v = prefix.to_vec();
            v.resize(MAX_SNIFF_BYTES + extra, fill);
            check_total(&v);
        }

        #[test]
        fn random_http_heads_never_panic(
            host in "[ -~]{0,80}",
            junk in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut v = format!("GET / HTTP/1.1\r\nHost: {host}\r\n").into_bytes();
            v.extend_from_slice(&junk);
            check_total(&v);
        }

        #[test]
        fn any_sni_round_trips_or_is_refused(name in proptest::collection::vec(any::<u8>(), 0..300)) {
            let ext = server_name_ext(&[(0, &name)]);
            let got = sniff(&records(&hello_message(Some(&[ext])), 1 << 14));
            match got {
                Old::Name(n) => prop_assert_eq!(n, String::from_utf8_lossy(name.strip_suffix(b".").unwrap_or(&name)).to_ascii_lowercase()),
                Old::NoName => {}
                Old::NeedMore => prop_assert!(false, "complete hello needs more"),
            }
        }
    }
}
