//! `preheat` (`lua/seckill.lua::preheat`): a SKU's activity meta (status, window, version,
//! reservation TTL) installed by version, and its initial stock written once: its arguments,
//! its replies and their parser.
//!
//! What it is not: the call. `client.rs` builds the KEYS and ARGV and sends them
//! (`Functions::preheat`); this file only says what goes in and what can come back.
//!
//! Read next: the contract comment above `preheat` in `lua/seckill.lua`, and
//! `tests/tests/lua_functions.rs` for its branches against a real Redis.

use super::error::{unexpected, ScriptError};
use super::parse::{array, text, uint};
use crate::redis::layout::ActivityStatus;
use crate::resp::Reply;

#[derive(Debug, Clone, Copy)]
pub struct PreheatArgs {
    pub status: ActivityStatus,
    pub start_ms: u64,
    pub end_ms: u64,
    pub version: u64,
    pub reservation_ttl_ms: u64,
    /// Initial stock; written only if the SKU has no stock key yet.
    pub stock: u64,
    /// Units one buyer may take in his one order (`meta.max_per_buyer`).
    pub max_per_buyer: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreheatReply {
    Applied {
        version: u64,
    },
    /// The stored version is >= ours (equal: already installed); nothing changed.
    Stale {
        current_version: u64,
    },
}

/// Parses `[code, version]`.
pub fn parse_preheat(reply: Reply) -> Result<PreheatReply, ScriptError> {
    const F: &str = "preheat";
    let items = array(F, &reply, 2)?;
    let version = uint(&items[1]);
    match (text(&items[0]), version) {
        (Some("APPLIED"), Some(version)) => Ok(PreheatReply::Applied { version }),
        (Some("STALE"), Some(current_version)) => Ok(PreheatReply::Stale { current_version }),
        _ => Err(unexpected(F, "code or version", &reply)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use bytes::Bytes;

    use super::super::parse::fixtures::{arr, bulk, expect_unexpected};
    use super::*;

    #[test]
    fn preheat_replies() {
        let r = |code, n| arr(vec![bulk(code), Reply::Integer(n)]);
        assert_eq!(parse_preheat(r("APPLIED", 3)).unwrap(), PreheatReply::Applied { version: 3 });
        assert_eq!(
            parse_preheat(r("STALE", 4)).unwrap(),
            PreheatReply::Stale { current_version: 4 }
        );
        expect_unexpected(parse_preheat(r("STALE", -4)));
        expect_unexpected(parse_preheat(arr(vec![bulk("APPLIED"), Reply::Nil])));
        expect_unexpected(parse_preheat(Reply::Error(Bytes::from_static(b"ERR x"))));
    }
}
