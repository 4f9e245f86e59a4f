//! What both schemas share when they are read: the schema version this build writes and
//! reads ([`SCHEMA_VERSION`]), the decode error the worker routes to the DLQ ([`DecodeError`]:
//! every variant permanent), the probe that tells a newer schema from garbage, and the field
//! checks (ids of visible ASCII within [`ID_LEN_MAX`], ids that fit a PostgreSQL `bigint`).
//!
//! What it is not: a schema. The messages themselves are `order_create.rs` and `event.rs`.
//!
//! Read next: `order_create.rs`.

use serde::Deserialize;

/// The schema version this build writes and the highest it reads.
pub const SCHEMA_VERSION: u32 = 1;

/// Longest id accepted in a message (the Redis library's bound, `io::redis::script::ID_LEN_MAX`,
/// so every id that passes here can also be written to Redis by `redis-sync`).
pub const ID_LEN_MAX: usize = crate::redis::script::ID_LEN_MAX;

/// Largest id a PostgreSQL `bigint` holds; activity, SKU and user ids must fit.
const PG_BIGINT_MAX: u64 = i64::MAX as u64;

/// Why a body is not a message this build can act on. Every variant is permanent: the same
/// bytes fail the same way on every delivery, so the worker dead-letters them at once.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("body of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    /// Not JSON, or a required field missing or of the wrong type.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// A `schema_version` newer than this build understands.
    #[error("unknown schema_version {version} (this build reads up to {SCHEMA_VERSION})")]
    UnknownSchema { version: u64 },
    /// Well-formed JSON whose field violates the contract.
    #[error("invalid field {field}: {reason}")]
    Invalid { field: &'static str, reason: &'static str },
}

impl DecodeError {
    /// Always false: see the type's documentation. Present so callers can treat every error
    /// of the pipeline alike.
    pub fn is_transient(&self) -> bool {
        false
    }
}

/// A newer schema may have changed the shape so much that the full decode fails; look at
/// `schema_version` alone so that such a message is reported as "unknown schema", not as
/// garbage.
pub(super) fn newer_schema(body: &[u8]) -> Option<DecodeError> {
    #[derive(Deserialize)]
    struct Probe {
        schema_version: u64,
    }
    let probe: Probe = serde_json::from_slice(body).ok()?;
    (probe.schema_version > u64::from(SCHEMA_VERSION))
        .then_some(DecodeError::UnknownSchema { version: probe.schema_version })
}

/// A contract violation in `field`.
pub(super) fn invalid(field: &'static str, reason: &'static str) -> DecodeError {
    DecodeError::Invalid { field, reason }
}

/// 1..=[`ID_LEN_MAX`] bytes of visible ASCII. Control characters and NUL would be refused by
/// PostgreSQL `text` or break a NATS header line; non-ASCII ids are not ours.
pub(super) fn check_id(id: &str, field: &'static str) -> Result<(), DecodeError> {
    if id.is_empty() {
        return Err(invalid(field, "must not be empty"));
    }
    if id.len() > ID_LEN_MAX {
        return Err(invalid(field, "longer than ID_LEN_MAX"));
    }
    if !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(field, "must be visible ASCII"));
    }
    Ok(())
}

/// An activity, SKU or user id: 1..=`i64::MAX`, as PostgreSQL stores it.
pub(super) fn check_bigint(value: u64, field: &'static str) -> Result<(), DecodeError> {
    if value == 0 || value > PG_BIGINT_MAX {
        return Err(invalid(field, "must be within 1..=i64::MAX"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_decode_error_is_permanent() {
        for e in [
            DecodeError::TooLarge { len: 1, max: 0 },
            DecodeError::Malformed("x".into()),
            DecodeError::UnknownSchema { version: 2 },
            DecodeError::Invalid { field: "f", reason: "r" },
        ] {
            assert!(!e.is_transient(), "{e}");
        }
    }
}
