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

/// Whether `h` is a host name as [`host_name`] makes them: ids come from
/// clients, and the name may go into a peer's URL ([`ClusterConfig::peer_url`]).
fn is_host_name(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= MAX_HOST_NAME
        && h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !h.starts_with('-')
        && !h.ends_with('-')
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
}
