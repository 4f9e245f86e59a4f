//! Every SQL statement the order-writer, the outbox publisher and the lag task send, in one
//! place (the migrations hold the schema, `flashsale_order_create` (0002, per message) and
//! `flashsale_order_facts` / `flashsale_order_apply` (0004, set-based); `tokens.rs` the TOKEN
//! allocator's stand-alone statements; `audit.rs` its one report query).
//!
//! All are prepared once per connection (`prepare_cached`) and reused.

/// One order-create message: see `migrations/0002_order_create.sql` and `0010_quantity.sql`
/// for the outcomes. Parameters: consumer group, message id, reservation id, request id,
/// activity id, SKU id, user id, quantity, reserved at, expires at, now, order id, pool size
/// (this SKU's units asked from this message to the end of the batch: how many to take when
/// the batch pool holds fewer than this message's quantity).
pub const ORDER_CREATE_SQL: &str = "\
    SELECT r_outcome, r_recorded, r_order_id, r_token_ids, r_claim_us \
    FROM flashsale_order_create($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)";

/// The set-based batch's reads and locks (`migrations/0004_order_create_set.sql`, as 0010
/// left them): consumer group, message ids, reservation ids, activity ids, SKU ids, user ids,
/// expiries, quantities, request ids (arrays by position), now. One row of arrays;
/// `set_writer.rs` decodes it into `plan::Facts`.
pub const ORDER_FACTS_SQL: &str = "\
    SELECT r_inserted_ids, r_recorded_ids, r_recorded_statuses, r_recorded_orders, \
           r_ordered_positions, r_sku_activity_ids, r_sku_ids, r_sku_statuses, r_sku_allocators, \
           r_sku_available, r_sku_contended, r_sku_claim_us, r_token_skus, r_token_ids, \
           r_requested_positions \
    FROM flashsale_order_facts($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";

/// The set-based batch's writes, as `plan::plan` decided them (`0010_quantity.sql`): consumer
/// group, contended message ids; per final outcome (batch order) reservation id, request id,
/// message id, activity id, SKU id, user id, status, order id, quantity, first token id; every
/// claimed token and the 1-based final row it belongs to; per final outcome reserved at,
/// expires at; per ROW SKU that sold units activity id, SKU id, units.
pub const ORDER_APPLY_SQL: &str = "\
    SELECT flashsale_order_apply($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, \
                                 $15, $16, $17, $18, $19)";

/// The SQLSTATE `flashsale_order_apply` raises when an order met a buyer its facts did not
/// show (a concurrent transaction got there first): the plan is stale and the batch is
/// written the per-message way instead.
pub const BUYER_RACE_SQLSTATE: &str = "FS001";

/// Gives the unused units of the transaction's ROW pools back; sent before every COMMIT.
pub const RETURN_UNITS_SQL: &str = "SELECT flashsale_return_units()";

// Transaction control, prepared like the rest so a batch is two pipelined round trips.
pub const BEGIN_SQL: &str = "BEGIN";
pub const COMMIT_SQL: &str = "COMMIT";
pub const ROLLBACK_SQL: &str = "ROLLBACK";

/// A batch's outbox events in one statement: aggregate ids, event types and JSON payloads as
/// three parallel arrays, inserted in array order (so event ids follow message order).
pub const INSERT_EVENTS_SQL: &str = "\
    INSERT INTO event_outbox (aggregate_id, event_type, payload) \
    SELECT e.aggregate_id, e.event_type, e.payload::jsonb \
    FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY \
         AS e(aggregate_id, event_type, payload, n) \
    ORDER BY e.n";

/// The outbox publisher's batch: the oldest unpublished events nobody else holds. SKIP LOCKED
/// lets several publishers work side by side without waiting on each other or taking the same
/// event (`event_outbox_unpublished_idx` serves it).
pub const CLAIM_UNPUBLISHED_SQL: &str = "\
    SELECT event_id, event_type, payload::text FROM event_outbox \
    WHERE published_at IS NULL ORDER BY event_id LIMIT $1 FOR UPDATE SKIP LOCKED";

/// Marks the given events published. `published_at IS NULL` makes a second marking impossible,
/// and the returned count lets the caller assert that every event it held was marked once.
pub const MARK_PUBLISHED_SQL: &str = "\
    UPDATE event_outbox SET published_at = now() \
    WHERE event_id = ANY($1) AND published_at IS NULL";

/// `flashsale_outbox_backlog`.
pub const OUTBOX_BACKLOG_SQL: &str = "SELECT count(*) FROM event_outbox WHERE published_at IS NULL";
