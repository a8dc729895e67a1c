//! What a guest TCP connection's bytes wait for before they go on to the
//! host ([`Gate`]): nothing, the egress policy's check of the names the
//! connection carries, or (DNS over TCP to the resolver) whole queries,
//! each judged by its name.
//!
//! # The name check
//!
//! How much a connection must show by name is the policy's
//! [`NameCheck`] for its address, fixed when it is admitted:
//!
//! - [`NameCheck::Off`] (no domain rule, or an address rule allowed the
//!   address): the bytes are spliced at once; no name is looked at.
//! - [`NameCheck::Required`] (only a domain rule allowed the address, under
//!   `egress: "deny"`): the guest's bytes are held until its first message
//!   is whole: a TLS ClientHello (RFC 8446 §4.1.2) or an HTTP/1.x request
//!   head (RFC 9112 §2-3), at most [`MAX_SNIFF_BYTES`] and
//!   [`NAME_WAIT`] after its first byte. Its name (the SNI `host_name`,
//!   RFC 6066 §3; the request's `Host` and, for an absolute-form target,
//!   the target's host) must be allowed by the policy
//!   ([`crate::policy::CompiledPolicy::check_name`]). Everything else is
//!   refused: the connection is reset both ways and its record says why
//!   ([`RULE_SNI_MISSING`], [`RULE_HOST_MISSING`], [`RULE_SNI_TIMEOUT`],
//!   [`RULE_HOST_TIMEOUT`], [`RULE_SNI_MALFORMED`], [`RULE_HOST_MALFORMED`],
//!   [`RULE_UNKNOWN_PROTOCOL`] for bytes that are neither TLS nor HTTP/1.x;
//!   a denied name gets the policy's rule, e.g. `egress:deny`, and the name
//!   in `domain`). On plain HTTP every later request on the connection is
//!   judged the same way ([`crate::http::RequestStream`]: heads parsed,
//!   bodies skipped by their framing), and one that fails resets the
//!   connection before any of its bytes reach the host.
//! - [`NameCheck::IfSeen`] (the default allowed the address, the policy
//!   has domain rules): the same look, but only a denied name refuses;
//!   bytes that show no name, or none within [`SNIFF_WAIT`], are spliced.
//!
//! What a domain rule guarantees, then, for a connection its address was
//! admitted by: the first message names an allowed host (TLS: the SNI;
//! HTTP: every request's `Host` and absolute-form target), and no byte of
//! a message that does not reaches the host. UDP to such an address is
//! refused (`udp:domain-only`, in `admit`): QUIC's name is not looked at.
//!
//! What it does not guarantee:
//! - what is inside TLS: a client may send an allowed SNI to a shared
//!   (CDN) address and another `Host` inside the encryption (domain
//!   fronting), or use Encrypted Client Hello, whose outer SNI is all we
//!   see; the server decides which name it serves;
//! - plain HTTP after the server agreed to leave HTTP/1.x: a 101 to a
//!   request with `Upgrade`, a 2xx to a `CONNECT` (what follows is
//!   another protocol or a tunnel, not judged). Until the answer is read
//!   ([`crate::http::response::ResponseStream`], fed every host-to-guest
//!   byte by [`Gate::host_sent`]) the guest's bytes after such a request
//!   are held; after any other answer they are judged as requests again.
//!   An answer stream that cannot be read (a body that ends with the
//!   connection, say) releases them to be judged as requests too;
//! - protocols other than TLS and HTTP/1.x (SSH, HTTP/2 with prior
//!   knowledge, ...) carry no name we read: to an address admitted only by
//!   a domain rule they are refused; allow the address (a CIDR rule) for
//!   them;
//! - that the address is the name's: the address was admitted because the
//!   sandbox's own DNS answered the name with it; another name served at
//!   the same address passes the address check and is caught only by the
//!   name check above.
//!
//! [`first_message`] is the one place where a connection's first message
//! is whole and its name known (its bytes still unread in the smoltcp
//! socket's buffer). There TLS to a host one of the sandbox's secrets may
//! go to is handed to the secret broker instead of being spliced
//! ([`Decision::Broker`], [`crate::control::Handoff`]). A sandbox with
//! secrets has every connection's first message looked at
//! ([`Gate::inspecting`]), also where the policy needs no name (then no
//! name is judged, only the broker and the leak check below look).
//!
//! # Placeholders in plain HTTP
//!
//! In a sandbox with secrets every plain HTTP request head (the first
//! and, on keep-alive, each later one) is searched for the placeholders
//! of secrets that may not go to the request's host
//! ([`Secrets::leak`]): such a request is logged (`secret-leak-blocked`),
//! and refused where the server says so ([`RULE_SECRET_LEAK`]). Request
//! bodies are not searched, nor anything inside TLS to a host that has
//! no secret: there the placeholder cannot be seen.

use std::time::{Duration, Instant};

use crate::http::response::{Answer, ResponseStream};
use crate::http::{Head, RequestStream, Step};
use crate::policy::NameCheck;
use crate::sniff::{sniff, Sniffed, CONTENT_HANDSHAKE, MAX_SNIFF_BYTES};

/// How long a connection whose name is required waits for its whole first
/// message, from its first byte; then it is refused.
pub const NAME_WAIT: Duration = Duration::from_secs(10);

/// How long a connection whose name is judged only if seen
/// ([`NameCheck::IfSeen`]) holds its first bytes for a name at most (a
/// protocol that is neither TLS nor HTTP may send a few bytes and wait for
/// an answer); then they go on unjudged.
pub const SNIFF_WAIT: Duration = Duration::from_secs(1);

/// Refused: a ClientHello without an SNI `host_name`.
pub const RULE_SNI_MISSING: &str = "sni:missing";
/// Refused: a request with no `Host` and no absolute-form target.
pub const RULE_HOST_MISSING: &str = "host:missing";
/// Refused: a ClientHello not whole within [`NAME_WAIT`].
pub const RULE_SNI_TIMEOUT: &str = "sni:timeout";
/// Refused: a request head not whole within [`NAME_WAIT`].
pub const RULE_HOST_TIMEOUT: &str = "host:timeout";
/// Refused: a ClientHello that is not well-formed or longer than
/// [`MAX_SNIFF_BYTES`], or cut short by the guest's FIN.
pub const RULE_SNI_MALFORMED: &str = "sni:malformed";
/// Refused: a request that is not well-formed (see [`crate::http`]), its
/// head longer than [`MAX_SNIFF_BYTES`], or cut short by the guest's FIN.
pub const RULE_HOST_MALFORMED: &str = "host:malformed";
/// Refused: first bytes that are neither TLS nor HTTP/1.x.
pub const RULE_UNKNOWN_PROTOCOL: &str = "name:unknown-protocol";
/// Refused: a DNS-over-TCP message that is not a standard query with one
/// question, or cut short.
pub const RULE_DNS_MALFORMED: &str = "dns:malformed";

/// Refused (where the server refuses leaks) or logged: a plain HTTP
/// request carrying the placeholder of a secret that may not go to its
/// host.
pub const RULE_SECRET_LEAK: &str = "secret-leak-blocked";

/// The sandbox's secrets as a gate asks about them.
pub(super) trait Secrets {
    /// Whether TLS whose ClientHello names `name` goes to the broker.
    fn wants(&mut self, name: &str) -> bool;
    /// Searches the plain HTTP request head `head` to `host` for
    /// placeholders that may not go there, logging what it finds;
    /// `true`: refuse the request.
    fn leak(&mut self, host: &str, head: &[u8]) -> bool;
}

/// A sandbox without secrets.
#[cfg(test)]
pub(super) struct NoSecrets;

#[cfg(test)]
impl Secrets for NoSecrets {
    fn wants(&mut self, _name: &str) -> bool {
        false
    }
    fn leak(&mut self, _host: &str, _head: &[u8]) -> bool {
        false
    }
}

/// A DNS-over-TCP message with its 2-byte length (RFC 7766 §8), at most.
const MAX_DNS_MESSAGE: usize = 2 + 65535;

/// What the guest's bytes wait for before they go on to the host.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Gate {
    /// Nothing.
    Open,
    /// The whole first message and its name. `since`: when its first
    /// byte was seen; `seen`: how many bytes were looked at last;
    /// `host_spoke`: the host sent bytes before it (then its answers
    /// cannot be told apart).
    First { check: NameCheck, since: Option<Instant>, seen: usize, host_spoke: bool },
    /// Plain HTTP after the first request: each request judged. `cleared`:
    /// bytes judged (or body) not yet passed on; `answers`: the host's
    /// answers, read to learn whether it switched protocols.
    Http { check: NameCheck, stream: RequestStream, cleared: u64, answers: ResponseStream },
    /// DNS over TCP to the resolver: whole messages (RFC 7766 §8: a
    /// 2-byte length, then the message), each judged by its name;
    /// `cleared`: bytes judged and not yet passed on.
    Dns { cleared: usize },
}

/// Why a connection is refused.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// A name the policy denies; the judge has written it, and the rule
    /// that denied it, into the connection's record.
    Denied,
    /// For this rule (one of the `RULE_*` here).
    Rule(&'static str),
}

/// What becomes of a connection whose first message was looked at.
#[derive(Debug, PartialEq, Eq)]
enum Decision {
    /// Its bytes go on to the host unlooked-at from here.
    Splice,
    /// Plain HTTP: this first request passes, later ones are judged.
    Http(Head),
    /// TLS to a host a secret of the sandbox may go to: to the broker.
    Broker(String),
}

/// Decides what becomes of a connection by its first message `first`
/// (whole, or known never to be; `bytes` from its first byte on),
/// judging its names with `judge` (which writes them into the
/// connection's record; not under [`NameCheck::Off`]) and asking
/// `secrets`: the one place where a first message is complete and its
/// name known, see the module doc.
fn first_message(
    check: NameCheck,
    first: Sniffed,
    bytes: &[u8],
    judge: &mut dyn FnMut(String) -> bool,
    secrets: &mut dyn Secrets,
) -> Result<Decision, Refusal> {
    let required = check == NameCheck::Required;
    match first {
        Sniffed::ClientHello(Some(name)) => {
            if check != NameCheck::Off && !judge(name.clone()) {
                return Err(Refusal::Denied);
            }
            if secrets.wants(&name) {
                Ok(Decision::Broker(name))
            } else {
                Ok(Decision::Splice)
            }
        }
        Sniffed::ClientHello(None) if required => Err(Refusal::Rule(RULE_SNI_MISSING)),
        Sniffed::Request(head) => {
            judge_head(check, &head, judge)?;
            leak_check(&head, bytes, secrets)?;
            Ok(Decision::Http(head))
        }
        Sniffed::Malformed { tls: true } if required => Err(Refusal::Rule(RULE_SNI_MALFORMED)),
        Sniffed::Malformed { tls: false } if required => Err(Refusal::Rule(RULE_HOST_MALFORMED)),
        Sniffed::Other if required => Err(Refusal::Rule(RULE_UNKNOWN_PROTOCOL)),
        Sniffed::ClientHello(None) | Sniffed::Malformed { .. } | Sniffed::Other | Sniffed::NeedMore => {
            Ok(Decision::Splice)
        }
    }
}

/// Searches the request head `head` (its bytes the first `head.len` of
/// `bytes`) for placeholders that may not go to its host.
fn leak_check(head: &Head, bytes: &[u8], secrets: &mut dyn Secrets) -> Result<(), Refusal> {
    let host = head.names.first().map(String::as_str).unwrap_or_default();
    if secrets.leak(host, bytes.get(..head.len).unwrap_or(bytes)) {
        return Err(Refusal::Rule(RULE_SECRET_LEAK));
    }
    Ok(())
}

/// Judges every name of a request head (none under [`NameCheck::Off`]);
/// none at all is refused when names are required.
fn judge_head(check: NameCheck, head: &Head, judge: &mut dyn FnMut(String) -> bool) -> Result<(), Refusal> {
    if check == NameCheck::Off {
        return Ok(());
    }
    if head.names.is_empty() && check == NameCheck::Required {
        return Err(Refusal::Rule(RULE_HOST_MISSING));
    }
    let mut last: Option<&String> = None;
    for name in &head.names {
        if last != Some(name) && !judge(name.clone()) {
            return Err(Refusal::Denied);
        }
        last = Some(name);
    }
    Ok(())
}

impl Gate {
    /// The gate of a new connection that must show `check` by name.
    pub(super) fn new(check: NameCheck) -> Self {
        match check {
            NameCheck::Off => Gate::Open,
            check => Gate::First { check, since: None, seen: 0, host_spoke: false },
        }
    }

    /// The gate of a new connection of a sandbox with secrets: its first
    /// message is looked at whatever `check` (see the module doc).
    pub(super) fn inspecting(check: NameCheck) -> Self {
        Gate::First { check, since: None, seen: 0, host_spoke: false }
    }

    /// The gate of DNS over TCP to the resolver.
    pub(super) fn dns() -> Self {
        Gate::Dns { cleared: 0 }
    }

    /// Bytes that may go on to the host now without another look
    /// (`u64::MAX`: all of them).
    pub(super) fn cleared(&self) -> u64 {
        match self {
            Gate::Open => u64::MAX,
            Gate::First { .. } => 0,
            Gate::Http { cleared, .. } => *cleared,
            Gate::Dns { cleared } => *cleared as u64,
        }
    }

    /// `n` bytes went on to the host.
    pub(super) fn passed(&mut self, n: usize) {
        match self {
            Gate::Http { cleared, .. } => *cleared = cleared.saturating_sub(n as u64),
            Gate::Dns { cleared } => *cleared = cleared.saturating_sub(n),
            Gate::Open | Gate::First { .. } => {}
        }
    }

    /// How many of the guest's bytes [`Gate::advance`] wants to see at
    /// most.
    pub(super) fn window(&self) -> usize {
        match self {
            Gate::Dns { .. } => MAX_DNS_MESSAGE,
            _ => MAX_SNIFF_BYTES,
        }
    }

    /// When the gate decides by itself (the first message's wait ends).
    pub(super) fn deadline(&self) -> Option<Instant> {
        match self {
            Gate::First { check, since: Some(t), .. } => Some(*t + wait(*check)),
            _ => None,
        }
    }

    /// Looks at the guest's bytes not yet passed on (`bytes`: from the
    /// first of them, at most [`Gate::window`]; `more`: whether more can
    /// come into view: no FIN, and neither the window nor the socket's
    /// buffer full) at `now`, judging names with `judge` (which writes them
    /// into the connection's record; `false`: denied). Afterwards
    /// [`Gate::cleared`] says what may go; an error refuses the connection.
    #[cfg(test)]
    pub(super) fn advance(
        &mut self,
        bytes: &[u8],
        more: bool,
        now: Instant,
        judge: &mut dyn FnMut(String) -> bool,
    ) -> Result<(), Refusal> {
        self.advance_with(bytes, more, now, judge, &mut NoSecrets).map(|_| ())
    }

    /// [`Gate::advance`] in a sandbox with `secrets`; `Some(name)`: the
    /// connection is TLS to `name` and goes to the broker (the gate is
    /// open from here).
    pub(super) fn advance_with(
        &mut self,
        bytes: &[u8],
        more: bool,
        now: Instant,
        judge: &mut dyn FnMut(String) -> bool,
        secrets: &mut dyn Secrets,
    ) -> Result<Option<String>, Refusal> {
        match self {
            Gate::Open => Ok(None),
            Gate::First { check, since, seen, host_spoke } => {
                let Some(&first_byte) = bytes.first() else {
                    return Ok(None);
                };
                let (check, host_spoke) = (*check, *host_spoke);
                let since = *since.get_or_insert(now);
                let waited = now >= since + wait(check);
                if bytes.len() == *seen && more && !waited {
                    return Ok(None);
                }
                *seen = bytes.len();
                let tls = first_byte == CONTENT_HANDSHAKE;
                let first = match sniff(bytes) {
                    Sniffed::NeedMore if !more => Sniffed::Malformed { tls },
                    Sniffed::NeedMore if waited => {
                        if check == NameCheck::Required {
                            return Err(Refusal::Rule(if tls { RULE_SNI_TIMEOUT } else { RULE_HOST_TIMEOUT }));
                        }
                        *self = Gate::Open;
                        return Ok(None);
                    }
                    Sniffed::NeedMore => return Ok(None),
                    first => first,
                };
                *self = match first_message(check, first, bytes, judge, secrets)? {
                    Decision::Splice => Gate::Open,
                    Decision::Broker(name) => {
                        *self = Gate::Open;
                        return Ok(Some(name));
                    }
                    Decision::Http(head) => {
                        let mut stream = RequestStream::new();
                        // The stream after the head: its body's framing.
                        stream.after_head(&head);
                        let mut answers = ResponseStream::new();
                        if host_spoke {
                            // Its first answer is not the first bytes it
                            // sent: nothing is read.
                            answers.asked_unreadable();
                        }
                        answers.asked(head.ask);
                        Gate::Http { check, stream, cleared: head.len as u64, answers }
                    }
                };
                // The bytes after the first head, if any, are looked at
                // once it has gone.
                Ok(None)
            }
            Gate::Http { check, stream, cleared, answers } => {
                if *cleared > 0 {
                    return Ok(None);
                }
                let check = *check;
                if advance_http(check, stream, answers, cleared, bytes, more, judge, secrets)? {
                    *self = Gate::Open;
                }
                Ok(None)
            }
            Gate::Dns { cleared } => {
                if *cleared > 0 {
                    return Ok(None);
                }
                let Some(head) = bytes.get(..2) else {
                    return if more || bytes.is_empty() { Ok(None) } else { Err(Refusal::Rule(RULE_DNS_MALFORMED)) };
                };
                let len = 2 + usize::from(u16::from_be_bytes([head[0], head[1]]));
                let Some(message) = bytes.get(2..len) else {
                    return if more { Ok(None) } else { Err(Refusal::Rule(RULE_DNS_MALFORMED)) };
                };
                let Some(name) = crate::dns::query_name(message) else {
                    return Err(Refusal::Rule(RULE_DNS_MALFORMED));
                };
                if !judge(name) {
                    return Err(Refusal::Denied);
                }
                *cleared = len;
                Ok(None)
            }
        }
    }

    /// The host sent `bytes` to the guest (every byte it sends, in
    /// order). `true`: guest bytes held for the host's answer to a request
    /// that asked to leave HTTP/1.x may go on, or be looked at, now
    /// ([`Gate::cleared`], [`Gate::advance_with`]).
    pub(super) fn host_sent(&mut self, bytes: &[u8]) -> bool {
        match self {
            Gate::First { host_spoke, .. } => {
                *host_spoke |= !bytes.is_empty();
                false
            }
            Gate::Http { answers, .. } => match answers.read(bytes) {
                Some(Answer::Switched) => {
                    *self = Gate::Open;
                    true
                }
                Some(Answer::Stayed) => true,
                None => false,
            },
            Gate::Open | Gate::Dns { .. } => false,
        }
    }
}

/// How long a first message is waited for under `check`.
fn wait(check: NameCheck) -> Duration {
    if check == NameCheck::Required {
        NAME_WAIT
    } else {
        SNIFF_WAIT
    }
}

/// Steps `stream` through `bytes` (from its position on), judging each
/// request head, telling `answers` what it asks and adding what may pass
/// to `cleared`; stops before the next head while a request that asked to
/// leave HTTP/1.x waits for its answer. `true`: the HTTP view ended (when
/// names are only judged if seen, a stream that is not well-formed), so
/// the rest passes.
#[allow(clippy::too_many_arguments, reason = "the parts of Gate::Http and the two judges, each used")]
fn advance_http(
    check: NameCheck,
    stream: &mut RequestStream,
    answers: &mut ResponseStream,
    cleared: &mut u64,
    bytes: &[u8],
    more: bool,
    judge: &mut dyn FnMut(String) -> bool,
    secrets: &mut dyn Secrets,
) -> Result<bool, Refusal> {
    let required = check == NameCheck::Required;
    let mut off = 0usize;
    loop {
        if stream.at_head() && answers.switch_waiting() {
            // What follows may be another protocol: held until the host
            // answers (Gate::host_sent).
            return Ok(false);
        }
        let rest = bytes.get(off..).unwrap_or(&[]);
        match stream.next(rest) {
            Step::Pass(n) => {
                *cleared = cleared.saturating_add(n);
                match usize::try_from(n).ok().and_then(|n| off.checked_add(n)) {
                    Some(end) if end < bytes.len() => off = end,
                    _ => return Ok(false),
                }
            }
            Step::Head(head) => {
                judge_head(check, &head, judge)?;
                leak_check(&head, rest, secrets)?;
                *cleared = cleared.saturating_add(head.len as u64);
                answers.asked(head.ask);
                off += head.len;
            }
            // Something waits to be passed first, or more can come.
            Step::NeedMore if off > 0 || more => return Ok(false),
            Step::NeedMore | Step::Malformed if required => return Err(Refusal::Rule(RULE_HOST_MALFORMED)),
            Step::NeedMore | Step::Malformed => return Ok(true),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A judge allowing `ok.example` only, noting every name it was asked.
    fn judge(asked: &mut Vec<String>) -> impl FnMut(String) -> bool + '_ {
        |name| {
            let ok = name == "ok.example";
            asked.push(name);
            ok
        }
    }

    /// A ClientHello with `sni` (`None`: no server_name extension), in one
    /// TLS record (RFC 8446 §4.1.2, RFC 6066 §3).
    fn hello(sni: Option<&str>) -> Vec<u8> {
        let vec16 = |b: &[u8]| {
            let mut v = u16::try_from(b.len()).unwrap().to_be_bytes().to_vec();
            v.extend_from_slice(b);
            v
        };
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7; 32]);
        body.push(0);
        body.extend_from_slice(&vec16(&[0x13, 0x01]));
        body.extend_from_slice(&[1, 0]);
        let mut exts = Vec::new();
        if let Some(name) = sni {
            let mut list = vec![0];
            list.extend_from_slice(&vec16(name.as_bytes()));
            exts.extend_from_slice(&0u16.to_be_bytes());
            exts.extend_from_slice(&vec16(&vec16(&list)));
        }
        exts.extend_from_slice(&43u16.to_be_bytes());
        exts.extend_from_slice(&vec16(&[2, 3, 4]));
        body.extend_from_slice(&vec16(&exts));
        let mut msg = vec![1];
        msg.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes()[1..]);
        msg.extend_from_slice(&body);
        let mut rec = vec![22, 3, 1];
        rec.extend_from_slice(&vec16(&msg));
        rec
    }

    fn required() -> Gate {
        Gate::new(NameCheck::Required)
    }

    #[test]
    fn a_first_message_is_judged_when_whole_however_long_it_took() {
        let t0 = Instant::now();
        let mut asked = Vec::new();
        let h = hello(Some("OK.example"));
        let mut g = required();
        // Half of it, then the rest 9 s later (inside NAME_WAIT).
        assert_eq!(g.advance(&h[..40], true, t0, &mut judge(&mut asked)), Ok(()));
        assert_eq!((g.cleared(), g.deadline()), (0, Some(t0 + NAME_WAIT)));
        assert_eq!(g.advance(&h[..40], true, t0 + Duration::from_secs(9), &mut judge(&mut asked)), Ok(()));
        assert!(asked.is_empty());
        assert_eq!(g.advance(&h, true, t0 + Duration::from_secs(9), &mut judge(&mut asked)), Ok(()));
        assert_eq!((g, asked), (Gate::Open, vec!["ok.example".to_string()]));
        // Another name: denied.
        let mut asked = Vec::new();
        let mut g = required();
        assert_eq!(g.advance(&hello(Some("evil.example")), true, t0, &mut judge(&mut asked)), Err(Refusal::Denied));
    }

    #[test]
    fn what_cannot_be_checked_is_refused_when_a_name_is_required() {
        let t0 = Instant::now();
        let h = hello(Some("ok.example"));
        let cases: Vec<(&[u8], bool, Duration, &str)> = vec![
            (&h[..40], true, NAME_WAIT, RULE_SNI_TIMEOUT),
            (b"GET / HTTP/1.1\r\nHost: ok", true, NAME_WAIT, RULE_HOST_TIMEOUT),
            (&h[..40], false, Duration::ZERO, RULE_SNI_MALFORMED),
            (b"GET / HTTP/1.1\r\nHost: ok.example\r\n", false, Duration::ZERO, RULE_HOST_MALFORMED),
            (b"SSH-2.0-OpenSSH_9.6\r\n", true, Duration::ZERO, RULE_UNKNOWN_PROTOCOL),
            (b"GET / HTTP/1.0\r\n\r\n", true, Duration::ZERO, RULE_HOST_MISSING),
            (b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", true, Duration::ZERO, RULE_HOST_MALFORMED),
        ];
        for (bytes, more, after, rule) in cases {
            let mut g = required();
            let mut asked = Vec::new();
            if !after.is_zero() {
                assert_eq!(g.advance(bytes, true, t0, &mut judge(&mut asked)), Ok(()));
            }
            let got = g.advance(bytes, more, t0 + after, &mut judge(&mut asked));
            assert_eq!(got, Err(Refusal::Rule(rule)), "{:?}", String::from_utf8_lossy(bytes));
        }
        let mut g = required();
        assert_eq!(g.advance(&hello(None), true, t0, &mut |_| true), Err(Refusal::Rule(RULE_SNI_MISSING)));
        // Judged only if seen: all of these go on unjudged.
        for bytes in [&hello(None)[..], b"SSH-2.0-x\r\n", b"GET / HTTP/1.0\r\n\r\n"] {
            let mut g = Gate::new(NameCheck::IfSeen);
            assert_eq!(g.advance(bytes, true, t0, &mut |_| false), Ok(()));
            assert_ne!(g.cleared(), 0);
        }
        let mut g = Gate::new(NameCheck::IfSeen);
        assert_eq!(g.advance(&h[..40], true, t0, &mut |_| false), Ok(()));
        assert_eq!(g.advance(&h[..40], true, t0 + SNIFF_WAIT, &mut |_| false), Ok(()));
        assert_eq!(g, Gate::Open, "past SNIFF_WAIT it goes on");
        let mut g = Gate::new(NameCheck::IfSeen);
        assert_eq!(g.advance(&hello(Some("evil.example")), true, t0, &mut |_| false), Err(Refusal::Denied));
        assert_eq!(Gate::new(NameCheck::Off), Gate::Open);
    }

    /// Feeds `stream` through a gate as the stack would: looks at what is
    /// not yet passed, passes what is cleared.
    fn run(g: &mut Gate, stream: &[u8], judge: &mut dyn FnMut(String) -> bool) -> Result<usize, Refusal> {
        let t0 = Instant::now();
        let mut at = 0;
        for _ in 0..1000 {
            if g.cleared() == 0 {
                let end = stream.len().min(at + g.window());
                g.advance(&stream[at..end], true, t0, judge)?;
                if g.cleared() == 0 {
                    break;
                }
            }
            let n = usize::try_from(g.cleared()).unwrap_or(usize::MAX).min(stream.len() - at).min(10);
            g.passed(n);
            at += n;
            if at == stream.len() {
                break;
            }
        }
        Ok(at)
    }

    #[test]
    fn every_request_of_a_keep_alive_connection_is_judged() {
        let first = b"POST /a HTTP/1.1\r\nHost: ok.example\r\nContent-Length: 5\r\n\r\nhello";
        let good = b"GET / HTTP/1.1\r\nHost: ok.example\r\n\r\n";
        let mut stream = first.to_vec();
        stream.extend_from_slice(good);
        let mut g = required();
        let mut asked = Vec::new();
        assert_eq!(run(&mut g, &stream, &mut judge(&mut asked)), Ok(stream.len()));
        assert_eq!(asked, ["ok.example", "ok.example"]);
        // A second request to another host: refused before any of its bytes pass.
        for bad in [
            &b"GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n"[..],
            b"GET http://evil.example/ HTTP/1.1\r\nHost: ok.example\r\n\r\n",
        ] {
            let mut stream = first.to_vec();
            stream.extend_from_slice(bad);
            let mut g = required();
            let mut passed = 0;
            let got = run(&mut g, &stream, &mut |n| {
                passed += 1;
                n == "ok.example"
            });
            assert_eq!(got, Err(Refusal::Denied), "{:?}", String::from_utf8_lossy(bad));
        }
        // Garbage where a request must start: refused, or the view ends.
        let mut stream = first.to_vec();
        stream.extend_from_slice(b"\x00garbage\r\n\r\n");
        assert_eq!(run(&mut required(), &stream, &mut |_| true), Err(Refusal::Rule(RULE_HOST_MALFORMED)));
        let mut g = Gate::new(NameCheck::IfSeen);
        assert_eq!(run(&mut g, &stream, &mut |_| true), Ok(stream.len()));
        assert_eq!(g, Gate::Open);
    }

    #[test]
    fn after_an_upgrade_requests_are_judged_unless_the_host_answered_101() {
        let upgrade = &b"GET /ws HTTP/1.1\r\nHost: ok.example\r\nUpgrade: websocket\r\n\r\n"[..];
        let evil = b"GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n";
        let first = b"GET /a HTTP/1.1\r\nHost: ok.example\r\n\r\n";
        let ok = |n: String| n == "ok.example";
        // The Upgrade as the first request and as a later one (whose
        // answer comes after the first request's).
        for (before, answers_before) in
            [(&b""[..], &b""[..]), (&first[..], &b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"[..])]
        {
            let asked = [before, upgrade].concat();
            let stream = [&asked[..], evil].concat();
            for check in [NameCheck::Required, NameCheck::IfSeen] {
                // Refused or declined: the bytes after the Upgrade are held
                // until the answer, then judged as a request (and refused).
                for declined in
                    [&b"HTTP/1.1 426 Upgrade Required\r\nContent-Length: 0\r\n\r\n"[..], b"HTTP/1.1 200 OK\r\n\r\n"]
                {
                    let mut g = Gate::new(check);
                    assert_eq!(run(&mut g, &stream, &mut |n| ok(n)), Ok(asked.len()));
                    assert!(!g.host_sent(answers_before));
                    assert_eq!(run(&mut g, evil, &mut |n| ok(n)), Ok(0), "held while no answer");
                    let (head, tail) = declined.split_at(declined.len() / 2);
                    assert!(!g.host_sent(head), "half an answer decides nothing");
                    assert!(g.host_sent(tail));
                    assert_eq!(run(&mut g, evil, &mut |n| ok(n)), Err(Refusal::Denied), "{check:?}");
                }
                // Switched: what follows is another protocol.
                let mut g = Gate::new(check);
                assert_eq!(run(&mut g, &stream, &mut |n| ok(n)), Ok(asked.len()));
                g.host_sent(answers_before);
                assert!(g.host_sent(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n"));
                assert_eq!(g, Gate::Open);
                assert_eq!(run(&mut g, evil, &mut |n| ok(n)), Ok(evil.len()));
            }
        }
        // A host that spoke before the first request: its answers are not
        // read, the Upgrade holds nothing and the next request is judged.
        let mut g = required();
        assert!(!g.host_sent(b"HTTP/1.1 101 Switching Protocols\r\n\r\n"));
        let stream = [upgrade, evil].concat();
        assert_eq!(run(&mut g, &stream, &mut |n| ok(n)), Err(Refusal::Denied));
    }

    #[test]
    fn dns_over_tcp_passes_whole_judged_queries() {
        use hickory_proto::op::{Message, MessageType, OpCode, Query};
        use hickory_proto::rr::{Name, RecordType};
        let framed = |name: &str| {
            let mut q = Message::new(1, MessageType::Query, OpCode::Query);
            q.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
            let b = q.to_vec().unwrap();
            let mut out = u16::try_from(b.len()).unwrap().to_be_bytes().to_vec();
            out.extend_from_slice(&b);
            out
        };
        let t0 = Instant::now();
        let ok = framed("ok.example.");
        let mut g = Gate::dns();
        assert_eq!(g.advance(&ok[..5], true, t0, &mut |_| unreachable!()), Ok(()));
        assert_eq!(g.cleared(), 0);
        assert_eq!(g.advance(&ok, true, t0, &mut |n| n == "ok.example"), Ok(()));
        assert_eq!(g.cleared(), ok.len() as u64);
        g.passed(ok.len());
        assert_eq!(g.advance(&framed("evil.example."), true, t0, &mut |n| n == "ok.example"), Err(Refusal::Denied));
        assert_eq!(Gate::dns().advance(&ok[..5], false, t0, &mut |_| true), Err(Refusal::Rule(RULE_DNS_MALFORMED)));
        assert_eq!(
            Gate::dns().advance(&[0, 3, 1, 2, 3], true, t0, &mut |_| true),
            Err(Refusal::Rule(RULE_DNS_MALFORMED))
        );
    }
}
