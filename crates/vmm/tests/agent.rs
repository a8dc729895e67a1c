//! The guest agent in a real guest: booted as /sbin/init from an ext4 root
//! on virtio-blk, reached over virtio-vsock with the framed protocol.
//! Needs /dev/kvm (skips loudly without it). The guest is the busybox
//! image (2 vCPUs); it also serves device_thread.rs's checks of a booted
//! guest (an idle device thread, the console log's cap) and the machine
//! state's save and restore (was vcpu_state.rs), so that they need no
//! boot of their own. The agent on the Debian image (bash, the Python
//! interpreter, the overlay root) is what every guest of crate tine's
//! tests runs: their checks are there (`mcp.rs`, `processes.rs`,
//! `storage.rs`) and in crate tine-sandbox's `python_warm.rs`.

mod common;

use std::time::Duration;

use tine_protocol::{AgentError, Cell, Command, Exec, ExitStatus, Op, ReadFile, Reply, Reseed, WriteFile};
use vmm::{DiskConfig, VmConfig, VmOutcome, VsockConfig};

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

/// The console log's cap in the busybox guest (see
/// [`idle_guest_sleeps_and_a_console_flood_stays_under_the_cap`]).
const CONSOLE_CAP: u64 = 4 << 10;

/// The busybox guest: the agent's exec, files and info, and, on the same
/// boot, [`idle_guest_sleeps_and_a_console_flood_stays_under_the_cap`].
#[test]
fn agent_serves_exec_files_and_info_over_vsock() {
    if !testkit::kvm_available("agent") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let log = dir.path().join("console.log");
    let mut config = VmConfig::new("agent-test", testkit::kernel());
    // The busybox image as a registry holds it, made a base image by
    // tine-image: what a template from an image boots.
    config.disks = vec![DiskConfig::raw(testkit::oci::busybox_image_rootfs(dir.path()), true, "root")];
    config.vsock = Some(VsockConfig { cid: 3, uds_path: uds.clone() });
    config.cmdline = testkit::oci::IMAGE_CMDLINE.into();
    config.console_log = Some(log.clone());
    config.console_log_max_bytes = CONSOLE_CAP;
    config.vcpus = 2;
    let mut vm = vmm::build_for_boot(&config).expect("VM starts");
    let console = vm.console().clone();
    assert!(
        console.wait_for("listening on vsock port 1024", Duration::from_secs(600)),
        "agent never started:\n{}",
        console.text()
    );
    let mut agent = testkit::BlockingAgent::connect(&uds).expect("connect to the agent");

    assert!(matches!(agent.call(Op::Ping), Ok(Reply::Pong { .. })));

    idle_guest_sleeps_and_a_console_flood_stays_under_the_cap(&mut agent, &config.name, &console, &log);

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

    // A binary file, written then read back byte-identical: 1 MiB (four
    // times the guest socket's 256 KiB receive window), 5 MiB with
    // TINE_TEST_FULL (each MiB in is some 4 s of guest kernel work here).
    let blob_mib = if testkit::full_size() { 5u32 } else { 1 };
    let blob: Vec<u8> = (0..blob_mib << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
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
    // This image has no python3: a typed error, not a hang.
    assert!(matches!(
        agent.call(Op::Python(Cell { code: "1".into(), timeout_ms: 0, output_limit: 0 })),
        Err(AgentError::Unsupported { .. })
    ));

    let rt = tokio::runtime::Runtime::new().unwrap();
    machine_state_saves_and_restores_on_a_running_guest(&mut vm, &uds, &console, &rt);

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
    assert!(matches!(exit, Ok(VmOutcome::PowerOff)), "{exit:?}\n{}", console.last_lines(20));
}

/// From device_thread.rs, on the busybox guest booted above (named `vm`,
/// its console log at `log` capped at [`CONSOLE_CAP`]): the device thread
/// of an idle guest with the agent's connection open sleeps (see
/// `common::threads`), and a guest flooding its serial console leaves the
/// console log under its cap.
fn idle_guest_sleeps_and_a_console_flood_stays_under_the_cap(
    agent: &mut testkit::BlockingAgent,
    vm: &str,
    console: &vmm::devices::ConsoleTail,
    log: &std::path::Path,
) {
    // Five times the cap: rotated at each cap's worth, the old log
    // replaced each time. Each byte is a UART write through the emulated
    // guest kernel (a VM exit and an interrupt), so the flood is small.
    const FLOOD: u64 = 20 << 10;

    // Idle, with the agent's connection open.
    testkit::with_console_on_panic(console, || common::threads::assert_sleeps(vm, "idle guest, agent connected"));

    // The guest writes several times the cap to its serial port.
    let r = exec_reply(agent.call(shell(&format!("head -c {FLOOD} /dev/zero | tr '\\0' x > /dev/ttyS0"), 600_000, 0)));
    assert_eq!(r.status, ExitStatus::Code(0), "{}", String::from_utf8_lossy(&r.stderr.data));
    let cur = std::fs::metadata(log).unwrap().len();
    let old = std::fs::metadata(log.with_extension("log.1")).map(|m| m.len()).unwrap_or(0);
    eprintln!("console.log {cur} bytes, console.log.1 {old} bytes, cap {CONSOLE_CAP}, flood {FLOOD}");
    assert!(cur <= CONSOLE_CAP && old <= CONSOLE_CAP, "console logs past the cap: {cur} and {old} bytes");
    assert_eq!(old, CONSOLE_CAP, "the log was not rotated");
    assert!(console.text().contains(&"x".repeat(1000)), "the flood did not reach the console");
}

/// MSR_LSTAR: the 64-bit system-call entry, set by every Linux guest.
const MSR_LSTAR: u32 = 0xc000_0082;

/// Was vcpu_state.rs (its own boot of a guest): saving and restoring
/// machine state on a real guest. Pause the booted guest `vm` (2 vCPUs,
/// its agent behind `uds`), save every vCPU and the VM-wide state
/// (interrupt controllers, PIT, clock), put it all back (after a round
/// trip through serde), resume, and the guest goes on.
fn machine_state_saves_and_restores_on_a_running_guest(
    vm: &mut vmm::RunningVm,
    uds: &std::path::Path,
    console: &vmm::devices::ConsoleTail,
    rt: &tokio::runtime::Runtime,
) {
    use std::sync::Arc;
    use vmm::vcpu_state::VcpuState;
    use vmm::ControlError;

    assert!(matches!(vm.save_vcpu_states(), Err(ControlError::NotPaused)), "saving needs a pause");
    let took = vm.pause(Duration::from_secs(5)).expect("pause");
    eprintln!("paused in {took:?}");
    let states = vm.save_vcpu_states().expect("save");
    assert_eq!(states.len(), 2);
    for (i, s) in states.iter().enumerate() {
        eprintln!("{s:?}");
        assert_eq!(usize::from(s.index), i);
        // Paused where it ran: in the kernel (CPL 0, the upper half) or in a
        // user process (CPL 3, a canonical lower-half address); CI saw both.
        let in_kernel = s.sregs.cs.selector & 3 == 0 && s.regs.rip >= 0xffff_ffff_8000_0000;
        let in_user = s.sregs.cs.selector & 3 == 3 && s.regs.rip < 0x0000_8000_0000_0000;
        assert!(
            in_kernel || in_user,
            "vCPU {i}'s CS and RIP disagree: {:#x} at {:#x}",
            s.sregs.cs.selector,
            s.regs.rip
        );
        assert_ne!(s.sregs.cr3, 0);
        assert_ne!(s.sregs.efer & (1 << 10), 0, "long mode active");
        assert!(s.msrs.iter().any(|m| m.index == MSR_LSTAR), "LSTAR saved");
    }
    // Through a serializer and back, as a snapshot file will carry them.
    let restored: Vec<Arc<VcpuState>> =
        states.iter().map(|s| Arc::new(serde_json::from_str(&serde_json::to_string(s).unwrap()).unwrap())).collect();
    assert_eq!(restored[0].regs.rip, states[0].regs.rip);
    assert_eq!(restored[1].lapic.regs, states[1].lapic.regs);
    let vm_state = vm.save_vm_state().expect("save VM state");
    eprintln!("{vm_state:?}");
    assert_ne!(vm_state.clock.clock, 0);
    let vm_state: vmm::vm_state::VmState = serde_json::from_str(&serde_json::to_string(&vm_state).unwrap()).unwrap();
    vm.restore_vm_state(&vm_state).expect("restore VM state");
    vm.restore_vcpu_states(&restored).expect("restore");
    let again = vm.save_vcpu_states().expect("save after restore");
    for (a, b) in states.iter().zip(&again) {
        assert_eq!((a.regs.rip, a.regs.rsp, a.sregs.cr3), (b.regs.rip, b.regs.rsp, b.sregs.cr3));
    }
    vm.resume();

    // The guest goes on: the agent answers, twice, on both vCPUs' watch
    // (a new connection, as vcpu_state.rs made).
    testkit::with_console_on_panic(console, || {
        rt.block_on(async {
            let agent = tine_agent_client::AgentClient::connect(uds, tine_agent_client::AGENT_PORT).await.unwrap();
            for _ in 0..2 {
                let r = agent.exec("echo alive", 0, 0).await.unwrap();
                assert_eq!((r.status, r.stdout.data.as_slice()), (ExitStatus::Code(0), &b"alive\n"[..]));
            }
        })
    });
}
