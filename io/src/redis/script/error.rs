//! [`ScriptError`]: everything a call of the `seckill` library can end in that is not one of
//! the function's own replies, with the three questions every caller asks of it (worth
//! retrying, a refused argument, may the function have run), and how a server error reply
//! becomes one ([`server_error`]).
//!
//! What it is not: a business outcome. `SOLD_OUT` or `DUPLICATE_USER` are replies
//! (`reserve.rs`), never errors; what the engine answers for an error is its own table.
//!
//! Read next: `client.rs` (where these come from), `connection.rs` (`RedisError`).

use crate::redis::RedisError;
use crate::resp::Reply;

/// Everything that is not a business outcome of a function call.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    /// The connection failed; see [`RedisError`] for whether the command may have run.
    #[error(transparent)]
    Redis(#[from] RedisError),
    /// Redis answered with an error reply (`-ERR seckill: bad now_ms`, `-READONLY ...`, a
    /// second "function not found" after the reload, ...).
    #[error("redis server error: {0}")]
    Server(String),
    /// The reply is outside the function's documented reply set (version skew or a bug). The
    /// function ran, so what it wrote is unknown.
    #[error("unexpected reply: {0}")]
    UnexpectedReply(String),
    /// An argument the library would reject (an id longer than
    /// [`ID_LEN_MAX`](super::keys::ID_LEN_MAX) or empty); nothing was sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// The library refused an argument (`-ERR seckill: bad <what>`): the function ran only its
    /// validation and wrote nothing. The node is healthy — this is bad input (or a binding
    /// bug), never a reason to open a circuit ([`ScriptError::is_refusal`]).
    #[error("refused by the seckill library: bad {0}")]
    Refused(String),
    /// `reserve` answered a reservation (CREATED, or IDEMPOTENT for one still queued) but the
    /// `WAIT` after it confirmed fewer than `min_replica_acks` replicas: it exists on the
    /// master and may vanish on failover. Never a promise: the engine answers `UNKNOWN` and
    /// the client retries with the same request id.
    #[error("reservation not confirmed by replicas ({acks} of {wanted} acknowledged)")]
    FenceShort { acks: u32, wanted: u32 },
}

/// Error-reply prefixes after which the server did not run the command and may accept it a
/// moment later (failover, loading, a busy script, memory pressure, cluster reconfiguration).
const TRANSIENT_SERVER_ERRORS: [&str; 7] =
    ["LOADING", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY", "OOM"];

impl ScriptError {
    /// Worth retrying (with the same ids) after a backoff.
    pub fn is_transient(&self) -> bool {
        match self {
            ScriptError::Redis(e) => e.is_transient(),
            ScriptError::Server(message) => {
                TRANSIENT_SERVER_ERRORS.iter().any(|prefix| message.starts_with(prefix))
            }
            ScriptError::UnexpectedReply(_)
            | ScriptError::InvalidArgument(_)
            | ScriptError::Refused(_) => false,
            ScriptError::FenceShort { .. } => true,
        }
    }

    /// An argument was refused (by this binding before sending, or by the library's own
    /// validation): the store is fine and nothing was written. Counts as a healthy answer,
    /// never as a node failure: one buyer's bad value must not close a shard for everyone
    /// (issue 23).
    pub fn is_refusal(&self) -> bool {
        matches!(self, ScriptError::InvalidArgument(_) | ScriptError::Refused(_))
    }

    /// The function may have run: the caller must not assume either outcome (answer
    /// `UNKNOWN`, never release stock, retry only with the same ids).
    pub fn outcome_unknown(&self) -> bool {
        match self {
            ScriptError::Redis(e) => e.outcome_unknown(),
            // The script ran and replied something we cannot read: what it wrote is unknown.
            ScriptError::UnexpectedReply(_) => true,
            // It ran on the master; whether it survives a failover is unknown.
            ScriptError::FenceShort { .. } => true,
            // An error reply means the function did not run or failed in validation, before
            // any write (the library validates first); nothing was sent for InvalidArgument.
            ScriptError::Server(_) | ScriptError::InvalidArgument(_) | ScriptError::Refused(_) => {
                false
            }
        }
    }
}

/// A reply outside `function`'s documented reply set.
pub(super) fn unexpected(function: &str, what: &str, reply: &Reply) -> ScriptError {
    ScriptError::UnexpectedReply(format!("{function}: {what} in {reply:?}"))
}

/// The library's validation replies (`bad()` in `lua/seckill.lua`) begin with this.
const LIBRARY_REFUSAL: &str = "ERR seckill: bad ";

/// An error reply as a [`ScriptError`]: the library's own refusals apart from the server's.
pub(super) fn server_error(message: &[u8]) -> ScriptError {
    let message = String::from_utf8_lossy(message);
    match message.strip_prefix(LIBRARY_REFUSAL) {
        Some(what) => ScriptError::Refused(what.to_owned()),
        None => ScriptError::Server(message.into_owned()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn error_classification() {
        let server = |s: &str| ScriptError::Server(s.to_owned());
        assert!(server("READONLY You can't write against a read only replica.").is_transient());
        assert!(server("LOADING Redis is loading the dataset in memory").is_transient());
        assert!(!server("ERR seckill: bad now_ms").is_transient());
        assert!(!server("READONLY x").outcome_unknown());
        assert!(ScriptError::UnexpectedReply(String::new()).outcome_unknown());
        assert!(!ScriptError::UnexpectedReply(String::new()).is_transient());
        assert!(!ScriptError::InvalidArgument("x").outcome_unknown());
    }

    #[test]
    fn the_librarys_validation_replies_are_refusals_not_failures() {
        let refused = server_error(b"ERR seckill: bad user_id");
        assert!(matches!(&refused, ScriptError::Refused(what) if what == "user_id"), "{refused:?}");
        assert!(refused.is_refusal() && !refused.is_transient() && !refused.outcome_unknown());
        assert!(ScriptError::InvalidArgument("request_id").is_refusal());
        for other in ["ERR unknown command 'FCALL'", "READONLY x", "ERR seckill: keys"] {
            let e = server_error(other.as_bytes());
            assert!(matches!(e, ScriptError::Server(_)) && !e.is_refusal(), "{other}: {e:?}");
        }
    }
}
