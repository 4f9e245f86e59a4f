//! The PostgreSQL schema against a real server: migrations, token generation
//! and claiming, and every constraint that guards an invariant of DESIGN.md
//! section 8.
//!
//! Each test gets a fresh database in the suite's private cluster
//! (`flashsale_tests::pg_database`) and migrates it with the production
//! `migrate`. Assertions name exact SqlStates and constraint names, so a
//! constraint that disappears, or starts failing for another reason, fails the
//! test.
//!
//! Not here: the order transaction as a whole (the worker's tests), Redis.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use flashsale_pg_worker::tokens::{token_id, CLAIM_TOKEN_SQL};
use flashsale_pg_worker::{
    apply_migrations, claim_token, generate_tokens, migrate, ClaimOutcome, Migration, PgError,
    MIGRATIONS,
};
use flashsale_tests::{pg_database, TestDb};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls};

const ACTIVITY: i64 = 10001;
const SKU: i64 = 20001;

async fn connect(db: &TestDb) -> Client {
    let (client, connection) =
        tokio_postgres::connect(&db.url, NoTls).await.unwrap_or_else(|e| panic!("connect: {e}"));
    tokio::spawn(async move {
        // The connection ends when the client is dropped; an error here shows
        // up as a failed query in the test itself.
        let _ = connection.await;
    });
    client
}

/// A fresh, migrated database and a connection to it.
async fn migrated() -> (TestDb, Client) {
    let db = pg_database().await;
    let mut client = connect(&db).await;
    let report = migrate(&mut client).await.expect("migrate a fresh database");
    assert_eq!(report.current_version, MIGRATIONS.len() as u32);
    (db, client)
}

/// An ACTIVE activity with one TOKEN-allocated SKU of `stock` units (no tokens yet).
async fn seed_sku(client: &Client, activity_id: i64, sku_id: i64, stock: i64) {
    client
        .execute(
            "INSERT INTO activity (activity_id, status, start_at, end_at, reservation_ttl_ms, \
             pay_timeout_ms) VALUES ($1, 'ACTIVE', now(), now() + interval '1 hour', 300000, 900000) \
             ON CONFLICT DO NOTHING",
            &[&activity_id],
        )
        .await
        .expect("insert activity");
    client
        .execute(
            "INSERT INTO sku_inventory (activity_id, sku_id, total_stock, allocator) \
             VALUES ($1, $2, $3, 'TOKEN')",
            &[&activity_id, &sku_id, &stock],
        )
        .await
        .expect("insert sku_inventory");
}

/// The highest embedded migration version, and every version in order.
fn latest_version() -> u32 {
    MIGRATIONS.last().map_or(0, |m| m.version)
}

fn all_versions() -> Vec<u32> {
    MIGRATIONS.iter().map(|m| m.version).collect()
}

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap_or_else(|e| panic!("{sql}: {e}")).get(0)
}

/// The `PgError` of a statement that must fail.
async fn must_fail(client: &Client, sql: &str) -> PgError {
    match client.batch_execute(sql).await {
        Ok(()) => panic!("expected an error from: {sql}"),
        Err(e) => PgError::from(e),
    }
}

fn assert_violation(err: &PgError, state: SqlState, constraint: &str) {
    assert_eq!(err.sql_state(), Some(&state), "{err}");
    assert_eq!(err.constraint(), Some(constraint), "{err}");
    assert!(!err.is_transient(), "a constraint violation is never transient: {err}");
}

// ---------------------------------------------------------------------------
// Migrations

#[tokio::test]
async fn migrate_twice_applies_nothing_the_second_time() {
    let db = pg_database().await;
    let mut client = connect(&db).await;

    let first = migrate(&mut client).await.expect("first migrate");
    assert_eq!(first.applied, all_versions());
    assert_eq!(first.current_version, latest_version());
    let second = migrate(&mut client).await.expect("second migrate");
    assert!(second.applied.is_empty(), "{second:?}");
    assert_eq!(second.current_version, latest_version());

    // Every contract table exists in `public`, plus the history table.
    let tables: HashSet<String> = client
        .query(
            "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public'",
            &[],
        )
        .await
        .expect("list tables")
        .iter()
        .map(|r| r.get(0))
        .collect();
    for table in [
        "activity",
        "sku_inventory",
        "inventory_token",
        "orders",
        "inventory_reservation",
        "inventory_ledger",
        "consumer_inbox",
        "event_outbox",
        "payment",
        "schema_migrations",
    ] {
        assert!(tables.contains(table), "missing table {table}; have {tables:?}");
    }
    let row = client
        .query_one("SELECT name, checksum FROM schema_migrations WHERE version = 1", &[])
        .await
        .expect("history row");
    assert_eq!(row.get::<_, String>(0), "init");
    assert_eq!(row.get::<_, String>(1), MIGRATIONS[0].checksum());
    assert_eq!(
        count(&client, "SELECT count(*) FROM schema_migrations").await,
        i64::from(latest_version())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_on_a_fresh_database_apply_once() {
    // Four rather than two processes: more chances to hit the race.
    const MIGRATORS: usize = 4;
    let db = pg_database().await;
    let barrier = Arc::new(tokio::sync::Barrier::new(MIGRATORS));
    let mut tasks = Vec::new();
    for _ in 0..MIGRATORS {
        let mut client = connect(&db).await;
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            migrate(&mut client).await
        }));
    }
    let mut applied = Vec::new();
    for task in tasks {
        let report = task.await.expect("join").expect("every concurrent migrate succeeds");
        assert_eq!(report.current_version, latest_version());
        applied.extend(report.applied);
    }
    applied.sort_unstable();
    assert_eq!(applied, all_versions(), "exactly one migrator applies each version");
    let client = connect(&db).await;
    assert_eq!(
        count(&client, "SELECT count(*) FROM schema_migrations").await,
        i64::from(latest_version())
    );
}

#[tokio::test]
async fn an_edited_migration_is_refused() {
    let (_db, mut client) = migrated().await;
    client
        .batch_execute(
            "UPDATE schema_migrations SET checksum = 'sha256:0000' WHERE version = 1; \
             CREATE TABLE canary (x int)",
        )
        .await
        .expect("tamper");

    let err = migrate(&mut client).await.expect_err("an edited migration must be refused");
    match &err {
        PgError::MigrationChecksumMismatch { version, recorded, embedded, .. } => {
            assert_eq!(*version, 1);
            assert_eq!(recorded, "sha256:0000");
            assert_eq!(*embedded, MIGRATIONS[0].checksum());
        }
        other => panic!("expected MigrationChecksumMismatch, got {other:?}"),
    }
    let message = err.to_string();
    assert!(message.contains("changed after it was applied"), "{message}");
    assert!(!err.is_transient());

    // Also refused when the list carries a NEW migration: nothing is applied
    // on top of a history that does not match.
    let with_next =
        [MIGRATIONS[0], Migration { version: 2, name: "next", sql: "DROP TABLE canary" }];
    let err = apply_migrations(&mut client, &with_next).await.expect_err("still refused");
    assert!(matches!(err, PgError::MigrationChecksumMismatch { version: 1, .. }), "{err}");
    assert_eq!(count(&client, "SELECT count(*) FROM canary").await, 0, "canary still there");
}

#[tokio::test]
async fn a_version_from_a_newer_build_is_refused() {
    let (_db, mut client) = migrated().await;
    // One above the newest this build knows.
    let future = i64::from(latest_version()) + 1;
    client
        .execute(
            "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, 'future', 'x')",
            &[&(future as i32)],
        )
        .await
        .expect("insert a future version");
    let err = migrate(&mut client).await.expect_err("unknown version");
    assert!(
        matches!(&err, PgError::MigrationUnknown { version, known_max, name }
            if *version == future && name == "future" && *known_max == latest_version()),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_later_migration_applies_alone_and_a_failing_one_leaves_nothing() {
    let (_db, mut client) = migrated().await;

    // Versions far above the embedded list, so they never collide with a real one.
    let note = Migration {
        version: 100,
        name: "add_note",
        sql: "ALTER TABLE orders ADD COLUMN note text",
    };
    let good: Vec<Migration> = MIGRATIONS.iter().copied().chain([note]).collect();
    let report = apply_migrations(&mut client, &good).await.expect("apply 100");
    assert_eq!(report.applied, vec![100]);
    assert_eq!(report.current_version, 100);

    // Version 101 creates a table, then fails: the whole file rolls back and is
    // not recorded, so the next run retries it from scratch.
    let failing = Migration {
        version: 101,
        name: "broken",
        sql: "CREATE TABLE half_done (x int); SELECT no_such_column FROM orders",
    };
    let with_failing: Vec<Migration> = good.iter().copied().chain([failing]).collect();
    let err = apply_migrations(&mut client, &with_failing).await.expect_err("broken migration");
    match &err {
        PgError::MigrationFailed { version: 101, name: "broken", .. } => {}
        other => panic!("expected MigrationFailed for 101, got {other:?}"),
    }
    assert_eq!(err.sql_state(), Some(&SqlState::UNDEFINED_COLUMN));
    assert!(!err.is_transient());
    assert_eq!(
        count(&client, "SELECT count(*) FROM pg_tables WHERE tablename = 'half_done'").await,
        0,
        "the failed migration's first statement must be rolled back"
    );
    assert_eq!(count(&client, "SELECT max(version)::bigint FROM schema_migrations").await, 100);

    // The recorded history as the production list sees it: version 100 is from
    // a "newer build" now.
    let err = migrate(&mut client).await.expect_err("v100 unknown to the embedded list");
    assert!(matches!(err, PgError::MigrationUnknown { version: 100, .. }), "{err}");
}

// ---------------------------------------------------------------------------
// Tokens

#[tokio::test]
async fn generate_tokens_is_idempotent() {
    let (_db, client) = migrated().await;
    seed_sku(&client, ACTIVITY, SKU, 1000).await;

    assert_eq!(generate_tokens(&client, ACTIVITY, SKU, 1000).await.expect("first"), 1000);
    assert_eq!(generate_tokens(&client, ACTIVITY, SKU, 1000).await.expect("second"), 0);

    let row = client
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE status = 'AVAILABLE'), \
             count(DISTINCT seq), min(seq), max(seq), \
             count(*) FILTER (WHERE token_id <> 'tok_' || activity_id || '_' || sku_id || '_' || seq) \
             FROM inventory_token WHERE activity_id = $1 AND sku_id = $2",
            &[&ACTIVITY, &SKU],
        )
        .await
        .expect("token summary");
    let (total, available, distinct_seq, min_seq, max_seq, bad_ids): (
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
    ) = (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4), row.get(5));
    assert_eq!((total, available, distinct_seq), (1000, 1000, 1000));
    assert_eq!((min_seq, max_seq), (1, 1000));
    assert_eq!(bad_ids, 0);
    assert_eq!(count(&client, "SELECT count(*) FROM inventory_token").await, 1000);

    // A re-run never resets a claimed token.
    client
        .execute(
            "UPDATE inventory_token SET status = 'CLAIMED', reservation_id = 'resv_x' \
             WHERE token_id = $1",
            &[&token_id(ACTIVITY, SKU, 1)],
        )
        .await
        .expect("claim one");
    assert_eq!(generate_tokens(&client, ACTIVITY, SKU, 1000).await.expect("third"), 0);
    assert_eq!(
        count(&client, "SELECT count(*) FROM inventory_token WHERE status = 'CLAIMED'").await,
        1
    );

    // Bounds and the SKU foreign key.
    let err = generate_tokens(&client, ACTIVITY, SKU, -1).await.expect_err("negative count");
    assert!(matches!(err, PgError::InvalidArgument(_)), "{err}");
    let err = generate_tokens(&client, ACTIVITY, SKU + 1, 10).await.expect_err("unknown SKU");
    assert!(err.is_foreign_key_violation(), "{err}");
    assert_eq!(err.constraint(), Some("inventory_token_sku_fkey"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claimers_take_every_token_exactly_once() {
    const CLAIMERS: usize = 32;
    const TOKENS: i64 = 1000;
    // Each claimer retries a Contended answer at most this often in a row; a
    // correct claim path needs a handful.
    const CONTENDED_IN_A_ROW_MAX: u32 = 10_000;

    let (db, client) = migrated().await;
    seed_sku(&client, ACTIVITY, SKU, TOKENS).await;
    assert_eq!(generate_tokens(&client, ACTIVITY, SKU, TOKENS).await.expect("generate"), 1000);

    let barrier = Arc::new(tokio::sync::Barrier::new(CLAIMERS));
    let mut tasks = Vec::new();
    for claimer in 0..CLAIMERS {
        let mut conn = connect(&db).await;
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            // token_id -> reservation_id, as this claimer saw its commits.
            let mut claimed: Vec<(String, String)> = Vec::new();
            let mut contended_in_a_row = 0u32;
            loop {
                let reservation_id = format!("resv_{claimer}_{}", claimed.len());
                let tx = conn.transaction().await.expect("begin");
                let outcome =
                    claim_token(&tx, ACTIVITY, SKU, &reservation_id).await.expect("claim");
                tx.commit().await.expect("commit");
                match outcome {
                    ClaimOutcome::Claimed { token_id } => {
                        contended_in_a_row = 0;
                        claimed.push((token_id, reservation_id));
                    }
                    ClaimOutcome::Contended => {
                        contended_in_a_row += 1;
                        assert!(
                            contended_in_a_row < CONTENDED_IN_A_ROW_MAX,
                            "claimer {claimer} starved"
                        );
                        tokio::task::yield_now().await;
                    }
                    ClaimOutcome::Exhausted => return claimed,
                }
            }
        }));
    }

    let mut per_claimer_total = 0usize;
    let mut claims: HashMap<String, String> = HashMap::new();
    for task in tasks {
        let claimed = task.await.expect("claimer panicked");
        per_claimer_total += claimed.len();
        for (token, reservation) in claimed {
            if let Some(previous) = claims.insert(token.clone(), reservation.clone()) {
                panic!("token {token} claimed twice: by {previous} and {reservation}");
            }
        }
    }
    assert_eq!(per_claimer_total, 1000, "sum of per-claimer counts");
    assert_eq!(claims.len(), 1000, "distinct tokens claimed");
    let reservations: HashSet<&String> = claims.values().collect();
    assert_eq!(reservations.len(), 1000, "one reservation per token");

    // The database agrees with what the claimers saw, token by token.
    assert_eq!(
        count(&client, "SELECT count(*) FROM inventory_token WHERE status = 'AVAILABLE'").await,
        0
    );
    let rows = client
        .query(
            "SELECT token_id, status, reservation_id, claimed_at IS NOT NULL FROM inventory_token",
            &[],
        )
        .await
        .expect("read tokens");
    assert_eq!(rows.len(), 1000);
    for row in rows {
        let token: String = row.get(0);
        assert_eq!(row.get::<_, String>(1), "CLAIMED", "{token}");
        let reservation: Option<String> = row.get(2);
        assert_eq!(reservation.as_ref(), claims.get(&token), "{token}");
        assert!(row.get::<_, bool>(3), "{token} has claimed_at");
    }

    // With every token gone, one more claim is Exhausted, not Contended.
    let mut conn = connect(&db).await;
    let tx = conn.transaction().await.expect("begin");
    assert_eq!(
        claim_token(&tx, ACTIVITY, SKU, "resv_late").await.expect("claim"),
        ClaimOutcome::Exhausted
    );
}

#[tokio::test]
async fn a_locked_last_token_is_contended_not_exhausted() {
    let (db, client) = migrated().await;
    seed_sku(&client, ACTIVITY, SKU, 1).await;
    generate_tokens(&client, ACTIVITY, SKU, 1).await.expect("generate");

    let mut holder = connect(&db).await;
    let mut other = connect(&db).await;
    let held = holder.transaction().await.expect("begin holder");
    assert_eq!(
        claim_token(&held, ACTIVITY, SKU, "resv_a").await.expect("claim a"),
        ClaimOutcome::Claimed { token_id: token_id(ACTIVITY, SKU, 1) }
    );
    {
        let tx = other.transaction().await.expect("begin other");
        let outcome = claim_token(&tx, ACTIVITY, SKU, "resv_b").await.expect("claim b");
        assert_eq!(outcome, ClaimOutcome::Contended);
        assert!(outcome.is_worth_retrying());
    }
    // The holder rolls back (e.g. a duplicate buyer): the token is free again.
    held.rollback().await.expect("rollback");
    let tx = other.transaction().await.expect("begin other again");
    assert_eq!(
        claim_token(&tx, ACTIVITY, SKU, "resv_b").await.expect("claim b again"),
        ClaimOutcome::Claimed { token_id: token_id(ACTIVITY, SKU, 1) }
    );
    tx.commit().await.expect("commit");

    // A reservation holds one token per unit (migration 0010): the schema lets it hold a
    // second, and what guards the count is the writers' plan assertion (pg-worker/src/plan.rs)
    // and the audit, which sees a held token no order holds.
    client
        .batch_execute(
            "INSERT INTO sku_inventory (activity_id, sku_id, total_stock) VALUES (10001, 20002, 1)",
        )
        .await
        .expect("second sku");
    generate_tokens(&client, ACTIVITY, SKU + 1, 1).await.expect("generate");
    let tx = other.transaction().await.expect("begin");
    let second = claim_token(&tx, ACTIVITY, SKU + 1, "resv_b").await.expect("second token");
    assert!(matches!(second, ClaimOutcome::Claimed { .. }), "{second:?}");
    tx.commit().await.expect("commit");
    let report = flashsale_pg_worker::audit::check_invariants(&client, ACTIVITY, SKU + 1)
        .await
        .expect("audit");
    assert_eq!(report.held_tokens_without_order, 1, "{report:?}");
    assert!(!report.ok());
}

/// EXPLAIN text of the production claim statement, one line per row.
async fn explain_claim(client: &Client) -> String {
    let sql = format!("EXPLAIN {CLAIM_TOKEN_SQL}");
    let rows = client.query(&sql, &[&ACTIVITY, &SKU, &"resv_x"]).await.expect("explain");
    rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>().join("\n")
}

#[tokio::test]
async fn the_claim_uses_the_partial_available_index() {
    let (_db, client) = migrated().await;
    // Only one activity's tokens in the table: the case where the planner,
    // left alone, walks the heap or primary key (FIELD-NOTES.md).
    seed_sku(&client, ACTIVITY, SKU, 10_000).await;
    generate_tokens(&client, ACTIVITY, SKU, 10_000).await.expect("generate");
    client.batch_execute("ANALYZE").await.expect("analyze");

    let plan = explain_claim(&client).await;
    assert!(plan.contains("inventory_token_available_idx"), "custom plan:\n{plan}");

    // The generic plan a long-lived prepared statement may switch to.
    let generic = client
        .simple_query(&format!(
            "SET plan_cache_mode = force_generic_plan; \
             PREPARE claim(bigint, bigint, text) AS {CLAIM_TOKEN_SQL}; \
             EXPLAIN EXECUTE claim({ACTIVITY}, {SKU}, 'resv_x')"
        ))
        .await
        .expect("explain generic");
    let generic: String = generic
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert!(generic.contains("inventory_token_available_idx"), "generic plan:\n{generic}");
    client.batch_execute("RESET plan_cache_mode; DEALLOCATE claim").await.expect("reset");

    // Still the index once 90% are claimed and statistics are fresh.
    client
        .batch_execute(
            "UPDATE inventory_token SET status = 'CLAIMED', reservation_id = 'resv_' || seq \
             WHERE seq <= 9000; ANALYZE inventory_token",
        )
        .await
        .expect("claim most");
    let plan = explain_claim(&client).await;
    assert!(plan.contains("inventory_token_available_idx"), "plan after claims:\n{plan}");

    // Why CLAIM_TOKEN_SQL orders by seq: the same query without the ORDER BY,
    // on a freshly analyzed single-SKU table, does not use the index. If a
    // PostgreSQL upgrade changes this, the ORDER BY is still harmless.
    client
        .batch_execute(
            "UPDATE inventory_token SET status = 'AVAILABLE', reservation_id = NULL; \
             ANALYZE inventory_token",
        )
        .await
        .expect("reset tokens");
    let rows = client
        .query(
            "EXPLAIN SELECT token_id FROM inventory_token WHERE activity_id = $1 AND sku_id = $2 \
             AND status = 'AVAILABLE' LIMIT 1 FOR UPDATE SKIP LOCKED",
            &[&ACTIVITY, &SKU],
        )
        .await
        .expect("explain unordered");
    let unordered = rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>().join("\n");
    assert!(!unordered.contains("inventory_token_available_idx"), "unordered plan:\n{unordered}");
}

// ---------------------------------------------------------------------------
// Unique constraints: one order per buyer, per token, per reservation

const ORDER_SQL: &str = "INSERT INTO orders (order_id, activity_id, sku_id, user_id, request_id, \
     reservation_id, inventory_token_id) VALUES ($1, 10001, 20001, $2, $3, $4, $5)";

async fn insert_order(
    client: &Client,
    order_id: &str,
    user_id: i64,
    reservation_id: &str,
    token: &str,
) -> Result<u64, PgError> {
    let request_id = format!("req_{order_id}");
    Ok(client
        .execute(ORDER_SQL, &[&order_id, &user_id, &request_id, &reservation_id, &token])
        .await?)
}

#[tokio::test]
async fn orders_are_unique_per_buyer_token_and_reservation() {
    let (_db, client) = migrated().await;
    seed_sku(&client, ACTIVITY, SKU, 5).await;
    generate_tokens(&client, ACTIVITY, SKU, 5).await.expect("generate");
    let tok = |n| token_id(ACTIVITY, SKU, n);

    assert_eq!(insert_order(&client, "ord_1", 7, "resv_1", &tok(1)).await.expect("first"), 1);

    // Same (activity, sku, user), everything else fresh.
    let err = insert_order(&client, "ord_2", 7, "resv_2", &tok(2)).await.expect_err("same buyer");
    assert!(err.is_unique_violation(), "{err}");
    assert!(!err.is_check_violation());
    assert_violation(&err, SqlState::UNIQUE_VIOLATION, "orders_activity_sku_user_key");

    // The worker's form: ON CONFLICT on the buyer key returns no row.
    let rows = client
        .query(
            &format!("{ORDER_SQL} ON CONFLICT (activity_id, sku_id, user_id) DO NOTHING RETURNING order_id"),
            &[&"ord_2", &7i64, &"req_2", &"resv_2", &tok(2)],
        )
        .await
        .expect("on conflict");
    assert!(rows.is_empty());

    // Same token for another buyer.
    let err = insert_order(&client, "ord_3", 8, "resv_3", &tok(1)).await.expect_err("same token");
    assert_violation(&err, SqlState::UNIQUE_VIOLATION, "orders_inventory_token_id_key");

    // Same reservation for another buyer and token.
    let err = insert_order(&client, "ord_4", 9, "resv_1", &tok(3)).await.expect_err("same resv");
    assert_violation(&err, SqlState::UNIQUE_VIOLATION, "orders_reservation_id_key");

    // A token that does not exist.
    let err = insert_order(&client, "ord_5", 10, "resv_5", "tok_10001_20001_99")
        .await
        .expect_err("unknown token");
    assert!(err.is_foreign_key_violation(), "{err}");
    assert_eq!(err.constraint(), Some("orders_inventory_token_fkey"));

    // Other buyers, tokens and reservations are fine; the ROW allocator's
    // orders have no token, and several may coexist.
    assert_eq!(insert_order(&client, "ord_6", 8, "resv_6", &tok(2)).await.expect("other"), 1);
    client
        .batch_execute(
            "INSERT INTO orders (order_id, activity_id, sku_id, user_id, request_id, reservation_id) \
             VALUES ('ord_7', 10001, 20001, 11, 'r7', 'resv_7'), ('ord_8', 10001, 20001, 12, 'r8', 'resv_8')",
        )
        .await
        .expect("tokenless orders");
    assert_eq!(count(&client, "SELECT count(*) FROM orders").await, 4);
}

// ---------------------------------------------------------------------------
// CHECK constraints: every status column accepts exactly its set

/// One status column: a statement template with `{}` for the status value
/// and `{n}` for a per-row unique number, the accepted values, and the CHECK.
struct StatusColumn {
    constraint: &'static str,
    insert: &'static str,
    valid: &'static [&'static str],
    invalid: &'static str,
}

const STATUS_COLUMNS: &[StatusColumn] = &[
    StatusColumn {
        constraint: "activity_status_check",
        insert: "INSERT INTO activity (activity_id, status, start_at, end_at, reservation_ttl_ms, \
                 pay_timeout_ms) VALUES ({n}, '{}', now(), now() + interval '1 hour', 1000, 1000)",
        valid: &["PENDING", "ACTIVE", "ENDED", "TERMINATED"],
        invalid: "RUNNING",
    },
    StatusColumn {
        constraint: "sku_inventory_allocator_check",
        insert: "INSERT INTO sku_inventory (activity_id, sku_id, total_stock, allocator, available_stock) \
                 VALUES (10001, {n}, 10, '{}', CASE WHEN '{}' = 'ROW' THEN 10 END)",
        valid: &["TOKEN", "ROW"],
        invalid: "LOTTERY",
    },
    StatusColumn {
        constraint: "inventory_token_status_check",
        insert: "INSERT INTO inventory_token (token_id, activity_id, sku_id, seq, status, reservation_id) \
                 VALUES ('tok_10001_20001_' || {n}, 10001, 20001, {n}, '{}', \
                 CASE WHEN '{}' <> 'AVAILABLE' THEN 'resv_' || {n} END)",
        valid: &["AVAILABLE", "CLAIMED", "SOLD", "RELEASED"],
        invalid: "LOST",
    },
    StatusColumn {
        constraint: "orders_status_check",
        insert: "INSERT INTO orders (order_id, activity_id, sku_id, user_id, request_id, \
                 reservation_id, status) VALUES ('ord_' || {n}, 10001, 20001, {n}, 'req', \
                 'resv_' || {n}, '{}')",
        valid: &["PENDING_PAYMENT", "PAID", "CANCELLED", "CLOSED", "PAYMENT_UNKNOWN"],
        invalid: "SHIPPED",
    },
    StatusColumn {
        constraint: "inventory_reservation_status_check",
        insert: "INSERT INTO inventory_reservation (reservation_id, request_id, message_id, \
                 activity_id, sku_id, user_id, status, order_id, reserved_at, expires_at) \
                 VALUES ('resv_' || {n}, 'req', 'msg_' || {n}, 10001, 20001, {n}, '{}', \
                 'ord_' || {n}, now(), now() + interval '5 minutes')",
        valid: &[
            "PROCESSING",
            "ORDER_CREATED",
            "REJECTED_NO_FINAL_STOCK",
            "REJECTED_DUPLICATE_USER",
            "REJECTED_EXPIRED",
            "REJECTED_ACTIVITY",
        ],
        invalid: "PENDING_MESSAGE",
    },
    StatusColumn {
        constraint: "inventory_ledger_kind_check",
        insert: "INSERT INTO inventory_ledger (activity_id, sku_id, reservation_id, kind) \
                 VALUES (10001, 20001, 'resv_' || {n}, '{}')",
        valid: &["CLAIM", "SELL", "RELEASE"],
        invalid: "REFUND",
    },
    StatusColumn {
        constraint: "event_outbox_event_type_check",
        insert: "INSERT INTO event_outbox (aggregate_id, event_type, payload) \
                 VALUES ('resv_' || {n}, '{}', '{\"n\": {n}}')",
        valid: &["order_created", "reservation_failed", "compensate", "order_cancelled", "order_paid"],
        invalid: "ORDER_CREATED",
    },
    StatusColumn {
        constraint: "payment_status_check",
        insert: "INSERT INTO payment (payment_id, order_id, status, amount_cents) \
                 VALUES ('pay_' || {n}, 'ord_1', '{}', 100)",
        valid: &["PAID", "FAILED", "CLOSED"],
        invalid: "PENDING",
    },
];

fn render(template: &str, status: &str, n: u32) -> String {
    template.replace("{n}", &n.to_string()).replace("{}", status)
}

#[tokio::test]
async fn every_status_check_accepts_exactly_its_set() {
    let (_db, client) = migrated().await;
    seed_sku(&client, ACTIVITY, SKU, 1000).await;
    let mut n = 100u32;
    for column in STATUS_COLUMNS {
        for status in column.valid {
            n += 1;
            let sql = render(column.insert, status, n);
            client.batch_execute(&sql).await.unwrap_or_else(|e| {
                panic!("{}: {status} must be accepted: {e}\n{sql}", column.constraint)
            });
        }
        n += 1;
        let err = must_fail(&client, &render(column.insert, column.invalid, n)).await;
        assert!(err.is_check_violation(), "{}: {err}", column.constraint);
        assert!(!err.is_unique_violation());
        assert_violation(&err, SqlState::CHECK_VIOLATION, column.constraint);
        // Case matters: the lower-case spelling of a valid value is not valid.
        n += 1;
        let lower = column.valid[0].to_ascii_lowercase();
        let upper = column.valid[0].to_ascii_uppercase();
        let other_case = if lower == column.valid[0] { upper } else { lower };
        let err = must_fail(&client, &render(column.insert, &other_case, n)).await;
        assert_violation(&err, SqlState::CHECK_VIOLATION, column.constraint);
    }
}

#[tokio::test]
async fn row_consistency_checks_hold() {
    let (_db, client) = migrated().await;
    seed_sku(&client, ACTIVITY, SKU, 3).await;
    generate_tokens(&client, ACTIVITY, SKU, 3).await.expect("generate");

    let cases: &[(&str, &str)] = &[
        // A token id that does not spell its unit would let extra stock in.
        (
            "INSERT INTO inventory_token (token_id, activity_id, sku_id, seq) \
             VALUES ('tok_10001_20001_x', 10001, 20001, 4)",
            "inventory_token_id_check",
        ),
        (
            "INSERT INTO inventory_token (token_id, activity_id, sku_id, seq) \
             VALUES ('tok_10001_20001_0', 10001, 20001, 0)",
            "inventory_token_seq_check",
        ),
        // An AVAILABLE token names no holder.
        (
            "UPDATE inventory_token SET reservation_id = 'resv_1' WHERE seq = 1",
            "inventory_token_available_free_check",
        ),
        // A held token names its reservation.
        ("UPDATE inventory_token SET status = 'CLAIMED' WHERE seq = 1", "inventory_token_held_owner_check"),
        // ROW allocator: the counter never goes negative nor above the total...
        (
            "INSERT INTO sku_inventory (activity_id, sku_id, total_stock, allocator, available_stock) \
             VALUES (10001, 1, 10, 'ROW', -1)",
            "sku_inventory_available_stock_check",
        ),
        (
            "INSERT INTO sku_inventory (activity_id, sku_id, total_stock, allocator, available_stock) \
             VALUES (10001, 1, 10, 'ROW', 11)",
            "sku_inventory_available_stock_check",
        ),
        // ...exists for ROW, and only for ROW.
        (
            "INSERT INTO sku_inventory (activity_id, sku_id, total_stock, allocator) \
             VALUES (10001, 1, 10, 'ROW')",
            "sku_inventory_allocator_counter_check",
        ),
        (
            "INSERT INTO sku_inventory (activity_id, sku_id, total_stock, allocator, available_stock) \
             VALUES (10001, 1, 10, 'TOKEN', 10)",
            "sku_inventory_allocator_counter_check",
        ),
        (
            "INSERT INTO sku_inventory (activity_id, sku_id, total_stock) VALUES (10001, 1, -1)",
            "sku_inventory_total_stock_check",
        ),
        // A reservation marked ORDER_CREATED names its order.
        (
            "INSERT INTO inventory_reservation (reservation_id, request_id, message_id, activity_id, \
             sku_id, user_id, status, reserved_at, expires_at) \
             VALUES ('resv_1', 'req', 'msg', 10001, 20001, 1, 'ORDER_CREATED', now(), now())",
            "inventory_reservation_order_check",
        ),
        (
            "INSERT INTO activity (activity_id, status, start_at, end_at, reservation_ttl_ms, \
             pay_timeout_ms) VALUES (2, 'ACTIVE', now(), now(), 1000, 1000)",
            "activity_window_check",
        ),
        (
            "INSERT INTO activity (activity_id, status, start_at, end_at, reservation_ttl_ms, \
             pay_timeout_ms) VALUES (2, 'ACTIVE', now(), now() + interval '1 hour', 0, 1000)",
            "activity_reservation_ttl_ms_check",
        ),
        (
            "INSERT INTO payment (payment_id, order_id, status, amount_cents) \
             VALUES ('pay_1', 'ord_1', 'PAID', -1)",
            "payment_amount_cents_check",
        ),
    ];
    for (sql, constraint) in cases {
        let err = must_fail(&client, sql).await;
        assert_violation(&err, SqlState::CHECK_VIOLATION, constraint);
    }

    // The ROW allocator's conditional decrement stops at zero even without
    // its WHERE guard: the CHECK turns a would-be oversell into an error.
    client
        .batch_execute(
            "INSERT INTO sku_inventory (activity_id, sku_id, total_stock, allocator, available_stock) \
             VALUES (10001, 1, 1, 'ROW', 1); \
             UPDATE sku_inventory SET available_stock = available_stock - 1 \
             WHERE activity_id = 10001 AND sku_id = 1",
        )
        .await
        .expect("take the last unit");
    let err = must_fail(
        &client,
        "UPDATE sku_inventory SET available_stock = available_stock - 1 \
         WHERE activity_id = 10001 AND sku_id = 1",
    )
    .await;
    assert_violation(&err, SqlState::CHECK_VIOLATION, "sku_inventory_available_stock_check");
}

// ---------------------------------------------------------------------------
// Ledger and inbox: one row per (reservation, kind) and per (group, message)

#[tokio::test]
async fn ledger_and_inbox_reject_duplicates() {
    let (_db, client) = migrated().await;

    let ledger =
        "INSERT INTO inventory_ledger (activity_id, sku_id, token_id, reservation_id, kind) \
                  VALUES (10001, 20001, 'tok_10001_20001_1', $1, $2) \
                  ON CONFLICT (reservation_id, kind, unit_no) DO NOTHING RETURNING ledger_id";
    let first = client.query_opt(ledger, &[&"resv_1", &"CLAIM"]).await.expect("first claim row");
    assert!(first.is_some());
    let again = client.query_opt(ledger, &[&"resv_1", &"CLAIM"]).await.expect("second claim row");
    assert!(again.is_none(), "a second CLAIM for one reservation must not insert");
    let release = client.query_opt(ledger, &[&"resv_1", &"RELEASE"]).await.expect("release row");
    assert!(release.is_some(), "a different kind for the same reservation is a new movement");
    // One row per unit (migration 0010): a reservation's second unit is a movement of its own.
    let second_unit = client
        .query_opt(
            "INSERT INTO inventory_ledger (activity_id, sku_id, reservation_id, kind, unit_no) \
             VALUES (10001, 20001, 'resv_1', 'CLAIM', 2) RETURNING ledger_id",
            &[],
        )
        .await
        .expect("second unit");
    assert!(second_unit.is_some());
    let err = must_fail(
        &client,
        "INSERT INTO inventory_ledger (activity_id, sku_id, reservation_id, kind) \
         VALUES (10001, 20001, 'resv_1', 'CLAIM')",
    )
    .await;
    assert!(err.is_unique_violation(), "{err}");
    assert_violation(
        &err,
        SqlState::UNIQUE_VIOLATION,
        "inventory_ledger_reservation_kind_unit_key",
    );
    assert_eq!(count(&client, "SELECT count(*) FROM inventory_ledger").await, 3);

    let inbox = "INSERT INTO consumer_inbox (consumer_group, message_id, reservation_id) \
                 VALUES ($1, $2, 'resv_1') ON CONFLICT DO NOTHING RETURNING message_id";
    let first = client.query_opt(inbox, &[&"order-writer", &"msg_1"]).await.expect("first");
    assert_eq!(first.map(|r| r.get::<_, String>(0)).as_deref(), Some("msg_1"));
    let again = client.query_opt(inbox, &[&"order-writer", &"msg_1"]).await.expect("again");
    assert!(again.is_none(), "a redelivered message must find its inbox row");
    let other_group = client.query_opt(inbox, &[&"redis-sync", &"msg_1"]).await.expect("other");
    assert!(other_group.is_some(), "another consumer group applies the message once too");
    let err = must_fail(
        &client,
        "INSERT INTO consumer_inbox (consumer_group, message_id) VALUES ('order-writer', 'msg_1')",
    )
    .await;
    assert_violation(&err, SqlState::UNIQUE_VIOLATION, "consumer_inbox_pkey");
    assert_eq!(count(&client, "SELECT count(*) FROM consumer_inbox").await, 2);
}

#[tokio::test]
async fn the_outbox_publisher_reads_unpublished_events_by_the_partial_index() {
    let (_db, client) = migrated().await;
    client
        .batch_execute(
            "INSERT INTO event_outbox (aggregate_id, event_type, payload, published_at) \
             SELECT 'resv_' || n, 'order_created', '{}'::jsonb, now() \
             FROM generate_series(1, 20000) n; \
             INSERT INTO event_outbox (aggregate_id, event_type, payload) \
             SELECT 'resv_x' || n, 'compensate', '{}'::jsonb FROM generate_series(1, 10) n; \
             ANALYZE event_outbox",
        )
        .await
        .expect("fill outbox");
    let rows = client
        .query(
            "EXPLAIN SELECT event_id FROM event_outbox WHERE published_at IS NULL \
             ORDER BY event_id LIMIT 100 FOR UPDATE SKIP LOCKED",
            &[],
        )
        .await
        .expect("explain");
    let plan = rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>().join("\n");
    assert!(plan.contains("event_outbox_unpublished_idx"), "{plan}");
    assert_eq!(
        count(&client, "SELECT count(*) FROM event_outbox WHERE published_at IS NULL").await,
        10
    );
}
