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
//! written by the broker.

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
}

fn upstream() -> Upstream {
    let ca = testkit::tls::TestCa::new("test upstream CA");
    let ca_file = tempfile::NamedTempFile::new().unwrap();
    ca.write_pem(ca_file.path());
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(ca.server_config("api.test")));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicU64::new(0));
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let held = release.clone();
    let authorities: Arc<Mutex<Vec<String>>> = Default::default();
    let (counted, seen) = (requests.clone(), authorities.clone());
    tokio::spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let (acceptor, counted, seen, held) = (acceptor.clone(), counted.clone(), seen.clone(), held.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let (counted, seen, held) = (counted.clone(), seen.clone(), held.clone());
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
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(text))))
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    Upstream { addr, ca_file, requests, release, authorities }
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
        tokio::spawn(conn);
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
    assert_eq!(body, format!("auth=Bearer {VALUE} query=key={VALUE} body= proto=HTTP/1.1"));
    // Detached: the next request on the same connection is not swapped.
    hooks.bindings.lock().unwrap().clear();
    let (_, body) = c.send(get("/v1", "api.test", &format!("Bearer {PLACEHOLDER}"))).await;
    assert_eq!(body, format!("auth=Bearer {PLACEHOLDER} query= body= proto=HTTP/1.1"));
    let events = hooks.events.lock().unwrap().clone();
    assert!(
        matches!(&events[0], BrokerEvent::Request { status: 200, swapped, path, .. } if swapped == &["api"] && path == "/v1"),
        "{events:?}"
    );
    assert!(matches!(&events[1], BrokerEvent::Request { swapped, .. } if swapped.is_empty()), "{events:?}");
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
    assert_eq!(body, format!("auth=Bearer {VALUE} query= body={{\"key\":\"{VALUE}\"}} proto=HTTP/2.0"));
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
    let text = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&text).ends_with(&format!("{VALUE} proto=HTTP/2.0")), "swapped");
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
    assert_eq!((status, body), (200, format!("auth=Bearer {VALUE} query= body= proto=HTTP/2.0")));
    assert_eq!(
        *up.authorities.lock().unwrap(),
        [format!("uri= host=api.test:{port}"), format!("uri=api.test:{port} host=")],
        "origin-form and one Host in HTTP/1.1, :authority alone in HTTP/2"
    );
}
