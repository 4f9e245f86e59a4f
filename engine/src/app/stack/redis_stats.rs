//! The private Redis servers' own counters as the demo reads them (issue 25): how many
//! commands and `FCALL`s a sale cost Redis per sold unit, and every command slower than 1 ms.
//!
//! Before the load: `CONFIG RESETSTAT`, `SLOWLOG RESET` and a 1 ms slow-log threshold on each
//! master. A watcher then polls the hot SKU's master every [`POLL_MS`] until the SKU is sold out
//! and every reservation's outcome is in Redis (`stock` 0 and `resv:pending` empty): the
//! sale's whole Redis work, from the first reservation to the last outcome applied, and none
//! of the load generator's own reads of the stores afterwards. There it takes `INFO
//! commandstats` and `SLOWLOG GET` of every master. The watcher's own calls are subtracted.
//!
//! Counted: every command the servers ran except `FCALL` itself (the commands inside the
//! functions, and the engine's plain reads beside them: meta refreshes, stock re-checks,
//! queries, the replay load).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use flashsale_io::resp::Reply;

use super::{redis_call, Kind, Server};

/// How often the watcher looks whether the sale's Redis work is done.
const POLL_MS: u64 = 100;
/// Longest the watcher waits for it.
const WATCH_MAX: Duration = Duration::from_secs(120);
/// Commands the server reports but which are this account's own, never the sale's.
const OWN: [&str; 4] = ["info", "config", "slowlog", "role"];

/// The Redis masters of the stack, with the counters reset.
pub struct Account {
    masters: Vec<u16>,
    hot: u16,
    started: Instant,
}

impl Account {
    /// Resets the counters of every master; `hot_key` names a key of the hot SKU (its master
    /// is the one watched).
    pub fn start(servers: &[Server], hot_key: &str) -> anyhow::Result<Account> {
        let mut masters = Vec::new();
        for server in servers.iter().filter(|s| s.kind == Kind::Redis) {
            let role = call(server.port, &["ROLE"])?;
            if role.as_array().and_then(|r| r.first()).and_then(Reply::as_str) != Some("master") {
                continue;
            }
            call(server.port, &["CONFIG", "RESETSTAT"])?;
            call(server.port, &["CONFIG", "SET", "slowlog-log-slower-than", "1000"])?;
            call(server.port, &["CONFIG", "SET", "slowlog-max-len", "4096"])?;
            call(server.port, &["SLOWLOG", "RESET"])?;
            masters.push(server.port);
        }
        let hot = hot_master(&masters, hot_key)?;
        Ok(Account { masters, hot, started: Instant::now() })
    }

    /// Waits until the sale's Redis work is done (see the module documentation), or until
    /// `load_ended` is set (a sale that did not sell out: the counters then cover the whole
    /// run, the generator's checks of the stores included, and `sold_out` is false), and reads
    /// the counters; `stock` units were for sale (those sold are what `stock` lost).
    pub fn finish(
        self,
        prefix: &str,
        stock_at_start: u64,
        load_ended: &AtomicBool,
    ) -> anyhow::Result<serde_json::Value> {
        let (stock, pending) = (format!("{prefix}stock"), format!("{prefix}resv:pending"));
        let (mut polls, deadline) = (0u64, Instant::now() + WATCH_MAX);
        let (sold_out, left) = loop {
            polls += 1;
            let left = text(&call(self.hot, &["GET", &stock])?);
            let queued = text(&call(self.hot, &["ZCARD", &pending])?);
            if left == "0" && queued == "0" {
                break (true, 0);
            }
            if load_ended.load(Ordering::Relaxed) || Instant::now() > deadline {
                break (false, left.parse().unwrap_or(0));
            }
            std::thread::sleep(Duration::from_millis(POLL_MS));
        };
        let mut calls: std::collections::BTreeMap<String, u64> = Default::default();
        let mut slow = Vec::new();
        for &port in &self.masters {
            for (name, n) in commandstats(&text(&call(port, &["INFO", "commandstats"])?)) {
                *calls.entry(name).or_default() += n;
            }
            slow.extend(slowlog(port)?);
        }
        // Subcommands are counted as `config|set`.
        calls.retain(|name, _| !OWN.contains(&name.split('|').next().unwrap_or_default()));
        // `hot_master`'s one `EXISTS` that ran (a redirected one is a rejected call, not a call).
        for (name, n) in [("get", polls), ("zcard", polls), ("exists", 1)] {
            calls.entry(name.into()).and_modify(|c| *c = c.saturating_sub(n));
        }
        let sold = stock_at_start.saturating_sub(left);
        let mut account = summary(&calls, slow, sold, self.started.elapsed());
        account["sold_out"] = serde_json::Value::Bool(sold_out);
        Ok(account)
    }
}

fn summary(
    calls: &std::collections::BTreeMap<String, u64>,
    slow: Vec<serde_json::Value>,
    sold: u64,
    took: Duration,
) -> serde_json::Value {
    let fcalls = calls.get("fcall").copied().unwrap_or(0);
    let commands: u64 = calls.iter().filter(|(n, _)| *n != "fcall").map(|(_, c)| c).sum();
    let per_unit = |n: u64| if sold == 0 { 0.0 } else { n as f64 / sold as f64 };
    serde_json::json!({
        "sold_units": sold,
        "fcalls": fcalls,
        "commands": commands,
        "fcalls_per_sold_unit": per_unit(fcalls),
        "commands_per_sold_unit": per_unit(commands),
        "by_command": calls,
        "slower_than_1ms": slow,
        "counted_for_s": took.as_secs_f64(),
    })
}

/// Prints the account in one line.
pub fn render(account: &serde_json::Value) -> String {
    let f = |k: &str| account[k].as_f64().unwrap_or(0.0);
    format!(
        "redis per sold unit: {:.2} commands, {:.3} FCALLs ({} commands slower than 1 ms)",
        f("commands_per_sold_unit"),
        f("fcalls_per_sold_unit"),
        account["slower_than_1ms"].as_array().map_or(0, Vec::len)
    )
}

/// The master that holds `key`: the one that answers `EXISTS` without a redirection.
fn hot_master(masters: &[u16], key: &str) -> anyhow::Result<u16> {
    for &port in masters {
        if !call(port, &["EXISTS", key])?.as_error().is_some_and(|e| e.starts_with(b"MOVED")) {
            return Ok(port);
        }
    }
    anyhow::bail!("no Redis master found")
}

/// `(command, calls)` of `INFO commandstats` (`cmdstat_get:calls=3,usec=...`).
pub fn commandstats(info: &str) -> Vec<(String, u64)> {
    info.lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = stats.split(',').find_map(|kv| kv.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .collect()
}

/// Every slow-log entry as `{command, usec}` (an entry: id, time, usec, arguments, ...).
fn slowlog(port: u16) -> anyhow::Result<Vec<serde_json::Value>> {
    let reply = call(port, &["SLOWLOG", "GET", "4096"])?;
    let entries = reply.as_array().unwrap_or_default();
    Ok(entries
        .iter()
        .filter_map(|entry| {
            let fields = entry.as_array()?;
            let usec = fields.get(2)?.as_int()?;
            let args = fields.get(3)?.as_array()?;
            let command: Vec<&str> = args.iter().take(2).filter_map(Reply::as_str).collect();
            Some(serde_json::json!({"usec": usec, "command": command.join(" ")}))
        })
        .collect())
}

fn call(port: u16, args: &[&str]) -> anyhow::Result<Reply> {
    Ok(redis_call(SocketAddr::from(([127, 0, 0, 1], port)), args)?)
}

/// A reply as text (bulk, simple or integer), "" for anything else.
fn text(reply: &Reply) -> String {
    match reply {
        Reply::Integer(n) => n.to_string(),
        other => other.as_str().unwrap_or_default().to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_lines_give_calls_per_command() {
        let info = "# Commandstats\r\ncmdstat_fcall:calls=12,usec=40,usec_per_call=3.33,\
                    rejected_calls=0,failed_calls=0\r\ncmdstat_hset:calls=70,usec=9\r\n";
        assert_eq!(commandstats(info), vec![("fcall".into(), 12), ("hset".into(), 70)]);
    }

    #[test]
    fn the_summary_counts_every_command_but_fcall_per_sold_unit() {
        let calls = [("fcall".to_owned(), 11), ("hset".to_owned(), 30), ("get".to_owned(), 10)];
        let s = summary(&calls.into_iter().collect(), vec![], 10, Duration::from_secs(1));
        assert_eq!((s["fcalls"].as_u64(), s["commands"].as_u64()), (Some(11), Some(40)));
        assert_eq!(s["commands_per_sold_unit"].as_f64(), Some(4.0));
        assert_eq!(s["fcalls_per_sold_unit"].as_f64(), Some(1.1));
    }
}
