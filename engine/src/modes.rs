//! Degradation modes (DESIGN.md section 7, seed chapter 9 §6.9 and §8.1): what an operator
//! (or the control plane) may switch submissions to, as signed, versioned, scoped, expiring
//! snapshots, and the table every instance keeps of the snapshots it accepted.
//!
//! What it is:
//! - [`Mode`]: `NORMAL`, `SHED_LOAD` (admit a share), `SUBMIT_CLOSED`, `QUERY_ONLY`,
//!   `RECOVERING` (admit a share, raised in steps); [`Mode::metric_value`] for the gauge.
//! - [`ModeSnapshot`] with its [`Scope`] (global, activity, SKU), its canonical text
//!   ([`ModeSnapshot::canonical_text`]) and [`SignedSnapshot`] (HMAC-SHA256 over that text
//!   with `FLASHSALE_CONTROL_KEY`, [`ControlKey`]); [`sign`] and [`verify`].
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
//!   [`CONTROL_KEY_LEN_MIN`]..=[`CONTROL_KEY_LEN_MAX`] bytes.
//!
//! What it is not: the transport (the lead's JetStream KV watcher and `POST /admin/v1/mode`),
//! the file I/O of persistence, or the admission decision itself (`admission.rs`). No I/O, no
//! clock (`now_ms` is an argument), no runtime.
//!
//! Read next: `admission.rs` (how the effective mode and the dependency health become a
//! submit decision), `circuit.rs`.

use std::collections::HashMap;
use std::fmt;
use std::fmt::Write as _;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Shortest control key: 128 bits.
pub const CONTROL_KEY_LEN_MIN: usize = 16;
/// Longest control key: one SHA-256 block (HMAC would hash a longer key down anyway).
pub const CONTROL_KEY_LEN_MAX: usize = 64;
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
// Snapshots
// ---------------------------------------------------------------------------------------------

/// One control decision: from `issued_at_ms` until `expires_at_ms` (exclusive), `scope` is in
/// `mode`; `version` orders the decisions of one scope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SnapshotWire", into = "SnapshotWire")]
pub struct ModeSnapshot {
    /// ≥ 1, strictly increasing per scope.
    pub version: u64,
    pub scope: Scope,
    pub mode: Mode,
    pub issued_at_ms: u64,
    /// Exclusive; must be after `issued_at_ms`.
    pub expires_at_ms: u64,
    /// Who issued it (an operator or the control plane), `[A-Za-z0-9_.@:-]{1,64}`.
    pub issuer: String,
}

/// The JSON shape of a snapshot (field order = the canonical order).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotWire {
    version: u64,
    scope: String,
    mode: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    admit_percent: Option<u8>,
    issued_at_ms: u64,
    expires_at_ms: u64,
    issuer: String,
}

impl TryFrom<SnapshotWire> for ModeSnapshot {
    type Error = ModeError;

    fn try_from(wire: SnapshotWire) -> Result<ModeSnapshot, ModeError> {
        let snapshot = ModeSnapshot {
            version: wire.version,
            scope: Scope::parse(&wire.scope).ok_or(ModeError::Malformed("scope"))?,
            mode: Mode::from_parts(&wire.mode, wire.admit_percent)?,
            issued_at_ms: wire.issued_at_ms,
            expires_at_ms: wire.expires_at_ms,
            issuer: wire.issuer,
        };
        snapshot.validate()?;
        Ok(snapshot)
    }
}

impl From<ModeSnapshot> for SnapshotWire {
    fn from(s: ModeSnapshot) -> SnapshotWire {
        SnapshotWire {
            version: s.version,
            scope: s.scope.to_string(),
            mode: s.mode.name().to_owned(),
            admit_percent: s.mode.percent_field(),
            issued_at_ms: s.issued_at_ms,
            expires_at_ms: s.expires_at_ms,
            issuer: s.issuer,
        }
    }
}

impl ModeSnapshot {
    /// The field rules a struct built in code may break (parsed ones are checked on parse).
    pub fn validate(&self) -> Result<(), ModeError> {
        if self.version == 0 {
            return Err(ModeError::Malformed("version must be at least 1"));
        }
        if self.mode.admit_percent() > 100 {
            return Err(ModeError::Malformed("admit_percent over 100"));
        }
        if self.expires_at_ms <= self.issued_at_ms {
            return Err(ModeError::Malformed("expires_at_ms must be after issued_at_ms"));
        }
        let issuer_ok = !self.issuer.is_empty()
            && self.issuer.len() <= ISSUER_LEN_MAX
            && self.issuer.bytes().all(|b| {
                b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'@' | b':' | b'-')
            });
        if !issuer_ok {
            return Err(ModeError::Malformed("issuer"));
        }
        Ok(())
    }

    /// The text the signature covers: compact JSON, fields in a fixed order, `admit_percent`
    /// only for SHED_LOAD and RECOVERING. Written by hand (not through serde) so that its
    /// spelling is fixed here, in one place, whatever a JSON library version does.
    pub fn canonical_text(&self) -> Result<String, ModeError> {
        self.validate()?;
        let mut out = String::with_capacity(SNAPSHOT_TEXT_LEN_MAX / 2);
        // Writing into a String cannot fail.
        let _ = write!(
            out,
            "{{\"version\":{},\"scope\":\"{}\",\"mode\":\"{}\"",
            self.version,
            self.scope,
            self.mode.name()
        );
        if let Some(percent) = self.mode.percent_field() {
            let _ = write!(out, ",\"admit_percent\":{percent}");
        }
        let _ = write!(
            out,
            ",\"issued_at_ms\":{},\"expires_at_ms\":{},\"issuer\":\"{}\"}}",
            self.issued_at_ms, self.expires_at_ms, self.issuer
        );
        debug_assert!(out.len() <= SNAPSHOT_TEXT_LEN_MAX);
        Ok(out)
    }

    /// Parses a canonical text and refuses any other spelling of it.
    pub fn from_canonical_text(text: &str) -> Result<ModeSnapshot, ModeError> {
        if text.len() > SNAPSHOT_TEXT_LEN_MAX {
            return Err(ModeError::Malformed("snapshot too long"));
        }
        let wire: SnapshotWire =
            serde_json::from_str(text).map_err(|_| ModeError::Malformed("snapshot json"))?;
        let snapshot = ModeSnapshot::try_from(wire)?;
        if snapshot.canonical_text()? != text {
            return Err(ModeError::Malformed("snapshot not in canonical form"));
        }
        Ok(snapshot)
    }

    /// Whether the snapshot has expired at `now_ms`.
    pub fn is_expired(&self, now_ms: u64) -> bool {
        now_ms >= self.expires_at_ms
    }
}

/// A snapshot and its signature, as sent to `POST /admin/v1/mode`, replicated to every
/// instance and persisted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignedSnapshot {
    pub snapshot: ModeSnapshot,
    /// HMAC-SHA256 of the domain prefix and the canonical text: 64 lowercase hex digits.
    pub sig_hex: String,
}

impl SignedSnapshot {
    /// `{"snapshot":{...},"sig_hex":"..."}`, compact.
    pub fn to_json(&self) -> String {
        // Only integers and plain strings: serializing cannot fail.
        serde_json::to_string(self).expect("a signed snapshot always serializes")
    }

    /// Parses an envelope (any JSON spelling, bounded); the signature is checked by
    /// [`verify`] / [`ModeTable::apply`], not here.
    pub fn from_json(text: &str) -> Result<SignedSnapshot, ModeError> {
        if text.len() > SIGNED_JSON_LEN_MAX {
            return Err(ModeError::Malformed("signed snapshot too long"));
        }
        serde_json::from_str(text).map_err(|_| ModeError::Malformed("signed snapshot json"))
    }
}

// ---------------------------------------------------------------------------------------------
// Keys, signing, verification
// ---------------------------------------------------------------------------------------------

/// `FLASHSALE_CONTROL_KEY`, parsed once (the HMAC pads are computed here and cloned per use).
#[derive(Clone)]
pub struct ControlKey {
    prepared: HmacSha256,
}

impl fmt::Debug for ControlKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print key material.
        f.write_str("ControlKey(..)")
    }
}

impl ControlKey {
    /// A hex key of 16..=64 bytes.
    pub fn from_hex(hex_key: &str) -> Result<ControlKey, ModeError> {
        let bytes = hex::decode(hex_key.trim()).map_err(|_| ModeError::BadKey("not hex"))?;
        if bytes.len() < CONTROL_KEY_LEN_MIN {
            return Err(ModeError::BadKey("shorter than 16 bytes"));
        }
        if bytes.len() > CONTROL_KEY_LEN_MAX {
            return Err(ModeError::BadKey("longer than 64 bytes"));
        }
        let prepared = HmacSha256::new_from_slice(&bytes)
            .map_err(|_| ModeError::BadKey("rejected by HMAC"))?;
        Ok(ControlKey { prepared })
    }

    fn mac_over(&self, canonical: &str) -> HmacSha256 {
        let mut mac = self.prepared.clone();
        mac.update(MAC_DOMAIN);
        mac.update(canonical.as_bytes());
        mac
    }
}

/// Signs a snapshot (the admin CLI, the control plane, tests). Refuses a malformed snapshot,
/// which no instance would accept.
pub fn sign(key: &ControlKey, snapshot: ModeSnapshot) -> Result<SignedSnapshot, ModeError> {
    let canonical = snapshot.canonical_text()?;
    let tag = key.mac_over(&canonical).finalize().into_bytes();
    Ok(SignedSnapshot { snapshot, sig_hex: hex::encode(tag) })
}

/// Checks form, signature and expiry; returns the snapshot it proves.
pub fn verify(
    key: &ControlKey,
    signed: &SignedSnapshot,
    now_ms: u64,
) -> Result<ModeSnapshot, ModeError> {
    verify_signature(key, signed)?;
    if signed.snapshot.is_expired(now_ms) {
        return Err(ModeError::Expired);
    }
    Ok(signed.snapshot.clone())
}

/// Form and signature only (persisted snapshots are re-verified this way: an expired one
/// still counts).
fn verify_signature(key: &ControlKey, signed: &SignedSnapshot) -> Result<(), ModeError> {
    let canonical = signed.snapshot.canonical_text()?;
    let tag = decode_sig_hex(&signed.sig_hex).ok_or(ModeError::BadSignature)?;
    key.mac_over(&canonical).verify_slice(&tag).map_err(|_| ModeError::BadSignature)
}

/// Exactly 64 lowercase hex digits (one spelling per tag).
fn decode_sig_hex(sig_hex: &str) -> Option<[u8; 32]> {
    let bytes = sig_hex.as_bytes();
    if bytes.len() != SIG_HEX_LEN || !bytes.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut tag = [0u8; 32];
    hex::decode_to_slice(bytes, &mut tag).ok()?;
    Some(tag)
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
    /// Leaving QUERY_ONLY (or a recovery in progress) other than through RECOVERING.
    MustRecover { scope: Scope, from: Mode, to: Mode },
    /// RECOVERING raised by more than the configured step (or NORMAL before 100 %).
    StepTooLarge { scope: Scope, from_percent: u8, to_percent: u8, step_max: u8 },
    /// A new scope while [`ModeConfig::scopes_max`] scopes are held.
    TableFull { scopes_max: usize },
    /// `FLASHSALE_CONTROL_KEY` unusable.
    BadKey(&'static str),
}

impl ModeError {
    /// A short stable label (metrics, the admin API's `reason_code`).
    pub const fn label(&self) -> &'static str {
        match self {
            ModeError::Malformed(_) => "MALFORMED",
            ModeError::BadSignature => "BAD_SIGNATURE",
            ModeError::Expired => "EXPIRED",
            ModeError::StaleVersion { .. } => "STALE_VERSION",
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

// ---------------------------------------------------------------------------------------------
// The table
// ---------------------------------------------------------------------------------------------

/// Limits and steps of a [`ModeTable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModeConfig {
    /// Largest raise of RECOVERING's share per snapshot. Default 25: 25, 50, 75, 100, then
    /// NORMAL. (The seed's stages 1, 5, 20, 50, 100 % need a step of 50.)
    pub recovering_step_percent_max: u8,
    /// Scopes held at once (global + activities + SKUs with their own snapshot).
    pub scopes_max: usize,
}

impl Default for ModeConfig {
    fn default() -> ModeConfig {
        ModeConfig { recovering_step_percent_max: 25, scopes_max: 4_096 }
    }
}

impl ModeConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=100).contains(&self.recovering_step_percent_max) {
            return Err("recovering_step_percent_max must be within 1..=100".into());
        }
        if !(1..=65_536).contains(&self.scopes_max) {
            return Err("scopes_max must be within 1..=65536".into());
        }
        Ok(())
    }
}

/// What one scope holds.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Accepted {
        signed: SignedSnapshot,
        recovery_required: bool,
    },
    /// A persisted entry that did not verify: closed, and only a version above `version`
    /// (as recorded, untrusted) replaces it.
    Unverifiable {
        version: u64,
        recovery_required: bool,
    },
}

impl Entry {
    fn version(&self) -> u64 {
        match self {
            Entry::Accepted { signed, .. } => signed.snapshot.version,
            Entry::Unverifiable { version, .. } => *version,
        }
    }

    /// The mode transitions are judged from (an unverifiable entry is closed).
    fn mode(&self) -> Mode {
        match self {
            Entry::Accepted { signed, .. } => signed.snapshot.mode,
            Entry::Unverifiable { .. } => Mode::SubmitClosed,
        }
    }

    fn recovery_required(&self) -> bool {
        match self {
            Entry::Accepted { recovery_required, .. }
            | Entry::Unverifiable { recovery_required, .. } => *recovery_required,
        }
    }
}

/// A snapshot that [`ModeTable::apply`] accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub scope: Scope,
    pub version: u64,
    /// The scope's mode before (None: the scope had no snapshot).
    pub previous: Option<Mode>,
    pub mode: Mode,
}

/// Where an [`EffectiveMode`] comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeSource {
    /// No applicable scope ever held a snapshot.
    NoSnapshot,
    Snapshot {
        scope: Scope,
        version: u64,
    },
    /// That scope's snapshot expired: closed.
    Expired {
        scope: Scope,
        version: u64,
    },
    /// That scope's persisted state did not verify: closed.
    Unverifiable {
        scope: Scope,
        version: u64,
    },
}

/// The mode a submit obeys, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EffectiveMode {
    pub mode: Mode,
    pub source: ModeSource,
}

impl EffectiveMode {
    /// What a deployment without any snapshot runs in.
    pub const NO_SNAPSHOT: EffectiveMode =
        EffectiveMode { mode: Mode::Normal, source: ModeSource::NoSnapshot };

    /// A stable reason code for rejections and logs.
    pub const fn reason(&self) -> &'static str {
        match self.source {
            ModeSource::Expired { .. } => "MODE_EXPIRED",
            ModeSource::Unverifiable { .. } => "MODE_UNVERIFIABLE",
            ModeSource::NoSnapshot | ModeSource::Snapshot { .. } => match self.mode {
                Mode::Normal => "MODE_NORMAL",
                Mode::ShedLoad { .. } => "MODE_SHED_LOAD",
                Mode::SubmitClosed => "MODE_SUBMIT_CLOSED",
                Mode::QueryOnly => "MODE_QUERY_ONLY",
                Mode::Recovering { .. } => "MODE_RECOVERING",
            },
        }
    }

    /// Whether this refuses every submission (expired/unverifiable sources always do).
    pub const fn closes_submissions(&self) -> bool {
        matches!(self.source, ModeSource::Expired { .. } | ModeSource::Unverifiable { .. })
            || self.mode.closes_submissions()
    }

    /// The share admitted, in percent (0 when closed).
    pub const fn admit_percent(&self) -> u8 {
        if self.closes_submissions() {
            0
        } else {
            self.mode.admit_percent()
        }
    }

    /// Lower = more restrictive: by admitted share, then QUERY_ONLY, unverifiable, expired,
    /// SUBMIT_CLOSED, RECOVERING, SHED_LOAD, NORMAL.
    const fn restrictiveness(&self) -> (u8, u8) {
        let kind = match (self.source, self.mode) {
            (ModeSource::Unverifiable { .. }, _) => 1,
            (ModeSource::Expired { .. }, _) => 2,
            (_, Mode::QueryOnly) => 0,
            (_, Mode::SubmitClosed) => 3,
            (_, Mode::Recovering { .. }) => 4,
            (_, Mode::ShedLoad { .. }) => 5,
            (_, Mode::Normal) => 6,
        };
        (self.admit_percent(), kind)
    }
}

/// The accepted snapshot per scope, on every instance (and every shard: `Clone`, updated by
/// version). The key is held so that nothing unverified can enter.
#[derive(Debug, Clone)]
pub struct ModeTable {
    key: ControlKey,
    config: ModeConfig,
    entries: HashMap<Scope, Entry>,
    /// Bumped by every accepted snapshot: shards holding a copy (or caching `effective` per
    /// SKU) compare it to know whether theirs is current.
    revision: u64,
}

/// The persisted form: one entry per scope, sorted by scope.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PersistedWire {
    format: u32,
    entries: Vec<PersistedEntry>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PersistedEntry {
    scope: String,
    version: u64,
    recovery_required: bool,
    /// Kept as raw JSON so that one bad entry does not make the whole state unreadable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    signed: Option<serde_json::Value>,
}

impl ModeTable {
    /// An empty table: every SKU NORMAL until a snapshot arrives.
    pub fn new(key: ControlKey, config: ModeConfig) -> ModeTable {
        if let Err(why) = config.validate() {
            panic!("invalid ModeConfig: {why}");
        }
        ModeTable { key, config, entries: HashMap::new(), revision: 0 }
    }

    /// Everything closed until a valid global snapshot arrives (any version), after which the
    /// recovery ramp applies: for a persisted state that could not be read at all.
    pub fn fail_closed(key: ControlKey, config: ModeConfig) -> ModeTable {
        let mut table = ModeTable::new(key, config);
        table
            .entries
            .insert(Scope::Global, Entry::Unverifiable { version: 0, recovery_required: true });
        table
    }

    /// Verifies `signed` and, if every rule holds, makes it its scope's snapshot.
    pub fn apply(&mut self, signed: &SignedSnapshot, now_ms: u64) -> Result<Applied, ModeError> {
        let snapshot = verify(&self.key, signed, now_ms)?;
        let scope = snapshot.scope;
        let current = self.entries.get(&scope);
        match current {
            Some(entry) if snapshot.version <= entry.version() => {
                return Err(ModeError::StaleVersion {
                    scope,
                    current: entry.version(),
                    offered: snapshot.version,
                });
            }
            None if self.entries.len() >= self.config.scopes_max => {
                return Err(ModeError::TableFull { scopes_max: self.config.scopes_max });
            }
            _ => {}
        }
        let previous = current.map(Entry::mode);
        let from = previous.unwrap_or(Mode::Normal);
        let required = current.is_some_and(Entry::recovery_required);
        let recovery_required = transition(
            scope,
            from,
            required,
            snapshot.mode,
            self.config.recovering_step_percent_max,
        )?;
        self.entries.insert(scope, Entry::Accepted { signed: signed.clone(), recovery_required });
        self.revision += 1;
        Ok(Applied { scope, version: snapshot.version, previous, mode: snapshot.mode })
    }

    /// The mode a submit for (`activity_id`, `sku_id`) obeys at `now_ms`: the most
    /// restrictive of the global, activity and SKU entries (see the module doc).
    pub fn effective(&self, activity_id: u64, sku_id: u64, now_ms: u64) -> EffectiveMode {
        let chain = [Scope::Global, Scope::Activity(activity_id), Scope::Sku(activity_id, sku_id)];
        let mut best: Option<EffectiveMode> = None;
        for scope in chain {
            let Some(entry) = self.entries.get(&scope) else { continue };
            let candidate = match entry {
                Entry::Unverifiable { version, .. } => EffectiveMode {
                    mode: Mode::SubmitClosed,
                    source: ModeSource::Unverifiable { scope, version: *version },
                },
                Entry::Accepted { signed, .. } => {
                    let snapshot = &signed.snapshot;
                    let version = snapshot.version;
                    if snapshot.is_expired(now_ms) {
                        EffectiveMode {
                            mode: Mode::SubmitClosed,
                            source: ModeSource::Expired { scope, version },
                        }
                    } else {
                        EffectiveMode {
                            mode: snapshot.mode,
                            source: ModeSource::Snapshot { scope, version },
                        }
                    }
                }
            };
            // Ties go to the narrower scope (it names the more precise cause).
            best = match best {
                Some(b) if b.restrictiveness() < candidate.restrictiveness() => Some(b),
                _ => Some(candidate),
            };
        }
        best.unwrap_or(EffectiveMode::NO_SNAPSHOT)
    }

    /// The accepted snapshot of `scope`, if any (for the admin API and replication).
    pub fn snapshot(&self, scope: Scope) -> Option<&SignedSnapshot> {
        match self.entries.get(&scope) {
            Some(Entry::Accepted { signed, .. }) => Some(signed),
            _ => None,
        }
    }

    /// The highest version `scope` holds (accepted or unverifiable).
    pub fn version(&self, scope: Scope) -> Option<u64> {
        self.entries.get(&scope).map(Entry::version)
    }

    /// Accepted snapshots since this table was created or restored.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Scopes held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Scopes closed because their persisted state did not verify (log it, alert on it).
    pub fn unverifiable_scopes(&self) -> usize {
        self.entries.values().filter(|e| matches!(e, Entry::Unverifiable { .. })).count()
    }

    /// The state to write to disk (the caller does the I/O, atomically: write + rename).
    pub fn to_persisted(&self) -> String {
        let mut scopes: Vec<&Scope> = self.entries.keys().collect();
        scopes.sort();
        let entries = scopes
            .into_iter()
            .filter_map(|scope| {
                let entry = self.entries.get(scope)?;
                let signed = match entry {
                    Entry::Accepted { signed, .. } => serde_json::to_value(signed).ok(),
                    Entry::Unverifiable { .. } => None,
                };
                Some(PersistedEntry {
                    scope: scope.to_string(),
                    version: entry.version(),
                    recovery_required: entry.recovery_required(),
                    signed,
                })
            })
            .collect();
        let wire = PersistedWire { format: PERSISTED_FORMAT, entries };
        // Only integers, strings and booleans: serializing cannot fail.
        serde_json::to_string(&wire).expect("the persisted mode state always serializes")
    }

    /// Restores a persisted state, re-verifying every snapshot with `key`. An entry that does
    /// not verify closes its scope (an entry whose scope cannot even be read closes the global
    /// scope); an unreadable document is `Err(Malformed)` — then start from
    /// [`ModeTable::fail_closed`].
    pub fn from_persisted(
        text: &str,
        key: ControlKey,
        config: ModeConfig,
    ) -> Result<ModeTable, ModeError> {
        let mut table = ModeTable::new(key, config);
        let len_max = config.scopes_max.saturating_mul(PERSISTED_ENTRY_LEN_MAX).saturating_add(64);
        if text.len() > len_max {
            return Err(ModeError::Malformed("persisted state too long"));
        }
        let wire: PersistedWire =
            serde_json::from_str(text).map_err(|_| ModeError::Malformed("persisted state json"))?;
        if wire.format != PERSISTED_FORMAT {
            return Err(ModeError::Malformed("persisted state format"));
        }
        if wire.entries.len() > config.scopes_max {
            return Err(ModeError::Malformed("persisted state has too many scopes"));
        }
        for entry in wire.entries {
            let (scope, restored) = table.restore_entry(entry);
            table.merge_restored(scope, restored);
        }
        Ok(table)
    }

    /// One persisted entry → the scope it governs and what it holds.
    fn restore_entry(&self, persisted: PersistedEntry) -> (Scope, Entry) {
        let Some(scope) = Scope::parse(&persisted.scope) else {
            // Which scope it governed is unknown: close everything.
            return (Scope::Global, Entry::Unverifiable { version: 0, recovery_required: true });
        };
        let signed =
            persisted.signed.and_then(|value| serde_json::from_value::<SignedSnapshot>(value).ok());
        let Some(signed) = signed else {
            return (
                scope,
                Entry::Unverifiable {
                    version: persisted.version,
                    recovery_required: persisted.recovery_required,
                },
            );
        };
        let snapshot = &signed.snapshot;
        let genuine = verify_signature(&self.key, &signed).is_ok()
            && snapshot.scope == scope
            && snapshot.version == persisted.version;
        if genuine {
            // The flag can only be made stricter by what the snapshot itself proves.
            let recovery_required = persisted.recovery_required || snapshot.mode == Mode::QueryOnly;
            (scope, Entry::Accepted { signed, recovery_required })
        } else {
            let version = persisted.version.max(snapshot.version);
            (scope, Entry::Unverifiable { version, recovery_required: persisted.recovery_required })
        }
    }

    /// Two persisted entries for one scope never come from [`ModeTable::to_persisted`]: keep
    /// the scope closed at the higher version.
    fn merge_restored(&mut self, scope: Scope, restored: Entry) {
        let merged = match self.entries.remove(&scope) {
            None => restored,
            Some(existing) => Entry::Unverifiable {
                version: existing.version().max(restored.version()),
                recovery_required: existing.recovery_required() || restored.recovery_required(),
            },
        };
        self.entries.insert(scope, merged);
    }
}

/// Judges `from → to` for one scope; returns the recovery flag after the change.
fn transition(
    scope: Scope,
    from: Mode,
    recovery_required: bool,
    to: Mode,
    step_max: u8,
) -> Result<bool, ModeError> {
    match to {
        Mode::QueryOnly => Ok(true),
        Mode::SubmitClosed => Ok(recovery_required),
        Mode::Recovering { admit_percent: to_percent } => {
            let base = match from {
                Mode::Recovering { admit_percent } => Some(admit_percent),
                _ if recovery_required => Some(0),
                _ => None,
            };
            match base {
                Some(from_percent) if to_percent > from_percent.saturating_add(step_max) => {
                    Err(ModeError::StepTooLarge { scope, from_percent, to_percent, step_max })
                }
                _ => Ok(recovery_required),
            }
        }
        Mode::ShedLoad { .. } if recovery_required => {
            Err(ModeError::MustRecover { scope, from, to })
        }
        Mode::ShedLoad { .. } => Ok(false),
        Mode::Normal => match from {
            Mode::Recovering { admit_percent: 100 } => Ok(false),
            Mode::Recovering { admit_percent } => Err(ModeError::StepTooLarge {
                scope,
                from_percent: admit_percent,
                to_percent: 100,
                step_max,
            }),
            _ if recovery_required => Err(ModeError::MustRecover { scope, from, to }),
            _ => Ok(false),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KEY_HEX: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
    const OTHER_KEY_HEX: &str = "ff0102030405060708090a0b0c0d0e0f";

    fn key() -> ControlKey {
        ControlKey::from_hex(KEY_HEX).expect("test key")
    }

    fn snap(version: u64, scope: Scope, mode: Mode) -> ModeSnapshot {
        ModeSnapshot {
            version,
            scope,
            mode,
            issued_at_ms: 1_000,
            expires_at_ms: 100_000,
            issuer: "ops-alice".into(),
        }
    }

    fn signed(version: u64, scope: Scope, mode: Mode) -> SignedSnapshot {
        sign(&key(), snap(version, scope, mode)).expect("sign")
    }

    fn table() -> ModeTable {
        ModeTable::new(key(), ModeConfig::default())
    }

    fn rec(p: u8) -> Mode {
        Mode::Recovering { admit_percent: p }
    }

    fn shed(p: u8) -> Mode {
        Mode::ShedLoad { admit_percent: p }
    }

    #[test]
    fn canonical_text_is_fixed() {
        let s = snap(7, Scope::Sku(10001, 20001), rec(25));
        assert_eq!(
            s.canonical_text().unwrap(),
            r#"{"version":7,"scope":"sku:10001:20001","mode":"RECOVERING","admit_percent":25,"issued_at_ms":1000,"expires_at_ms":100000,"issuer":"ops-alice"}"#
        );
        let g = snap(1, Scope::Global, Mode::QueryOnly);
        assert_eq!(
            g.canonical_text().unwrap(),
            r#"{"version":1,"scope":"global","mode":"QUERY_ONLY","issued_at_ms":1000,"expires_at_ms":100000,"issuer":"ops-alice"}"#
        );
        // serde's shape of the struct is the canonical text too (the envelope embeds it).
        assert_eq!(serde_json::to_string(&s).unwrap(), s.canonical_text().unwrap());
        assert_eq!(ModeSnapshot::from_canonical_text(&s.canonical_text().unwrap()), Ok(s));
    }

    #[test]
    fn non_canonical_spellings_are_malformed() {
        let text = snap(7, Scope::Activity(5), Mode::Normal).canonical_text().unwrap();
        for other in [
            text.replace("\"version\":7", "\"version\":07"),
            text.replace("\"version\":7,", "\"version\": 7,"),
            text.replace("activity:5", "activity:05"),
            text.replace("\"mode\":\"NORMAL\"", "\"mode\":\"NORMAL\",\"admit_percent\":null"),
            text.replacen('{', "{ ", 1),
        ] {
            assert!(
                matches!(ModeSnapshot::from_canonical_text(&other), Err(ModeError::Malformed(_))),
                "{other}"
            );
        }
    }

    #[test]
    fn field_rules() {
        let bad = |s: ModeSnapshot| matches!(sign(&key(), s), Err(ModeError::Malformed(_)));
        assert!(bad(snap(0, Scope::Global, Mode::Normal)), "version 0");
        assert!(bad(snap(1, Scope::Global, rec(101))), "percent over 100");
        assert!(bad(ModeSnapshot { expires_at_ms: 1_000, ..snap(1, Scope::Global, Mode::Normal) }));
        assert!(bad(ModeSnapshot {
            issuer: String::new(),
            ..snap(1, Scope::Global, Mode::Normal)
        }));
        assert!(bad(ModeSnapshot {
            issuer: "a\"b".into(),
            ..snap(1, Scope::Global, Mode::Normal)
        }));
        assert!(bad(ModeSnapshot {
            issuer: "x".repeat(ISSUER_LEN_MAX + 1),
            ..snap(1, Scope::Global, Mode::Normal)
        }));
        for text in [
            r#"{"version":1,"scope":"global","mode":"SHED_LOAD","issued_at_ms":1,"expires_at_ms":2,"issuer":"a"}"#,
            r#"{"version":1,"scope":"global","mode":"NORMAL","admit_percent":5,"issued_at_ms":1,"expires_at_ms":2,"issuer":"a"}"#,
            r#"{"version":1,"scope":"global","mode":"PANIC","issued_at_ms":1,"expires_at_ms":2,"issuer":"a"}"#,
            r#"{"version":1,"scope":"planet","mode":"NORMAL","issued_at_ms":1,"expires_at_ms":2,"issuer":"a"}"#,
            r#"{"version":1,"scope":"global","mode":"NORMAL","issued_at_ms":1,"expires_at_ms":2,"issuer":"a","x":1}"#,
            r#"{"version":-1,"scope":"global","mode":"NORMAL","issued_at_ms":1,"expires_at_ms":2,"issuer":"a"}"#,
        ] {
            assert!(
                matches!(ModeSnapshot::from_canonical_text(text), Err(ModeError::Malformed(_))),
                "{text}"
            );
        }
    }

    #[test]
    fn scope_text_round_trips() {
        for scope in [Scope::Global, Scope::Activity(0), Scope::Sku(u64::MAX, 3)] {
            assert_eq!(Scope::parse(&scope.to_string()), Some(scope));
        }
        for bad in ["", "Global", "activity:", "activity:+1", "sku:1", "sku:1:2:3", "sku:01:2"] {
            assert_eq!(Scope::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn keys() {
        assert!(ControlKey::from_hex(KEY_HEX).is_ok());
        assert_eq!(ControlKey::from_hex("zz").err(), Some(ModeError::BadKey("not hex")));
        assert_eq!(
            ControlKey::from_hex("00112233").err(),
            Some(ModeError::BadKey("shorter than 16 bytes"))
        );
        assert_eq!(
            ControlKey::from_hex(&"ab".repeat(65)).err(),
            Some(ModeError::BadKey("longer than 64 bytes"))
        );
        assert_eq!(format!("{:?}", key()), "ControlKey(..)");
    }

    #[test]
    fn verify_checks_signature_then_expiry() {
        let s = signed(1, Scope::Global, Mode::SubmitClosed);
        assert_eq!(verify(&key(), &s, 99_999), Ok(s.snapshot.clone()));
        assert_eq!(verify(&key(), &s, 100_000), Err(ModeError::Expired), "expiry is exclusive");
        let other = ControlKey::from_hex(OTHER_KEY_HEX).unwrap();
        assert_eq!(verify(&other, &s, 0), Err(ModeError::BadSignature));
        // A forged AND expired snapshot is reported as forged.
        assert_eq!(verify(&other, &s, 200_000), Err(ModeError::BadSignature));
        let upper = SignedSnapshot { sig_hex: s.sig_hex.to_uppercase(), ..s.clone() };
        assert_eq!(verify(&key(), &upper, 0), Err(ModeError::BadSignature), "one spelling");
        let short = SignedSnapshot { sig_hex: s.sig_hex[..62].to_owned(), ..s.clone() };
        assert_eq!(verify(&key(), &short, 0), Err(ModeError::BadSignature));
        let altered = SignedSnapshot { snapshot: snap(1, Scope::Global, Mode::Normal), ..s };
        assert_eq!(verify(&key(), &altered, 0), Err(ModeError::BadSignature));
    }

    #[test]
    fn envelope_round_trips_and_is_bounded() {
        let s = signed(3, Scope::Activity(9), shed(40));
        let json = s.to_json();
        assert!(json.starts_with(r#"{"snapshot":{"version":3,"scope":"activity:9""#), "{json}");
        assert_eq!(SignedSnapshot::from_json(&json), Ok(s.clone()));
        // Any spelling of the envelope: the MAC covers the canonical text of what was parsed.
        let pretty = serde_json::to_string_pretty(&s).unwrap();
        let parsed = SignedSnapshot::from_json(&pretty).unwrap();
        assert_eq!(verify(&key(), &parsed, 2_000), Ok(s.snapshot.clone()));
        let long = format!("{json}{}", " ".repeat(SIGNED_JSON_LEN_MAX));
        assert_eq!(
            SignedSnapshot::from_json(&long),
            Err(ModeError::Malformed("signed snapshot too long"))
        );
        assert!(SignedSnapshot::from_json(r#"{"snapshot":{},"sig_hex":""}"#).is_err());
    }

    #[test]
    fn versions_strictly_increase_per_scope() {
        let mut t = table();
        let applied = t.apply(&signed(5, Scope::Global, Mode::SubmitClosed), 2_000).unwrap();
        assert_eq!(
            applied,
            Applied { scope: Scope::Global, version: 5, previous: None, mode: Mode::SubmitClosed }
        );
        assert_eq!(
            t.apply(&signed(5, Scope::Global, Mode::Normal), 2_000),
            Err(ModeError::StaleVersion { scope: Scope::Global, current: 5, offered: 5 })
        );
        assert_eq!(
            t.apply(&signed(4, Scope::Global, Mode::Normal), 2_000),
            Err(ModeError::StaleVersion { scope: Scope::Global, current: 5, offered: 4 })
        );
        // Another scope has its own sequence.
        assert!(t.apply(&signed(1, Scope::Activity(1), Mode::Normal), 2_000).is_ok());
        let applied = t.apply(&signed(6, Scope::Global, Mode::Normal), 2_000).unwrap();
        assert_eq!(applied.previous, Some(Mode::SubmitClosed));
        assert_eq!(t.version(Scope::Global), Some(6));
        assert_eq!(t.revision(), 3, "only accepted snapshots bump the revision");
    }

    #[test]
    fn apply_refuses_forged_and_expired() {
        let mut t = table();
        let other = ControlKey::from_hex(OTHER_KEY_HEX).unwrap();
        let forged = sign(&other, snap(1, Scope::Global, Mode::Normal)).unwrap();
        assert_eq!(t.apply(&forged, 2_000), Err(ModeError::BadSignature));
        assert_eq!(
            t.apply(&signed(1, Scope::Global, Mode::Normal), 100_000),
            Err(ModeError::Expired)
        );
        assert!(t.is_empty(), "nothing refused is kept");
    }

    #[test]
    fn query_only_must_recover_in_steps() {
        let mut t = table();
        let g = Scope::Global;
        t.apply(&signed(1, g, Mode::QueryOnly), 2_000).unwrap();
        let must = |from, to| Err(ModeError::MustRecover { scope: g, from, to });
        assert_eq!(
            t.apply(&signed(2, g, Mode::Normal), 2_000),
            must(Mode::QueryOnly, Mode::Normal)
        );
        assert_eq!(t.apply(&signed(2, g, shed(10)), 2_000), must(Mode::QueryOnly, shed(10)));
        assert_eq!(
            t.apply(&signed(2, g, rec(30)), 2_000),
            Err(ModeError::StepTooLarge {
                scope: g,
                from_percent: 0,
                to_percent: 30,
                step_max: 25
            })
        );
        // The detour through SUBMIT_CLOSED does not clear the obligation.
        t.apply(&signed(2, g, Mode::SubmitClosed), 2_000).unwrap();
        assert_eq!(
            t.apply(&signed(3, g, Mode::Normal), 2_000),
            must(Mode::SubmitClosed, Mode::Normal)
        );
        t.apply(&signed(3, g, rec(25)), 2_000).unwrap();
        t.apply(&signed(4, g, rec(50)), 2_000).unwrap();
        assert_eq!(
            t.apply(&signed(5, g, Mode::Normal), 2_000),
            Err(ModeError::StepTooLarge {
                scope: g,
                from_percent: 50,
                to_percent: 100,
                step_max: 25
            })
        );
        // Rolling back mid-ramp restarts the ramp from 0.
        t.apply(&signed(5, g, Mode::SubmitClosed), 2_000).unwrap();
        assert!(matches!(
            t.apply(&signed(6, g, rec(50)), 2_000),
            Err(ModeError::StepTooLarge { from_percent: 0, .. })
        ));
        for (v, p) in [(6, 25), (7, 50), (8, 75), (9, 100)] {
            t.apply(&signed(v, g, rec(p)), 2_000).unwrap();
        }
        t.apply(&signed(10, g, Mode::Normal), 2_000).unwrap();
        // Recovered: SHED_LOAD and a direct SUBMIT_CLOSED → NORMAL are allowed again.
        t.apply(&signed(11, g, shed(50)), 2_000).unwrap();
        t.apply(&signed(12, g, Mode::SubmitClosed), 2_000).unwrap();
        t.apply(&signed(13, g, Mode::Normal), 2_000).unwrap();
    }

    #[test]
    fn recovering_steps_also_outside_a_recovery() {
        let mut t = table();
        let s = Scope::Sku(1, 2);
        t.apply(&signed(1, s, Mode::SubmitClosed), 2_000).unwrap();
        // Not after QUERY_ONLY: RECOVERING may start anywhere...
        t.apply(&signed(2, s, rec(60)), 2_000).unwrap();
        // ...but rises in steps, and may drop at any time.
        assert!(matches!(
            t.apply(&signed(3, s, rec(90)), 2_000),
            Err(ModeError::StepTooLarge { from_percent: 60, to_percent: 90, .. })
        ));
        t.apply(&signed(3, s, rec(10)), 2_000).unwrap();
        t.apply(&signed(4, s, rec(35)), 2_000).unwrap();
    }

    #[test]
    fn table_is_bounded() {
        let mut t = ModeTable::new(key(), ModeConfig { scopes_max: 2, ..ModeConfig::default() });
        t.apply(&signed(1, Scope::Global, Mode::Normal), 2_000).unwrap();
        t.apply(&signed(1, Scope::Activity(1), Mode::Normal), 2_000).unwrap();
        assert_eq!(
            t.apply(&signed(1, Scope::Activity(2), Mode::Normal), 2_000),
            Err(ModeError::TableFull { scopes_max: 2 })
        );
        // Existing scopes still update.
        t.apply(&signed(2, Scope::Activity(1), Mode::SubmitClosed), 2_000).unwrap();
    }

    #[test]
    fn effective_is_the_most_restrictive_scope() {
        let mut t = table();
        assert_eq!(t.effective(1, 2, 0), EffectiveMode::NO_SNAPSHOT);
        t.apply(&signed(1, Scope::Sku(1, 2), Mode::Normal), 2_000).unwrap();
        assert_eq!(
            t.effective(1, 2, 2_000),
            EffectiveMode {
                mode: Mode::Normal,
                source: ModeSource::Snapshot { scope: Scope::Sku(1, 2), version: 1 }
            }
        );
        // Another SKU of the same activity is untouched.
        assert_eq!(t.effective(1, 3, 2_000), EffectiveMode::NO_SNAPSHOT);
        // A global kill switch closes the SKU despite its own NORMAL.
        t.apply(&signed(1, Scope::Global, Mode::QueryOnly), 2_000).unwrap();
        assert_eq!(t.effective(1, 2, 2_000).mode, Mode::QueryOnly);
        assert_eq!(t.effective(9, 9, 2_000).reason(), "MODE_QUERY_ONLY");
        // Global ramps: every SKU is capped by the global share.
        t.apply(&signed(2, Scope::Global, rec(25)), 2_000).unwrap();
        assert_eq!(t.effective(1, 2, 2_000).mode, rec(25));
        // An activity can close more.
        t.apply(&signed(1, Scope::Activity(1), shed(10)), 2_000).unwrap();
        assert_eq!(t.effective(1, 2, 2_000).mode, shed(10));
        assert_eq!(t.effective(2, 2, 2_000).mode, rec(25));
    }

    #[test]
    fn expired_closes_but_no_snapshot_is_normal() {
        let mut t = table();
        let mut s = snap(1, Scope::Activity(7), shed(50));
        s.expires_at_ms = 5_000;
        t.apply(&sign(&key(), s).unwrap(), 2_000).unwrap();
        assert_eq!(t.effective(7, 1, 4_999).mode, shed(50));
        let closed = t.effective(7, 1, 5_000);
        assert_eq!(
            closed,
            EffectiveMode {
                mode: Mode::SubmitClosed,
                source: ModeSource::Expired { scope: Scope::Activity(7), version: 1 }
            }
        );
        assert!(closed.closes_submissions());
        assert_eq!(closed.reason(), "MODE_EXPIRED");
        assert_eq!(closed.admit_percent(), 0);
        // Activities that never had a snapshot keep selling.
        assert_eq!(t.effective(8, 1, 5_000), EffectiveMode::NO_SNAPSHOT);
        // A refresh (higher version) re-opens.
        t.apply(&signed(2, Scope::Activity(7), Mode::Normal), 5_000).unwrap();
        assert_eq!(t.effective(7, 1, 5_000).mode, Mode::Normal);
    }

    #[test]
    fn persistence_round_trips_and_reverifies() {
        let mut t = table();
        t.apply(&signed(3, Scope::Global, Mode::QueryOnly), 2_000).unwrap();
        t.apply(&signed(4, Scope::Global, Mode::SubmitClosed), 2_000).unwrap();
        t.apply(&signed(2, Scope::Sku(1, 2), shed(30)), 2_000).unwrap();
        let text = t.to_persisted();
        let back = ModeTable::from_persisted(&text, key(), ModeConfig::default()).unwrap();
        assert_eq!(back.to_persisted(), text);
        assert_eq!(back.version(Scope::Global), Some(4));
        assert_eq!(back.unverifiable_scopes(), 0);
        // The highest version and the recovery obligation survived the restart.
        let mut back = back;
        assert!(matches!(
            back.apply(&signed(4, Scope::Global, Mode::Normal), 2_000),
            Err(ModeError::StaleVersion { .. })
        ));
        assert!(matches!(
            back.apply(&signed(5, Scope::Global, Mode::Normal), 2_000),
            Err(ModeError::MustRecover { .. })
        ));
        // Expired snapshots are restored too (and still close).
        let expired = ModeTable::from_persisted(&text, key(), ModeConfig::default()).unwrap();
        assert_eq!(expired.effective(1, 2, 1_000_000).reason(), "MODE_EXPIRED");
    }

    #[test]
    fn persisted_entries_that_do_not_verify_close_their_scope() {
        let mut t = table();
        t.apply(&signed(3, Scope::Activity(1), Mode::Normal), 2_000).unwrap();
        t.apply(&signed(2, Scope::Activity(2), Mode::Normal), 2_000).unwrap();
        let text = t.to_persisted();
        // Another key (rotation, or a forged file): both scopes closed, versions kept.
        let other = ControlKey::from_hex(OTHER_KEY_HEX).unwrap();
        let mut back = ModeTable::from_persisted(&text, other, ModeConfig::default()).unwrap();
        assert_eq!(back.unverifiable_scopes(), 2);
        assert_eq!(
            back.effective(1, 5, 2_000),
            EffectiveMode {
                mode: Mode::SubmitClosed,
                source: ModeSource::Unverifiable { scope: Scope::Activity(1), version: 3 }
            }
        );
        assert_eq!(back.effective(3, 5, 2_000), EffectiveMode::NO_SNAPSHOT);
        // The marker persists as such and is replaced only by a higher version.
        let again = back.to_persisted();
        let mut again_table =
            ModeTable::from_persisted(&again, key(), ModeConfig::default()).unwrap();
        assert_eq!(again_table.unverifiable_scopes(), 2);
        let other = ControlKey::from_hex(OTHER_KEY_HEX).unwrap();
        let new = sign(&other, snap(3, Scope::Activity(1), Mode::Normal)).unwrap();
        assert!(matches!(back.apply(&new, 2_000), Err(ModeError::StaleVersion { .. })));
        let new = sign(&key(), snap(4, Scope::Activity(1), Mode::Normal)).unwrap();
        again_table.apply(&new, 2_000).unwrap();
        assert_eq!(again_table.effective(1, 5, 2_000).mode, Mode::Normal);

        // Tampering inside one entry closes that scope only.
        let tampered = text.replacen("\"mode\":\"NORMAL\"", "\"mode\":\"SUBMIT_CLOSED\"", 1);
        assert_ne!(tampered, text);
        let back = ModeTable::from_persisted(&tampered, key(), ModeConfig::default()).unwrap();
        assert_eq!(back.unverifiable_scopes(), 1);
        assert_eq!(back.effective(2, 1, 2_000).mode, Mode::Normal);
        assert_eq!(back.effective(1, 1, 2_000).reason(), "MODE_UNVERIFIABLE");
    }

    #[test]
    fn unreadable_persisted_state() {
        for text in ["", "{", r#"{"format":2,"entries":[]}"#, r#"{"format":1}"#] {
            assert!(
                matches!(
                    ModeTable::from_persisted(text, key(), ModeConfig::default()),
                    Err(ModeError::Malformed(_))
                ),
                "{text}"
            );
        }
        // A bad scope closes everything.
        let text =
            r#"{"format":1,"entries":[{"scope":"nowhere","version":1,"recovery_required":false}]}"#;
        let t = ModeTable::from_persisted(text, key(), ModeConfig::default()).unwrap();
        assert_eq!(t.effective(1, 1, 0).reason(), "MODE_UNVERIFIABLE");
        // The fail-closed table: closed until a valid global snapshot, then the ramp.
        let mut t = ModeTable::fail_closed(key(), ModeConfig::default());
        assert!(t.effective(1, 1, 2_000).closes_submissions());
        assert!(matches!(
            t.apply(&signed(1, Scope::Global, Mode::Normal), 2_000),
            Err(ModeError::MustRecover { .. })
        ));
        t.apply(&signed(1, Scope::Global, rec(25)), 2_000).unwrap();
        assert_eq!(t.effective(1, 1, 2_000).mode, rec(25));
    }

    #[test]
    fn metric_values_and_labels() {
        let modes = [Mode::Normal, shed(1), rec(1), Mode::SubmitClosed, Mode::QueryOnly];
        let values: Vec<u8> = modes.iter().map(|m| m.metric_value()).collect();
        assert_eq!(values, [0, 1, 2, 3, 4]);
        assert_eq!(ModeError::BadSignature.label(), "BAD_SIGNATURE");
        assert!(ModeError::StaleVersion { scope: Scope::Global, current: 2, offered: 1 }
            .to_string()
            .contains("version 1 is not above the current 2"));
    }

    // --- properties -------------------------------------------------------------------------

    fn mode_strategy() -> impl Strategy<Value = Mode> {
        prop_oneof![
            Just(Mode::Normal),
            Just(Mode::SubmitClosed),
            Just(Mode::QueryOnly),
            (0u8..=100).prop_map(shed),
            (0u8..=100).prop_map(rec),
            // Small steps too, so that ramps actually get through.
            (0u8..=4).prop_map(|k| rec(k * 25)),
        ]
    }

    fn scope_strategy() -> impl Strategy<Value = Scope> {
        prop_oneof![
            Just(Scope::Global),
            (0u64..3).prop_map(Scope::Activity),
            (0u64..3, 0u64..3).prop_map(|(a, s)| Scope::Sku(a, s)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Any single-byte change of the signed text, or of the signature, never applies.
        #[test]
        fn forged_snapshots_never_apply(
            version in 1u64..1_000_000,
            scope in scope_strategy(),
            mode in mode_strategy(),
            at in any::<proptest::sample::Index>(),
            byte in any::<u8>(),
            in_sig in any::<bool>(),
        ) {
            let original = signed(version, scope, mode);
            let text = original.snapshot.canonical_text().unwrap();
            let mut forged = original.clone();
            if in_sig {
                let mut sig = original.sig_hex.clone().into_bytes();
                let i = at.index(sig.len());
                prop_assume!(sig[i] != byte);
                sig[i] = byte;
                let Ok(sig) = String::from_utf8(sig) else { return Ok(()) };
                forged.sig_hex = sig;
            } else {
                let mut bytes = text.clone().into_bytes();
                let i = at.index(bytes.len());
                prop_assume!(bytes[i] != byte);
                bytes[i] = byte;
                let Ok(changed) = String::from_utf8(bytes) else { return Ok(()) };
                match ModeSnapshot::from_canonical_text(&changed) {
                    Ok(snapshot) => forged.snapshot = snapshot,
                    Err(_) => return Ok(()), // not even a snapshot: cannot apply
                }
            }
            let mut t = table();
            prop_assert!(t.apply(&forged, 2_000).is_err());
            prop_assert!(t.is_empty());
            // The envelope too: a changed byte either fails to parse, parses to the same
            // signed snapshot (a harmless respelling), or does not apply.
            let json = original.to_json().into_bytes();
            let i = at.index(json.len());
            let mut json2 = json.clone();
            json2[i] = byte;
            if let Ok(s) = std::str::from_utf8(&json2) {
                if let Ok(parsed) = SignedSnapshot::from_json(s) {
                    if parsed != original {
                        prop_assert!(t.apply(&parsed, 2_000).is_err());
                    }
                }
            }
        }

        /// Whatever the order of arrival, each scope's accepted versions strictly increase,
        /// and with transitions that are always allowed the highest version wins.
        #[test]
        fn versions_never_go_backwards(
            picks in proptest::collection::vec((scope_strategy(), 1u64..40, mode_strategy()), 1..60),
        ) {
            let mut t = table();
            let mut last: HashMap<Scope, u64> = HashMap::new();
            for (scope, version, mode) in &picks {
                if let Ok(applied) = t.apply(&signed(*version, *scope, *mode), 2_000) {
                    let before = last.insert(*scope, applied.version);
                    prop_assert!(before.is_none_or(|b| b < applied.version));
                }
                prop_assert_eq!(t.version(*scope), last.get(scope).copied());
            }
            // Closing modes are always allowed: then the maximum version per scope wins.
            let mut t = table();
            let mut max: HashMap<Scope, u64> = HashMap::new();
            for (scope, version, _) in &picks {
                let _ = t.apply(&signed(*version, *scope, Mode::SubmitClosed), 2_000);
                let m = max.entry(*scope).or_insert(0);
                *m = (*m).max(*version);
            }
            for (scope, version) in max {
                prop_assert_eq!(t.version(scope), Some(version));
            }
        }

        /// From QUERY_ONLY, a scope reaches NORMAL only from RECOVERING 100, having raised
        /// RECOVERING by at most the step each time, and never passes through SHED_LOAD.
        #[test]
        fn query_only_reaches_normal_only_through_recovering(
            modes in proptest::collection::vec(mode_strategy(), 1..80),
        ) {
            let step = ModeConfig::default().recovering_step_percent_max;
            let mut t = table();
            let g = Scope::Global;
            let mut version = 0;
            let mut in_recovery = false;
            let mut ramp_percent = 0u8;
            let mut previous: Option<Mode> = None;
            for mode in modes {
                version += 1;
                let Ok(applied) = t.apply(&signed(version, g, mode), 2_000) else {
                    version -= 1;
                    continue;
                };
                prop_assert_eq!(applied.previous, previous);
                match mode {
                    Mode::QueryOnly => { in_recovery = true; ramp_percent = 0; }
                    Mode::Normal if in_recovery => {
                        prop_assert_eq!(previous, Some(rec(100)));
                        in_recovery = false;
                    }
                    Mode::Recovering { admit_percent } if in_recovery => {
                        prop_assert!(admit_percent <= ramp_percent.saturating_add(step));
                        ramp_percent = admit_percent;
                    }
                    Mode::SubmitClosed if in_recovery => ramp_percent = 0,
                    Mode::ShedLoad { .. } => prop_assert!(!in_recovery),
                    _ => {}
                }
                previous = Some(mode);
                // Persisting and restoring at any point keeps the obligation.
                let restored =
                    ModeTable::from_persisted(&t.to_persisted(), key(), ModeConfig::default());
                prop_assert!(restored.is_ok());
                t = restored.unwrap();
            }
        }
    }
}
