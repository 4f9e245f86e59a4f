-- 0006_lifecycle: an activity's life after its creation (CONTRACT.md section 4): several SKUs
-- per activity, a SKU ended or terminated on its own, stock topped up, every change recorded.
--
-- Applied by `flashsale_pg_worker::migrate` inside one transaction (no BEGIN/COMMIT here).
-- Frozen once applied: a change is a new migration.
--
-- sku_inventory.status: a SKU's own state beside its activity's. The effective state of a SKU
-- is TERMINATED when either is, else ENDED when either is, else the activity's
-- (`pg-worker/src/lifecycle.rs`). Only TERMINATED changes what the order-writer does (a
-- reservation of a terminated SKU is rejected with REJECTED_ACTIVITY and compensated, as for
-- a terminated activity); ENDED only stops new reservations, in Redis.
-- sku_inventory.version: bumped by every change of the SKU (status, top-up); Redis `meta`
-- takes activity.version + sku_inventory.version - 1, which grows with either.
-- sku_inventory.config_hash: the canonical body that created the SKU (idempotent add-sku).
ALTER TABLE sku_inventory ADD COLUMN status text NOT NULL DEFAULT 'ACTIVE';
ALTER TABLE sku_inventory ADD CONSTRAINT sku_inventory_status_check
    CHECK (status IN ('ACTIVE', 'ENDED', 'TERMINATED'));
ALTER TABLE sku_inventory ADD COLUMN version bigint NOT NULL DEFAULT 1;
ALTER TABLE sku_inventory ADD CONSTRAINT sku_inventory_version_check CHECK (version >= 1);
ALTER TABLE sku_inventory ADD COLUMN config_hash text NULL;

-- activity_change: who changed what, when (one row per applied change; a repeat of an
-- idempotent call adds nothing). `request_id` makes a top-up idempotent: the same id for the
-- same SKU is the same top-up.
CREATE TABLE activity_change (
    change_id   bigint      GENERATED ALWAYS AS IDENTITY,
    activity_id bigint      NOT NULL,
    sku_id      bigint      NULL,
    action      text        NOT NULL,
    detail      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    version     bigint      NOT NULL,
    actor       text        NOT NULL,
    request_id  text        NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT activity_change_pkey PRIMARY KEY (change_id),
    CONSTRAINT activity_change_action_check
        CHECK (action IN ('create', 'add_sku', 'end', 'terminate', 'top_up', 'release_policy')),
    CONSTRAINT activity_change_actor_check CHECK (length(actor) BETWEEN 1 AND 128)
);
CREATE UNIQUE INDEX activity_change_request_idx
    ON activity_change (activity_id, sku_id, request_id) WHERE request_id IS NOT NULL;
COMMENT ON TABLE activity_change IS
    'Every lifecycle change of an activity or SKU, with who and when (CONTRACT.md 4).';

-- The order-writer's two status reads (0002 flashsale_order_create step 3, 0004
-- flashsale_order_facts) learn the SKU's own TERMINATED; nothing else in them changes.

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

    -- 3. Expired, or the activity terminated (an ENDED activity still honours reservations
    -- taken inside its window until they expire).
    IF p_expires_at <= p_now THEN
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

CREATE OR REPLACE FUNCTION flashsale_order_facts(
    p_consumer_group    text,
    p_message_ids       text[],
    p_reservation_ids   text[],
    p_activity_ids      bigint[],
    p_sku_ids           bigint[],
    p_user_ids          bigint[],
    p_expires_at        timestamptz[],
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
    OUT r_token_ids         text[])
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

    r_sku_activity_ids := '{}'; r_sku_ids := '{}'; r_sku_statuses := '{}';
    r_sku_allocators := '{}'; r_sku_available := '{}'; r_sku_contended := '{}';
    r_sku_claim_us := '{}'; r_token_skus := '{}'; r_token_ids := '{}';
    -- 4. Per SKU, in key order: the activity, then the claim.
    FOR v_sku IN
        SELECT m.activity_id, m.sku_id, count(DISTINCT m.message_id)::integer AS wanted
        FROM unnest(p_message_ids, p_activity_ids, p_sku_ids, p_expires_at)
             AS m(message_id, activity_id, sku_id, expires_at)
        WHERE m.expires_at > p_now
        GROUP BY m.activity_id, m.sku_id
        ORDER BY m.activity_id, m.sku_id
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
