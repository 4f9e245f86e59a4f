-- 0003_payments: the order lifecycle after creation (DESIGN.md sections 6 and 8; CONTRACT.md
-- 3.4): payment callbacks, the user's cancel, and the order timeout closer, as server-side
-- functions so that each is ONE statement, i.e. one transaction per order.
--
-- Applied by `flashsale_pg_worker::migrate` inside one transaction (no BEGIN/COMMIT here).
-- Frozen once applied: a change is a new migration.
--
-- Order states (orders.status) and who moves them; every move is a conditional transition on
-- a row locked FOR UPDATE, so of two racing moves exactly one applies and the other sees the
-- result:
--
--   PENDING_PAYMENT --PAID callback----------------------------> PAID        (token SOLD)
--   PENDING_PAYMENT --owner cancel-----------------------------> CANCELLED   (unit released)
--   PENDING_PAYMENT --closer, past pay_timeout_ms, unpaid------> CLOSED      (unit released)
--   PENDING_PAYMENT --unexpected callback state / PAID with a
--                     different amount / provider timeout------> PAYMENT_UNKNOWN
--   PAYMENT_UNKNOWN --PAID callback----------------------------> PAID
--   PAYMENT_UNKNOWN --FAILED/CLOSED callback, no PAID payment--> PENDING_PAYMENT
--
-- PAYMENT_UNKNOWN keeps its unit: it is neither cancellable nor closable (DESIGN.md 6: "unknown
-- is a state"); only an authoritative callback moves it on. CANCELLED, CLOSED and PAID are
-- final: a PAID callback for a CANCELLED/CLOSED order (or a second PAID for a PAID order) is
-- recorded with outcome REFUND_NEEDED and never resurrects the order.
--
-- Releasing a unit (cancel, close), in the same transaction as the state change:
--   TOKEN allocator, release_policy BACK_TO_SALE (default): the token goes back to AVAILABLE
--          (holder cleared) for resale; the outbox event asks redis-sync to return one unit of
--          Redis stock.
--   TOKEN allocator, release_policy RELEASED: the token becomes RELEASED for good; Redis stock
--          stays as it is (return_stock false).
--   ROW allocator: available_stock + 1 and Redis stock returned, whatever the policy (the ROW
--          counter has no per-unit state to retire, and I1/I3 for ROW is available + live =
--          total).
--   Always: ledger RELEASE row (UNIQUE (reservation_id, kind): at most once), outbox
--          `order_cancelled` event (redis-sync applies `compensate` once per reservation: the
--          `comp` marker), the buyer's Redis user marker kept (UNIQUE (activity, sku, user)
--          still holds the cancelled order, so the buyer cannot buy this SKU again).

-- ---------------------------------------------------------------------------------------------
-- activity.release_policy: what a cancelled or closed order's token becomes.
ALTER TABLE activity ADD COLUMN release_policy text NOT NULL DEFAULT 'BACK_TO_SALE';
ALTER TABLE activity ADD CONSTRAINT activity_release_policy_check
    CHECK (release_policy IN ('BACK_TO_SALE', 'RELEASED'));

-- ---------------------------------------------------------------------------------------------
-- I1 "each order holds a distinct token" is about LIVE orders: a token put back on sale is
-- claimed by the next buyer's order while the cancelled order still names it (history kept).
-- Same name as the constraint it replaces, so violations read the same.
ALTER TABLE orders DROP CONSTRAINT orders_inventory_token_id_key;
CREATE UNIQUE INDEX orders_inventory_token_id_key
    ON orders (inventory_token_id) WHERE status NOT IN ('CANCELLED', 'CLOSED');

-- ---------------------------------------------------------------------------------------------
-- payment.outcome: what the callback did, so that a repeated callback (same payment_id, same
-- body) is answered with the first outcome without acting again (I6).
ALTER TABLE payment ADD COLUMN outcome text NULL;
ALTER TABLE payment ADD CONSTRAINT payment_outcome_check
    CHECK (outcome IN ('PAID', 'UNPAID', 'REFUND_NEEDED', 'AMOUNT_MISMATCH'));
-- The refund job's work list: money received that no live order took.
CREATE INDEX payment_refund_needed_idx ON payment (created_at) WHERE outcome = 'REFUND_NEEDED';

-- ---------------------------------------------------------------------------------------------
-- The outbox payload of an order event, in the `io::wire::ReservationEvent` schema (version 1;
-- tests/tests/payments.rs decodes it with `decode_event`). PostgreSQL does not record the
-- request's payload hash; order events never make redis-sync recreate a `req` hash (only
-- `apply_result` reads it), so a fixed placeholder stands in.
CREATE FUNCTION flashsale_order_event(p_event_type text, p_order orders, p_return_stock boolean,
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
        'order_id', p_order.order_id,
        'return_stock', p_return_stock,
        'release_user', false,
        'occurred_at', to_char(p_now AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'));
$fn$;

-- ---------------------------------------------------------------------------------------------
-- flashsale_order_release: cancel (owner) or close (timeout closer) ONE order.
--   p_kind 'CANCEL': waits for the order's row lock (a racing payment must be decided, not
--                    skipped); the order must belong to (p_activity_id, p_user_id).
--   p_kind 'CLOSE':  FOR UPDATE SKIP LOCKED (several closers never wait on each other or on a
--                    callback in flight; a skipped order is looked at again next round); the
--                    order must be past its activity's pay_timeout_ms at p_now.
-- r_outcome:
--   RELEASED        the order is now CANCELLED/CLOSED, its unit released, ledger + event written
--   NOT_FOUND       no such order (CANCEL: or not this buyer's in this activity)
--   BUSY            CLOSE only: the row is locked by someone else right now
--   NOT_PENDING     the order is not PENDING_PAYMENT (r_status says what it is)
--   PAID_RECORDED   a PAID payment is recorded for it: never release (cannot happen while
--                   callbacks move the order in the same transaction; kept as a guard)
--   NOT_DUE         CLOSE only: not past its pay timeout at p_now
-- r_status: the order's status after the call (NULL when NOT_FOUND/BUSY).
CREATE FUNCTION flashsale_order_release(
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
        UPDATE sku_inventory SET available_stock = available_stock + 1, updated_at = now()
        WHERE activity_id = v_order.activity_id AND sku_id = v_order.sku_id;
        v_return := true;
    ELSE
        IF v_policy = 'RELEASED' THEN
            UPDATE inventory_token SET status = 'RELEASED', updated_at = now()
            WHERE token_id = v_order.inventory_token_id AND status = 'CLAIMED'
              AND reservation_id = v_order.reservation_id;
            v_return := false;
        ELSE
            UPDATE inventory_token
            SET status = 'AVAILABLE', reservation_id = NULL, order_id = NULL, claimed_at = NULL,
                updated_at = now()
            WHERE token_id = v_order.inventory_token_id AND status = 'CLAIMED'
              AND reservation_id = v_order.reservation_id;
            v_return := true;
        END IF;
        IF NOT FOUND THEN
            -- A live unpaid order always holds its CLAIMED token (audit I1); releasing
            -- something else would mint or lose a unit. Abort the whole transaction.
            RAISE EXCEPTION 'order % does not hold its token % as CLAIMED', p_order_id,
                v_order.inventory_token_id;
        END IF;
    END IF;
    INSERT INTO inventory_ledger (activity_id, sku_id, token_id, order_id, reservation_id, kind)
    VALUES (v_order.activity_id, v_order.sku_id, v_order.inventory_token_id, p_order_id,
            v_order.reservation_id, 'RELEASE')
    ON CONFLICT (reservation_id, kind) DO NOTHING;
    INSERT INTO event_outbox (aggregate_id, event_type, payload)
    VALUES (v_order.reservation_id, 'order_cancelled',
            flashsale_order_event('order_cancelled', v_order, v_return, p_now));
    r_outcome := 'RELEASED';
    r_status := v_final;
END;
$fn$;

-- ---------------------------------------------------------------------------------------------
-- flashsale_payment_callback: one provider callback, idempotent by payment_id.
-- p_status outside PAID/FAILED/CLOSED is not authoritative about money: no payment row (the
-- table accepts only those three); a PENDING_PAYMENT order becomes PAYMENT_UNKNOWN so that the
-- closer keeps its unit until an authoritative callback arrives.
-- r_outcome (stored in payment.outcome except the last two):
--   PAID             the order (PENDING_PAYMENT or PAYMENT_UNKNOWN) is now PAID; token SOLD,
--                    ledger SELL, outbox `order_paid`
--   UNPAID           FAILED/CLOSED recorded (a PAYMENT_UNKNOWN order without a PAID payment
--                    goes back to PENDING_PAYMENT: authoritatively unpaid again)
--   REFUND_NEEDED    PAID for an order that is CANCELLED, CLOSED, already PAID (by another
--                    payment) or unknown: recorded, the order untouched, money to give back
--   AMOUNT_MISMATCH  PAID with an amount other than the order's: recorded, order
--                    PAYMENT_UNKNOWN (its unit kept) for a person to settle
--   PAYMENT_UNKNOWN  a non-authoritative status (see above)
--   PAYMENT_CONFLICT this payment_id was recorded with a different order, status or amount
-- r_order_status: the order's status afterwards (NULL when the order is unknown);
-- r_replayed: the same callback was applied before; r_outcome is the recorded one.
CREATE FUNCTION flashsale_payment_callback(
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
                UPDATE inventory_token SET status = 'SOLD', updated_at = now()
                WHERE token_id = v_order.inventory_token_id AND status = 'CLAIMED'
                  AND reservation_id = v_order.reservation_id;
                IF NOT FOUND THEN
                    RAISE EXCEPTION 'order % does not hold its token % as CLAIMED', p_order_id,
                        v_order.inventory_token_id;
                END IF;
            END IF;
            INSERT INTO inventory_ledger (activity_id, sku_id, token_id, order_id,
                                          reservation_id, kind)
            VALUES (v_order.activity_id, v_order.sku_id, v_order.inventory_token_id, p_order_id,
                    v_order.reservation_id, 'SELL')
            ON CONFLICT (reservation_id, kind) DO NOTHING;
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

COMMENT ON FUNCTION flashsale_order_release(text, text, bigint, bigint, timestamptz) IS
    'Cancel (owner) or close (timeout) one unpaid order: status, unit release, ledger, event (DESIGN.md 6).';
COMMENT ON FUNCTION flashsale_payment_callback(text, text, text, bigint, timestamptz) IS
    'One payment callback, idempotent by payment_id; PAID never resurrects a cancelled/closed order.';
COMMENT ON FUNCTION flashsale_order_event(text, orders, boolean, timestamptz) IS
    'Outbox payload of an order event in the io::wire::ReservationEvent schema (version 1).';
