//! The guest side of the network in a real guest. With no NIC (the
//! network disabled): the agent's init brings `lo` up, finds no `eth0` and
//! goes on; loopback TCP works; the image has the network tools (`ip`,
//! `curl`, `git`, `pip`, `venv`) and the resolver file naming the gateway's
//! DNS. With a NIC: `eth0` has the fixed addressing of
//! `crates/netstack/src/lib.rs`, and `curl` reaches an HTTP server on the
//! host's loopback through the gateway by a name its DNS answers.
//! Needs /dev/kvm (skips loudly without it).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use tine_protocol::{Command, Exec, ExitStatus, Op, Reply};

/// Runs `script` with bash; returns (exit status, stdout, stderr).
fn sh(agent: &mut testkit::BlockingAgent, script: &str) -> (ExitStatus, String, String) {
    sh_within(agent, script, 120_000)
}

/// [`sh`] with a timeout of `timeout_ms`; prints how long the command took.
fn sh_within(agent: &mut testkit::BlockingAgent, script: &str, timeout_ms: u32) -> (ExitStatus, String, String) {
    let op = Op::Exec(Exec {
        command: Command::Argv(vec!["/bin/bash".into(), "-c".into(), script.into()]),
        cwd: None,
        env: vec![],
        stdin: vec![],
        timeout_ms,
        output_limit: 0,
    });
    let t = std::time::Instant::now();
    let answer = agent.call(op);
    eprintln!("guest-net: `{script}`: {:.1} s", t.elapsed().as_secs_f64());
    match answer {
        Ok(Reply::Exec(r)) => (
            r.status,
            String::from_utf8_lossy(&r.stdout.data).into_owned(),
            String::from_utf8_lossy(&r.stderr.data).into_owned(),
        ),
        other => panic!("`{script}`: {other:?}"),
    }
}

#[test]
#[ignore = "on demand (cold boots): CI covers the NIC through crates/tine/tests/network.rs and the no-NIC agent through every sandbox-crate guest"]
fn without_a_nic_lo_is_up_and_the_tools_are_there() {
    if !testkit::kvm_available("guest-net") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let mut config = testkit::agent_vm_config("guest-net", &uds);
    config.net = None;
    let mut vm = vmm::build_for_boot(&config).expect("VM starts");
    let started = vm.started();
    let console = vm.console().clone();
    assert!(
        console.wait_for("listening on vsock port 1024", Duration::from_secs(600)),
        "agent never started:\n{}",
        console.text()
    );
    let ready = started.elapsed();
    testkit::with_console_on_panic(&console, || {
        let text = console.text();
        assert!(text.contains("tine-agent init: network: no NIC, loopback only"), "{text}");
        let mut agent = testkit::BlockingAgent::connect(&uds).expect("connect to the agent");

        // lo is up with 127.0.0.1/8 (iproute2 over rtnetlink); no eth0.
        let (status, out, err) = sh(&mut agent, "ip -o link show lo; ip -o -4 addr show lo");
        assert_eq!(status, ExitStatus::Code(0), "{err}");
        assert!(out.contains("<LOOPBACK,UP,LOWER_UP>"), "{out}");
        assert!(out.contains("inet 127.0.0.1/8"), "{out}");
        let (status, _, err) = sh(&mut agent, "ip link show eth0");
        assert_ne!(status, ExitStatus::Code(0), "eth0 exists without a NIC");
        assert!(err.contains("eth0"), "{err}");

        // Loopback TCP carries bytes (a down lo gives ENETUNREACH).
        let (status, out, err) = sh(
            &mut agent,
            "python3 -c \"import socket; s = socket.create_server(('127.0.0.1', 0)); \
             c = socket.create_connection(s.getsockname()); a, _ = s.accept(); c.sendall(b'ping'); \
             print(a.recv(4).decode())\"",
        );
        assert_eq!((status, out.as_str()), (ExitStatus::Code(0), "ping\n"), "{err}");

        // The tools of the image. Running pip or venv takes minutes where
        // guest kernel mode is emulated (docs/hosts.md): their packages are
        // checked here, pip itself runs in crates/tine/tests/network.rs.
        for (cmd, want, timeout_ms) in [
            ("curl --version", "curl ", 120_000),
            ("git --version", "git version ", 120_000),
            ("getent services https", "443/tcp", 120_000),
            (
                "dpkg-query -W -f='${Package} ${Status}\\n' python3-pip python3-venv",
                "python3-pip install ok installed\npython3-venv install ok installed",
                120_000,
            ),
        ] {
            let (status, out, err) = sh_within(&mut agent, cmd, timeout_ms);
            assert_eq!(status, ExitStatus::Code(0), "`{cmd}`: {err}");
            assert!(out.contains(want), "`{cmd}`: {out}");
        }

        // The resolver is the gateway's DNS, shipped in the image: the
        // overlay's upper layer has no copy of it.
        let (status, out, err) = sh(&mut agent, "cat /etc/resolv.conf; getent hosts tine");
        assert_eq!(status, ExitStatus::Code(0), "{err}");
        assert!(out.starts_with("nameserver 10.0.2.3\n"), "{out}");
        assert!(out.ends_with("tine\n") && out.contains("127.0.1.1"), "{out}");
        match agent.call(Op::Manifest { paths: None }) {
            Ok(Reply::Manifest(m)) => assert!(m.entries.iter().all(|e| e.path != "/etc/resolv.conf"), "{m:?}"),
            other => panic!("manifest: {other:?}"),
        }
    });
    eprintln!("guest-net: VM start to agent ready {:.1} s", ready.as_secs_f64());
    let _ = vm.stop();
}

/// Serves `body` to every HTTP request on `listener` (HTTP/1.0, one
/// request per connection), until the test ends.
fn serve_http(listener: TcpListener, body: &'static [u8]) {
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut req = Vec::new();
            let mut buf = [0u8; 1024];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 64 * 1024 {
                match conn.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => req.extend_from_slice(&buf[..n]),
                }
            }
            let head = format!("HTTP/1.0 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
            let _ = conn.write_all(head.as_bytes()).and_then(|()| conn.write_all(body));
        }
    });
}

#[test]
#[ignore = "on demand (cold boots): CI covers the NIC through crates/tine/tests/network.rs and the no-NIC agent through every sandbox-crate guest"]
fn with_a_nic_eth0_has_the_fixed_addressing_and_reaches_the_host() {
    if !testkit::kvm_available("guest-net-nic") {
        return;
    }
    // Test traffic stays on this machine: the server is on 127.0.0.1, the
    // guest reaches it as the gateway (10.0.2.2) by a name the gateway's
    // DNS answers itself, and there is no upstream resolver.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    const BODY: &[u8] = b"tine guest network ok\n";
    serve_http(listener, BODY);
    let server = Arc::new(netstack::policy::ServerNetPolicy {
        permit_ranges: vec!["127.0.0.0/8".parse().unwrap()],
        host_addrs: Default::default(),
    });
    let control = netstack::control::NetControl::new(&netstack::policy::NetworkPolicy::default(), None, server, 256)
        .expect("a policy");
    let stack = netstack::stack::StackConfig {
        dns_upstreams: vec![],
        static_hosts: [("host.tine.test".to_string(), IpAddr::V4(Ipv4Addr::new(10, 0, 2, 2)))].into(),
        max_connections: 16,
        tcp_buffer_bytes: 256 * 1024,
        max_guest_frames: 256,
        ..netstack::stack::StackConfig::default()
    };

    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let mut config = testkit::agent_vm_config("guest-net-nic", &uds);
    config.net = Some(vmm::vm::config::NetConfig { stack, control });
    let mut vm = vmm::build_for_boot(&config).expect("VM starts");
    let console = vm.console().clone();
    assert!(
        console.wait_for("listening on vsock port 1024", Duration::from_secs(600)),
        "agent never started:\n{}",
        console.text()
    );
    testkit::with_console_on_panic(&console, || {
        let text = console.text();
        assert!(text.contains("tine-agent init: network: eth0 10.0.2.15/24 via 10.0.2.2, dns 10.0.2.3"), "{text}");
        let mut agent = testkit::BlockingAgent::connect(&uds).expect("connect to the agent");

        let (status, out, err) = sh(
            &mut agent,
            "ip -o -4 addr show eth0; ip route; cat /sys/class/net/eth0/mtu /sys/class/net/eth0/address",
        );
        assert_eq!(status, ExitStatus::Code(0), "{err}");
        for want in ["inet 10.0.2.15/24", "default via 10.0.2.2 dev eth0", "10.0.2.0/24 dev eth0", "\n1500\n"] {
            assert!(out.contains(want), "no {want:?} in:\n{out}");
        }
        assert!(out.ends_with("02:54:00:12:34:56\n"), "{out}");

        let (status, out, err) = sh(&mut agent, "getent ahostsv4 host.tine.test | head -1");
        assert_eq!(status, ExitStatus::Code(0), "{err}");
        assert!(out.starts_with("10.0.2.2 "), "{out}");

        let (status, out, err) = sh(&mut agent, &format!("curl -sS --max-time 60 http://host.tine.test:{port}/"));
        assert_eq!((status, out.as_bytes()), (ExitStatus::Code(0), BODY), "{err}");
    });
    let _ = vm.stop();
}
