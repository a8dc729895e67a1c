//! Property tests of the wire format (every request and response round-trips;
//! arbitrary bytes and bodies decode to an error, never a panic) and unit
//! tests of its limits: frame length, vector lengths, version, wire tags.

use proptest::prelude::*;

use super::*;

fn arb_output() -> impl Strategy<Value = Output> {
    (proptest::collection::vec(any::<u8>(), 0..64), any::<bool>(), any::<u64>())
        .prop_map(|(data, truncated, total_bytes)| Output { data, truncated, total_bytes })
}

fn arb_command() -> impl Strategy<Value = Command> {
    prop_oneof![".{0,40}".prop_map(Command::Shell), proptest::collection::vec(".{0,8}", 0..4).prop_map(Command::Argv)]
}

fn arb_stream() -> impl Strategy<Value = StreamKind> {
    prop_oneof![Just(StreamKind::Stdout), Just(StreamKind::Stderr)]
}

fn arb_stream_set() -> impl Strategy<Value = StreamSet> {
    prop_oneof![Just(StreamSet::Stdout), Just(StreamSet::Stderr), Just(StreamSet::Both)]
}

fn arb_wait_for() -> impl Strategy<Value = Option<WaitFor>> {
    proptest::option::of(prop_oneof![".{0,20}".prop_map(WaitFor::Text), ".{0,20}".prop_map(WaitFor::Regex)])
}

/// The new process and progress operations (protocol 3).
fn arb_process_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (arb_command(), any::<u32>(), any::<u32>()).prop_map(|(command, timeout_ms, progress_ms)| {
            Op::ExecWithProgress {
                exec: Exec { command, cwd: None, env: vec![], stdin: vec![1], timeout_ms, output_limit: 0 },
                progress_ms,
            }
        }),
        (
            arb_command(),
            proptest::option::of(".{0,10}"),
            proptest::collection::vec((".{0,4}", ".{0,4}"), 0..3),
            proptest::collection::vec(any::<u8>(), 0..64),
            any::<bool>()
        )
            .prop_map(|(command, cwd, env, stdin, close_stdin)| Op::Spawn(Spawn {
                command,
                cwd,
                env,
                stdin,
                close_stdin
            })),
        Just(Op::ProcessList),
        (any::<u64>(), arb_stream(), proptest::option::of(any::<u64>()), any::<u32>()).prop_map(
            |(id, stream, offset, max_bytes)| Op::ProcessOutput(ProcessOutputRequest { id, stream, offset, max_bytes })
        ),
        (any::<u64>(), any::<u32>(), arb_wait_for(), arb_stream_set(), any::<u64>(), any::<u64>(), any::<u32>())
            .prop_map(|(id, timeout_ms, until, streams, stdout_from, stderr_from, progress_ms)| {
                Op::ProcessWait(ProcessWait { id, timeout_ms, until, streams, stdout_from, stderr_from, progress_ms })
            }),
        (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..64), any::<bool>(), any::<u32>())
            .prop_map(|(id, data, close, timeout_ms)| Op::ProcessWrite(ProcessWrite { id, data, close, timeout_ms })),
        (any::<u64>(), any::<i32>(), any::<u32>()).prop_map(|(id, signal, escalate_ms)| Op::ProcessSignal {
            id,
            signal,
            escalate_ms
        }),
        proptest::collection::vec((".{0,8}", ".{0,8}"), 0..4).prop_map(|env| Op::SetEnv { env }),
        (".{0,12}", ".{0,12}").prop_map(|(from, to)| Op::Rename { from, to }),
        (".{0,40}", any::<u32>(), any::<u32>()).prop_map(|(code, timeout_ms, output_limit)| Op::Node(Cell {
            code,
            timeout_ms,
            output_limit
        })),
        (proptest::option::of(".{0,12}"), proptest::option::of(".{0,12}"))
            .prop_map(|(user, working_dir)| Op::SetProcessDefaults(ProcessDefaults { user, working_dir })),
        (".{0,20}", ".{0,12}", any::<bool>()).prop_map(|(serial, path, read_only)| Op::Mount(Mount {
            serial,
            path,
            read_only
        })),
        ".{0,12}".prop_map(|path| Op::Unmount { path }),
        ".{0,40}".prop_map(|pem| Op::InstallTrust { pem }),
        proptest::collection::vec((".{0,8}", ".{0,8}"), 0..4).prop_map(|env| Op::SetHostEnv { env }),
        any::<u64>().prop_map(|id| Op::Cancel { id }),
    ]
}

fn arb_exit_status() -> impl Strategy<Value = ExitStatus> {
    prop_oneof![
        any::<i32>().prop_map(ExitStatus::Code),
        any::<i32>().prop_map(ExitStatus::Signal),
        Just(ExitStatus::TimedOut)
    ]
}

fn arb_stream_state() -> impl Strategy<Value = StreamState> {
    (any::<u64>(), any::<u64>(), any::<bool>()).prop_map(|(total_bytes, buffer_start, closed)| StreamState {
        total_bytes,
        buffer_start,
        closed,
    })
}

fn arb_process_info() -> impl Strategy<Value = ProcessInfo> {
    (
        (any::<u64>(), ".{0,30}", any::<i32>(), proptest::option::of(arb_exit_status()), any::<bool>()),
        (any::<u64>(), proptest::option::of(any::<u64>()), arb_stream_state(), arb_stream_state(), any::<bool>()),
    )
        .prop_map(
            |(
                (id, command, pid, status, group_alive),
                (started_unix_ms, ended_unix_ms, stdout, stderr, stdin_open),
            )| {
                ProcessInfo {
                    id,
                    command,
                    pid,
                    status,
                    group_alive,
                    started_unix_ms,
                    ended_unix_ms,
                    stdout,
                    stderr,
                    stdin_open,
                }
            },
        )
}

fn arb_bytes() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..64)
}

/// The new process and progress replies and errors (protocol 3).
fn arb_process_result() -> impl Strategy<Value = Result<Reply, AgentError>> {
    let outcome = prop_oneof![Just(WaitOutcome::Matched), Just(WaitOutcome::Exited), Just(WaitOutcome::TimedOut)];
    let found = proptest::option::of(
        (arb_stream(), any::<u64>(), any::<u64>(), arb_bytes()).prop_map(|(stream, offset, end, line)| WaitMatch {
            stream,
            offset,
            end,
            line,
        }),
    );
    prop_oneof![
        (any::<u64>(), any::<u64>(), any::<u64>(), arb_bytes(), arb_bytes()).prop_map(
            |(elapsed_ms, stdout_bytes, stderr_bytes, stdout_tail, stderr_tail)| Ok(Reply::Progress(Progress {
                elapsed_ms,
                stdout_bytes,
                stderr_bytes,
                stdout_tail,
                stderr_tail
            }))
        ),
        arb_process_info().prop_map(|i| Ok(Reply::Process(i))),
        proptest::collection::vec(arb_process_info(), 0..4).prop_map(|v| Ok(Reply::Processes(v))),
        (arb_process_info(), arb_stream(), any::<u64>(), arb_bytes(), any::<u64>()).prop_map(
            |(info, stream, offset, data, skipped)| Ok(Reply::ProcessOutput(ProcessOutput {
                info,
                stream,
                offset,
                data,
                skipped
            }))
        ),
        (
            (outcome, found, arb_process_info()),
            (arb_bytes(), arb_bytes(), any::<u64>(), any::<u64>(), any::<[u64; 2]>())
        )
            .prop_map(|((outcome, found, info), (stdout_tail, stderr_tail, waited_ms, missed, resume))| Ok(
                Reply::ProcessWaited(ProcessWaited {
                    outcome,
                    found,
                    info,
                    stdout_tail,
                    stderr_tail,
                    waited_ms,
                    missed,
                    resume
                })
            )),
        (any::<u64>(), arb_process_info()).prop_map(|(bytes, info)| Ok(Reply::ProcessWritten { bytes, info })),
        any::<u64>().prop_map(|id| Err(AgentError::NoSuchProcess { id })),
        any::<u32>().prop_map(|max| Err(AgentError::TooManyProcesses { max })),
    ]
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        arb_process_op(),
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
        (".{0,40}", any::<u32>()).prop_map(|(code, t)| Op::Python(Cell { code, timeout_ms: t, output_limit: 10 })),
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
        arb_process_result(),
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
                CellReply {
                    value,
                    stdout,
                    stderr: Output::default(),
                    exception: Some(CellException { name: "E".into(), message: "m".into(), traceback: "t".into() }),
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

    /// Every message goes through version 4 and back unchanged (re-shaped
    /// by name to the frozen types, postcard, and back), and through each
    /// wire's request and response paths; an operation added after version
    /// 4 is refused for it before anything is sent.
    #[test]
    fn messages_round_trip_through_every_wire(id in any::<u64>(), op in arb_op(), result in arb_result()) {
        let after_v4 = matches!(
            op,
            Op::SetProcessDefaults(_)
                | Op::Mount(_)
                | Op::Unmount { .. }
                | Op::InstallTrust { .. }
                | Op::SetHostEnv { .. }
                | Op::Cancel { .. }
        );
        let req = Request { id, op };
        let resp = Response { id, result };
        for wire in Wire::ALL {
            if after_v4 && wire == Wire::V4 {
                let refused = wire.encode_request(&req);
                prop_assert!(matches!(refused, Err(ProtocolError::UnknownOp { .. })), "{:?}", refused);
            } else {
                let frame = wire.encode_request(&req).unwrap();
                let body = read_body(&mut &frame[..]).unwrap();
                prop_assert_eq!(body_version(&body).unwrap(), wire.version());
                prop_assert_eq!(wire.decode_request(&body).unwrap(), req.clone());
            }
            let frame = wire.encode_response(&resp).unwrap();
            let body = read_body(&mut &frame[..]).unwrap();
            prop_assert_eq!(wire.decode_response(&body).unwrap(), resp.clone());
        }
    }

    /// The size bound the agent budgets a manifest reply with holds.
    #[test]
    fn manifest_entries_encode_within_their_bound(m in arb_manifest()) {
        for e in &m.entries {
            let mut body = Vec::new();
            ciborium::into_writer(e, &mut body).unwrap();
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
    // A WriteFile whose data byte string claims ~2^63 bytes: the decoder
    // must fail on the short input rather than reserve that much, also
    // where the operation is first read as a CBOR value (the agent's
    // `Wire::decode_request`).
    let mut body = PROTOCOL_VERSION.to_le_bytes().to_vec();
    body.extend_from_slice(&[0xa2, 0x62, b'i', b'd', 0x00, 0x62, b'o', b'p', 0xa1, 0x69]);
    body.extend_from_slice(b"WriteFile");
    body.extend_from_slice(&[0xa1, 0x64, b'd', b'a', b't', b'a', 0x5b]);
    body.extend_from_slice(&[0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
    body.extend_from_slice(&[1, 2, 3]);
    assert!(matches!(decode_body::<Request>(&body), Err(ProtocolError::Decode(_))));
    assert!(matches!(Wire::V5.decode_request(&body), Err(ProtocolError::Decode(_))));
    // The same in version 4 (postcard's varint length).
    let mut body = v4::VERSION.to_le_bytes().to_vec();
    body.extend_from_slice(&[0, 4, 1, b'/']); // id 0, Op::WriteFile, path "/"
    body.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]); // data length varint
    body.extend_from_slice(&[1, 2, 3]);
    assert!(matches!(Wire::V4.decode_request(&body), Err(ProtocolError::Decode(_))));
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
    assert!(matches!(encode(&big), Err(ProtocolError::FrameTooLarge { max: MAX_FRAME_BYTES, .. })));
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
fn version_4_keeps_its_wire_tags() {
    // The frozen version 4 types encode as that release did (postcard is
    // positional: a tag is the variant's index). Op::Manifest was appended.
    assert_eq!(postcard::to_allocvec(&v4::Op::Ping).unwrap(), [0]);
    assert_eq!(postcard::to_allocvec(&v4::Op::Info).unwrap(), [9]);
    assert_eq!(postcard::to_allocvec(&v4::Op::Manifest { paths: None }).unwrap(), [11, 0]);
    assert_eq!(postcard::to_allocvec(&v4::Reply::Done).unwrap(), [8]);
    // Protocol 3 appends its operations, replies and errors after them.
    assert_eq!(postcard::to_allocvec(&v4::Op::PythonWarmUp).unwrap(), [12]);
    assert_eq!(postcard::to_allocvec(&v4::Op::ProcessList).unwrap(), [15]);
    assert_eq!(
        postcard::to_allocvec(&v4::Op::ProcessSignal { id: 1, signal: 15, escalate_ms: 0 }).unwrap(),
        [19, 1, 30, 0] // i32 is zigzag-encoded
    );
    assert_eq!(postcard::to_allocvec(&v4::Reply::Processes(vec![])).unwrap(), [13, 0]);
    assert_eq!(postcard::to_allocvec(&v4::AgentError::NoSuchProcess { id: 7 }).unwrap(), [10, 7]);
    // Protocol 4 appends the sandbox environment.
    assert_eq!(postcard::to_allocvec(&v4::Op::SetEnv { env: vec![] }).unwrap(), [20, 0]);
    assert_eq!(
        postcard::to_allocvec(&v4::Op::Rename { from: "/a".into(), to: String::new() }).unwrap(),
        [21, 2, b'/', b'a', 0]
    );
    // ... and the Node.js interpreter, with Op::Python's request shape.
    let node = v4::Op::Node(v4::Python { code: "1".into(), timeout_ms: 2, output_limit: 3 });
    assert_eq!(postcard::to_allocvec(&node).unwrap(), [22, 1, b'1', 2, 3]);
}

#[test]
fn sandbox_env_limits() {
    let env = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
    assert_eq!(check_sandbox_env(&[]), Ok(()));
    assert_eq!(check_sandbox_env(&env(&[("API_KEY", "s3cret"), ("_x1", ""), ("PATH", "/a:/b")])), Ok(()));
    for (bad, says) in [
        (env(&[("", "v")]), "name \"\""),
        (env(&[("1X", "v")]), "not starting with a digit"),
        (env(&[("A=B", "v")]), "name \"A=B\""),
        (env(&[("A-B", "v")]), "letters, digits"),
        (env(&[("A", "x\0y")]), "NUL"),
        (env(&[("A", "1"), ("A", "2")]), "twice"),
        (env(&[("A", &"x".repeat(MAX_SANDBOX_ENV_BYTES))]), "bytes: at most"),
    ] {
        match check_sandbox_env(&bad) {
            Err(AgentError::InvalidRequest { reason }) => assert!(reason.contains(says), "{reason} lacks {says:?}"),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    let many: Vec<_> = (0..=MAX_SANDBOX_ENV_VARS).map(|i| (format!("V{i}"), String::new())).collect();
    assert!(check_sandbox_env(&many).is_err());
    assert!(check_sandbox_env(&many[..MAX_SANDBOX_ENV_VARS]).is_ok());
    // A long name is quoted cut.
    let long = env(&[(&"é".repeat(1000), "v")]);
    let Err(AgentError::InvalidRequest { reason }) = check_sandbox_env(&long) else { panic!() };
    assert!(reason.len() < 300, "{reason}");
}

/// The limits the agent and host share hold together: a page, a wait's
/// line and tails fit in a frame many times over; the table's rings fit
/// the guest budget of the design (16 MiB).
#[test]
fn process_limits_are_consistent() {
    const {
        assert!(MAX_PROCESS_CHUNK as usize <= PROCESS_BUFFER_BYTES);
        assert!(MAX_SPAWN_STDIN <= MAX_PROCESS_WRITE);
        assert!(MAX_PROCESS_WRITE + 1024 < MAX_FRAME_BYTES);
        assert!(MAX_PROCESSES * 2 * PROCESS_BUFFER_BYTES <= 16 << 20);
    }
    let info = ProcessInfo {
        id: u64::MAX,
        command: "x".repeat(PROCESS_COMMAND_BYTES),
        pid: i32::MAX,
        status: Some(ExitStatus::Signal(9)),
        group_alive: true,
        started_unix_ms: u64::MAX,
        ended_unix_ms: Some(u64::MAX),
        stdout: StreamState { total_bytes: u64::MAX, buffer_start: u64::MAX, closed: true },
        stderr: StreamState::default(),
        stdin_open: false,
    };
    let list = Response { id: 1, result: Ok(Reply::Processes(vec![info.clone(); MAX_PROCESSES])) };
    assert!(encode(&list).unwrap().len() < 64 << 10);
    let page = Response {
        id: 2,
        result: Ok(Reply::ProcessOutput(ProcessOutput {
            info,
            stream: StreamKind::Stderr,
            offset: 3,
            data: vec![0xff; MAX_PROCESS_CHUNK as usize],
            skipped: 9,
        })),
    };
    let frame = encode(&page).unwrap();
    assert_eq!(read_message::<_, Response>(&mut &frame[..]).unwrap(), page);
}

/// A CBOR frame body of the current version holding `value`.
fn cbor_body(value: &ciborium::Value) -> Vec<u8> {
    let mut body = PROTOCOL_VERSION.to_le_bytes().to_vec();
    ciborium::into_writer(value, &mut body).unwrap();
    body
}

fn text(s: &str) -> ciborium::Value {
    ciborium::Value::Text(s.into())
}

#[test]
fn a_newer_peers_fields_are_ignored_and_its_operations_answered_by_id() {
    use ciborium::Value;
    // A request whose Exec carries a field this version does not know.
    let mut exec = Value::serialized(&Exec {
        command: Command::Shell("true".into()),
        cwd: None,
        env: vec![],
        stdin: vec![],
        timeout_ms: 5,
        output_limit: 6,
    })
    .unwrap();
    if let Value::Map(fields) = &mut exec {
        fields.push((text("niceness"), Value::Integer(3.into())));
    }
    let req = Value::Map(vec![
        (text("id"), Value::Integer(41.into())),
        (text("op"), Value::Map(vec![(text("Exec"), exec)])),
        (text("trace"), text("abc")),
    ]);
    let got = Wire::V5.decode_request(&cbor_body(&req)).unwrap();
    assert_eq!(got.id, 41);
    assert!(matches!(got.op, Op::Exec(Exec { timeout_ms: 5, output_limit: 6, .. })), "{got:?}");
    // An operation this version does not know, with and without a body:
    // the error carries the id to answer.
    for op in [text("Teleport"), Value::Map(vec![(text("Teleport"), Value::Map(vec![]))])] {
        let req = Value::Map(vec![(text("id"), Value::Integer(42.into())), (text("op"), op)]);
        match Wire::V5.decode_request(&cbor_body(&req)) {
            Err(ProtocolError::UnknownOp { id: 42, reason }) => assert!(reason.contains("Teleport"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }
    // A reply with a field this version does not know.
    let mut pong =
        Value::serialized(&Response { id: 7, result: Ok(Reply::Pong { agent_version: "9".into() }) }).unwrap();
    if let Value::Map(fields) = &mut pong {
        fields.push((text("elapsed_us"), Value::Integer(12.into())));
    }
    let back = Wire::V5.decode_response(&cbor_body(&pong)).unwrap();
    assert_eq!(back, Response { id: 7, result: Ok(Reply::Pong { agent_version: "9".into() }) });
}

#[test]
fn a_frame_of_another_version_is_refused_by_each_wire() {
    let v5 = Wire::V5.encode_request(&Request { id: 1, op: Op::Ping }).unwrap();
    let v4 = Wire::V4.encode_request(&Request { id: 1, op: Op::Ping }).unwrap();
    let err = Wire::V4.decode_request(&v5[LENGTH_BYTES..]).unwrap_err();
    assert!(matches!(err, ProtocolError::VersionMismatch { ours: 4, theirs: 5 }), "{err}");
    let err = Wire::V5.decode_request(&v4[LENGTH_BYTES..]).unwrap_err();
    assert!(matches!(err, ProtocolError::VersionMismatch { ours: 5, theirs: 4 }), "{err}");
    assert_eq!(Wire::of_version(4), Some(Wire::V4));
    assert_eq!(Wire::of_version(5), Some(Wire::V5));
    assert_eq!(Wire::of_version(6), None);
    // Version 4's bytes are what that release sent: Ping is variant 0.
    assert_eq!(&v4[LENGTH_BYTES..], &[4, 0, 1, 0]);
}
