-- 0010_quantity: a buyer may take more than one unit in his one order (issue 29; seed ch8
-- §7.9: payload_hash = hash(activity_id, sku_id, user_id, quantity), §9 step 6: INSERT
-- order_items).
--
-- Applied by `flashsale_pg_worker::migrate` inside one transaction (no BEGIN/COMMIT here).
-- Frozen once applied: a change is a new migration.
--
-- Every guarantee is now per unit:
--   * sku_inventory.max_per_buyer: the units one buyer may take in his one order of the SKU
--     (default 1; part of the SKU's configuration, CONTRACT.md section 4). Redis enforces it
--     on the reservation (its meta carries it); PostgreSQL records what the buyer took.
--   * inventory_reservation.quantity, orders.quantity: the units of the reservation and of
--     its order (default 1: every row before this migration took one).
--   * order_items: one row per order — its SKU, its quantity and the tokens it holds (TOKEN;
--     empty for ROW, whose units are a count).
--   * inventory_token: a reservation holds as many tokens as its quantity. The unique index
--     on reservation_id (0001: "one reservation holds at most one token") becomes a plain one;
--     the writers assert the count before anything commits (pg-worker/src/plan.rs, I1) and the
--     audit counts it per order (orders_without_held_token).
--   * inventory_ledger.unit_no: one CLAIM, SELL and RELEASE row per unit, unique per
--     (reservation, kind, unit): a replay still cannot move a unit twice (I3, I7).
--   * orders.amount_cents = price × quantity (0007's trigger).
--
-- Both order writers take a reservation's units all or none (a request for 2 with 1 left is
-- REJECTED_NO_FINAL_STOCK for that message; the unit stays for the next), as Redis does (`reserve`
-- never takes part of a quantity). The release (cancel, close) and the PAID callback move
-- every unit of the order.

ALTER TABLE sku_inventory
    ADD COLUMN max_per_buyer integer NOT NULL DEFAULT 1,
    ADD CONSTRAINT sku_inventory_max_per_buyer_check CHECK (max_per_buyer BETWEEN 1 AND 100);
ALTER TABLE inventory_reservation
    ADD COLUMN quantity integer NOT NULL DEFAULT 1,
    ADD CONSTRAINT inventory_reservation_quantity_check CHECK (quantity BETWEEN 1 AND 100);
ALTER TABLE orders
    ADD COLUMN quantity integer NOT NULL DEFAULT 1,
    ADD CONSTRAINT orders_quantity_check CHECK (quantity BETWEEN 1 AND 100);

CREATE TABLE order_items (
    order_id    text    NOT NULL,
    activity_id bigint  NOT NULL,
    sku_id      bigint  NOT NULL,
    quantity    integer NOT NULL,
    -- The tokens the order holds, in seq order (TOKEN); empty for the ROW allocator.
    token_ids   text[]  NOT NULL DEFAULT '{}',
    CONSTRAINT order_items_pkey PRIMARY KEY (order_id),
    CONSTRAINT order_items_order_fkey FOREIGN KEY (order_id) REFERENCES orders (order_id),
    CONSTRAINT order_items_quantity_check CHECK (quantity BETWEEN 1 AND 100),
    -- I1: a TOKEN order names one token per unit.
    CONSTRAINT order_items_tokens_check
        CHECK (cardinality(token_ids) = 0 OR cardinality(token_ids) = quantity)
);
COMMENT ON TABLE order_items IS
    'What an order holds: its SKU, its units, their tokens (seed ch8 §9 step 6; DESIGN.md 8: I1).';
-- Orders written before this migration took one unit: their item, from the order's token.
INSERT INTO order_items (order_id, activity_id, sku_id, quantity, token_ids)
SELECT o.order_id, o.activity_id, o.sku_id, 1,
       CASE WHEN o.inventory_token_id IS NULL THEN '{}'::text[] ELSE ARRAY[o.inventory_token_id] END
FROM orders o;

DROP INDEX inventory_token_reservation_key;
CREATE INDEX inventory_token_reservation_idx
    ON inventory_token (reservation_id) WHERE reservation_id IS NOT NULL;

ALTER TABLE inventory_ledger
    ADD COLUMN unit_no integer NOT NULL DEFAULT 1,
    ADD CONSTRAINT inventory_ledger_unit_no_check CHECK (unit_no BETWEEN 1 AND 100),
    DROP CONSTRAINT inventory_ledger_reservation_kind_key,
    ADD CONSTRAINT inventory_ledger_reservation_kind_unit_key UNIQUE (reservation_id, kind, unit_no);

-- ---------------------------------------------------------------------------------------------
-- An order's amount: its unit price times its units.
CREATE OR REPLACE FUNCTION flashsale_order_amount()
RETURNS trigger
LANGUAGE plpgsql
AS $fn$
BEGIN
    SELECT s.price_cents * NEW.quantity INTO NEW.amount_cents
    FROM sku_inventory s
    WHERE s.activity_id = NEW.activity_id AND s.sku_id = NEW.sku_id;
    RETURN NEW;
END;
$fn$;

-- ---------------------------------------------------------------------------------------------
-- An order event's payload (0003) with the order's units: redis-sync's compensation of a
-- released order gives back exactly its quantity.
CREATE OR REPLACE FUNCTION flashsale_order_event(p_event_type text, p_order orders, p_return_stock boolean,
                                      p_now timestamptz)
RETURNS jsonb
LANGUAGE sql
STABLE
AS $fn$
    SELECT jsonb_build_object(
        'schema_version', 1,
        'event_type', p_event_type,
        'reservation_id', p_order.reservation_id,
        'request_id', p_order.request_id,
        -- Every order has its ORDER_CREATED reservation (audit I7); the placeholder only keeps
        -- the event decodable if that were ever broken.
        'message_id', coalesce((SELECT r.message_id FROM inventory_reservation r
                                WHERE r.reservation_id = p_order.reservation_id), 'unrecorded'),
        'payload_hash', 'unrecorded',
        'activity_id', p_order.activity_id,
        'sku_id', p_order.sku_id,
        'user_id', p_order.user_id,
        'quantity', p_order.quantity,
        'order_id', p_order.order_id,
        'return_stock', p_return_stock,
        'release_user', false,
        'occurred_at', to_char(p_now AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'));
$fn$;

-- ---------------------------------------------------------------------------------------------
-- Locks up to p_count AVAILABLE tokens of a SKU that are not in p_held (this transaction's
-- pool: its own locks do not skip them), lowest seq first. The claim of tokens.rs, for many.
CREATE FUNCTION flashsale_lock_tokens(p_activity_id bigint, p_sku_id bigint, p_count integer,
                                      p_held text[])
RETURNS text[]
LANGUAGE sql
SET enable_seqscan = off
AS $fn$
    SELECT coalesce(array_agg(token_id ORDER BY seq), '{}') FROM (
        SELECT token_id, seq FROM inventory_token
        WHERE activity_id = p_activity_id AND sku_id = p_sku_id AND status = 'AVAILABLE'
          AND token_id <> ALL (p_held)
        ORDER BY seq LIMIT greatest(p_count, 0) FOR UPDATE SKIP LOCKED) picked;
$fn$;

-- ---------------------------------------------------------------------------------------------
-- The per-message writer (0002, as 0009 left it), taking p_quantity units all or none. New
-- argument and results, so a new signature: the old one is dropped.
--   r_token_ids: the tokens claimed (TOKEN, ORDER_CREATED), in seq order.
DROP FUNCTION flashsale_order_create(text, text, text, text, bigint, bigint, bigint,
                                     timestamptz, timestamptz, timestamptz, text, integer);

CREATE FUNCTION flashsale_order_create(
    p_consumer_group text,
    p_message_id     text,
    p_reservation_id text,
    p_request_id     text,
    p_activity_id    bigint,
    p_sku_id         bigint,
    p_user_id        bigint,
    p_quantity       integer,
    p_reserved_at    timestamptz,
    p_expires_at     timestamptz,
    p_now            timestamptz,
    p_order_id       text,
    p_pool_size      integer,
    OUT r_outcome    text,
    OUT r_recorded   text,
    OUT r_order_id   text,
    OUT r_token_ids  text[],
    OUT r_claim_us   bigint)
LANGUAGE plpgsql
SET enable_seqscan = off
AS $fn$
DECLARE
    v_activity_status text;
    v_allocator       text;
    v_claim_started   timestamptz;
    v_key             text := p_activity_id || '_' || p_sku_id;
    v_pool            text[];
    v_units           integer;
BEGIN
    -- 1. Inbox: one effect per message per consumer group (I7).
    INSERT INTO consumer_inbox (consumer_group, message_id, reservation_id)
    VALUES (p_consumer_group, p_message_id, p_reservation_id)
    ON CONFLICT (consumer_group, message_id) DO NOTHING;
    IF NOT FOUND THEN
        r_outcome := 'DUPLICATE';
        SELECT status, order_id INTO r_recorded, r_order_id
        FROM inventory_reservation WHERE reservation_id = p_reservation_id;
        RETURN;
    END IF;

    -- 2. The same reservation carried by another message id (a producer bug): its recorded
    -- outcome stands. (Its final row is inserted below; a concurrent twin loses on the key.)
    SELECT status, order_id INTO r_recorded, r_order_id
    FROM inventory_reservation WHERE reservation_id = p_reservation_id;
    IF FOUND THEN
        r_outcome := 'DUPLICATE';
        RETURN;
    END IF;

    -- 2b. The buyer's request id recorded under another reservation (0009).
    IF EXISTS (SELECT 1 FROM inventory_reservation
               WHERE activity_id = p_activity_id AND sku_id = p_sku_id AND user_id = p_user_id
                 AND request_id = p_request_id AND reservation_id <> p_reservation_id
                 AND status <> 'REJECTED_DUPLICATE_USER') THEN
        r_outcome := 'REJECTED_DUPLICATE_USER';
    -- 3. Expired, or the activity terminated (an ENDED activity still honours reservations
    -- taken inside its window until they expire).
    ELSIF p_expires_at <= p_now THEN
        r_outcome := 'REJECTED_EXPIRED';
    ELSE
        SELECT CASE WHEN s.status = 'TERMINATED' THEN 'TERMINATED' ELSE a.status END, s.allocator
            INTO v_activity_status, v_allocator
        FROM activity a
        JOIN sku_inventory s ON s.activity_id = a.activity_id AND s.sku_id = p_sku_id
        WHERE a.activity_id = p_activity_id;
        IF NOT FOUND OR v_activity_status = 'TERMINATED' THEN
            r_outcome := 'REJECTED_ACTIVITY';
        END IF;
    END IF;

    -- 4. Claim p_quantity units, all or none, from this transaction's pool, refilling it with
    -- up to p_pool_size units (this SKU's units asked from this message to the batch's end).
    IF r_outcome IS NULL THEN
        v_claim_started := clock_timestamp();
        IF v_allocator = 'ROW' THEN
            v_units := coalesce(nullif(current_setting('flashsale.row_pool_' || v_key, true), '')::integer, 0);
            IF v_units < p_quantity THEN
                v_units := v_units + flashsale_fill_pool(p_activity_id, p_sku_id, 'ROW',
                    greatest(p_pool_size, p_quantity) - v_units);
            END IF;
            IF v_units < p_quantity THEN
                -- What the pool holds stays for the next message; flashsale_return_units()
                -- gives back what is left at the end.
                r_outcome := 'REJECTED_NO_FINAL_STOCK';
            ELSE
                PERFORM set_config('flashsale.row_pool_' || v_key, (v_units - p_quantity)::text, true);
            END IF;
        ELSE
            v_pool := coalesce(string_to_array(nullif(current_setting(
                'flashsale.token_pool_' || v_key, true), ''), ','), '{}');
            IF cardinality(v_pool) < p_quantity THEN
                v_pool := v_pool || flashsale_lock_tokens(p_activity_id, p_sku_id,
                    greatest(p_pool_size, p_quantity) - cardinality(v_pool), v_pool);
            END IF;
            PERFORM set_config('flashsale.token_pool_' || v_key, array_to_string(v_pool, ','), true);
            IF cardinality(v_pool) < p_quantity THEN
                -- A plain read sees tokens other transactions hold locked but not yet committed
                -- as still AVAILABLE: they may roll back, so this is "not now", not "none left".
                IF EXISTS (SELECT 1 FROM inventory_token
                           WHERE activity_id = p_activity_id AND sku_id = p_sku_id
                             AND status = 'AVAILABLE' AND token_id <> ALL (v_pool)) THEN
                    -- Nothing but the inbox row is written yet: take it back, so the message
                    -- leaves no trace and is retried.
                    DELETE FROM consumer_inbox
                    WHERE consumer_group = p_consumer_group AND message_id = p_message_id;
                    r_outcome := 'CONTENDED';
                    RETURN;
                END IF;
                r_outcome := 'REJECTED_NO_FINAL_STOCK';
            ELSE
                r_token_ids := v_pool[1:p_quantity];
                PERFORM set_config('flashsale.token_pool_' || v_key,
                    array_to_string(v_pool[p_quantity + 1:], ','), true);
                -- Locked by this transaction since they entered the pool, so still AVAILABLE.
                UPDATE inventory_token
                SET status = 'CLAIMED', reservation_id = p_reservation_id, order_id = p_order_id,
                    claimed_at = now(), updated_at = now()
                WHERE token_id = ANY (r_token_ids) AND status = 'AVAILABLE';
                GET DIAGNOSTICS v_units = ROW_COUNT;
                IF v_units <> p_quantity THEN
                    RAISE EXCEPTION 'pooled tokens % are not all AVAILABLE', r_token_ids;
                END IF;
            END IF;
        END IF;
        r_claim_us := (extract(epoch FROM clock_timestamp() - v_claim_started) * 1000000)::bigint;
    END IF;

    -- 5. The order; the final guard of one order per buyer (I2).
    IF r_outcome IS NULL THEN
        INSERT INTO orders (order_id, activity_id, sku_id, user_id, request_id, reservation_id,
                            inventory_token_id, quantity)
        VALUES (p_order_id, p_activity_id, p_sku_id, p_user_id, p_request_id, p_reservation_id,
                r_token_ids[1], p_quantity)
        ON CONFLICT (activity_id, sku_id, user_id) DO NOTHING;
        IF NOT FOUND THEN
            -- The units go back in this same transaction (I3), to the pool for the batch.
            IF r_token_ids IS NOT NULL THEN
                UPDATE inventory_token
                SET status = 'AVAILABLE', reservation_id = NULL, order_id = NULL,
                    claimed_at = NULL, updated_at = now()
                WHERE token_id = ANY (r_token_ids);
                PERFORM set_config('flashsale.token_pool_' || v_key,
                    array_to_string(r_token_ids || coalesce(string_to_array(nullif(current_setting(
                        'flashsale.token_pool_' || v_key, true), ''), ','), '{}'), ','), true);
            ELSE
                PERFORM set_config('flashsale.row_pool_' || v_key,
                    (current_setting('flashsale.row_pool_' || v_key)::integer + p_quantity)::text,
                    true);
            END IF;
            r_token_ids := NULL;
            r_outcome := 'REJECTED_DUPLICATE_USER';
        ELSE
            -- 6. Its items, and the ledger: one CLAIM per unit.
            INSERT INTO order_items (order_id, activity_id, sku_id, quantity, token_ids)
            VALUES (p_order_id, p_activity_id, p_sku_id, p_quantity, coalesce(r_token_ids, '{}'));
            INSERT INTO inventory_ledger (activity_id, sku_id, token_id, order_id, reservation_id,
                                          kind, unit_no)
            SELECT p_activity_id, p_sku_id, r_token_ids[u], p_order_id, p_reservation_id, 'CLAIM', u
            FROM generate_series(1, p_quantity) AS u;
            r_outcome := 'ORDER_CREATED';
            r_order_id := p_order_id;
        END IF;
    END IF;

    -- The reservation, once, with its final status.
    INSERT INTO inventory_reservation (reservation_id, request_id, message_id, activity_id,
                                       sku_id, user_id, status, order_id, reserved_at, expires_at,
                                       quantity)
    VALUES (p_reservation_id, p_request_id, p_message_id, p_activity_id, p_sku_id, p_user_id,
            r_outcome, r_order_id, p_reserved_at, p_expires_at, p_quantity);
END;
$fn$;

-- ---------------------------------------------------------------------------------------------
-- The set-based batch's reads (0004, as 0006 left it), wanting each SKU's units: the sum of
-- its messages' quantities; and the requests recorded under another reservation (0009's rule,
-- read here under the function's enable_seqscan = off: a plain statement of its own was
-- planned as a sequential scan on tables analyzed empty). New arguments (p_quantities,
-- p_request_ids), so a new signature.
DROP FUNCTION flashsale_order_facts(text, text[], text[], bigint[], bigint[], bigint[],
                                    timestamptz[], timestamptz);

CREATE FUNCTION flashsale_order_facts(
    p_consumer_group    text,
    p_message_ids       text[],
    p_reservation_ids   text[],
    p_activity_ids      bigint[],
    p_sku_ids           bigint[],
    p_user_ids          bigint[],
    p_expires_at        timestamptz[],
    p_quantities        integer[],
    p_request_ids       text[],
    p_now               timestamptz,
    -- Message ids whose inbox row this call inserted.
    OUT r_inserted_ids      text[],
    -- Recorded reservations among the batch's reservation ids: id, status, order id.
    OUT r_recorded_ids      text[],
    OUT r_recorded_statuses text[],
    OUT r_recorded_orders   text[],
    -- 1-based positions (not expired) whose buyer already holds an order.
    OUT r_ordered_positions integer[],
    -- Per SKU the batch claims from, in key order.
    OUT r_sku_activity_ids  bigint[],
    OUT r_sku_ids           bigint[],
    OUT r_sku_statuses      text[],      -- activity status; NULL: activity or SKU unknown
    OUT r_sku_allocators    text[],
    OUT r_sku_available     bigint[],    -- ROW: available_stock under the row lock
    OUT r_sku_contended     boolean[],   -- TOKEN: fewer locked than wanted, others hold some
    OUT r_sku_claim_us      bigint[],    -- the claim step's duration; NULL: no claim
    -- The tokens locked, in seq order per SKU; r_token_skus = 1-based index into r_sku_*.
    OUT r_token_skus        integer[],
    OUT r_token_ids         text[],
    -- 1-based positions whose buyer's request id is recorded under another reservation that
    -- is not itself a duplicate buyer (0009, plan rule 2b).
    OUT r_requested_positions integer[])
LANGUAGE plpgsql
SET enable_seqscan = off
AS $fn$
DECLARE
    v_sku        record;
    v_index      integer := 0;
    v_status     text;
    v_allocator  text;
    v_available  bigint;
    v_tokens     text[];
    v_contended  boolean;
    v_started    timestamptz;
    v_claim_us   bigint;
BEGIN
    -- 1. Inbox (I7): the first occurrence of each message id, in id order.
    WITH inserted AS (
        INSERT INTO consumer_inbox (consumer_group, message_id, reservation_id)
        SELECT DISTINCT ON (m.message_id) p_consumer_group, m.message_id, m.reservation_id
        FROM unnest(p_message_ids, p_reservation_ids) WITH ORDINALITY
             AS m(message_id, reservation_id, pos)
        ORDER BY m.message_id, m.pos
        ON CONFLICT (consumer_group, message_id) DO NOTHING
        RETURNING message_id)
    SELECT coalesce(array_agg(i.message_id), '{}') INTO r_inserted_ids FROM inserted i;

    -- 2. Recorded reservations, in a snapshot taken after the inbox insert.
    SELECT coalesce(array_agg(r.reservation_id), '{}'), coalesce(array_agg(r.status), '{}'),
           coalesce(array_agg(r.order_id), '{}')
    INTO r_recorded_ids, r_recorded_statuses, r_recorded_orders
    FROM unnest(p_reservation_ids) AS m(reservation_id)
    CROSS JOIN LATERAL (
        SELECT ir.reservation_id, ir.status, ir.order_id FROM inventory_reservation ir
        WHERE ir.reservation_id = m.reservation_id OFFSET 0) r;

    -- 3. Buyers who already hold an order (the orders insert will still be the final guard).
    SELECT coalesce(array_agg(m.pos::integer ORDER BY m.pos), '{}') INTO r_ordered_positions
    FROM unnest(p_activity_ids, p_sku_ids, p_user_ids, p_expires_at) WITH ORDINALITY
         AS m(activity_id, sku_id, user_id, expires_at, pos)
    WHERE m.expires_at > p_now
      AND EXISTS (SELECT 1 FROM orders o
                  WHERE o.activity_id = m.activity_id AND o.sku_id = m.sku_id
                    AND o.user_id = m.user_id
                  OFFSET 0);

    -- 3b. Requests recorded under another reservation (0009's key, whose predicate the
    -- subquery repeats so that its index serves it).
    SELECT coalesce(array_agg(m.pos::integer ORDER BY m.pos), '{}') INTO r_requested_positions
    FROM unnest(p_activity_ids, p_sku_ids, p_user_ids, p_request_ids, p_reservation_ids)
         WITH ORDINALITY AS m(activity_id, sku_id, user_id, request_id, reservation_id, pos)
    WHERE EXISTS (SELECT 1 FROM inventory_reservation r
                  WHERE r.activity_id = m.activity_id AND r.sku_id = m.sku_id
                    AND r.user_id = m.user_id AND r.request_id = m.request_id
                    AND r.status <> 'REJECTED_DUPLICATE_USER'
                    AND r.reservation_id <> m.reservation_id
                  OFFSET 0);

    r_sku_activity_ids := '{}'; r_sku_ids := '{}'; r_sku_statuses := '{}';
    r_sku_allocators := '{}'; r_sku_available := '{}'; r_sku_contended := '{}';
    r_sku_claim_us := '{}'; r_token_skus := '{}'; r_token_ids := '{}';
    -- 4. Per SKU, in key order: the activity, then the claim.
    -- wanted: the units the batch may take from the SKU (each message id once, its quantity).
    FOR v_sku IN
        SELECT d.activity_id, d.sku_id, sum(d.quantity)::integer AS wanted
        FROM (SELECT DISTINCT ON (m.message_id) m.activity_id, m.sku_id, m.quantity
              FROM unnest(p_message_ids, p_activity_ids, p_sku_ids, p_expires_at, p_quantities)
                   AS m(message_id, activity_id, sku_id, expires_at, quantity)
              WHERE m.expires_at > p_now
              ORDER BY m.message_id) d
        GROUP BY d.activity_id, d.sku_id
        ORDER BY d.activity_id, d.sku_id
    LOOP
        v_index := v_index + 1;
        v_status := NULL; v_allocator := NULL; v_available := NULL;
        v_contended := false; v_claim_us := NULL;
        SELECT CASE WHEN s.status = 'TERMINATED' THEN 'TERMINATED' ELSE a.status END, s.allocator
            INTO v_status, v_allocator
        FROM activity a
        JOIN sku_inventory s ON s.activity_id = a.activity_id AND s.sku_id = v_sku.sku_id
        WHERE a.activity_id = v_sku.activity_id;
        IF v_status IS NOT NULL AND v_status <> 'TERMINATED' THEN
            v_started := clock_timestamp();
            IF v_allocator = 'ROW' THEN
                SELECT available_stock INTO v_available FROM sku_inventory
                WHERE activity_id = v_sku.activity_id AND sku_id = v_sku.sku_id FOR UPDATE;
            ELSE
                -- tokens.rs' claim, for many: ORDER BY seq keeps inventory_token_available_idx.
                SELECT coalesce(array_agg(t.token_id ORDER BY t.seq), '{}') INTO v_tokens
                FROM (SELECT token_id, seq FROM inventory_token
                      WHERE activity_id = v_sku.activity_id AND sku_id = v_sku.sku_id
                        AND status = 'AVAILABLE'
                      ORDER BY seq LIMIT v_sku.wanted FOR UPDATE SKIP LOCKED) t;
                IF cardinality(v_tokens) < v_sku.wanted THEN
                    -- A plain read sees tokens other transactions hold locked (uncommitted) as
                    -- AVAILABLE, and ours too: more AVAILABLE than ours means "not now", not
                    -- "none left". LIMIT: at most ours + 1 index entries.
                    SELECT count(*) > cardinality(v_tokens) INTO v_contended
                    FROM (SELECT 1 FROM inventory_token
                          WHERE activity_id = v_sku.activity_id AND sku_id = v_sku.sku_id
                            AND status = 'AVAILABLE'
                          LIMIT cardinality(v_tokens) + 1) seen;
                END IF;
                r_token_skus := r_token_skus || array_fill(v_index, ARRAY[cardinality(v_tokens)]);
                r_token_ids := r_token_ids || v_tokens;
            END IF;
            v_claim_us := (extract(epoch FROM clock_timestamp() - v_started) * 1000000)::bigint;
        END IF;
        r_sku_activity_ids := r_sku_activity_ids || v_sku.activity_id;
        r_sku_ids := r_sku_ids || v_sku.sku_id;
        r_sku_statuses := r_sku_statuses || v_status;
        r_sku_allocators := r_sku_allocators || v_allocator;
        r_sku_available := r_sku_available || v_available;
        r_sku_contended := r_sku_contended || v_contended;
        r_sku_claim_us := r_sku_claim_us || v_claim_us;
    END LOOP;
END;
$fn$;

-- ---------------------------------------------------------------------------------------------
-- Writes a planned batch (0004's, per unit). The reservation arrays hold every message with a
-- final outcome (created or rejected), in message order, each with its quantity; p_order_ids
-- is set for ORDER_CREATED only, p_first_token_ids for ORDER_CREATED with the TOKEN allocator
-- (the order's first token, orders.inventory_token_id). p_unit_token_ids: every token claimed,
-- p_unit_rows the 1-based final row each belongs to (in seq order within a row). p_row_* =
-- units each ROW SKU sold in this batch. p_contended_ids: inbox rows to take back.
DROP FUNCTION flashsale_order_apply(text, text[], text[], text[], text[], bigint[], bigint[],
                                    bigint[], text[], text[], text[], timestamptz[],
                                    timestamptz[], bigint[], bigint[], bigint[]);

CREATE FUNCTION flashsale_order_apply(
    p_consumer_group   text,
    p_contended_ids    text[],
    p_reservation_ids  text[],
    p_request_ids      text[],
    p_message_ids      text[],
    p_activity_ids     bigint[],
    p_sku_ids          bigint[],
    p_user_ids         bigint[],
    p_statuses         text[],
    p_order_ids        text[],
    p_quantities       integer[],
    p_first_token_ids  text[],
    p_unit_token_ids   text[],
    p_unit_rows        integer[],
    p_reserved_at      timestamptz[],
    p_expires_at       timestamptz[],
    p_row_activity_ids bigint[],
    p_row_sku_ids      bigint[],
    p_row_units        bigint[])
RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
AS $fn$
DECLARE
    v_expected   bigint;
    v_rows       bigint;
    v_message_id text;
BEGIN
    -- Contended messages are rare and few: one delete by primary key each (a set delete's
    -- generic plan walked every inbox row of the consumer group, filtering by id).
    FOREACH v_message_id IN ARRAY p_contended_ids
    LOOP
        DELETE FROM consumer_inbox
        WHERE consumer_group = p_consumer_group AND message_id = v_message_id;
    END LOOP;

    SELECT count(*) FILTER (WHERE s = 'ORDER_CREATED') INTO v_expected
    FROM unnest(p_statuses) AS s;
    IF v_expected > 0 THEN
        -- The final guard of one order per buyer (I2); in buyer-key order, so two batches
        -- meeting on buyers wait for each other in one order.
        INSERT INTO orders (order_id, activity_id, sku_id, user_id, request_id, reservation_id,
                            inventory_token_id, quantity)
        SELECT m.order_id, m.activity_id, m.sku_id, m.user_id, m.request_id, m.reservation_id,
               m.token_id, m.quantity
        FROM unnest(p_order_ids, p_activity_ids, p_sku_ids, p_user_ids, p_request_ids,
                    p_reservation_ids, p_first_token_ids, p_statuses, p_quantities)
             AS m(order_id, activity_id, sku_id, user_id, request_id, reservation_id, token_id,
                  status, quantity)
        WHERE m.status = 'ORDER_CREATED'
        ORDER BY m.activity_id, m.sku_id, m.user_id
        ON CONFLICT (activity_id, sku_id, user_id) DO NOTHING;
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        IF v_rows <> v_expected THEN
            RAISE EXCEPTION USING ERRCODE = 'FS001',
                MESSAGE = format('%s of %s orders met a buyer the facts did not show',
                                 v_expected - v_rows, v_expected);
        END IF;

        -- Tokens held locked since the facts, so still AVAILABLE (I1, I3). Not filtered by
        -- status: that would make the partial claim index look like the way in and turn the
        -- join into a hashed scan of every AVAILABLE token per batch; `token_id = ANY` keeps
        -- it to primary-key lookups. A token that is not AVAILABLE (cannot happen) gets a NULL
        -- status, which the NOT NULL constraint refuses: the batch rolls back.
        v_expected := cardinality(p_unit_token_ids);
        IF v_expected > 0 THEN
            UPDATE inventory_token t
            SET status = CASE WHEN t.status = 'AVAILABLE' THEN 'CLAIMED' END,
                reservation_id = p_reservation_ids[u.row], order_id = p_order_ids[u.row],
                claimed_at = now(), updated_at = now()
            FROM unnest(p_unit_token_ids, p_unit_rows) AS u(token_id, row)
            WHERE t.token_id = ANY (p_unit_token_ids) AND t.token_id = u.token_id;
            GET DIAGNOSTICS v_rows = ROW_COUNT;
            IF v_rows <> v_expected THEN
                RAISE EXCEPTION '% of % locked tokens are missing', v_expected - v_rows, v_expected;
            END IF;
        END IF;

        -- Each order's item, and one ledger CLAIM per unit (TOKEN: its token; ROW: none).
        INSERT INTO order_items (order_id, activity_id, sku_id, quantity, token_ids)
        SELECT m.order_id, m.activity_id, m.sku_id, m.quantity, coalesce(t.tokens, '{}')
        FROM unnest(p_order_ids, p_activity_ids, p_sku_ids, p_quantities, p_statuses)
             WITH ORDINALITY AS m(order_id, activity_id, sku_id, quantity, status, pos)
        LEFT JOIN (SELECT u.row, array_agg(u.token_id ORDER BY u.ord) AS tokens
                   FROM unnest(p_unit_token_ids, p_unit_rows) WITH ORDINALITY AS u(token_id, row, ord)
                   GROUP BY u.row) t ON t.row = m.pos
        WHERE m.status = 'ORDER_CREATED'
        ORDER BY m.pos;
        INSERT INTO inventory_ledger (activity_id, sku_id, token_id, order_id, reservation_id,
                                      kind, unit_no)
        SELECT m.activity_id, m.sku_id, t.tokens[g.unit_no], m.order_id, m.reservation_id,
               'CLAIM', g.unit_no
        FROM unnest(p_activity_ids, p_sku_ids, p_order_ids, p_reservation_ids, p_statuses,
                    p_quantities) WITH ORDINALITY
             AS m(activity_id, sku_id, order_id, reservation_id, status, quantity, pos)
        LEFT JOIN (SELECT u.row, array_agg(u.token_id ORDER BY u.ord) AS tokens
                   FROM unnest(p_unit_token_ids, p_unit_rows) WITH ORDINALITY AS u(token_id, row, ord)
                   GROUP BY u.row) t ON t.row = m.pos
        CROSS JOIN LATERAL generate_series(1, m.quantity) AS g(unit_no)
        WHERE m.status = 'ORDER_CREATED'
        ORDER BY m.pos, g.unit_no;
    END IF;

    IF cardinality(p_row_units) > 0 THEN
        -- The row is held locked since the facts read available_stock (I1, I3).
        UPDATE sku_inventory s
        SET available_stock = s.available_stock - d.units, updated_at = now()
        FROM unnest(p_row_activity_ids, p_row_sku_ids, p_row_units) AS d(activity_id, sku_id, units)
        WHERE s.activity_id = d.activity_id AND s.sku_id = d.sku_id
          AND s.available_stock >= d.units;
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        IF v_rows <> cardinality(p_row_units) THEN
            RAISE EXCEPTION 'a ROW SKU has fewer units than its locked facts said';
        END IF;
    END IF;

    -- The reservations, once, with their final status (I4).
    INSERT INTO inventory_reservation (reservation_id, request_id, message_id, activity_id,
                                       sku_id, user_id, status, order_id, reserved_at, expires_at,
                                       quantity)
    SELECT * FROM unnest(p_reservation_ids, p_request_ids, p_message_ids, p_activity_ids,
                         p_sku_ids, p_user_ids, p_statuses, p_order_ids, p_reserved_at,
                         p_expires_at, p_quantities);
END;
$fn$;


-- ---------------------------------------------------------------------------------------------
-- flashsale_order_release (0003), every unit of the order: ROW returns its quantity to the
-- counter; TOKEN moves every token the reservation holds (exactly its quantity, CLAIMED, or
-- the transaction aborts); one RELEASE ledger row per unit. Same signature, same outcomes.
CREATE OR REPLACE FUNCTION flashsale_order_release(
    p_order_id    text,
    p_kind        text,
    p_activity_id bigint,
    p_user_id     bigint,
    p_now         timestamptz,
    OUT r_outcome text,
    OUT r_status  text)
LANGUAGE plpgsql
SET enable_seqscan = off
AS $fn$
DECLARE
    v_order     orders%ROWTYPE;
    v_final     text;
    v_policy    text;
    v_timeout   bigint;
    v_allocator text;
    v_return    boolean;
    v_tokens    text[];
    v_moved     integer;
BEGIN
    IF p_kind = 'CANCEL' THEN
        SELECT * INTO v_order FROM orders WHERE order_id = p_order_id FOR UPDATE;
        IF NOT FOUND OR v_order.activity_id <> p_activity_id OR v_order.user_id <> p_user_id THEN
            r_outcome := 'NOT_FOUND';
            RETURN;
        END IF;
        v_final := 'CANCELLED';
    ELSIF p_kind = 'CLOSE' THEN
        SELECT * INTO v_order FROM orders WHERE order_id = p_order_id FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            r_outcome := CASE WHEN EXISTS (SELECT 1 FROM orders WHERE order_id = p_order_id)
                              THEN 'BUSY' ELSE 'NOT_FOUND' END;
            RETURN;
        END IF;
        v_final := 'CLOSED';
    ELSE
        RAISE EXCEPTION 'unknown release kind %', p_kind;
    END IF;
    r_status := v_order.status;
    IF v_order.status <> 'PENDING_PAYMENT' THEN
        r_outcome := 'NOT_PENDING';
        RETURN;
    END IF;
    -- Authoritatively unpaid: no payment, or FAILED/CLOSED ones only.
    IF EXISTS (SELECT 1 FROM payment WHERE order_id = p_order_id AND status = 'PAID') THEN
        r_outcome := 'PAID_RECORDED';
        RETURN;
    END IF;
    SELECT a.release_policy, a.pay_timeout_ms, s.allocator INTO v_policy, v_timeout, v_allocator
    FROM activity a
    JOIN sku_inventory s ON s.activity_id = a.activity_id AND s.sku_id = v_order.sku_id
    WHERE a.activity_id = v_order.activity_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'order % has no activity/sku row', p_order_id;
    END IF;
    IF p_kind = 'CLOSE' AND v_order.created_at + v_timeout * interval '1 millisecond' > p_now THEN
        r_outcome := 'NOT_DUE';
        RETURN;
    END IF;

    UPDATE orders SET status = v_final, updated_at = now() WHERE order_id = p_order_id;
    IF v_allocator = 'ROW' THEN
        UPDATE sku_inventory SET available_stock = available_stock + v_order.quantity,
            updated_at = now()
        WHERE activity_id = v_order.activity_id AND sku_id = v_order.sku_id;
        v_return := true;
    ELSE
        SELECT coalesce(array_agg(token_id ORDER BY seq), '{}') INTO v_tokens
        FROM inventory_token
        WHERE reservation_id = v_order.reservation_id AND status = 'CLAIMED';
        IF cardinality(v_tokens) <> v_order.quantity THEN
            -- A live unpaid order always holds its CLAIMED tokens (audit I1); releasing
            -- something else would mint or lose a unit. Abort the whole transaction.
            RAISE EXCEPTION 'order % holds % CLAIMED tokens, not its % units', p_order_id,
                cardinality(v_tokens), v_order.quantity;
        END IF;
        IF v_policy = 'RELEASED' THEN
            UPDATE inventory_token SET status = 'RELEASED', updated_at = now()
            WHERE token_id = ANY (v_tokens) AND status = 'CLAIMED';
            v_return := false;
        ELSE
            UPDATE inventory_token
            SET status = 'AVAILABLE', reservation_id = NULL, order_id = NULL, claimed_at = NULL,
                updated_at = now()
            WHERE token_id = ANY (v_tokens) AND status = 'CLAIMED';
            v_return := true;
        END IF;
        GET DIAGNOSTICS v_moved = ROW_COUNT;
        IF v_moved <> v_order.quantity THEN
            RAISE EXCEPTION 'order % released % of its % units', p_order_id, v_moved,
                v_order.quantity;
        END IF;
    END IF;
    INSERT INTO inventory_ledger (activity_id, sku_id, token_id, order_id, reservation_id, kind,
                                  unit_no)
    SELECT v_order.activity_id, v_order.sku_id, v_tokens[u], p_order_id, v_order.reservation_id,
           'RELEASE', u
    FROM generate_series(1, v_order.quantity) AS u
    ON CONFLICT (reservation_id, kind, unit_no) DO NOTHING;
    INSERT INTO event_outbox (aggregate_id, event_type, payload)
    VALUES (v_order.reservation_id, 'order_cancelled',
            flashsale_order_event('order_cancelled', v_order, v_return, p_now));
    r_outcome := 'RELEASED';
    r_status := v_final;
END;
$fn$;


-- ---------------------------------------------------------------------------------------------
-- flashsale_payment_callback (0003), PAID moving every unit of the order: each token the
-- reservation holds SOLD (exactly its quantity, or the transaction aborts), one SELL ledger row
-- per unit. The amount checked is the order's, price × quantity (flashsale_order_amount).
-- Same signature, same outcomes.
CREATE OR REPLACE FUNCTION flashsale_payment_callback(
    p_payment_id   text,
    p_order_id     text,
    p_status       text,
    p_amount_cents bigint,
    p_now          timestamptz,
    OUT r_outcome      text,
    OUT r_order_status text,
    OUT r_replayed     boolean)
LANGUAGE plpgsql
SET enable_seqscan = off
AS $fn$
DECLARE
    v_order    orders%ROWTYPE;
    v_recorded payment%ROWTYPE;
    v_tokens   text[];
    v_sold     integer;
BEGIN
    r_replayed := false;
    IF p_status NOT IN ('PAID', 'FAILED', 'CLOSED') THEN
        SELECT * INTO v_order FROM orders WHERE order_id = p_order_id FOR UPDATE;
        IF FOUND AND v_order.status = 'PENDING_PAYMENT' THEN
            UPDATE orders SET status = 'PAYMENT_UNKNOWN', updated_at = now()
            WHERE order_id = p_order_id;
            v_order.status := 'PAYMENT_UNKNOWN';
        END IF;
        r_outcome := 'PAYMENT_UNKNOWN';
        r_order_status := v_order.status;
        RETURN;
    END IF;

    -- Idempotency by payment_id (I6). A concurrent twin waits here for our commit, then reads
    -- the outcome we recorded.
    INSERT INTO payment (payment_id, order_id, status, amount_cents)
    VALUES (p_payment_id, p_order_id, p_status, p_amount_cents)
    ON CONFLICT (payment_id) DO NOTHING;
    IF NOT FOUND THEN
        SELECT * INTO v_recorded FROM payment WHERE payment_id = p_payment_id;
        SELECT status INTO r_order_status FROM orders WHERE order_id = v_recorded.order_id;
        IF v_recorded.order_id = p_order_id AND v_recorded.status = p_status
           AND v_recorded.amount_cents = p_amount_cents THEN
            r_outcome := v_recorded.outcome;
            r_replayed := true;
        ELSE
            r_outcome := 'PAYMENT_CONFLICT';
        END IF;
        RETURN;
    END IF;

    SELECT * INTO v_order FROM orders WHERE order_id = p_order_id FOR UPDATE;
    IF NOT FOUND THEN
        r_outcome := CASE WHEN p_status = 'PAID' THEN 'REFUND_NEEDED' ELSE 'UNPAID' END;
    ELSIF p_status = 'PAID' THEN
        IF v_order.status NOT IN ('PENDING_PAYMENT', 'PAYMENT_UNKNOWN') THEN
            -- CANCELLED/CLOSED stay so (no resurrection); PAID was paid by another payment.
            r_outcome := 'REFUND_NEEDED';
        ELSIF v_order.amount_cents IS NOT NULL AND v_order.amount_cents <> p_amount_cents THEN
            UPDATE orders SET status = 'PAYMENT_UNKNOWN', updated_at = now()
            WHERE order_id = p_order_id;
            v_order.status := 'PAYMENT_UNKNOWN';
            r_outcome := 'AMOUNT_MISMATCH';
        ELSE
            UPDATE orders
            SET status = 'PAID', amount_cents = coalesce(amount_cents, p_amount_cents),
                updated_at = now()
            WHERE order_id = p_order_id;
            v_order.status := 'PAID';
            IF v_order.inventory_token_id IS NOT NULL THEN
                SELECT coalesce(array_agg(token_id ORDER BY seq), '{}') INTO v_tokens
                FROM inventory_token
                WHERE reservation_id = v_order.reservation_id AND status = 'CLAIMED';
                UPDATE inventory_token SET status = 'SOLD', updated_at = now()
                WHERE token_id = ANY (v_tokens) AND status = 'CLAIMED';
                GET DIAGNOSTICS v_sold = ROW_COUNT;
                IF v_sold <> v_order.quantity THEN
                    RAISE EXCEPTION 'order % holds % CLAIMED tokens, not its % units',
                        p_order_id, v_sold, v_order.quantity;
                END IF;
            END IF;
            INSERT INTO inventory_ledger (activity_id, sku_id, token_id, order_id,
                                          reservation_id, kind, unit_no)
            SELECT v_order.activity_id, v_order.sku_id, v_tokens[u], p_order_id,
                   v_order.reservation_id, 'SELL', u
            FROM generate_series(1, v_order.quantity) AS u
            ON CONFLICT (reservation_id, kind, unit_no) DO NOTHING;
            INSERT INTO event_outbox (aggregate_id, event_type, payload)
            VALUES (v_order.reservation_id, 'order_paid',
                    flashsale_order_event('order_paid', v_order, false, p_now));
            r_outcome := 'PAID';
        END IF;
    ELSE
        IF v_order.status = 'PAYMENT_UNKNOWN'
           AND NOT EXISTS (SELECT 1 FROM payment WHERE order_id = p_order_id AND status = 'PAID') THEN
            UPDATE orders SET status = 'PENDING_PAYMENT', updated_at = now()
            WHERE order_id = p_order_id;
            v_order.status := 'PENDING_PAYMENT';
        END IF;
        r_outcome := 'UNPAID';
    END IF;
    r_order_status := v_order.status;
    UPDATE payment SET outcome = r_outcome WHERE payment_id = p_payment_id;
END;
$fn$;

COMMENT ON FUNCTION flashsale_order_create(text, text, text, text, bigint, bigint, bigint,
                                           integer, timestamptz, timestamptz, timestamptz, text,
                                           integer) IS
    'One order-create message of p_quantity units: inbox, duplicate request, expiry/activity, claim all or none, order, items, ledger per unit, reservation (DESIGN.md 5).';
COMMENT ON FUNCTION flashsale_order_facts(text, text[], text[], bigint[], bigint[], bigint[],
                                          timestamptz[], integer[], text[], timestamptz) IS
    'A batch of order-create messages: inbox insert, recorded reservations, buyers with orders, per-SKU claim of the units wanted (locks); writes nothing else (DESIGN.md 5).';
COMMENT ON FUNCTION flashsale_order_apply(text, text[], text[], text[], text[], bigint[],
                                          bigint[], bigint[], text[], text[], integer[], text[],
                                          text[], integer[], timestamptz[], timestamptz[],
                                          bigint[], bigint[], bigint[]) IS
    'Writes a planned batch: contended inbox rows back, orders, token claims, items, ledger per unit, ROW units, reservations (DESIGN.md 5).';
COMMENT ON FUNCTION flashsale_lock_tokens(bigint, bigint, integer, text[]) IS
    'Locks up to N AVAILABLE tokens of a SKU not already in this transaction''s pool, lowest seq first.';
