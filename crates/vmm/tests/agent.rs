//! The guest agent in a real guest: booted as /sbin/init from an ext4 root
//! on virtio-blk, reached over virtio-vsock with the framed protocol.
//! Needs /dev/kvm (skips loudly without it).

use std::time::Duration;

use tine_protocol::{AgentError, Command, Exec, ExitStatus, Op, Python, ReadFile, Reply, Reseed, WriteFile};
use vmm::{DiskConfig, Vm, VmConfig, VmExit, VsockConfig};

fn shell(script: &str, timeout_ms: u32, output_limit: u32) -> Op {
    Op::Exec(Exec {
        command: Command::Shell(script.into()),
        cwd: None,
        env: vec![("GREETING".into(), "hi".into())],
        stdin: Vec::new(),
        timeout_ms,
        output_limit,
    })
}

fn exec_reply(r: Result<Reply, AgentError>) -> tine_protocol::ExecReply {
    match r {
        Ok(Reply::Exec(e)) => e,
        other => panic!("expected an exec reply, got {other:?}"),
    }
}

#[test]
fn agent_serves_exec_files_and_info_over_vsock() {
    if !testkit::kvm_available("agent") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let mut config = VmConfig::new("agent-test", testkit::kernel());
    config.disks = vec![DiskConfig { path: testkit::build_agent_rootfs(dir.path(), 64), read_only: true, id: "root".into() }];
    config.vsock = Some(VsockConfig { cid: 3, uds_path: uds.clone() });
    config.cmdline = "root=/dev/vda ro rootfstype=ext4".into();
    let mut vm = Vm::start(&config).expect("VM starts");
    let console = vm.console().clone();
    assert!(console.wait_for("listening on vsock port 1024", Duration::from_secs(600)), "agent never started:\n{}", console.text());
    let (stream, _) = testkit::vsock_connect(&uds, 1024).expect("connect to the agent");
    stream.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let mut agent = testkit::AgentClient::new(stream);

    assert!(matches!(agent.call(Op::Ping), Ok(Reply::Pong { .. })));

    // stdout, exit code and the environment.
    let r = exec_reply(agent.call(shell("echo $GREETING; echo oops >&2; exit 3", 0, 0)));
    assert_eq!(r.status, ExitStatus::Code(3));
    assert_eq!(r.stdout.data, b"hi\n");
    assert_eq!(r.stderr.data, b"oops\n");

    // A timeout kills the command and its children (the whole group).
    let r = exec_reply(agent.call(shell("sleep 1000 & sleep 1000", 3000, 0)));
    assert_eq!(r.status, ExitStatus::TimedOut);
    assert!(r.duration_ms < 60_000, "took {} ms", r.duration_ms);
    let ps = exec_reply(agent.call(shell("ps -o args", 0, 0)));
    let ps_out = String::from_utf8_lossy(&ps.stdout.data);
    assert!(!ps_out.contains("sleep 1000"), "a sleep survived the timeout:\n{ps_out}");

    // Output past the cap: truncated, with the real count.
    let r = exec_reply(agent.call(shell("head -c 100000 /dev/zero", 0, 1000)));
    assert_eq!((r.stdout.data.len(), r.stdout.truncated, r.stdout.total_bytes), (1000, true, 100_000));

    // A 5 MiB binary file, written then read back byte-identical.
    let blob: Vec<u8> = (0..5u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let w = agent.call(Op::WriteFile(WriteFile {
        path: "/tmp/data/blob.bin".into(),
        data: blob.clone(),
        mode: Some(0o600),
        append: false,
        create_parents: true,
    }));
    assert_eq!(w, Ok(Reply::Written { bytes: blob.len() as u64 }));
    match agent.call(Op::ReadFile(ReadFile { path: "/tmp/data/blob.bin".into(), offset: 0, length: None })) {
        Ok(Reply::File(f)) => {
            assert_eq!(f.size, blob.len() as u64);
            assert!(f.data == blob, "the file read back differs");
        }
        other => panic!("{other:?}"),
    }
    match agent.call(Op::ListDir { path: "/tmp/data".into() }) {
        Ok(Reply::Entries(e)) => {
            assert_eq!(e.len(), 1);
            assert_eq!((e[0].name.as_str(), e[0].stat.size, e[0].stat.mode), ("blob.bin", blob.len() as u64, 0o600));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        agent.call(Op::ReadFile(ReadFile { path: "/nope".into(), offset: 0, length: None })),
        Err(AgentError::NotFound { path: "/nope".into() })
    );

    // Two requests in flight: the quick one answers first.
    let slow = agent.send(shell("sleep 2", 0, 0));
    let quick = agent.send(Op::Ping);
    let first = agent.recv();
    let second = agent.recv();
    assert_eq!((first.id, second.id), (quick, slow));

    match agent.call(Op::Info) {
        Ok(Reply::Info(i)) => assert!(i.mem_total > 100 << 20 && i.uptime_ms > 0, "{i:?}"),
        other => panic!("{other:?}"),
    }
    let now_ns = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    assert_eq!(agent.call(Op::Reseed(Reseed { entropy: vec![7; 64], unix_time_ns: now_ns })), Ok(Reply::Done));
    let date = exec_reply(agent.call(shell("date +%s", 0, 0)));
    let guest_secs: u64 = String::from_utf8_lossy(&date.stdout.data).trim().parse().unwrap();
    assert!(guest_secs.abs_diff(now_ns / 1_000_000_000) < 120, "the clock was not set: {guest_secs}");
    assert!(matches!(
        agent.call(Op::Python(Python { code: "1".into(), timeout_ms: 0, output_limit: 0 })),
        Err(AgentError::Unsupported { .. })
    ));

    // Power off from inside; the VM ends cleanly.
    agent.send(Op::Exec(Exec {
        command: Command::Argv(vec!["/bin/busybox".into(), "poweroff".into(), "-f".into()]),
        cwd: None,
        env: vec![],
        stdin: vec![],
        timeout_ms: 0,
        output_limit: 0,
    }));
    let exit = vm.wait_timeout(Duration::from_secs(120));
    assert!(matches!(exit, Ok(VmExit::PowerOff)), "{exit:?}\n{}", console.last_lines(20));
}
