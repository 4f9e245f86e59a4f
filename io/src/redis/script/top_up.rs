//! `top_up` (`lua/seckill.lua::top_up`): the units of one PostgreSQL top-up added to a SKU's Redis
//! stock, once per version: its arguments, its replies and their parser.
//!
//! What it is not: the call. `client.rs` builds the KEYS and ARGV and sends them
//! (`Functions::top_up`); this file only says what goes in and what can come back.
//!
//! Read next: the contract comment above `top_up` in `lua/seckill.lua`, and
//! `tests/tests/lua_functions.rs` for its branches against a real Redis.

use super::error::{unexpected, ScriptError};
use super::parse::{array, text};
use crate::resp::Reply;

/// `top_up`: the units of one PostgreSQL top-up (`version` = the SKU's version after it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopUpArgs {
    pub add: u64,
    pub version: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopUpReply {
    /// Stock raised; the stock after it.
    Applied { stock_after: i64 },
    /// This version was applied before: nothing changed.
    Already { stock: i64 },
    /// The SKU was never preheated: nothing changed.
    NoMeta,
}

pub fn parse_top_up(reply: Reply) -> Result<TopUpReply, ScriptError> {
    const F: &str = "top_up";
    let items = array(F, &reply, 2)?;
    let stock = items[1].as_int();
    match (text(&items[0]), stock) {
        (Some("APPLIED"), Some(stock_after)) => Ok(TopUpReply::Applied { stock_after }),
        (Some("ALREADY"), Some(stock)) => Ok(TopUpReply::Already { stock }),
        (Some("NO_META"), Some(_)) => Ok(TopUpReply::NoMeta),
        _ => Err(unexpected(F, "code or stock", &reply)),
    }
}
