//! The authority of a brokered request: checked against the flow's TLS
//! name, then written by the broker itself.
//!
//! A request carries its authority in up to three places: the request
//! target (absolute-form in HTTP/1.1, RFC 9112 §3.2.2; `:authority` in
//! HTTP/2, RFC 9113 §8.3.1), the `Host` header (more than one of them, if
//! the guest sends so), and, in HTTP/2, a `host` header beside
//! `:authority`. A front end that routes by `Host` would deliver a
//! swapped value to whichever app one of them names, so every one of
//! them present must name the flow's host (the SNI the broker ended,
//! which its secrets' hosts matched), and at its port when it gives one
//! ([`check`]); then the broker drops them all and writes the authority
//! itself from the TLS name and the port the guest dialled ([`write`]).

use hyper::header::{HeaderMap, HeaderValue, HOST};
use hyper::http::request::Parts;
use hyper::http::uri::{Authority, PathAndQuery, Scheme};
use hyper::{Method, Uri};

/// The default port of `https` (RFC 9110 §4.2.2): a written authority
/// leaves it out.
pub const HTTPS_PORT: u16 = 443;

/// A request whose authority is not the flow's.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthorityError {
    /// The request target (absolute-form, `:authority`) names another
    /// authority.
    #[error("the request target names {0:?}")]
    Target(String),
    /// A `Host` header names another authority.
    #[error("a Host header names {0:?}")]
    Host(String),
    /// More than one `Host` header (RFC 9112 §3.2).
    #[error("{0} Host headers")]
    Hosts(usize),
    /// The authority the broker writes is not a valid one.
    #[error("{0:?} is not an authority")]
    Written(String),
}

impl AuthorityError {
    /// What the request named (for the log; at most 100 characters).
    pub fn named(&self) -> String {
        match self {
            AuthorityError::Target(a) | AuthorityError::Host(a) | AuthorityError::Written(a) => {
                a.chars().take(100).collect()
            }
            AuthorityError::Hosts(n) => format!("{n} Host headers"),
        }
    }
}

/// Whether `text` is an authority for host `name` (lower case) at `port`:
/// no user info, the host (any case, a trailing dot allowed) `name`, the
/// port `port` or none.
fn names(text: &str, name: &str, port: u16) -> bool {
    if text.contains('@') {
        return false;
    }
    let Ok(a) = text.parse::<Authority>() else { return false };
    let host = a.host().trim_end_matches('.');
    host.eq_ignore_ascii_case(name) && a.port_u16().is_none_or(|p| p == port)
}

/// Checks that the request target `uri` and the headers `headers` name no
/// other authority than host `name` (lower case) at `port`. A request
/// that names none at all (HTTP/1.0 without `Host`) passes: the broker
/// writes one.
///
/// Errors: [`AuthorityError::Target`], [`AuthorityError::Host`],
/// [`AuthorityError::Hosts`].
pub fn check(uri: &Uri, headers: &HeaderMap, name: &str, port: u16) -> Result<(), AuthorityError> {
    if let Some(a) = uri.authority() {
        if !names(a.as_str(), name, port) {
            return Err(AuthorityError::Target(a.as_str().to_string()));
        }
    }
    let hosts: Vec<&HeaderValue> = headers.get_all(HOST).iter().collect();
    if hosts.len() > 1 {
        return Err(AuthorityError::Hosts(hosts.len()));
    }
    for h in hosts {
        let text = String::from_utf8_lossy(h.as_bytes());
        if !names(&text, name, port) {
            return Err(AuthorityError::Host(text.into_owned()));
        }
    }
    Ok(())
}

/// Writes the authority of host `name` at `port` into the request head
/// `parts`, replacing what the guest sent: for HTTP/2 the target
/// `https://name[:port]/...` and no `host` header; for HTTP/1.1 the
/// target in origin-form (a `CONNECT`'s authority-form kept) and one
/// `Host: name[:port]`.
///
/// Errors: [`AuthorityError::Written`] (a name that is no authority).
pub fn write(parts: &mut Parts, name: &str, port: u16, http2: bool) -> Result<(), AuthorityError> {
    let text = if port == HTTPS_PORT { name.to_string() } else { format!("{name}:{port}") };
    let authority: Authority = text.parse().map_err(|_| AuthorityError::Written(text.clone()))?;
    let host = HeaderValue::from_str(&text).map_err(|_| AuthorityError::Written(text.clone()))?;
    parts.headers.remove(HOST);
    if parts.method == Method::CONNECT {
        parts.headers.insert(HOST, host);
        return Ok(());
    }
    let pq = parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
    let uri = if http2 {
        Uri::builder().scheme(Scheme::HTTPS).authority(authority).path_and_query(pq).build()
    } else {
        parts.headers.insert(HOST, host);
        Uri::builder().path_and_query(pq).build()
    };
    parts.uri = uri.map_err(|_| AuthorityError::Written(text))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(uri: &str, hosts: &[&str]) -> Parts {
        let mut b = hyper::Request::builder().uri(uri);
        for h in hosts {
            b = b.header(HOST, *h);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn every_authority_must_be_the_flows() {
        let ok = |uri: &str, hosts: &[&str]| {
            let p = head(uri, hosts);
            check(&p.uri, &p.headers, "api.test", 8443)
        };
        assert_eq!(ok("/", &["api.test"]), Ok(()));
        assert_eq!(ok("/", &["API.test.:8443"]), Ok(()));
        assert_eq!(ok("https://api.test/x", &[]), Ok(()));
        assert_eq!(ok("/", &[]), Ok(()), "none named: the broker writes it");
        assert_eq!(ok("https://evil.test/", &["api.test"]), Err(AuthorityError::Target("evil.test".into())));
        assert_eq!(ok("https://api.test/", &["evil.test"]), Err(AuthorityError::Host("evil.test".into())));
        assert_eq!(ok("/", &["api.test", "evil.test"]), Err(AuthorityError::Hosts(2)));
        assert_eq!(ok("/", &["api.test", "api.test"]), Err(AuthorityError::Hosts(2)));
        assert_eq!(ok("/", &["api.test:1"]), Err(AuthorityError::Host("api.test:1".into())));
        assert_eq!(ok("/", &["user@api.test"]), Err(AuthorityError::Host("user@api.test".into())));
        assert_eq!(ok("/", &["api.test.evil.test"]), Err(AuthorityError::Host("api.test.evil.test".into())));
    }

    #[test]
    fn the_broker_writes_the_authority() {
        let mut p = head("https://api.test/v1?q=1", &["api.test"]);
        write(&mut p, "api.test", 443, false).unwrap();
        assert_eq!((p.uri.to_string(), p.headers.get_all(HOST).iter().count()), ("/v1?q=1".into(), 1));
        assert_eq!(p.headers[HOST], "api.test");
        let mut p = head("/v1", &["api.test"]);
        write(&mut p, "api.test", 8443, true).unwrap();
        assert_eq!(p.uri.to_string(), "https://api.test:8443/v1");
        assert!(!p.headers.contains_key(HOST), "HTTP/2 carries it in :authority only");
    }
}
