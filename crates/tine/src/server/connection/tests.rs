//! [`serve_connection`] on in-memory duplex streams (real hyper, real
//! time, deadlines of a second or two) and [`PerAddress`].

use std::net::IpAddr;
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{serve_connection, ConnError, ConnLimits, PerAddress, CLOSE_GRACE};

/// How late a close may come after its deadline on a busy test host.
const SLACK: Duration = Duration::from_millis(1500);

/// `/` answers at once; `/stream` streams five chunks 400 ms apart.
fn app() -> Router {
    Router::new().route("/", get(|| async { "ok" })).route(
        "/stream",
        get(|| async {
            let chunks = futures_util::stream::unfold(0, |n| async move {
                if n == 5 {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(400)).await;
                Some((Ok::<_, std::io::Error>(format!("chunk {n}\n")), n + 1))
            });
            Body::from_stream(chunks)
        }),
    )
}

/// The builder as the server makes it, with hyper's HTTP/1 header read
/// timeout `header_read`.
fn builder(header_read: Duration) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1().timer(TokioTimer::new()).header_read_timeout(header_read);
    b.http2().timer(TokioTimer::new()).keep_alive_interval(None);
    b
}

/// A connection served under `limits` (hyper's header read timeout
/// `header_read`): the client's end, the task serving it, its shutdown.
fn connect(
    limits: ConnLimits,
    header_read: Duration,
) -> (DuplexStream, JoinHandle<Result<(), ConnError>>, CancellationToken) {
    let (client, server) = tokio::io::duplex(64 << 10);
    let shutdown = CancellationToken::new();
    let not_busy = tokio::sync::watch::channel(false).1;
    let conn = serve_connection(&builder(header_read), server, None, app(), limits, not_busy, shutdown.clone());
    (client, tokio::spawn(conn), shutdown)
}

/// Reads `client` to its end (EOF or an error); what came.
async fn read_to_close(client: &mut DuplexStream) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), client.read_to_end(&mut out))
        .await
        .expect("the server closed the connection within 30 s");
    out
}

/// Asserts `t` (when a close was seen, counted from `start`) is at
/// `deadline` or at most [`SLACK`] after.
fn closed_at(start: Instant, deadline: Duration, what: &str) {
    let took = start.elapsed();
    assert!(took + Duration::from_millis(50) >= deadline, "{what}: closed after {took:?}, before {deadline:?}");
    assert!(took <= deadline + SLACK, "{what}: closed after {took:?}, deadline {deadline:?}");
}

const LIMITS: ConnLimits = ConnLimits { first_request: Duration::from_secs(1), idle: Duration::from_secs(600) };

#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_at_the_first_request_deadline() {
    let start = Instant::now();
    let (mut client, task, _shutdown) = connect(LIMITS, Duration::from_secs(600));
    assert!(read_to_close(&mut client).await.is_empty());
    closed_at(start, LIMITS.first_request, "silent");
    assert!(matches!(task.await.unwrap(), Err(ConnError::NoFirstRequest(_))));
}

#[tokio::test]
async fn half_an_http2_preface_is_closed_at_the_first_request_deadline() {
    let start = Instant::now();
    let (mut client, task, _shutdown) = connect(LIMITS, Duration::from_secs(600));
    // hyper-util waits for 24 bytes to tell HTTP/2 from HTTP/1; 16 come.
    client.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    assert!(read_to_close(&mut client).await.is_empty());
    closed_at(start, LIMITS.first_request, "half preface");
    assert!(matches!(task.await.unwrap(), Err(ConnError::NoFirstRequest(_))));
}

/// The frame types in `bytes` (HTTP/2 frames, RFC 9113 §4.1).
fn frame_types(mut bytes: &[u8]) -> Vec<u8> {
    let mut types = Vec::new();
    while bytes.len() >= 9 {
        let len = usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
        types.push(bytes[3]);
        bytes = &bytes[(9 + len).min(bytes.len())..];
    }
    types
}

#[tokio::test]
async fn an_http2_connection_without_a_request_gets_a_goaway_at_the_deadline() {
    let start = Instant::now();
    let (mut client, task, _shutdown) = connect(LIMITS, Duration::from_secs(600));
    // The whole preface and an empty SETTINGS frame: the handshake is
    // done, but no HEADERS follow (and the server's PING is not answered).
    client.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
    client.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap();
    let got = read_to_close(&mut client).await;
    let took = start.elapsed();
    assert!(took + Duration::from_millis(50) >= LIMITS.first_request, "closed after {took:?}");
    assert!(took <= LIMITS.first_request + CLOSE_GRACE + SLACK, "closed after {took:?}");
    let types = frame_types(&got);
    assert_eq!(types.first(), Some(&4), "the server's SETTINGS first: {types:?}");
    assert!(types.contains(&7), "a GOAWAY before the close: {types:?}");
    assert!(matches!(task.await.unwrap(), Err(ConnError::NoFirstRequest(_))));
}

#[tokio::test]
async fn an_http1_connection_idle_after_its_request_is_closed_at_the_idle_limit() {
    let limits = ConnLimits { first_request: Duration::from_secs(600), idle: Duration::from_secs(1) };
    let (mut client, task, _shutdown) = connect(limits, Duration::from_secs(600));
    client.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n").await.unwrap();
    let mut head = [0u8; 12];
    client.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    let answered = Instant::now();
    let rest = read_to_close(&mut client).await;
    assert!(String::from_utf8_lossy(&rest).ends_with("ok"), "the whole answer, then the close");
    closed_at(answered, limits.idle, "idle keep-alive");
    task.await.unwrap().expect("an idle close is a clean end");
}

/// hyper arms its HTTP/1 header read timeout again when a keep-alive
/// connection goes idle: the module's documentation relies on it.
#[tokio::test]
async fn hyper_closes_an_idle_http1_keep_alive_connection_at_its_header_read_timeout() {
    let limits = ConnLimits { first_request: Duration::from_secs(600), idle: Duration::from_secs(600) };
    let header_read = Duration::from_secs(1);
    let (mut client, task, _shutdown) = connect(limits, header_read);
    client.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n").await.unwrap();
    let mut head = [0u8; 12];
    client.read_exact(&mut head).await.unwrap();
    let answered = Instant::now();
    read_to_close(&mut client).await;
    closed_at(answered, header_read, "hyper's header read timeout");
    let _ = task.await.unwrap();
}

#[tokio::test]
async fn a_streaming_response_longer_than_the_idle_limit_is_not_cut() {
    // The stream takes 2 s, the idle limit is 1 s: the connection counts
    // as busy until the body ends, then idle.
    let limits = ConnLimits { first_request: Duration::from_secs(600), idle: Duration::from_secs(1) };
    let (mut client, task, _shutdown) = connect(limits, Duration::from_secs(600));
    let start = Instant::now();
    client.write_all(b"GET /stream HTTP/1.1\r\nHost: localhost\r\n\r\n").await.unwrap();
    let got = String::from_utf8_lossy(&read_to_close(&mut client).await).into_owned();
    for n in 0..5 {
        assert!(got.contains(&format!("chunk {n}")), "chunk {n} in {got}");
    }
    closed_at(start, Duration::from_millis(2000) + limits.idle, "idle after the stream");
    task.await.unwrap().expect("an idle close is a clean end");
}

#[tokio::test]
async fn shutdown_closes_idle_and_undetected_connections_at_once() {
    let limits = ConnLimits { first_request: Duration::from_secs(600), idle: Duration::from_secs(600) };
    let (mut silent, silent_task, shutdown_silent) = connect(limits, Duration::from_secs(600));
    let (mut served, served_task, shutdown_served) = connect(limits, Duration::from_secs(600));
    served.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n").await.unwrap();
    let mut head = [0u8; 12];
    served.read_exact(&mut head).await.unwrap();
    let start = Instant::now();
    shutdown_silent.cancel();
    shutdown_served.cancel();
    read_to_close(&mut silent).await;
    read_to_close(&mut served).await;
    assert!(start.elapsed() < SLACK, "closed after {:?}", start.elapsed());
    silent_task.await.unwrap().expect("a shutdown is a clean end");
    served_task.await.unwrap().expect("a shutdown is a clean end");
}

#[test]
fn connections_per_address_are_capped() {
    let a: IpAddr = "10.0.0.1".parse().unwrap();
    let b: IpAddr = "10.0.0.2".parse().unwrap();
    let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
    let cap = PerAddress::new(2);
    let first = cap.take(a).expect("one");
    let _second = cap.take(mapped).expect("two (an IPv4-mapped address is the IPv4 one)");
    assert!(cap.take(a).is_none(), "a third from the same address");
    let _other = cap.take(b).expect("another address has its own count");
    drop(first);
    assert_eq!(cap.open(a), 1);
    let _again = cap.take(a).expect("a freed place is taken again");
    assert!(cap.take(a).is_none());
    let off = PerAddress::new(0);
    let held: Vec<_> = (0..1000).map(|_| off.take(a).expect("no cap")).collect();
    assert_eq!(off.open(a), 1000);
    drop(held);
    assert_eq!(off.open(a), 0, "an address with no connection left is forgotten");
    assert!(off.open.lock().unwrap().is_empty());
}
