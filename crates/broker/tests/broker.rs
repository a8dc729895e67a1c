//! The broker end to end on loopback, no guest: a client that trusts the
//! broker's CA (as a guest does) speaks TLS to the broker over a socket
//! pair (the NAT's hand-over); the broker passes its requests on to a
//! real HTTPS server (hyper and rustls, with a test CA the broker trusts
//! through `extra_roots`) over a TCP connection the test opened (the
//! NAT's). The server answers what it was sent, so each test checks what
//! reached it: the real value where the placeholder was, in HTTP/1.1 and
//! HTTP/2, nothing after a detach, the placeholder left alone for a host
//! the secret may not go to, 421 and nothing upstream for a request that
//! names another authority anywhere, and the authority the upstream sees
//! written by the broker, and one body budget across a sandbox's
//! requests. An echoing upstream ([`echo_upstream`]) sends the value back
//! in every place and form a response can carry it: the guest must read
//! only the placeholder.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tine_broker::{
    Binding, BodyBudget, Broker, BrokerConfig, BrokerEvent, CertificateAuthority, Flow, FlowHooks, HostPattern,
    SecretValue,
};

const PLACEHOLDER: &str = "tine_placeholder_5f1c";
const VALUE: &str = "sk-the-real-value";

/// The test's upstream: an HTTPS server for `api.test` that answers each
/// request with what it got (`auth=<Authorization> query=<query>
/// body=<body> proto=<version>`), counts them and keeps the authorities
/// each named (`uri=<authority> host=<Host headers>`).
struct Upstream {
    addr: SocketAddr,
    ca_file: tempfile::NamedTempFile,
    requests: Arc<AtomicU64>,
    /// A request to `/hold` is answered only after a permit is added here.
    release: Arc<tokio::sync::Semaphore>,
    authorities: Arc<Mutex<Vec<String>>>,
    /// What it answered, as it sent it (the guest reads it scrubbed).
    seen: Arc<Mutex<Vec<String>>>,
}

impl Upstream {
    /// What the upstream answered last.
    fn last(&self) -> String {
        self.seen.lock().unwrap().last().cloned().unwrap_or_default()
    }
}

/// A TLS server's parts for `api.test` on a loopback port: the file of
/// the test CA that signed its certificate (for the broker's
/// `extra_roots`), its acceptor, its listener (non-blocking) and address.
fn tls_listener() -> (tempfile::NamedTempFile, tokio_rustls::TlsAcceptor, std::net::TcpListener, SocketAddr) {
    let ca = testkit::tls::TestCa::new("test upstream CA");
    let ca_file = tempfile::NamedTempFile::new().unwrap();
    ca.write_pem(ca_file.path());
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(ca.server_config("api.test")));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    (ca_file, acceptor, listener, addr)
}

fn upstream() -> Upstream {
    let (ca_file, acceptor, listener, addr) = tls_listener();
    let requests = Arc::new(AtomicU64::new(0));
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let held = release.clone();
    let authorities: Arc<Mutex<Vec<String>>> = Default::default();
    let (counted, seen) = (requests.clone(), authorities.clone());
    let answered = Arc::new(Mutex::new(Vec::new()));
    let log = answered.clone();
    tokio::spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let (acceptor, counted, seen, held, log) =
                (acceptor.clone(), counted.clone(), seen.clone(), held.clone(), log.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let (counted, seen, held, log) = (counted.clone(), seen.clone(), held.clone(), log.clone());
                    async move {
                        counted.fetch_add(1, Ordering::SeqCst);
                        if req.uri().path() == "/hold" {
                            held.acquire().await.unwrap().forget();
                        }
                        let hosts: Vec<String> = req
                            .headers()
                            .get_all("host")
                            .iter()
                            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                            .collect();
                        let uri = req.uri().authority().map(|a| a.to_string()).unwrap_or_default();
                        seen.lock().unwrap().push(format!("uri={uri} host={}", hosts.join(",")));
                        let auth = req.headers().get("authorization").map(|v| v.to_str().unwrap().to_string());
                        let query = req.uri().query().unwrap_or_default().to_string();
                        let version = format!("{:?}", req.version());
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let text = format!(
                            "auth={} query={query} body={} proto={version}",
                            auth.unwrap_or_default(),
                            String::from_utf8_lossy(&body)
                        );
                        log.lock().unwrap().push(text.clone());
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(text))))
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    Upstream { addr, ca_file, requests, release, authorities, seen: answered }
}

/// The sandbox's side: its bindings (changeable), its events and its
/// body budget.
struct Hooks {
    bindings: Mutex<Vec<Arc<Binding>>>,
    events: Mutex<Vec<BrokerEvent>>,
    budget: Arc<BodyBudget>,
}

impl Default for Hooks {
    fn default() -> Self {
        Hooks {
            bindings: Mutex::default(),
            events: Mutex::default(),
            budget: BodyBudget::new(tine_broker::DEFAULT_SANDBOX_BODY_BUDGET),
        }
    }
}

impl FlowHooks for Hooks {
    fn bindings(&self) -> Vec<Arc<Binding>> {
        self.bindings.lock().unwrap().clone()
    }
    fn event(&self, event: BrokerEvent) {
        self.events.lock().unwrap().push(event);
    }
    fn body_budget(&self) -> Arc<BodyBudget> {
        self.budget.clone()
    }
}

fn binding(secret: &str, placeholder: &str, host: &str, in_body: bool) -> Arc<Binding> {
    Arc::new(Binding {
        secret: secret.into(),
        placeholder: placeholder.into(),
        value: Arc::new(SecretValue::new(VALUE.as_bytes().to_vec())),
        hosts: vec![HostPattern::parse(host).unwrap()],
        header: None,
        any_header: false,
        format: None,
        in_query: true,
        in_body,
    })
}

/// A client connection through the broker: TLS to `api.test` trusting
/// the broker's CA with `alpn`, then HTTP/1.1 or HTTP/2 as negotiated.
enum Client {
    H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

impl Client {
    async fn send(&mut self, req: Request<Full<Bytes>>) -> (u16, String) {
        let resp = match self {
            Client::H1(s) => s.send_request(req).await.unwrap(),
            Client::H2(s) => s.send_request(req).await.unwrap(),
        };
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }
}

type GuestTls = tokio_rustls::client::TlsStream<tokio::net::UnixStream>;

/// Starts a flow: the broker serves one end of a socket pair, the client
/// speaks on the other.
async fn open(broker: &Arc<Broker>, up: &Upstream, hooks: Arc<Hooks>, alpn: &[&[u8]]) -> Client {
    let tls = tls(broker, up, hooks, alpn).await;
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let io = TokioIo::new(tls);
    if h2 {
        let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await.unwrap();
        tokio::spawn(conn);
        Client::H2(send)
    } else {
        let (send, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
        tokio::spawn(conn.with_upgrades());
        Client::H1(send)
    }
}

/// A flow's guest side up to its TLS (for requests written by hand).
async fn tls(broker: &Arc<Broker>, up: &Upstream, hooks: Arc<Hooks>, alpn: &[&[u8]]) -> GuestTls {
    let (guest, inside) = tokio::net::UnixStream::pair().unwrap();
    let upstream = tokio::net::TcpStream::connect(up.addr).await.unwrap();
    let b = broker.clone();
    let port = up.addr.port();
    tokio::spawn(async move {
        let r = b.serve(inside, Flow { name: "api.test".into(), port, upstream, hooks }).await;
        if let Err(e) = r {
            eprintln!("flow ended: {e}");
        }
    });
    let roots = testkit::tls::roots(broker.ca_pem());
    let mut config =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let name = rustls_pki_types::ServerName::try_from("api.test").unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, guest).await.expect("TLS to the broker")
}

/// Writes `head` (an HTTP/1.1 request head, `Connection: close`) on a new
/// flow and reads the answer to its end: its status code.
async fn raw(broker: &Arc<Broker>, up: &Upstream, hooks: Arc<Hooks>, head: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tls = tls(broker, up, hooks, &[b"http/1.1"]).await;
    tls.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    // Until the broker closes (a TLS close without close_notify is an end too).
    while let Ok(n @ 1..) = tls.read(&mut buf).await {
        got.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&got);
    let status = text.strip_prefix("HTTP/1.1 ").and_then(|t| t.get(..3)).and_then(|c| c.parse().ok());
    status.unwrap_or_else(|| panic!("no HTTP answer to {head:?}: {text:?}"))
}

fn broker(up: &Upstream) -> Arc<Broker> {
    let dir = tempfile::tempdir().unwrap();
    let ca = Arc::new(CertificateAuthority::load_or_create(dir.path(), "test").unwrap());
    Arc::new(
        Broker::new(BrokerConfig { ca, native_roots: false, extra_roots: vec![up.ca_file.path().to_path_buf()] })
            .unwrap(),
    )
}

fn get(uri: &str, host: &str, auth: &str) -> Request<Full<Bytes>> {
    Request::get(uri).header("host", host).header("authorization", auth).body(Full::default()).unwrap()
}

#[tokio::test]
async fn http1_requests_carry_the_value_until_the_secret_is_detached() {
    let up = upstream();
    let broker = broker(&up);
    let hooks = Arc::new(Hooks::default());
    hooks.bindings.lock().unwrap().push(binding("api", PLACEHOLDER, "api.test", false));
    let mut c = open(&broker, &up, hooks.clone(), &[b"http/1.1"]).await;
    assert!(matches!(c, Client::H1(_)));
    let (status, body) =
        c.send(get(&format!("/v1?key={PLACEHOLDER}"), "api.test", &format!("Bearer {PLACEHOLDER}"))).await;
    assert_eq!(status, 200);
    assert_eq!(up.last(), format!("auth=Bearer {VALUE} query=key={VALUE} body= proto=HTTP/1.1"));
    assert_eq!(
        body,
        format!("auth=Bearer {PLACEHOLDER} query=key={PLACEHOLDER} body= proto=HTTP/1.1"),
        "the echo comes back scrubbed"
    );
    // Detached: the next request on the same connection is not swapped.
    hooks.bindings.lock().unwrap().clear();
    let (_, body) = c.send(get("/v1", "api.test", &format!("Bearer {PLACEHOLDER}"))).await;
    assert_eq!(up.last(), format!("auth=Bearer {PLACEHOLDER} query= body= proto=HTTP/1.1"));
    assert_eq!(body, up.last());
    let events = hooks.events.lock().unwrap().clone();
    assert!(
        matches!(&events[0], BrokerEvent::Request { status: 200, swapped, path, .. } if swapped == &["api"] && path == "/v1"),
        "{events:?}"
    );
    assert!(
        matches!(&events[1], BrokerEvent::EchoScrubbed { secrets, path, .. } if secrets == &["api"] && path == "/v1"),
        "the echo of the first answer was scrubbed: {events:?}"
    );
    assert!(matches!(&events[2], BrokerEvent::Request { swapped, .. } if swapped.is_empty()), "{events:?}");
    assert_eq!(events.len(), 3, "nothing to scrub after the detach: {events:?}");
    assert!(!format!("{events:?}").contains(VALUE), "events never carry the value");
}

#[tokio::test]
async fn http2_stays_http2_and_bodies_are_swapped_where_the_secret_says() {
    let up = upstream();
    let broker = broker(&up);
    let hooks = Arc::new(Hooks::default());
    hooks.bindings.lock().unwrap().push(binding("api", PLACEHOLDER, "api.test", true));
    let mut c = open(&broker, &up, hooks.clone(), &[b"h2", b"http/1.1"]).await;
    assert!(matches!(c, Client::H2(_)), "the host chose h2, so the guest gets h2");
    let req = Request::post("https://api.test/v1/chat")
        .header("authorization", format!("Bearer {PLACEHOLDER}"))
        .body(Full::new(Bytes::from(format!("{{\"key\":\"{PLACEHOLDER}\"}}"))))
        .unwrap();
    let (status, body) = c.send(req).await;
    assert_eq!(status, 200);
    assert_eq!(up.last(), format!("auth=Bearer {VALUE} query= body={{\"key\":\"{VALUE}\"}} proto=HTTP/2.0"));
    assert_eq!(body, format!("auth=Bearer {PLACEHOLDER} query= body={{\"key\":\"{PLACEHOLDER}\"}} proto=HTTP/2.0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_held_to_swap_in_share_one_budget_per_sandbox() {
    let up = upstream();
    let broker = broker(&up);
    // Room for one body of nearly 1 MiB, not two.
    let budget = BodyBudget::new(3 << 19);
    let hooks = Arc::new(Hooks { budget: budget.clone(), ..Hooks::default() });
    hooks.bindings.lock().unwrap().push(binding("api", PLACEHOLDER, "api.test", true));
    let Client::H2(send) = open(&broker, &up, hooks.clone(), &[b"h2"]).await else { panic!("not h2") };
    let body = |path: &str| {
        let mut text = "x".repeat((1 << 20) - 100);
        text.push_str(PLACEHOLDER);
        Request::post(format!("https://api.test{path}")).body(Full::new(Bytes::from(text))).unwrap()
    };
    // A request the upstream holds: its body stays reserved meanwhile.
    let mut first = send.clone();
    let held = tokio::spawn(async move { first.send_request(body("/hold")).await.unwrap().status().as_u16() });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while up.requests.load(Ordering::SeqCst) == 0 {
        assert!(std::time::Instant::now() < deadline, "the held request did not reach the upstream");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(budget.held() >= (1 << 20) - 100, "the held body is counted: {}", budget.held());
    // A second one on another stream of the same connection does not fit.
    let resp = send.clone().send_request(body("/v1")).await.unwrap();
    assert_eq!(resp.status().as_u16(), 503);
    assert!(resp.headers().contains_key("retry-after"));
    let text = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&text).contains("at most; retry when one has been answered"), "{text:?}");
    assert_eq!(up.requests.load(Ordering::SeqCst), 1, "the refused request was not passed on");
    assert!(hooks
        .events
        .lock()
        .unwrap()
        .iter()
        .any(|e| matches!(e, BrokerEvent::BodyBudget { limit, .. } if *limit == 3 << 19)));
    // Answered, the first gives its bytes back, and the next fits.
    up.release.add_permits(1);
    assert_eq!(held.await.unwrap(), 200);
    let resp = send.clone().send_request(body("/v1")).await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert!(up.last().ends_with(&format!("{VALUE} proto=HTTP/2.0")), "swapped");
    assert_eq!(budget.held(), 0, "nothing stays reserved");
}

#[tokio::test]
async fn another_authority_gets_421_and_another_hosts_placeholder_stays() {
    let up = upstream();
    let broker = broker(&up);
    let hooks = Arc::new(Hooks::default());
    hooks.bindings.lock().unwrap().push(binding("api", PLACEHOLDER, "api.test", false));
    hooks.bindings.lock().unwrap().push(binding("other", "tine_placeholder_other", "other.test", false));
    let mut c = open(&broker, &up, hooks.clone(), &[b"http/1.1"]).await;
    let before = up.requests.load(Ordering::SeqCst);
    let (status, _) = c.send(get("/", "evil.test", &format!("Bearer {PLACEHOLDER}"))).await;
    assert_eq!(status, 421, "a request for another authority is not passed on");
    assert_eq!(up.requests.load(Ordering::SeqCst), before);
    let (status, body) = c.send(get("/", "api.test", "Bearer tine_placeholder_other")).await;
    assert_eq!(status, 200);
    assert_eq!(body, "auth=Bearer tine_placeholder_other query= body= proto=HTTP/1.1", "not for this host");
    let events = hooks.events.lock().unwrap().clone();
    assert!(events.iter().any(|e| matches!(e, BrokerEvent::Misdirected { authority, .. } if authority == "evil.test")));
    assert!(events.iter().any(|e| matches!(e, BrokerEvent::LeakBlocked { secrets, .. } if secrets == &["other"])));
}

#[tokio::test]
async fn an_upstream_the_broker_does_not_trust_ends_the_flow() {
    let up = upstream();
    let dir = tempfile::tempdir().unwrap();
    let ca = Arc::new(CertificateAuthority::load_or_create(dir.path(), "test").unwrap());
    // Trusting only its own CA: the upstream's certificate does not verify.
    let own = dir.path().join(tine_broker::ca::CA_CERT_FILE);
    let broker = Broker::new(BrokerConfig { ca, native_roots: false, extra_roots: vec![own] }).unwrap();
    let (guest, inside) = tokio::net::UnixStream::pair().unwrap();
    let upstream = tokio::net::TcpStream::connect(up.addr).await.unwrap();
    let hooks = Arc::new(Hooks::default());
    let client = tokio::spawn(async move {
        let roots = testkit::tls::roots(&std::fs::read_to_string(up.ca_file.path()).unwrap());
        let config =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
        let name = rustls_pki_types::ServerName::try_from("api.test").unwrap();
        tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, guest).await.is_ok()
    });
    let r = broker.serve(inside, Flow { name: "api.test".into(), port: 443, upstream, hooks }).await;
    let e = r.unwrap_err().to_string();
    assert!(e.starts_with("upstream:") && e.contains("certificate"), "{e}");
    assert!(!client.await.unwrap(), "the guest's handshake does not complete");
}

#[tokio::test]
async fn every_authority_a_request_names_must_be_the_flows_and_the_broker_writes_it() {
    let up = upstream();
    let broker = broker(&up);
    let hooks = Arc::new(Hooks::default());
    hooks.bindings.lock().unwrap().push(binding("api", PLACEHOLDER, "api.test", false));
    let auth = format!("Authorization: Bearer {PLACEHOLDER}\r\nConnection: close\r\n\r\n");
    // HTTP/1.1: an absolute-form target naming another host than Host, or
    // Host another than the target, a second Host, a Host at another port.
    for head in [
        format!("GET https://evil.test/ HTTP/1.1\r\nHost: api.test\r\n{auth}"),
        format!("GET https://api.test/ HTTP/1.1\r\nHost: evil.test\r\n{auth}"),
        format!("GET / HTTP/1.1\r\nHost: api.test\r\nHost: evil.test\r\n{auth}"),
        format!("GET / HTTP/1.1\r\nHost: evil.test\r\nHost: api.test\r\n{auth}"),
        format!("GET / HTTP/1.1\r\nHost: api.test:1\r\n{auth}"),
    ] {
        assert_eq!(raw(&broker, &up, hooks.clone(), &head).await, 421, "{head:?}");
    }
    // HTTP/2: a host header beside :authority, and another :authority.
    let mut c = open(&broker, &up, hooks.clone(), &[b"h2"]).await;
    assert!(matches!(c, Client::H2(_)));
    for (uri, host) in [("https://api.test/", Some("evil.test")), ("https://evil.test/", None)] {
        let mut req = Request::get(uri).header("authorization", format!("Bearer {PLACEHOLDER}"));
        if let Some(h) = host {
            req = req.header("host", h);
        }
        let (status, _) = c.send(req.body(Full::default()).unwrap()).await;
        assert_eq!(status, 421, "{uri} host {host:?}");
    }
    assert_eq!(up.requests.load(Ordering::SeqCst), 0, "nothing of a misdirected request went upstream");
    let events = hooks.events.lock().unwrap().clone();
    assert_eq!(events.iter().filter(|e| matches!(e, BrokerEvent::Misdirected { .. })).count(), 7, "{events:?}");

    // The flow's own authority passes, and the upstream sees the one the
    // broker wrote (the TLS name and the port), in HTTP/1.1 and HTTP/2.
    let port = up.addr.port();
    let head = format!("GET https://API.test:{port}/ HTTP/1.1\r\nHost: api.test\r\n{auth}");
    assert_eq!(raw(&broker, &up, hooks.clone(), &head).await, 200);
    let (status, body) = c.send(get("https://api.test/v2", "api.test", &format!("Bearer {PLACEHOLDER}"))).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(up.last(), format!("auth=Bearer {VALUE} query= body= proto=HTTP/2.0"));
    assert_eq!(
        *up.authorities.lock().unwrap(),
        [format!("uri= host=api.test:{port}"), format!("uri=api.test:{port} host=")],
        "origin-form and one Host in HTTP/1.1, :authority alone in HTTP/2"
    );
}

// ---- Responses scrubbed of the value (issue 58, item 1) ----

/// A value with the characters its encoded forms change (`/`, `+`, ` `,
/// `"`, `&`, `=`), so percent-encoded, JSON-escaped and base64 forms all
/// differ from the raw one.
const ECHOED: &str = "sk-live/Q+w \"7\"&z=9";

/// A response body of given frames (data and trailers), of unknown length
/// (HTTP/1.1 sends it chunked, one chunk a frame).
struct Frames(std::collections::VecDeque<hyper::body::Frame<Bytes>>);

impl hyper::body::Body for Frames {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Infallible>>> {
        std::task::Poll::Ready(self.0.pop_front().map(Ok))
    }
}

fn frames(data: Vec<Vec<u8>>, trailers: Option<hyper::HeaderMap>) -> Frames {
    let mut f: std::collections::VecDeque<_> =
        data.into_iter().map(|d| hyper::body::Frame::data(Bytes::from(d))).collect();
    f.extend(trailers.map(hyper::body::Frame::trailers));
    Frames(f)
}

fn percent(v: &[u8]) -> String {
    v.iter()
        .map(|&b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn json_escaped(v: &[u8]) -> String {
    String::from_utf8_lossy(v).replace('\\', "\\\\").replace('"', "\\\"").replace('/', "\\/")
}

/// A WebSocket frame from the host (unmasked).
fn ws_frame(fin: bool, opcode: u8, payload: &[u8]) -> Vec<u8> {
    assert!(payload.len() < 126);
    let mut f = vec![if fin { 0x80 } else { 0 } | opcode, payload.len() as u8];
    f.extend_from_slice(payload);
    f
}

/// An echo service: each path sends back the value it got (after
/// `Authorization: Bearer `) in one place or form of a response.
async fn echo(req: Request<hyper::body::Incoming>) -> Result<Response<Frames>, Infallible> {
    use base64::Engine;
    let value = req.headers().get("authorization").map(|v| v.as_bytes().to_vec()).unwrap_or_default();
    let value = value.strip_prefix(b"Bearer ").map(<[u8]>::to_vec).unwrap_or(value);
    let seen_ae = req.headers().get("accept-encoding").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    let text = [b"you sent: ".as_slice(), &value, b" (end)"].concat();
    let r = Response::builder().header("x-seen-accept-encoding", seen_ae);
    let resp = match req.uri().path() {
        "/header" => {
            let reason =
                hyper::ext::ReasonPhrase::try_from([b"Incorrect API key ".as_slice(), &value].concat()).unwrap();
            r.status(401)
                .header("x-echo", hyper::header::HeaderValue::from_bytes(&value).unwrap())
                .header("access-control-allow-origin", hyper::header::HeaderValue::from_bytes(&value).unwrap())
                .extension(reason)
                .body(frames(vec![b"{}".to_vec()], None))
        }
        "/length" => r.header("content-length", text.len()).body(frames(vec![text], None)),
        "/chunked" => {
            // Split in the value's middle, and the value in a trailer too.
            let cut = 10 + value.len() / 2;
            let mut trailers = hyper::HeaderMap::new();
            trailers.insert("x-signed-with", hyper::header::HeaderValue::from_bytes(&value).unwrap());
            r.header("trailer", "x-signed-with")
                .body(frames(vec![text[..cut].to_vec(), text[cut..].to_vec()], Some(trailers)))
        }
        "/gzip" => {
            use std::io::Write;
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            gz.write_all(&text).unwrap();
            let gz = gz.finish().unwrap();
            let mid = gz.len() / 2;
            r.header("content-encoding", "gzip")
                .header("content-length", gz.len())
                .body(frames(vec![gz[..mid].to_vec(), gz[mid..].to_vec()], None))
        }
        "/forms" => {
            let b64 = base64::engine::general_purpose::STANDARD;
            let inner = b64.encode([b"{\"key\":\"".as_slice(), &value, b"\"}"].concat());
            let body = format!(
                "b64={} inner={inner} url={} pct={} json=\"{}\" hex={}",
                b64.encode(&value),
                base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&value),
                percent(&value),
                json_escaped(&value),
                value.iter().map(|b| format!("{b:02x}")).collect::<String>(),
            );
            r.body(frames(vec![body.into_bytes()], None))
        }
        "/compress" => r.header("content-encoding", "compress").body(frames(vec![text], None)),
        "/ws" => {
            let saw_ext = req.headers().contains_key("sec-websocket-extensions");
            let upgrade = hyper::upgrade::on(req);
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                let Ok(up) = upgrade.await else { return };
                let mut io = TokioIo::new(up);
                let half = value.len() / 2;
                let mut out = ws_frame(false, 1, &[b"hello ".as_slice(), &value[..half]].concat());
                out.extend(ws_frame(true, 0, &[&value[half..], b" bye".as_slice()].concat()));
                out.extend(ws_frame(true, 2, &value));
                out.extend(ws_frame(true, 8, &[&[0x0f, 0xa0][..], b"bad key ", &value].concat()));
                let _ = io.write_all(&out).await;
                let _ = io.shutdown().await;
            });
            r.status(101)
                .header("upgrade", "websocket")
                .header("connection", "upgrade")
                .header("x-saw-extensions", saw_ext.to_string())
                .body(frames(Vec::new(), None))
        }
        _ => r.status(404).body(frames(Vec::new(), None)),
    };
    Ok(resp.unwrap())
}

/// An HTTPS upstream for `api.test` answering with [`echo`].
fn echo_upstream() -> Upstream {
    let (ca_file, acceptor, listener, addr) = tls_listener();
    tokio::spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection_with_upgrades(TokioIo::new(tls), hyper::service::service_fn(echo))
                    .await;
            });
        }
    });
    Upstream {
        addr,
        ca_file,
        requests: Arc::new(AtomicU64::new(0)),
        release: Arc::new(tokio::sync::Semaphore::new(0)),
        authorities: Arc::default(),
        seen: Arc::default(),
    }
}

/// What the guest got: the head, the body, the trailers.
struct Got {
    head: hyper::http::response::Parts,
    body: Vec<u8>,
    trailers: Option<hyper::HeaderMap>,
}

impl Got {
    /// Everything the guest read, as text: status reason, headers, body, trailers.
    fn all(&self) -> String {
        let mut t = String::new();
        if let Some(r) = self.head.extensions.get::<hyper::ext::ReasonPhrase>() {
            t += &format!("reason: {}\n", String::from_utf8_lossy(r.as_bytes()));
        }
        for (k, v) in self.head.headers.iter().chain(self.trailers.iter().flatten()) {
            t += &format!("{k}: {}\n", String::from_utf8_lossy(v.as_bytes()));
        }
        t + &String::from_utf8_lossy(&self.body)
    }
}

impl Client {
    async fn get_all(&mut self, req: Request<Full<Bytes>>) -> Got {
        let resp = match self {
            Client::H1(s) => s.send_request(req).await.unwrap(),
            Client::H2(s) => s.send_request(req).await.unwrap(),
        };
        let (head, body) = resp.into_parts();
        let collected = body.collect().await.unwrap();
        let trailers = collected.trailers().cloned();
        Got { head, body: collected.to_bytes().to_vec(), trailers }
    }
}

fn echo_binding() -> Arc<Binding> {
    Arc::new(Binding {
        secret: "api".into(),
        placeholder: PLACEHOLDER.into(),
        value: Arc::new(SecretValue::new(ECHOED.as_bytes().to_vec())),
        hosts: vec![HostPattern::parse("api.test").unwrap()],
        header: None,
        format: None,
        in_query: false,
        in_body: false,
        any_header: false,
    })
}

fn echo_req(h2: bool, path: &str) -> Request<Full<Bytes>> {
    let b = if h2 {
        Request::get(format!("https://api.test{path}"))
    } else {
        Request::get(path).header("host", "api.test")
    };
    b.header("authorization", format!("Bearer {PLACEHOLDER}"))
        .header("accept-encoding", "gzip, compress")
        .body(Full::default())
        .unwrap()
}

/// Every form of the value the echo server uses, none of which the guest may read.
fn assert_clean(what: &str, got: &str) {
    use base64::Engine;
    let v = ECHOED.as_bytes();
    for form in [
        ECHOED.to_string(),
        base64::engine::general_purpose::STANDARD.encode(v),
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v),
        percent(v),
        json_escaped(v),
        v.iter().map(|b| format!("{b:02x}")).collect(),
        // The value's own middle: what any echo of it holds.
        ECHOED[3..ECHOED.len() - 3].to_string(),
    ] {
        assert!(!got.contains(&form), "{what}: the guest read the value ({form}) in:\n{got}");
    }
}

#[tokio::test]
async fn an_echoed_value_reaches_the_guest_as_its_placeholder_http1() {
    let up = echo_upstream();
    let broker = broker(&up);
    let hooks = Arc::new(Hooks::default());
    hooks.bindings.lock().unwrap().push(echo_binding());
    let mut c = open(&broker, &up, hooks.clone(), &[b"http/1.1"]).await;
    assert!(matches!(c, Client::H1(_)));
    // In the status reason and headers.
    let got = c.get_all(echo_req(false, "/header")).await;
    assert_eq!(got.head.status, 401);
    assert_clean("headers", &got.all());
    assert_eq!(got.head.headers["x-echo"], PLACEHOLDER);
    assert_eq!(got.head.headers["access-control-allow-origin"], PLACEHOLDER);
    let reason = got.head.extensions.get::<hyper::ext::ReasonPhrase>().map(|r| r.as_bytes().to_vec());
    assert_eq!(reason.as_deref(), Some(format!("Incorrect API key {PLACEHOLDER}").as_bytes()));
    // A content-length body: the length follows the new body.
    let got = c.get_all(echo_req(false, "/length")).await;
    assert_clean("content-length body", &got.all());
    assert_eq!(String::from_utf8_lossy(&got.body), format!("you sent: {PLACEHOLDER} (end)"));
    assert!(got.head.headers.get("content-length").is_none_or(|l| l == &got.body.len().to_string()));
    // Chunked, split in the value's middle.
    let got = c.get_all(echo_req(false, "/chunked")).await;
    assert_clean("chunked body", &got.all());
    assert_eq!(String::from_utf8_lossy(&got.body), format!("you sent: {PLACEHOLDER} (end)"));
    // gzip: asked for (compress is not), decoded, sent on identity.
    let got = c.get_all(echo_req(false, "/gzip")).await;
    assert_clean("gzip body", &got.all());
    assert_eq!(got.head.headers["x-seen-accept-encoding"], "gzip", "only codings the broker decodes are asked for");
    assert!(got.head.headers.get("content-encoding").is_none());
    assert_eq!(String::from_utf8_lossy(&got.body), format!("you sent: {PLACEHOLDER} (end)"));
    // Encoded forms.
    let got = c.get_all(echo_req(false, "/forms")).await;
    assert_clean("encoded forms", &got.all());
    let body = String::from_utf8_lossy(&got.body).to_string();
    {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        assert!(body.starts_with(&format!("b64={} ", b64.encode(PLACEHOLDER))), "{body}");
        assert!(body.contains(&format!("pct={PLACEHOLDER} json=\"{PLACEHOLDER}\"")), "{body}");
    }
    // A coding the broker cannot read: refused, not passed on unread.
    let got = c.get_all(echo_req(false, "/compress")).await;
    assert_eq!(got.head.status, 502);
    assert_clean("refused coding", &got.all());
    assert!(String::from_utf8_lossy(&got.body).contains("compress"), "{}", got.all());
    let events = hooks.events.lock().unwrap().clone();
    let scrubbed =
        events.iter().filter(|e| matches!(e, BrokerEvent::EchoScrubbed { secrets, .. } if secrets == &["api"])).count();
    assert!(scrubbed >= 5, "each echo is logged: {events:?}");
    assert!(!format!("{events:?}").contains(ECHOED), "events never carry the value");
}

#[tokio::test]
async fn an_echoed_value_reaches_the_guest_as_its_placeholder_http2() {
    let up = echo_upstream();
    let broker = broker(&up);
    let hooks = Arc::new(Hooks::default());
    hooks.bindings.lock().unwrap().push(echo_binding());
    let mut c = open(&broker, &up, hooks.clone(), &[b"h2"]).await;
    assert!(matches!(c, Client::H2(_)));
    for path in ["/header", "/length", "/chunked", "/gzip", "/forms"] {
        let got = c.get_all(echo_req(true, path)).await;
        assert_clean(path, &got.all());
        if path == "/chunked" {
            let t = got.trailers.as_ref().expect("trailers pass");
            assert_eq!(t["x-signed-with"], PLACEHOLDER, "trailers are scrubbed");
            assert_eq!(String::from_utf8_lossy(&got.body), format!("you sent: {PLACEHOLDER} (end)"));
        }
    }
    let got = c.get_all(echo_req(true, "/compress")).await;
    assert_eq!(got.head.status, 502);
}

#[tokio::test]
async fn an_echoed_value_in_websocket_messages_reaches_the_guest_as_its_placeholder() {
    use tokio::io::AsyncReadExt;
    let up = echo_upstream();
    let broker = broker(&up);
    let hooks = Arc::new(Hooks::default());
    hooks.bindings.lock().unwrap().push(echo_binding());
    let Client::H1(mut send) = open(&broker, &up, hooks.clone(), &[b"http/1.1"]).await else { panic!("h1") };
    let req = Request::get("/ws")
        .header("host", "api.test")
        .header("authorization", format!("Bearer {PLACEHOLDER}"))
        .header("connection", "upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-version", "13")
        .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
        .header("sec-websocket-extensions", "permessage-deflate")
        .body(Full::default())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 101);
    assert_eq!(resp.headers()["x-saw-extensions"], "false", "no compression the broker could not read through");
    let mut io = TokioIo::new(hyper::upgrade::on(resp).await.unwrap());
    let mut raw = Vec::new();
    io.read_to_end(&mut raw).await.unwrap();
    // Messages: data frames joined up to FIN; control frames on their own.
    let (mut messages, mut current, mut close) = (Vec::new(), Vec::new(), None);
    let mut at = 0;
    while at < raw.len() {
        let (fin, opcode) = (raw[at] & 0x80 != 0, raw[at] & 0x0f);
        assert_eq!(raw[at + 1] & 0x80, 0, "unmasked");
        let (len, head) = match raw[at + 1] & 0x7f {
            126 => (u16::from_be_bytes([raw[at + 2], raw[at + 3]]) as usize, 4),
            127 => panic!("no frame that long"),
            n => (n as usize, 2),
        };
        let payload = &raw[at + head..at + head + len];
        at += head + len;
        if opcode == 8 {
            close = Some(payload.to_vec());
            continue;
        }
        current.extend_from_slice(payload);
        if fin {
            messages.push(String::from_utf8(std::mem::take(&mut current)).unwrap());
        }
    }
    assert_clean("websocket", &String::from_utf8_lossy(&raw));
    assert_eq!(messages, vec![format!("hello {PLACEHOLDER} bye"), PLACEHOLDER.to_string()]);
    let close = close.expect("the close frame passes");
    assert_eq!(&close[..2], &[0x0f, 0xa0]);
    assert_eq!(String::from_utf8_lossy(&close[2..]), format!("bad key {PLACEHOLDER}"));
    let events = hooks.events.lock().unwrap().clone();
    assert!(events.iter().any(|e| matches!(e, BrokerEvent::EchoScrubbed { path, .. } if path == "/ws")), "{events:?}");
}
