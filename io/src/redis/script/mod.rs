//! The Rust binding of the `seckill` Redis Functions library (`lua/seckill.lua`).
//!
//! What it is, one file per concern:
//! - `client.rs`: [`Functions`], which calls the functions over a [`Router`](super::router::Router)
//!   (routed by the SKU's slot, `reserve` fenced) and reloads [`LIBRARY`] once on "function not
//!   found" (the function did not run, so resending is safe); [`load_library`].
//! - one file per function, mirroring it: `reserve.rs`, `mark_sent.rs`, `claim_due.rs`,
//!   `apply_result.rs`, `compensate.rs`, `preheat.rs`, `top_up.rs`, `restore.rs`. Each holds the
//!   typed arguments, the reply enum mirroring the function's closed set of replies, and the pure
//!   parser of that reply (unit-tested beside it).
//! - `keys.rs`: [`SkuKeys`] (the key names of one SKU, built once) and the per-call keys built
//!   on the stack; `error.rs`: [`ScriptError`]; `parse.rs`: the readers every parser shares.
//!
//! What it is not: a decision maker. It reports what the script answered; mapping replies to
//! HTTP states, publishing, and retry policy live in the engine. Reply parsing never panics on
//! what the server sent: anything outside a function's documented reply set is
//! [`ScriptError::UnexpectedReply`].
//!
//! Layout: this file only declares the children and re-exports what callers use; no child
//! imports it (each takes what it shares from its sibling), so the folder has no import circle.
//!
//! Read next: the contract comment above each function in `lua/seckill.lua` (KEYS, ARGV,
//! reply shape, invariants), and `tests/tests/lua_functions.rs` for every branch against a
//! real Redis.

mod apply_result;
mod claim_due;
mod client;
mod compensate;
mod error;
mod keys;
mod mark_sent;
mod parse;
mod preheat;
mod reserve;
mod restore;
mod top_up;

pub use apply_result::{
    parse_apply_result, parse_apply_results, ApplyResultArgs, ApplyResultReply, FinalOutcome,
    APPLY_RESULTS_MAX,
};
pub use claim_due::{parse_claim_due, ClaimDueArgs, ClaimDueReply, CLAIM_BATCH_MAX};
pub use client::{load_library, load_library_on, Functions, LIBRARY, LIBRARY_NAME};
pub use compensate::{parse_compensate, CompensateArgs, CompensateReply};
pub use error::ScriptError;
pub use keys::{KeyBuf, SkuKeys, ID_LEN_MAX};
pub use mark_sent::{parse_mark_sent, MarkSent, MarkSentArgs, MarkSentReply, MARK_SENT_MAX};
pub use preheat::{parse_preheat, PreheatArgs, PreheatReply};
pub use reserve::{parse_reserve, ActivityInvalidReason, RequestState, ReserveArgs, ReserveReply};
pub use restore::{
    parse_restore, RestoreLock, RestoreMeta, RestoreReply, RestoreReservation, RestoreStep,
};
pub use top_up::{parse_top_up, TopUpArgs, TopUpReply};
