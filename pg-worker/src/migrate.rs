//! Versioned, checksummed, concurrency-safe schema migrations
//! (`flashsale migrate`, and the start of `serve`/`worker`).
//!
//! What it is: the embedded list of `.sql` files in `pg-worker/migrations/`
//! (`MIGRATIONS`), and `migrate`, which applies the ones a database lacks. Each
//! migration runs in ONE transaction that first takes a transaction-scoped
//! advisory lock (`pg_advisory_xact_lock`), so two processes migrating the same
//! database at once serialize: the second waits, sees the version recorded, and
//! skips it. A failed migration rolls back whole; nothing half-applied is ever
//! recorded. `schema_migrations` keeps each applied file's SHA-256, and a
//! database whose recorded checksum differs from the embedded file, or that has
//! a version this binary does not know, is refused with an error that says so.
//!
//! What it is not: a down-migration tool (fix forward with a new file), nor a
//! place for data backfills that need `CREATE INDEX CONCURRENTLY` or batching
//! outside a transaction.
//!
//! The decision of what to apply (`plan`) is sans-I/O and unit-tested below;
//! `apply_migrations` is the thin driver around it.
//!
//! Read next: `migrations/0001_init.sql` (the schema and the invariant each
//! constraint enforces), `tokens.rs` (the claim query the schema is tuned for).

use sha2::{Digest, Sha256};
use tokio_postgres::{Client, Transaction};

use crate::error::PgError;

/// One embedded migration. `version`s are strictly increasing, from 1.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    pub version: u32,
    pub name: &'static str,
    pub sql: &'static str,
}

impl Migration {
    /// `sha256:<hex>` of the SQL text exactly as embedded (bytes, not
    /// normalized: any edit, even whitespace, is an edit).
    pub fn checksum(&self) -> String {
        let digest = Sha256::digest(self.sql.as_bytes());
        let mut out = String::with_capacity("sha256:".len() + 2 * digest.len());
        out.push_str("sha256:");
        out.push_str(&hex::encode(digest));
        out
    }
}

/// The schema, in order. Never edit an entry once it has been applied
/// anywhere; append a new one.
pub const MIGRATIONS: &[Migration] = &[
    Migration { version: 1, name: "init", sql: include_str!("../migrations/0001_init.sql") },
    Migration {
        version: 2,
        name: "order_create",
        sql: include_str!("../migrations/0002_order_create.sql"),
    },
    Migration {
        version: 3,
        name: "payments",
        sql: include_str!("../migrations/0003_payments.sql"),
    },
    Migration {
        version: 4,
        name: "order_create_set",
        sql: include_str!("../migrations/0004_order_create_set.sql"),
    },
    Migration {
        version: 5,
        name: "payment_status",
        sql: include_str!("../migrations/0005_payment_status.sql"),
    },
    Migration {
        version: 6,
        name: "lifecycle",
        sql: include_str!("../migrations/0006_lifecycle.sql"),
    },
    Migration {
        version: 7,
        name: "bounds_and_price",
        sql: include_str!("../migrations/0007_bounds_and_price.sql"),
    },
    Migration {
        version: 8,
        name: "payment_hold",
        sql: include_str!("../migrations/0008_payment_hold.sql"),
    },
    Migration {
        version: 9,
        name: "request_unique",
        sql: include_str!("../migrations/0009_request_unique.sql"),
    },
    Migration {
        version: 10,
        name: "quantity",
        sql: include_str!("../migrations/0010_quantity.sql"),
    },
];

// A malformed list is a build defect: catch it at compile time.
const _: () = assert!(migration_list_is_valid(MIGRATIONS));

/// What `migrate` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrateReport {
    /// Versions this call applied, ascending; empty when the database was
    /// already current (or another process applied them first).
    pub applied: Vec<u32>,
    /// The highest version recorded in the database afterwards (0: none).
    pub current_version: u32,
}

/// Key of the advisory lock that serializes migrations of one database. Any
/// fixed 64-bit value works as long as nothing else uses it: these are the
/// ASCII bytes of "flashmig".
pub const MIGRATE_LOCK_KEY: i64 = 0x666c_6173_686d_6967;

/// How long a migration waits for the advisory lock (another process
/// migrating) or for a table lock its DDL needs (long-running transactions).
/// Past it the server answers 55P03, which `PgError::is_transient` calls
/// retryable: a stuck migrator should surface, not hang start-up forever.
pub const MIGRATE_LOCK_TIMEOUT_MS: u32 = 60_000;

/// Settings for every migration transaction (`set_config(.., true)` is
/// `SET LOCAL`: they end with the transaction). `search_path` is pinned so the
/// tables land in `public` (CONTRACT.md section 7) whatever the connection's
/// default is.
const MIGRATION_TX_SETTINGS_SQL: &str =
    "SELECT set_config('lock_timeout', $1, true), set_config('search_path', 'public', true)";

const CREATE_SCHEMA_MIGRATIONS_SQL: &str = "\
    CREATE TABLE IF NOT EXISTS schema_migrations (\
        version    integer     NOT NULL, \
        name       text        NOT NULL, \
        checksum   text        NOT NULL, \
        applied_at timestamptz NOT NULL DEFAULT now(), \
        CONSTRAINT schema_migrations_pkey PRIMARY KEY (version))";

/// A row of `schema_migrations`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedMigration {
    /// As stored (`integer`); only positive values are ever written by this
    /// crate, anything else is reported as unknown.
    pub version: i64,
    pub name: String,
    pub checksum: String,
}

/// Applies the embedded `MIGRATIONS` that the database lacks.
///
/// Idempotent, and safe when several processes call it on the same database
/// at the same time: exactly one of them applies each migration. Refuses (and
/// changes nothing) when an applied migration's checksum differs from the
/// embedded one or the database knows a version this binary does not.
pub async fn migrate(client: &mut Client) -> Result<MigrateReport, PgError> {
    apply_migrations(client, MIGRATIONS).await
}

/// `migrate` with an explicit list, for tests and tools. `migrations` must be
/// strictly increasing by version, from 1, with non-empty names.
pub async fn apply_migrations(
    client: &mut Client,
    migrations: &[Migration],
) -> Result<MigrateReport, PgError> {
    if !migration_list_is_valid(migrations) {
        return Err(PgError::MigrationList(
            "versions must be strictly increasing from 1 up to i32::MAX, names non-empty",
        ));
    }

    // Bootstrap and read the history under the lock: two processes racing to
    // create schema_migrations would otherwise collide on the catalog (23505 on
    // pg_type) even with IF NOT EXISTS.
    let recorded = {
        let tx = client.transaction().await?;
        lock(&tx).await?;
        tx.batch_execute(CREATE_SCHEMA_MIGRATIONS_SQL).await?;
        let recorded = read_recorded(&tx).await?;
        tx.commit().await?;
        recorded
    };
    // Refuse before touching anything if the history does not match.
    let pending = plan(&recorded, migrations)?;

    let mut applied = Vec::with_capacity(pending.len());
    for migration in pending {
        if apply_one(client, migration).await? {
            applied.push(migration.version);
        }
    }

    let current: Option<i32> =
        client.query_one("SELECT max(version) FROM public.schema_migrations", &[]).await?.get(0);
    let current_version = current.and_then(|v| u32::try_from(v).ok()).unwrap_or(0);
    if !applied.is_empty() {
        tracing::info!(?applied, current_version, "schema migrated");
    }
    Ok(MigrateReport { applied, current_version })
}

/// Applies one migration in its own locked transaction. `Ok(false)`: another
/// process applied it while we waited for the lock (its checksum verified).
async fn apply_one(client: &mut Client, migration: &Migration) -> Result<bool, PgError> {
    let checksum = migration.checksum();
    let tx = client.transaction().await?;
    lock(&tx).await?;
    let version = version_to_db(migration.version);
    let row = tx
        .query_opt("SELECT name, checksum FROM schema_migrations WHERE version = $1", &[&version])
        .await?;
    if let Some(row) = row {
        let recorded: String = row.get(1);
        if recorded != checksum {
            return Err(PgError::MigrationChecksumMismatch {
                version: migration.version,
                name: row.get(0),
                recorded,
                embedded: checksum,
            });
        }
        // Dropping `tx` rolls back, which is all a read-only transaction needs.
        return Ok(false);
    }
    tx.batch_execute(migration.sql).await.map_err(|source| PgError::MigrationFailed {
        version: migration.version,
        name: migration.name,
        source,
    })?;
    tx.execute(
        "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
        &[&version, &migration.name, &checksum],
    )
    .await?;
    tx.commit().await?;
    Ok(true)
}

/// Takes the migration lock for the rest of the transaction.
async fn lock(tx: &Transaction<'_>) -> Result<(), PgError> {
    let lock_timeout = format!("{MIGRATE_LOCK_TIMEOUT_MS}ms");
    tx.execute(MIGRATION_TX_SETTINGS_SQL, &[&lock_timeout]).await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATE_LOCK_KEY]).await?;
    Ok(())
}

async fn read_recorded(tx: &Transaction<'_>) -> Result<Vec<AppliedMigration>, PgError> {
    let rows = tx
        .query("SELECT version, name, checksum FROM schema_migrations ORDER BY version", &[])
        .await?;
    let mut recorded = Vec::with_capacity(rows.len());
    for row in rows {
        let version: i32 = row.get(0);
        recorded.push(AppliedMigration {
            version: i64::from(version),
            name: row.get(1),
            checksum: row.get(2),
        });
    }
    Ok(recorded)
}

fn version_to_db(version: u32) -> i32 {
    // migration_list_is_valid bounds versions by i32::MAX.
    i32::try_from(version).unwrap_or(i32::MAX)
}

/// Decides what to apply (sans-I/O). Errors when an applied migration differs
/// from its embedded text or is unknown to this binary; otherwise returns the
/// embedded migrations not yet recorded, in order.
pub fn plan<'m>(
    recorded: &[AppliedMigration],
    migrations: &'m [Migration],
) -> Result<Vec<&'m Migration>, PgError> {
    let known_max = migrations.last().map_or(0, |m| m.version);
    for applied in recorded {
        let Some(embedded) = migrations.iter().find(|m| i64::from(m.version) == applied.version)
        else {
            return Err(PgError::MigrationUnknown {
                version: applied.version,
                name: applied.name.clone(),
                known_max,
            });
        };
        let checksum = embedded.checksum();
        if applied.checksum != checksum {
            return Err(PgError::MigrationChecksumMismatch {
                version: embedded.version,
                name: applied.name.clone(),
                recorded: applied.checksum.clone(),
                embedded: checksum,
            });
        }
    }
    Ok(migrations
        .iter()
        .filter(|m| !recorded.iter().any(|applied| applied.version == i64::from(m.version)))
        .collect())
}

/// Strictly increasing versions in `1..=i32::MAX` (the column is `integer`),
/// non-empty names. `const` so the embedded list is checked at compile time.
pub const fn migration_list_is_valid(migrations: &[Migration]) -> bool {
    let mut previous = 0u32;
    let mut i = 0;
    while i < migrations.len() {
        let m = &migrations[i];
        if m.version <= previous || m.version > i32::MAX as u32 || m.name.is_empty() {
            return false;
        }
        previous = m.version;
        i += 1;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Migration = Migration { version: 1, name: "a", sql: "SELECT 1" };
    const B: Migration = Migration { version: 2, name: "b", sql: "SELECT 2" };

    fn recorded(m: &Migration) -> AppliedMigration {
        AppliedMigration {
            version: i64::from(m.version),
            name: m.name.to_owned(),
            checksum: m.checksum(),
        }
    }

    #[test]
    fn plan_applies_only_what_is_missing() {
        let list = [A, B];
        let versions = |p: Vec<&Migration>| p.iter().map(|m| m.version).collect::<Vec<_>>();
        assert_eq!(versions(plan(&[], &list).expect("fresh")), vec![1, 2]);
        assert_eq!(versions(plan(&[recorded(&A)], &list).expect("partial")), vec![2]);
        assert!(plan(&[recorded(&A), recorded(&B)], &list).expect("current").is_empty());
    }

    #[test]
    fn plan_refuses_an_edited_migration() {
        let mut edited = recorded(&A);
        edited.checksum = Migration { sql: "SELECT 1 ", ..A }.checksum();
        let err = plan(&[edited], &[A, B]).expect_err("edited");
        assert!(matches!(err, PgError::MigrationChecksumMismatch { version: 1, .. }), "{err}");
        assert!(!err.is_transient());
    }

    #[test]
    fn plan_refuses_a_version_from_a_newer_build() {
        let err = plan(&[recorded(&A), recorded(&B)], &[A]).expect_err("newer");
        assert!(matches!(err, PgError::MigrationUnknown { version: 2, known_max: 1, .. }), "{err}");
    }

    #[test]
    fn list_validation() {
        assert!(migration_list_is_valid(&[A, B]));
        assert!(migration_list_is_valid(&[]));
        assert!(!migration_list_is_valid(&[B, A]));
        assert!(!migration_list_is_valid(&[A, A]));
        assert!(!migration_list_is_valid(&[Migration { version: 0, ..A }]));
        assert!(!migration_list_is_valid(&[Migration { name: "", ..A }]));
        assert!(!migration_list_is_valid(&[Migration { version: 1 << 31, ..A }]));
    }

    #[test]
    fn checksum_is_sha256_of_the_exact_text() {
        // sha256("SELECT 1"), computed independently.
        assert_eq!(
            A.checksum(),
            "sha256:e004ebd5b5532a4b85984a62f8ad48a81aa3460c1ca07701f386135d72cdecf5"
        );
        assert_ne!(A.checksum(), Migration { sql: "SELECT 1\n", ..A }.checksum());
    }

    #[test]
    fn embedded_migrations_are_transaction_safe() {
        // apply_one wraps each file in its own transaction.
        for migration in MIGRATIONS {
            let sql = migration.sql.to_ascii_uppercase();
            for forbidden in ["BEGIN;", "COMMIT;", "CONCURRENTLY", "VACUUM"] {
                let in_code = sql.lines().filter(|l| !l.trim_start().starts_with("--"));
                assert!(
                    !in_code.clone().any(|l| l.contains(forbidden)),
                    "{forbidden} in migration {} ({})",
                    migration.version,
                    migration.name
                );
            }
        }
    }
}
