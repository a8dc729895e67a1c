//! Sandbox ids: `sb-[<host>-]<random>`, where `<random>` is 80 bits from
//! the kernel's CSPRNG (`getrandom(2)`) written as 16 characters of
//! base32 with the extended-hex alphabet in lower case (`[0-9a-v]`,
//! RFC 4648 §7), so an id cannot be guessed from another one and fits a
//! DNS label beside a host name of up to 40 characters (60 bytes at most).
//!
//! Ids minted before random parts (`sb-<host>-<n>`, kept across restarts in
//! hibernation records) are still read: their last part is decimal digits,
//! which are in the same alphabet.

use thiserror::Error;

/// Bytes of randomness in an id (80 bits).
pub const RANDOM_BYTES: usize = 10;

/// Characters of an id's random part (`RANDOM_BYTES` * 8 / 5).
pub const RANDOM_CHARS: usize = RANDOM_BYTES * 8 / 5;

/// The prefix of every sandbox id.
pub const SANDBOX_PREFIX: &str = "sb";

/// What minting an id can meet.
#[derive(Debug, Error)]
pub enum IdError {
    /// `getrandom(2)` failed (the kernel's entropy pool is not ready, or
    /// the syscall is refused by a seccomp filter).
    #[error("cannot read random bytes for an id: {0}")]
    Random(getrandom::Error),
}

/// A new random part: [`RANDOM_CHARS`] characters of `[0-9a-v]`.
///
/// Errors: [`IdError::Random`].
pub fn random_part() -> Result<String, IdError> {
    let mut bytes = [0u8; RANDOM_BYTES];
    getrandom::fill(&mut bytes).map_err(IdError::Random)?;
    Ok(data_encoding::BASE32_DNSSEC.encode(&bytes))
}

/// A new id under `prefix`: `<prefix>-<random part>`.
///
/// Errors: [`IdError::Random`].
pub fn mint(prefix: &str) -> Result<String, IdError> {
    Ok(format!("{prefix}-{}", random_part()?))
}

/// The prefix of the sandbox ids of a host: `sb-<host>`, or `sb` without a
/// host name.
pub fn sandbox_prefix(host: Option<&str>) -> String {
    match host {
        Some(h) => format!("{SANDBOX_PREFIX}-{h}"),
        None => SANDBOX_PREFIX.into(),
    }
}

/// Whether `part` can be the last part of a sandbox id: a random part, or
/// the decimal number of an id minted before random parts.
pub fn is_id_part(part: &str) -> bool {
    !part.is_empty() && part.len() <= RANDOM_CHARS && part.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'v'))
}

/// The host part of sandbox id `id` as written (`sb-<host>-<part>` gives
/// `<host>`; `None` for an id without one). The caller checks that it is a
/// host name. A process id (`<sandbox id>:p<n>`) names its sandbox's host.
pub fn host_part(id: &str) -> Option<&str> {
    let sandbox = id.split_once(':').map_or(id, |(s, _)| s);
    let (host, part) = sandbox.strip_prefix("sb-")?.rsplit_once('-')?;
    (!host.is_empty() && is_id_part(part)).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_random_and_readable() {
        let a = mint(&sandbox_prefix(Some("h1"))).unwrap();
        let b = mint(&sandbox_prefix(Some("h1"))).unwrap();
        assert_ne!(a, b);
        let part = a.strip_prefix("sb-h1-").unwrap();
        assert_eq!(part.len(), RANDOM_CHARS);
        assert!(is_id_part(part), "{a}");
        assert_eq!(host_part(&a), Some("h1"));
        assert_eq!(host_part(&format!("{a}:p3")), Some("h1"));
        assert_eq!(mint(&sandbox_prefix(None)).unwrap().len(), 3 + RANDOM_CHARS);
        // 40 characters of host name: the id fits a DNS label (63).
        assert!(mint(&sandbox_prefix(Some(&"h".repeat(40)))).unwrap().len() <= 63);
    }

    #[test]
    fn old_and_malformed_ids() {
        assert_eq!(host_part("sb-my-host-12"), Some("my-host"));
        assert_eq!(host_part("sb-12"), None);
        assert_eq!(host_part(&format!("sb-{}", random_part().unwrap())), None);
        for bad in ["sb-h1-", "sb-h1-X", "sb-h1-w", "sb--0", "xb-h1-0", "sb-h1-00000000000000000"] {
            assert_eq!(host_part(bad), None, "{bad}");
        }
    }
}
