//! Private servers and fresh PostgreSQL databases for the benches that price the order path
//! (`order_pipeline`, `floors`): the stack code of `flashsale stack up` starts the servers, and
//! every case gets a database of its own, migrated, with one ACTIVE SKU, so no case inherits
//! another's bloat.

use flashsale_engine::app::stack::Server;
use flashsale_io::wire::{OrderCreate, ORDER_CREATE_EVENT_TYPE};
use flashsale_pg_worker::{generate_tokens, migrate};
use tokio_postgres::{Client, NoTls};

/// The activity and SKU every bench database holds.
pub const ACTIVITY: i64 = 10001;
pub const SKU: i64 = 20001;

/// Stops a server when dropped (also on panic), so no bench run leaves one behind.
pub struct Running(pub Server);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.stop();
    }
}

/// A client whose connection runs on the current tokio runtime.
pub async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.expect("connect");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

pub fn db_url(pg: &Server, name: &str) -> String {
    format!("postgres://postgres@127.0.0.1:{}/{name}", pg.port)
}

/// The SKU of a fresh database.
pub struct SkuSpec {
    /// `TOKEN` or `ROW`.
    pub allocator: &'static str,
    /// inventory_token at fillfactor 50 (half-empty pages; the schema keeps the default 100).
    pub half_empty_tokens: bool,
    pub stock: i64,
    pub max_per_buyer: i32,
}

/// Drops and creates database `name`, migrates it and adds one ACTIVE SKU (its tokens too
/// for the TOKEN allocator), vacuumed and analysed.
pub async fn fresh_database(pg: &Server, name: &str, sku: &SkuSpec) -> Client {
    let admin = connect(&pg.url()).await;
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name}")).await.expect("drop");
    admin.batch_execute(&format!("CREATE DATABASE {name}")).await.expect("create");
    let mut client = connect(&db_url(pg, name)).await;
    migrate(&mut client).await.expect("migrate");
    client
        .execute(
            "INSERT INTO activity (activity_id, status, start_at, end_at, reservation_ttl_ms, \
             pay_timeout_ms) VALUES ($1, 'ACTIVE', now() - interval '1 hour', \
             now() + interval '1 hour', 300000, 900000)",
            &[&ACTIVITY],
        )
        .await
        .expect("activity");
    let available = (sku.allocator == "ROW").then_some(sku.stock);
    client
        .execute(
            "INSERT INTO sku_inventory (activity_id, sku_id, total_stock, allocator, \
                                        available_stock, max_per_buyer) \
             VALUES ($1, $2, $3, $4, $5, $6)",
            &[&ACTIVITY, &SKU, &sku.stock, &sku.allocator, &available, &sku.max_per_buyer],
        )
        .await
        .expect("sku");
    if sku.half_empty_tokens {
        client
            .batch_execute("ALTER TABLE inventory_token SET (fillfactor = 50)")
            .await
            .expect("fillfactor");
    }
    if sku.allocator == "TOKEN" {
        generate_tokens(&client, ACTIVITY, SKU, sku.stock).await.expect("tokens");
    }
    client.batch_execute("VACUUM ANALYZE").await.expect("vacuum");
    client
}

/// Order-create message `n` of the bench SKU (ids `<kind>_bench<n>`, buyer 1,000,000 + n),
/// reserved at `now_ms` for an hour.
pub fn order_create(n: u64, quantity: u32, now_ms: u64) -> OrderCreate {
    OrderCreate {
        schema_version: 1,
        event_type: ORDER_CREATE_EVENT_TYPE.to_owned(),
        message_id: format!("msg_bench{n:020}"),
        message_key: format!("resv_bench{n:020}"),
        request_id: format!("req_bench{n:020}"),
        reservation_id: format!("resv_bench{n:020}"),
        activity_id: ACTIVITY as u64,
        sku_id: SKU as u64,
        user_id: 1_000_000 + n,
        quantity,
        reserved_at_ms: now_ms,
        reservation_expires_at_ms: now_ms + 3_600_000,
        retry_count: 0,
        payload_hash: format!("sha256:{n:064x}"),
        traceparent: Some(format!("00-{n:032x}-{n:016x}-01")),
        created_at_ms: now_ms,
    }
}

/// The 1-minute load average: the machine is shared, and a number taken while something else
/// was busy says so beside it.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}
