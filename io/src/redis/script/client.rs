//! The client of the `seckill` library: [`Functions`], which calls the seven functions over one
//! [`Router`] (a standalone server or a Redis Cluster, with the same call sites), each routed
//! by its SKU's slot, `reserve` on the fenced lane. Each call checks its ids, writes its KEYS
//! and ARGV on the stack (no key strings allocated), sends one `FCALL`, and hands the reply to
//! that function's parser. On "function not found" (a restarted or promoted node without the
//! library) it loads [`LIBRARY`] on the node that said so, once across concurrent callers, and
//! resends once: the function did not run, so resending is safe.
//!
//! What it is not: a decision maker. It reports what the script answered; mapping replies to
//! HTTP states, publishing and retry policy live in the engine. What each function takes and
//! answers is in its own file (`reserve.rs`, `mark_sent.rs`, `claim_due.rs`, `apply_result.rs`,
//! `compensate.rs`, `preheat.rs`, `top_up.rs`); key names are `keys.rs`.
//!
//! Read next: `reserve.rs` (the hot path's reply), `router.rs` and `connection.rs` (how the
//! `FCALL` travels).

use std::cell::Cell;

use bytes::BytesMut;

use super::apply_result::{
    parse_apply_result, parse_apply_results, ApplyResultArgs, ApplyResultReply, FinalOutcome,
};
use super::claim_due::{parse_claim_due, ClaimDueArgs, ClaimDueReply};
use super::compensate::{parse_compensate, CompensateArgs, CompensateReply};
use super::error::{server_error, unexpected, ScriptError};
use super::keys::{check_id, KeyBuf, SkuKeys};
use super::mark_sent::{parse_mark_sent, MarkSentArgs, MarkSentReply, MARK_SENT_MAX};
use super::preheat::{parse_preheat, PreheatArgs, PreheatReply};
use super::reserve::{fenced, parse_reserve, ReserveArgs, ReserveReply};
use super::restore::{parse_restore, RestoreLock, RestoreReply, RestoreStep};
use super::top_up::{parse_top_up, TopUpArgs, TopUpReply};
use crate::redis::cluster::Lane;
use crate::redis::connection::FenceOutcome;
use crate::redis::router::Router;
use crate::redis::slot::Slot;
use crate::redis::RedisClient;
use crate::resp::U64Text;
use crate::resp::{encode_fcall, Reply};

/// The library source, loaded with `FUNCTION LOAD REPLACE`.
pub const LIBRARY: &str = include_str!("../../../../lua/seckill.lua");

/// Outcomes `apply_results` sends per call: five commands each for a first outcome, so a call
/// stays far below a millisecond of Redis time and never holds the SKU's master up for the
/// buyers behind it (the library takes up to
/// [`APPLY_RESULTS_MAX`](super::apply_result::APPLY_RESULTS_MAX)).
const APPLY_RESULTS_CALL: usize = 64;

/// The library name declared on the first line of [`LIBRARY`].
pub const LIBRARY_NAME: &str = "seckill";

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
        let quantity = U64Text::new(u64::from(args.quantity));
        let (reply, fence) = self
            .fcall(
                keys.slot(),
                Lane::Fenced,
                "reserve",
                &[
                    keys.meta().as_bytes(),
                    keys.stock().as_bytes(),
                    user.as_bytes(),
                    req.as_bytes(),
                    resv.as_bytes(),
                    keys.pending().as_bytes(),
                    keys.soldout().as_bytes(),
                ],
                &[
                    args.request_id.as_bytes(),
                    user_id.as_bytes(),
                    args.payload_hash.as_bytes(),
                    args.reservation_id.as_bytes(),
                    args.message_id.as_bytes(),
                    now_ms.as_bytes(),
                    grace_ms.as_bytes(),
                    quantity.as_bytes(),
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
        key_refs.push(keys.pending().as_bytes());
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
                &[keys.pending().as_bytes(), keys.stuck().as_bytes()],
                &[
                    keys.prefix().as_bytes(),
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
        let parts = OutcomeParts::new(keys, args)?;
        let (req, resv) = (parts.req.as_bytes(), parts.resv.as_bytes());
        let key_refs = [req, resv, keys.pending().as_bytes(), keys.stuck().as_bytes()];
        let (reply, _plain) =
            self.fcall(keys.slot(), Lane::Plain, "apply_result", &key_refs, &parts.argv()).await?;
        parse_apply_result(reply)
    }

    /// One SKU's outcomes in one call (`apply_results`), one reply per outcome in order.
    /// Each outcome is checked here first, and one this binding refuses gets its own error
    /// without holding the others back. If the library refuses the batch (an argument this
    /// binding let through: a binding bug), its outcomes are applied one by one, so only the
    /// bad one fails. A transient error fails the whole call: nothing or everything may
    /// have been applied, and every step is idempotent.
    pub async fn apply_results(
        &self,
        keys: &SkuKeys,
        outcomes: &[ApplyResultArgs<'_>],
    ) -> Result<Vec<Result<ApplyResultReply, ScriptError>>, ScriptError> {
        let mut replies: Vec<Option<Result<ApplyResultReply, ScriptError>>> =
            Vec::with_capacity(outcomes.len());
        let mut checked = Vec::with_capacity(outcomes.len());
        for (i, args) in outcomes.iter().enumerate() {
            match OutcomeParts::new(keys, args) {
                Ok(parts) => {
                    checked.push((i, parts));
                    replies.push(None);
                }
                Err(e) => replies.push(Some(Err(e))),
            }
        }
        for chunk in checked.chunks(APPLY_RESULTS_CALL) {
            let applied = match self.apply_chunk(keys, chunk).await {
                Err(e) if e.is_refusal() => self.apply_one_by_one(keys, outcomes, chunk).await,
                applied => applied?.into_iter().map(Ok).collect(),
            };
            for ((i, _), reply) in chunk.iter().zip(applied) {
                replies[*i] = Some(reply);
            }
        }
        // The parser answers one reply per outcome sent, so every slot is filled.
        let unanswered = || Err(ScriptError::UnexpectedReply("apply_results: no reply".into()));
        Ok(replies.into_iter().map(|r| r.unwrap_or_else(unanswered)).collect())
    }

    async fn apply_chunk(
        &self,
        keys: &SkuKeys,
        chunk: &[(usize, OutcomeParts<'_>)],
    ) -> Result<Vec<ApplyResultReply>, ScriptError> {
        let mut key_refs: Vec<&[u8]> = Vec::with_capacity(2 + 2 * chunk.len());
        key_refs.extend([keys.pending().as_bytes(), keys.stuck().as_bytes()]);
        let mut arg_refs: Vec<&[u8]> = Vec::with_capacity(9 * chunk.len());
        for (_, parts) in chunk {
            key_refs.extend([parts.req.as_bytes(), parts.resv.as_bytes()]);
            arg_refs.extend(parts.argv());
        }
        let (reply, _plain) =
            self.fcall(keys.slot(), Lane::Plain, "apply_results", &key_refs, &arg_refs).await?;
        parse_apply_results(reply, chunk.len())
    }

    async fn apply_one_by_one(
        &self,
        keys: &SkuKeys,
        outcomes: &[ApplyResultArgs<'_>],
        chunk: &[(usize, OutcomeParts<'_>)],
    ) -> Vec<Result<ApplyResultReply, ScriptError>> {
        let mut replies = Vec::with_capacity(chunk.len());
        for (i, _) in chunk {
            replies.push(self.apply_result(keys, &outcomes[*i]).await);
        }
        replies
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
        let units = U64Text::new(u64::from(args.units));
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
                    keys.stock().as_bytes(),
                    user.as_bytes(),
                    resv.as_bytes(),
                    req.as_bytes(),
                    keys.pending().as_bytes(),
                    keys.soldout().as_bytes(),
                    keys.stuck().as_bytes(),
                ],
                &[
                    args.reservation_id.as_bytes(),
                    flag(args.return_stock),
                    flag(args.release_user),
                    args.reason_code.as_bytes(),
                    now_ms.as_bytes(),
                    units.as_bytes(),
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
        let max_per_buyer = U64Text::new(u64::from(args.max_per_buyer));
        let (reply, _plain) = self
            .fcall(
                keys.slot(),
                Lane::Plain,
                "preheat",
                &[keys.meta().as_bytes(), keys.stock().as_bytes(), keys.soldout().as_bytes()],
                &[
                    args.status.as_str().as_bytes(),
                    start_ms.as_bytes(),
                    end_ms.as_bytes(),
                    version.as_bytes(),
                    ttl_ms.as_bytes(),
                    stock.as_bytes(),
                    max_per_buyer.as_bytes(),
                ],
            )
            .await?;
        parse_preheat(reply)
    }

    /// One step of a rebuild from PostgreSQL (`restore`), under `lock`.
    pub async fn restore(
        &self,
        keys: &SkuKeys,
        lock: RestoreLock<'_>,
        step: &RestoreStep<'_>,
    ) -> Result<RestoreReply, ScriptError> {
        check_id(lock.token, "token")?;
        let fixed = [
            keys.meta(),
            keys.stock(),
            keys.soldout(),
            keys.rebuild(),
            keys.pending(),
            keys.stuck(),
        ];
        let mut key_list: Vec<Vec<u8>> = fixed.iter().map(|k| k.as_bytes().to_vec()).collect();
        let mut arg_list: Vec<Vec<u8>> = Vec::with_capacity(10);
        let mode: &[u8] = match step {
            RestoreStep::Begin { stock } => {
                arg_list.push(stock.to_string().into_bytes());
                b"BEGIN"
            }
            RestoreStep::Wipe { keys: wiped } => {
                key_list.extend(wiped.iter().map(|k| k.as_bytes().to_vec()));
                b"WIPE"
            }
            RestoreStep::Reservation(r) => {
                key_list.push(keys.user(r.user_id).as_bytes().to_vec());
                key_list.push(keys.req(r.user_id, r.request_id)?.as_bytes().to_vec());
                key_list.push(keys.resv(r.reservation_id)?.as_bytes().to_vec());
                let user_id = r.user_id.to_string();
                let texts =
                    [r.request_id, &user_id, r.payload_hash, r.reservation_id, r.message_id];
                arg_list.extend(texts.map(|t| t.as_bytes().to_vec()));
                let times = [r.reserved_at_ms, r.expires_at_ms, r.next_retry_at_ms];
                arg_list.extend(times.map(|n| n.to_string().into_bytes()));
                arg_list.push(r.quantity.to_string().into_bytes());
                b"RESERVATION"
            }
            RestoreStep::Finish(meta) => {
                arg_list.push(meta.status.as_str().as_bytes().to_vec());
                let numbers = [
                    meta.start_ms,
                    meta.end_ms,
                    meta.version,
                    meta.reservation_ttl_ms,
                    u64::from(meta.max_per_buyer),
                ];
                arg_list.extend(numbers.map(|n| n.to_string().into_bytes()));
                b"FINISH"
            }
        };
        let ttl = lock.ttl_ms.to_string();
        let mut args: Vec<&[u8]> = vec![mode, lock.token.as_bytes(), ttl.as_bytes()];
        args.extend(arg_list.iter().map(Vec::as_slice));
        let key_refs: Vec<&[u8]> = key_list.iter().map(Vec::as_slice).collect();
        let (reply, _plain) =
            self.fcall(keys.slot(), Lane::Plain, "restore", &key_refs, &args).await?;
        parse_restore(reply)
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
                &[keys.meta().as_bytes(), keys.stock().as_bytes(), keys.soldout().as_bytes()],
                &[add.as_bytes(), version.as_bytes()],
            )
            .await?;
        parse_top_up(reply)
    }
}

/// The error reply of a node that lacks the library (restarted, or a promoted replica).
fn is_function_not_found(message: &[u8]) -> bool {
    // Redis 7: "ERR Function not found". Matched without the prefix so a proxy that rewrites
    // the error code still triggers the reload.
    const NEEDLE: &[u8] = b"Function not found";
    message.windows(NEEDLE.len()).any(|w| w == NEEDLE)
}

/// A flag argument as the library reads it.
fn flag(on: bool) -> &'static [u8] {
    if on {
        b"1"
    } else {
        b"0"
    }
}

/// One outcome of `apply_result` / `apply_results`, checked: its two keys and its nine
/// arguments (the library's ARGV order).
struct OutcomeParts<'a> {
    req: KeyBuf,
    resv: KeyBuf,
    args: &'a ApplyResultArgs<'a>,
    outcome: &'static [u8],
    order_id: &'a str,
    reason_code: &'a str,
    now_ms: U64Text,
    user_id: U64Text,
}

impl<'a> OutcomeParts<'a> {
    fn new(keys: &SkuKeys, args: &'a ApplyResultArgs<'a>) -> Result<OutcomeParts<'a>, ScriptError> {
        check_id(args.payload_hash, "payload_hash")?;
        check_id(args.message_id, "message_id")?;
        let req = keys.req(args.user_id, args.request_id)?;
        let resv = keys.resv(args.reservation_id)?;
        let (outcome, order_id, reason_code): (&'static [u8], &str, &str) = match args.outcome {
            FinalOutcome::OrderCreated { order_id } => {
                check_id(order_id, "order_id")?;
                (b"ORDER_CREATED", order_id, "")
            }
            FinalOutcome::Failed { reason_code } => {
                check_id(reason_code, "reason_code")?;
                (b"FAILED", "", reason_code)
            }
        };
        let (now_ms, user_id) = (U64Text::new(args.now_ms), U64Text::new(args.user_id));
        Ok(OutcomeParts { req, resv, args, outcome, order_id, reason_code, now_ms, user_id })
    }

    fn argv(&self) -> [&[u8]; 9] {
        [
            self.args.reservation_id.as_bytes(),
            self.outcome,
            self.order_id.as_bytes(),
            self.reason_code.as_bytes(),
            self.now_ms.as_bytes(),
            self.args.request_id.as_bytes(),
            self.args.payload_hash.as_bytes(),
            self.args.message_id.as_bytes(),
            self.user_id.as_bytes(),
        ]
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn function_not_found_is_recognised() {
        assert!(is_function_not_found(b"ERR Function not found"));
        assert!(!is_function_not_found(b"ERR seckill: bad now_ms"));
        assert!(!is_function_not_found(b""));
    }

    #[test]
    fn library_header_names_the_library() {
        assert!(LIBRARY.starts_with(&format!("#!lua name={LIBRARY_NAME}\n")));
        for f in [
            "reserve",
            "mark_sent",
            "claim_due",
            "apply_result",
            "compensate",
            "preheat",
            "top_up",
            "restore",
        ] {
            assert!(
                LIBRARY.contains(&format!("redis.register_function('{f}', {f})")),
                "{f} not registered"
            );
        }
    }
}
