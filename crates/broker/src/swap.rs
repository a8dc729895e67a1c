//! What the broker swaps: a sandbox's secret bindings ([`Binding`]: a
//! placeholder the guest holds, the real value, the hosts it may go to
//! and where in a request) and the swap itself on a request's head
//! ([`swap_head`]) and body ([`swap_body`]).
//!
//! A placeholder is replaced only in requests to one of its binding's
//! hosts; one found in a request to another host is left as it is and
//! reported (`leaked`), so the value never reaches a host the operator
//! did not name. Values live in [`SecretValue`]s, which are zeroed when
//! dropped and print as `<redacted>`.

use std::sync::Arc;

use hyper::header::{HeaderName, HeaderValue};
use hyper::http::request::Parts;
use hyper::Uri;

/// The most bytes of a request body the broker holds to swap in it
/// ([`Binding::in_body`]); a longer body is refused (413).
pub const MAX_SWAP_BODY: usize = 1 << 20;

/// A secret's value: zeroed when dropped, never printed.
pub struct SecretValue(zeroize::Zeroizing<Vec<u8>>);

impl SecretValue {
    /// `bytes` as a secret value.
    pub fn new(bytes: Vec<u8>) -> Self {
        SecretValue(zeroize::Zeroizing::new(bytes))
    }

    /// The value's bytes.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretValue(<redacted>)")
    }
}

/// A host a secret may go to: a name (`api.openai.com`) or every name
/// under a domain (`*.anthropic.com`, not the domain itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPattern {
    /// The name, or the domain after `*.` (lower case).
    name: String,
    wildcard: bool,
}

/// A host pattern that cannot be read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SwapError {
    /// Not a DNS name or `*.` and one.
    #[error("{0:?} is not a host name or *.domain")]
    Pattern(String),
    /// A header name that HTTP does not allow.
    #[error("{0:?} is not an HTTP header name")]
    Header(String),
    /// A format without `{{value}}`.
    #[error("the format {0:?} has no {{value}}")]
    Format(String),
}

impl HostPattern {
    /// Reads `api.openai.com` or `*.anthropic.com` (case-insensitive, no
    /// port, no trailing dot).
    ///
    /// Errors: [`SwapError::Pattern`].
    pub fn parse(text: &str) -> Result<Self, SwapError> {
        let t = text.trim().to_ascii_lowercase();
        let (wildcard, name) = match t.strip_prefix("*.") {
            Some(rest) => (true, rest.to_string()),
            None => (false, t.clone()),
        };
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        if name.is_empty() || name.len() > 253 || !name.split('.').all(label_ok) {
            return Err(SwapError::Pattern(text.chars().take(80).collect()));
        }
        Ok(HostPattern { name, wildcard })
    }

    /// Whether `host` (lower case, no port) is one this pattern names.
    pub fn matches(&self, host: &str) -> bool {
        if self.wildcard {
            host.len() > self.name.len() + 1
                && host.ends_with(&self.name)
                && host.as_bytes()[host.len() - self.name.len() - 1] == b'.'
        } else {
            host == self.name
        }
    }
}

impl std::fmt::Display for HostPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.wildcard {
            write!(f, "*.{}", self.name)
        } else {
            f.write_str(&self.name)
        }
    }
}

/// One secret bound to one sandbox.
#[derive(Debug)]
pub struct Binding {
    /// The secret's name (for logs; never its value).
    pub secret: String,
    /// What the guest holds in its place (ASCII, unique per sandbox and
    /// secret).
    pub placeholder: String,
    /// The real value.
    pub value: Arc<SecretValue>,
    /// The hosts it may be sent to.
    pub hosts: Vec<HostPattern>,
    /// With `Some(h)`, the placeholder is swapped only in header `h`,
    /// whose whole value then becomes `format` with `{value}` replaced
    /// (`Authorization` and `Bearer {value}`); `None`: only in
    /// `Authorization`, the placeholder itself
    /// replaced (`Bearer <placeholder>` becomes `Bearer <value>`), or,
    /// with [`Binding::any_header`], in every header.
    pub header: Option<HeaderName>,
    /// Without `header`: swap the placeholder in every request header (the
    /// behaviour before there was a default header; a header the host
    /// echoes back, logs or forwards then carries the value too).
    pub any_header: bool,
    /// The header's value around the secret (`{value}` where it goes);
    /// `None`: `{value}`.
    pub format: Option<String>,
    /// Also swap it in the request target's query string (percent-encoded).
    pub in_query: bool,
    /// Also swap it in request bodies of at most [`MAX_SWAP_BODY`] bytes.
    pub in_body: bool,
}

impl Binding {
    /// Whether this binding's value may go to `host`.
    pub fn allows(&self, host: &str) -> bool {
        self.hosts.iter().any(|p| p.matches(host))
    }

    /// The one header its placeholder is swapped in (`None`: every one,
    /// [`Binding::any_header`]).
    pub fn target_header(&self) -> Option<HeaderName> {
        match (&self.header, self.any_header) {
            (Some(h), _) => Some(h.clone()),
            (None, true) => None,
            (None, false) => Some(hyper::header::AUTHORIZATION),
        }
    }

    /// The bytes written in place of the placeholder in a header.
    fn header_value(&self) -> Vec<u8> {
        match &self.format {
            Some(f) => {
                let mut out = Vec::with_capacity(f.len() + self.value.expose().len());
                let mut parts = f.splitn(2, "{value}");
                out.extend_from_slice(parts.next().unwrap_or_default().as_bytes());
                out.extend_from_slice(self.value.expose());
                out.extend_from_slice(parts.next().unwrap_or_default().as_bytes());
                out
            }
            None => self.value.expose().to_vec(),
        }
    }
}

/// Checks a header name and format as a secret gives them.
///
/// Errors: [`SwapError::Header`], [`SwapError::Format`].
pub fn check_header(header: &str, format: Option<&str>) -> Result<HeaderName, SwapError> {
    if let Some(f) = format {
        if !f.contains("{value}") {
            return Err(SwapError::Format(f.to_string()));
        }
    }
    HeaderName::from_bytes(header.as_bytes()).map_err(|_| SwapError::Header(header.to_string()))
}

/// What a swap did to one request.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Swapped {
    /// Secrets whose values went in (names).
    pub swapped: Vec<String>,
    /// Secrets whose placeholders were found but may not go to this host
    /// (names): left as they are.
    pub leaked: Vec<String>,
    /// Secrets to swap in the body too.
    pub in_body: Vec<usize>,
}

/// Swaps the placeholders of `bindings` in the head of a request to
/// `host`: headers and, where a binding says so, the query string.
///
/// Errors: a binding's name whose value is not allowed in a header (a
/// control character).
pub fn swap_head(parts: &mut Parts, host: &str, bindings: &[Arc<Binding>]) -> Result<Swapped, String> {
    let mut out = Swapped::default();
    for (i, b) in bindings.iter().enumerate() {
        let ph = b.placeholder.as_bytes();
        let allowed = b.allows(host);
        let target = b.target_header();
        let mut found = false;
        let names: Vec<HeaderName> = parts.headers.keys().cloned().collect();
        for name in names {
            let values: Vec<HeaderValue> = parts.headers.get_all(&name).iter().cloned().collect();
            if !values.iter().any(|v| contains(v.as_bytes(), ph)) {
                continue;
            }
            found = true;
            // Another header than its own keeps the placeholder.
            if !allowed || target.as_ref().is_some_and(|h| *h != name) {
                continue;
            }
            let swapped: Result<Vec<HeaderValue>, _> = values
                .iter()
                .map(|v| {
                    if !contains(v.as_bytes(), ph) {
                        return Ok::<HeaderValue, String>(v.clone());
                    }
                    let bytes =
                        if b.header.is_some() { b.header_value() } else { replace(v.as_bytes(), ph, b.value.expose()) };
                    let mut hv = HeaderValue::from_bytes(&bytes).map_err(|_| b.secret.clone())?;
                    hv.set_sensitive(true);
                    Ok(hv)
                })
                .collect();
            let swapped = swapped?;
            parts.headers.remove(&name);
            for v in swapped {
                parts.headers.append(name.clone(), v);
            }
            if !out.swapped.contains(&b.secret) {
                out.swapped.push(b.secret.clone());
            }
        }
        if let Some(pq) = parts.uri.path_and_query().map(|pq| pq.as_str().to_string()) {
            if contains(pq.as_bytes(), ph) {
                found = true;
                if allowed && b.in_query {
                    let encoded = percent_encode(b.value.expose());
                    let new = replace(pq.as_bytes(), ph, encoded.as_bytes());
                    let mut uri = parts.uri.clone().into_parts();
                    uri.path_and_query = String::from_utf8(new).ok().and_then(|s| s.parse().ok());
                    if let Ok(u) = Uri::from_parts(uri) {
                        parts.uri = u;
                        if !out.swapped.contains(&b.secret) {
                            out.swapped.push(b.secret.clone());
                        }
                    }
                }
            }
        }
        if allowed && b.in_body {
            out.in_body.push(i);
        }
        if found && !allowed && !out.leaked.contains(&b.secret) {
            out.leaked.push(b.secret.clone());
        }
    }
    Ok(out)
}

/// Swaps the placeholders of `bindings[i]` for each `i` of `which` in
/// `body`; returns the new body and the secrets that went in.
pub fn swap_body(body: &[u8], bindings: &[Arc<Binding>], which: &[usize]) -> (Vec<u8>, Vec<String>) {
    let mut out = body.to_vec();
    let mut swapped = Vec::new();
    for &i in which {
        let Some(b) = bindings.get(i) else { continue };
        if contains(&out, b.placeholder.as_bytes()) {
            out = replace(&out, b.placeholder.as_bytes(), b.value.expose());
            swapped.push(b.secret.clone());
        }
    }
    (out, swapped)
}

/// The placeholders of `bindings` that occur in `bytes` and may not go to
/// `host` (their secrets' names): what a leak check of plain traffic
/// reports.
pub fn leaked_in(bytes: &[u8], host: &str, bindings: &[Arc<Binding>]) -> Vec<String> {
    bindings
        .iter()
        .filter(|b| !b.allows(host) && contains(bytes, b.placeholder.as_bytes()))
        .map(|b| b.secret.clone())
        .collect()
}

/// Whether `needle` (not empty) occurs in `hay`.
pub fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// `hay` with every `needle` replaced by `with`.
fn replace(hay: &[u8], needle: &[u8], with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(hay.len() + with.len());
    let mut i = 0;
    while i < hay.len() {
        if !needle.is_empty() && hay[i..].starts_with(needle) {
            out.extend_from_slice(with);
            i += needle.len();
        } else {
            out.push(hay[i]);
            i += 1;
        }
    }
    out
}

/// `bytes` percent-encoded for a query string (RFC 3986 §2.1: all but the
/// unreserved characters).
fn percent_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 3);
    for &b in bytes {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding(header: Option<&str>, format: Option<&str>) -> Arc<Binding> {
        Arc::new(Binding {
            secret: "openai".into(),
            placeholder: "tine_ph_0123".into(),
            value: Arc::new(SecretValue::new(b"sk-real value".to_vec())),
            hosts: vec![HostPattern::parse("api.openai.com").unwrap(), HostPattern::parse("*.anthropic.com").unwrap()],
            header: header.map(|h| check_header(h, format).unwrap()),
            any_header: false,
            format: format.map(str::to_string),
            in_query: true,
            in_body: true,
        })
    }

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = hyper::Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn patterns_name_hosts_and_subdomains() {
        let p = HostPattern::parse("*.Anthropic.com").unwrap();
        assert!(p.matches("api.anthropic.com") && !p.matches("anthropic.com") && !p.matches("xanthropic.com"));
        assert!(HostPattern::parse("api.openai.com").unwrap().matches("api.openai.com"));
        for bad in ["", "*.", "a..b", "-a.b", "a b", "*.*.x", "http://x"] {
            assert!(HostPattern::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(HostPattern::parse("*.x.org").unwrap().to_string(), "*.x.org");
    }

    #[test]
    fn placeholders_are_swapped_only_for_their_hosts() {
        let b = vec![binding(None, None)];
        let mut p = parts("/v1?key=tine_ph_0123", &[("authorization", "Bearer tine_ph_0123"), ("x-other", "keep")]);
        let out = swap_head(&mut p, "api.openai.com", &b).unwrap();
        assert_eq!(out.swapped, vec!["openai"]);
        assert_eq!(p.headers["authorization"], "Bearer sk-real value");
        assert!(p.headers["authorization"].is_sensitive());
        assert_eq!(p.uri.query(), Some("key=sk-real%20value"));
        assert_eq!(p.headers["x-other"], "keep");
        let mut p = parts("/", &[("authorization", "Bearer tine_ph_0123")]);
        let out = swap_head(&mut p, "evil.example", &b).unwrap();
        assert_eq!((out.swapped.len(), out.leaked.clone()), (0, vec!["openai".to_string()]));
        assert_eq!(p.headers["authorization"], "Bearer tine_ph_0123", "left as it is");
        let (body, swapped) = swap_body(b"{\"k\":\"tine_ph_0123\"}", &b, &[0]);
        assert_eq!((body.as_slice(), swapped.len()), (&b"{\"k\":\"sk-real value\"}"[..], 1));
        assert_eq!(leaked_in(b"GET /?tine_ph_0123", "other.test", &b), vec!["openai"]);
        assert!(leaked_in(b"GET /?tine_ph_0123", "api.openai.com", &b).is_empty());
    }

    #[test]
    fn a_header_binding_writes_its_format_into_its_header_only() {
        let b = vec![binding(Some("x-api-key"), Some("Key {value}!"))];
        let mut p = parts("/", &[("x-api-key", "tine_ph_0123"), ("authorization", "tine_ph_0123")]);
        swap_head(&mut p, "x.anthropic.com", &b).unwrap();
        assert_eq!(p.headers["x-api-key"], "Key sk-real value!");
        assert_eq!(p.headers["authorization"], "tine_ph_0123", "not its header");
        assert!(check_header("x", Some("no value")).is_err());
        assert!(check_header("bad header", None).is_err());
        assert_eq!(format!("{:?}", b[0].value), "SecretValue(<redacted>)");
    }

    #[test]
    fn without_a_header_only_authorization_is_swapped_unless_any_header() {
        let heads = || parts("/", &[("authorization", "Bearer tine_ph_0123"), ("x-echo", "tine_ph_0123")]);
        let mut p = heads();
        let out = swap_head(&mut p, "api.openai.com", &[binding(None, None)]).unwrap();
        assert_eq!(p.headers["authorization"], "Bearer sk-real value");
        assert_eq!(p.headers["x-echo"], "tine_ph_0123", "not its header: the placeholder stays");
        assert_eq!((out.swapped, out.leaked.len()), (vec!["openai".to_string()], 0));
        let mut any = binding(None, None);
        Arc::get_mut(&mut any).unwrap().any_header = true;
        let mut p = heads();
        swap_head(&mut p, "api.openai.com", &[any]).unwrap();
        assert_eq!(p.headers["x-echo"], "sk-real value", "any-header: every header");
        assert_eq!(p.headers["authorization"], "Bearer sk-real value");
    }
}
