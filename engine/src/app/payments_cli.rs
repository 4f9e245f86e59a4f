//! `flashsale admin payments reconcile --statement FILE [--apply]`: the payment channel's
//! statement against PostgreSQL (seed ch9 §7.10 step 4), printed as JSON; with `--apply` the
//! differences the payment state machine can settle are fed to it, line by line, as callbacks
//! (`flashsale_pg_worker::payment_reconcile`). The statement's format is
//! `flashsale_pg_worker::payment_statement` (README "Recovery → payments").
//!
//! Why it talks to PostgreSQL and not to the engine's admin API like the other `admin` calls:
//! a statement is far larger than the admin API's 4 KiB body bound, and the state machine it
//! goes through lives in PostgreSQL (`flashsale_payment_callback`), which the engine's own
//! callback route calls the same way. It needs `FLASHSALE_PG_URL` (or `--pg-url`), no engine.
//!
//! Exit status: 0 when nothing is left open (no difference, or every one applied and none for
//! review), 1 otherwise.

use std::io::Write;
use std::path::Path;

use anyhow::Context;
use flashsale_pg_worker::payment_reconcile::{
    reconcile_statement, ReconcileMode, ReconcileReport, Reconciled,
};
use serde_json::{json, Value};

/// Largest statement file read (a statement of `STATEMENT_LINES_MAX` lines fits).
const STATEMENT_BYTES_MAX: u64 = 64 << 20;

/// Reads, compares, applies (with `mode` Apply) and prints; returns the exit status.
pub fn reconcile(
    pg_url: &str,
    statement_path: &Path,
    mode: ReconcileMode,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let size = std::fs::metadata(statement_path)
        .with_context(|| format!("read the statement {}", statement_path.display()))?
        .len();
    anyhow::ensure!(
        size <= STATEMENT_BYTES_MAX,
        "statement larger than {STATEMENT_BYTES_MAX} bytes: split it"
    );
    let text = std::fs::read_to_string(statement_path)
        .with_context(|| format!("read the statement {}", statement_path.display()))?;
    let statement = flashsale_pg_worker::payment_statement::parse_statement(&text)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let report = runtime.block_on(async {
        let pool_config = flashsale_pg_worker::pool::PgPoolConfig {
            url: pg_url.to_owned(),
            ..Default::default()
        };
        let connector = flashsale_pg_worker::pool::Connector::new(&pool_config)?;
        let (client, driver) = connector
            .connect()
            .await
            .with_context(|| format!("connect to PostgreSQL at {pg_url}"))?;
        let driver = tokio::spawn(driver);
        let now_ms = crate::logic::clock::now_ms();
        let report = reconcile_statement(&client, &statement, mode, now_ms).await;
        drop(client);
        let _ = driver.await;
        anyhow::Ok(report?)
    })?;
    let printed = render(&report, mode, statement_path);
    writeln!(out, "{}", serde_json::to_string_pretty(&printed)?)?;
    Ok(if report.open() == 0 { 0 } else { 1 })
}

fn render(report: &ReconcileReport, mode: ReconcileMode, path: &Path) -> Value {
    let time = |ms: u64| flashsale_io::wire::format_rfc3339_ms(ms).to_string();
    json!({
        "statement": {
            "file": path.display().to_string(),
            "lines": report.lines,
            "from": report.period_ms.map(|(from, _)| time(from)),
            "to": report.period_ms.map(|(_, to)| time(to)),
        },
        "mode": if mode == ReconcileMode::Apply { "apply" } else { "report" },
        "matched": report.matched,
        "differences": report.differences.iter().map(difference).collect::<Vec<_>>(),
        "changed": report.changed(),
        "open": report.open(),
        "ok": report.open() == 0,
    })
}

fn difference(r: &Reconciled) -> Value {
    let d = &r.difference;
    let mut v = json!({
        "kind": d.kind.as_str(),
        "action": d.action.as_str(),
        "payment_id": d.payment_id,
        "order_id": d.order_id,
        "order_status": d.order_status,
        "amount_cents_here": d.amount_cents_here,
    });
    if let Some(line) = &d.line {
        v["line"] = json!(line.line);
        v["status_there"] = json!(line.status.as_str());
        v["amount_cents_there"] = json!(line.amount_cents);
        v["at"] = json!(flashsale_io::wire::format_rfc3339_ms(line.at_ms).to_string());
    }
    if let Some(applied) = &r.applied {
        v["outcome"] = json!(applied.outcome.as_str());
        v["replayed"] = json!(applied.replayed);
        v["order_status_after"] = json!(applied.order_status);
    }
    v
}
