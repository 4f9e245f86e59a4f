-- 0004_order_create_set: the order-writer's batch transaction done set-based (DESIGN.md
-- section 5): a batch of B messages costs a fixed number of statements instead of one function
-- call (eight statements inside) per message.
--
-- Applied by `flashsale_pg_worker::migrate` inside one transaction (no BEGIN/COMMIT here).
-- Frozen once applied: a change is a new migration.
--
-- Why: PostgreSQL's CPU, not fsync, bounds order writing here (FIELD-NOTES.md, "PostgreSQL
-- order writing"): per order ~24 WAL records and the row writes cost ~53 us, and the
-- per-message path added ~300 us of statement overhead on top (0.39 s of PostgreSQL CPU per
-- 1,000 orders). Set-based, the overhead is paid once per batch.
--
-- The split of work. PostgreSQL reads and locks; Rust decides; PostgreSQL writes:
--
--   BEGIN; SELECT * FROM flashsale_order_facts(arrays...)        -- one round trip
--   (pg-worker/src/plan.rs decides every message's outcome from those facts, sans I/O)
--   SELECT flashsale_order_apply(arrays...); INSERT INTO event_outbox ...; COMMIT;   -- one
--
-- flashsale_order_facts does, for the whole batch, what 0002's flashsale_order_create does
-- per message before it decides:
--   1. inbox: ONE insert of the batch's distinct message ids, ON CONFLICT DO NOTHING,
--      RETURNING the ids it inserted (a concurrent transaction holding the same id makes it
--      wait, exactly as the per-message insert does); inserted in message-id order, so two
--      batches sharing ids take their keys in the same order and cannot deadlock;
--   2. the recorded reservations of the batch's reservation ids (status, order id), read
--      AFTER the inbox insert, i.e. in a later snapshot that sees a twin that just committed;
--   3. which buyers (activity, sku, user) already hold an order;
--   4. per SKU (in key order, so ROW rows are locked in one order by every batch): activity
--      status and allocator; then the claim: TOKEN locks up to `wanted` AVAILABLE tokens
--      (`wanted` = the SKU's distinct non-expired message ids: every unit the batch can use) in
--      ONE `ORDER BY seq LIMIT wanted FOR UPDATE SKIP LOCKED` scan, and when it got fewer says
--      whether AVAILABLE tokens remain that others hold (contended, not exhausted); ROW locks
--      the SKU row and reads available_stock.
-- Facts only: it writes nothing but the inbox rows and the row locks.
--
-- flashsale_order_apply writes what the plan decided, one statement per kind: deletes the
-- inbox rows of contended messages (they leave no trace and are retried), inserts the orders
-- (ON CONFLICT on the buyer key), claims the tokens, inserts the ledger CLAIM rows, takes the
-- ROW units, inserts the reservations with their final status. The outbox events are the
-- caller's next statement (their payloads and compensation flags are ONE Rust function,
-- `wire::RejectReason::compensation`). Nothing here commits or publishes.
--
-- Checked on the way, each a raised error that rolls the batch back (the caller then writes
-- the batch through 0002's per-message function, which isolates a failing message):
--   - FS001: an order insert met a buyer that the facts did not show (a concurrent
--     transaction inserted it after the facts were read); the plan is stale, not wrong;
--   - 23502 / P0001: a token the facts locked is not AVAILABLE (its status would become NULL)
--     or missing, or a ROW SKU has fewer units than it had under the lock (cannot happen:
--     both are held locked since the facts);
--   - anything a constraint says (23505 on an order id or a reservation id, ...).
--
-- Every per-message outcome of 0002 is kept: tests/tests/order_writer.rs runs the same
-- scripted and random message sequences through both paths and compares the rows.
--
-- Plans. PL/pgSQL caches a generic plan per statement per session; two traps, both avoided:
--   - a lookup planned while its table was empty (fresh, or ANALYZEd empty) is cached as a
--     sequential scan: enable_seqscan = off on both functions (every statement has an index);
--   - an EXISTS (or a LATERAL lookup) over a hot table can be turned into a hashed scan of the
--     WHOLE table per batch: `OFFSET 0` inside keeps it a per-row index lookup (the planner
--     neither pulls such a subquery up into a join nor hashes it).
-- No statement joins the batch's rows to each other: they are array positions (WITH
-- ORDINALITY), so nothing is O(B x B). tests/tests/order_writer.rs prints and checks the
-- generic plans (auto_explain) after analyzing the empty tables.

-- Not here: fillfactor 50 on inventory_token. It took 13-18% off the per-message path at
-- small batches (FIELD-NOTES.md), but on this set-based path the order pipeline bench showed
-- no difference beyond its noise (10,000 orders, medians of 5 interleaved runs: batch 512
-- 1.62 s vs 1.70 s with the default 100, PostgreSQL CPU 123 vs 125 us per order; batch 32
-- 2.65 s vs 2.38 s, 174 vs 179 us), so the table keeps its default packing.

-- ---------------------------------------------------------------------------------------------
CREATE FUNCTION flashsale_order_facts(
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
        SELECT a.status, s.allocator INTO v_status, v_allocator
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
-- Writes a planned batch. The reservation arrays hold every message with a final outcome
-- (created or rejected), in message order; p_order_ids is set for ORDER_CREATED only, and
-- p_token_ids for ORDER_CREATED with the TOKEN allocator only. p_row_* = units each ROW SKU
-- sold in this batch. p_contended_ids: inbox rows to take back.
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
    p_token_ids        text[],
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
                            inventory_token_id)
        SELECT m.order_id, m.activity_id, m.sku_id, m.user_id, m.request_id, m.reservation_id,
               m.token_id
        FROM unnest(p_order_ids, p_activity_ids, p_sku_ids, p_user_ids, p_request_ids,
                    p_reservation_ids, p_token_ids, p_statuses)
             AS m(order_id, activity_id, sku_id, user_id, request_id, reservation_id, token_id,
                  status)
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
        SELECT count(*) INTO v_expected FROM unnest(p_token_ids) AS t WHERE t IS NOT NULL;
        IF v_expected > 0 THEN
            UPDATE inventory_token t
            SET status = CASE WHEN t.status = 'AVAILABLE' THEN 'CLAIMED' END,
                reservation_id = m.reservation_id, order_id = m.order_id,
                claimed_at = now(), updated_at = now()
            FROM unnest(p_token_ids, p_reservation_ids, p_order_ids)
                 AS m(token_id, reservation_id, order_id)
            WHERE t.token_id = ANY (p_token_ids) AND t.token_id = m.token_id;
            GET DIAGNOSTICS v_rows = ROW_COUNT;
            IF v_rows <> v_expected THEN
                RAISE EXCEPTION '% of % locked tokens are missing', v_expected - v_rows, v_expected;
            END IF;
        END IF;

        INSERT INTO inventory_ledger (activity_id, sku_id, token_id, order_id, reservation_id, kind)
        SELECT m.activity_id, m.sku_id, m.token_id, m.order_id, m.reservation_id, 'CLAIM'
        FROM unnest(p_activity_ids, p_sku_ids, p_token_ids, p_order_ids, p_reservation_ids,
                    p_statuses) WITH ORDINALITY
             AS m(activity_id, sku_id, token_id, order_id, reservation_id, status, pos)
        WHERE m.status = 'ORDER_CREATED'
        ORDER BY m.pos;
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
                                       sku_id, user_id, status, order_id, reserved_at, expires_at)
    SELECT * FROM unnest(p_reservation_ids, p_request_ids, p_message_ids, p_activity_ids,
                         p_sku_ids, p_user_ids, p_statuses, p_order_ids, p_reserved_at,
                         p_expires_at);
END;
$fn$;

COMMENT ON FUNCTION flashsale_order_facts(text, text[], text[], bigint[], bigint[], bigint[],
                                          timestamptz[], timestamptz) IS
    'A batch of order-create messages: inbox insert, recorded reservations, buyers with orders, per-SKU claim (locks); writes nothing else (DESIGN.md 5).';
COMMENT ON FUNCTION flashsale_order_apply(text, text[], text[], text[], text[], bigint[],
                                          bigint[], bigint[], text[], text[], text[],
                                          timestamptz[], timestamptz[], bigint[], bigint[],
                                          bigint[]) IS
    'Writes a planned batch: contended inbox rows back, orders, token claims, ledger, ROW units, reservations (DESIGN.md 5).';
