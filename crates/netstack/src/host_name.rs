//! Host names in the one form they are compared in: ASCII lower case, no
//! trailing dot (RFC 4343: DNS names compare case-insensitively; RFC 1034
//! §3.1: a trailing dot marks an absolute name, which every name here is).
//!
//! Two entry points:
//! - [`fold`]: lenient, for names seen in traffic (DNS questions and
//!   answers, TLS SNI, HTTP `Host`) and matched against the policy: any
//!   bytes a name may carry there (`_dmarc.example.com`) stay, so a deny
//!   entry above the name still meets it;
//! - [`parse`]: strict, for names an operator or a client writes (policy
//!   domain entries): RFC 1123 §2.1 host names only.

/// A host name's length as text, at most (RFC 1035 §2.3.4: 255 bytes on
/// the wire, 253 as text without the trailing dot).
pub const MAX_LEN: usize = 253;
/// A label's length, at most (RFC 1035 §2.3.4).
pub const MAX_LABEL_LEN: usize = 63;

/// `name` trimmed of ASCII white space, without one trailing dot, in ASCII
/// lower case; `None` if nothing is left. Bytes are not checked (see
/// [`parse`] for that).
pub fn fold(name: &str) -> Option<String> {
    let n = name.trim_ascii();
    let n = n.strip_suffix('.').unwrap_or(n);
    (!n.is_empty()).then(|| n.to_ascii_lowercase())
}

/// `name` [`fold`]ed if it is a valid host name (RFC 1123 §2.1 / RFC 1035
/// §2.3.4: ASCII letters, digits and hyphens; labels of 1 to 63 bytes, not
/// starting or ending with a hyphen; at most 253 bytes; the last label not
/// all digits, so a mistyped IPv4 address is not taken for a name); else
/// `None`. Internationalised names must be written in their `xn--` form.
pub fn parse(name: &str) -> Option<String> {
    let n = name.strip_suffix('.').unwrap_or(name);
    if n.is_empty() || n.len() > MAX_LEN {
        return None;
    }
    let mut last_numeric = false;
    for label in n.split('.') {
        let b = label.as_bytes();
        if b.is_empty() || b.len() > MAX_LABEL_LEN {
            return None;
        }
        if !b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-') {
            return None;
        }
        if b.first() == Some(&b'-') || b.last() == Some(&b'-') {
            return None;
        }
        last_numeric = b.iter().all(u8::is_ascii_digit);
    }
    if last_numeric {
        return None;
    }
    fold(n)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn fold_gives_the_compared_form() {
        assert_eq!(fold("WWW.Example.COM.").as_deref(), Some("www.example.com"));
        assert_eq!(fold(" _dmarc.example.com ").as_deref(), Some("_dmarc.example.com"));
        assert_eq!(fold("example.com..").as_deref(), Some("example.com."), "one trailing dot only");
        assert_eq!(fold("."), None);
        assert_eq!(fold(""), None);
        assert_eq!(fold("  "), None);
    }

    #[test]
    fn parse_takes_host_names_only() {
        assert_eq!(parse("API.OpenAI.com").as_deref(), Some("api.openai.com"));
        assert_eq!(parse("xn--bcher-kva.example.").as_deref(), Some("xn--bcher-kva.example"));
        assert_eq!(parse("a-b.c9"), Some("a-b.c9".into()));
        for bad in ["", ".", "a..b", "-a.com", "a-.com", "a_b.com", "1.2.3.4", "a b.com", " a.com", "ä.com"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
        let label = "a".repeat(MAX_LABEL_LEN);
        assert!(parse(&label).is_some());
        assert!(parse(&format!("{label}a")).is_none());
        let long = ["a"; 127].join(".");
        assert_eq!(long.len(), MAX_LEN);
        assert!(parse(&long).is_some());
        assert!(parse(&format!("a{long}")).is_none());
    }

    proptest! {
        #[test]
        fn a_parsed_name_is_its_own_fold(name in "[a-zA-Z0-9-]{1,20}(\\.[a-zA-Z][a-zA-Z0-9-]{0,20}){0,4}\\.?") {
            if let Some(p) = parse(&name) {
                prop_assert_eq!(fold(&p), Some(p.clone()));
                prop_assert_eq!(fold(&name), Some(p));
            }
        }

        #[test]
        fn fold_ignores_ascii_case(name in "\\PC{0,40}") {
            prop_assert_eq!(fold(&name.to_ascii_uppercase()), fold(&name));
        }
    }
}
