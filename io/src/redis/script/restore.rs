//! `restore` (`lua/seckill.lua::restore`): a SKU Redis lost rebuilt from PostgreSQL, step by
//! step under one lock: its steps, its replies and their parser.
//!
//! What it is not: the call (`client.rs`, `Functions::restore`) or the rebuild's order of
//! steps (the engine's `shard/failover.rs`, from `logic::rebuild`'s plan).
//!
//! Read next: the contract comment above `restore` in `lua/seckill.lua`, and
//! `tests/tests/lua_functions.rs` for its branches against a real Redis.

use super::error::{unexpected, ScriptError};
use super::parse::{array, text};
use crate::redis::layout::ActivityStatus;
use crate::resp::Reply;

/// One reservation as `reserve` wrote it, rebuilt from PostgreSQL's row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreReservation<'a> {
    pub request_id: &'a str,
    pub user_id: u64,
    pub payload_hash: &'a str,
    pub reservation_id: &'a str,
    pub message_id: &'a str,
    pub reserved_at_ms: u64,
    pub expires_at_ms: u64,
    /// Its `resv:pending` score (when the scanner may republish it if no outcome arrives).
    pub next_retry_at_ms: u64,
    /// Its units.
    pub quantity: u32,
}

/// The SKU's `meta`, written last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreMeta {
    pub status: ActivityStatus,
    pub start_ms: u64,
    pub end_ms: u64,
    pub version: u64,
    pub reservation_ttl_ms: u64,
    pub max_per_buyer: u32,
}

/// Who holds a rebuild's lock, and for how long each step renews it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreLock<'a> {
    /// The rebuilder's own token (`[A-Za-z0-9_-]`, at most `ID_LEN_MAX`).
    pub token: &'a str,
    pub ttl_ms: u64,
}

/// One step of a rebuild (the modes of `restore`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreStep<'a> {
    /// Take the lock, clear pending/stuck/soldout, set the stock to PostgreSQL's total.
    Begin {
        stock: u64,
    },
    /// Delete these keys of the SKU (what the lost Redis was left with: resv:, req:, user:,
    /// comp: keys), at most a page at a time.
    Wipe {
        keys: &'a [String],
    },
    Reservation(RestoreReservation<'a>),
    /// Write meta (a stock the replay left below zero set to 0, soldout set when 0) and let go
    /// of the lock: the SKU is whole again.
    Finish(RestoreMeta),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoreReply {
    /// Done; the stock after the step.
    Ok { stock: i64 },
    /// Meta exists: the SKU is whole (nothing changed).
    Live,
    /// Another rebuilder holds the lock, or this one lost it (nothing changed).
    Busy,
}

pub fn parse_restore(reply: Reply) -> Result<RestoreReply, ScriptError> {
    const F: &str = "restore";
    let items = array(F, &reply, 2)?;
    match (text(&items[0]), items[1].as_int()) {
        (Some("OK"), Some(stock)) => Ok(RestoreReply::Ok { stock }),
        (Some("LIVE"), Some(_)) => Ok(RestoreReply::Live),
        (Some("BUSY"), Some(_)) => Ok(RestoreReply::Busy),
        _ => Err(unexpected(F, "code or stock", &reply)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::parse::fixtures::{arr, bulk};
    use super::*;

    fn reply(code: &str, stock: i64) -> Reply {
        arr(vec![bulk(code), Reply::Integer(stock)])
    }

    #[test]
    fn every_code_parses_and_strangers_are_errors() {
        assert_eq!(parse_restore(reply("OK", 7)).unwrap(), RestoreReply::Ok { stock: 7 });
        assert_eq!(parse_restore(reply("LIVE", 0)).unwrap(), RestoreReply::Live);
        assert_eq!(parse_restore(reply("BUSY", 0)).unwrap(), RestoreReply::Busy);
        assert!(parse_restore(reply("MAYBE", 0)).is_err());
        assert!(parse_restore(Reply::Integer(1)).is_err());
    }
}
