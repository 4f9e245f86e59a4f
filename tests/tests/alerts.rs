//! The operators' side of the metrics: `tuning/prometheus/alerts.yml` (alerting rules),
//! `tuning/prometheus/alerts_test.yml` (their promtool unit tests) and
//! `tuning/grafana/flashsale.json` (the dashboard), checked against the real tools and a real
//! engine (private Redis, NATS and PostgreSQL, as everywhere in this crate).
//!
//! - `promtool_checks_and_unit_tests_every_rule`: `promtool check rules` and `promtool test
//!   rules` pass; every rule has a severity, a summary and a runbook anchor, and the unit tests
//!   cover every rule both firing and not firing.
//! - `every_metric_name_in_the_rules_and_the_dashboard_is_exported`: every `flashsale_*` name
//!   in a rule's or a panel's expression is on a running engine's `/metrics` (the worker
//!   in-process, after a small sale) or is one of the worker's and log client's `metrics::`
//!   names (those appear only once their event happened, e.g. a dead letter).
//! - `the_conservation_alert_fires_in_a_real_prometheus`: a private `prometheus` scrapes the
//!   engine every second and evaluates the real rules file, in which only the conservation
//!   rule's `for` is shortened (1m → 3s: the engine's reconcile runs every 500 ms here instead
//!   of 30 s); the alert is absent while the sale is clean, and pending then firing once a sold
//!   token is forced back to AVAILABLE in PostgreSQL. The same Prometheus also parses every
//!   dashboard expression.
//!
//! promtool and prometheus come from the Debian package `prometheus`, which `./run` installs;
//! a missing binary fails these tests with that message rather than skipping them.

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use flashsale_tests::{prometheus_render, small_worker, state, wait_for_ms, Engine, HttpClient};
use serde_json::Value;

const CONSERVATION_ALERT: &str = "FlashsaleInventoryConservationGap";
const MISSING_PACKAGE: &str =
    "./run installs the Debian package `prometheus` (apt-get install prometheus)";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn rules_text() -> String {
    std::fs::read_to_string(repo().join("tuning/prometheus/alerts.yml")).unwrap()
}

// ---- the rules file, read as text (one line per key, as alerts.yml is written) -------------

#[derive(Debug, Default)]
struct Rule {
    alert: String,
    expr: String,
    for_: Option<String>,
    severity: Option<String>,
    summary: Option<String>,
    runbook: Option<String>,
}

fn parse_rules(text: &str) -> Vec<Rule> {
    let mut rules: Vec<Rule> = Vec::new();
    for line in text.lines() {
        let t = line.trim();
        if let Some(name) = t.strip_prefix("- alert: ") {
            rules.push(Rule { alert: name.to_owned(), ..Rule::default() });
            continue;
        }
        let Some(rule) = rules.last_mut() else { continue };
        let value = |key: &str| t.strip_prefix(key).map(|v| v.trim_matches('"').to_owned());
        if let Some(v) = value("expr: ") {
            assert!(!v.starts_with(['|', '>']), "{}: write its expr on one line", rule.alert);
            rule.expr = v;
        } else if let Some(v) = value("for: ") {
            rule.for_ = Some(v);
        } else if let Some(v) = value("severity: ") {
            rule.severity = Some(v);
        } else if let Some(v) = value("summary: ") {
            rule.summary = Some(v);
        } else if let Some(v) = value("runbook: ") {
            rule.runbook = Some(v);
        }
    }
    rules
}

/// The rules file with one alert's `for` replaced; returns it and the `for` it had.
fn with_for(text: &str, alert: &str, new_for: &str) -> (String, String) {
    let (mut out, mut inside, mut old) = (String::new(), false, Vec::new());
    for line in text.lines() {
        let t = line.trim_start();
        if let Some(name) = t.strip_prefix("- alert: ") {
            inside = name == alert;
        }
        match t.strip_prefix("for: ") {
            Some(v) if inside => {
                old.push(v.to_owned());
                out.push_str(&line[..line.len() - t.len()]);
                out.push_str("for: ");
                out.push_str(new_for);
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    assert_eq!(old.len(), 1, "{alert} has exactly one `for`");
    (out, old.remove(0))
}

fn promtool(args: &[&str], dir: &Path) -> (bool, String) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("promtool cannot run ({e}): {MISSING_PACKAGE}"));
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn promtool_checks_and_unit_tests_every_rule() {
    let dir = repo().join("tuning/prometheus");
    let rules = parse_rules(&rules_text());
    assert!(rules.len() >= 10, "{rules:?}");

    let (ok, out) = promtool(&["check", "rules", "alerts.yml"], &dir);
    assert!(ok, "promtool check rules failed:\n{out}");
    assert!(out.contains(&format!("SUCCESS: {} rules found", rules.len())), "{out}");
    let started = Instant::now();
    let (ok, out) = promtool(&["test", "rules", "alerts_test.yml"], &dir);
    assert!(ok, "promtool test rules failed:\n{out}");
    println!("promtool test rules: {} rules, {:?}", rules.len(), started.elapsed());

    let readme = std::fs::read_to_string(repo().join("README.md")).expect("README.md");
    for rule in &rules {
        let name = &rule.alert;
        assert!(!rule.expr.is_empty(), "{name}: no expr");
        assert!(
            matches!(rule.severity.as_deref(), Some("critical" | "warning")),
            "{name}: severity {:?}",
            rule.severity
        );
        assert!(rule.summary.as_deref().is_some_and(|s| !s.is_empty()), "{name}: no summary");
        let anchor = format!("README.md#{}", name.to_lowercase());
        assert_eq!(rule.runbook.as_deref(), Some(anchor.as_str()), "{name}: runbook");
        // The anchor resolves: README.md has the rule's own runbook heading.
        assert!(readme.lines().any(|l| l == format!("#### {name}")), "README.md: no '#### {name}'");
    }

    // Every rule is tested firing (a non-empty exp_alerts) and quiet (`exp_alerts: []`).
    let tests = std::fs::read_to_string(dir.join("alerts_test.yml")).unwrap();
    let (mut firing, mut quiet, mut current) = (BTreeSet::new(), BTreeSet::new(), String::new());
    for line in tests.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("alertname: ") {
            current = name.to_owned();
        } else if line == "exp_alerts: []" {
            quiet.insert(current.clone());
        } else if line == "exp_alerts:" {
            firing.insert(current.clone());
        }
    }
    let names: BTreeSet<String> = rules.iter().map(|r| r.alert.clone()).collect();
    for name in &names {
        assert!(firing.contains(name), "{name}: no unit test where it fires");
        assert!(quiet.contains(name), "{name}: no unit test where it does not fire");
    }
    let stale: Vec<_> = firing.union(&quiet).filter(|n| !names.contains(*n)).collect();
    assert!(stale.is_empty(), "unit tests of alerts that do not exist: {stale:?}");
}

// ---- metric names ---------------------------------------------------------------------------

/// The `flashsale_*` metric names in a PromQL expression (quoted strings and Grafana's
/// `$variables` skipped).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let b = expr.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let (mut names, mut i) = (BTreeSet::new(), 0);
    while i < b.len() {
        match b[i] {
            q @ (b'"' | b'\'') => {
                i += 1;
                while i < b.len() && b[i] != q {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            c if ident(c) || c == b'$' => {
                let start = i;
                i += 1;
                while i < b.len() && ident(b[i]) {
                    i += 1;
                }
                let word = &expr[start..i];
                if word.starts_with("flashsale_") {
                    names.insert(word.to_owned());
                }
            }
            _ => i += 1,
        }
    }
    names
}

#[test]
fn metric_names_are_read_out_of_expressions() {
    let expr = r#"sum(rate(flashsale_a_total{state="flashsale_not_a_name",i=~"$instance"}[$__rate_interval])) / clamp_min(flashsale_b:c, 1e-9) > $flashsale_var"#;
    let names: Vec<String> = metric_names(expr).into_iter().collect();
    assert_eq!(names, ["flashsale_a_total", "flashsale_b:c"]);
}

fn dashboard() -> Value {
    let text = std::fs::read_to_string(repo().join("tuning/grafana/flashsale.json")).unwrap();
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every query of the dashboard: panels' `expr`s and the template variables' queries.
fn dashboard_queries(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr" | "definition", Value::String(s)) => out.push(s.clone()),
                    ("query", Value::String(s)) if s.contains("flashsale_") => out.push(s.clone()),
                    _ => dashboard_queries(value, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|item| dashboard_queries(item, out)),
        _ => {}
    }
}

/// The sample names of a Prometheus text exposition.
fn exposition_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// The names given to `metrics::counter!`/`gauge!`/`histogram!` under `dir` (a histogram is
/// rendered by metrics-exporter-prometheus as a summary: NAME{quantile}, NAME_sum, NAME_count).
fn source_names(dir: &Path, out: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            source_names(&path, out);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (kind, suffixes) in [
            ("counter", &[""][..]),
            ("gauge", &[""][..]),
            ("histogram", &["", "_sum", "_count"][..]),
        ] {
            let call = format!("metrics::{kind}!(");
            for (at, _) in text.match_indices(&call) {
                let rest = text[at + call.len()..].trim_start();
                let Some(name) = rest.strip_prefix('"').and_then(|r| r.split('"').next()) else {
                    continue;
                };
                for suffix in suffixes {
                    out.insert(format!("{name}{suffix}"));
                }
            }
        }
    }
}

fn pg_i64(engine: &Engine, sql: &str) -> i64 {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let (client, conn) =
            tokio_postgres::connect(&engine.db.url, tokio_postgres::NoTls).await.unwrap();
        let driver = tokio::spawn(conn);
        let value = client.query_one(sql, &[]).await.unwrap().get::<_, i64>(0);
        drop(client);
        let _ = driver.await;
        value
    })
}

/// Buyers 1..=buyers submit once each on a SKU of `stock` units; waits for the orders.
fn small_sale(engine: &Engine, activity: u64, sku: u64, stock: u64, buyers: u64) {
    engine.create_activity(activity, sku, stock);
    let mut c = HttpClient::connect(engine.http());
    for user in 1..=buyers {
        let (_, v) = engine.submit(&mut c, user, activity, sku, &format!("req-{user}"));
        assert!(matches!(state(&v), "QUEUED" | "QUEUED_PENDING" | "SOLD_OUT"), "{v}");
    }
    let orders = stock.min(buyers) as i64;
    let sql = format!("SELECT count(*) FROM orders WHERE activity_id = {activity}");
    wait_for_ms("the sale's orders in PostgreSQL", 30_000, || pg_i64(engine, &sql) == orders);
}

/// Names rendered only when a Redis master has replicas or PostgreSQL has standbys.
const ONLY_WITH_REPLICAS: [&str; 3] = [
    "flashsale_redis_replica_offset_lag_bytes",
    "flashsale_pg_replication_lag_seconds",
    "flashsale_pg_replication_lag_bytes",
];

/// The per-SKU funnel as this file's engines count it: SKU 31:32 marked hot, one more slot.
fn hot_sku_funnel() -> flashsale_engine::logic::sku_funnel::SkuFunnelConfig {
    flashsale_engine::logic::sku_funnel::SkuFunnelConfig {
        hot: vec![flashsale_engine::logic::placement::SkuKey::new(31, 32)],
        series_max: 2,
        promote_min_events: 1,
    }
}

#[test]
fn every_metric_name_in_the_rules_and_the_dashboard_is_exported() {
    let engine = Engine::start_with(|c| {
        c.worker = Some(small_worker(c));
        c.render_extra = Some(prometheus_render());
        c.edge.reconcile.interval_ms = 300;
        c.edge.sku_funnel = hot_sku_funnel();
    });
    small_sale(&engine, 31, 32, 3, 5);
    the_funnel_per_sku_is_bounded(&engine);
    the_dependencies_are_sampled_from_the_real_servers(&engine);
    let mut scrape = String::new();
    wait_for_ms("the worker's metrics and a reconcile round on /metrics", 20_000, || {
        scrape = engine.metrics();
        scrape.contains("\nflashsale_order_create_latency_seconds_count ")
            && !scrape.contains("\nflashsale_reconcile_rounds_total 0\n")
    });
    // The worker's histograms are summaries on /metrics: the p99 rule and panel read a quantile.
    let p99 = "\nflashsale_order_create_latency_seconds{quantile=\"0.99\"} ";
    assert!(scrape.contains(p99), "{scrape}");
    let scraped = exposition_names(&scrape);
    let mut known = scraped.clone();
    for dir in ["pg-worker/src", "io/src", "engine/src"] {
        source_names(&repo().join(dir), &mut known);
    }

    let mut used: Vec<(String, String)> = Vec::new();
    for rule in parse_rules(&rules_text()) {
        used.extend(metric_names(&rule.expr).into_iter().map(|n| (n, rule.alert.clone())));
    }
    let mut queries = Vec::new();
    dashboard_queries(&dashboard(), &mut queries);
    assert!(queries.len() >= 20, "{queries:?}");
    for q in &queries {
        used.extend(metric_names(q).into_iter().map(|n| (n, "dashboard".to_owned())));
    }
    // Series that exist only beside replicas, which this single-server stack has none of (the
    // dependency samplers render them per replica: durable/dependencies.rs).
    known.extend(ONLY_WITH_REPLICAS.iter().map(|n| (*n).to_owned()));
    let missing: Vec<_> = used.iter().filter(|(n, _)| !known.contains(n)).collect();
    assert!(missing.is_empty(), "names that no engine exports: {missing:?}\nscrape:\n{scrape}");
    let distinct: BTreeSet<&String> = used.iter().map(|(n, _)| n).collect();
    let not_scraped: Vec<_> = distinct.iter().filter(|n| !scraped.contains(**n)).collect();
    println!(
        "{} distinct names in {} dashboard queries and the rules; {} on this scrape; \
         from the worker's source only (not yet incremented): {not_scraped:?}",
        distinct.len(),
        queries.len(),
        distinct.len() - not_scraped.len()
    );
}

/// The value of the exposition line that is exactly `series` (labels included), if any.
fn series_value(scrape: &str, series: &str) -> Option<f64> {
    scrape.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn funnel(scrape: &str, activity: &str, sku: &str, stage: &str) -> Option<f64> {
    let series = format!(
        "flashsale_sku_funnel_total{{activity_id=\"{activity}\",sku_id=\"{sku}\",stage=\"{stage}\"}}"
    );
    series_value(scrape, &series)
}

/// Issue 28 item 1 against a real engine: the hot SKU has its series from the start, the next
/// SKU by traffic takes the one free slot at a scrape, a third SKU is only in the aggregate, and
/// nothing is lost between them.
fn the_funnel_per_sku_is_bounded(engine: &Engine) {
    wait_for_ms("the hot SKU's orders in its funnel", 30_000, || {
        funnel(&engine.metrics(), "31", "32", "orders") == Some(3.0)
    });
    let scrape = engine.metrics();
    assert_eq!(funnel(&scrape, "31", "32", "reserved"), Some(3.0), "{scrape}");
    // Five buyers for three units: five attempts, two sold out.
    assert_eq!(funnel(&scrape, "31", "32", "attempts"), Some(5.0), "{scrape}");
    assert_eq!(funnel(&scrape, "31", "32", "sold_out"), Some(2.0), "{scrape}");
    small_sale(engine, 33, 34, 2, 2);
    // This scrape promotes 33:34 (the heaviest candidate since the last one) into the last slot.
    assert!(engine.metrics().contains("\nflashsale_sku_series 2\n"));
    small_sale(engine, 35, 36, 2, 2);
    let mut scrape = String::new();
    wait_for_ms("every order counted in the funnel", 30_000, || {
        scrape = engine.metrics();
        let orders: f64 = scrape
            .lines()
            .filter(|l| l.starts_with("flashsale_sku_funnel_total{") && l.contains("\"orders\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        orders == 7.0
    });
    let pairs: BTreeSet<&str> = scrape
        .lines()
        .filter_map(|l| l.strip_prefix("flashsale_sku_funnel_total{")?.split(",stage=").next())
        .collect();
    assert_eq!(pairs.len(), 3, "two slots and the aggregate: {pairs:?}");
    assert!(funnel(&scrape, "35", "36", "reserved").is_none(), "no slot left: {scrape}");
    assert!(funnel(&scrape, "other", "other", "reserved").is_some_and(|n| n >= 2.0), "{scrape}");
    let reserved: f64 = ["31:32", "33:34", "other:other"]
        .iter()
        .filter_map(|p| {
            let (a, s) = p.split_once(':').unwrap();
            funnel(&scrape, a, s, "reserved")
        })
        .sum();
    assert_eq!(reserved, 7.0, "every reservation in exactly one series: {scrape}");
    println!("funnel series: {pairs:?}");
}

/// Issue 28 items 2 and 3 against the real servers: every sampler answered, a Redis setting
/// changed on the server shows up in its gauge within a sample, the log's limits and the
/// drain estimate are there, and `/readyz` carries the backlog detail.
fn the_dependencies_are_sampled_from_the_real_servers(engine: &Engine) {
    let up = |d: &str| format!("flashsale_dependency_up{{dependency=\"{d}\"}}");
    wait_for_ms("every dependency sampled", 20_000, || {
        let scrape = engine.metrics();
        ["redis", "postgres", "log"].iter().all(|d| series_value(&scrape, &up(d)) == Some(1.0))
    });
    let node = format!("{{node=\"{}\"}}", engine.redis.addr());
    let maxmemory = format!("flashsale_redis_maxmemory_bytes{node}");
    let _ = flashsale_tests::redis_cmd(&engine.redis, &["CONFIG", "SET", "maxmemory", "987654321"]);
    let started = Instant::now();
    wait_for_ms("the new maxmemory sampled", 20_000, || {
        series_value(&engine.metrics(), &maxmemory) == Some(987_654_321.0)
    });
    println!("a Redis setting reached its gauge after {:?} (sampled every 5 s)", started.elapsed());
    let _ = flashsale_tests::redis_cmd(&engine.redis, &["CONFIG", "SET", "maxmemory", "0"]);
    let scrape = engine.metrics();
    let used = series_value(&scrape, &format!("flashsale_redis_used_memory_bytes{node}"));
    assert!(used.is_some_and(|b| b > 0.0), "{scrape}");
    assert_eq!(
        series_value(&scrape, &format!("flashsale_redis_evicted_keys_total{node}")),
        Some(0.0)
    );
    assert_eq!(series_value(&scrape, "flashsale_pg_sync_standbys_required"), Some(0.0));
    assert!(series_value(&scrape, "flashsale_pg_max_connections").is_some_and(|n| n >= 10.0));
    assert!(series_value(&scrape, "flashsale_pg_connections").is_some_and(|n| n >= 1.0));
    let orders = "{stream=\"SECKILL_ORDERS\"}";
    let limit = series_value(&scrape, &format!("flashsale_log_stream_max_bytes{orders}"));
    assert_eq!(limit, Some((1u64 << 30) as f64), "{scrape}");
    assert!(series_value(&scrape, &format!("flashsale_log_stream_bytes{orders}")).is_some());
    let pending =
        "flashsale_log_consumer_pending{stream=\"SECKILL_ORDERS\",consumer=\"order-writer\"}";
    assert_eq!(series_value(&scrape, pending), Some(0.0), "{scrape}");
    // Drained: the estimate is 0 (empty), and /readyz says so.
    wait_for_ms("the drained backlog's estimate", 20_000, || {
        series_value(&engine.metrics(), "flashsale_backlog_drain_seconds") == Some(0.0)
    });
    let (status, body) = http_get(engine.admin(), "/readyz").expect("readyz");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((status, v["backlog"]["drain"].as_str()), (200, Some("empty")), "{body}");
    assert_eq!(v["backlog"]["drain_seconds"].as_f64(), Some(0.0), "{body}");
}

// ---- a real Prometheus -------------------------------------------------------------------

/// A private Prometheus on a free loopback port, its configuration, rules and TSDB in a
/// temporary directory; killed on drop.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(target: SocketAddr, rules: &str) -> Prometheus {
        let dir = tempfile::Builder::new().prefix("flashsale-test-prometheus-").tempdir().unwrap();
        let rules_path = dir.path().join("alerts.yml");
        std::fs::write(&rules_path, rules).unwrap();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {}\n\
             scrape_configs:\n  - job_name: flashsale\n    static_configs:\n      - targets: [\"{target}\"]\n",
            rules_path.display()
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap();
        // A port that was free a moment ago; if it was taken since, the wait below says so.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("prometheus cannot run ({e}): {MISSING_PACKAGE}"));
        let mut prometheus = Prometheus { child, addr, dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while http_get(addr, "/-/ready").map(|(status, _)| status) != Some(200) {
            if let Ok(Some(status)) = prometheus.child.try_wait() {
                panic!("prometheus exited ({status}): {}", prometheus.log());
            }
            assert!(Instant::now() < deadline, "prometheus not ready: {}", prometheus.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        prometheus
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// `GET path` of the HTTP API: its `data`, or the error body.
    fn api(&self, path: &str) -> Result<Value, String> {
        let (status, body) = http_get(self.addr, path).ok_or("prometheus unreachable")?;
        let v: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        match (status, v["status"].as_str()) {
            (200, Some("success")) => Ok(v["data"].clone()),
            _ => Err(format!("{status} {body}")),
        }
    }

    /// An instant query's result vector.
    fn query(&self, promql: &str) -> Result<Vec<Value>, String> {
        let data = self.api(&format!("/api/v1/query?query={}", urlencode(promql)))?;
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// The first sample value of an instant query (None: empty result).
    fn value(&self, promql: &str) -> Option<f64> {
        let result = self.query(promql).unwrap_or_else(|e| panic!("{promql}: {e}"));
        result.first().and_then(|s| s["value"][1].as_str()).and_then(|v| v.parse().ok())
    }

    /// The loaded alerting rule named `name` (`Null` when there is none).
    fn rule(&self, name: &str) -> Value {
        let data = self.api("/api/v1/rules").unwrap();
        let groups = data["groups"].as_array().cloned().unwrap_or_default();
        let mut rules =
            groups.iter().flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default());
        rules.find(|r| r["name"] == name).unwrap_or(Value::Null)
    }

    /// The active (pending or firing) alerts named `name`.
    fn alerts(&self, name: &str) -> Vec<Value> {
        let data = self.api("/api/v1/alerts").unwrap();
        let all = data["alerts"].as_array().cloned().unwrap_or_default();
        all.into_iter().filter(|a| a["labels"]["alertname"] == name).collect()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// HTTP/1.0 GET (the answer is never chunked and ends at close): (status, body).
fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn alert_states(alerts: &[Value]) -> BTreeSet<String> {
    alerts.iter().filter_map(|a| a["state"].as_str()).map(str::to_owned).collect()
}

#[test]
fn the_conservation_alert_fires_in_a_real_prometheus() {
    let engine = Engine::start_with(|c| {
        c.worker = Some(small_worker(c));
        c.render_extra = Some(prometheus_render());
        c.edge.reconcile.interval_ms = 500;
        c.edge.sku_funnel = hot_sku_funnel();
    });
    let (rules, real_for) = with_for(&rules_text(), CONSERVATION_ALERT, "3s");
    assert_eq!(real_for, "1m", "the rule waits two 30 s reconcile rounds");
    let prometheus = Prometheus::start(engine.admin(), &rules);
    // Prometheus' target discovery settles for ~5 s before the first scrape: wait for it, so
    // that the sale is scraped from its start.
    wait_for_ms("the first scrape", 30_000, || {
        prometheus.value("up{job=\"flashsale\"}") == Some(1.0)
    });
    let sale_started = Instant::now();
    short_sale(&engine);
    println!("short sale under a scraping Prometheus: {:?}", sale_started.elapsed());

    // Before the fault: several scrapes saw every delta at 0, the rule evaluated them (health
    // ok, with the rewritten `for`), and no alert is active.
    let started = Instant::now();
    wait_for_ms("five scrapes of the clean sale", 30_000, || {
        let q = "min(count_over_time(flashsale_inventory_conservation_delta[1m]))";
        prometheus.value(q).is_some_and(|n| n >= 5.0)
    });
    println!("five scrapes in Prometheus after {:?}", started.elapsed());
    let mut rule = Value::Null;
    wait_for_ms("the conservation rule evaluated", 30_000, || {
        rule = prometheus.rule(CONSERVATION_ALERT);
        rule["health"] == "ok"
    });
    assert_eq!(rule["duration"].as_f64(), Some(3.0), "{rule}");
    let max_delta = "max(max_over_time(flashsale_inventory_conservation_delta[1m]))";
    assert_eq!(prometheus.value(max_delta), Some(0.0));
    assert_eq!(prometheus.value("up{job=\"flashsale\"}"), Some(1.0));
    let before = prometheus.alerts(CONSERVATION_ALERT);
    assert!(before.is_empty(), "alert before the fault: {before:?}");
    prove_the_dashboard(&prometheus);
    draw_key_panels(&prometheus, sale_started.elapsed().as_secs() + 5);

    // The fault: a sold token back to AVAILABLE (an order without its unit).
    let fault = Instant::now();
    let changed = pg_i64(
        &engine,
        "WITH t AS (SELECT inventory_token_id FROM orders ORDER BY order_id LIMIT 1), \
         u AS (UPDATE inventory_token SET status = 'AVAILABLE', reservation_id = NULL, \
         order_id = NULL WHERE token_id = (SELECT inventory_token_id FROM t) RETURNING 1) \
         SELECT count(*) FROM u",
    );
    assert_eq!(changed, 1);
    let line = "flashsale_inventory_conservation_delta{kind=\"no_oversell\"}";
    wait_for_ms("the engine's delta gauge", 30_000, || {
        flashsale_tests::metric(&engine.metrics(), line) > 0
    });
    let at_engine = fault.elapsed();
    let mut active = Vec::new();
    wait_for_ms("the alert pending or firing", 60_000, || {
        active = prometheus.alerts(CONSERVATION_ALERT);
        !active.is_empty()
    });
    let first_seen = (fault.elapsed(), alert_states(&active));
    wait_for_ms("the alert firing", 60_000, || {
        active = prometheus.alerts(CONSERVATION_ALERT);
        active.iter().any(|a| a["state"] == "firing")
    });
    let firing = fault.elapsed();
    println!(
        "conservation gap injected: engine gauge > 0 after {at_engine:?}; alert first seen {:?} \
         after {:?}; firing after {firing:?} (reconcile every 500 ms, scrape and evaluation \
         every 1 s, `for` 1m rewritten to 3s)",
        first_seen.1, first_seen.0
    );
    let kinds: BTreeSet<&str> =
        active.iter().filter_map(|a| a["labels"]["kind"].as_str()).collect();
    assert!(kinds.contains("no_oversell"), "{active:?}");
    for a in &active {
        assert_eq!(a["labels"]["severity"], "critical", "{a}");
        assert_eq!(a["labels"]["job"], "flashsale", "{a}");
        let runbook = a["annotations"]["runbook"].as_str().unwrap();
        assert_eq!(runbook, "README.md#flashsaleinventoryconservationgap");
    }
}

/// Two SKUs sold in six waves a second apart while Prometheus scrapes (so that the rates
/// have a shape): 21:22 (80 units, 120 buyers) and the hot 31:32 (40 units, 60 buyers).
fn short_sale(engine: &Engine) {
    engine.create_activity(21, 22, 80);
    engine.create_activity(31, 32, 40);
    let mut c = HttpClient::connect(engine.http());
    for wave in 0..6u64 {
        for i in 0..20u64 {
            let user = wave * 20 + i + 1;
            let (_, v) = engine.submit(&mut c, user, 21, 22, &format!("s-{user}"));
            assert!(matches!(state(&v), "QUEUED" | "QUEUED_PENDING" | "SOLD_OUT"), "{v}");
            if i % 2 == 0 {
                let (_, v) = engine.submit(&mut c, user, 31, 32, &format!("h-{user}"));
                assert!(matches!(state(&v), "QUEUED" | "QUEUED_PENDING" | "SOLD_OUT"), "{v}");
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let sql = "SELECT count(*) FROM orders";
    wait_for_ms("the short sale's orders", 30_000, || pg_i64(engine, sql) == 120);
}

/// Issue 28 item 5: every panel of the dashboard evaluated in a real Prometheus that scraped
/// a short sale; a panel none of whose queries returns a series fails the test (a query that
/// returns none beside others that do is printed: e.g. dead letters in a sale that had none).
fn prove_the_dashboard(prometheus: &Prometheus) {
    let dashboard = dashboard();
    let panels = dashboard["panels"].as_array().cloned().unwrap_or_default();
    let (mut failed, mut quiet, mut proven) = (Vec::new(), Vec::new(), 0);
    for panel in panels.iter().filter(|p| p["type"] != "row") {
        let title = panel["title"].as_str().unwrap_or("?").to_owned();
        let mut series = 0;
        for target in panel["targets"].as_array().cloned().unwrap_or_default() {
            let q = target["expr"].as_str().unwrap_or_default();
            let result = prometheus
                .query(&expand(q))
                .unwrap_or_else(|e| panic!("panel {title}: {q} refused by Prometheus: {e}"));
            if result.is_empty() {
                quiet.push(format!("{title}: {q}"));
            }
            series += result.len();
        }
        if series == 0 {
            failed.push(title);
        } else {
            proven += 1;
        }
    }
    println!("dashboard: {proven} panels with data; queries without a series: {quiet:#?}");
    assert!(failed.is_empty(), "panels without a series after a sale: {failed:?}");
}

/// Grafana's variables replaced by what they expand to here.
fn expand(q: &str) -> String {
    q.replace("$__rate_interval", "5s").replace("$instance", ".*")
}

/// The key panels over the last `window_s` seconds, drawn from Prometheus' own data into
/// `var/flashsale-sale.svg`; with `FLASHSALE_REFRESH_PICTURES=1` into the committed
/// `tuning/grafana/flashsale-sale.svg` (README "Metrics" shows it) — a plain test run leaves
/// the checkout clean.
fn draw_key_panels(prometheus: &Prometheus, window_s: u64) {
    let titles = [
        "Submissions by state",
        "Funnel per SKU",
        "Request latency p50 / p99",
        "Backlogs",
        "Order-writer backlog drain time",
        "Redis memory and evictions",
    ];
    let dashboard = dashboard();
    let panels = dashboard["panels"].as_array().cloned().unwrap_or_default();
    let end = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let mut charts = Vec::new();
    for title in titles {
        let panel =
            panels.iter().find(|p| p["title"] == title).unwrap_or_else(|| panic!("{title}"));
        let mut lines = Vec::new();
        for target in panel["targets"].as_array().cloned().unwrap_or_default() {
            let q = expand(target["expr"].as_str().unwrap_or_default());
            let legend = target["legendFormat"].as_str().unwrap_or("").to_owned();
            let path = format!(
                "/api/v1/query_range?query={}&start={}&end={end}&step=1",
                urlencode(&q),
                end - window_s
            );
            let data = prometheus.api(&path).unwrap_or_else(|e| panic!("{q}: {e}"));
            for s in data["result"].as_array().cloned().unwrap_or_default() {
                let name = legend_of(&legend, &s["metric"]);
                let points: Vec<(f64, f64)> = s["values"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|v| {
                        let y: f64 = v[1].as_str()?.parse().ok()?;
                        Some((v[0].as_f64()? - (end - window_s) as f64, y))
                    })
                    .filter(|(_, y)| y.is_finite())
                    .collect();
                lines.push((name, points));
            }
        }
        // Series that stayed at 0 (states nobody got) would only crowd the legend.
        lines.retain(|(_, points)| points.iter().any(|(_, y)| *y > 0.0));
        charts.push((title, lines));
    }
    let scrapes =
        prometheus.value(&format!("count_over_time(up{{job=\"flashsale\"}}[{window_s}s])"));
    println!("key panels drawn over {window_s} s ({scrapes:?} scrapes in it)");
    let svg = svg::charts(&charts, window_s as f64);
    let path = if std::env::var_os("FLASHSALE_REFRESH_PICTURES").is_some() {
        repo().join("tuning/grafana/flashsale-sale.svg")
    } else {
        std::fs::create_dir_all(repo().join("var")).unwrap();
        repo().join("var/flashsale-sale.svg")
    };
    std::fs::write(&path, svg).unwrap();
    println!("key panels: {}", path.display());
}

/// A Grafana legend (`{{label}}`) filled from a series' labels.
fn legend_of(format: &str, metric: &Value) -> String {
    let mut out = format.to_owned();
    if let Some(labels) = metric.as_object() {
        for (k, v) in labels {
            out = out.replace(&format!("{{{{{k}}}}}"), v.as_str().unwrap_or(""));
        }
    }
    out
}

/// Small hand-written SVG: one chart per panel, one polyline per series.
mod svg {
    use std::fmt::Write as _;

    const COLORS: [&str; 8] =
        ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
    type Chart<'a> = (&'a str, Vec<(String, Vec<(f64, f64)>)>);

    pub fn charts(charts: &[Chart<'_>], window_s: f64) -> String {
        let (w, h, cols) = (420.0, 240.0, 3usize);
        let rows = charts.len().div_ceil(cols);
        let mut out = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" \
             font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
            w * cols as f64,
            h * rows as f64
        );
        for (i, (title, lines)) in charts.iter().enumerate() {
            let (x0, y0) = ((i % cols) as f64 * w, (i / cols) as f64 * h);
            chart(&mut out, (x0, y0, w, h), title, lines, window_s);
        }
        out.push_str("</svg>\n");
        out
    }

    fn chart(
        out: &mut String,
        (x0, y0, w, h): (f64, f64, f64, f64),
        title: &str,
        lines: &[(String, Vec<(f64, f64)>)],
        window_s: f64,
    ) {
        let (left, top, pw, ph) = (x0 + 45.0, y0 + 22.0, w - 60.0, h - 90.0);
        let y_max = lines.iter().flat_map(|(_, p)| p.iter().map(|(_, y)| *y)).fold(0.0, f64::max);
        let y_max = if y_max > 0.0 { y_max * 1.1 } else { 1.0 };
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" font-weight=\"bold\">{title}</text>",
            x0 + 8.0,
            y0 + 14.0
        );
        let _ = writeln!(out, "<rect x=\"{left}\" y=\"{top}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#bbb\"/>");
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
            left - 3.0,
            top + 9.0,
            short(y_max)
        );
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">0</text>",
            left - 3.0,
            top + ph
        );
        let _ = writeln!(out, "<text x=\"{}\" y=\"{}\">-{window_s}s</text>", left, top + ph + 12.0);
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">now</text>",
            left + pw,
            top + ph + 12.0
        );
        for (i, (name, points)) in lines.iter().take(COLORS.len()).enumerate() {
            let color = COLORS[i % COLORS.len()];
            let coords: Vec<String> = points
                .iter()
                .map(|(x, y)| {
                    format!("{:.1},{:.1}", left + x / window_s * pw, top + ph - y / y_max * ph)
                })
                .collect();
            let _ = writeln!(
                out,
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>",
                coords.join(" ")
            );
            let (lx, ly) =
                (x0 + 10.0 + (i % 2) as f64 * 200.0, top + ph + 26.0 + (i / 2) as f64 * 13.0);
            let _ = writeln!(
                out,
                "<text x=\"{lx}\" y=\"{ly}\" fill=\"{color}\">{}</text>",
                escape(name)
            );
        }
    }

    fn short(v: f64) -> String {
        match v {
            v if v >= 1e9 => format!("{:.1}G", v / 1e9),
            v if v >= 1e6 => format!("{:.1}M", v / 1e6),
            v if v >= 1e3 => format!("{:.1}k", v / 1e3),
            v if v >= 1.0 => format!("{v:.1}"),
            v => format!("{v:.3}"),
        }
    }

    fn escape(s: &str) -> String {
        s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
    }
}
