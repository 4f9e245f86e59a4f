//! `claim_due` (`lua/seckill.lua::claim_due`): the republish scanner's claim of a SKU's due pending
//! reservations (each one's `send_attempts` bumped and its next retry scheduled) and the move
//! of those past the recovery deadline to `resv:stuck`: the bound on a claim
//! ([`CLAIM_BATCH_MAX`]), its arguments, its reply and the parser, which bounds the counts a
//! server declares before it allocates for them.
//!
//! What it is not: the call. `client.rs` builds the KEYS and ARGV and sends them
//! (`Functions::claim_due`); this file only says what goes in and what can come back.
//! The claimed entries themselves are plain data (`layout::PendingEntry`).
//!
//! Read next: the contract comment above `claim_due` in `lua/seckill.lua`, and
//! `tests/tests/lua_functions.rs` for its branches against a real Redis.

use super::error::{unexpected, ScriptError};
use super::parse::{owned, text, uint};
use crate::redis::layout::{PendingEntry, PendingStatus};
use crate::resp::Reply;

/// Most entries one `claim_due` call may claim; the Lua side rejects more (`CLAIM_BATCH_MAX`).
pub const CLAIM_BATCH_MAX: u32 = 512;

#[derive(Debug, Clone, Copy)]
pub struct ClaimDueArgs {
    pub now_ms: u64,
    /// 1..=[`CLAIM_BATCH_MAX`].
    pub batch_max: u32,
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    /// Older reservations go to `resv:stuck` instead of being republished.
    pub recovery_deadline_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClaimDueReply {
    pub claimed: Vec<PendingEntry>,
    /// Reservation ids moved to `resv:stuck` by this call.
    pub stuck: Vec<String>,
}

/// Fields per claimed entry in a `claim_due` reply.
const CLAIM_ENTRY_FIELDS: usize = 10;

/// Parses `[claimed_count, stuck_count, 9 fields per claimed entry..., stuck ids...]`.
pub fn parse_claim_due(reply: Reply) -> Result<ClaimDueReply, ScriptError> {
    const F: &str = "claim_due";
    let bad = |what: &str| unexpected(F, what, &reply);
    let Reply::Array(items) = &reply else { return Err(bad("not an array")) };
    let (claimed_count, stuck_count) = match items.as_slice() {
        [c, s, ..] => (uint(c), uint(s)),
        _ => return Err(bad("no counts")),
    };
    let (Some(claimed_count), Some(stuck_count)) = (claimed_count, stuck_count) else {
        return Err(bad("counts"));
    };
    // Bound the counts before multiplying: a hostile count must not overflow or allocate.
    let bound = u64::from(CLAIM_BATCH_MAX);
    if claimed_count + stuck_count > bound {
        return Err(bad("more entries than batch_max allows"));
    }
    // Both counts are <= 512 here, so the casts and the arithmetic are exact.
    let (claimed_count, stuck_count) = (claimed_count as usize, stuck_count as usize);
    if items.len() != 2 + CLAIM_ENTRY_FIELDS * claimed_count + stuck_count {
        return Err(bad("length does not match counts"));
    }
    let claimed_end = 2 + CLAIM_ENTRY_FIELDS * claimed_count;
    let mut claimed = Vec::with_capacity(claimed_count);
    for fields in items[2..claimed_end].chunks_exact(CLAIM_ENTRY_FIELDS) {
        claimed.push(parse_pending_entry(fields).ok_or_else(|| bad("claimed entry"))?);
    }
    let mut stuck = Vec::with_capacity(stuck_count);
    for id in &items[claimed_end..] {
        stuck.push(owned(id).filter(|s| !s.is_empty()).ok_or_else(|| bad("stuck id"))?);
    }
    Ok(ClaimDueReply { claimed, stuck })
}

fn parse_pending_entry(f: &[Reply]) -> Option<PendingEntry> {
    let [id, message, request, user, hash, reserved_at, expires_at, attempts, status, quantity] = f
    else {
        return None;
    };
    let status = match text(status)? {
        "PENDING_MESSAGE" => PendingStatus::PendingMessage,
        "MESSAGE_SENT" => PendingStatus::MessageSent,
        _ => return None,
    };
    Some(PendingEntry {
        reservation_id: owned(id).filter(|s| !s.is_empty())?,
        message_id: owned(message).filter(|s| !s.is_empty())?,
        request_id: owned(request)?,
        user_id: uint(user)?,
        payload_hash: owned(hash)?,
        reserved_at_ms: uint(reserved_at)?,
        expires_at_ms: uint(expires_at)?,
        send_attempts: u32::try_from(uint(attempts)?).ok()?,
        status,
        quantity: u32::try_from(uint(quantity)?).ok().filter(|q| *q >= 1)?,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::parse::fixtures::{arr, bulk, expect_unexpected};
    use super::*;

    fn entry_fields(id: &str, attempts: &str, status: &str) -> Vec<Reply> {
        [id, "msg_x", "req_x", "30001", "sha256:ab", "1000", "301000", attempts, status, "2"]
            .iter()
            .map(|s| bulk(s))
            .collect()
    }

    #[test]
    fn claim_due_parses_entries_and_stuck() {
        let mut items = vec![Reply::Integer(2), Reply::Integer(1)];
        items.extend(entry_fields("resv_a", "1", "PENDING_MESSAGE"));
        items.extend(entry_fields("resv_b", "3", "MESSAGE_SENT"));
        items.push(bulk("resv_c"));
        let parsed = parse_claim_due(arr(items)).unwrap();
        assert_eq!(parsed.claimed.len(), 2);
        assert_eq!(
            parsed.claimed[0],
            PendingEntry {
                reservation_id: "resv_a".into(),
                message_id: "msg_x".into(),
                request_id: "req_x".into(),
                user_id: 30001,
                payload_hash: "sha256:ab".into(),
                reserved_at_ms: 1000,
                expires_at_ms: 301000,
                send_attempts: 1,
                status: PendingStatus::PendingMessage,
                quantity: 2,
            }
        );
        assert_eq!(parsed.claimed[1].send_attempts, 3);
        assert_eq!(parsed.claimed[1].status, PendingStatus::MessageSent);
        assert_eq!(parsed.stuck, vec!["resv_c".to_string()]);
        let empty = parse_claim_due(arr(vec![Reply::Integer(0), Reply::Integer(0)])).unwrap();
        assert_eq!(empty, ClaimDueReply::default());
    }

    #[test]
    fn claim_due_malformed() {
        expect_unexpected(parse_claim_due(Reply::Nil));
        expect_unexpected(parse_claim_due(arr(vec![Reply::Integer(0)])));
        expect_unexpected(parse_claim_due(arr(vec![Reply::Integer(-1), Reply::Integer(0)])));
        // Counts that do not match the length.
        expect_unexpected(parse_claim_due(arr(vec![Reply::Integer(1), Reply::Integer(0)])));
        expect_unexpected(parse_claim_due(arr(vec![
            Reply::Integer(0),
            Reply::Integer(0),
            bulk("extra"),
        ])));
        // Hostile counts must not overflow or allocate.
        expect_unexpected(parse_claim_due(arr(vec![
            Reply::Integer(i64::MAX),
            Reply::Integer(i64::MAX),
        ])));
        let mut bad_status = vec![Reply::Integer(1), Reply::Integer(0)];
        bad_status.extend(entry_fields("resv_a", "1", "ORDER_CREATED"));
        expect_unexpected(parse_claim_due(arr(bad_status)));
        let mut bad_number = vec![Reply::Integer(1), Reply::Integer(0)];
        bad_number.extend(entry_fields("resv_a", "x", "PENDING_MESSAGE"));
        expect_unexpected(parse_claim_due(arr(bad_number)));
        let empty_stuck = arr(vec![Reply::Integer(0), Reply::Integer(1), bulk("")]);
        expect_unexpected(parse_claim_due(empty_stuck));
    }
}
