//! What more than one tool family's parameters use: the schema of an
//! environment map, and timeouts in seconds.

use crate::mcp::bounds::{string_map, MAX_ENV_NAME_CHARS, MAX_ENV_VALUE_CHARS, MAX_ENV_VARS};
use crate::mcp::errors::ToolError;

/// Schema of an environment map (the whole is checked again in bytes by
/// the manager and the agent).
pub(super) fn env_map(schema: &mut schemars::Schema) {
    string_map::<MAX_ENV_VARS, MAX_ENV_NAME_CHARS, MAX_ENV_VALUE_CHARS>(schema);
}

/// A tool's `timeout_secs` as the agent's milliseconds (0: its default).
///
/// Errors: [`ToolError::Timeout`] outside 1..=600 s.
pub fn secs_to_ms(secs: Option<u32>) -> Result<u32, ToolError> {
    let max = tine_protocol::MAX_TIMEOUT_MS / 1000;
    match secs {
        None => Ok(0),
        Some(s) if (1..=max).contains(&s) => Ok(s * 1000),
        Some(s) => Err(ToolError::Timeout { got: s, max }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_checked_in_seconds() {
        let secs_to_ms = |s| secs_to_ms(s).map_err(|e| e.to_string());
        assert_eq!(secs_to_ms(None), Ok(0));
        assert_eq!(secs_to_ms(Some(2)), Ok(2000));
        assert_eq!(secs_to_ms(Some(600)), Ok(600_000));
        assert_eq!(secs_to_ms(Some(0)), Err("timeout_secs must be 1..=600, got 0".into()));
        assert!(secs_to_ms(Some(601)).is_err());
        assert!(secs_to_ms(Some(u32::MAX)).is_err());
    }
}
