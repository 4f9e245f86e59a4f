-- 0009_request_unique: a buyer's request id is unique per SKU in PostgreSQL too (issue 26,
-- item 1; seed ch9 §7.2: "Redis 结果丢失、PostgreSQL 已有订单 → 通过 request_id 唯一键返回原订单").
--
-- Applied by `flashsale_pg_worker::migrate` inside one transaction (no BEGIN/COMMIT here).
-- Frozen once applied: a change is a new migration.
--
-- Redis is the request id's idempotency store, and it can lose it (FLUSHALL, a node back
-- empty). Before this migration a second reservation minted for the same request id was
-- recorded like any other (0001's comment on inventory_reservation_request_idx); the engine now
-- rebuilds a lost SKU's request records from PostgreSQL (engine/src/shard/rebuild.rs), and
-- PostgreSQL keeps the rule itself:
--
--   * inventory_reservation_request_key: UNIQUE (activity_id, sku_id, user_id, request_id)
--     among the reservations that are not REJECTED_DUPLICATE_USER. A second reservation of one
--     request is still recorded (every reservation the log carried has its row, I4), as
--     REJECTED_DUPLICATE_USER: the buyer's intent was decided once. So the lookup of a request
--     id (the query fallback, pg-worker/src/reservation_lookup.rs) finds the original.
--   * Both order writers decide it before claiming a unit: flashsale_order_create below (step
--     2b), and the set-based planner (pg-worker/src/plan.rs, rule 2b) from the positions
--     flashsale_order_facts returns (from 0010 on: r_requested_positions). The unique key is
--     the final guard, as the orders' buyer key is for one order per buyer.
--
-- inventory_reservation_request_idx (0001) stays: every per-SKU read (reconcile, audit, the
-- rebuild) uses it as its prefix index, which a partial index cannot serve.
--
-- A database that already holds two such reservations cannot take the key: the migration
-- stops with their count (the reconcile report lists them, `duplicate_requests`), and the
-- operator resolves them before upgrading.

DO $check$
DECLARE
    v_duplicates bigint;
BEGIN
    SELECT count(*) INTO v_duplicates FROM (
        SELECT 1 FROM inventory_reservation WHERE status <> 'REJECTED_DUPLICATE_USER'
        GROUP BY activity_id, sku_id, user_id, request_id HAVING count(*) > 1) d;
    IF v_duplicates > 0 THEN
        RAISE EXCEPTION '% request ids are recorded under several reservations; the reconcile report lists them (duplicate_requests): resolve them, then migrate', v_duplicates;
    END IF;
END;
$check$;

CREATE UNIQUE INDEX inventory_reservation_request_key
    ON inventory_reservation (activity_id, sku_id, user_id, request_id)
    WHERE status <> 'REJECTED_DUPLICATE_USER';

-- The per-message writer (0002, as 0006 left it) with step 2b; nothing else changes.
CREATE OR REPLACE FUNCTION flashsale_order_create(
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

    -- 2b. The buyer's request id recorded under another reservation (Redis lost the first
    -- and minted a second): the buyer's intent was decided once; this reservation is a
    -- duplicate of it, holds no unit, and the first stays the one a lookup finds
    -- (inventory_reservation_request_key).
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

COMMENT ON INDEX inventory_reservation_request_key IS
    'A buyer''s request id names one reservation (duplicates recorded as REJECTED_DUPLICATE_USER).';
