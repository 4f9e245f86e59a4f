//! Degradation modes (DESIGN.md section 7, seed chapter 9 §6.9 and §8.1): what an operator
//! (or the control plane) may switch submissions to, as signed, versioned, scoped, expiring
//! snapshots, and the table every instance keeps of the snapshots it accepted.
//!
//! What it is:
//! - [`Mode`]: `NORMAL`, `SHED_LOAD` (admit a share), `SUBMIT_CLOSED`, `QUERY_ONLY`,
//!   `RECOVERING` (admit a share, raised in steps); [`Mode::metric_value`] for the gauge.
//! - [`ModeSnapshot`] with its [`Scope`] (global, activity, SKU), its canonical text
//!   ([`ModeSnapshot::canonical_text`]) and [`SignedSnapshot`] (HMAC-SHA256 over that text
//!   with `FLASHSALE_CONTROL_KEY`, an [`HmacKey`] read by [`control_key`]); [`sign`] and
//!   [`verify`].
//! - [`ModeTable`]: the accepted snapshot per scope, [`ModeTable::apply`] (the rules below),
//!   [`ModeTable::effective`] (the mode a submit for one SKU obeys, read by
//!   `admission::decide_submit`) and persistence ([`ModeTable::to_persisted`] /
//!   [`ModeTable::from_persisted`]).
//!
//! Rules, each with its reason:
//! - **Signed, one spelling.** The MAC covers `"flashsale-mode-v1\n"` + the canonical text:
//!   compact JSON with a fixed field order, ids as plain decimals, the issuer restricted to
//!   `[A-Za-z0-9_.@:-]` (no escapes, so no second spelling of the same string). The signature
//!   is exactly 64 lowercase hex digits (`A` and `a` would otherwise decode alike, making a
//!   changed signature text verify). So every single-byte change of the signed text or of the
//!   signature fails (a property test checks it). The comparison is constant-time (`hmac`'s
//!   `verify_slice`). The envelope (`{"snapshot":{..},"sig_hex":".."}`) may be spelled freely:
//!   the MAC is recomputed over the canonical text of what was parsed.
//! - **Checks in this order:** well-formed ([`ModeError::Malformed`]), signature
//!   ([`ModeError::BadSignature`]), expiry ([`ModeError::Expired`], at `expires_at_ms` itself it
//!   has expired), version, transition. The signature comes before the expiry so that the
//!   `Expired` label only ever counts genuine snapshots.
//! - **Versions strictly increase per scope**: an older or equal version is
//!   [`ModeError::StaleVersion`], whatever the order in which replicated snapshots arrive.
//! - **QUERY_ONLY never jumps to NORMAL** ([`ModeError::MustRecover`]; seed: 禁止从 QUERY_ONLY
//!   直接跳回 NORMAL, 从故障模式恢复时必须先灰度). Entering QUERY_ONLY sets a per-scope
//!   "recovery required" flag that only NORMAL reached from `RECOVERING 100` clears. While it
//!   is set: closing modes are always allowed, `SHED_LOAD` is refused (`MustRecover`), and
//!   `RECOVERING` starts from 0 % (also after falling back to `SUBMIT_CLOSED` mid-ramp: a
//!   rollback restarts the ramp). Without the flag, `QUERY_ONLY → SUBMIT_CLOSED → NORMAL`
//!   would be a two-step way around the rule.
//! - **RECOVERING rises in steps**: from `RECOVERING p`, at most `p + step`
//!   ([`ModeConfig::recovering_step_percent_max`], default 25 —
//!   [`ModeError::StepTooLarge`]); lowering is always allowed (closing is always safe).
//!   NORMAL is allowed from `RECOVERING 100` or from any mode other than RECOVERING and
//!   QUERY_ONLY while no recovery is required.
//! - **Effective mode = the most restrictive applicable scope.** A submit for (activity, SKU)
//!   obeys the global, activity and SKU entries together: the one admitting the smallest
//!   share wins (closing beats sharing beats NORMAL). An EXPIRED or unverifiable entry counts
//!   as `SUBMIT_CLOSED` with that reason (seed: 安全 TTL 过期后进入 SUBMIT_CLOSED). Deliberate
//!   deviation from "most specific wins": a global QUERY_ONLY must close the hot SKU even if
//!   that SKU still holds an older SKU-level NORMAL or SHED_LOAD, and a SKU must not be
//!   fully open while its global scope is still ramping in RECOVERING (that would be the
//!   QUERY_ONLY → NORMAL jump again, one scope down). Narrower scopes can therefore only
//!   close more; to let one SKU ahead of the rest, close the rest at their own scopes.
//! - **No snapshot ever = NORMAL.** A fresh deployment without a control plane must sell.
//!   Once a scope has held a snapshot, it keeps its last one (expired or not) until a higher
//!   version replaces it: the control plane must re-issue (refresh) every scope it created
//!   before it expires, or that scope closes. There is no "delete".
//! - **Persistence.** The last accepted snapshot per scope (hence its highest version) and the
//!   recovery flag are written by [`ModeTable::to_persisted`]; [`ModeTable::from_persisted`]
//!   re-verifies every signature (not the expiry: an expired snapshot still closes its scope
//!   and still fixes its version). An entry that fails verification (tampered file, rotated
//!   key) becomes an *unverifiable* marker: its scope is closed until a valid snapshot with a
//!   higher version than the (untrusted) one recorded arrives. An unreadable file: use
//!   [`ModeTable::fail_closed`] (everything closed until a valid global snapshot arrives,
//!   from which the recovery ramp applies). If the state is lost altogether (file deleted),
//!   an older snapshot could be replayed; its expiry bounds how long that matters.
//! - **Bounds:** at most [`ModeConfig::scopes_max`] scopes ([`ModeError::TableFull`]), the
//!   issuer ≤ [`ISSUER_LEN_MAX`], a signed envelope ≤ [`SIGNED_JSON_LEN_MAX`] bytes, a key of
//!   `logic::key`'s 16..=64 bytes.
//!
//! Files: `snapshot.rs` (signing, one spelling), `table.rs` (the rules, the effective mode),
//! `persist.rs` (the persisted text), `tests.rs`.
//!
//! What it is not: the transport (the JetStream KV watcher in `durable/control.rs`, `POST
//! /admin/v1/mode`), the file I/O of persistence, or the admission decision itself
//! (`admission.rs`). No I/O, no clock (`now_ms` is an argument), no runtime.
//!
//! Read next: `admission.rs` (how the effective mode and the dependency health become a
//! submit decision), `circuit.rs`.

use std::fmt;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::logic::key::{HmacKey, KeyError};
/// Longest issuer name.
pub const ISSUER_LEN_MAX: usize = 64;
/// Longest canonical snapshot text: the fixed field names (~110 bytes), six decimals of at
/// most 20 digits, the longest mode name and the issuer; 512 leaves room.
pub const SNAPSHOT_TEXT_LEN_MAX: usize = 512;
/// Longest signed envelope accepted by [`SignedSnapshot::from_json`] (also a fit for the admin
/// body limit): the snapshot, 64 hex digits and whitespace a human may add.
pub const SIGNED_JSON_LEN_MAX: usize = 4096;
/// Bytes of persisted text allowed per scope (an entry is a signed envelope plus its scope,
/// version and flag).
const PERSISTED_ENTRY_LEN_MAX: usize = SIGNED_JSON_LEN_MAX + 256;
/// Version of the persisted format.
const PERSISTED_FORMAT: u32 = 1;
/// Domain separation: a MAC made for something else with the same key never verifies here.
const MAC_DOMAIN: &[u8] = b"flashsale-mode-v1\n";
/// Hex digits of an HMAC-SHA256 tag.
const SIG_HEX_LEN: usize = 64;

const _: () = assert!(SNAPSHOT_TEXT_LEN_MAX + SIG_HEX_LEN + 32 <= SIGNED_JSON_LEN_MAX);
const _: () = assert!(ISSUER_LEN_MAX + 200 <= SNAPSHOT_TEXT_LEN_MAX);

// ---------------------------------------------------------------------------------------------
// Modes and scopes
// ---------------------------------------------------------------------------------------------

/// A degradation mode (seed chapter 9 §6.9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Submissions open.
    Normal,
    /// Admit `admit_percent` % of submissions (raised limits during overload).
    ShedLoad { admit_percent: u8 },
    /// No new reservations; existing messages, queries and payments continue.
    SubmitClosed,
    /// Only queries, payment confirmation and operations.
    QueryOnly,
    /// Re-opening after a closure: admit `admit_percent` %, raised in steps.
    Recovering { admit_percent: u8 },
}

impl Mode {
    /// The name used in snapshots, logs and the admin API.
    pub const fn name(self) -> &'static str {
        match self {
            Mode::Normal => "NORMAL",
            Mode::ShedLoad { .. } => "SHED_LOAD",
            Mode::SubmitClosed => "SUBMIT_CLOSED",
            Mode::QueryOnly => "QUERY_ONLY",
            Mode::Recovering { .. } => "RECOVERING",
        }
    }

    /// The share of submissions this mode admits, in percent.
    pub const fn admit_percent(self) -> u8 {
        match self {
            Mode::Normal => 100,
            Mode::ShedLoad { admit_percent } | Mode::Recovering { admit_percent } => admit_percent,
            Mode::SubmitClosed | Mode::QueryOnly => 0,
        }
    }

    /// The value of the `flashsale_mode` gauge: higher is more closed, so the maximum over
    /// instances or SKUs is the worst one. NORMAL 0, SHED_LOAD 1, RECOVERING 2,
    /// SUBMIT_CLOSED 3, QUERY_ONLY 4.
    pub const fn metric_value(self) -> u8 {
        match self {
            Mode::Normal => 0,
            Mode::ShedLoad { .. } => 1,
            Mode::Recovering { .. } => 2,
            Mode::SubmitClosed => 3,
            Mode::QueryOnly => 4,
        }
    }

    /// Whether this mode refuses every new submission.
    pub const fn closes_submissions(self) -> bool {
        matches!(self, Mode::SubmitClosed | Mode::QueryOnly)
    }

    fn percent_field(self) -> Option<u8> {
        match self {
            Mode::ShedLoad { admit_percent } | Mode::Recovering { admit_percent } => {
                Some(admit_percent)
            }
            _ => None,
        }
    }

    /// A mode from its name and, for SHED_LOAD / RECOVERING only, its share (the snapshot's
    /// `mode` and `admit_percent` fields; the admin CLI's flags).
    pub fn from_parts(name: &str, percent: Option<u8>) -> Result<Mode, ModeError> {
        let mode = match (name, percent) {
            ("NORMAL", None) => Mode::Normal,
            ("SUBMIT_CLOSED", None) => Mode::SubmitClosed,
            ("QUERY_ONLY", None) => Mode::QueryOnly,
            ("SHED_LOAD", Some(admit_percent)) => Mode::ShedLoad { admit_percent },
            ("RECOVERING", Some(admit_percent)) => Mode::Recovering { admit_percent },
            ("SHED_LOAD" | "RECOVERING", None) => {
                return Err(ModeError::Malformed("admit_percent required"))
            }
            ("NORMAL" | "SUBMIT_CLOSED" | "QUERY_ONLY", Some(_)) => {
                return Err(ModeError::Malformed("admit_percent not allowed"))
            }
            _ => return Err(ModeError::Malformed("unknown mode")),
        };
        if mode.admit_percent() > 100 {
            return Err(ModeError::Malformed("admit_percent over 100"));
        }
        Ok(mode)
    }
}

/// Which submissions a snapshot governs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    Global,
    /// Every SKU of one activity.
    Activity(u64),
    /// One SKU of one activity: `(activity_id, sku_id)`.
    Sku(u64, u64),
}

impl Scope {
    /// `"global"`, `"activity:<a>"` or `"sku:<a>:<s>"` (decimals without sign or leading zeros).
    pub fn parse(text: &str) -> Option<Scope> {
        if text == "global" {
            return Some(Scope::Global);
        }
        if let Some(rest) = text.strip_prefix("activity:") {
            return canonical_u64(rest).map(Scope::Activity);
        }
        let rest = text.strip_prefix("sku:")?;
        let (activity, sku) = rest.split_once(':')?;
        Some(Scope::Sku(canonical_u64(activity)?, canonical_u64(sku)?))
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scope::Global => f.write_str("global"),
            Scope::Activity(a) => write!(f, "activity:{a}"),
            Scope::Sku(a, s) => write!(f, "sku:{a}:{s}"),
        }
    }
}

/// A decimal u64 in its one spelling: digits only, no leading zero (except "0" itself).
fn canonical_u64(text: &str) -> Option<u64> {
    let bytes = text.as_bytes();
    let well_formed = !bytes.is_empty()
        && bytes.len() <= 20
        && bytes.iter().all(u8::is_ascii_digit)
        && (bytes[0] != b'0' || bytes.len() == 1);
    if !well_formed {
        return None;
    }
    text.parse().ok()
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Why a snapshot (or a key, or a persisted state) was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModeError {
    /// Not a well-formed snapshot / envelope / persisted state; says which part.
    Malformed(&'static str),
    /// The signature does not match (forged, altered, or signed with another key).
    BadSignature,
    /// Genuine but past `expires_at_ms`.
    Expired,
    /// The scope already holds this version or a newer one.
    StaleVersion { scope: Scope, current: u64, offered: u64 },
    /// An operator's snapshot jumps more than `MODE_VERSION_STEP_MAX` above the scope's
    /// current version (a typo of a few digits would otherwise take every version above it).
    VersionJump { scope: Scope, current: u64, offered: u64, step_max: u64 },
    /// Leaving QUERY_ONLY (or a recovery in progress) other than through RECOVERING.
    MustRecover { scope: Scope, from: Mode, to: Mode },
    /// RECOVERING raised by more than the configured step (or NORMAL before 100 %).
    StepTooLarge { scope: Scope, from_percent: u8, to_percent: u8, step_max: u8 },
    /// A new scope while [`ModeConfig::scopes_max`] scopes are held.
    TableFull { scopes_max: usize },
    /// `FLASHSALE_CONTROL_KEY` unusable.
    BadKey(KeyError),
}

impl ModeError {
    /// A short stable label (metrics, the admin API's `reason_code`).
    pub const fn label(&self) -> &'static str {
        match self {
            ModeError::Malformed(_) => "MALFORMED",
            ModeError::BadSignature => "BAD_SIGNATURE",
            ModeError::Expired => "EXPIRED",
            ModeError::StaleVersion { .. } => "STALE_VERSION",
            ModeError::VersionJump { .. } => "VERSION_JUMP",
            ModeError::MustRecover { .. } => "MUST_RECOVER",
            ModeError::StepTooLarge { .. } => "STEP_TOO_LARGE",
            ModeError::TableFull { .. } => "TABLE_FULL",
            ModeError::BadKey(_) => "BAD_KEY",
        }
    }
}

impl fmt::Display for ModeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModeError::Malformed(what) => write!(f, "malformed mode snapshot: {what}"),
            ModeError::BadSignature => f.write_str("mode snapshot signature does not verify"),
            ModeError::Expired => f.write_str("mode snapshot expired"),
            ModeError::StaleVersion { scope, current, offered } => {
                write!(f, "{scope}: version {offered} is not above the current {current}")
            }
            ModeError::VersionJump { scope, current, offered, step_max } => write!(
                f,
                "{scope}: version {offered} jumps more than {step_max} above the current {current}"
            ),
            ModeError::MustRecover { scope, from, to } => write!(
                f,
                "{scope}: {} -> {} refused; leave QUERY_ONLY through RECOVERING steps",
                from.name(),
                to.name()
            ),
            ModeError::StepTooLarge { scope, from_percent, to_percent, step_max } => write!(
                f,
                "{scope}: RECOVERING {from_percent}% -> {to_percent}% exceeds the step of \
                 {step_max}%"
            ),
            ModeError::TableFull { scopes_max } => {
                write!(f, "mode table full ({scopes_max} scopes)")
            }
            ModeError::BadKey(why) => write!(f, "FLASHSALE_CONTROL_KEY: {why}"),
        }
    }
}

impl std::error::Error for ModeError {}

mod persist;
mod snapshot;
mod table;
#[cfg(test)]
mod tests;

pub use snapshot::{control_key, sign, verify, ModeSnapshot, SignedSnapshot};
pub use table::{Applied, EffectiveMode, ModeConfig, ModeSource, ModeTable};
