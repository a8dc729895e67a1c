//! Property tests of the wire format (every request and response round-trips;
//! arbitrary bytes and bodies decode to an error, never a panic) and unit
//! tests of its limits: frame length, vector lengths, version, wire tags.

use proptest::prelude::*;

use super::*;

fn arb_output() -> impl Strategy<Value = Output> {
    (proptest::collection::vec(any::<u8>(), 0..64), any::<bool>(), any::<u64>())
        .prop_map(|(data, truncated, total_bytes)| Output { data, truncated, total_bytes })
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        Just(Op::Ping),
        Just(Op::Info),
        Just(Op::PythonWarmUp),
        (".{0,40}", proptest::collection::vec(any::<u8>(), 0..64), any::<u32>(), any::<u32>()).prop_map(
            |(s, stdin, t, l)| {
                Op::Exec(Exec {
                    command: Command::Shell(s),
                    cwd: None,
                    env: vec![("K".into(), "V".into())],
                    stdin,
                    timeout_ms: t,
                    output_limit: l,
                })
            }
        ),
        (proptest::collection::vec(".{0,8}", 0..4)).prop_map(|argv| Op::Exec(Exec {
            command: Command::Argv(argv),
            cwd: Some("/tmp".into()),
            env: vec![],
            stdin: vec![],
            timeout_ms: DEFAULT_TIMEOUT_MS,
            output_limit: DEFAULT_OUTPUT_LIMIT
        })),
        (".{0,40}", any::<u32>()).prop_map(|(code, t)| Op::Python(Python { code, timeout_ms: t, output_limit: 10 })),
        (".{0,20}", any::<u64>(), proptest::option::of(any::<u64>()))
            .prop_map(|(path, offset, length)| Op::ReadFile(ReadFile { path, offset, length })),
        (".{0,20}", proptest::collection::vec(any::<u8>(), 0..256), any::<bool>()).prop_map(|(path, data, append)| {
            Op::WriteFile(WriteFile { path, data, mode: Some(0o600), append, create_parents: true })
        }),
        (".{0,20}", any::<bool>()).prop_map(|(path, recursive)| Op::Remove { path, recursive }),
        (proptest::collection::vec(any::<u8>(), 0..64), any::<u64>())
            .prop_map(|(entropy, unix_time_ns)| Op::Reseed(Reseed { entropy, unix_time_ns })),
        proptest::option::of(proptest::collection::vec(".{0,20}", 0..8)).prop_map(|paths| Op::Manifest { paths }),
    ]
}

fn arb_entry_kind() -> impl Strategy<Value = EntryKind> {
    prop_oneof![
        Just(EntryKind::File),
        Just(EntryKind::Dir),
        Just(EntryKind::Symlink),
        Just(EntryKind::Other),
        Just(EntryKind::Absent),
    ]
}

fn arb_manifest() -> impl Strategy<Value = Manifest> {
    let entry = (".{0,30}", arb_entry_kind(), any::<u64>(), 0u32..0o10000, proptest::option::of("[0-9a-f]{64}"))
        .prop_map(|(path, kind, size, mode, sha256)| ManifestEntry { path, kind, size, mode, sha256 });
    (proptest::collection::vec(entry, 0..8), any::<bool>())
        .prop_map(|(entries, truncated)| Manifest { entries, truncated })
}

fn arb_result() -> impl Strategy<Value = Result<Reply, AgentError>> {
    prop_oneof![
        (arb_output(), arb_output(), any::<i32>()).prop_map(|(stdout, stderr, c)| Ok(Reply::Exec(ExecReply {
            status: ExitStatus::Code(c),
            stdout,
            stderr,
            duration_ms: 3
        }))),
        (
            proptest::option::of(".{0,10}"),
            arb_output(),
            any::<bool>(),
            any::<u64>(),
            proptest::option::of(any::<u64>())
        )
            .prop_map(|(value, stdout, value_truncated, value_bytes, interpreter_start_ms)| Ok(Reply::Python(
                PythonReply {
                    value,
                    stdout,
                    stderr: Output::default(),
                    exception: Some(PythonException { name: "E".into(), message: "m".into(), traceback: "t".into() }),
                    timed_out: false,
                    value_truncated,
                    value_bytes,
                    interpreter_start_ms,
                }
            ))),
        proptest::option::of(any::<u64>())
            .prop_map(|interpreter_start_ms| Ok(Reply::PythonWarm { interpreter_start_ms })),
        Just(Ok(Reply::Done)),
        arb_manifest().prop_map(|m| Ok(Reply::Manifest(m))),
        ".{0,20}".prop_map(|reason| Err(AgentError::Unsupported { reason })),
        ".{0,20}".prop_map(|path| Err(AgentError::NotFound { path })),
        (any::<u64>(), any::<u64>()).prop_map(|(size, limit)| Err(AgentError::TooLarge { size, limit })),
    ]
}

proptest! {
    #[test]
    fn requests_round_trip(id in any::<u64>(), op in arb_op()) {
        let req = Request { id, op };
        let frame = encode(&req).unwrap();
        let back: Request = read_message(&mut &frame[..]).unwrap();
        prop_assert_eq!(back, req);
    }

    #[test]
    fn responses_round_trip(id in any::<u64>(), result in arb_result()) {
        let resp = Response { id, result };
        let frame = encode(&resp).unwrap();
        let back: Response = read_message(&mut &frame[..]).unwrap();
        prop_assert_eq!(back, resp);
    }

    /// The size bound the agent budgets a manifest reply with holds.
    #[test]
    fn manifest_entries_encode_within_their_bound(m in arb_manifest()) {
        for e in &m.entries {
            let body = postcard::to_allocvec(e).unwrap();
            prop_assert!(body.len() <= e.encoded_len_bound(), "{} > {}", body.len(), e.encoded_len_bound());
        }
    }

    /// Arbitrary bytes never panic the decoder, and it never reads (so
    /// never allocates) a body longer than the frame limit.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut r = &bytes[..];
        while let Ok(body) = read_body(&mut r) {
            prop_assert!(body.len() <= MAX_FRAME_BYTES);
            let _ = decode_body::<Request>(&body);
            let _ = decode_body::<Response>(&body);
        }
        let _ = decode_body::<Request>(&bytes);
        let _ = decode_body::<Response>(&bytes);
    }

    /// A valid version followed by arbitrary bytes: decode errors, no panic.
    #[test]
    fn arbitrary_bodies_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut body = PROTOCOL_VERSION.to_le_bytes().to_vec();
        body.extend_from_slice(&bytes);
        let _ = decode_body::<Request>(&body);
        let _ = decode_body::<Response>(&body);
    }
}

#[test]
fn an_oversized_length_is_refused_before_reading_the_body() {
    // Claims 4 GiB; only the 4-byte prefix may be consumed.
    let mut input: &[u8] = &[0xff, 0xff, 0xff, 0xff, 1, 0, 9, 9, 9];
    let err = read_body(&mut input).unwrap_err();
    assert!(matches!(err, ProtocolError::FrameTooLarge { len: 0xffff_ffff, .. }), "{err}");
    assert_eq!(input.len(), 5, "the body must not be read");
    // Just over the limit.
    let over = ((MAX_FRAME_BYTES + 1) as u32).to_le_bytes();
    assert!(matches!(body_len(over), Err(ProtocolError::FrameTooLarge { .. })));
}

#[test]
fn a_huge_vec_length_inside_a_small_frame_does_not_allocate_it() {
    // A WriteFile whose data length prefix claims ~2^63 bytes: postcard
    // must fail on the short input rather than reserve that much.
    let mut body = PROTOCOL_VERSION.to_le_bytes().to_vec();
    body.push(0); // id = 0 (varint)
    body.push(4); // Op::WriteFile
    body.push(1); // path length 1
    body.push(b'/');
    body.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]); // data length varint
    body.extend_from_slice(&[1, 2, 3]);
    assert!(matches!(decode_body::<Request>(&body), Err(ProtocolError::Decode(_))));
}

#[test]
fn version_mismatch_and_eof_are_typed() {
    let mut frame = encode(&Request { id: 1, op: Op::Ping }).unwrap();
    frame[LENGTH_BYTES] = 9;
    let err = read_message::<_, Request>(&mut &frame[..]).unwrap_err();
    assert!(matches!(err, ProtocolError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: 9 }), "{err}");
    assert!(matches!(read_body(&mut &[][..]), Err(ProtocolError::Closed)));
    assert!(matches!(read_body(&mut &[5u8, 0][..]), Err(ProtocolError::Io(_))));
    assert!(matches!(read_body(&mut &[1u8, 0, 0, 0, 1][..]), Err(ProtocolError::FrameTooShort(1))));
}

#[test]
fn a_frame_over_the_limit_is_not_encoded() {
    let big = Request {
        id: 1,
        op: Op::WriteFile(WriteFile {
            path: "/x".into(),
            data: vec![0; MAX_FRAME_BYTES],
            mode: None,
            append: false,
            create_parents: false,
        }),
    };
    assert!(matches!(encode(&big), Err(ProtocolError::Encode(_))));
    let ok = Request {
        id: 1,
        op: Op::WriteFile(WriteFile {
            path: "/x".into(),
            data: vec![7; MAX_FILE_CHUNK as usize],
            mode: None,
            append: false,
            create_parents: false,
        }),
    };
    let frame = encode(&ok).unwrap();
    assert!(frame.len() < MAX_FRAME_BYTES, "a full file chunk fits in a frame");
    assert_eq!(read_message::<_, Request>(&mut &frame[..]).unwrap(), ok);
}

#[test]
fn limits_default_and_cap() {
    assert_eq!(effective_limits(0, 0).unwrap(), (DEFAULT_TIMEOUT_MS, DEFAULT_OUTPUT_LIMIT));
    assert_eq!(effective_limits(5, 7).unwrap(), (5, 7));
    assert_eq!(effective_limits(MAX_TIMEOUT_MS, MAX_OUTPUT_LIMIT).unwrap(), (MAX_TIMEOUT_MS, MAX_OUTPUT_LIMIT));
    assert!(matches!(effective_limits(MAX_TIMEOUT_MS + 1, 0), Err(AgentError::InvalidRequest { .. })));
    assert!(matches!(effective_limits(0, MAX_OUTPUT_LIMIT + 1), Err(AgentError::InvalidRequest { .. })));
}

#[test]
fn manifest_request_and_reply_round_trip() {
    for paths in [None, Some(vec![]), Some(vec!["/etc/hosts".to_string(), "/tmp/x y".to_string()])] {
        let req = Request { id: 7, op: Op::Manifest { paths } };
        let frame = encode(&req).unwrap();
        assert_eq!(read_message::<_, Request>(&mut &frame[..]).unwrap(), req);
    }
    let manifest = Manifest {
        entries: vec![
            ManifestEntry { path: "/etc".into(), kind: EntryKind::Dir, size: 0, mode: 0o755, sha256: None },
            ManifestEntry { path: "/etc/gone".into(), kind: EntryKind::Absent, size: 0, mode: 0, sha256: None },
            ManifestEntry {
                path: "/usr/bin/sudo".into(),
                kind: EntryKind::File,
                size: u64::MAX,
                mode: 0o4755,
                sha256: Some("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855".into()),
            },
        ],
        truncated: true,
    };
    let resp = Response { id: 7, result: Ok(Reply::Manifest(manifest)) };
    let frame = encode(&resp).unwrap();
    assert_eq!(read_message::<_, Response>(&mut &frame[..]).unwrap(), resp);
}

#[test]
fn existing_ops_keep_their_wire_tags() {
    // Op::Manifest is appended: an old host's requests still decode the same.
    assert_eq!(postcard::to_allocvec(&Op::Ping).unwrap(), [0]);
    assert_eq!(postcard::to_allocvec(&Op::Info).unwrap(), [9]);
    assert_eq!(postcard::to_allocvec(&Op::Manifest { paths: None }).unwrap(), [11, 0]);
    assert_eq!(postcard::to_allocvec(&Reply::Done).unwrap(), [8]);
}
