//! The typed reads (and the one plain write) the engine makes outside the `seckill`
//! functions: a SKU's `meta` and `stock`, a request's record (and its replay fields), the
//! active-SKU set, the pending sample behind the pending gauges, and what reconcile reads
//! (CONTRACT.md section 5).
//!
//! Why here: `io::redis` owns every key name and every command, so the engine never spells
//! one. Each read returns a record of [`super::layout`]; a reply of the wrong shape reads as
//! absent fields, never as a panic, and an error reply is [`ScriptError::Server`].
//!
//! What it is not: a writer of a SKU's keys. Those writes are the functions' alone
//! (`lua/seckill.lua`); the only write here, [`Functions::add_active_sku`], touches the shared
//! active-SKU set. Every read here is a single command or a few in a fixed order, each O(1) or
//! bounded by its arguments (`SCAN` by `count`, `ZRANGE` by `n`).

use crate::redis::layout::{
    ActivityStatus, KeyPage, MetaRecord, PendingEntry, PendingSample, PendingStatus, ReplayRecord,
    RequestRecord, ReservationRecord, SkuCounters, SkuFlags, SkuMember, SoldOutReads, StuckEntry,
    ACTIVE_SKUS_KEY,
};
use crate::redis::script::{Functions, ScriptError, SkuKeys};
use crate::redis::slot::Slot;
use crate::resp::{Reply, U64Text};

/// The slot of the active-SKU set (15413: outside every SKU's slot, by design).
fn active_skus_slot() -> Slot {
    Slot::of_key(ACTIVE_SKUS_KEY.as_bytes())
}

fn text(reply: &Reply) -> Option<&str> {
    reply.as_str()
}

/// A non-empty string field.
fn owned(reply: &Reply) -> Option<String> {
    text(reply).filter(|s| !s.is_empty()).map(str::to_owned)
}

fn int(reply: &Reply) -> Option<i64> {
    reply.as_int().or_else(|| text(reply).and_then(|s| s.parse().ok()))
}

fn uint(reply: &Reply) -> Option<u64> {
    int(reply).and_then(|n| u64::try_from(n).ok())
}

fn field(fields: &[Reply], i: usize) -> &Reply {
    fields.get(i).unwrap_or(&Reply::Nil)
}

impl Functions {
    /// One command; an error reply becomes [`ScriptError::Server`]. Every read of this module
    /// goes through here, routed by the slot of the keys it names (a SKU's keys share one).
    async fn read(&self, slot: Slot, args: &[&[u8]]) -> Result<Reply, ScriptError> {
        match self.command(slot, args).await? {
            Reply::Error(message) => {
                Err(ScriptError::Server(String::from_utf8_lossy(&message).into_owned()))
            }
            reply => Ok(reply),
        }
    }

    /// The SKU's `meta`, when every field is present and well-formed (`None`: not preheated
    /// yet, or malformed; `reserve` then answers for itself).
    pub async fn read_meta(&self, keys: &SkuKeys) -> Result<Option<MetaRecord>, ScriptError> {
        let reply = self
            .read(
                keys.slot(),
                &[
                    b"HMGET",
                    keys.meta().as_bytes(),
                    b"status",
                    b"start_ms",
                    b"end_ms",
                    b"version",
                    b"reservation_ttl_ms",
                ],
            )
            .await?;
        let fields = reply.as_array().unwrap_or_default();
        let status = text(field(fields, 0)).and_then(ActivityStatus::parse);
        let number = |i| uint(field(fields, i));
        Ok(match (status, number(1), number(2), number(3), number(4)) {
            (Some(status), Some(start_ms), Some(end_ms), Some(version), Some(ttl_ms)) => {
                Some(MetaRecord { status, start_ms, end_ms, version, reservation_ttl_ms: ttl_ms })
            }
            _ => None,
        })
    }

    /// The SKU's `stock` (`None`: missing or not a number).
    pub async fn read_stock(&self, keys: &SkuKeys) -> Result<Option<i64>, ScriptError> {
        Ok(int(&self.read(keys.slot(), &[b"GET", keys.stock().as_bytes()]).await?))
    }

    /// The buyer's request record (`None`: no record, a miss).
    pub async fn read_request(
        &self,
        keys: &SkuKeys,
        user_id: u64,
        request_id: &str,
    ) -> Result<Option<RequestRecord>, ScriptError> {
        let req = keys.req(user_id, request_id)?;
        let reply = self
            .read(
                keys.slot(),
                &[
                    b"HMGET",
                    req.as_bytes(),
                    b"state",
                    b"reservation_id",
                    b"order_id",
                    b"reason_code",
                    b"user_id",
                ],
            )
            .await?;
        let fields = reply.as_array().unwrap_or_default();
        let Some(state) = owned(field(fields, 0)) else { return Ok(None) };
        Ok(Some(RequestRecord {
            state,
            reservation_id: owned(field(fields, 1)),
            order_id: owned(field(fields, 2)),
            reason_code: owned(field(fields, 3)),
            user_id: uint(field(fields, 4)),
        }))
    }

    /// What a replay of the buyer's request needs (`None`: no record, or one without its
    /// ids).
    pub async fn read_replay(
        &self,
        keys: &SkuKeys,
        user_id: u64,
        request_id: &str,
    ) -> Result<Option<ReplayRecord>, ScriptError> {
        let req = keys.req(user_id, request_id)?;
        let fields: [&[u8]; 6] =
            [b"HMGET", req.as_bytes(), b"payload_hash", b"reservation_id", b"message_id", b"state"];
        let reply = self.read(keys.slot(), &fields).await?;
        let fields = reply.as_array().unwrap_or_default();
        let text = |i| owned(field(fields, i));
        Ok(match (text(0), text(1), text(2), text(3)) {
            (Some(payload_hash), Some(reservation_id), Some(message_id), Some(state)) => {
                Some(ReplayRecord { payload_hash, reservation_id, message_id, state })
            }
            _ => None,
        })
    }

    /// What a submit to a sold-out SKU needs while the replay map is not loaded: three reads
    /// sent together (the request's record, `meta`'s status and limit, the buyer's marker)
    /// instead of a whole `reserve`, which writes nothing once the SKU is sold out (issue 25:
    /// ~0.17 `FCALL`s and ~0.3 commands a sold unit in the demo).
    pub async fn sold_out_reads(
        &self,
        keys: &SkuKeys,
        user_id: u64,
        request_id: &str,
    ) -> Result<SoldOutReads, ScriptError> {
        let meta: [&[u8]; 4] = [b"HMGET", keys.meta().as_bytes(), b"status", b"max_per_buyer"];
        let user = keys.user(user_id);
        let marker: [&[u8]; 2] = [b"GET", user.as_bytes()];
        let (replay, meta, marker) = futures::join!(
            self.read_replay(keys, user_id, request_id),
            self.read(keys.slot(), &meta),
            self.read(keys.slot(), &marker),
        );
        let meta = meta?;
        let fields = meta.as_array().unwrap_or_default();
        Ok(SoldOutReads {
            replay: replay?,
            status: owned(field(fields, 0)),
            max_per_buyer: uint(field(fields, 1)),
            marker: owned(&marker?),
        })
    }

    /// Every member of the active-SKU set that parses (strangers are skipped).
    pub async fn active_skus(&self) -> Result<Vec<SkuMember>, ScriptError> {
        let reply =
            self.read(active_skus_slot(), &[b"SMEMBERS", ACTIVE_SKUS_KEY.as_bytes()]).await?;
        let members = reply.as_array().unwrap_or_default();
        Ok(members.iter().filter_map(|m| text(m).and_then(SkuMember::parse)).collect())
    }

    /// Adds a SKU to the active-SKU set (idempotent).
    pub async fn add_active_sku(&self, member: SkuMember) -> Result<(), ScriptError> {
        let text = member.to_string();
        self.read(active_skus_slot(), &[b"SADD", ACTIVE_SKUS_KEY.as_bytes(), text.as_bytes()])
            .await
            .map(|_| ())
    }

    /// How many reservations are pending, and when the most overdue one was reserved.
    pub async fn sample_pending(&self, keys: &SkuKeys) -> Result<PendingSample, ScriptError> {
        let pending_key = keys.pending().as_bytes();
        let pending = uint(&self.read(keys.slot(), &[b"ZCARD", pending_key]).await?).unwrap_or(0);
        let head = self.read(keys.slot(), &[b"ZRANGE", pending_key, b"0", b"0"]).await?;
        let Some(id) = head.as_array().and_then(|a| a.first()).and_then(text) else {
            return Ok(PendingSample { pending, most_overdue_reserved_at_ms: None });
        };
        let resv = keys.resv(id)?;
        let at = self.read(keys.slot(), &[b"HGET", resv.as_bytes(), b"reserved_at"]).await?;
        Ok(PendingSample { pending, most_overdue_reserved_at_ms: uint(&at) })
    }

    /// `stock`, and the sizes of `resv:pending` and `resv:stuck`.
    pub async fn counters(&self, keys: &SkuKeys) -> Result<SkuCounters, ScriptError> {
        let stock = int(&self.read(keys.slot(), &[b"GET", keys.stock().as_bytes()]).await?);
        let pending = uint(&self.read(keys.slot(), &[b"ZCARD", keys.pending().as_bytes()]).await?);
        let stuck = uint(&self.read(keys.slot(), &[b"ZCARD", keys.stuck().as_bytes()]).await?);
        Ok(SkuCounters { stock, pending: pending.unwrap_or(0), stuck: stuck.unwrap_or(0) })
    }

    /// One `SCAN` page over the SKU's keys (its hash tag), sorted by kind.
    pub async fn scan_sku_keys(
        &self,
        keys: &SkuKeys,
        cursor: u64,
        count: u32,
    ) -> Result<KeyPage, ScriptError> {
        let prefix = keys.prefix();
        let pattern = format!("{prefix}*");
        let cursor = U64Text::new(cursor);
        let count = U64Text::new(u64::from(count));
        let reply = self
            .read(
                keys.slot(),
                &[
                    b"SCAN",
                    cursor.as_bytes(),
                    b"MATCH",
                    pattern.as_bytes(),
                    b"COUNT",
                    count.as_bytes(),
                ],
            )
            .await?;
        let parts = reply.as_array().unwrap_or_default();
        let (Some(next), Some(names)) =
            (parts.first().and_then(uint), parts.get(1).and_then(Reply::as_array))
        else {
            return Err(ScriptError::UnexpectedReply(format!("SCAN: {reply:?}")));
        };
        let mut page = KeyPage { next_cursor: next, ..KeyPage::default() };
        for name in names.iter().filter_map(text) {
            let Some(rest) = name.strip_prefix(prefix) else { continue };
            if matches!(rest, "meta" | "stock" | "soldout" | "resv:pending" | "resv:stuck") {
                continue;
            }
            let sorted = [
                ("resv:", &mut page.reservation_ids),
                ("comp:", &mut page.compensation_ids),
                ("user:", &mut page.user_markers),
                ("req:", &mut page.request_records),
            ];
            for (kind, list) in sorted {
                if let Some(id) = rest.strip_prefix(kind) {
                    list.push(id.to_owned());
                    break;
                }
            }
        }
        Ok(page)
    }

    /// One reservation: `ZSCORE pending`, `ZSCORE stuck`, then its hash, in that order.
    pub async fn read_reservation(
        &self,
        keys: &SkuKeys,
        reservation_id: &str,
    ) -> Result<ReservationRecord, ScriptError> {
        let resv = keys.resv(reservation_id)?;
        let id = reservation_id.as_bytes();
        let pending = self.read(keys.slot(), &[b"ZSCORE", keys.pending().as_bytes(), id]).await?;
        let stuck = self.read(keys.slot(), &[b"ZSCORE", keys.stuck().as_bytes(), id]).await?;
        let fields = self
            .read(
                keys.slot(),
                &[
                    b"HMGET",
                    resv.as_bytes(),
                    b"status",
                    b"user_id",
                    b"reserved_at",
                    b"order_id",
                    b"quantity",
                ],
            )
            .await?;
        let fields = fields.as_array().unwrap_or_default();
        Ok(ReservationRecord {
            status: owned(field(fields, 0)),
            user_id: uint(field(fields, 1)),
            reserved_at_ms: uint(field(fields, 2)),
            order_id: owned(field(fields, 3)),
            quantity: uint(field(fields, 4)).and_then(|q| u32::try_from(q).ok()),
            in_pending: !matches!(pending, Reply::Nil),
            in_stuck: !matches!(stuck, Reply::Nil),
        })
    }

    /// The reason a compensation marker records (`None`: never compensated).
    pub async fn read_compensation(
        &self,
        keys: &SkuKeys,
        reservation_id: &str,
    ) -> Result<Option<String>, ScriptError> {
        let comp = keys.comp(reservation_id)?;
        Ok(owned(&self.read(keys.slot(), &[b"GET", comp.as_bytes()]).await?))
    }

    /// `meta.status` as written, and whether `soldout` is set.
    pub async fn sku_flags(&self, keys: &SkuKeys) -> Result<SkuFlags, ScriptError> {
        let status = self.read(keys.slot(), &[b"HGET", keys.meta().as_bytes(), b"status"]).await?;
        let soldout = self.read(keys.slot(), &[b"EXISTS", keys.soldout().as_bytes()]).await?;
        Ok(SkuFlags { meta_status: owned(&status), soldout: int(&soldout) == Some(1) })
    }

    /// Pending entries due at or before `before_ms` (overdue ones, for reconcile).
    pub async fn pending_due_count(
        &self,
        keys: &SkuKeys,
        before_ms: u64,
    ) -> Result<u64, ScriptError> {
        let before = U64Text::new(before_ms);
        let reply = self
            .read(keys.slot(), &[b"ZCOUNT", keys.pending().as_bytes(), b"-inf", before.as_bytes()])
            .await?;
        Ok(uint(&reply).unwrap_or(0))
    }

    /// The first `n` stuck entries with the ms they got stuck (oldest first).
    pub async fn stuck_sample(
        &self,
        keys: &SkuKeys,
        n: usize,
    ) -> Result<Vec<(String, u64)>, ScriptError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let last = U64Text::new((n - 1) as u64);
        let reply = self
            .read(
                keys.slot(),
                &[b"ZRANGE", keys.stuck().as_bytes(), b"0", last.as_bytes(), b"WITHSCORES"],
            )
            .await?;
        Ok(reply
            .as_array()
            .unwrap_or_default()
            .chunks(2)
            .filter_map(|pair| {
                let id = owned(pair.first()?)?;
                Some((id, pair.get(1).and_then(uint).unwrap_or(0)))
            })
            .collect())
    }

    /// The first `n` stuck entries (oldest first), each with its record: one `ZRANGE`, then
    /// one `HMGET` per entry.
    pub async fn stuck_entries(
        &self,
        keys: &SkuKeys,
        n: usize,
    ) -> Result<Vec<StuckEntry>, ScriptError> {
        let mut entries = Vec::new();
        for (reservation_id, stuck_at_ms) in self.stuck_sample(keys, n).await? {
            entries.push(self.stuck_record(keys, reservation_id, stuck_at_ms).await?);
        }
        Ok(entries)
    }

    /// One stuck entry (`None`: not a member of `resv:stuck`).
    pub async fn stuck_entry(
        &self,
        keys: &SkuKeys,
        reservation_id: &str,
    ) -> Result<Option<StuckEntry>, ScriptError> {
        let id = reservation_id.as_bytes();
        let score = self.read(keys.slot(), &[b"ZSCORE", keys.stuck().as_bytes(), id]).await?;
        match uint(&score) {
            Some(stuck_at_ms) => {
                Ok(Some(self.stuck_record(keys, reservation_id.to_owned(), stuck_at_ms).await?))
            }
            None => Ok(None),
        }
    }

    async fn stuck_record(
        &self,
        keys: &SkuKeys,
        reservation_id: String,
        stuck_at_ms: u64,
    ) -> Result<StuckEntry, ScriptError> {
        let resv = keys.resv(&reservation_id)?;
        let command: &[&[u8]] = &[
            b"HMGET",
            resv.as_bytes(),
            b"status",
            b"last_error_code",
            b"message_id",
            b"request_id",
            b"user_id",
            b"payload_hash",
            b"reserved_at",
            b"expires_at",
            b"send_attempts",
            b"quantity",
        ];
        let reply = self.read(keys.slot(), command).await?;
        let f = reply.as_array().unwrap_or_default();
        let status = owned(field(f, 0));
        let pending_status = match status.as_deref() {
            Some("PENDING_MESSAGE") => Some(PendingStatus::PendingMessage),
            Some("MESSAGE_SENT") => Some(PendingStatus::MessageSent),
            _ => None,
        };
        let entry = pending_status.and_then(|status| {
            Some(PendingEntry {
                reservation_id: reservation_id.clone(),
                message_id: owned(field(f, 2))?,
                request_id: owned(field(f, 3))?,
                user_id: uint(field(f, 4))?,
                payload_hash: owned(field(f, 5))?,
                reserved_at_ms: uint(field(f, 6))?,
                expires_at_ms: uint(field(f, 7))?,
                send_attempts: uint(field(f, 8)).and_then(|n| u32::try_from(n).ok()).unwrap_or(0),
                status,
                // A record written before quantities held one unit.
                quantity: match field(f, 9) {
                    Reply::Nil => 1,
                    q => uint(q).and_then(|n| u32::try_from(n).ok()).filter(|n| *n >= 1)?,
                },
            })
        });
        Ok(StuckEntry {
            reservation_id,
            stuck_at_ms,
            status,
            last_error_code: owned(field(f, 1)),
            entry,
        })
    }

    /// The `run_id` of one node (`INFO server`): another one means the process restarted
    /// (and may have lost what it held). `None`: no such field in the answer.
    pub async fn run_id_of(
        &self,
        node: std::net::SocketAddr,
    ) -> Result<Option<String>, ScriptError> {
        let reply = self
            .router()
            .request_on(node, |buf| crate::resp::encode_command(buf, &[b"INFO", b"server"]))
            .await?;
        if let Reply::Error(message) = &reply {
            return Err(ScriptError::Server(String::from_utf8_lossy(message).into_owned()));
        }
        Ok(crate::redis::router::info_field(&reply, "run_id").map(str::to_owned))
    }
}
