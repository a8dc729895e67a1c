//! Preview URLs against the other ways to the same guest server (issue
//! 34): one sandbox of a real `tine server start --dev` runs the web app
//! of `crates/tine/tests/py/preview_app.py` on guest port 8000, reached
//!
//! - through its preview URL (`http://<id>.localhost:<port>/`, the cookie
//!   already exchanged): the server's HTTP proxy into the guest;
//! - through `tine port-forward` (raw TCP over the same inbound NAT path,
//!   no HTTP proxy in the server): the NAT's own cost;
//! - through nginx (Debian's, `/usr/sbin/nginx` or `$TINE_NGINX`)
//!   proxying that port forward: the anchor, a well-known HTTP proxy over
//!   the same path;
//! - from inside the guest (`curl` to 127.0.0.1 in `sandbox_exec`): the
//!   guest server alone.
//!
//! For each: time to first byte and total time of a 1 KiB response,
//! throughput of a `PREVIEW_BENCH_MIB` (default 10) MiB response, and the
//! round trip of a WebSocket echo (not from inside the guest), as medians
//! of `PREVIEW_BENCH_ROUNDS` (default 5). Measures, asserts nothing.
//!
//! `cargo bench -p tine-benches --bench preview`.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use testkit::mcp::{call, tine_binary, TineServer};
use tine_benches::{env_or, median, record};

const APP: &str = include_str!("../../crates/tine/tests/py/preview_app.py");

/// A child process killed on drop.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `tine port-forward SANDBOX 8000 0` against `base`: the process and the
/// address it listens on.
fn port_forward(base: &str, sandbox: &str) -> (Killed, SocketAddr) {
    let mut child = Command::new(tine_binary())
        .args(["port-forward", sandbox, "8000", "0", "--url", base])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start tine port-forward");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).expect("its first line");
    let addr = line.split_whitespace().nth(1).and_then(|a| a.parse().ok());
    (Killed(child), addr.unwrap_or_else(|| panic!("tine port-forward printed {line:?}")))
}

/// nginx proxying `upstream` on a free loopback port, in a temporary
/// directory: the process, the directory and the port.
fn nginx(upstream: SocketAddr) -> Option<(Killed, tempfile::TempDir, u16)> {
    let bin = std::env::var_os("TINE_NGINX").unwrap_or_else(|| "/usr/sbin/nginx".into());
    if !std::path::Path::new(&bin).exists() {
        eprintln!("preview bench: no nginx at {bin:?}: the anchor is left out (scripts/setup.sh installs it)");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = testkit::mcp::free_port();
    let d = dir.path().display();
    let conf = format!(
        "daemon off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
         events {{ worker_connections 256; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
         \x20 fastcgi_temp_path {d}/f;\n  uwsgi_temp_path {d}/u;\n  scgi_temp_path {d}/s;\n\
         \x20 map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}\n\
         \x20 server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://{upstream};\n\
         \x20     proxy_http_version 1.1;\n      proxy_set_header Upgrade $http_upgrade;\n\
         \x20     proxy_set_header Connection $connection_upgrade;\n      proxy_buffering off;\n    }}\n  }}\n}}\n"
    );
    std::fs::write(dir.path().join("nginx.conf"), conf).unwrap();
    let child = Command::new(&bin)
        .arg("-p")
        .arg(dir.path())
        .arg("-e")
        .arg(dir.path().join("error.log"))
        .arg("-c")
        .arg(dir.path().join("nginx.conf"))
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start nginx");
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t.elapsed() < Duration::from_secs(20), "nginx does not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    Some((Killed(child), dir, port))
}

/// A way to the app: its base URL, the client, and the cookie to send.
struct Way {
    name: &'static str,
    base: String,
    http: reqwest::Client,
    cookie: Option<String>,
    /// Where a WebSocket connects (TCP) and the URL it asks for.
    ws: (SocketAddr, String),
}

impl Way {
    fn get(&self, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.get(format!("{}{path}", self.base));
        match &self.cookie {
            Some(c) => r.header("cookie", c),
            None => r,
        }
    }
}

/// `bytes` over the median of `times`, in MB/s.
fn rate(bytes: usize, times: &[Duration]) -> f64 {
    bytes as f64 / 1e6 / median(times).as_secs_f64().max(1e-9)
}

/// Median time to first byte and total time of `/blob?n=1024`, and
/// the throughput (MB/s, over the median time) of `/blob?n=<big>`.
async fn http_figures(way: &Way, rounds: usize, big: usize) -> (Duration, Duration, f64) {
    let (mut ttfb, mut total, mut bigs) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        let r = way.get("/blob?n=1024").send().await.expect("small GET");
        ttfb.push(t.elapsed());
        let body = r.bytes().await.expect("small body");
        total.push(t.elapsed());
        assert_eq!(body.len(), 1024, "{}", way.name);
        let t = Instant::now();
        let mut s = way.get(&format!("/blob?n={big}")).send().await.expect("big GET").bytes_stream();
        let mut n = 0;
        while let Some(c) = s.next().await {
            n += c.expect("big body").len();
        }
        assert_eq!(n, big, "{}", way.name);
        bigs.push(t.elapsed());
    }
    (median(&ttfb), median(&total), rate(big, &bigs))
}

/// Median round trip of a WebSocket echo, `rounds` messages on one
/// connection.
async fn ws_round_trip(way: &Way, rounds: usize) -> Duration {
    let mut request =
        tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(way.ws.1.as_str()).unwrap();
    if let Some(c) = &way.cookie {
        request.headers_mut().insert("cookie", c.parse().unwrap());
    }
    let tcp = tokio::net::TcpStream::connect(way.ws.0).await.unwrap();
    let (mut ws, _) = tokio_tungstenite::client_async(request, tcp).await.expect("WebSocket handshake");
    let mut trips = Vec::new();
    for i in 0..rounds {
        let t = Instant::now();
        ws.send(tokio_tungstenite::tungstenite::Message::text(format!("ping {i}"))).await.unwrap();
        let echo = ws.next().await.expect("an echo").unwrap();
        trips.push(t.elapsed());
        assert_eq!(echo.to_text().unwrap(), format!("echo: ping {i}"));
    }
    let _ = ws.close(None).await;
    median(&trips)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _changes = tine_benches::report_changes_at_end("preview");
    if !testkit::kvm_available("bench preview") {
        return;
    }
    let rounds: usize = env_or("PREVIEW_BENCH_ROUNDS", 5);
    let big: usize = env_or::<usize>("PREVIEW_BENCH_MIB", 10) << 20;
    let server = TineServer::start(&tine_binary(), None, "[limits]\nboot_timeout_secs = 1200\n");
    server.wait_for_default_template(Duration::from_secs(1800));
    let addr: SocketAddr = server.base.trim_start_matches("http://").parse().unwrap();
    let client = server.client().await;
    let sb = call(&client, "sandbox_create", json!({})).await.expect("create");
    let id = sb["sandbox_id"].as_str().unwrap().to_string();
    call(&client, "sandbox_run_python", json!({"sandbox_id": id, "code": APP})).await.expect("start the app");
    eprintln!("preview bench: app up in {id}; {rounds} rounds, {} MiB", big >> 20);

    let p = call(&client, "sandbox_preview_url", json!({"sandbox_id": id, "port": 8000})).await.expect("preview");
    let url = p["url"].as_str().unwrap().to_string();
    let host = reqwest::Url::parse(&url).unwrap().host_str().unwrap().to_string();
    let preview_http =
        reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).resolve(&host, addr).build().unwrap();
    let first = preview_http.get(&url).send().await.expect("exchange the token");
    let cookie = first.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_string();
    let origin = format!("http://{host}:{}", addr.port());
    let (_forward, forwarded) = port_forward(&server.base, &id);
    let plain = reqwest::Client::new();
    let mut ways = vec![
        Way {
            name: "preview",
            base: origin.clone(),
            http: preview_http,
            cookie: Some(cookie),
            ws: (addr, format!("ws://{host}:{}/ws", addr.port())),
        },
        Way {
            name: "port_forward",
            base: format!("http://{forwarded}"),
            http: plain.clone(),
            cookie: None,
            ws: (forwarded, format!("ws://{forwarded}/ws")),
        },
    ];
    let anchor = nginx(forwarded);
    if let Some((_, _, port)) = &anchor {
        let at: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        ways.push(Way {
            name: "nginx_port_forward",
            base: format!("http://{at}"),
            http: plain.clone(),
            cookie: None,
            ws: (at, format!("ws://{at}/ws")),
        });
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for way in &ways {
        let (ttfb, total, rate) = http_figures(way, rounds, big).await;
        let ws = ws_round_trip(way, rounds.max(10)).await;
        println!(
            "{:<20} 1 KiB: first byte {:8.2} ms, total {:8.2} ms; {} MiB: {:7.3} MB/s; WebSocket echo {:8.2} ms",
            way.name,
            ms(ttfb),
            ms(total),
            big >> 20,
            rate,
            ms(ws)
        );
        record("preview", &format!("{}_1k_first_byte", way.name), ms(ttfb), "ms");
        record("preview", &format!("{}_1k_total", way.name), ms(total), "ms");
        record("preview", &format!("{}_{}m_throughput", way.name, big >> 20), rate, "MB/s");
        record("preview", &format!("{}_ws_round_trip", way.name), ms(ws), "ms");
    }
    // Inside the guest: curl to the app over the guest's loopback.
    let (mut ttfb, mut total, mut bigs) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let cmd = format!(
            "curl -s -o /dev/null -w '%{{time_starttransfer}} %{{time_total}}\\n' http://127.0.0.1:8000/blob?n=1024; \
             curl -s -o /dev/null -w '%{{time_total}}\\n' 'http://127.0.0.1:8000/blob?n={big}'"
        );
        let r = call(&client, "sandbox_exec", json!({"sandbox_id": id, "command": cmd, "timeout_secs": 600}))
            .await
            .expect("curl in the guest");
        let v: Vec<f64> =
            r["stdout"].as_str().unwrap_or_default().split_whitespace().filter_map(|s| s.parse().ok()).collect();
        if let [first, small, whole] = v[..] {
            ttfb.push(Duration::from_secs_f64(first));
            total.push(Duration::from_secs_f64(small));
            bigs.push(Duration::from_secs_f64(whole));
        } else {
            eprintln!("preview bench: curl in the guest printed {r}");
        }
    }
    println!(
        "{:<20} 1 KiB: first byte {:8.2} ms, total {:8.2} ms; {} MiB: {:7.3} MB/s",
        "in_guest",
        ms(median(&ttfb)),
        ms(median(&total)),
        big >> 20,
        rate(big, &bigs)
    );
    record("preview", "in_guest_1k_first_byte", ms(median(&ttfb)), "ms");
    record("preview", "in_guest_1k_total", ms(median(&total)), "ms");
    record("preview", &format!("in_guest_{}m_throughput", big >> 20), rate(big, &bigs), "MB/s");
    let _ = call(&client, "sandbox_kill", json!({"sandbox_id": id})).await;
    drop(anchor);
}
