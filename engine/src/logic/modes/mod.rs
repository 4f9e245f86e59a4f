//! Degradation modes (DESIGN.md section 7, seed chapter 9 §6.9 and §8.1): what an operator
//! (or the control plane) may switch submissions to, as signed, versioned, scoped, expiring
//! snapshots, and the table every instance keeps of the snapshots it accepted.
//!
//! What it is:
//! - [`Mode`]: `NORMAL`, `SHED_LOAD` (admit a share), `SUBMIT_CLOSED`, `QUERY_ONLY`,
//!   `RECOVERING` (admit a share, raised in steps); [`Mode::metric_value`] for the gauge.
//! - [`ModeSnapshot`] with its [`Scope`] (global, activity, SKU), its canonical text
//!   ([`ModeSnapshot::canonical_text`]) and [`SignedSnapshot`] (HMAC-SHA256 over that text
//!   with `FLASHSALE_CONTROL_KEY`, an [`HmacKey`](flashsale_io::key::HmacKey) read by [`control_key`]); [`sign`] and
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
//!   `flashsale_io::key`'s 16..=64 bytes.
//!
//! Files: `types.rs` (modes, scopes, errors), `snapshot.rs` (signing, one spelling, the
//! snapshot bounds), `table.rs` (the rules, the effective mode), `persist.rs` (the persisted
//! text), `tests.rs`. This file only declares them and re-exports; no part imports it.
//!
//! What it is not: the transport (the JetStream KV watcher in `durable/modes.rs`, `POST
//! /admin/v1/mode`), the file I/O of persistence, or the admission decision itself
//! (`admission.rs`). No I/O, no clock (`now_ms` is an argument), no runtime.
//!
//! Read next: `admission.rs` (how the effective mode and the dependency health become a
//! submit decision), `circuit.rs`.

mod persist;
mod snapshot;
mod table;
#[cfg(test)]
mod tests;
mod types;

pub use snapshot::{
    control_key, sign, verify, ModeSnapshot, SignedSnapshot, ISSUER_LEN_MAX, SIGNED_JSON_LEN_MAX,
    SNAPSHOT_TEXT_LEN_MAX,
};
pub use table::{Applied, EffectiveMode, ModeConfig, ModeSource, ModeTable};
pub use types::{Mode, ModeError, Scope};
