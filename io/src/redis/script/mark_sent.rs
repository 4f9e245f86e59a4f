//! `mark_sent` (`lua/seckill.lua::mark_sent`): one SKU's batch of reservations whose messages
//! the log acknowledged, marked sent and re-scored to their order deadline: the bound on a
//! batch ([`MARK_SENT_MAX`]), its arguments, the per-reservation reply codes and their parser.
//!
//! What it is not: the call. `client.rs` builds the KEYS and ARGV and sends them
//! (`Functions::mark_sent`); this file only says what goes in and what can come back.
//!
//! Read next: the contract comment above `mark_sent` in `lua/seckill.lua`, and
//! `tests/tests/lua_functions.rs` for its branches against a real Redis.

use super::error::{unexpected, ScriptError};
use super::parse::{array, text};
use crate::resp::Reply;

/// Reservations one `mark_sent` call marks at most (`MARK_SENT_MAX` in seckill.lua).
pub const MARK_SENT_MAX: usize = 256;

/// One reservation of a `mark_sent` batch: its message was acknowledged by the log.
#[derive(Debug, Clone, Copy)]
pub struct MarkSent<'a> {
    pub reservation_id: &'a str,
    pub request_id: &'a str,
    pub user_id: u64,
}

#[derive(Debug, Clone, Copy)]
pub struct MarkSentArgs<'a> {
    /// 1..=[`MARK_SENT_MAX`] reservations of the SKU.
    pub marks: &'a [MarkSent<'a>],
    pub now_ms: u64,
    /// The pending entries are re-scored to `now_ms + order_deadline_ms`: if no final outcome
    /// arrived by then, the scanner republishes.
    pub order_deadline_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkSentReply {
    Ok,
    NotFound,
    /// Already MESSAGE_SENT or final; nothing changed.
    NotPending,
}

/// Parses `mark_sent`'s reply: one code per reservation of the batch of `n`.
pub fn parse_mark_sent(reply: Reply, n: usize) -> Result<Vec<MarkSentReply>, ScriptError> {
    const F: &str = "mark_sent";
    array(F, &reply, n)?
        .iter()
        .map(|code| match text(code) {
            Some("OK") => Ok(MarkSentReply::Ok),
            Some("NOT_FOUND") => Ok(MarkSentReply::NotFound),
            Some("NOT_PENDING") => Ok(MarkSentReply::NotPending),
            _ => Err(unexpected(F, "code", code)),
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use bytes::Bytes;

    use super::super::parse::fixtures::{arr, bulk, expect_unexpected};
    use super::*;

    #[test]
    fn mark_sent_replies() {
        use MarkSentReply::{NotFound, NotPending, Ok as Marked};
        let codes = arr(vec![bulk("OK"), bulk("NOT_FOUND"), bulk("NOT_PENDING")]);
        assert_eq!(parse_mark_sent(codes, 3).unwrap(), vec![Marked, NotFound, NotPending]);
        let simple = arr(vec![Reply::Simple(Bytes::from_static(b"OK"))]);
        assert_eq!(parse_mark_sent(simple, 1).unwrap(), vec![Marked]);
        expect_unexpected(parse_mark_sent(arr(vec![bulk("ok")]), 1));
        expect_unexpected(parse_mark_sent(arr(vec![Reply::Integer(1)]), 1));
        // One code per reservation sent, never more or fewer; never a bare code.
        expect_unexpected(parse_mark_sent(arr(vec![bulk("OK")]), 2));
        expect_unexpected(parse_mark_sent(bulk("OK"), 1));
    }
}
