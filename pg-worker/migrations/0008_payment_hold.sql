-- 0008_payment_hold: payments fail closed without a provider to ask (issue 26, item 5; seed
-- ch9 §7.10: "宁可暂时占用库存，也不能把可能已经支付的订单释放后再次售卖").
--
-- Applied by `flashsale_pg_worker::migrate` inside one transaction (no BEGIN/COMMIT here).
-- Frozen once applied: a change is a new migration.
--
-- Before this migration the closer, with no payment provider configured ([payments]
-- status_url), closed every order past its pay timeout that had no PAID payment: a payment
-- whose callback was merely late had its unit resold. Now, by default, the closer without a
-- provider calls flashsale_order_hold_unknown, one order per transaction:
--
--   PENDING_PAYMENT, past pay_timeout_ms, no payment recorded at all
--                    --closer, no provider----------------------> PAYMENT_UNKNOWN (unit kept)
--   PENDING_PAYMENT, past pay_timeout_ms, a FAILED/CLOSED payment recorded and no PAID one
--                    --closer, no provider----------------------> CLOSED (unit released, as
--                      flashsale_order_release 'CLOSE': the provider's own word says unpaid)
--
-- A PAYMENT_UNKNOWN order leaves that state only through the payment state machine of 0003
-- (flashsale_payment_callback): a PAID (a late callback, or a line of the provider's statement
-- applied by `flashsale admin payments reconcile --apply`) makes it PAID; a FAILED/CLOSED
-- makes it PENDING_PAYMENT again, and the next closer round closes it as authoritatively
-- unpaid. The old behaviour (close without asking) stays available as an explicit opt-in
-- (`[payments] close_unpaid_without_provider = true`), which calls flashsale_order_release.

-- ---------------------------------------------------------------------------------------------
-- flashsale_order_hold_unknown: the no-provider closer's move for ONE due order.
-- FOR UPDATE SKIP LOCKED like the closer's release (a callback in flight is never waited on;
-- a skipped order is looked at again next round).
-- r_outcome:
--   HELD            the order is now PAYMENT_UNKNOWN and keeps its unit
--   RELEASED        a FAILED/CLOSED payment was recorded (and no PAID one): closed, released
--   NOT_FOUND, BUSY, NOT_PENDING, PAID_RECORDED, NOT_DUE   as flashsale_order_release
-- r_status: the order's status after the call (NULL when NOT_FOUND/BUSY).
CREATE FUNCTION flashsale_order_hold_unknown(
    p_order_id text,
    p_now      timestamptz,
    OUT r_outcome text,
    OUT r_status  text)
LANGUAGE plpgsql
SET enable_seqscan = off
AS $fn$
DECLARE
    v_order   orders%ROWTYPE;
    v_timeout bigint;
BEGIN
    SELECT * INTO v_order FROM orders WHERE order_id = p_order_id FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        r_outcome := CASE WHEN EXISTS (SELECT 1 FROM orders WHERE order_id = p_order_id)
                          THEN 'BUSY' ELSE 'NOT_FOUND' END;
        RETURN;
    END IF;
    r_status := v_order.status;
    IF v_order.status <> 'PENDING_PAYMENT' THEN
        r_outcome := 'NOT_PENDING';
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM payment WHERE order_id = p_order_id AND status = 'PAID') THEN
        r_outcome := 'PAID_RECORDED';
        RETURN;
    END IF;
    SELECT a.pay_timeout_ms INTO v_timeout FROM activity a
    WHERE a.activity_id = v_order.activity_id;
    IF v_order.created_at + v_timeout * interval '1 millisecond' > p_now THEN
        r_outcome := 'NOT_DUE';
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM payment WHERE order_id = p_order_id
               AND status IN ('FAILED', 'CLOSED')) THEN
        -- Our own row lock: the release's SKIP LOCKED does not skip it.
        SELECT r.r_outcome, r.r_status INTO r_outcome, r_status
        FROM flashsale_order_release(p_order_id, 'CLOSE', 0, 0, p_now) r;
        RETURN;
    END IF;
    UPDATE orders SET status = 'PAYMENT_UNKNOWN', updated_at = now()
    WHERE order_id = p_order_id;
    r_outcome := 'HELD';
    r_status := 'PAYMENT_UNKNOWN';
END;
$fn$;

-- ---------------------------------------------------------------------------------------------
-- The statement reconciliation (pg-worker/src/payment_reconcile.rs) asks "which payments did
-- we record PAID within the statement's period?" to find those the provider does not list.
CREATE INDEX payment_paid_created_idx ON payment (created_at) WHERE status = 'PAID';

COMMENT ON FUNCTION flashsale_order_hold_unknown(text, timestamptz) IS
    'No-provider closer: a due unpaid order without an authoritative word becomes PAYMENT_UNKNOWN (unit kept); with a FAILED/CLOSED payment it is closed (0008).';
