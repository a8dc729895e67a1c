//! Property-based fuzzing of the agent protocol (stable toolchain: proptest
//! in place of cargo-fuzz, a bounded number of cases per `cargo test`).
//!
//! Both sides decode what the other sends: the host decodes a possibly
//! hostile guest's replies, the agent the host's requests. Every message
//! type decodes arbitrary bytes and mutated valid encodings without
//! panicking; whatever decodes re-encodes to something that decodes to the
//! same value; a stream of frames with arbitrary corruption is read to its
//! end in a bounded number of steps, never allocating past the frame limit.

use proptest::prelude::*;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tine_protocol::*;

/// Decodes `bytes` as a bare `T` (no frame), and as a frame body; if it
/// decodes, the value survives a round trip (compared by its encoding:
/// `AgentInfo`'s floats may be NaN).
fn decode_as<T>(bytes: &[u8]) -> Result<(), TestCaseError>
where
    T: Serialize + DeserializeOwned,
{
    if let Ok(v) = ciborium::from_reader::<T, _>(bytes) {
        let mut enc = Vec::new();
        ciborium::into_writer(&v, &mut enc).unwrap();
        let again: T = ciborium::from_reader(&enc[..]).unwrap();
        let mut enc_again = Vec::new();
        ciborium::into_writer(&again, &mut enc_again).unwrap();
        prop_assert_eq!(enc_again, enc);
    }
    let mut body = PROTOCOL_VERSION.to_le_bytes().to_vec();
    body.extend_from_slice(bytes);
    if let Ok(v) = decode_body::<T>(&body) {
        let frame = encode(&v).unwrap();
        let again: T = read_message(&mut &frame[..]).unwrap();
        prop_assert_eq!(encode(&again).unwrap(), frame);
    }
    Ok(())
}

/// Every message type, and the types inside them; requests and responses
/// also as frame bodies of every wire (version 4's postcard included).
fn decode_every_type(bytes: &[u8]) -> Result<(), TestCaseError> {
    for wire in Wire::ALL {
        let mut body = wire.version().to_le_bytes().to_vec();
        body.extend_from_slice(bytes);
        if let Ok(req) = wire.decode_request(&body) {
            let frame = wire.encode_request(&req).unwrap();
            prop_assert_eq!(wire.decode_request(&frame[LENGTH_BYTES..]).unwrap(), req);
        }
        if let Ok(resp) = wire.decode_response(&body) {
            let frame = wire.encode_response(&resp).unwrap();
            let _ = wire.decode_response(&frame[LENGTH_BYTES..]).unwrap();
        }
    }
    decode_as::<Request>(bytes)?;
    decode_as::<Response>(bytes)?;
    decode_as::<Op>(bytes)?;
    decode_as::<Command>(bytes)?;
    decode_as::<Exec>(bytes)?;
    decode_as::<Cell>(bytes)?;
    decode_as::<ReadFile>(bytes)?;
    decode_as::<WriteFile>(bytes)?;
    decode_as::<Reseed>(bytes)?;
    decode_as::<Reply>(bytes)?;
    decode_as::<Output>(bytes)?;
    decode_as::<ExitStatus>(bytes)?;
    decode_as::<ExecReply>(bytes)?;
    decode_as::<CellException>(bytes)?;
    decode_as::<CellReply>(bytes)?;
    decode_as::<FileData>(bytes)?;
    decode_as::<FileKind>(bytes)?;
    decode_as::<FileStat>(bytes)?;
    decode_as::<DirEntry>(bytes)?;
    decode_as::<EntryKind>(bytes)?;
    decode_as::<ManifestEntry>(bytes)?;
    decode_as::<Manifest>(bytes)?;
    decode_as::<AgentInfo>(bytes)?;
    decode_as::<AgentError>(bytes)?;
    decode_as::<Result<Reply, AgentError>>(bytes)?;
    decode_as::<Spawn>(bytes)?;
    decode_as::<ProcessOutputRequest>(bytes)?;
    decode_as::<ProcessWait>(bytes)?;
    decode_as::<ProcessWrite>(bytes)?;
    decode_as::<WaitFor>(bytes)?;
    decode_as::<Progress>(bytes)?;
    decode_as::<ProcessInfo>(bytes)?;
    decode_as::<ProcessOutput>(bytes)?;
    decode_as::<ProcessWaited>(bytes)?;
    Ok(())
}

/// Valid encodings to mutate: a few requests and responses of each shape.
fn seeds() -> Vec<Vec<u8>> {
    let out = |data: &[u8]| Output { data: data.to_vec(), truncated: false, total_bytes: data.len() as u64 };
    let requests = [
        Op::Ping,
        Op::Exec(Exec {
            command: Command::Shell("echo hi".into()),
            cwd: Some("/tmp".into()),
            env: vec![("A".into(), "b".into())],
            stdin: b"in".to_vec(),
            timeout_ms: 1000,
            output_limit: 4096,
        }),
        Op::Exec(Exec {
            command: Command::Argv(vec!["ls".into(), "-l".into()]),
            cwd: None,
            env: vec![],
            stdin: vec![],
            timeout_ms: 0,
            output_limit: 0,
        }),
        Op::ReadFile(ReadFile { path: "/etc/hostname".into(), offset: 7, length: Some(1024) }),
        Op::WriteFile(WriteFile {
            path: "/x".into(),
            data: vec![1, 2, 3],
            mode: Some(0o644),
            append: true,
            create_parents: false,
        }),
        Op::Remove { path: "/x".into(), recursive: true },
        Op::Reseed(Reseed { entropy: vec![9; 32], unix_time_ns: 1 << 60 }),
        Op::Manifest { paths: Some(vec!["/tmp".into()]) },
        Op::PythonWarmUp,
        Op::ExecWithProgress {
            exec: Exec {
                command: Command::Shell("make".into()),
                cwd: None,
                env: vec![],
                stdin: vec![],
                timeout_ms: 0,
                output_limit: 0,
            },
            progress_ms: 2000,
        },
        Op::Spawn(Spawn {
            command: Command::Argv(vec!["python3".into(), "-m".into(), "http.server".into()]),
            cwd: Some("/tmp".into()),
            env: vec![("K".into(), "v".into())],
            stdin: b"x".to_vec(),
            close_stdin: false,
        }),
        Op::ProcessOutput(ProcessOutputRequest {
            id: 3,
            stream: StreamKind::Stderr,
            offset: Some(1 << 40),
            max_bytes: 7,
        }),
        Op::ProcessWait(ProcessWait {
            id: 3,
            timeout_ms: 1000,
            until: Some(WaitFor::Regex("^[0-9]+$".into())),
            streams: StreamSet::Both,
            stdout_from: 5,
            stderr_from: 0,
            progress_ms: 500,
        }),
        Op::ProcessWrite(ProcessWrite { id: 3, data: b"hello\n".to_vec(), close: true, timeout_ms: 0 }),
        Op::ProcessSignal { id: 3, signal: 15, escalate_ms: KILL_ESCALATE_MS },
        Op::SetEnv { env: vec![("API_KEY".into(), "s3cret".into())] },
        Op::Rename { from: "/tmp/a.part".into(), to: "/tmp/a".into() },
        Op::Node(Cell { code: "let x = 41; await Promise.resolve(x + 1)".into(), timeout_ms: 2000, output_limit: 0 }),
    ];
    let info = ProcessInfo {
        id: 7,
        command: "sleep 1000".into(),
        pid: 321,
        status: Some(ExitStatus::Signal(15)),
        group_alive: false,
        started_unix_ms: 1_700_000_000_000,
        ended_unix_ms: Some(1_700_000_000_500),
        stdout: StreamState { total_bytes: 300_000, buffer_start: 37_856, closed: true },
        stderr: StreamState::default(),
        stdin_open: true,
    };
    let results: Vec<Result<Reply, AgentError>> = vec![
        Ok(Reply::Done),
        Ok(Reply::Exec(ExecReply {
            status: ExitStatus::Code(3),
            stdout: out(b"out"),
            stderr: out(b"err"),
            duration_ms: 12,
        })),
        Ok(Reply::Python(CellReply {
            value: Some("42".into()),
            stdout: out(b""),
            stderr: out(b"w"),
            exception: Some(CellException { name: "E".into(), message: "m".into(), traceback: "t".into() }),
            timed_out: true,
            value_truncated: false,
            value_bytes: 2,
            interpreter_start_ms: Some(30),
        })),
        Ok(Reply::Manifest(Manifest {
            entries: vec![ManifestEntry {
                path: "/a".into(),
                kind: EntryKind::File,
                size: 5,
                mode: 0o644,
                sha256: Some("0".repeat(64)),
            }],
            truncated: false,
        })),
        Err(AgentError::NotFound { path: "/nope".into() }),
        Err(AgentError::TooLarge { size: 1 << 40, limit: 1 << 20 }),
        Ok(Reply::Progress(Progress {
            elapsed_ms: 2000,
            stdout_bytes: 12,
            stderr_bytes: 0,
            stdout_tail: b"line 1\n".to_vec(),
            stderr_tail: vec![],
        })),
        Ok(Reply::Processes(vec![info.clone(), info.clone()])),
        Ok(Reply::ProcessOutput(ProcessOutput {
            info: info.clone(),
            stream: StreamKind::Stdout,
            offset: 10,
            data: b"abc".to_vec(),
            skipped: 4,
        })),
        Ok(Reply::ProcessWaited(ProcessWaited {
            outcome: WaitOutcome::Matched,
            found: Some(WaitMatch { stream: StreamKind::Stderr, offset: 4, end: 9, line: b"Serving".to_vec() }),
            info: info.clone(),
            stdout_tail: b"t".to_vec(),
            stderr_tail: vec![],
            waited_ms: 30,
            missed: 0,
            resume: [1, 9],
        })),
        Ok(Reply::ProcessWritten { bytes: 6, info }),
        Err(AgentError::NoSuchProcess { id: 99 }),
        Err(AgentError::TooManyProcesses { max: MAX_PROCESSES as u32 }),
    ];
    let mut seeds: Vec<Vec<u8>> =
        requests.into_iter().enumerate().map(|(i, op)| encode(&Request { id: i as u64, op }).unwrap()).collect();
    seeds
        .extend(results.into_iter().enumerate().map(|(i, result)| encode(&Response { id: i as u64, result }).unwrap()));
    seeds
}

/// A mutation of a byte string: flip, overwrite, insert, delete, truncate.
#[derive(Clone, Debug)]
enum Mutation {
    Flip(usize, u8),
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Truncate(usize),
}

fn arb_mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<usize>(), prop_oneof![Just(0u8), Just(0x7f), Just(0x80), Just(0xff), any::<u8>()])
            .prop_map(|(i, b)| Mutation::Set(i, b)),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16)).prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<usize>(), 1usize..16).prop_map(|(i, n)| Mutation::Delete(i, n)),
        any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn mutate(mut b: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        let len = b.len().max(1);
        match m {
            Mutation::Flip(i, x) => {
                if let Some(v) = b.get_mut(i % len) {
                    *v ^= x;
                }
            }
            Mutation::Set(i, x) => {
                if let Some(v) = b.get_mut(i % len) {
                    *v = *x;
                }
            }
            Mutation::Insert(i, bytes) => {
                let at = i % (b.len() + 1);
                b.splice(at..at, bytes.iter().copied());
            }
            Mutation::Delete(i, n) => {
                let at = i % len;
                let end = (at + n).min(b.len());
                if at < end {
                    b.drain(at..end);
                }
            }
            Mutation::Truncate(i) => b.truncate(i % len),
        }
    }
    b
}

/// Reads frames from `stream` until it ends or breaks, decoding each body
/// as the host and the agent would. Returns the number of frames read;
/// each read consumes at least the 4-byte prefix, so this ends.
fn read_all_frames(stream: &[u8]) -> Result<usize, TestCaseError> {
    let mut r = stream;
    let mut frames = 0;
    loop {
        let before = r.len();
        match read_body(&mut r) {
            Ok(body) => {
                prop_assert!(body.len() <= MAX_FRAME_BYTES);
                prop_assert!(r.len() < before, "a frame was read without consuming input");
                let _ = decode_body::<Request>(&body);
                let _ = decode_body::<Response>(&body);
                frames += 1;
            }
            Err(_) => return Ok(frames),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    /// Arbitrary bytes, decoded as every type.
    #[test]
    fn arbitrary_bytes_decode_as_every_type_without_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        decode_every_type(&bytes)?;
    }

    /// Valid messages with a few mutations, decoded as every type: the
    /// structured inputs reach deep into the decoders.
    #[test]
    fn mutated_messages_decode_without_panic(
        seed in 0usize..64,
        muts in proptest::collection::vec(arb_mutation(), 1..6),
    ) {
        let seeds = seeds();
        let frame = &seeds[seed % seeds.len()];
        let body = mutate(frame[LENGTH_BYTES + VERSION_BYTES..].to_vec(), &muts);
        decode_every_type(&body)?;
    }

    /// Streams of valid frames with corruption anywhere (length prefixes
    /// included) are read to their end.
    #[test]
    fn corrupted_frame_streams_end(
        picks in proptest::collection::vec(0usize..64, 1..8),
        muts in proptest::collection::vec(arb_mutation(), 0..6),
    ) {
        let seeds = seeds();
        let stream: Vec<u8> = picks.iter().flat_map(|&i| seeds[i % seeds.len()].clone()).collect();
        let clean = read_all_frames(&stream)?;
        prop_assert_eq!(clean, picks.len());
        let broken = mutate(stream, &muts);
        let n = read_all_frames(&broken)?;
        prop_assert!(n <= broken.len() / (LENGTH_BYTES + VERSION_BYTES) + 1);
    }
}
