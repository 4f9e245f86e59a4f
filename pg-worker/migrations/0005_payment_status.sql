-- 0005_payment_status: the closer asks the payment provider before it closes an order
-- (pg-worker/src/provider.rs, payments::close_due_orders_verified), and money that no live
-- order takes is announced for the refund job.
--
-- Applied by `flashsale_pg_worker::migrate` inside one transaction (no BEGIN/COMMIT here).
-- Frozen once applied: a change is a new migration.
--
-- With a provider configured, an order past its pay timeout and without a PAID payment is
-- asked about (a signed status request) before anything happens to it:
--
--   answer UNPAID/CLOSED/FAILED -> flashsale_order_close_verified: CLOSED, unit released
--                                  (a PAYMENT_UNKNOWN order too: the provider's word is
--                                  authoritative)
--   answer PAID                 -> applied as a callback (flashsale_payment_callback)
--   no answer, unknown, forged  -> PENDING_PAYMENT becomes PAYMENT_UNKNOWN (unit kept), asked
--                                  again after a bounded exponential backoff
--
-- payment_status_ask records the asking: how often, when next, what was last heard.

-- ---------------------------------------------------------------------------------------------
-- payment_status_ask: one row per order the closer has asked the provider about.
CREATE TABLE payment_status_ask (
    order_id    text        NOT NULL,
    -- Asks so far (every answer counts, "no answer" too).
    attempts    integer     NOT NULL,
    -- Not asked again before this (the backoff).
    next_ask_at timestamptz NOT NULL,
    -- PAID, UNPAID or UNKNOWN (with why, for operators) of the last ask.
    last_answer text        NOT NULL,
    asked_at    timestamptz NOT NULL,
    CONSTRAINT payment_status_ask_pkey PRIMARY KEY (order_id),
    CONSTRAINT payment_status_ask_attempts_check CHECK (attempts >= 1)
);
COMMENT ON TABLE payment_status_ask IS
    'The closer''s status requests to the payment provider, per order: count, backoff, last answer.';

-- The verified closer also looks at PAYMENT_UNKNOWN orders (asking resolves them); they are
-- few, and this keeps the scan from walking paid or closed history.
CREATE INDEX orders_payment_unknown_idx ON orders (created_at) WHERE status = 'PAYMENT_UNKNOWN';

-- ---------------------------------------------------------------------------------------------
-- event_outbox.event_type: `refund_requested` joins the known types (same constraint name, so
-- violations read the same).
ALTER TABLE event_outbox DROP CONSTRAINT event_outbox_event_type_check;
ALTER TABLE event_outbox ADD CONSTRAINT event_outbox_event_type_check
    CHECK (event_type IN ('order_created', 'reservation_failed', 'compensate',
                          'order_cancelled', 'order_paid', 'refund_requested'));

-- ---------------------------------------------------------------------------------------------
-- flashsale_order_close_verified: close ONE order the provider said is unpaid.
-- Like flashsale_order_release(.., 'CLOSE', ..) (SKIP LOCKED, past its pay timeout, no PAID
-- payment), and a PAYMENT_UNKNOWN order without a PAID payment is closed as well: it goes back
-- to PENDING_PAYMENT and is released in the same transaction, or, if the release does not
-- happen, is put back to PAYMENT_UNKNOWN. r_outcome / r_status as flashsale_order_release.
CREATE FUNCTION flashsale_order_close_verified(
    p_order_id text,
    p_now      timestamptz,
    OUT r_outcome text,
    OUT r_status  text)
LANGUAGE plpgsql
SET enable_seqscan = off
AS $fn$
DECLARE
    v_status text;
BEGIN
    SELECT status INTO v_status FROM orders WHERE order_id = p_order_id FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        r_outcome := CASE WHEN EXISTS (SELECT 1 FROM orders WHERE order_id = p_order_id)
                          THEN 'BUSY' ELSE 'NOT_FOUND' END;
        RETURN;
    END IF;
    IF v_status = 'PAYMENT_UNKNOWN'
       AND NOT EXISTS (SELECT 1 FROM payment WHERE order_id = p_order_id AND status = 'PAID') THEN
        UPDATE orders SET status = 'PENDING_PAYMENT' WHERE order_id = p_order_id;
    END IF;
    -- Our own row lock: the release's SKIP LOCKED does not skip it.
    SELECT r.r_outcome, r.r_status INTO r_outcome, r_status
    FROM flashsale_order_release(p_order_id, 'CLOSE', 0, 0, p_now) r;
    IF r_outcome <> 'RELEASED' AND v_status = 'PAYMENT_UNKNOWN' THEN
        UPDATE orders SET status = 'PAYMENT_UNKNOWN'
        WHERE order_id = p_order_id AND status = 'PENDING_PAYMENT';
        r_status := 'PAYMENT_UNKNOWN';
    END IF;
END;
$fn$;

-- ---------------------------------------------------------------------------------------------
-- refund_requested: when a payment's outcome becomes REFUND_NEEDED (flashsale_payment_callback
-- writes the outcome after inserting the row, in the same transaction), the outbox gets a
-- `refund_requested` event in the order-event schema plus payment_id and amount_cents. Money
-- for an order that does not exist has no order to name (the event schema needs its ids): it
-- is only listed (GET /admin/v1/refunds reads payment_refund_needed_idx).
CREATE FUNCTION flashsale_refund_requested()
RETURNS trigger
LANGUAGE plpgsql
AS $fn$
DECLARE
    v_order orders%ROWTYPE;
BEGIN
    SELECT * INTO v_order FROM orders WHERE order_id = NEW.order_id;
    IF FOUND THEN
        INSERT INTO event_outbox (aggregate_id, event_type, payload)
        VALUES (v_order.reservation_id, 'refund_requested',
                flashsale_order_event('refund_requested', v_order, false, now())
                    || jsonb_build_object('payment_id', NEW.payment_id,
                                          'amount_cents', NEW.amount_cents));
    END IF;
    RETURN NULL;
END;
$fn$;

CREATE TRIGGER payment_refund_requested
    AFTER UPDATE OF outcome ON payment
    FOR EACH ROW
    WHEN (NEW.outcome = 'REFUND_NEEDED' AND OLD.outcome IS DISTINCT FROM NEW.outcome)
    EXECUTE FUNCTION flashsale_refund_requested();

COMMENT ON FUNCTION flashsale_order_close_verified(text, timestamptz) IS
    'Close one order the payment provider said is unpaid (PENDING_PAYMENT or PAYMENT_UNKNOWN).';
COMMENT ON FUNCTION flashsale_refund_requested() IS
    'Outbox refund_requested event when a payment is recorded REFUND_NEEDED.';
