-- 0007: the bounds every store shares (io/src/bounds.rs, issue 23) and the unit price an order's
-- amount comes from.
--
-- 1. Bounds as constraints. The admin API refuses anything outside io/src/bounds.rs before it
--    writes; these CHECKs say the same in the schema, so a caller that skipped the edge (a
--    script, a future API) cannot store a window or a timeout that Redis or the message
--    schema could not hold. NOT VALID: rows written before this migration are not re-checked
--    (they were accepted under the old rules and may be in use); every new or updated row is.
-- 2. `sku_inventory.price_cents`: the SKU's unit price, part of its configuration (CONTRACT.md
--    section 4, `price_cents`). NULL for SKUs created without one.
-- 3. `orders.amount_cents` from that price, filled as the row is inserted (both order paths,
--    the per-message function of 0002 and the set-based one of 0004, insert without it), so
--    that a PAID callback of another amount is AMOUNT_MISMATCH (0003's check compares only a
--    known amount).
-- 4. AMOUNT_MISMATCH money goes back: the payment is listed for refund and announced with
--    `refund_requested` like REFUND_NEEDED (the order keeps its unit as PAYMENT_UNKNOWN, as
--    0003 decided: a person settles it; the unit is never resold on a guess).

ALTER TABLE activity
    ADD CONSTRAINT activity_end_at_bound_check
        CHECK (end_at <= timestamptz '9999-12-31 23:59:59.999+00') NOT VALID,
    ADD CONSTRAINT activity_reservation_ttl_ms_bound_check
        CHECK (reservation_ttl_ms <= 86400000) NOT VALID,
    ADD CONSTRAINT activity_pay_timeout_ms_bound_check
        CHECK (pay_timeout_ms <= 604800000) NOT VALID;

ALTER TABLE sku_inventory
    ADD COLUMN price_cents bigint NULL,
    ADD CONSTRAINT sku_inventory_total_stock_bound_check
        CHECK (total_stock <= 1000000) NOT VALID,
    ADD CONSTRAINT sku_inventory_price_cents_check
        CHECK (price_cents >= 0 AND price_cents <= 1000000000000);

CREATE FUNCTION flashsale_order_amount()
RETURNS trigger
LANGUAGE plpgsql
AS $fn$
BEGIN
    SELECT s.price_cents INTO NEW.amount_cents
    FROM sku_inventory s
    WHERE s.activity_id = NEW.activity_id AND s.sku_id = NEW.sku_id;
    RETURN NEW;
END;
$fn$;

-- Only rows inserted without an amount: an explicit amount (a test, a migration of old data)
-- is kept.
CREATE TRIGGER orders_amount_from_price
    BEFORE INSERT ON orders
    FOR EACH ROW
    WHEN (NEW.amount_cents IS NULL)
    EXECUTE FUNCTION flashsale_order_amount();

DROP TRIGGER payment_refund_requested ON payment;
CREATE TRIGGER payment_refund_requested
    AFTER UPDATE OF outcome ON payment
    FOR EACH ROW
    WHEN (NEW.outcome IN ('REFUND_NEEDED', 'AMOUNT_MISMATCH')
          AND OLD.outcome IS DISTINCT FROM NEW.outcome)
    EXECUTE FUNCTION flashsale_refund_requested();

-- The refund listing's work list now holds both kinds of money to give back.
DROP INDEX payment_refund_needed_idx;
CREATE INDEX payment_refund_needed_idx ON payment (created_at)
    WHERE outcome IN ('REFUND_NEEDED', 'AMOUNT_MISMATCH');

COMMENT ON COLUMN sku_inventory.price_cents IS
    'Unit price in cents (io/src/bounds.rs PRICE_CENTS_MAX); an order''s amount_cents comes from it.';
COMMENT ON FUNCTION flashsale_order_amount() IS
    'orders.amount_cents from the SKU''s price_cents when the insert names none (0007).';
