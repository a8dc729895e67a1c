//! The secret broker's own cost (issue 35), on the host without a guest:
//! a host client speaks TLS through the broker (over a socket pair, as
//! the NAT hands a flow over) to a loopback HTTPS server (hyper and
//! rustls, a CA of the bench's own), against the same client straight to
//! the server, in one run:
//!
//! - the time per request once the connection is up (`BROKER_BENCH_REQUESTS`
//!   small GETs one after the other on one connection, default 2000), over
//!   HTTP/1.1 and HTTP/2, and what the broker adds;
//! - the throughput of a `BROKER_BENCH_MIB` (default 10) MiB response, the
//!   median of `BROKER_BENCH_ROUNDS` (default 15), direct and brokered
//!   rounds taking turns.
//!
//! Every request through the broker carries a placeholder that it swaps
//! for the value (checked). Target: throughput at least 0.8x direct,
//! under 1 ms added per request. Measures, asserts only that the swap
//! happened.
//!
//! `cargo bench -p tine-benches --bench broker`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tine_benches::{env_or, median, record};
use tine_broker::{
    Binding, BodyBudget, Broker, BrokerConfig, BrokerEvent, CertificateAuthority, Flow, FlowHooks, HostPattern,
    SecretValue, DEFAULT_SANDBOX_BODY_BUDGET,
};

const VALUE: &str = "sk-bench-value";
const PLACEHOLDER: &str = "tine_placeholder_bench";

struct Hooks(Vec<Arc<Binding>>, Arc<BodyBudget>);

impl FlowHooks for Hooks {
    fn bindings(&self) -> Vec<Arc<Binding>> {
        self.0.clone()
    }
    fn event(&self, _: BrokerEvent) {}
    fn body_budget(&self) -> Arc<BodyBudget> {
        self.1.clone()
    }
}

/// The server: `/small` answers 16 bytes (`ok` when `Authorization` has
/// the value), `/big` `big` bytes.
async fn server(big: usize, ca_file: &std::path::Path) -> std::net::SocketAddr {
    let ca = testkit::tls::TestCa::new("broker bench CA");
    ca.write_pem(ca_file);
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(ca.server_config("api.bench")));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let body = Bytes::from(vec![b'x'; big]);
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let _ = tcp.set_nodelay(true);
            let (acceptor, body) = (acceptor.clone(), body.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let body = body.clone();
                    async move {
                        let out = if req.uri().path() == "/big" {
                            body
                        } else {
                            let ok = req
                                .headers()
                                .get("authorization")
                                .is_some_and(|v| v == format!("Bearer {VALUE}").as_str());
                            Bytes::from_static(if ok { b"ok-ok-ok-ok-ok-o" } else { b"no-no-no-no-no-n" })
                        };
                        Ok::<_, Infallible>(Response::new(Full::new(out)))
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    addr
}

enum Client {
    H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

impl Client {
    async fn get(&mut self, path: &str) -> Bytes {
        let req = Request::get(format!("https://api.bench{path}"))
            .header("host", "api.bench")
            .header("authorization", format!("Bearer {PLACEHOLDER}"))
            .body(Full::default())
            .unwrap();
        let resp = match self {
            Client::H1(s) => {
                let (mut parts, body) = req.into_parts();
                parts.uri = path.parse().unwrap();
                s.ready().await.unwrap();
                s.send_request(Request::from_parts(parts, body)).await.unwrap()
            }
            Client::H2(s) => {
                s.ready().await.unwrap();
                s.send_request(req).await.unwrap()
            }
        };
        resp.into_body().collect().await.unwrap().to_bytes()
    }
}

/// A client connection trusting `roots`, over `io`, offering `alpn`.
async fn client<S>(io: S, roots: &rustls::RootCertStore, alpn: &[u8]) -> Client
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut config =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots.clone())
            .with_no_client_auth();
    config.alpn_protocols = vec![alpn.to_vec()];
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(rustls::pki_types::ServerName::try_from("api.bench").unwrap(), io)
        .await
        .unwrap();
    let io = TokioIo::new(tls);
    if alpn == b"h2" {
        let (s, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await.unwrap();
        tokio::spawn(conn);
        Client::H2(s)
    } else {
        let (s, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
        tokio::spawn(conn);
        Client::H1(s)
    }
}

fn roots(pem_file: &std::path::Path) -> rustls::RootCertStore {
    testkit::tls::roots(&std::fs::read_to_string(pem_file).unwrap())
}

/// A connection to `addr`: straight, or through the broker.
async fn open(
    addr: std::net::SocketAddr,
    broker: Option<&Arc<Broker>>,
    roots: &rustls::RootCertStore,
    alpn: &[u8],
) -> Client {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    match broker {
        None => client(tcp, roots, alpn).await,
        Some(b) => {
            let (guest, inside) = tokio::net::UnixStream::pair().unwrap();
            let b = b.clone();
            let binding = Arc::new(Binding {
                secret: "bench".into(),
                placeholder: PLACEHOLDER.into(),
                value: Arc::new(SecretValue::new(VALUE.as_bytes().to_vec())),
                hosts: vec![HostPattern::parse("api.bench").unwrap()],
                header: None,
                format: None,
                in_query: false,
                in_body: false,
                any_header: false,
            });
            tokio::spawn(async move {
                let _ = b
                    .serve(
                        inside,
                        Flow {
                            name: "api.bench".into(),
                            port: addr.port(),
                            upstream: tcp,
                            hooks: Arc::new(Hooks(vec![binding], BodyBudget::new(DEFAULT_SANDBOX_BODY_BUDGET))),
                        },
                    )
                    .await;
            });
            client(guest, roots, alpn).await
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _changes = tine_benches::report_changes_at_end("broker");
    let requests: usize = env_or("BROKER_BENCH_REQUESTS", 2000);
    let mib: usize = env_or("BROKER_BENCH_MIB", 10);
    let rounds: usize = env_or("BROKER_BENCH_ROUNDS", 15);
    let dir = tempfile::tempdir().unwrap();
    let upstream_ca = dir.path().join("upstream-ca.pem");
    let addr = server(mib << 20, &upstream_ca).await;
    let ca = Arc::new(CertificateAuthority::load_or_create(dir.path(), "bench").unwrap());
    let broker = Arc::new(
        Broker::new(BrokerConfig { ca, native_roots: false, extra_roots: vec![upstream_ca.clone()] }).unwrap(),
    );
    let direct_roots = roots(&upstream_ca);
    let broker_roots = roots(&dir.path().join(tine_broker::ca::CA_CERT_FILE));
    println!("broker bench: {requests} requests per run, {mib} MiB x {rounds} rounds");
    for (proto, alpn) in [("http1", &b"http/1.1"[..]), ("http2", &b"h2"[..])] {
        let mut per = Vec::new();
        for (way, b, r) in [("direct", None, &direct_roots), ("broker", Some(&broker), &broker_roots)] {
            let mut c = open(addr, b, r, alpn).await;
            let first = c.get("/small").await;
            if b.is_some() {
                assert_eq!(&first[..], b"ok-ok-ok-ok-ok-o", "the broker swapped the placeholder");
            }
            let t = Instant::now();
            for _ in 0..requests {
                c.get("/small").await;
            }
            let each = t.elapsed() / requests as u32;
            println!("{proto} {way}: {:.1} us per request", each.as_secs_f64() * 1e6);
            record("broker", &format!("{proto}_{way}_request_us"), each.as_secs_f64() * 1e6, "us");
            per.push(each);
        }
        let added = per[1].saturating_sub(per[0]);
        println!("{proto}: the broker adds {:.1} us per request", added.as_secs_f64() * 1e6);
        record("broker", &format!("{proto}_added_request_us"), added.as_secs_f64() * 1e6, "us");
    }
    // Direct and brokered rounds alternate, so that both see the same
    // machine (this one's neighbours come and go); medians of each.
    let mut samples: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    let mut cpu = [0.0f64; 2];
    for _ in 0..rounds {
        for (i, (b, r)) in [(None, &direct_roots), (Some(&broker), &broker_roots)].into_iter().enumerate() {
            let mut c = open(addr, b, r, b"http/1.1").await;
            let (t, c0) = (Instant::now(), cpu_seconds());
            let got = c.get("/big").await;
            samples[i].push(t.elapsed());
            cpu[i] += cpu_seconds() - c0;
            assert_eq!(got.len(), mib << 20);
        }
    }
    // Client, server and broker share this process: its CPU time per MiB
    // moved says what the broker costs where cores are not the limit.
    for (i, way) in ["direct", "broker"].into_iter().enumerate() {
        let per_mib_ms = cpu[i] * 1e3 / (rounds * mib) as f64;
        println!("{way}: {per_mib_ms:.2} ms of CPU per MiB (client, server and broker together)");
        record("broker", &format!("cpu_{way}_ms_per_mib"), per_mib_ms, "ms");
    }
    let mut rates = Vec::new();
    for (i, way) in ["direct", "broker"].into_iter().enumerate() {
        let m: Duration = median(&samples[i]);
        let rate = (mib << 20) as f64 / m.as_secs_f64() / 1e6;
        println!("{mib} MiB {way}: {rate:.0} MB/s (median {:.1} ms of {rounds})", m.as_secs_f64() * 1e3);
        record("broker", &format!("throughput_{way}_mb_s"), rate, "MB/s");
        rates.push(rate);
    }
    println!("throughput through the broker: {:.2}x direct", rates[1] / rates[0]);
    record("broker", "throughput_ratio", rates[1] / rates[0], "x");
}

/// This process's CPU time so far (user and system, s), from
/// `/proc/self/stat` (clock ticks of 10 ms: summed over many rounds).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command's closing parenthesis; utime and stime
    // are the 14th and 15th of the whole line (proc(5)).
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = [11, 12].iter().filter_map(|&i| fields.get(i)?.parse::<f64>().ok()).sum();
    ticks / 100.0
}
