//! What the engine's Redis holds, as plain data: the activity status stored in a SKU's
//! `meta`, the set of active SKUs and its member encoding, the records the typed reads of
//! [`super::reads`] return, and the pending entries `claim_due` hands back (CONTRACT.md
//! section 5).
//!
//! What it is not: I/O. Nothing here talks to a server, so the engine's sans-I/O decisions
//! may use these types; the key names themselves are built by `script::SkuKeys`
//! (`script/keys.rs`), and every command that reads or writes them lives in `script` (the
//! functions) or `reads`. This file imports nothing from either: they build these values,
//! never the other way round.

use std::fmt;

/// A plain Redis SET of `activity:sku` members: every SKU ever preheated. Outside any SKU's
/// hash slot on purpose: every shard of every instance reads it to find the SKUs it owns, and
/// only activity creation writes it.
pub const ACTIVE_SKUS_KEY: &str = "seckill:active-skus";

/// Status of an activity as `meta.status` holds it (CONTRACT.md section 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivityStatus {
    Pending,
    Active,
    Ended,
    Terminated,
}

impl ActivityStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ActivityStatus::Pending => "PENDING",
            ActivityStatus::Active => "ACTIVE",
            ActivityStatus::Ended => "ENDED",
            ActivityStatus::Terminated => "TERMINATED",
        }
    }

    pub fn parse(text: &str) -> Option<ActivityStatus> {
        Some(match text {
            "PENDING" => ActivityStatus::Pending,
            "ACTIVE" => ActivityStatus::Active,
            "ENDED" => ActivityStatus::Ended,
            "TERMINATED" => ActivityStatus::Terminated,
            _ => return None,
        })
    }
}

/// One member of [`ACTIVE_SKUS_KEY`]: `activity_id:sku_id` in decimal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SkuMember {
    pub activity_id: u64,
    pub sku_id: u64,
}

impl SkuMember {
    /// A member as the set holds it; `None` for anything else (a stranger's member is skipped,
    /// never guessed at).
    pub fn parse(text: &str) -> Option<SkuMember> {
        let (a, s) = text.split_once(':')?;
        let canonical = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        if !canonical(a) || !canonical(s) {
            return None;
        }
        Some(SkuMember { activity_id: a.parse().ok()?, sku_id: s.parse().ok()? })
    }
}

impl fmt::Display for SkuMember {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.activity_id, self.sku_id)
    }
}

/// A SKU's `meta` hash, when every field is present and well-formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaRecord {
    pub status: ActivityStatus,
    pub start_ms: u64,
    pub end_ms: u64,
    pub version: u64,
    pub reservation_ttl_ms: u64,
}

/// A request's `req` hash as a query reads it (absent fields are `None`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestRecord {
    /// `QUEUED_PENDING`, `QUEUED`, `SUCCEEDED`, `FAILED`.
    pub state: String,
    pub reservation_id: Option<String>,
    pub order_id: Option<String>,
    pub reason_code: Option<String>,
    pub user_id: Option<u64>,
}

/// What a replay of a request needs from its `req` hash (`reserve`'s `IDEMPOTENT` fields):
/// loaded into an instance's replay map after sell-out.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReplayRecord {
    pub payload_hash: String,
    pub reservation_id: String,
    pub message_id: String,
    /// `QUEUED_PENDING`, `QUEUED`, `SUCCEEDED`, `FAILED`.
    pub state: String,
}

/// What a submit to a sold-out SKU needs while the instance's replay map is not loaded
/// ([`crate::redis::script::Functions::sold_out_reads`]): the request's replay fields, the
/// activity's status and limit per buyer from `meta`, and the buyer's marker.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SoldOutReads {
    pub replay: Option<ReplayRecord>,
    /// `meta`'s `status` as stored (`None`: no `meta`, the SKU's keys are gone).
    pub status: Option<String>,
    pub max_per_buyer: Option<u64>,
    /// The reservation id the buyer's marker holds.
    pub marker: Option<String>,
}

/// The sizes that a reservation or an outcome moves: `stock`, `resv:pending`, `resv:stuck`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SkuCounters {
    /// `None` when the key is missing or not a number.
    pub stock: Option<i64>,
    pub pending: u64,
    pub stuck: u64,
}

/// The `flashsale_reservations_pending` sample of one SKU: how many are pending, and when the
/// most overdue one (lowest score: scores are next-retry times) was reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PendingSample {
    pub pending: u64,
    pub most_overdue_reserved_at_ms: Option<u64>,
}

/// One reservation as reconcile reads it: its memberships first, then its hash (the order of
/// the reads is the contract, see the reconcile module of the engine).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReservationRecord {
    pub status: Option<String>,
    pub user_id: Option<u64>,
    pub reserved_at_ms: Option<u64>,
    pub order_id: Option<String>,
    /// The units it holds (`None`: a record written before quantities, which held one).
    pub quantity: Option<u32>,
    pub in_pending: bool,
    pub in_stuck: bool,
}

/// The reservation status values a claimed (non-final) entry can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PendingStatus {
    PendingMessage,
    MessageSent,
}

/// A pending reservation with every field its order-create message is rebuilt from: what
/// `claim_due` hands back for a due one (its `send_attempts` already bumped), and the entry of
/// a stuck one as [`StuckEntry`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingEntry {
    pub reservation_id: String,
    pub message_id: String,
    pub request_id: String,
    pub user_id: u64,
    pub payload_hash: String,
    pub reserved_at_ms: u64,
    pub expires_at_ms: u64,
    pub send_attempts: u32,
    pub status: PendingStatus,
    /// The units reserved (1 for a record written before quantities).
    pub quantity: u32,
}

/// One member of a SKU's `resv:stuck` as the admin plane lists it: when it got stuck, why,
/// and (when its record still holds every field a message needs) the pending entry an
/// operator's republish or compensation rebuilds the order-create message from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StuckEntry {
    pub reservation_id: String,
    pub stuck_at_ms: u64,
    /// `resv.status` as written (`None`: the record is gone).
    pub status: Option<String>,
    /// `RECOVERY_DEADLINE` or `INVALID_RECORD` (`lua/seckill.lua`, `claim_due`).
    pub last_error_code: Option<String>,
    /// `None`: a field is missing or malformed, or the status is final or not republishable.
    pub entry: Option<PendingEntry>,
}

/// What one `SCAN` page of a SKU's keys held, sorted by kind (only the ids; counts of the
/// kinds reconcile only counts).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KeyPage {
    /// `0` when the scan is complete.
    pub next_cursor: u64,
    pub reservation_ids: Vec<String>,
    pub compensation_ids: Vec<String>,
    /// The `user:` marker suffixes (user ids) and `req:` suffixes (`user:request`) seen.
    pub user_markers: Vec<String>,
    pub request_records: Vec<String>,
}

/// The flags reconcile reports beside the counts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SkuFlags {
    pub meta_status: Option<String>,
    pub soldout: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_round_trip_and_strangers_are_skipped() {
        let member = SkuMember { activity_id: 10001, sku_id: 20001 };
        assert_eq!(member.to_string(), "10001:20001");
        assert_eq!(SkuMember::parse("10001:20001"), Some(member));
        for bad in ["", "1", "1:", ":1", "1:x", "+1:2", "1:2:3", "1 :2"] {
            assert_eq!(SkuMember::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn statuses_round_trip() {
        for status in [
            ActivityStatus::Pending,
            ActivityStatus::Active,
            ActivityStatus::Ended,
            ActivityStatus::Terminated,
        ] {
            assert_eq!(ActivityStatus::parse(status.as_str()), Some(status));
        }
        assert_eq!(ActivityStatus::parse("active"), None);
    }
}
