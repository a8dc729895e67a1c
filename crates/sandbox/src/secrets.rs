//! Secrets as the sandbox manager uses them: a sandbox's bindings (an
//! environment variable holding a placeholder, for a named secret), where
//! the values and rules come from ([`SecretSource`], the server's store),
//! and what the manager needs to broker them ([`SecretsSetup`]).
//!
//! The guest only ever holds placeholders: random strings, unique per
//! sandbox and secret, set in its host environment (`Op::SetHostEnv`). A
//! branch child and a restored sandbox keep their source's bindings and
//! placeholders (their processes hold them already); a binding is
//! resolved to its secret's value and rules at every use, so a detached
//! or deleted secret stops being swapped at once. Values never enter
//! records, logs, snapshots or results.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
pub use tine_broker::{Binding, Broker, HeaderName, HostPattern, SecretValue};

/// Secrets one sandbox may have bound at once.
pub const MAX_BINDINGS: usize = 32;
/// The placeholder's prefix (then 32 hex digits, 128 random bits).
pub const PLACEHOLDER_PREFIX: &str = "tine_placeholder_";

/// A secret as the server's store gives it.
#[derive(Debug)]
pub struct SecretRule {
    /// Its name.
    pub name: String,
    /// The real value.
    pub value: Arc<SecretValue>,
    /// The hosts it may be sent to.
    pub hosts: Vec<HostPattern>,
    /// The header it goes in, and the header's format (see
    /// [`Binding::header`]); `None`: `Authorization`, the placeholder
    /// itself replaced (every header with `any_header`).
    pub header: Option<(HeaderName, Option<String>)>,
    /// Without `header`: swapped in every request header
    /// ([`Binding::any_header`]).
    pub any_header: bool,
    /// Also swapped in query strings.
    pub in_query: bool,
    /// Also swapped in small request bodies.
    pub in_body: bool,
}

/// Where secrets' values and rules come from (the server's store).
pub trait SecretSource: Send + Sync {
    /// Secret `name` as `tenant` (`None`: the operator) may use it: the
    /// tenant's own, else one the operator shares; `None` when there is
    /// none it may use.
    fn lookup(&self, tenant: Option<&str>, name: &str) -> Option<Arc<SecretRule>>;
    /// Whether a plain HTTP request carrying a placeholder to a host its
    /// secret may not go to is refused (always logged).
    fn refuse_leaks(&self) -> bool;
}

/// What the manager needs for secrets: the store and the broker.
#[derive(Clone)]
pub struct SecretsSetup {
    /// The server's secrets.
    pub source: Arc<dyn SecretSource>,
    /// The TLS broker flows go to.
    pub broker: Arc<Broker>,
}

impl std::fmt::Debug for SecretsSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretsSetup").finish_non_exhaustive()
    }
}

/// One secret bound to one sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct SecretBinding {
    /// The guest's environment variable that holds the placeholder.
    pub env: String,
    /// The secret's name.
    pub secret: String,
    /// The placeholder (what the guest sees; not secret).
    pub placeholder: String,
}

/// A new placeholder: [`PLACEHOLDER_PREFIX`] and 128 bits from the
/// kernel's random source, as hex.
///
/// Errors: the random source failed (its message).
pub fn new_placeholder() -> Result<String, String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| e.to_string())?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("{PLACEHOLDER_PREFIX}{hex}"))
}

/// `binding` resolved against `rule`, for the broker.
pub fn broker_binding(binding: &SecretBinding, rule: &SecretRule) -> Binding {
    Binding {
        secret: rule.name.clone(),
        placeholder: binding.placeholder.clone(),
        value: rule.value.clone(),
        hosts: rule.hosts.clone(),
        header: rule.header.as_ref().map(|(h, _)| h.clone()),
        any_header: rule.any_header,
        format: rule.header.as_ref().and_then(|(_, f)| f.clone()),
        in_query: rule.in_query,
        in_body: rule.in_body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_random_and_shaped() {
        let (a, b) = (new_placeholder().unwrap(), new_placeholder().unwrap());
        assert_ne!(a, b);
        assert!(a.starts_with(PLACEHOLDER_PREFIX) && a.len() == PLACEHOLDER_PREFIX.len() + 32);
        assert!(a.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_'));
    }
}
