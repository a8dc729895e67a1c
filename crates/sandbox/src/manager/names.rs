//! Named sandboxes: a name given at create (`sandbox_create { name }`),
//! unique within its tenant among the sandboxes this host keeps, taken
//! wherever an id is ([`Manager::resolve`]). A name never looks like an id
//! (it may not start with `sb-`), so one string is either. A branch child
//! has no name; a merge leaves the parent's.

use super::{Manager, SandboxError, SandboxId};
use crate::lock;

/// Longest name (bytes).
pub const MAX_NAME: usize = 63;

/// Checks a name's shape: 1-[`MAX_NAME`] lowercase letters, digits, `-`
/// and `_`, starting with a letter or digit, not `sb-...` (an id's shape).
///
/// Errors: [`SandboxError::Name`].
pub fn check_name(name: &str) -> Result<(), SandboxError> {
    let bad = |why: &str| SandboxError::Name(format!("sandbox name {name:?}: {why}"));
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(bad(&format!("use 1 to {MAX_NAME} characters")));
    }
    if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        || !name.as_bytes()[0].is_ascii_alphanumeric()
    {
        return Err(bad("use lowercase letters, digits, '-' and '_', starting with a letter or digit"));
    }
    if name.starts_with("sb-") {
        return Err(bad("names may not start with \"sb-\" (sandbox ids do)"));
    }
    Ok(())
}

impl Manager {
    /// The id of the sandbox `tenant` (`None`: the operator) calls
    /// `name_or_id`: the sandbox of that id, else the one of its tenant
    /// with that name (the operator: its own, else the one sandbox of any
    /// tenant with it). `None` when there is none.
    pub fn resolve(&self, tenant: Option<&str>, name_or_id: &str) -> Option<SandboxId> {
        let map = lock(&self.sandboxes);
        if map.contains_key(name_or_id) {
            return Some(name_or_id.to_string());
        }
        let named = |t: Option<&str>| {
            map.values()
                .filter(|sb| lock(&sb.name).as_deref() == Some(name_or_id) && sb.tenant().as_deref() == t)
                .map(|sb| sb.id.clone())
                .next()
        };
        if let Some(id) = named(tenant) {
            return Some(id);
        }
        if tenant.is_some() {
            return None;
        }
        let mut any = map.values().filter(|sb| lock(&sb.name).as_deref() == Some(name_or_id));
        match (any.next(), any.next()) {
            (Some(sb), None) => Some(sb.id.clone()),
            _ => None,
        }
    }

    /// The sandbox of `tenant` named `name`, other than `except`, if any.
    fn named(&self, tenant: Option<&str>, name: &str, except: Option<&str>) -> Option<SandboxId> {
        lock(&self.sandboxes)
            .values()
            .filter(|sb| Some(sb.id.as_str()) != except)
            .find(|sb| lock(&sb.name).as_deref() == Some(name) && sb.tenant().as_deref() == tenant)
            .map(|sb| sb.id.clone())
    }

    /// Checks that `name` may be given to a new sandbox of `tenant`.
    ///
    /// Errors: [`SandboxError::Name`] (its shape, or taken).
    pub(super) fn check_new_name(&self, tenant: Option<&str>, name: &str) -> Result<(), SandboxError> {
        check_name(name)?;
        match self.named(tenant, name, None) {
            Some(id) => Err(SandboxError::Name(format!(
                "a sandbox named {name:?} exists already ({id}): pick another name, or kill it first"
            ))),
            None => Ok(()),
        }
    }

    /// Gives new sandbox `id` its `name`, unless another sandbox of its
    /// tenant took it meanwhile.
    ///
    /// Errors: [`SandboxError::Name`], [`SandboxError::NotFound`].
    pub(super) fn give_name(&self, id: &str, name: &str) -> Result<(), SandboxError> {
        let sb = self.get(id)?;
        let _records = lock(&self.records);
        if let Some(other) = self.named(sb.tenant().as_deref(), name, Some(id)) {
            return Err(SandboxError::Name(format!("a sandbox named {name:?} was made meanwhile ({other})")));
        }
        *lock(&sb.name) = Some(name.to_string());
        drop(_records);
        self.record_in_background(&sb);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_have_a_shape_of_their_own() {
        for ok in ["my-python-env", "primes", "a", "x_1", &"n".repeat(63)] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "sb-h1-abc", "My", "-x", "a b", "a.b", &"n".repeat(64)] {
            assert!(matches!(check_name(bad), Err(SandboxError::Name(_))), "{bad}");
        }
    }
}
