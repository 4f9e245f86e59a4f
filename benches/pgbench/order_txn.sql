-- The order-writer's single-message transaction, for pgbench: exactly the statements
-- pg-worker/src/order_writer.rs sends for a batch of one message:
--   BEGIN; SELECT ... FROM flashsale_order_create(...); SELECT flashsale_return_units();
--   INSERT INTO event_outbox ...; COMMIT;
-- with an event payload of the real size (~450 bytes). pgbench substitutes `:name` even
-- inside quoted literals, so the payload is built with json_build_object (no colons in it).
--
-- The order pipeline bench (benches/benches/order_pipeline.rs) runs it against its private
-- PostgreSQL (fsync on) on a fresh migrated database whose SKU has more units than
-- transactions, and compares the worker's orders/s with the TPS printed here:
--
--   pgbench -n -M prepared -f benches/pgbench/order_txn.sql -c 8 -j 2 -t 1250 \
--       -D activity=10001 -D sku=20001 -h 127.0.0.1 -p PORT -U postgres DBNAME
--
-- Point `sku` at a SKU seeded with allocator 'ROW' to measure the single-row allocator.
-- Ids are random per transaction; a rare collision takes the duplicate path (still one
-- transaction, cheaper), which does not move the figure.

\set uid random(1, 1000000000)
\set n random(1, 1000000000)
BEGIN;
SELECT r_outcome, r_recorded, r_order_id, r_token_ids, r_claim_us
FROM flashsale_order_create('order-writer', 'msg_' || :client_id || '_' || :n,
    'resv_' || :client_id || '_' || :n, 'req_' || :n, :activity, :sku, :uid, 1,
    now(), now() + interval '5 minutes', now(), 'ord_' || :client_id || '_' || :n, 1);
SELECT flashsale_return_units();
INSERT INTO event_outbox (aggregate_id, event_type, payload)
SELECT e.aggregate_id, e.event_type, e.payload::jsonb
FROM unnest(ARRAY['resv_' || :client_id || '_' || :n], ARRAY['order_created'],
    ARRAY[json_build_object(
        'schema_version', 1, 'event_type', 'order_created',
        'reservation_id', 'resv_' || :client_id || '_' || :n,
        'request_id', 'req_01J0Z3Q8YB3W5M2N7K4T9R6P1E',
        'message_id', 'msg_01J0Z3Q8YB3W5M2N7K4T9R6P1C',
        'payload_hash', 'sha256_5b9d6c1f0d0f7c2a3e8e3b2f1a0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c',
        'activity_id', CAST(:activity AS bigint), 'sku_id', CAST(:sku AS bigint),
        'user_id', CAST(:uid AS bigint),
        'order_id', 'ord_' || :client_id || '_' || :n,
        'return_stock', false, 'release_user', false,
        'traceparent', '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01',
        'occurred_at', now())::text])
    WITH ORDINALITY AS e(aggregate_id, event_type, payload, n)
ORDER BY e.n;
COMMIT;
