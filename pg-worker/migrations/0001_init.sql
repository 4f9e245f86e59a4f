-- 0001_init: the flashsale schema (CONTRACT.md section 7).
--
-- Applied by `flashsale_pg_worker::migrate` inside ONE transaction that holds the
-- migration advisory lock; this file must therefore not contain BEGIN/COMMIT nor
-- statements that refuse to run in a transaction (CREATE INDEX CONCURRENTLY, VACUUM).
-- Once applied anywhere, this file is frozen: its SHA-256 is recorded in
-- schema_migrations and `migrate` refuses to run if it changes. Changes go into a
-- new file 0002_*.sql.
--
-- Conventions: ids are text (`resv_`, `msg_`, `ord_`, `tok_` + ULID or a
-- deterministic suffix) except the numeric business keys activity_id, sku_id and
-- user_id; timestamps are timestamptz; money is bigint cents. Every constraint
-- is named, so that an error's `constraint()` says which rule fired, and carries a
-- comment naming the DESIGN.md section 8 invariant (I1..I7) it enforces:
--   I1 no oversell, I2 one order per buyer, I3 token conservation,
--   I4 nothing lost, I5 Redis conservation, I6 idempotency, I7 ack after commit.
-- Constraints that only keep a row self-consistent say "row sanity".
--
-- Deliberately absent: foreign keys from the hot tables (orders,
-- inventory_reservation, inventory_ledger) to activity/sku_inventory. Every
-- insert would take FOR KEY SHARE on the ONE sku_inventory row of the hot SKU,
-- turning it into a multixact hot spot under 32 concurrent writers (and
-- colliding with the ROW allocator's UPDATE of that very row). The worker reads
-- the activity anyway; the reconcile report cross-checks the rest.

-- ---------------------------------------------------------------------------
-- activity: one flash-sale event and its window. Source of the PENDING/ACTIVE/
-- ENDED/TERMINATED status that Redis `meta` mirrors.
CREATE TABLE activity (
    activity_id        bigint      NOT NULL,
    status             text        NOT NULL DEFAULT 'PENDING',
    start_at           timestamptz NOT NULL,
    end_at             timestamptz NOT NULL,
    -- Bumped on every change; Redis `meta.version` and shard snapshots compare it
    -- so that an older snapshot never overwrites a newer one.
    version            bigint      NOT NULL DEFAULT 1,
    reservation_ttl_ms bigint      NOT NULL,
    pay_timeout_ms     bigint      NOT NULL,
    -- Hash of the admin API body that created the activity: the same body again is
    -- idempotent, a different one answers 409. NULL for rows made by other tools.
    config_hash        text        NULL,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    -- I4/I6: one activity per id, so creation through the admin API is idempotent.
    CONSTRAINT activity_pkey PRIMARY KEY (activity_id),
    -- I4: the worker rejects by status (REJECTED_ACTIVITY); an unknown status
    -- would be neither active nor terminated and strand reservations.
    CONSTRAINT activity_status_check
        CHECK (status IN ('PENDING', 'ACTIVE', 'ENDED', 'TERMINATED')),
    -- Row sanity: an empty or inverted window would reject every reservation.
    CONSTRAINT activity_window_check CHECK (end_at > start_at),
    -- I6: versions only grow from 1; snapshot comparison relies on it.
    CONSTRAINT activity_version_check CHECK (version >= 1),
    -- I4: a zero TTL expires every reservation on arrival; a zero pay timeout
    -- closes every order on creation.
    CONSTRAINT activity_reservation_ttl_ms_check CHECK (reservation_ttl_ms > 0),
    CONSTRAINT activity_pay_timeout_ms_check CHECK (pay_timeout_ms > 0)
);
COMMENT ON TABLE activity IS
    'A flash-sale event: status and window; Redis meta mirrors it (DESIGN.md 2, 8: I4).';

-- ---------------------------------------------------------------------------
-- sku_inventory: the stock of one SKU in one activity and how it is allocated.
CREATE TABLE sku_inventory (
    activity_id     bigint      NOT NULL,
    sku_id          bigint      NOT NULL,
    -- The initial stock: tokens 1..=total_stock exist for the TOKEN allocator.
    total_stock     bigint      NOT NULL,
    allocator       text        NOT NULL DEFAULT 'TOKEN',
    -- ROW allocator only: decremented by `UPDATE ... WHERE available_stock > 0`.
    -- NULL for TOKEN, where the tokens themselves are the count.
    available_stock bigint      NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    -- I3: one stock figure per SKU, the "total" of token conservation.
    CONSTRAINT sku_inventory_pkey PRIMARY KEY (activity_id, sku_id),
    -- Row sanity: stock belongs to a known activity (cold table, FK is cheap here).
    CONSTRAINT sku_inventory_activity_fkey
        FOREIGN KEY (activity_id) REFERENCES activity (activity_id),
    -- I3: conservation starts from a non-negative total.
    CONSTRAINT sku_inventory_total_stock_check CHECK (total_stock >= 0),
    -- I1: only the two allocators the worker implements; anything else would
    -- leave the claim step undefined.
    CONSTRAINT sku_inventory_allocator_check CHECK (allocator IN ('TOKEN', 'ROW')),
    -- I1 (ROW allocator): the row counter never goes below zero, so a racing
    -- decrement past the last unit fails instead of overselling.
    CONSTRAINT sku_inventory_available_stock_check
        CHECK (available_stock >= 0 AND available_stock <= total_stock),
    -- I1/I3: exactly one source of truth per allocator: the counter exists for
    -- ROW and only for ROW (TOKEN counts its tokens).
    CONSTRAINT sku_inventory_allocator_counter_check
        CHECK ((allocator = 'ROW') = (available_stock IS NOT NULL))
);
COMMENT ON TABLE sku_inventory IS
    'Stock of one SKU in one activity and its allocator (DESIGN.md 8: I1, I3).';

-- ---------------------------------------------------------------------------
-- inventory_token: one row per sellable unit (TOKEN allocator). A claim locks ONE
-- token row with FOR UPDATE SKIP LOCKED instead of decrementing one hot counter.
CREATE TABLE inventory_token (
    -- Deterministic `tok_<activity>_<sku>_<seq>`, so generation is idempotent.
    token_id       text        NOT NULL,
    activity_id    bigint      NOT NULL,
    sku_id         bigint      NOT NULL,
    seq            bigint      NOT NULL,
    status         text        NOT NULL DEFAULT 'AVAILABLE',
    reservation_id text        NULL,
    order_id       text        NULL,
    claimed_at     timestamptz NULL,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    -- I1: a unit exists once; orders reference it by this id.
    CONSTRAINT inventory_token_pkey PRIMARY KEY (token_id),
    -- I1/I3: the id IS the unit number, so the primary key also makes
    -- (activity_id, sku_id, seq) unique: re-running the generator, or a writer
    -- using another id scheme, cannot mint extra stock. A CHECK rather than a
    -- UNIQUE index on purpose: every claim is a non-HOT update that inserts into
    -- each index, and a full (activity_id, sku_id, seq) index would also compete
    -- with the partial claim index below in the planner.
    CONSTRAINT inventory_token_id_check
        CHECK (token_id = 'tok_' || activity_id || '_' || sku_id || '_' || seq),
    -- I3: every token belongs to a SKU whose total_stock it is counted against.
    -- Checked on insert only (status updates do not touch the key), so the claim
    -- path pays nothing for it.
    CONSTRAINT inventory_token_sku_fkey
        FOREIGN KEY (activity_id, sku_id) REFERENCES sku_inventory (activity_id, sku_id),
    -- Row sanity: unit numbers are 1-based, like the generator's series.
    CONSTRAINT inventory_token_seq_check CHECK (seq >= 1),
    -- I3: conservation counts exactly these four states.
    CONSTRAINT inventory_token_status_check
        CHECK (status IN ('AVAILABLE', 'CLAIMED', 'SOLD', 'RELEASED')),
    -- I1: an AVAILABLE token names no holder, so a token put back cannot still be
    -- counted as held by its former reservation or order.
    CONSTRAINT inventory_token_available_free_check
        CHECK (status <> 'AVAILABLE' OR (reservation_id IS NULL AND order_id IS NULL)),
    -- I1/I4: a held token names the reservation holding it, so every claimed
    -- unit is traceable to exactly one reservation.
    CONSTRAINT inventory_token_held_owner_check
        CHECK (status NOT IN ('CLAIMED', 'SOLD') OR reservation_id IS NOT NULL)
);
-- I1/I3: one reservation holds at most one token; a buggy double claim fails
-- instead of silently taking a second unit out of circulation.
CREATE UNIQUE INDEX inventory_token_reservation_key
    ON inventory_token (reservation_id) WHERE reservation_id IS NOT NULL;
-- The claim index (I1 at speed): only AVAILABLE tokens, ordered by seq. The claim
-- query (tokens.rs, CLAIM_TOKEN_SQL) orders by seq so that the planner picks this
-- index even when one SKU's tokens are the whole table; without the ORDER BY a
-- fresh ANALYZE says "every row matches" and a LIMIT 1 scan of the heap or the
-- primary key looks cheaper, then degrades to O(claimed) per claim
-- (FIELD-NOTES.md: 12.5 s instead of 2.1 s for 10,000 orders). A claimed token's
-- new row version is not in this index and its old entry is marked dead by the
-- first scan that passes it (then removed by vacuum), so a claim visits about
-- O(tokens locked by others) entries, not O(tokens sold).
CREATE INDEX inventory_token_available_idx
    ON inventory_token (activity_id, sku_id, seq) WHERE status = 'AVAILABLE';
COMMENT ON TABLE inventory_token IS
    'One row per sellable unit; claimed with FOR UPDATE SKIP LOCKED (DESIGN.md 8: I1, I3).';

-- ---------------------------------------------------------------------------
-- inventory_reservation: PostgreSQL's record of every reservation message it has
-- processed and its outcome; the query API falls back to it on a Redis miss.
CREATE TABLE inventory_reservation (
    reservation_id text        NOT NULL,
    request_id     text        NOT NULL,
    message_id     text        NOT NULL,
    activity_id    bigint      NOT NULL,
    sku_id         bigint      NOT NULL,
    user_id        bigint      NOT NULL,
    status         text        NOT NULL DEFAULT 'PROCESSING',
    order_id       text        NULL,
    reserved_at    timestamptz NOT NULL,
    expires_at     timestamptz NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    -- I4/I6: one outcome per reservation id, however often its message arrives.
    CONSTRAINT inventory_reservation_pkey PRIMARY KEY (reservation_id),
    -- I4: every reservation ends in exactly one of these; the query API maps
    -- each to QUEUING / SUCCEEDED / FAILED(reason).
    CONSTRAINT inventory_reservation_status_check
        CHECK (status IN ('PROCESSING', 'ORDER_CREATED', 'REJECTED_NO_FINAL_STOCK',
                          'REJECTED_DUPLICATE_USER', 'REJECTED_EXPIRED', 'REJECTED_ACTIVITY')),
    -- I4: ORDER_CREATED without an order id would answer SUCCEEDED with nothing
    -- behind it.
    CONSTRAINT inventory_reservation_order_check
        CHECK (status <> 'ORDER_CREATED' OR order_id IS NOT NULL)
);
-- The query fallback: GET /v1/reservations/{request_id}?activity_id&sku_id with
-- the user from the pass. Not UNIQUE: Redis is the request_id idempotency store
-- (I6) and can lose writes on failover; a second reservation for one request_id
-- must still be recorded (and show up in reconcile), not fail the worker.
CREATE INDEX inventory_reservation_request_idx
    ON inventory_reservation (activity_id, sku_id, user_id, request_id);
COMMENT ON TABLE inventory_reservation IS
    'Outcome of every processed reservation; query fallback (DESIGN.md 8: I4, I6).';

-- ---------------------------------------------------------------------------
-- orders: an order exists when this row commits (DESIGN.md section 2).
CREATE TABLE orders (
    order_id           text        NOT NULL,
    activity_id        bigint      NOT NULL,
    sku_id             bigint      NOT NULL,
    user_id            bigint      NOT NULL,
    request_id         text        NOT NULL,
    reservation_id     text        NOT NULL,
    -- NULL only for the ROW allocator, which has no tokens.
    inventory_token_id text        NULL,
    status             text        NOT NULL DEFAULT 'PENDING_PAYMENT',
    amount_cents       bigint      NULL,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT orders_pkey PRIMARY KEY (order_id),
    -- I2: the final guard for one order per buyer, whatever Redis lost.
    CONSTRAINT orders_activity_sku_user_key UNIQUE (activity_id, sku_id, user_id),
    -- I4/I7: one order per reservation, so a redelivered message that slipped
    -- past the inbox cannot create a second order.
    CONSTRAINT orders_reservation_id_key UNIQUE (reservation_id),
    -- I1: each order holds a distinct token: no unit sold twice.
    CONSTRAINT orders_inventory_token_id_key UNIQUE (inventory_token_id),
    -- I1: the token an order holds exists. The worker holds that token row
    -- FOR UPDATE already, so the FK's KEY SHARE lock costs nothing extra.
    CONSTRAINT orders_inventory_token_fkey
        FOREIGN KEY (inventory_token_id) REFERENCES inventory_token (token_id),
    -- I1: "orders not cancelled" counts exactly these states.
    CONSTRAINT orders_status_check
        CHECK (status IN ('PENDING_PAYMENT', 'PAID', 'CANCELLED', 'CLOSED', 'PAYMENT_UNKNOWN')),
    -- Row sanity: money is never negative.
    CONSTRAINT orders_amount_cents_check CHECK (amount_cents >= 0)
);
-- The order timeout closer scans only unpaid orders, oldest first.
CREATE INDEX orders_pending_payment_idx
    ON orders (created_at) WHERE status = 'PENDING_PAYMENT';
COMMENT ON TABLE orders IS
    'An order exists when its row commits (DESIGN.md 8: I1, I2, I7).';

-- ---------------------------------------------------------------------------
-- inventory_ledger: append-only history of stock movements per reservation.
CREATE TABLE inventory_ledger (
    ledger_id      bigint      GENERATED ALWAYS AS IDENTITY,
    activity_id    bigint      NOT NULL,
    sku_id         bigint      NOT NULL,
    -- NULL for the ROW allocator.
    token_id       text        NULL,
    order_id       text        NULL,
    reservation_id text        NOT NULL,
    kind           text        NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT inventory_ledger_pkey PRIMARY KEY (ledger_id),
    -- I3/I7: each movement happens once per reservation, so a replayed message
    -- or repair job cannot claim or release the same unit twice.
    CONSTRAINT inventory_ledger_reservation_kind_key UNIQUE (reservation_id, kind),
    -- I3: the only movements conservation knows about.
    CONSTRAINT inventory_ledger_kind_check CHECK (kind IN ('CLAIM', 'SELL', 'RELEASE'))
);
COMMENT ON TABLE inventory_ledger IS
    'Append-only stock movements, one per (reservation, kind) (DESIGN.md 8: I3, I7).';

-- ---------------------------------------------------------------------------
-- consumer_inbox: messages whose effect has been committed, per consumer group.
CREATE TABLE consumer_inbox (
    consumer_group text        NOT NULL,
    message_id     text        NOT NULL,
    reservation_id text        NULL,
    received_at    timestamptz NOT NULL DEFAULT now(),
    -- I7: one effect per message per consumer: a redelivery after a crash
    -- between commit and ack finds its row and does nothing twice.
    CONSTRAINT consumer_inbox_pkey PRIMARY KEY (consumer_group, message_id)
);
COMMENT ON TABLE consumer_inbox IS
    'One row per applied message per consumer group (DESIGN.md 8: I7).';

-- ---------------------------------------------------------------------------
-- event_outbox: events written in the same transaction as the state they
-- announce, published to SECKILL_EVENTS afterwards with Nats-Msg-Id evt_<id>.
CREATE TABLE event_outbox (
    event_id     bigint      GENERATED ALWAYS AS IDENTITY,
    aggregate_id text        NOT NULL,
    event_type   text        NOT NULL,
    payload      jsonb       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz NULL,
    -- I4: the id is the publish dedup key (evt_<event_id>), stable across
    -- republishes.
    CONSTRAINT event_outbox_pkey PRIMARY KEY (event_id),
    -- I4/I5: only the events `redis-sync` understands (CONTRACT.md section 6);
    -- an unknown type would be acked and dropped, leaving a reservation unresolved
    -- in Redis.
    CONSTRAINT event_outbox_event_type_check
        CHECK (event_type IN ('order_created', 'reservation_failed', 'compensate',
                              'order_cancelled', 'order_paid'))
);
-- I4: the publisher's SKIP LOCKED batches read only unpublished events, oldest
-- first; published rows leave the index so it stays the size of the backlog.
CREATE INDEX event_outbox_unpublished_idx
    ON event_outbox (event_id) WHERE published_at IS NULL;
COMMENT ON TABLE event_outbox IS
    'Transactional outbox for SECKILL_EVENTS (DESIGN.md 8: I4, I5).';

-- ---------------------------------------------------------------------------
-- payment: provider callbacks, idempotent by payment_id. No foreign key to
-- orders on purpose: money received for an order we do not know must still be
-- recorded for reconciliation, not bounced by a constraint.
CREATE TABLE payment (
    payment_id   text        NOT NULL,
    order_id     text        NOT NULL,
    status       text        NOT NULL,
    amount_cents bigint      NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    -- I6: a repeated callback is the same payment, applied once.
    CONSTRAINT payment_pkey PRIMARY KEY (payment_id),
    -- I1: the closer releases stock only on an authoritative FAILED/CLOSED; an
    -- unknown status must not be read as "unpaid".
    CONSTRAINT payment_status_check CHECK (status IN ('PAID', 'FAILED', 'CLOSED')),
    -- Row sanity: money is never negative.
    CONSTRAINT payment_amount_cents_check CHECK (amount_cents >= 0)
);
-- The closer asks "is this order authoritatively unpaid?" by order id.
CREATE INDEX payment_order_idx ON payment (order_id);
COMMENT ON TABLE payment IS
    'Payment provider callbacks, idempotent by payment_id (DESIGN.md 8: I1, I6).';
