//! Host names, and the hosts that sandbox, process and session ids name.
//! A sandbox id's format is [`tine_sandbox::ids`]'s; this module checks that
//! the host part a client sends is a host name before it goes into a
//! peer's URL.

use rmcp::model::JsonObject;

use super::ClusterError;

/// The environment variable that names this host when the configuration
/// does not (e.g. a Kubernetes pod's IP or node name).
pub const HOST_NAME_ENV: &str = "TINE_HOST_NAME";
/// Longest host name (bytes).
pub const MAX_HOST_NAME: usize = 40;
/// The argument names of tools that hold sandbox or process ids.
const ID_ARGUMENTS: [&str; 6] = ["sandbox_id", "process_id", "a", "b", "winner", "parent"];

/// `raw` as a host name: lowercased, `.` turned into `-`.
///
/// Errors: [`ClusterError::BadHostName`] for an empty or too long name, or
/// one with other characters or a `-` at either end.
pub fn host_name(raw: &str) -> Result<String, ClusterError> {
    let bad = |reason| ClusterError::BadHostName { name: raw.to_string(), reason };
    let name: String = raw.trim().to_ascii_lowercase().replace('.', "-");
    if name.is_empty() {
        return Err(bad("it is empty"));
    }
    if name.len() > MAX_HOST_NAME {
        return Err(bad("it is too long"));
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        return Err(bad("it has characters other than letters, digits, '-' and '.'"));
    }
    if name.starts_with('-') || name.ends_with('-') {
        return Err(bad("it starts or ends with '-' or '.'"));
    }
    if is_numeric_label(&name) {
        return Err(bad("it is a number, which a URL reads as an IPv4 address; add a letter"));
    }
    Ok(name)
}

/// The system's host name (gethostname(2)), its first label made into a
/// host name (other characters become `-`); `"tine"` when it has none.
pub fn system_host_name() -> String {
    let raw = nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_default();
    let first = raw.split('.').next().unwrap_or_default();
    let mut name: String = first
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
        .take(MAX_HOST_NAME)
        .collect();
    name = name.trim_matches('-').to_string();
    if name.is_empty() {
        "tine".into()
    } else {
        name
    }
}

/// Whether the DNS label `label` is one that a URL's host parser takes as
/// (the last part of) an IPv4 address: the WHATWG URL Standard's "ends in
/// a number checker" (§3.5, host parsing) says so for a last label of
/// ASCII digits only (decimal, or octal with a leading `0`) or of `0x`/`0X`
/// and hex digits (`0x` alone included). `3405803783`, `0x7f000001` and
/// `0177` are such labels: in `http://{host}:5555` they would name an IP
/// address, not a host.
pub fn is_numeric_label(label: &str) -> bool {
    let hex = label.strip_prefix("0x").or_else(|| label.strip_prefix("0X"));
    match hex {
        Some(digits) => digits.bytes().all(|b| b.is_ascii_hexdigit()),
        None => !label.is_empty() && label.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// Whether `h` is a host name as [`host_name`] makes them: ids come from
/// clients, and the name may go into a peer's URL ([`ClusterConfig::peer_url`]),
/// so a name that a URL would read as an IPv4 address ([`is_numeric_label`])
/// is not one.
///
/// [`ClusterConfig::peer_url`]: super::ClusterConfig::peer_url
fn is_host_name(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= MAX_HOST_NAME
        && h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !h.starts_with('-')
        && !h.ends_with('-')
        && !is_numeric_label(h)
}

/// The host a sandbox or process id names: `sb-<host>-<random>[:p<m>]`
/// gives `<host>` ([`tine_sandbox::ids::host_part`]); `None` for an id
/// without one, not of that shape, or whose host part is not a host name.
pub fn host_of(id: &str) -> Option<&str> {
    tine_sandbox::ids::host_part(id).filter(|h| is_host_name(h))
}

/// The sandbox and process ids a tool call's arguments name (by
/// [`ID_ARGUMENTS`]).
pub fn named_ids(args: Option<&JsonObject>) -> impl Iterator<Item = &str> {
    ID_ARGUMENTS.iter().filter_map(move |key| args.and_then(|a| a.get(*key)).and_then(|v| v.as_str()))
}

/// The host a session id names: `<host>.<uuid>` gives `<host>` (`None`
/// when that part is not a host name).
pub fn session_host(session_id: &str) -> Option<&str> {
    session_id.split_once('.').map(|(h, _)| h).filter(|h| is_host_name(h))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_are_checked_and_normalized() {
        assert_eq!(host_name("Node-7.example.com").unwrap(), "node-7-example-com");
        assert_eq!(host_name("10.1.2.3").unwrap(), "10-1-2-3");
        for bad in ["", "-a", "a-", "a_b", "a/b", "é", &"a".repeat(MAX_HOST_NAME + 1)] {
            let e = host_name(bad).unwrap_err();
            assert!(e.to_string().contains("host_name"), "{bad:?}: {e}");
        }
        let sys = system_host_name();
        assert_eq!(host_name(&sys).unwrap(), sys, "the system's name is usable as it is");
    }

    #[test]
    fn ids_name_their_host() {
        assert_eq!(host_of("sb-h2-17"), Some("h2"));
        assert_eq!(host_of("sb-node-7-17:p3"), Some("node-7"));
        assert_eq!(host_of("sb-17"), None);
        assert_eq!(host_of("sb-h2-x"), None);
        assert_eq!(host_of("default"), None);
        let minted = tine_sandbox::ids::mint("sb-node-7").unwrap();
        assert_eq!(host_of(&minted), Some("node-7"));
        assert_eq!(host_of(&format!("{minted}:p2")), Some("node-7"));
        // Client-supplied ids cannot point a peer URL elsewhere.
        for evil in ["sb-evil.com/x-1", "sb-a@b-1", "sb-A-1", "sb--1", "sb-a:b-1"] {
            assert_eq!(host_of(evil), None, "{evil}");
        }
        assert_eq!(session_host("evil.com/x.0f7c"), Some("evil"));
        assert_eq!(session_host("a/b.0f7c"), None);
        assert_eq!(session_host("http://x.0f7c"), None);
        assert_eq!(session_host("h2.0f7c"), Some("h2"));
        assert_eq!(session_host("0f7c"), None);
    }

    /// Host parts a URL parser reads as IPv4 addresses (127.0.0.1 written
    /// four ways, and 203.0.113.7 as the issue's `3405803783`) name no
    /// host: no peer URL is made from them.
    #[test]
    fn numeric_host_parts_name_no_host() {
        let minted = tine_sandbox::ids::mint("sb-h1").unwrap();
        let random = minted.strip_prefix("sb-h1-").unwrap();
        for numeric in ["2130706433", "3405803783", "0x7f000001", "0x", "017700000001", "0", "0xffffffff"] {
            assert_eq!(host_of(&format!("sb-{numeric}-{random}")), None, "{numeric}");
            assert_eq!(host_of(&format!("sb-{numeric}-{random}:p1")), None, "{numeric}");
            assert_eq!(session_host(&format!("{numeric}.0f7c")), None, "{numeric}");
            assert!(host_name(numeric).unwrap_err().to_string().contains("IPv4"), "{numeric}");
            // What they would have been in a peer URL.
            let url = reqwest::Url::parse(&format!("http://{numeric}:5555/")).unwrap();
            assert!(url.host_str().unwrap().parse::<std::net::Ipv4Addr>().is_ok(), "{numeric}: {url}");
        }
        // Names with a letter or a '-' stay names, for the URL parser too.
        for name in ["h1", "10-1-2-3", "0xg1", "x0", "127-0-0-1", "0x7f-1", "1e5", "deadbeef"] {
            assert_eq!(host_of(&format!("sb-{name}-{random}")), Some(name), "{name}");
            assert_eq!(host_name(name).unwrap(), name);
            let url = reqwest::Url::parse(&format!("http://{name}:5555/")).unwrap();
            assert_eq!(url.host_str(), Some(name), "{name}: {url}");
        }
        // Dotted forms cannot be host parts at all ('.' is not in a name).
        assert_eq!(host_of(&format!("sb-127.0.0.1-{random}")), None);
        assert_eq!(session_host("127.0.0.1.0f7c"), None);
    }
}
