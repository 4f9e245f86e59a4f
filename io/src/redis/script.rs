//! The Rust binding of the `seckill` Redis Functions library (`lua/seckill.lua`).
//!
//! What it is: [`LIBRARY`] (the Lua source, embedded), [`SkuKeys`] (the key names of one SKU,
//! built once), one typed argument struct and one reply enum per function mirroring the
//! function's closed set of replies, and [`Functions`], which calls them over a pipelined
//! [`RedisClient`] and reloads the library once on "function not found" (the function did
//! not run, so resending is safe).
//!
//! What it is not: a decision maker. It reports what the script answered; mapping replies to
//! HTTP states, publishing, and retry policy live in the engine. Reply parsing is pure
//! (`parse_*`, unit-tested below) and never panics on what the server sent: anything outside
//! a function's documented reply set is [`ScriptError::UnexpectedReply`].
//!
//! Read next: the contract comment above each function in `lua/seckill.lua` (KEYS, ARGV,
//! reply shape, invariants), and `tests/tests/lua_functions.rs` for every branch against a
//! real Redis.

use std::cell::Cell;
use std::fmt;

use bytes::BytesMut;

use crate::redis::cluster::Lane;
use crate::redis::connection::FenceOutcome;
use crate::redis::layout::{ActivityStatus, PendingEntry, PendingStatus};
use crate::redis::router::Router;
use crate::redis::slot::Slot;
use crate::redis::{RedisClient, RedisError};
use crate::resp::U64Text;
use crate::resp::{encode_fcall, Reply};

/// The library source, loaded with `FUNCTION LOAD REPLACE`.
pub const LIBRARY: &str = include_str!("../../../lua/seckill.lua");

/// The library name declared on the first line of [`LIBRARY`].
pub const LIBRARY_NAME: &str = "seckill";

/// Longest id (request, reservation, message, order, payload hash) the library accepts; the
/// Lua side enforces the same bound (`ID_LEN_MAX`).
pub const ID_LEN_MAX: usize = 128;

/// Most entries one `claim_due` call may claim; the Lua side rejects more (`CLAIM_BATCH_MAX`).
pub const CLAIM_BATCH_MAX: u32 = 512;

/// Longest SKU prefix: `seckill:{` + u64 + `:` + u64 + `}:`.
const PREFIX_LEN_MAX: usize = 9 + 20 + 1 + 20 + 2;

/// Longest key built per call: prefix + `resv:` / `comp:` / `user:` + an id, or prefix +
/// `req:` + a u64 user id + `:` + an id (the longest).
const KEY_LEN_MAX: usize = PREFIX_LEN_MAX + 4 + 20 + 1 + ID_LEN_MAX;

const _: () = assert!(KEY_LEN_MAX <= 224, "per-call keys live on the stack; keep them small");
const _: () = assert!(20 <= ID_LEN_MAX, "a u64 user id must fit where an id fits");

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Everything that is not a business outcome of a function call.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    /// The connection failed; see [`RedisError`] for whether the command may have run.
    #[error(transparent)]
    Redis(#[from] RedisError),
    /// Redis answered with an error reply (`-ERR seckill: bad now_ms`, `-READONLY ...`, a
    /// second "function not found" after the reload, ...).
    #[error("redis server error: {0}")]
    Server(String),
    /// The reply is outside the function's documented reply set (version skew or a bug). The
    /// function ran, so what it wrote is unknown.
    #[error("unexpected reply: {0}")]
    UnexpectedReply(String),
    /// An argument the library would reject (an id longer than [`ID_LEN_MAX`] or empty);
    /// nothing was sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// The library refused an argument (`-ERR seckill: bad <what>`): the function ran only its
    /// validation and wrote nothing. The node is healthy — this is bad input (or a binding
    /// bug), never a reason to open a circuit ([`ScriptError::is_refusal`]).
    #[error("refused by the seckill library: bad {0}")]
    Refused(String),
    /// `reserve` answered a reservation (CREATED, or IDEMPOTENT for one still queued) but the
    /// `WAIT` after it confirmed fewer than `min_replica_acks` replicas: it exists on the
    /// master and may vanish on failover. Never a promise: the engine answers `UNKNOWN` and
    /// the client retries with the same request id.
    #[error("reservation not confirmed by replicas ({acks} of {wanted} acknowledged)")]
    FenceShort { acks: u32, wanted: u32 },
}

/// Error-reply prefixes after which the server did not run the command and may accept it a
/// moment later (failover, loading, a busy script, memory pressure, cluster reconfiguration).
const TRANSIENT_SERVER_ERRORS: [&str; 7] =
    ["LOADING", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY", "OOM"];

impl ScriptError {
    /// Worth retrying (with the same ids) after a backoff.
    pub fn is_transient(&self) -> bool {
        match self {
            ScriptError::Redis(e) => e.is_transient(),
            ScriptError::Server(message) => {
                TRANSIENT_SERVER_ERRORS.iter().any(|prefix| message.starts_with(prefix))
            }
            ScriptError::UnexpectedReply(_)
            | ScriptError::InvalidArgument(_)
            | ScriptError::Refused(_) => false,
            ScriptError::FenceShort { .. } => true,
        }
    }

    /// An argument was refused (by this binding before sending, or by the library's own
    /// validation): the store is fine and nothing was written. Counts as a healthy answer,
    /// never as a node failure: one buyer's bad value must not close a shard for everyone
    /// (issue 23).
    pub fn is_refusal(&self) -> bool {
        matches!(self, ScriptError::InvalidArgument(_) | ScriptError::Refused(_))
    }

    /// The function may have run: the caller must not assume either outcome (answer
    /// `UNKNOWN`, never release stock, retry only with the same ids).
    pub fn outcome_unknown(&self) -> bool {
        match self {
            ScriptError::Redis(e) => e.outcome_unknown(),
            // The script ran and replied something we cannot read: what it wrote is unknown.
            ScriptError::UnexpectedReply(_) => true,
            // It ran on the master; whether it survives a failover is unknown.
            ScriptError::FenceShort { .. } => true,
            // An error reply means the function did not run or failed in validation, before
            // any write (the library validates first); nothing was sent for InvalidArgument.
            ScriptError::Server(_) | ScriptError::InvalidArgument(_) | ScriptError::Refused(_) => {
                false
            }
        }
    }
}

fn unexpected(function: &str, what: &str, reply: &Reply) -> ScriptError {
    ScriptError::UnexpectedReply(format!("{function}: {what} in {reply:?}"))
}

// ---------------------------------------------------------------------------------------------
// Keys
// ---------------------------------------------------------------------------------------------

/// The key names of one SKU (`seckill:{A:S}:...`, CONTRACT.md section 5), built once per SKU.
/// Per-call keys (user, request, reservation, compensation marker) are written into a
/// [`KeyBuf`] on the stack, so a call allocates no key strings.
#[derive(Debug, Clone)]
pub struct SkuKeys {
    /// The Redis Cluster slot of every key of this SKU (they share the `{A:S}` hash tag).
    slot: Slot,
    prefix: String,
    meta: String,
    stock: String,
    pending: String,
    stuck: String,
    soldout: String,
}

impl SkuKeys {
    pub fn new(activity_id: u64, sku_id: u64) -> SkuKeys {
        let prefix = format!("seckill:{{{activity_id}:{sku_id}}}:");
        debug_assert!(prefix.len() <= PREFIX_LEN_MAX);
        SkuKeys {
            slot: Slot::of_key(prefix.as_bytes()),
            meta: format!("{prefix}meta"),
            stock: format!("{prefix}stock"),
            pending: format!("{prefix}resv:pending"),
            stuck: format!("{prefix}resv:stuck"),
            soldout: format!("{prefix}soldout"),
            prefix,
        }
    }

    /// The slot all of this SKU's keys live in: what every call for this SKU routes by.
    pub fn slot(&self) -> Slot {
        self.slot
    }

    /// `seckill:{A:S}:`, the `key_prefix` argument of `claim_due`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    pub fn meta(&self) -> &str {
        &self.meta
    }
    pub fn stock(&self) -> &str {
        &self.stock
    }
    /// `resv:pending`: reservations whose outcome has not reached Redis, by next_retry_at.
    pub fn pending(&self) -> &str {
        &self.pending
    }
    /// `resv:stuck`: reservations past the recovery deadline, by the time they got stuck.
    pub fn stuck(&self) -> &str {
        &self.stuck
    }
    pub fn soldout(&self) -> &str {
        &self.soldout
    }

    pub fn user(&self, user_id: u64) -> KeyBuf {
        let digits = U64Text::new(user_id);
        // A u64 always fits (checked at compile time above), so this cannot fail.
        KeyBuf::build(&self.prefix, "user:", digits.as_bytes())
            .unwrap_or_else(|| unreachable!("u64 user key exceeds KEY_LEN_MAX"))
    }

    /// `req:{user_id}:{request_id}`: a request id is the buyer's own (another buyer can
    /// neither see nor squat it).
    pub fn req(&self, user_id: u64, request_id: &str) -> Result<KeyBuf, ScriptError> {
        check_id(request_id, "request_id")?;
        let digits = U64Text::new(user_id);
        let parts: [&[u8]; 4] = [b"req:", digits.as_bytes(), b":", request_id.as_bytes()];
        KeyBuf::build_parts(&self.prefix, &parts).ok_or(ScriptError::InvalidArgument("request_id"))
    }

    pub fn resv(&self, reservation_id: &str) -> Result<KeyBuf, ScriptError> {
        self.with_id("resv:", reservation_id, "reservation_id")
    }

    pub fn comp(&self, reservation_id: &str) -> Result<KeyBuf, ScriptError> {
        self.with_id("comp:", reservation_id, "reservation_id")
    }

    fn with_id(&self, kind: &str, id: &str, name: &'static str) -> Result<KeyBuf, ScriptError> {
        check_id(id, name)?;
        KeyBuf::build(&self.prefix, kind, id.as_bytes()).ok_or(ScriptError::InvalidArgument(name))
    }
}

fn check_id(id: &str, name: &'static str) -> Result<(), ScriptError> {
    if id.is_empty() || id.len() > ID_LEN_MAX {
        return Err(ScriptError::InvalidArgument(name));
    }
    Ok(())
}

/// A key built on the stack: prefix + kind + id, at most [`KEY_LEN_MAX`] bytes.
#[derive(Clone, Copy)]
pub struct KeyBuf {
    len: usize,
    bytes: [u8; KEY_LEN_MAX],
}

impl KeyBuf {
    fn build(prefix: &str, kind: &str, id: &[u8]) -> Option<KeyBuf> {
        KeyBuf::build_parts(prefix, &[kind.as_bytes(), id])
    }

    fn build_parts(prefix: &str, parts: &[&[u8]]) -> Option<KeyBuf> {
        let len = prefix.len() + parts.iter().map(|p| p.len()).sum::<usize>();
        if len > KEY_LEN_MAX {
            return None;
        }
        let mut bytes = [0u8; KEY_LEN_MAX];
        bytes[..prefix.len()].copy_from_slice(prefix.as_bytes());
        let mut at = prefix.len();
        for part in parts {
            bytes[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
        Some(KeyBuf { len, bytes })
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// The key as text (keys are built from UTF-8 parts, so this is lossless).
    pub fn as_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(self.as_bytes())
    }
}

impl fmt::Debug for KeyBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyBuf({:?})", self.as_str())
    }
}

fn flag(on: bool) -> &'static [u8] {
    if on {
        b"1"
    } else {
        b"0"
    }
}

// ---------------------------------------------------------------------------------------------
// Arguments and replies, one pair per function
// ---------------------------------------------------------------------------------------------

/// `reserve` arguments. The ids are generated by the caller BEFORE the call and reused on
/// every retry of the same request (DESIGN.md section 2).
#[derive(Debug, Clone, Copy)]
pub struct ReserveArgs<'a> {
    pub request_id: &'a str,
    pub user_id: u64,
    pub payload_hash: &'a str,
    pub reservation_id: &'a str,
    pub message_id: &'a str,
    pub now_ms: u64,
    /// How long the first publish may take before the scanner republishes.
    pub pending_grace_ms: u64,
}

/// The state a request record (`req` hash) is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestState {
    /// Reserved; the order-create message is not confirmed in the log yet.
    QueuedPending,
    /// Reserved; the message is in the log.
    Queued,
    /// The order was created (`order_id` set).
    Succeeded,
    /// The reservation ended without an order (`reason_code` set).
    Failed,
}

impl RequestState {
    pub fn as_str(self) -> &'static str {
        match self {
            RequestState::QueuedPending => "QUEUED_PENDING",
            RequestState::Queued => "QUEUED",
            RequestState::Succeeded => "SUCCEEDED",
            RequestState::Failed => "FAILED",
        }
    }

    pub fn parse(s: &str) -> Option<RequestState> {
        Some(match s {
            "QUEUED_PENDING" => RequestState::QueuedPending,
            "QUEUED" => RequestState::Queued,
            "SUCCEEDED" => RequestState::Succeeded,
            "FAILED" => RequestState::Failed,
            _ => return None,
        })
    }
}

/// Why `reserve` found the activity not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivityInvalidReason {
    /// No `meta` for this SKU (never preheated, or Redis lost it).
    Unknown,
    /// `meta.status` is `PENDING`.
    Pending,
    /// ACTIVE but `now_ms < start_ms`.
    NotStarted,
    /// ACTIVE but `now_ms >= end_ms`, or `meta.status` is `ENDED`.
    Ended,
    /// `meta.status` is `TERMINATED`.
    Terminated,
}

impl ActivityInvalidReason {
    fn parse(s: &str) -> Option<ActivityInvalidReason> {
        Some(match s {
            "UNKNOWN" => ActivityInvalidReason::Unknown,
            "PENDING" => ActivityInvalidReason::Pending,
            "NOT_STARTED" => ActivityInvalidReason::NotStarted,
            "ENDED" => ActivityInvalidReason::Ended,
            "TERMINATED" => ActivityInvalidReason::Terminated,
            _ => return None,
        })
    }
}

/// The closed reply set of `reserve`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveReply {
    /// Stock pre-reserved under the ids of the call (checked to be echoed back);
    /// `stock_after` is what is left, 0 meaning this call sold the SKU out.
    Created {
        stock_after: u64,
        /// `resv.expires_at`: `now_ms` + the SKU's `meta.reservation_ttl_ms`, as `reserve`
        /// wrote it (the order-create message carries the same instant).
        expires_at_ms: u64,
    },
    /// This request was recorded before with the same payload: its first result.
    Idempotent {
        reservation_id: String,
        message_id: String,
        state: RequestState,
        order_id: Option<String>,
        reason_code: Option<String>,
    },
    /// Same request id, different payload.
    IdempotencyConflict,
    ActivityInvalid {
        reason: ActivityInvalidReason,
    },
    /// The user already holds this reservation for the SKU.
    DuplicateUser {
        reservation_id: String,
    },
    SoldOut,
}

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

/// A reservation's final outcome, as decided by PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalOutcome<'a> {
    OrderCreated { order_id: &'a str },
    Failed { reason_code: &'a str },
}

#[derive(Debug, Clone, Copy)]
pub struct ApplyResultArgs<'a> {
    pub request_id: &'a str,
    pub reservation_id: &'a str,
    pub outcome: FinalOutcome<'a>,
    pub now_ms: u64,
    /// The next three recreate the `req` hash if Redis lost it.
    pub payload_hash: &'a str,
    pub message_id: &'a str,
    pub user_id: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyResultReply {
    Applied,
    /// The same outcome was recorded before; nothing changed.
    Already,
    /// A different final outcome is recorded; nothing changed.
    Conflict,
}

/// `compensate` arguments: which of the reservation's Redis effects to undo (the flags of the
/// compensation event).
#[derive(Debug, Clone, Copy)]
pub struct CompensateArgs<'a> {
    pub reservation_id: &'a str,
    pub request_id: &'a str,
    pub user_id: u64,
    pub return_stock: bool,
    pub release_user: bool,
    pub reason_code: &'a str,
    pub now_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompensateReply {
    Applied {
        stock_after: u64,
    },
    /// This reservation was compensated before; nothing changed.
    AlreadyApplied,
}

#[derive(Debug, Clone, Copy)]
pub struct PreheatArgs {
    pub status: ActivityStatus,
    pub start_ms: u64,
    pub end_ms: u64,
    pub version: u64,
    pub reservation_ttl_ms: u64,
    /// Initial stock; written only if the SKU has no stock key yet.
    pub stock: u64,
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

// ---------------------------------------------------------------------------------------------
// Calls
// ---------------------------------------------------------------------------------------------

/// `FUNCTION LOAD REPLACE <LIBRARY>`.
pub async fn load_library(client: &RedisClient) -> Result<(), ScriptError> {
    let reply = client.command(&[b"FUNCTION", b"LOAD", b"REPLACE", LIBRARY.as_bytes()]).await?;
    check_loaded(&reply)
}

/// `FUNCTION LOAD REPLACE <LIBRARY>` on one node of a router.
pub async fn load_library_on(
    router: &Router,
    node: std::net::SocketAddr,
) -> Result<(), ScriptError> {
    let args: [&[u8]; 4] = [b"FUNCTION", b"LOAD", b"REPLACE", LIBRARY.as_bytes()];
    let reply = router.request_on(node, |buf| crate::resp::encode_command(buf, &args)).await?;
    check_loaded(&reply)
}

fn check_loaded(reply: &Reply) -> Result<(), ScriptError> {
    match reply {
        Reply::Bulk(name) | Reply::Simple(name) if name.as_ref() == LIBRARY_NAME.as_bytes() => {
            Ok(())
        }
        Reply::Error(message) => Err(server_error(message)),
        _ => Err(unexpected("FUNCTION LOAD", "not the library name", reply)),
    }
}

/// The `seckill` functions over one [`Router`]: a standalone server or a Redis Cluster, with
/// the same call sites (not `Sync`: share it between a shard's tasks with `Rc`). Every call
/// routes by its SKU's slot ([`SkuKeys::slot`]); `reserve` takes the fenced lane.
pub struct Functions {
    router: Router,
    /// A standalone server's library generation (a cluster keeps one per node): bumped after
    /// each load, so tasks that all saw "function not found" reload once between them.
    library_generation: Cell<u64>,
    reload: futures::lock::Mutex<()>,
    /// The connection [`Functions::client`] hands out (see there).
    unrouted: RedisClient,
}

impl Functions {
    /// Over one standalone connection, without replica fencing.
    pub fn new(client: RedisClient) -> Functions {
        Functions::over(Router::standalone(client))
    }

    /// Over any router (standalone or cluster, fenced or not).
    pub fn over(router: Router) -> Functions {
        let unrouted = router.first_client();
        Functions {
            router,
            library_generation: Cell::new(0),
            reload: futures::lock::Mutex::new(()),
            unrouted,
        }
    }

    /// Loads the library on every master (start-up; a promoted replica already has it).
    pub async fn load_everywhere(&self) -> Result<(), ScriptError> {
        for node in self.router.masters() {
            load_library_on(&self.router, node).await?;
        }
        Ok(())
    }

    pub fn router(&self) -> &Router {
        &self.router
    }

    /// A command of the caller's own (a typed read, `SMEMBERS seckill:active-skus`), routed
    /// by the slot of its keys, on the plain lane. Error replies are values here.
    pub async fn command(&self, slot: Slot, args: &[&[u8]]) -> Result<Reply, ScriptError> {
        Ok(self.router.command(slot, args).await?)
    }

    /// The standalone connection. Over a cluster: the plain connection to the first master
    /// of the map at start, UNROUTED — a command for another master's key gets `-MOVED` as
    /// an error reply (never a wrong answer). Kept for the call sites written before the
    /// cluster; new code uses [`Functions::command`].
    pub fn client(&self) -> &RedisClient {
        &self.unrouted
    }

    /// Sends one FCALL routed by `slot`; on "function not found" loads the library on the
    /// node that said so (once across concurrent callers) and resends once. Server error
    /// replies become [`ScriptError::Server`]. The fence is that of the lane.
    async fn fcall(
        &self,
        slot: Slot,
        lane: Lane,
        function: &'static str,
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> Result<(Reply, FenceOutcome), ScriptError> {
        let encode = |buf: &mut BytesMut| encode_fcall(buf, function.as_bytes(), keys, args);
        let routed = self.router.request(slot, lane, encode).await?;
        let routed = match &routed.reply {
            Reply::Error(message) if is_function_not_found(message) => {
                let generation = self.generation_of(routed.node);
                self.reload_after(routed.node, generation).await?;
                self.router.request(slot, lane, encode).await?
            }
            _ => routed,
        };
        match routed.reply {
            Reply::Error(message) => Err(server_error(&message)),
            reply => Ok((reply, routed.fence)),
        }
    }

    fn generation_of(&self, node: std::net::SocketAddr) -> u64 {
        match self.router.cluster() {
            Some(cluster) => cluster.library_generation(node),
            None => self.library_generation.get(),
        }
    }

    /// Loads the library on `node` unless someone did since `seen_generation` was read (then
    /// the library is already back and resending is enough).
    async fn reload_after(
        &self,
        node: std::net::SocketAddr,
        seen_generation: u64,
    ) -> Result<(), ScriptError> {
        let _guard = self.reload.lock().await;
        if self.generation_of(node) == seen_generation {
            tracing::warn!(%node, "redis: function not found; loading the seckill library");
            load_library_on(&self.router, node).await?;
            let next = seen_generation.wrapping_add(1);
            match self.router.cluster() {
                Some(cluster) => cluster.set_library_generation(node, next),
                None => self.library_generation.set(next),
            }
        }
        Ok(())
    }

    /// The hot path: one atomic pre-reservation attempt. Keys and numbers are formatted on the
    /// stack and encoded straight into the pipeline buffer.
    pub async fn reserve(
        &self,
        keys: &SkuKeys,
        args: &ReserveArgs<'_>,
    ) -> Result<ReserveReply, ScriptError> {
        check_id(args.payload_hash, "payload_hash")?;
        check_id(args.message_id, "message_id")?;
        let user = keys.user(args.user_id);
        let req = keys.req(args.user_id, args.request_id)?;
        let resv = keys.resv(args.reservation_id)?;
        let user_id = U64Text::new(args.user_id);
        let now_ms = U64Text::new(args.now_ms);
        let grace_ms = U64Text::new(args.pending_grace_ms);
        let (reply, fence) = self
            .fcall(
                keys.slot(),
                Lane::Fenced,
                "reserve",
                &[
                    keys.meta.as_bytes(),
                    keys.stock.as_bytes(),
                    user.as_bytes(),
                    req.as_bytes(),
                    resv.as_bytes(),
                    keys.pending.as_bytes(),
                    keys.soldout.as_bytes(),
                ],
                &[
                    args.request_id.as_bytes(),
                    user_id.as_bytes(),
                    args.payload_hash.as_bytes(),
                    args.reservation_id.as_bytes(),
                    args.message_id.as_bytes(),
                    now_ms.as_bytes(),
                    grace_ms.as_bytes(),
                ],
            )
            .await?;
        fenced(parse_reserve(reply, args)?, fence)
    }

    /// Marks a batch of one SKU's reservations sent; one reply per reservation, in order.
    pub async fn mark_sent(
        &self,
        keys: &SkuKeys,
        args: &MarkSentArgs<'_>,
    ) -> Result<Vec<MarkSentReply>, ScriptError> {
        let n = args.marks.len();
        if n == 0 || n > MARK_SENT_MAX {
            return Err(ScriptError::InvalidArgument("marks"));
        }
        let mut owned = Vec::with_capacity(2 * n);
        for mark in args.marks {
            owned.push(keys.resv(mark.reservation_id)?);
            owned.push(keys.req(mark.user_id, mark.request_id)?);
        }
        let mut key_refs: Vec<&[u8]> = Vec::with_capacity(1 + 2 * n);
        key_refs.push(keys.pending.as_bytes());
        key_refs.extend(owned.iter().map(|k| k.as_bytes()));
        let now_ms = U64Text::new(args.now_ms);
        let deadline_ms = U64Text::new(args.order_deadline_ms);
        let mut arg_refs: Vec<&[u8]> = Vec::with_capacity(2 + n);
        arg_refs.extend([now_ms.as_bytes(), deadline_ms.as_bytes()]);
        arg_refs.extend(args.marks.iter().map(|m| m.reservation_id.as_bytes()));
        let (reply, _plain) =
            self.fcall(keys.slot(), Lane::Plain, "mark_sent", &key_refs, &arg_refs).await?;
        parse_mark_sent(reply, n)
    }

    pub async fn claim_due(
        &self,
        keys: &SkuKeys,
        args: &ClaimDueArgs,
    ) -> Result<ClaimDueReply, ScriptError> {
        let now_ms = U64Text::new(args.now_ms);
        let batch_max = U64Text::new(u64::from(args.batch_max));
        let base_ms = U64Text::new(args.backoff_base_ms);
        let max_ms = U64Text::new(args.backoff_max_ms);
        let recovery_ms = U64Text::new(args.recovery_deadline_ms);
        let (reply, _plain) = self
            .fcall(
                keys.slot(),
                Lane::Plain,
                "claim_due",
                &[keys.pending.as_bytes(), keys.stuck.as_bytes()],
                &[
                    keys.prefix.as_bytes(),
                    now_ms.as_bytes(),
                    batch_max.as_bytes(),
                    base_ms.as_bytes(),
                    max_ms.as_bytes(),
                    recovery_ms.as_bytes(),
                ],
            )
            .await?;
        parse_claim_due(reply)
    }

    pub async fn apply_result(
        &self,
        keys: &SkuKeys,
        args: &ApplyResultArgs<'_>,
    ) -> Result<ApplyResultReply, ScriptError> {
        check_id(args.payload_hash, "payload_hash")?;
        check_id(args.message_id, "message_id")?;
        let req = keys.req(args.user_id, args.request_id)?;
        let resv = keys.resv(args.reservation_id)?;
        let (outcome, order_id, reason_code): (&[u8], &str, &str) = match args.outcome {
            FinalOutcome::OrderCreated { order_id } => {
                check_id(order_id, "order_id")?;
                (b"ORDER_CREATED", order_id, "")
            }
            FinalOutcome::Failed { reason_code } => {
                check_id(reason_code, "reason_code")?;
                (b"FAILED", "", reason_code)
            }
        };
        let now_ms = U64Text::new(args.now_ms);
        let user_id = U64Text::new(args.user_id);
        let (reply, _plain) = self
            .fcall(
                keys.slot(),
                Lane::Plain,
                "apply_result",
                &[req.as_bytes(), resv.as_bytes(), keys.pending.as_bytes(), keys.stuck.as_bytes()],
                &[
                    args.reservation_id.as_bytes(),
                    outcome,
                    order_id.as_bytes(),
                    reason_code.as_bytes(),
                    now_ms.as_bytes(),
                    args.request_id.as_bytes(),
                    args.payload_hash.as_bytes(),
                    args.message_id.as_bytes(),
                    user_id.as_bytes(),
                ],
            )
            .await?;
        parse_apply_result(reply)
    }

    pub async fn compensate(
        &self,
        keys: &SkuKeys,
        args: &CompensateArgs<'_>,
    ) -> Result<CompensateReply, ScriptError> {
        check_id(args.reason_code, "reason_code")?;
        let comp = keys.comp(args.reservation_id)?;
        let user = keys.user(args.user_id);
        let resv = keys.resv(args.reservation_id)?;
        let req = keys.req(args.user_id, args.request_id)?;
        let now_ms = U64Text::new(args.now_ms);
        // Negative control (tests/tests/negative_controls.rs): the marker is forgotten before
        // the call, so `compensate` cannot tell a second compensation from the first.
        #[cfg(feature = "failpoints")]
        if crate::negctl::switched_off("negctl.comp_marker_off") {
            self.command(keys.slot(), &[b"DEL", comp.as_bytes()]).await?;
        }
        let (reply, _plain) = self
            .fcall(
                keys.slot(),
                Lane::Plain,
                "compensate",
                &[
                    comp.as_bytes(),
                    keys.stock.as_bytes(),
                    user.as_bytes(),
                    resv.as_bytes(),
                    req.as_bytes(),
                    keys.pending.as_bytes(),
                    keys.soldout.as_bytes(),
                    keys.stuck.as_bytes(),
                ],
                &[
                    args.reservation_id.as_bytes(),
                    flag(args.return_stock),
                    flag(args.release_user),
                    args.reason_code.as_bytes(),
                    now_ms.as_bytes(),
                ],
            )
            .await?;
        parse_compensate(reply)
    }

    pub async fn preheat(
        &self,
        keys: &SkuKeys,
        args: &PreheatArgs,
    ) -> Result<PreheatReply, ScriptError> {
        let start_ms = U64Text::new(args.start_ms);
        let end_ms = U64Text::new(args.end_ms);
        let version = U64Text::new(args.version);
        let ttl_ms = U64Text::new(args.reservation_ttl_ms);
        let stock = U64Text::new(args.stock);
        let (reply, _plain) = self
            .fcall(
                keys.slot(),
                Lane::Plain,
                "preheat",
                &[keys.meta.as_bytes(), keys.stock.as_bytes(), keys.soldout.as_bytes()],
                &[
                    args.status.as_str().as_bytes(),
                    start_ms.as_bytes(),
                    end_ms.as_bytes(),
                    version.as_bytes(),
                    ttl_ms.as_bytes(),
                    stock.as_bytes(),
                ],
            )
            .await?;
        parse_preheat(reply)
    }

    pub async fn top_up(
        &self,
        keys: &SkuKeys,
        args: &TopUpArgs,
    ) -> Result<TopUpReply, ScriptError> {
        let add = U64Text::new(args.add);
        let version = U64Text::new(args.version);
        let (reply, _plain) = self
            .fcall(
                keys.slot(),
                Lane::Plain,
                "top_up",
                &[keys.meta.as_bytes(), keys.stock.as_bytes(), keys.soldout.as_bytes()],
                &[add.as_bytes(), version.as_bytes()],
            )
            .await?;
        parse_top_up(reply)
    }
}

// ---------------------------------------------------------------------------------------------
// Reply parsing (pure; never panics on server input)
// ---------------------------------------------------------------------------------------------

/// A reservation the buyer could be told about (CREATED, or a replay of one still queued)
/// is only passed on when its fence held; otherwise [`ScriptError::FenceShort`].
/// Answers that promise nothing new (sold out, conflict, a final state that PostgreSQL
/// decided) pass through whatever the fence said.
fn fenced(reply: ReserveReply, fence: FenceOutcome) -> Result<ReserveReply, ScriptError> {
    let promises = match &reply {
        ReserveReply::Created { .. } => true,
        ReserveReply::Idempotent { state, .. } => {
            matches!(state, RequestState::Queued | RequestState::QueuedPending)
        }
        _ => false,
    };
    match fence {
        FenceOutcome::Short { acks, wanted } if promises => {
            Err(ScriptError::FenceShort { acks, wanted })
        }
        _ => Ok(reply),
    }
}

fn is_function_not_found(message: &[u8]) -> bool {
    // Redis 7: "ERR Function not found". Matched without the prefix so a proxy that rewrites
    // the error code still triggers the reload.
    const NEEDLE: &[u8] = b"Function not found";
    message.windows(NEEDLE.len()).any(|w| w == NEEDLE)
}

/// The library's validation replies (`bad()` in `lua/seckill.lua`) begin with this.
const LIBRARY_REFUSAL: &str = "ERR seckill: bad ";

fn server_error(message: &[u8]) -> ScriptError {
    let message = String::from_utf8_lossy(message);
    match message.strip_prefix(LIBRARY_REFUSAL) {
        Some(what) => ScriptError::Refused(what.to_owned()),
        None => ScriptError::Server(message.into_owned()),
    }
}

/// A string element (Lua strings arrive as bulk strings; status replies as simple strings).
fn text(reply: &Reply) -> Option<&str> {
    match reply {
        Reply::Bulk(b) | Reply::Simple(b) => std::str::from_utf8(b).ok(),
        _ => None,
    }
}

fn owned(reply: &Reply) -> Option<String> {
    text(reply).map(str::to_owned)
}

/// "" means absent in the library's flat replies.
fn optional(reply: &Reply) -> Option<Option<String>> {
    text(reply).map(|s| if s.is_empty() { None } else { Some(s.to_owned()) })
}

/// An integer element: an integer reply, or a bulk string of decimal digits (hash fields).
fn int(reply: &Reply) -> Option<i64> {
    match reply {
        Reply::Integer(n) => Some(*n),
        Reply::Bulk(b) | Reply::Simple(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

fn uint(reply: &Reply) -> Option<u64> {
    int(reply).and_then(|n| u64::try_from(n).ok())
}

fn array<'r>(function: &str, reply: &'r Reply, len: usize) -> Result<&'r [Reply], ScriptError> {
    match reply {
        Reply::Array(items) if items.len() == len => Ok(items),
        _ => Err(unexpected(function, "wrong shape", reply)),
    }
}

/// Parses a `reserve` reply: `[code, reservation_id, message_id, state, order_id, reason_code,
/// stock_after, expires_at]`. A CREATED reply must echo the ids that were sent.
pub fn parse_reserve(reply: Reply, sent: &ReserveArgs<'_>) -> Result<ReserveReply, ScriptError> {
    const F: &str = "reserve";
    let items = array(F, &reply, 8)?;
    let bad = |what: &str| unexpected(F, what, &reply);
    let code = text(&items[0]).ok_or_else(|| bad("code"))?;
    match code {
        "CREATED" => {
            let echoed = text(&items[1]) == Some(sent.reservation_id)
                && text(&items[2]) == Some(sent.message_id);
            if !echoed {
                return Err(bad("ids not echoed"));
            }
            let stock_after = uint(&items[6]).ok_or_else(|| bad("stock_after"))?;
            let expires_at_ms = uint(&items[7]).ok_or_else(|| bad("expires_at"))?;
            Ok(ReserveReply::Created { stock_after, expires_at_ms })
        }
        "IDEMPOTENT" => {
            let reservation_id = owned(&items[1]).filter(|s| !s.is_empty());
            let message_id = owned(&items[2]).filter(|s| !s.is_empty());
            let state = text(&items[3]).and_then(RequestState::parse);
            match (reservation_id, message_id, state, optional(&items[4]), optional(&items[5])) {
                (
                    Some(reservation_id),
                    Some(message_id),
                    Some(state),
                    Some(order_id),
                    Some(reason),
                ) => Ok(ReserveReply::Idempotent {
                    reservation_id,
                    message_id,
                    state,
                    order_id,
                    reason_code: reason,
                }),
                _ => Err(bad("idempotent fields")),
            }
        }
        "IDEMPOTENCY_CONFLICT" => Ok(ReserveReply::IdempotencyConflict),
        "ACTIVITY_INVALID" => {
            let reason = text(&items[5])
                .and_then(ActivityInvalidReason::parse)
                .ok_or_else(|| bad("reason"))?;
            Ok(ReserveReply::ActivityInvalid { reason })
        }
        "DUPLICATE_USER" => {
            let reservation_id =
                owned(&items[1]).filter(|s| !s.is_empty()).ok_or_else(|| bad("reservation_id"))?;
            Ok(ReserveReply::DuplicateUser { reservation_id })
        }
        "SOLD_OUT" => Ok(ReserveReply::SoldOut),
        _ => Err(bad("code")),
    }
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

/// Fields per claimed entry in a `claim_due` reply.
const CLAIM_ENTRY_FIELDS: usize = 9;

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
    let [id, message, request, user, hash, reserved_at, expires_at, attempts, status] = f else {
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
    })
}

pub fn parse_apply_result(reply: Reply) -> Result<ApplyResultReply, ScriptError> {
    match text(&reply) {
        Some("APPLIED") => Ok(ApplyResultReply::Applied),
        Some("ALREADY") => Ok(ApplyResultReply::Already),
        Some("CONFLICT") => Ok(ApplyResultReply::Conflict),
        _ => Err(unexpected("apply_result", "code", &reply)),
    }
}

/// Parses `[code, stock]`.
pub fn parse_compensate(reply: Reply) -> Result<CompensateReply, ScriptError> {
    const F: &str = "compensate";
    let items = array(F, &reply, 2)?;
    let stock = uint(&items[1]);
    match (text(&items[0]), stock) {
        (Some("APPLIED"), Some(stock_after)) => Ok(CompensateReply::Applied { stock_after }),
        (Some("ALREADY_APPLIED"), Some(_)) => Ok(CompensateReply::AlreadyApplied),
        _ => Err(unexpected(F, "code or stock", &reply)),
    }
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn bulk(s: &str) -> Reply {
        Reply::Bulk(Bytes::copy_from_slice(s.as_bytes()))
    }

    fn arr(items: Vec<Reply>) -> Reply {
        Reply::Array(items)
    }

    fn reserve_reply(code: &str, f: [&str; 5], stock: i64) -> Reply {
        let mut items = vec![bulk(code)];
        items.extend(f.iter().map(|s| bulk(s)));
        items.push(Reply::Integer(stock));
        // `reserve` reports the expiry only for CREATED (-1 otherwise).
        items.push(Reply::Integer(if code == "CREATED" { 301_000 } else { -1 }));
        arr(items)
    }

    const SENT: ReserveArgs<'static> = ReserveArgs {
        request_id: "req_1",
        user_id: 30001,
        payload_hash: "sha256:ab",
        reservation_id: "resv_1",
        message_id: "msg_1",
        now_ms: 1_000,
        pending_grace_ms: 500,
    };

    fn expect_unexpected<T: fmt::Debug>(r: Result<T, ScriptError>) {
        match r {
            Err(ScriptError::UnexpectedReply(_)) => {}
            other => panic!("expected UnexpectedReply, got {other:?}"),
        }
    }

    #[test]
    fn keys_follow_the_contract() {
        let keys = SkuKeys::new(10001, 20001);
        assert_eq!(keys.prefix(), "seckill:{10001:20001}:");
        assert_eq!(keys.meta(), "seckill:{10001:20001}:meta");
        assert_eq!(keys.stock(), "seckill:{10001:20001}:stock");
        assert_eq!(keys.pending(), "seckill:{10001:20001}:resv:pending");
        assert_eq!(keys.stuck(), "seckill:{10001:20001}:resv:stuck");
        assert_eq!(keys.soldout(), "seckill:{10001:20001}:soldout");
        assert_eq!(keys.user(30001).as_str(), "seckill:{10001:20001}:user:30001");
        assert_eq!(keys.user(0).as_str(), "seckill:{10001:20001}:user:0");
        assert_eq!(keys.req(30001, "r1").unwrap().as_str(), "seckill:{10001:20001}:req:30001:r1");
        assert_eq!(keys.resv("v1").unwrap().as_str(), "seckill:{10001:20001}:resv:v1");
        assert_eq!(keys.comp("v1").unwrap().as_str(), "seckill:{10001:20001}:comp:v1");
    }

    #[test]
    fn longest_keys_fit_and_overlong_ids_are_refused() {
        let keys = SkuKeys::new(u64::MAX, u64::MAX);
        let id = "x".repeat(ID_LEN_MAX);
        let key = keys.resv(&id).unwrap();
        assert_eq!(key.as_bytes().len(), keys.prefix().len() + 5 + ID_LEN_MAX);
        assert_eq!(keys.user(u64::MAX).as_str(), format!("{}user:{}", keys.prefix(), u64::MAX));
        let too_long = "x".repeat(ID_LEN_MAX + 1);
        let longest = keys.req(u64::MAX, &id).unwrap();
        assert_eq!(longest.as_bytes().len(), keys.prefix().len() + 4 + 20 + 1 + ID_LEN_MAX);
        let too_long_req = keys.req(1, &too_long);
        assert!(matches!(too_long_req, Err(ScriptError::InvalidArgument("request_id"))));
        assert!(matches!(keys.comp(""), Err(ScriptError::InvalidArgument("reservation_id"))));
    }

    #[test]
    fn u64_text() {
        for n in [0, 7, 10, 1_234_567_890_123, u64::MAX] {
            assert_eq!(U64Text::new(n).as_bytes(), n.to_string().as_bytes());
        }
    }

    #[test]
    fn reserve_created() {
        let r = reserve_reply("CREATED", ["resv_1", "msg_1", "QUEUED_PENDING", "", ""], 99);
        assert_eq!(
            parse_reserve(r, &SENT).unwrap(),
            ReserveReply::Created { stock_after: 99, expires_at_ms: 301_000 }
        );
    }

    #[test]
    fn reserve_created_must_echo_ids_and_a_stock() {
        let other = reserve_reply("CREATED", ["resv_2", "msg_1", "QUEUED_PENDING", "", ""], 1);
        expect_unexpected(parse_reserve(other, &SENT));
        let negative = reserve_reply("CREATED", ["resv_1", "msg_1", "QUEUED_PENDING", "", ""], -1);
        expect_unexpected(parse_reserve(negative, &SENT));
    }

    #[test]
    fn reserve_idempotent() {
        let r = reserve_reply("IDEMPOTENT", ["resv_0", "msg_0", "SUCCEEDED", "ord_1", ""], -1);
        assert_eq!(
            parse_reserve(r, &SENT).unwrap(),
            ReserveReply::Idempotent {
                reservation_id: "resv_0".into(),
                message_id: "msg_0".into(),
                state: RequestState::Succeeded,
                order_id: Some("ord_1".into()),
                reason_code: None,
            }
        );
        let failed = reserve_reply("IDEMPOTENT", ["resv_0", "msg_0", "FAILED", "", "EXPIRED"], -1);
        assert!(matches!(
            parse_reserve(failed, &SENT).unwrap(),
            ReserveReply::Idempotent { state: RequestState::Failed, reason_code: Some(r), .. }
                if r == "EXPIRED"
        ));
        let bad_state = reserve_reply("IDEMPOTENT", ["resv_0", "msg_0", "WHAT", "", ""], -1);
        expect_unexpected(parse_reserve(bad_state, &SENT));
        let no_id = reserve_reply("IDEMPOTENT", ["", "msg_0", "QUEUED", "", ""], -1);
        expect_unexpected(parse_reserve(no_id, &SENT));
    }

    #[test]
    fn reserve_other_codes() {
        let r = |code, f| reserve_reply(code, f, -1);
        assert_eq!(
            parse_reserve(r("IDEMPOTENCY_CONFLICT", ["", "", "", "", ""]), &SENT).unwrap(),
            ReserveReply::IdempotencyConflict
        );
        assert_eq!(
            parse_reserve(r("DUPLICATE_USER", ["resv_0", "", "", "", ""]), &SENT).unwrap(),
            ReserveReply::DuplicateUser { reservation_id: "resv_0".into() }
        );
        assert_eq!(
            parse_reserve(reserve_reply("SOLD_OUT", ["", "", "", "", ""], 0), &SENT).unwrap(),
            ReserveReply::SoldOut
        );
        for (reason, expected) in [
            ("UNKNOWN", ActivityInvalidReason::Unknown),
            ("PENDING", ActivityInvalidReason::Pending),
            ("NOT_STARTED", ActivityInvalidReason::NotStarted),
            ("ENDED", ActivityInvalidReason::Ended),
            ("TERMINATED", ActivityInvalidReason::Terminated),
        ] {
            assert_eq!(
                parse_reserve(r("ACTIVITY_INVALID", ["", "", "", "", reason]), &SENT).unwrap(),
                ReserveReply::ActivityInvalid { reason: expected }
            );
        }
        expect_unexpected(parse_reserve(r("ACTIVITY_INVALID", ["", "", "", "", "ACTIVE"]), &SENT));
        expect_unexpected(parse_reserve(r("DUPLICATE_USER", ["", "", "", "", ""]), &SENT));
    }

    #[test]
    fn reserve_malformed() {
        expect_unexpected(parse_reserve(Reply::Nil, &SENT));
        expect_unexpected(parse_reserve(bulk("CREATED"), &SENT));
        expect_unexpected(parse_reserve(arr(vec![bulk("SOLD_OUT")]), &SENT));
        expect_unexpected(parse_reserve(reserve_reply("MAYBE", ["", "", "", "", ""], 0), &SENT));
        let mut items = vec![Reply::Integer(1)];
        items.extend((0..6).map(|_| Reply::Nil));
        expect_unexpected(parse_reserve(arr(items), &SENT));
        let invalid_utf8 = Reply::Bulk(Bytes::from_static(&[0xff, 0xfe]));
        let mut items = vec![invalid_utf8];
        items.extend((0..6).map(|_| bulk("")));
        expect_unexpected(parse_reserve(arr(items), &SENT));
    }

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

    fn entry_fields(id: &str, attempts: &str, status: &str) -> Vec<Reply> {
        [id, "msg_x", "req_x", "30001", "sha256:ab", "1000", "301000", attempts, status]
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

    #[test]
    fn apply_result_replies() {
        assert_eq!(parse_apply_result(bulk("APPLIED")).unwrap(), ApplyResultReply::Applied);
        assert_eq!(parse_apply_result(bulk("ALREADY")).unwrap(), ApplyResultReply::Already);
        assert_eq!(parse_apply_result(bulk("CONFLICT")).unwrap(), ApplyResultReply::Conflict);
        expect_unexpected(parse_apply_result(bulk("")));
        expect_unexpected(parse_apply_result(Reply::Nil));
    }

    #[test]
    fn compensate_replies() {
        let r = |code, n| arr(vec![bulk(code), Reply::Integer(n)]);
        assert_eq!(
            parse_compensate(r("APPLIED", 5)).unwrap(),
            CompensateReply::Applied { stock_after: 5 }
        );
        assert_eq!(
            parse_compensate(r("ALREADY_APPLIED", 5)).unwrap(),
            CompensateReply::AlreadyApplied
        );
        expect_unexpected(parse_compensate(r("APPLIED", -1)));
        expect_unexpected(parse_compensate(r("NOPE", 1)));
        expect_unexpected(parse_compensate(arr(vec![bulk("APPLIED")])));
        expect_unexpected(parse_compensate(bulk("APPLIED")));
    }

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

    #[test]
    fn function_not_found_is_recognised() {
        assert!(is_function_not_found(b"ERR Function not found"));
        assert!(!is_function_not_found(b"ERR seckill: bad now_ms"));
        assert!(!is_function_not_found(b""));
    }

    #[test]
    fn error_classification() {
        let server = |s: &str| ScriptError::Server(s.to_owned());
        assert!(server("READONLY You can't write against a read only replica.").is_transient());
        assert!(server("LOADING Redis is loading the dataset in memory").is_transient());
        assert!(!server("ERR seckill: bad now_ms").is_transient());
        assert!(!server("READONLY x").outcome_unknown());
        assert!(ScriptError::UnexpectedReply(String::new()).outcome_unknown());
        assert!(!ScriptError::UnexpectedReply(String::new()).is_transient());
        assert!(!ScriptError::InvalidArgument("x").outcome_unknown());
    }

    #[test]
    fn the_librarys_validation_replies_are_refusals_not_failures() {
        let refused = server_error(b"ERR seckill: bad user_id");
        assert!(matches!(&refused, ScriptError::Refused(what) if what == "user_id"), "{refused:?}");
        assert!(refused.is_refusal() && !refused.is_transient() && !refused.outcome_unknown());
        assert!(ScriptError::InvalidArgument("request_id").is_refusal());
        for other in ["ERR unknown command 'FCALL'", "READONLY x", "ERR seckill: keys"] {
            let e = server_error(other.as_bytes());
            assert!(matches!(e, ScriptError::Server(_)) && !e.is_refusal(), "{other}: {e:?}");
        }
    }

    #[test]
    fn library_header_names_the_library() {
        assert!(LIBRARY.starts_with(&format!("#!lua name={LIBRARY_NAME}\n")));
        for f in
            ["reserve", "mark_sent", "claim_due", "apply_result", "compensate", "preheat", "top_up"]
        {
            assert!(
                LIBRARY.contains(&format!("redis.register_function('{f}', {f})")),
                "{f} not registered"
            );
        }
    }
}
