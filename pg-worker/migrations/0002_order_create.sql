-- 0002_order_create: the order-writer's per-message transaction body (DESIGN.md section 5)
-- as server-side functions, so that a message costs one statement instead of eight round
-- trips and the worker can pipeline a whole batch of them in one round trip.
--
-- Applied by `flashsale_pg_worker::migrate` inside one transaction (no BEGIN/COMMIT here).
-- Frozen once applied: a change is a new migration (`CREATE OR REPLACE FUNCTION`).
--
-- The functions decide and write; they never commit and never publish. The caller
-- (pg-worker/src/order_writer.rs) sends one flashsale_order_create call per message of a
-- batch in ONE plain transaction (no savepoints: a subtransaction per message cost more than
-- the rest of the message, see order_writer.rs), calls flashsale_return_units() before
-- COMMIT, writes the outbox event for each outcome (the compensation flags are ONE Rust
-- function, `wire::RejectReason::compensation`, not duplicated here), commits, and only then
-- acks. If a call fails, the caller rolls the transaction back and redoes the batch without
-- that message. benches/pgbench/order_txn.sql runs the same statements.
--
-- Batch unit pools. A claim that scans for "the first AVAILABLE token" walks past every token
-- that another in-flight transaction holds locked (SKIP LOCKED has to look at each), and past
-- this transaction's own earlier claims; with B messages per transaction and W writers that
-- is O(B x W) per claim, so batching made claims slower. Instead the first message of a SKU
-- in a transaction takes units for all of that SKU's messages still to come in the batch
-- (p_pool_size, computed by the caller) in ONE step, and keeps them in a transaction-local
-- pool (a custom setting set with is_local = true):
--   TOKEN: one `ORDER BY seq LIMIT p_pool_size FOR UPDATE SKIP LOCKED` scan locks that many
--          AVAILABLE tokens; each message then claims one of them by primary key. Unused
--          tokens were only locked, never changed: the commit simply releases them.
--   ROW:   one conditional decrement `available_stock - least(available_stock, n) WHERE
--          available_stock > 0` takes n units; each message then takes one from the pool, and
--          flashsale_return_units() adds the unused rest back before COMMIT, in the same
--          transaction, so every committed state conserves stock (I1, I3).
-- A message rejected as a duplicate buyer gives its unit back to the pool (a later message of
-- the batch may use it). When a pool runs dry the next message refills it the same way. A
-- rolled-back transaction takes its pools with it (the settings are transaction-local).
--
-- flashsale_order_create outcomes (r_outcome), each with every write it implies already done:
--   CONTENDED                 AVAILABLE tokens remain but every one is locked by other
--                             transactions: nothing written (its inbox row is deleted again);
--                             retry shortly.
--   DUPLICATE                 the inbox (or the reservation table) already has this message:
--                             nothing written; r_recorded/r_order_id = the reservation's
--                             recorded status and order id, for the caller to re-emit (I7).
--   REJECTED_EXPIRED          reservation_expires_at <= p_now (I4).
--   REJECTED_ACTIVITY         activity TERMINATED, or activity/SKU unknown to PostgreSQL.
--   REJECTED_NO_FINAL_STOCK   no AVAILABLE token (TOKEN) / available_stock = 0 (ROW) (I1).
--   REJECTED_DUPLICATE_USER   the buyer already has an order for this SKU; the unit just
--                             claimed is AVAILABLE again / back in the pool (I2, I3).
--   ORDER_CREATED             token CLAIMED (ROW: one unit of the decrement), order row,
--                             ledger CLAIM, reservation ORDER_CREATED (I1, I2, I3).
-- Errors are the caller's to classify (40P01, 55P03, ... are transient); a pooled token that
-- is not AVAILABLE raises P0001 (cannot happen: the pool holds it locked).
--
-- The reservation row is written once, with its final status, after the decision (a
-- PROCESSING row that this same transaction overwrites would be invisible to everyone else
-- anyway, and cost a second row version per message). Nothing ever commits PROCESSING.
--
-- Plans: both functions run with enable_seqscan = off. Every statement in them has an index
-- (primary keys, the arbiter indexes, inventory_token_available_idx); what the setting removes
-- is a trap: PL/pgSQL caches one generic plan per statement per session, and a lookup such as
-- `inventory_reservation WHERE reservation_id = $1` planned while the table was empty (freshly
-- migrated, or ANALYZEd empty) is cached as a sequential scan and stays one as the table grows,
-- making every message O(rows) (seen here with auto_explain: a Seq Scan on
-- inventory_reservation per message after the bench ANALYZEd the empty tables).
-- (tests/tests/order_writer.rs checks the plans after analyzing empty tables.)
--
-- Locks: SKIP LOCKED on tokens (no waits); the orders unique index waits for a concurrent
-- insert of the same buyer (then DO NOTHING); ROW holds the SKU row until commit.
-- r_claim_us: the claim step's duration in microseconds (flashsale_token_claim_latency_seconds);
-- a claim from the pool takes microseconds, a refill is one scan.

-- Takes up to p_count units of a SKU into this transaction's pool; returns how many it took.
-- TOKEN: locks them (FOR UPDATE SKIP LOCKED, lowest seq first); ROW: decrements the counter.
CREATE FUNCTION flashsale_fill_pool(p_activity_id bigint, p_sku_id bigint, p_allocator text,
                                    p_count integer)
RETURNS integer
LANGUAGE plpgsql
SET enable_seqscan = off
AS $fn$
DECLARE
    v_tokens    text[];
    v_available bigint;
    v_taken     integer := 0;
    v_keys      text;
    v_key       text := p_activity_id || '_' || p_sku_id;
BEGIN
    IF p_allocator = 'ROW' THEN
        SELECT available_stock INTO v_available FROM sku_inventory
        WHERE activity_id = p_activity_id AND sku_id = p_sku_id FOR UPDATE;
        IF v_available > 0 THEN
            v_taken := least(v_available, p_count);
            UPDATE sku_inventory
            SET available_stock = available_stock - v_taken, updated_at = now()
            WHERE activity_id = p_activity_id AND sku_id = p_sku_id AND available_stock >= v_taken;
            PERFORM set_config('flashsale.row_pool_' || v_key,
                (coalesce(nullif(current_setting('flashsale.row_pool_' || v_key, true), '')::integer, 0)
                 + v_taken)::text, true);
            -- Remember the SKU so that flashsale_return_units() finds its pool.
            v_keys := coalesce(current_setting('flashsale.row_pool_keys', true), '');
            IF position(',' || v_key || ',' IN ',' || v_keys || ',') = 0 THEN
                PERFORM set_config('flashsale.row_pool_keys',
                                   CASE WHEN v_keys = '' THEN v_key ELSE v_keys || ',' || v_key END,
                                   true);
            END IF;
        END IF;
    ELSE
        -- The claim of tokens.rs (CLAIM_TOKEN_SQL), for many: ORDER BY seq keeps the partial
        -- index inventory_token_available_idx the plan.
        SELECT array_agg(token_id) INTO v_tokens FROM (
            SELECT token_id FROM inventory_token
            WHERE activity_id = p_activity_id AND sku_id = p_sku_id AND status = 'AVAILABLE'
            ORDER BY seq LIMIT p_count FOR UPDATE SKIP LOCKED) picked;
        v_taken := coalesce(cardinality(v_tokens), 0);
        IF v_taken > 0 THEN
            PERFORM set_config('flashsale.token_pool_' || v_key,
                array_to_string(v_tokens, ','), true);
        END IF;
    END IF;
    RETURN v_taken;
END;
$fn$;

-- Gives back the units of every ROW pool of this transaction (TOKEN pools need nothing: their
-- unused tokens were only locked). Call once before COMMIT; a no-op without ROW pools.
CREATE FUNCTION flashsale_return_units()
RETURNS integer
LANGUAGE plpgsql
AS $fn$
DECLARE
    v_keys     text := nullif(current_setting('flashsale.row_pool_keys', true), '');
    v_key      text;
    v_left     integer;
    v_returned integer := 0;
BEGIN
    IF v_keys IS NULL THEN
        RETURN 0;
    END IF;
    FOREACH v_key IN ARRAY string_to_array(v_keys, ',')
    LOOP
        v_left := coalesce(nullif(current_setting('flashsale.row_pool_' || v_key, true), '')::integer, 0);
        IF v_left > 0 THEN
            UPDATE sku_inventory
            SET available_stock = available_stock + v_left, updated_at = now()
            WHERE activity_id = split_part(v_key, '_', 1)::bigint
              AND sku_id = split_part(v_key, '_', 2)::bigint;
            v_returned := v_returned + v_left;
        END IF;
        PERFORM set_config('flashsale.row_pool_' || v_key, '0', true);
    END LOOP;
    PERFORM set_config('flashsale.row_pool_keys', '', true);
    RETURN v_returned;
END;
$fn$;

CREATE FUNCTION flashsale_order_create(
    p_consumer_group text,
    p_message_id     text,
    p_reservation_id text,
    p_request_id     text,
    p_activity_id    bigint,
    p_sku_id         bigint,
    p_user_id        bigint,
    p_reserved_at    timestamptz,
    p_expires_at     timestamptz,
    p_now            timestamptz,
    p_order_id       text,
    p_pool_size      integer,
    OUT r_outcome    text,
    OUT r_recorded   text,
    OUT r_order_id   text,
    OUT r_token_id   text,
    OUT r_claim_us   bigint)
LANGUAGE plpgsql
SET enable_seqscan = off
AS $fn$
DECLARE
    v_activity_status text;
    v_allocator       text;
    v_claim_started   timestamptz;
    v_key             text := p_activity_id || '_' || p_sku_id;
    v_pool            text;
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

    -- 3. Expired, or the activity terminated (an ENDED activity still honours reservations
    -- taken inside its window until they expire).
    IF p_expires_at <= p_now THEN
        r_outcome := 'REJECTED_EXPIRED';
    ELSE
        SELECT a.status, s.allocator INTO v_activity_status, v_allocator
        FROM activity a
        JOIN sku_inventory s ON s.activity_id = a.activity_id AND s.sku_id = p_sku_id
        WHERE a.activity_id = p_activity_id;
        IF NOT FOUND OR v_activity_status = 'TERMINATED' THEN
            r_outcome := 'REJECTED_ACTIVITY';
        END IF;
    END IF;

    -- 4. Claim one unit from this transaction's pool, refilling it when empty.
    IF r_outcome IS NULL THEN
        v_claim_started := clock_timestamp();
        IF v_allocator = 'ROW' THEN
            v_units := coalesce(nullif(current_setting('flashsale.row_pool_' || v_key, true), '')::integer, 0);
            IF v_units = 0 THEN
                v_units := flashsale_fill_pool(p_activity_id, p_sku_id, 'ROW', greatest(p_pool_size, 1));
            END IF;
            IF v_units = 0 THEN
                r_outcome := 'REJECTED_NO_FINAL_STOCK';
            ELSE
                PERFORM set_config('flashsale.row_pool_' || v_key, (v_units - 1)::text, true);
            END IF;
        ELSE
            v_pool := nullif(current_setting('flashsale.token_pool_' || v_key, true), '');
            IF v_pool IS NULL
               AND flashsale_fill_pool(p_activity_id, p_sku_id, 'TOKEN', greatest(p_pool_size, 1)) > 0 THEN
                v_pool := current_setting('flashsale.token_pool_' || v_key);
            END IF;
            IF v_pool IS NULL THEN
                -- A plain read sees tokens other transactions hold locked but not yet committed as
                -- still AVAILABLE: they may roll back, so this is "not now", not "none left".
                IF EXISTS (SELECT 1 FROM inventory_token
                           WHERE activity_id = p_activity_id AND sku_id = p_sku_id
                             AND status = 'AVAILABLE') THEN
                    -- Nothing but the inbox row is written yet: take it back, so the message
                    -- leaves no trace and is retried.
                    DELETE FROM consumer_inbox
                    WHERE consumer_group = p_consumer_group AND message_id = p_message_id;
                    r_outcome := 'CONTENDED';
                    RETURN;
                END IF;
                r_outcome := 'REJECTED_NO_FINAL_STOCK';
            ELSE
                r_token_id := split_part(v_pool, ',', 1);
                PERFORM set_config('flashsale.token_pool_' || v_key,
                    substr(v_pool, length(r_token_id) + 2), true);
                -- Locked by this transaction since the fill, so still AVAILABLE.
                UPDATE inventory_token
                SET status = 'CLAIMED', reservation_id = p_reservation_id, order_id = p_order_id,
                    claimed_at = now(), updated_at = now()
                WHERE token_id = r_token_id AND status = 'AVAILABLE';
                IF NOT FOUND THEN
                    RAISE EXCEPTION 'pooled token % is not AVAILABLE', r_token_id;
                END IF;
            END IF;
        END IF;
        r_claim_us := (extract(epoch FROM clock_timestamp() - v_claim_started) * 1000000)::bigint;
    END IF;

    -- 5. The order; the final guard of one order per buyer (I2).
    IF r_outcome IS NULL THEN
        INSERT INTO orders (order_id, activity_id, sku_id, user_id, request_id, reservation_id,
                            inventory_token_id)
        VALUES (p_order_id, p_activity_id, p_sku_id, p_user_id, p_request_id, p_reservation_id,
                r_token_id)
        ON CONFLICT (activity_id, sku_id, user_id) DO NOTHING;
        IF NOT FOUND THEN
            -- The unit goes back in this same transaction (I3), to the pool for the batch.
            IF r_token_id IS NOT NULL THEN
                UPDATE inventory_token
                SET status = 'AVAILABLE', reservation_id = NULL, order_id = NULL,
                    claimed_at = NULL, updated_at = now()
                WHERE token_id = r_token_id;
                PERFORM set_config('flashsale.token_pool_' || v_key,
                    concat_ws(',', r_token_id,
                              nullif(current_setting('flashsale.token_pool_' || v_key, true), '')),
                    true);
            ELSE
                PERFORM set_config('flashsale.row_pool_' || v_key,
                    (current_setting('flashsale.row_pool_' || v_key)::integer + 1)::text, true);
            END IF;
            r_token_id := NULL;
            r_outcome := 'REJECTED_DUPLICATE_USER';
        ELSE
            -- 6. Ledger.
            INSERT INTO inventory_ledger (activity_id, sku_id, token_id, order_id, reservation_id, kind)
            VALUES (p_activity_id, p_sku_id, r_token_id, p_order_id, p_reservation_id, 'CLAIM');
            r_outcome := 'ORDER_CREATED';
            r_order_id := p_order_id;
        END IF;
    END IF;

    -- The reservation, once, with its final status.
    INSERT INTO inventory_reservation (reservation_id, request_id, message_id, activity_id,
                                       sku_id, user_id, status, order_id, reserved_at, expires_at)
    VALUES (p_reservation_id, p_request_id, p_message_id, p_activity_id, p_sku_id, p_user_id,
            r_outcome, r_order_id, p_reserved_at, p_expires_at);
END;
$fn$;

COMMENT ON FUNCTION flashsale_order_create(text, text, text, text, bigint, bigint, bigint,
                                           timestamptz, timestamptz, timestamptz, text, integer) IS
    'One order-create message: inbox, expiry/activity, claim from the batch pool, order, ledger, reservation (DESIGN.md 5).';
COMMENT ON FUNCTION flashsale_fill_pool(bigint, bigint, text, integer) IS
    'Takes units of a SKU into the transaction''s batch pool: locks tokens (TOKEN) or decrements the counter (ROW).';
COMMENT ON FUNCTION flashsale_return_units() IS
    'Adds the unused units of the transaction''s ROW pools back to their SKUs; call before COMMIT.';
