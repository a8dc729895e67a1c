//! Sandbox networking end to end: a real `tine` server, real guests, a real
//! MCP client, and an HTTP server this test runs on the host's loopback
//! (the only address test traffic goes to; the server's config permits
//! 127.0.0.0/8 and names two hosts for its DNS).
//!
//! One server for every case (a default template restore is ~1 s here).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use testkit::mcp::{call, TineServer};

/// The transfers' size (bytes): 1 MiB (four times the NAT's 256 KiB
/// buffer each way), or 16 MiB with `TINE_TEST_FULL`
/// set (a guest that emulates its kernel moves 0.15-0.5 MB/s here, so the
/// full size adds minutes; the stack's own test, `crates/netstack/tests/
/// nat.rs`, moves 16 MiB each way without a guest).
fn blob_bytes() -> usize {
    if testkit::full_size() {
        16 << 20
    } else {
        1 << 20
    }
}

/// How long `GET /slow` waits at most for [`HostHttp::release_slow`] before
/// it sends the rest anyway (so a failed test does not leave a thread).
const SLOW_GATE: Duration = Duration::from_secs(600);

/// Opened once: `GET /slow` sends its first 64 KiB, then waits here for the
/// test to say the rest may go (after the branch it wants to land mid-
/// transfer: no timing to guess).
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    fn wait(&self) {
        let guard = self.open.lock().unwrap();
        let _ = self.opened.wait_timeout_while(guard, SLOW_GATE, |open| !*open);
    }
}

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tine"))
}

/// The test's deterministic body of [`blob_bytes`].
fn blob() -> Vec<u8> {
    let bytes = blob_bytes();
    let mut v = Vec::with_capacity(bytes);
    let mut x: u32 = 0x1234_5678;
    while v.len() < bytes {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// A minimal HTTP/1.1 server on 127.0.0.1 for the guests: `GET /blob`
/// ([`blob_bytes`]), `GET /slow` (the blob: 64 KiB, then the rest once
/// [`HostHttp::release_slow`] is called), `GET /small`, `GET /hold` (keeps
/// the connection open), `PUT /upload` (answers the body's SHA-256). Counts
/// held connections.
struct HostHttp {
    port: u16,
    held: Arc<AtomicUsize>,
    slow: Arc<Gate>,
}

impl HostHttp {
    fn start() -> HostHttp {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        let port = listener.local_addr().unwrap().port();
        let held = Arc::new(AtomicUsize::new(0));
        let body = Arc::new(blob());
        let slow = Arc::new(Gate::default());
        let (h, g) = (held.clone(), slow.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (body, held, slow) = (body.clone(), h.clone(), g.clone());
                std::thread::spawn(move || {
                    let _ = serve(conn, &body, &held, &slow);
                });
            }
        });
        HostHttp { port, held, slow }
    }

    /// Lets every `GET /slow`, now and later, send the rest of the blob.
    fn release_slow(&self) {
        self.slow.open();
    }
}

fn serve(conn: TcpStream, body: &[u8], held: &AtomicUsize, slow: &Gate) -> std::io::Result<()> {
    let mut r = BufReader::new(conn.try_clone()?);
    let mut w = conn;
    let mut line = String::new();
    r.read_line(&mut line)?;
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 || h == "\r\n" {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
    }
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let ok = |w: &mut TcpStream, b: &[u8]| -> std::io::Result<()> {
        write!(w, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", b.len())?;
        w.write_all(b)
    };
    match (line.split_whitespace().next(), path.as_str()) {
        (Some("GET"), "/blob") => ok(&mut w, body),
        (Some("GET"), "/slow") => {
            write!(w, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len())?;
            let (first, rest) = body.split_at(body.len().min(64 << 10));
            w.write_all(first)?;
            slow.wait();
            w.write_all(rest)
        }
        (Some("GET"), "/small") => ok(&mut w, b"hello from the host\n"),
        (Some("GET"), "/hold") => {
            held.fetch_add(1, Ordering::SeqCst);
            write!(w, "HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")?;
            let mut sink = [0u8; 64];
            // Until the guest goes away.
            let _ = r.read(&mut sink);
            held.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        }
        (Some("PUT"), _) => {
            let mut hasher = Sha256::new();
            let mut left = len;
            let mut buf = vec![0u8; 64 << 10];
            while left > 0 {
                let n = r.read(&mut buf[..left.min(64 << 10)])?;
                if n == 0 {
                    break;
                }
                hasher.update(&buf[..n]);
                left -= n;
            }
            ok(&mut w, format!("{}\n", hex(&hasher.finalize())).as_bytes())
        }
        _ => {
            write!(w, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        }
    }
}

async fn exec(client: &testkit::mcp::McpClient, id: &str, command: &str, timeout: u64) -> Value {
    call(client, "sandbox_exec", json!({"sandbox_id": id, "command": command, "timeout_secs": timeout}))
        .await
        .unwrap_or_else(|e| panic!("exec {command:?}: {e}"))
}

/// A bash function for the test's small requests: `get HOST PORT PATH
/// [HOST_HEADER]` sends an HTTP/1.1 GET over bash's `/dev/tcp` and prints
/// the body's first line; it fails (exit 7) when the connection is refused
/// and prints nothing when the connection is reset. The NAT sees the same
/// bytes as from curl, but no process starts: curl takes 13-24 s to start
/// in a guest here (docs/hosts.md), and the test made 12 such requests.
const GET: &str = "get() { exec 3<>/dev/tcp/$1/$2 || return 7; \
    printf 'GET %s HTTP/1.1\\r\\nHost: %s\\r\\nConnection: close\\r\\n\\r\\n' \"$3\" \"${4:-$1:$2}\" >&3; \
    while IFS= read -r l <&3 && [ \"$l\" != $'\\r' ]; do :; done; IFS= read -r l <&3 && echo \"$l\"; }; ";

/// A bash function for the test's waits in the guest: `nap SECONDS` is
/// bash's own `read -t` on a FIFO no one writes to. A `sleep` would start
/// a process each time (about 1.5 s of guest kernel work here,
/// docs/hosts.md), taking the vCPU from the transfer being waited for.
const NAP: &str = "[ -p /tmp/nap ] || mkfifo /tmp/nap; exec 9<>/tmp/nap; nap() { read -t \"$1\" -u 9; }; ";

/// Runs `get` ([`GET`]) in `id`; its stdout and exit code.
async fn get(client: &testkit::mcp::McpClient, id: &str, args: &str) -> (String, i64) {
    let r = exec(client, id, &format!("{GET}get {args}"), 60).await;
    (stdout(&r), exit_code(&r))
}

fn stdout(v: &Value) -> String {
    v["stdout"].as_str().unwrap_or_default().to_string()
}

fn exit_code(v: &Value) -> i64 {
    v["exit_code"].as_i64().unwrap_or(-1)
}

/// A TCP echo server on guest port 7000 for the sandbox's interpreter:
/// it listens before the cell ends, then a thread echoes each connection
/// until its end, one at a time.
const ECHO_SERVER: &str = "import socket, threading
echo_listener = socket.socket()
echo_listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
echo_listener.bind(('0.0.0.0', 7000))
echo_listener.listen(8)
def echo_serve(s):
    while True:
        c, _ = s.accept()
        while True:
            d = c.recv(65536)
            if not d:
                break
            c.sendall(d)
        c.shutdown(socket.SHUT_WR)
        c.close()
threading.Thread(target=echo_serve, args=(echo_listener,), daemon=True).start()
";

/// A running `tine port-forward SANDBOX PORT 0` against the server at
/// `base`: killed on drop.
struct Forward(std::process::Child);

impl Drop for Forward {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `tine port-forward` to guest `port` of `sandbox` on a free local
/// port; the process and the address it listens on.
fn port_forward(base: &str, sandbox: &str, port: u16) -> (Forward, std::net::SocketAddr) {
    let mut child = std::process::Command::new(binary())
        .args(["port-forward", sandbox, &port.to_string(), "0", "--url", base])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start tine port-forward");
    let stdout = child.stdout.take().unwrap();
    let forward = Forward(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("its first line");
    // "forwarding 127.0.0.1:PORT -> SANDBOX:PORT"
    let addr = line.split_whitespace().nth(1).and_then(|a| a.parse().ok());
    let addr = addr.unwrap_or_else(|| panic!("tine port-forward printed {line:?}"));
    (forward, addr)
}

/// The closed record of an inbound connection to the guest's `port`.
fn closed_inbound(records: &[Value], port: u16) -> Option<&Value> {
    records.iter().find(|r| {
        r["direction"] == "inbound" && r["port"] == port && r["addr"] == "10.0.2.15" && !r["duration_ms"].is_null()
    })
}

async fn log_records(client: &testkit::mcp::McpClient, id: &str) -> Vec<Value> {
    let v = call(client, "sandbox_network_log", json!({"sandbox_id": id})).await.expect("network log");
    v["records"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn guests_reach_the_host_through_the_nat_under_their_policy() {
    if !testkit::kvm_available("network") {
        return;
    }
    let http = HostHttp::start();
    let port = http.port;
    let config = "[network]\npermit_ranges = [\"127.0.0.0/8\"]\nmax_connections = 32\n\
                  [network.hosts]\n\"files.test\" = \"10.0.2.2\"\n\"other.test\" = \"10.0.2.2\"\n";
    let server = TineServer::start_with_default_template(binary(), None, config);
    let client = server.client().await;
    let started = std::time::Instant::now();
    let phase = |what: &str| eprintln!("network test: {what} at {:.1} s", started.elapsed().as_secs_f64());

    let sb = call(&client, "sandbox_create", json!({})).await.expect("create");
    let id = sb["sandbox_id"].as_str().unwrap().to_string();
    assert_eq!(sb["network"]["egress"], "allow", "{sb}");
    // The fixed addressing every sandbox has (crates/netstack/src/lib.rs).
    let r = exec(&client, &id, "ip -4 -o addr show eth0; ip route; cat /sys/class/net/eth0/address", 120).await;
    let out = stdout(&r);
    assert!(
        out.contains("inet 10.0.2.15/24")
            && out.contains("default via 10.0.2.2 dev eth0")
            && out.contains("02:54:00:12:34:56"),
        "{r}"
    );

    // The blob's download is the branch check's `/slow` transfer below
    // (one curl start less); its upload follows it.
    let mib = blob_bytes() >> 20;
    let want = hex(&Sha256::digest(blob()));

    // The gateway's DNS answers the server's names.
    let r = exec(&client, &id, "getent hosts files.test", 60).await;
    assert!(stdout(&r).starts_with("10.0.2.2"), "{r}");

    // Always-denied ranges are refused even when dialled by address (a
    // connect in a subshell each; the log below shows the NAT refused them).
    let dial = "for a in 169.254.169.254 10.1.2.3 192.168.1.1 100.64.0.1; do \
                (exec 3<>/dev/tcp/$a/80) 2>/dev/null && echo \"$a connected\"; done; echo dialled";
    let r = exec(&client, &id, dial, 120).await;
    assert_eq!(stdout(&r), "dialled\n", "every blocked range must be refused: {r}");
    let records = log_records(&client, &id).await;
    let blocked = records
        .iter()
        .filter(|r| r["allowed"] == false && r["rule"].as_str().unwrap_or("").starts_with("blocked-range:"))
        .count();
    assert!(blocked >= 4, "refusals logged with their range: {records:?}");

    phase("refusals checked");
    // An allowlist: files.test is reachable, other.test is not (same
    // address; its DNS answer and its Host header are refused).
    let upd = call(
        &client,
        "sandbox_update",
        json!({"sandbox_id": id, "network": {"egress": "deny", "allow": ["files.test"]}}),
    )
    .await
    .expect("update");
    assert_eq!(upd["network"]["egress"], "deny", "{upd}");
    let r = get(&client, &id, &format!("files.test {port} /small")).await;
    assert_eq!(r, ("hello from the host\n".to_string(), 0));
    let r = get(&client, &id, &format!("other.test {port} /small")).await;
    assert_eq!(r.1, 7, "other.test must be refused (its name does not resolve): {r:?}");
    let r = get(&client, &id, &format!("10.0.2.2 {port} /small other.test:{port}")).await;
    assert!(r.0.is_empty() && r.1 != 0, "other.test by its Host header must be refused: {r:?}");
    let records = log_records(&client, &id).await;
    assert!(
        records.iter().any(|r| r["allowed"] == false && r["domain"] == "other.test"),
        "the refusal of other.test is logged: {records:?}"
    );

    // egress deny with no allow list: nothing.
    call(&client, "sandbox_update", json!({"sandbox_id": id, "network": {"egress": "deny"}})).await.expect("update");
    let r = get(&client, &id, &format!("10.0.2.2 {port} /small")).await;
    assert_eq!(r.1, 7, "egress deny blocks everything: {r:?}");
    call(&client, "sandbox_update", json!({"sandbox_id": id, "network": {"egress": "allow"}})).await.expect("update");

    phase("policies checked");
    // A branch during a transfer: the source's completes intact, the
    // child's sees a reset; both can connect again. The host holds the
    // transfer after its first 64 KiB until the branch is taken; curl's
    // keepalive probes every 2 s idle are what the child's NAT, which has
    // no such connection, answers with a RST.
    exec(
        &client,
        &id,
        &format!(
            "setsid sh -c 'curl -sS --fail --keepalive-time 2 -o /tmp/slow http://10.0.2.2:{port}/slow; \
             echo $? > /tmp/slow.rc' </dev/null >/dev/null 2>&1 &"
        ),
        60,
    )
    .await;
    // curl's first start in this guest (13-24 s alone, over 60 s beside
    // a cold boot): up to 3 min.
    let started =
        format!("{NAP}for ((i = 0; i < 900; i++)); do [ -s /tmp/slow ] && break; nap 0.2; done; stat -c %s /tmp/slow");
    let r = exec(&client, &id, &started, 240).await;
    assert!(stdout(&r).trim().parse::<u64>().unwrap_or(0) > 0, "the transfer started: {r}");
    let b = call(&client, "sandbox_branch", json!({"sandbox_id": id, "n": 1})).await.expect("branch");
    let child = b["children"][0]["sandbox_id"].as_str().expect("child id").to_string();
    http.release_slow();
    let wait_rc = format!(
        "{NAP}for ((i = 0; i < 1200; i++)); do [ -f /tmp/slow.rc ] && break; nap 0.5; done; cat /tmp/slow.rc; \
         sha256sum /tmp/slow"
    );
    let r = exec(&client, &id, &wait_rc, 600).await;
    let out = stdout(&r);
    assert!(out.starts_with("0\n") && out.contains(&want), "the source's transfer completes intact: {r}");
    phase(&format!("{mib} MiB downloaded (curl in the guest, held at 64 KiB until the branch)"));
    // The download is logged with its bytes once the NAT closes it.
    let logged = |records: &[Value]| {
        records.iter().any(|r| {
            r["protocol"] == "tcp" && r["allowed"] == true && r["bytes_in"].as_u64() >= Some((mib as u64) << 20)
        })
    };
    let t = std::time::Instant::now();
    let mut records = log_records(&client, &id).await;
    while !logged(&records) && t.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        records = log_records(&client, &id).await;
    }
    assert!(logged(&records), "the download is logged with its bytes: {records:?}");
    // And back up: the host's checksum of what it received. A PUT over
    // bash's /dev/tcp with `cat` for the body: the NAT sees what it would
    // from curl, and the guest is spared curl's start (about 20 s here).
    let put = format!(
        "exec 3<>/dev/tcp/10.0.2.2/{port} && printf 'PUT /upload HTTP/1.1\\r\\nHost: 10.0.2.2\\r\\n\
         Content-Length: {}\\r\\nConnection: close\\r\\n\\r\\n' >&3 && cat /tmp/slow >&3 && \
         while IFS= read -r l <&3 && [ \"$l\" != $'\\r' ]; do :; done; IFS= read -r l <&3; echo \"$l\"",
        blob_bytes()
    );
    let r = exec(&client, &id, &put, 300).await;
    assert_eq!(stdout(&r).trim(), want, "upload checksum: {r}");
    phase(&format!("{mib} MiB uploaded in {} ms (bash and cat in the guest)", r["duration_ms"]));
    let r = exec(&client, &child, &wait_rc, 600).await;
    assert!(!stdout(&r).starts_with("0\n"), "the child's copy of the transfer is reset: {r}");
    for sandbox in [&id, &child] {
        let r = get(&client, sandbox, &format!("10.0.2.2 {port} /small")).await;
        assert_eq!(r, ("hello from the host\n".to_string(), 0), "{sandbox} connects after the branch");
    }
    assert_eq!(
        call(&client, "sandbox_info", json!({"sandbox_id": child})).await.unwrap()["network"]["egress"],
        "allow",
        "the child inherits the policy"
    );

    phase("branch checked");
    // Connections without end hit the per-sandbox cap (32 here); the
    // daemon and the other sandbox go on.
    // 64 connects from one bash, each connection kept open on a new fd
    // until the command ends.
    let flood = format!(
        "held=0; refused=0; {{ for i in $(seq 64); do if exec {{fd}}<>/dev/tcp/10.0.2.2/{port}; then \
         printf 'GET /hold HTTP/1.1\\r\\n\\r\\n' >&$fd; held=$((held + 1)); else refused=$((refused + 1)); fi; \
         done; }} 2>/dev/null; echo $held $refused"
    );
    let r = exec(&client, &id, &flood, 300).await;
    let counts: Vec<u64> = stdout(&r).split_whitespace().filter_map(|x| x.parse().ok()).collect();
    assert_eq!(counts.len(), 2, "{r}");
    assert!(counts[0] <= 32 && counts[1] >= 32, "the cap holds: {r}");
    let r = get(&client, &child, &format!("10.0.2.2 {port} /small")).await;
    assert_eq!(r, ("hello from the host\n".to_string(), 0), "another sandbox is unaffected");
    let records = log_records(&client, &id).await;
    assert!(records.iter().any(|r| r["rule"] == "limit:connections"), "cap refusals are logged: {records:?}");
    // The held connections close with the flood's process.
    for _ in 0..100 {
        if http.held.load(Ordering::SeqCst) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(http.held.load(Ordering::SeqCst), 0, "connections are closed when the guest's end closes");

    phase("cap checked");
    // Inbound: `tine port-forward` carries a TCP echo both ways into a
    // guest port, through the server's API; a port nobody listens on
    // closes the connection at once; both are logged as inbound, and the
    // branch child (whose own network this is not) sees neither.
    // The sandbox's warm interpreter serves it from a thread (a new
    // python3 process takes 15 s to listen here).
    let r = call(&client, "sandbox_run_python", json!({"sandbox_id": id, "code": ECHO_SERVER}))
        .await
        .expect("start the echo server");
    assert!(r.get("exception").is_none_or(Value::is_null), "{r}");
    let message: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let (forward, local) = port_forward(&server.base, &id, 7000);
    let sent = message.clone();
    let echoed = tokio::task::spawn_blocking(move || {
        let mut c = TcpStream::connect(local).expect("connect to the forward");
        c.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let writer = {
            let mut c = c.try_clone().unwrap();
            std::thread::spawn(move || {
                c.write_all(&sent).unwrap();
                c.shutdown(std::net::Shutdown::Write).unwrap();
            })
        };
        let mut back = Vec::new();
        c.read_to_end(&mut back).expect("read the echo");
        writer.join().unwrap();
        back
    })
    .await
    .unwrap();
    assert!(echoed == message, "the echo comes back whole: {} of {} bytes", echoed.len(), message.len());
    drop(forward);
    let (closed, local) = port_forward(&server.base, &id, 7001);
    let got = tokio::task::spawn_blocking(move || {
        let mut c = TcpStream::connect(local).expect("connect to the forward");
        c.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let mut back = Vec::new();
        c.read_to_end(&mut back).map(|_| back.len())
    })
    .await
    .unwrap();
    assert_eq!(got.ok(), Some(0), "a port nobody listens on closes the connection with no byte");
    drop(closed);
    // Both records, closed (the bytes are written at the close).
    let t = std::time::Instant::now();
    let mut records = log_records(&client, &id).await;
    while [7000, 7001].iter().any(|p| closed_inbound(&records, *p).is_none()) && t.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        records = log_records(&client, &id).await;
    }
    let inbound = closed_inbound(&records, 7000).unwrap_or_else(|| panic!("7000 logged inbound: {records:?}"));
    let n = message.len() as u64;
    assert_eq!((inbound["bytes_in"].as_u64(), inbound["bytes_out"].as_u64()), (Some(n), Some(n)), "{inbound}");
    assert!(closed_inbound(&records, 7001).is_some(), "7001 logged inbound: {records:?}");
    let child_records = log_records(&client, &child).await;
    assert!(!child_records.iter().any(|r| r["direction"] == "inbound"), "{child_records:?}");

    phase("port forward checked");
    call(&client, "sandbox_kill", json!({"sandbox_id": child})).await.expect("kill child");
    call(&client, "sandbox_kill", json!({"sandbox_id": id})).await.expect("kill");
}
