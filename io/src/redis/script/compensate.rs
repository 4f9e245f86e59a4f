//! `compensate` (`lua/seckill.lua::compensate`): the once-per-reservation repair of a rejected
//! or released reservation's Redis effects (return the stock unit and/or release the buyer's
//! marker, as the event's flags say): its arguments, its replies and their parser.
//!
//! What it is not: the call. `client.rs` builds the KEYS and ARGV and sends them
//! (`Functions::compensate`); this file only says what goes in and what can come back. Nor
//! the choice of effects: which ones a rejection undoes is the PostgreSQL worker's decision
//! and arrives as the event's flags.
//!
//! Read next: the contract comment above `compensate` in `lua/seckill.lua`, and
//! `tests/tests/lua_functions.rs` for its branches against a real Redis.

use super::error::{unexpected, ScriptError};
use super::parse::{array, text, uint};
use crate::resp::Reply;

/// `compensate` arguments: which of the reservation's Redis effects to undo (the flags of the
/// compensation event).
#[derive(Debug, Clone, Copy)]
pub struct CompensateArgs<'a> {
    pub reservation_id: &'a str,
    pub request_id: &'a str,
    pub user_id: u64,
    pub return_stock: bool,
    pub release_user: bool,
    pub reason_code: &'a str,
    pub now_ms: u64,
    /// The reservation's quantity: what `return_stock` gives back.
    pub units: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompensateReply {
    Applied {
        stock_after: u64,
    },
    /// This reservation was compensated before; nothing changed.
    AlreadyApplied,
}

/// Parses `[code, stock]`.
pub fn parse_compensate(reply: Reply) -> Result<CompensateReply, ScriptError> {
    const F: &str = "compensate";
    let items = array(F, &reply, 2)?;
    let stock = uint(&items[1]);
    match (text(&items[0]), stock) {
        (Some("APPLIED"), Some(stock_after)) => Ok(CompensateReply::Applied { stock_after }),
        (Some("ALREADY_APPLIED"), Some(_)) => Ok(CompensateReply::AlreadyApplied),
        _ => Err(unexpected(F, "code or stock", &reply)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::parse::fixtures::{arr, bulk, expect_unexpected};
    use super::*;

    #[test]
    fn compensate_replies() {
        let r = |code, n| arr(vec![bulk(code), Reply::Integer(n)]);
        assert_eq!(
            parse_compensate(r("APPLIED", 5)).unwrap(),
            CompensateReply::Applied { stock_after: 5 }
        );
        assert_eq!(
            parse_compensate(r("ALREADY_APPLIED", 5)).unwrap(),
            CompensateReply::AlreadyApplied
        );
        expect_unexpected(parse_compensate(r("APPLIED", -1)));
        expect_unexpected(parse_compensate(r("NOPE", 1)));
        expect_unexpected(parse_compensate(arr(vec![bulk("APPLIED")])));
        expect_unexpected(parse_compensate(bulk("APPLIED")));
    }
}
