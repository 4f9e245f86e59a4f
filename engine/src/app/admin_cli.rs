//! `flashsale admin ...`: control-plane calls against a running engine's admin listener
//! (CONTRACT.md sections 1 and 4), over a tiny blocking HTTP/1.1 client.
//!
//! - `flashsale admin reconcile --activity A --sku S`: prints the conservation report (JSON);
//!   exit 0 when it says `"ok": true`, 1 otherwise (a gap, or the engine could not be asked).
//! - `flashsale admin create-activity --activity A --sku S --stock N [...]`: `POST
//!   /admin/v1/activities`; prints the answer; exit 0 on 200/201.
//! - `flashsale admin mode --mode M --version V [--scope S] [--admit-percent P] [--ttl-s T]`:
//!   signs a degradation-mode snapshot with `FLASHSALE_CONTROL_KEY` and posts it to `POST
//!   /admin/v1/mode` (every instance then gets it through the mode bucket); `flashsale admin
//!   mode --show` prints the global mode. Exit 0 when accepted.
//! - `flashsale admin refunds`: `GET /admin/v1/refunds`, the payments recorded REFUND_NEEDED
//!   (order id, payment id, amount, since) as JSON; exit 0 when listed.
//! - `flashsale admin payments unknown`: `GET /admin/v1/payments/unknown`, the orders held
//!   PAYMENT_UNKNOWN (their units kept) with why; exit 0 when listed. `flashsale admin payments
//!   reconcile --statement FILE [--apply] [--pg-url URL]`: the provider's statement against
//!   PostgreSQL, and with `--apply` the differences fed to the payment state machine
//!   (`payments_cli.rs`: the one call that goes to PostgreSQL, not to the engine); exit 0 when
//!   nothing is left open.
//! - `flashsale admin stuck list --activity A --sku S`: the SKU's stuck reservations (oldest
//!   first, with what each may be resolved by); `flashsale admin stuck resolve --activity A
//!   --sku S --reservation R (--republish | --compensate)`: `POST
//!   /admin/v1/activities/{a}/skus/{s}/stuck/{r}` (`shard/admin/stuck.rs` says when each is allowed);
//!   exit 0 when the engine took the decision.
//! - `flashsale admin activity add-sku|end|terminate|top-up|release-policy ...`: the
//!   lifecycle routes of CONTRACT.md section 4 (`shard/admin/lifecycle.rs`); exit 0 when the engine
//!   applied the change or had applied it before.
//! - `flashsale admin dlq list [--after SEQ]`: dead letters, oldest first; `flashsale admin dlq
//!   replay --seq N` / `discard --seq N`: `POST /admin/v1/dlq/{n}` (`shard/admin/dlq.rs`); exit 0
//!   when done.
//!
//! - `flashsale admin backup --dir DIR [--pg-url URL]` and `flashsale admin restore-drill
//!   --backup DIR --to RFC3339 [--json FILE] [--keep]`: PostgreSQL base backups and the
//!   point-in-time restore drill (`app/backup/`: they talk to PostgreSQL and its tools, not to
//!   the engine); exit 2 for input they refuse ([`crate::app::backup::UsageError`]).
//!
//! Adding a call: a variant of [`AdminCommand`], its argument struct, and a function that uses
//! [`AdminClient::get_json`] / [`AdminClient::post_json`] and returns the exit status.
//! `--admin-addr` and `--token` override `FLASHSALE_ADMIN_ADDR` / `FLASHSALE_ADMIN_TOKEN` (and
//! the TOML file), like every other setting ([`crate::app::config`]).
//!
//! What it is not: a general HTTP client (one request per connection, `Content-Length`
//! bodies only, no TLS — the admin listener is loopback or a private network).

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use serde_json::{json, Value};

use crate::app::config::{self, Config, Env, Overrides};

/// Largest answer read (a reconcile report lists bounded ids, so it stays far below this).
const RESPONSE_BYTES_MAX: usize = 16 << 20;

/// `flashsale admin` and its options shared by every call.
#[derive(Debug, Args)]
pub struct AdminArgs {
    #[command(subcommand)]
    pub command: AdminCommand,
    /// Admin listener of the running engine (overrides FLASHSALE_ADMIN_ADDR).
    #[arg(long, global = true)]
    pub admin_addr: Option<String>,
    /// Bearer token of the admin API (overrides FLASHSALE_ADMIN_TOKEN).
    #[arg(long, global = true)]
    pub token: Option<String>,
    /// TOML configuration file (default: flashsale.toml when present).
    #[arg(long, global = true)]
    pub config: Option<PathBuf>,
    /// Stack directory whose env file supplies default URLs.
    #[arg(long, global = true, default_value = config::DEFAULT_STACK_DIR)]
    pub stack_dir: PathBuf,
    /// Seconds to wait for the engine's answer (a reconcile reads both stores).
    #[arg(long, global = true, default_value_t = 60)]
    pub timeout_s: u64,
}

#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// The conservation report of one SKU (DESIGN.md section 8) as JSON; exit 0 when ok, 1
    /// when not.
    Reconcile(SkuArgs),
    /// Create an activity with one SKU and its stock (idempotent for the same values; the
    /// engine answers 409 for different values under an existing id).
    CreateActivity(CreateActivityArgs),
    /// Set a degradation mode (signed with FLASHSALE_CONTROL_KEY), or `--show` the current one.
    Mode(ModeArgs),
    /// Payments whose money must go back (recorded REFUND_NEEDED), oldest first, as JSON.
    Refunds,
    /// Orders held PAYMENT_UNKNOWN, and the payment channel's statement reconciled.
    #[command(subcommand)]
    Payments(PaymentsCommand),
    /// Reservations past the recovery deadline with no outcome: list, or resolve one.
    #[command(subcommand)]
    Stuck(StuckCommand),
    /// Dead letters (`SECKILL_DLQ`): list, replay one to where it came from, or discard one.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// An activity's life: add a SKU, end or terminate (an activity or one SKU), top up
    /// stock, set the release policy. Each change is versioned and recorded with `--actor`.
    #[command(subcommand)]
    Activity(ActivityCommand),
    /// A PostgreSQL base backup (pg_basebackup) beside the WAL archive the server keeps; prints
    /// its manifest. Talks to PostgreSQL, not to the engine.
    Backup(crate::app::backup::BackupArgs),
    /// Restores a backup into an isolated directory to a point in time, starts it on a free
    /// port, checks orders, payments, ledger, unique keys and each SKU's conservation, and
    /// reports the measured RPO and RTO; exit 0 when everything reconciles, 1 when not, 2 on
    /// bad input.
    RestoreDrill(crate::app::backup::DrillArgs),
}

#[derive(Debug, Subcommand)]
pub enum PaymentsCommand {
    /// Orders held PAYMENT_UNKNOWN (their unit kept until the provider's word), oldest first.
    Unknown,
    /// Compare the provider's statement (CSV `payment_id,order_id,amount_cents,status,at`)
    /// with PostgreSQL; `--apply` feeds the differences it can settle to the payment state
    /// machine (idempotent: the same statement twice changes nothing the second time).
    Reconcile(StatementArgs),
}

#[derive(Debug, Args)]
pub struct StatementArgs {
    /// The provider's statement (README "Recovery → payments" for the format).
    #[arg(long)]
    pub statement: PathBuf,
    /// Apply the differences (without it: report only).
    #[arg(long)]
    pub apply: bool,
    /// PostgreSQL to reconcile (overrides FLASHSALE_PG_URL).
    #[arg(long)]
    pub pg_url: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum ActivityCommand {
    /// Add a SKU with its stock to an existing activity (idempotent for the same values).
    AddSku(AddSkuArgs),
    /// No new submissions; reservations in flight still become orders.
    End(ScopeArgs),
    /// No new submissions; reservations in flight are rejected and their units returned.
    Terminate(ScopeArgs),
    /// Add units to a SKU (new tokens, then Redis stock); `--request-id` makes a retry safe.
    TopUp(TopUpArgs),
    /// What a cancelled or closed order's unit becomes: BACK_TO_SALE or RELEASED.
    ReleasePolicy(ReleasePolicyArgs),
}

#[derive(Debug, Args)]
pub struct AddSkuArgs {
    #[command(flatten)]
    pub sku: SkuArgs,
    #[arg(long)]
    pub stock: u64,
    /// TOKEN (the default) or ROW.
    #[arg(long)]
    pub allocator: Option<String>,
    /// Who makes the change (recorded in PostgreSQL).
    #[arg(long, default_value = "flashsale-admin")]
    pub actor: String,
}

#[derive(Debug, Args)]
pub struct ScopeArgs {
    #[arg(long)]
    pub activity: u64,
    /// Only this SKU (default: the whole activity).
    #[arg(long)]
    pub sku: Option<u64>,
    #[arg(long, default_value = "flashsale-admin")]
    pub actor: String,
}

#[derive(Debug, Args)]
pub struct TopUpArgs {
    #[command(flatten)]
    pub sku: SkuArgs,
    /// Units to add.
    #[arg(long)]
    pub add: u64,
    /// The same id again is the same top-up (default: a fresh one, printed in the answer).
    #[arg(long)]
    pub request_id: Option<String>,
    #[arg(long, default_value = "flashsale-admin")]
    pub actor: String,
}

#[derive(Debug, Args)]
pub struct ReleasePolicyArgs {
    #[arg(long)]
    pub activity: u64,
    /// BACK_TO_SALE or RELEASED.
    #[arg(long)]
    pub policy: String,
    #[arg(long, default_value = "flashsale-admin")]
    pub actor: String,
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// Dead letters, oldest first, as JSON (100 at a time; `--after` continues).
    List {
        /// Only dead letters with a higher sequence (the answer's `next_after`).
        #[arg(long, default_value_t = 0)]
        after: u64,
    },
    /// Publish one again to its source subject, then delete it (fix the cause first).
    Replay(DlqSeq),
    /// Delete one without replaying it.
    Discard(DlqSeq),
}

#[derive(Debug, Args)]
pub struct DlqSeq {
    /// Its sequence in SECKILL_DLQ, as `dlq list` prints it.
    #[arg(long)]
    pub seq: u64,
}

#[derive(Debug, Subcommand)]
pub enum StuckCommand {
    /// The SKU's stuck reservations, oldest first, as JSON.
    List(SkuArgs),
    /// Resolve one: republish its message, or (once it expired) compensate it.
    Resolve(ResolveArgs),
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("action").required(true).args(["republish", "compensate"])))]
pub struct ResolveArgs {
    #[command(flatten)]
    pub sku: SkuArgs,
    /// Reservation id (`resv_...`), as `stuck list` prints it.
    #[arg(long)]
    pub reservation: String,
    /// Send its order-create message to the log again (always allowed; the order-writer
    /// decides).
    #[arg(long)]
    pub republish: bool,
    /// Record the order-writer's "expired" verdict now and return the unit (refused before
    /// the reservation expired).
    #[arg(long)]
    pub compensate: bool,
}

#[derive(Debug, Args)]
pub struct ModeArgs {
    /// Print the global scope's effective mode and its snapshot instead of setting one.
    #[arg(long, conflicts_with_all = ["mode", "version"])]
    pub show: bool,
    /// NORMAL, SHED_LOAD, SUBMIT_CLOSED, QUERY_ONLY or RECOVERING.
    #[arg(long, required_unless_present = "show")]
    pub mode: Option<String>,
    /// Share admitted by SHED_LOAD / RECOVERING, in percent.
    #[arg(long)]
    pub admit_percent: Option<u8>,
    /// `global`, `activity:A` or `sku:A:S`.
    #[arg(long, default_value = "global")]
    pub scope: String,
    /// Strictly above the scope's current version (every instance refuses older ones).
    #[arg(long, required_unless_present = "show")]
    pub version: Option<u64>,
    /// Lifetime: past it the scope closes submissions until a newer snapshot arrives, so the
    /// control plane must refresh it.
    #[arg(long, default_value_t = 300)]
    pub ttl_s: u64,
    /// Who issues it (`[A-Za-z0-9_.@:-]`, logged by every instance).
    #[arg(long, default_value = "flashsale-admin")]
    pub issuer: String,
}

#[derive(Debug, Args)]
pub struct SkuArgs {
    /// Activity id.
    #[arg(long)]
    pub activity: u64,
    /// SKU id.
    #[arg(long)]
    pub sku: u64,
}

#[derive(Debug, Args)]
pub struct CreateActivityArgs {
    /// Activity id.
    #[arg(long)]
    pub activity: u64,
    /// SKU id.
    #[arg(long)]
    pub sku: u64,
    /// Units (inventory tokens) of the SKU.
    #[arg(long)]
    pub stock: u64,
    /// Window start, ms since the epoch (default: open now).
    #[arg(long)]
    pub start_at_ms: Option<u64>,
    /// Window end, ms since the epoch.
    #[arg(long)]
    pub end_at_ms: Option<u64>,
    /// How long a reservation may wait for its order (default 5 min).
    #[arg(long)]
    pub reservation_ttl_ms: Option<u64>,
    /// How long an order may wait for its payment (default 15 min).
    #[arg(long)]
    pub pay_timeout_ms: Option<u64>,
    /// TOKEN (inventory tokens, the default) or ROW (one counter row).
    #[arg(long)]
    pub allocator: Option<String>,
    /// The unit price in cents: an order's amount, checked against each PAID callback.
    #[arg(long)]
    pub price_cents: Option<u64>,
}

/// Parses `admin ...`-style arguments (the first item is the program name) exactly as the
/// binary does; for tests and embedding.
pub fn parse_from<I, T>(args: I) -> Result<AdminArgs, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    #[derive(Parser)]
    struct Wrapper {
        #[command(flatten)]
        args: AdminArgs,
    }
    Wrapper::try_parse_from(args).map(|w| w.args)
}

/// Runs one admin call, writing its answer to `out`; returns the exit status (0 ok, 1 the
/// call answered "not ok"). Errors (engine unreachable, refused) are exit status 1 in `main`.
pub fn run(args: AdminArgs, env: &Env, out: &mut dyn Write) -> anyhow::Result<u8> {
    let pg_url = match &args.command {
        AdminCommand::Payments(PaymentsCommand::Reconcile(s)) => s.pg_url.clone(),
        AdminCommand::Backup(b) => b.pg_url.clone(),
        _ => None,
    };
    let overrides =
        Overrides { admin_addr: args.admin_addr.clone(), pg_url, ..Overrides::default() };
    let config = Config::load(args.config.as_deref(), env, &overrides, &args.stack_dir)?;
    let client = AdminClient {
        addr: crate::app::serve::loopback(config.admin_addr),
        token: args.token.clone().or(config.admin_token),
        timeout: Duration::from_secs(args.timeout_s.max(1)),
    };
    let status = match &args.command {
        AdminCommand::Reconcile(sku) => reconcile(&client, sku, out)?,
        AdminCommand::CreateActivity(create) => create_activity(&client, create, out)?,
        AdminCommand::Mode(mode_args) => {
            mode(&client, mode_args, config.control_key.as_deref(), out)?
        }
        AdminCommand::Refunds => refunds(&client, out)?,
        AdminCommand::Payments(PaymentsCommand::Unknown) => {
            print_listing(&client, "/admin/v1/payments/unknown", "PAYMENT_UNKNOWN orders", out)?
        }
        AdminCommand::Payments(PaymentsCommand::Reconcile(s)) => {
            use flashsale_pg_worker::payment_reconcile::ReconcileMode;
            let mode = if s.apply { ReconcileMode::Apply } else { ReconcileMode::Report };
            crate::app::payments_cli::reconcile(&config.pg_url, &s.statement, mode, out)?
        }
        AdminCommand::Stuck(StuckCommand::List(sku)) => stuck_list(&client, sku, out)?,
        AdminCommand::Stuck(StuckCommand::Resolve(resolve)) => {
            stuck_resolve(&client, resolve, out)?
        }
        AdminCommand::Activity(command) => activity(&client, command, out)?,
        AdminCommand::Dlq(DlqCommand::List { after }) => dlq_list(&client, *after, out)?,
        AdminCommand::Dlq(DlqCommand::Replay(seq)) => dlq_act(&client, seq.seq, "replay", out)?,
        AdminCommand::Dlq(DlqCommand::Discard(seq)) => dlq_act(&client, seq.seq, "discard", out)?,
        AdminCommand::Backup(b) => crate::app::backup::backup(b, &config.pg_url, out)?,
        AdminCommand::RestoreDrill(d) => crate::app::backup::restore_drill(d, out)?,
    };
    out.flush()?;
    Ok(status)
}

fn reconcile(client: &AdminClient, sku: &SkuArgs, out: &mut dyn Write) -> anyhow::Result<u8> {
    let path = format!("/admin/v1/activities/{}/skus/{}/reconcile", sku.activity, sku.sku);
    let answer = client.get_json(&path)?;
    writeln!(out, "{}", serde_json::to_string_pretty(&answer.body)?)?;
    // 404 still carries a report (PostgreSQL does not know the SKU): not ok.
    if answer.status != 200 && answer.status != 404 {
        bail!("the engine answered {} to {path}", answer.status);
    }
    Ok(if answer.body["ok"] == Value::Bool(true) { 0 } else { 1 })
}

fn refunds(client: &AdminClient, out: &mut dyn Write) -> anyhow::Result<u8> {
    print_listing(client, "/admin/v1/refunds", "refunds", out)
}

/// `GET path`, printed; exit 0 on 200, an error naming `what` otherwise.
fn print_listing(
    client: &AdminClient,
    path: &str,
    what: &str,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let answer = client.get_json(path)?;
    writeln!(out, "{}", serde_json::to_string_pretty(&answer.body)?)?;
    if answer.status != 200 {
        bail!("the engine could not list {what} ({})", answer.status);
    }
    Ok(0)
}

fn stuck_list(client: &AdminClient, sku: &SkuArgs, out: &mut dyn Write) -> anyhow::Result<u8> {
    let path = format!("/admin/v1/activities/{}/skus/{}/stuck", sku.activity, sku.sku);
    print_listing(client, &path, "stuck reservations", out)
}

fn stuck_resolve(
    client: &AdminClient,
    args: &ResolveArgs,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let path = format!(
        "/admin/v1/activities/{}/skus/{}/stuck/{}",
        args.sku.activity, args.sku.sku, args.reservation
    );
    let action = if args.compensate { "compensate" } else { "republish" };
    let answer = client.post_json(&path, &json!({ "action": action }))?;
    writeln!(out, "{}", serde_json::to_string_pretty(&answer.body)?)?;
    Ok(if answer.status == 202 { 0 } else { 1 })
}

fn activity(
    client: &AdminClient,
    command: &ActivityCommand,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let scope_path = |scope: &ScopeArgs, what: &str| match scope.sku {
        Some(sku) => format!("/admin/v1/activities/{}/skus/{sku}/{what}", scope.activity),
        None => format!("/admin/v1/activities/{}/{what}", scope.activity),
    };
    let (path, body) = match command {
        ActivityCommand::AddSku(a) => {
            let mut body = json!({"sku_id": a.sku.sku, "stock": a.stock, "actor": a.actor});
            if let Some(allocator) = &a.allocator {
                body["allocator"] = json!(allocator);
            }
            (format!("/admin/v1/activities/{}/skus", a.sku.activity), body)
        }
        ActivityCommand::End(scope) => (scope_path(scope, "end"), json!({"actor": scope.actor})),
        ActivityCommand::Terminate(scope) => {
            (scope_path(scope, "terminate"), json!({"actor": scope.actor}))
        }
        ActivityCommand::TopUp(t) => {
            let request_id = t
                .request_id
                .clone()
                .unwrap_or_else(|| format!("topup-{}", crate::logic::clock::now_ms()));
            (
                format!("/admin/v1/activities/{}/skus/{}/stock", t.sku.activity, t.sku.sku),
                json!({"add": t.add, "request_id": request_id, "actor": t.actor}),
            )
        }
        ActivityCommand::ReleasePolicy(p) => (
            format!("/admin/v1/activities/{}/release-policy", p.activity),
            json!({"release_policy": p.policy, "actor": p.actor}),
        ),
    };
    let answer = client.post_json(&path, &body)?;
    let mut printed = answer.body.clone();
    if let (ActivityCommand::TopUp(_), Some(map)) = (command, printed.as_object_mut()) {
        map.insert("request_id".into(), body["request_id"].clone());
    }
    writeln!(out, "{}", serde_json::to_string_pretty(&printed)?)?;
    Ok(if matches!(answer.status, 200 | 201) { 0 } else { 1 })
}

fn dlq_list(client: &AdminClient, after: u64, out: &mut dyn Write) -> anyhow::Result<u8> {
    print_listing(client, &format!("/admin/v1/dlq?after={after}"), "dead letters", out)
}

fn dlq_act(
    client: &AdminClient,
    seq: u64,
    action: &str,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let answer = client.post_json(&format!("/admin/v1/dlq/{seq}"), &json!({ "action": action }))?;
    writeln!(out, "{}", serde_json::to_string_pretty(&answer.body)?)?;
    Ok(if matches!(answer.status, 200 | 202) { 0 } else { 1 })
}

fn create_activity(
    client: &AdminClient,
    args: &CreateActivityArgs,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let mut body = json!({"activity_id": args.activity, "sku_id": args.sku, "stock": args.stock});
    let optional = [
        ("start_at_ms", args.start_at_ms.map(Value::from)),
        ("end_at_ms", args.end_at_ms.map(Value::from)),
        ("reservation_ttl_ms", args.reservation_ttl_ms.map(Value::from)),
        ("pay_timeout_ms", args.pay_timeout_ms.map(Value::from)),
        ("allocator", args.allocator.clone().map(Value::from)),
        ("price_cents", args.price_cents.map(Value::from)),
    ];
    for (name, value) in optional {
        if let Some(value) = value {
            body[name] = value;
        }
    }
    let answer = client.post_json("/admin/v1/activities", &body)?;
    writeln!(out, "{}", serde_json::to_string_pretty(&answer.body)?)?;
    if answer.status != 200 && answer.status != 201 {
        bail!("the engine refused the activity ({})", answer.status);
    }
    Ok(0)
}

fn mode(
    client: &AdminClient,
    args: &ModeArgs,
    control_key: Option<&str>,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    use crate::logic::modes::{sign, Mode, ModeSnapshot, Scope};
    if args.show {
        let answer = client.get_json("/admin/v1/mode")?;
        writeln!(out, "{}", serde_json::to_string_pretty(&answer.body)?)?;
        return Ok(if answer.status == 200 { 0 } else { 1 });
    }
    let key = control_key.context("FLASHSALE_CONTROL_KEY is not set: cannot sign a mode")?;
    let key = crate::logic::modes::control_key(key).map_err(|e| anyhow::anyhow!("{e}"))?;
    let name = args.mode.as_deref().unwrap_or_default();
    let mode = Mode::from_parts(name, args.admit_percent).map_err(|e| anyhow::anyhow!("{e}"))?;
    let scope = Scope::parse(&args.scope)
        .with_context(|| format!("--scope {:?}: global, activity:A or sku:A:S", args.scope))?;
    let now_ms = crate::logic::clock::now_ms();
    let snapshot = ModeSnapshot {
        version: args.version.unwrap_or_default(),
        scope,
        mode,
        issued_at_ms: now_ms,
        expires_at_ms: now_ms.saturating_add(args.ttl_s.saturating_mul(1000)),
        issuer: args.issuer.clone(),
    };
    let signed = sign(&key, snapshot).map_err(|e| anyhow::anyhow!("{e}"))?;
    let body: Value = serde_json::from_str(&signed.to_json())?;
    let answer = client.post_json("/admin/v1/mode", &body)?;
    writeln!(out, "{}", serde_json::to_string_pretty(&answer.body)?)?;
    if answer.status != 200 {
        bail!("the engine refused the mode ({})", answer.status);
    }
    Ok(0)
}

/// One answer of the admin API.
#[derive(Debug, Clone, PartialEq)]
pub struct AdminResponse {
    pub status: u16,
    /// The JSON body (`Value::Null` when empty).
    pub body: Value,
}

/// A blocking client of the admin API: one request per connection.
#[derive(Debug, Clone)]
pub struct AdminClient {
    pub addr: SocketAddr,
    pub token: Option<String>,
    /// Bound on connecting, and on each read and write.
    pub timeout: Duration,
}

impl AdminClient {
    pub fn get_json(&self, path: &str) -> anyhow::Result<AdminResponse> {
        self.request("GET", path, None)
    }

    pub fn post_json(&self, path: &str, body: &Value) -> anyhow::Result<AdminResponse> {
        self.request("POST", path, Some(&body.to_string()))
    }

    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> anyhow::Result<AdminResponse> {
        let mut stream = TcpStream::connect_timeout(&self.addr, self.timeout)
            .with_context(|| format!("connect to the admin API at {}", self.addr))?;
        stream.set_read_timeout(Some(self.timeout))?;
        stream.set_write_timeout(Some(self.timeout))?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nAccept: application/json\r\n",
            self.addr
        );
        if let Some(token) = &self.token {
            head.push_str(&format!("Authorization: Bearer {token}\r\n"));
        }
        let body = body.unwrap_or("");
        if method == "POST" {
            head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            ));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes())?;
        stream.write_all(body.as_bytes())?;
        let (status, bytes) = read_response(&mut stream)
            .with_context(|| format!("read the answer to {method} {path}"))?;
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).with_context(|| {
                format!("{method} {path} answered {status} with a non-JSON body")
            })?
        };
        Ok(AdminResponse { status, body })
    }
}

/// Reads one `Content-Length` response: (status, body).
fn read_response(stream: &mut impl Read) -> anyhow::Result<(u16, Vec<u8>)> {
    let mut buf = Vec::with_capacity(16 * 1024);
    let mut chunk = [0u8; 16 * 1024];
    let head_end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        if buf.len() > 64 * 1024 {
            bail!("response head over 64 KiB");
        }
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            bail!("connection closed before the response head");
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end]).context("response head is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|code| code.parse().ok())
        .context("no status line")?;
    let length: usize = lines
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, value)| value.trim().parse().ok())
        .context("response without Content-Length")?;
    if length > RESPONSE_BYTES_MAX {
        bail!("response body of {length} bytes over the {RESPONSE_BYTES_MAX}-byte bound");
    }
    let mut body = buf.split_off(head_end + 4);
    while body.len() < length {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            bail!("connection closed after {} of {length} body bytes", body.len());
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_command_lines() {
        let args = parse_from(["admin", "reconcile", "--activity", "1", "--sku", "2"]).unwrap();
        assert!(matches!(args.command, AdminCommand::Reconcile(SkuArgs { activity: 1, sku: 2 })));
        assert_eq!(args.admin_addr, None);
        let args = parse_from([
            "admin",
            "reconcile",
            "--activity",
            "1",
            "--sku",
            "2",
            "--admin-addr",
            "127.0.0.1:9",
            "--token",
            "t",
        ])
        .unwrap();
        assert_eq!(args.admin_addr.as_deref(), Some("127.0.0.1:9"));
        assert_eq!(args.token.as_deref(), Some("t"));
        let args = parse_from([
            "admin",
            "create-activity",
            "--activity",
            "1",
            "--sku",
            "2",
            "--stock",
            "10",
            "--allocator",
            "ROW",
        ])
        .unwrap();
        match args.command {
            AdminCommand::CreateActivity(c) => {
                assert_eq!((c.activity, c.sku, c.stock), (1, 2, 10));
                assert_eq!(c.allocator.as_deref(), Some("ROW"));
            }
            other => panic!("{other:?}"),
        }
        assert!(parse_from(["admin", "reconcile", "--activity", "1"]).is_err());

        let resolve = ["admin", "stuck", "resolve", "--activity", "1", "--sku", "2"];
        let args =
            parse_from(resolve.iter().chain(&["--reservation", "resv_1", "--compensate"])).unwrap();
        match args.command {
            AdminCommand::Stuck(StuckCommand::Resolve(r)) => {
                assert_eq!((r.sku.activity, r.sku.sku, r.reservation.as_str()), (1, 2, "resv_1"));
                assert!(r.compensate && !r.republish);
            }
            other => panic!("{other:?}"),
        }
        // Exactly one action.
        assert!(parse_from(resolve.iter().chain(&["--reservation", "resv_1"])).is_err());
        let both = ["--reservation", "resv_1", "--republish", "--compensate"];
        assert!(parse_from(resolve.iter().chain(&both)).is_err());
        let list = ["admin", "stuck", "list", "--activity", "1", "--sku", "2"];
        assert!(matches!(
            parse_from(list).unwrap().command,
            AdminCommand::Stuck(StuckCommand::List(SkuArgs { activity: 1, sku: 2 }))
        ));
        assert!(matches!(
            parse_from(["admin", "dlq", "replay", "--seq", "7"]).unwrap().command,
            AdminCommand::Dlq(DlqCommand::Replay(DlqSeq { seq: 7 }))
        ));
        assert!(matches!(
            parse_from(["admin", "dlq", "list"]).unwrap().command,
            AdminCommand::Dlq(DlqCommand::List { after: 0 })
        ));
        assert!(parse_from(["admin", "dlq", "discard"]).is_err(), "--seq is required");
    }

    #[test]
    fn reads_a_content_length_response_in_pieces() {
        let raw = b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\ncontent-type: application/json\r\n\r\n{\"ok\":true}";
        struct Trickle<'a>(&'a [u8]);
        impl Read for Trickle<'_> {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                let n = self.0.len().min(3).min(buf.len());
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let (status, body) = read_response(&mut Trickle(raw)).unwrap();
        assert_eq!((status, body.as_slice()), (200, &b"{\"ok\":true}"[..]));
        let cut = &raw[..raw.len() - 2];
        assert!(read_response(&mut Trickle(cut)).is_err(), "a short body is an error");
        assert!(read_response(&mut Trickle(b"HTTP/1.1 200 OK\r\n\r\n")).is_err());
    }

    #[test]
    fn wildcard_addresses_are_reached_on_loopback() {
        assert_eq!(
            crate::app::serve::loopback("0.0.0.0:9090".parse().unwrap()),
            "127.0.0.1:9090".parse().unwrap()
        );
        assert_eq!(
            crate::app::serve::loopback("10.0.0.1:1".parse().unwrap()),
            "10.0.0.1:1".parse().unwrap()
        );
    }
}
