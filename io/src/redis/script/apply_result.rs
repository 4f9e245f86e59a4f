//! `apply_result` (`lua/seckill.lua::apply_result`): a reservation's final outcome as
//! PostgreSQL decided it (an order, or a failure with its reason) recorded in Redis, once: its
//! arguments ([`FinalOutcome`], [`ApplyResultArgs`]), its three replies and their parser; and
//! its batch form `apply_results` (one SKU's outcomes in one call, at most
//! [`APPLY_RESULTS_MAX`], one reply each).
//!
//! What it is not: the call. `client.rs` builds the KEYS and ARGV and sends them
//! (`Functions::apply_result`); this file only says what goes in and what can come back.
//!
//! Read next: the contract comment above `apply_result` in `lua/seckill.lua`, and
//! `tests/tests/lua_functions.rs` for its branches against a real Redis.

use super::error::{unexpected, ScriptError};
use super::parse::{array, text};
use crate::resp::Reply;

/// Outcomes one `apply_results` call applies at most (`APPLY_RESULTS_MAX` in seckill.lua).
pub const APPLY_RESULTS_MAX: usize = 256;

/// A reservation's final outcome, as decided by PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalOutcome<'a> {
    OrderCreated { order_id: &'a str },
    Failed { reason_code: &'a str },
}

#[derive(Debug, Clone, Copy)]
pub struct ApplyResultArgs<'a> {
    pub request_id: &'a str,
    pub reservation_id: &'a str,
    pub outcome: FinalOutcome<'a>,
    pub now_ms: u64,
    /// The next three recreate the `req` hash if Redis lost it.
    pub payload_hash: &'a str,
    pub message_id: &'a str,
    pub user_id: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyResultReply {
    Applied,
    /// The same outcome was recorded before; nothing changed.
    Already,
    /// A different final outcome is recorded; nothing changed.
    Conflict,
}

pub fn parse_apply_result(reply: Reply) -> Result<ApplyResultReply, ScriptError> {
    code("apply_result", &reply)
}

/// Parses `apply_results`' reply: one code per outcome of the batch of `n`.
pub fn parse_apply_results(reply: Reply, n: usize) -> Result<Vec<ApplyResultReply>, ScriptError> {
    array("apply_results", &reply, n)?.iter().map(|c| code("apply_results", c)).collect()
}

fn code(function: &'static str, reply: &Reply) -> Result<ApplyResultReply, ScriptError> {
    match text(reply) {
        Some("APPLIED") => Ok(ApplyResultReply::Applied),
        Some("ALREADY") => Ok(ApplyResultReply::Already),
        Some("CONFLICT") => Ok(ApplyResultReply::Conflict),
        _ => Err(unexpected(function, "code", reply)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::parse::fixtures::{bulk, expect_unexpected};
    use super::*;

    #[test]
    fn apply_result_replies() {
        assert_eq!(parse_apply_result(bulk("APPLIED")).unwrap(), ApplyResultReply::Applied);
        assert_eq!(parse_apply_result(bulk("ALREADY")).unwrap(), ApplyResultReply::Already);
        assert_eq!(parse_apply_result(bulk("CONFLICT")).unwrap(), ApplyResultReply::Conflict);
        expect_unexpected(parse_apply_result(bulk("")));
        expect_unexpected(parse_apply_result(Reply::Nil));
    }

    #[test]
    fn apply_results_replies_one_code_per_outcome() {
        use super::super::parse::fixtures::arr;
        use ApplyResultReply::{Already, Applied, Conflict};
        let codes = arr(vec![bulk("APPLIED"), bulk("ALREADY"), bulk("CONFLICT")]);
        assert_eq!(parse_apply_results(codes, 3).unwrap(), vec![Applied, Already, Conflict]);
        expect_unexpected(parse_apply_results(arr(vec![bulk("APPLIED")]), 2));
        expect_unexpected(parse_apply_results(arr(vec![bulk("applied")]), 1));
        expect_unexpected(parse_apply_results(bulk("APPLIED"), 1));
    }
}
