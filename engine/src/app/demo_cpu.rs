//! `flashsale demo`'s CPU table: CPU microseconds per process per sold unit (the selling
//! phase) and per SOLD_OUT answer (the sold-out phase), printed and added to the JSON report
//! as `cpu`.
//!
//! - Processes: the engine (the demo's own process: `serve::start` runs in it), split by
//!   thread name into the edge shards (`shard-*`), the edge's durable side (`durable*`), the
//!   worker (`flashsale-worker*`, the kernel keeps 15 bytes of a name) and the other
//!   threads (the main thread, and every thread that exited: their time stays in the
//!   process's total but leaves the thread list); redis-server, nats-server (every node on
//!   the multi-node topologies) and PostgreSQL (`cpu::postgres_ticks`: postmaster, live
//!   children, reaped children); the load generator. The sampling thread itself
//!   (`cpu-sampler`) is its own row and not in the engine's.
//! - Phases, from the load generator's report (`timing`): selling = the schedule's zero to
//!   the first SOLD_OUT answer, sold-out = from there to the last answer. Per sold unit =
//!   selling CPU / new reservations (`reservations_new`); per sold-out answer = sold-out CPU /
//!   SOLD_OUT answers. The order writes the worker and PostgreSQL still do after the first
//!   SOLD_OUT fall in the sold-out phase: a phase is a span of time, not a kind of work.
//! - Sampling: `/proc` every 100 ms from a thread of this process, all samples kept (a few
//!   hundred bytes each), the boundaries interpolated between the samples around them
//!   (`cpu::ticks_at`). CPU times are 10 ms ticks, so a short phase is coarse.
//!
//! On the fault scenarios a killed server's count is lost with it (that process counts 0
//! across the kill rather than a negative amount); the table then says less.

use std::sync::mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;

use crate::app::cpu::{self, Reading};
use crate::app::stack::{Kind, Server};

const SAMPLE_EVERY: Duration = Duration::from_millis(100);
const SAMPLER_THREAD: &str = "cpu-sampler";

/// A row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Row {
    Engine,
    EdgeShards,
    EdgeDurable,
    Worker,
    EngineOther,
    Redis,
    Nats,
    Postgres,
    Loadgen,
    Sampler,
}

impl Row {
    pub const ALL: [Row; 10] = [
        Row::Engine,
        Row::EdgeShards,
        Row::EdgeDurable,
        Row::Worker,
        Row::EngineOther,
        Row::Redis,
        Row::Nats,
        Row::Postgres,
        Row::Loadgen,
        Row::Sampler,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Row::Engine => "engine",
            Row::EdgeShards => "edge shards",
            Row::EdgeDurable => "edge durable",
            Row::Worker => "worker",
            Row::EngineOther => "engine other",
            Row::Redis => "redis",
            Row::Nats => "nats",
            Row::Postgres => "postgres",
            Row::Loadgen => "loadgen",
            Row::Sampler => "demo sampler",
        }
    }

    /// Part of the engine's row (printed indented under it).
    fn in_engine(self) -> bool {
        matches!(self, Row::EdgeShards | Row::EdgeDurable | Row::Worker | Row::EngineOther)
    }

    fn index(self) -> usize {
        Row::ALL.iter().position(|r| *r == self).unwrap_or(0)
    }
}

/// Which row a thread of the engine's process belongs to, by its name.
pub fn thread_row(name: &str) -> Row {
    if name == SAMPLER_THREAD {
        Row::Sampler
    } else if name.starts_with("shard-") {
        Row::EdgeShards
    } else if name.starts_with("durable") {
        Row::EdgeDurable
    } else if name.starts_with("flashsale-work") {
        Row::Worker
    } else {
        Row::EngineOther
    }
}

/// One reading of every row: cumulative ticks, `None` for a process that is not there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    pub at_us: u64,
    pub ticks: [Option<u64>; Row::ALL.len()],
}

/// The processes sampled besides this one.
#[derive(Debug, Clone, Default)]
struct Pids {
    redis: Vec<u32>,
    nats: Vec<u32>,
    postgres: Vec<u32>,
    loadgen: u32,
}

/// The engine's rows from its process total and its threads' `(name, ticks)`: the sampler
/// thread out of the engine, "other" = whatever the named parts do not explain.
pub fn engine_rows(total: u64, threads: &[(String, u64)], ticks: &mut [Option<u64>]) {
    let mut parts = [0u64; Row::ALL.len()];
    for (name, t) in threads {
        parts[thread_row(name).index()] += t;
    }
    let engine = total.saturating_sub(parts[Row::Sampler.index()]);
    let named: u64 =
        [Row::EdgeShards, Row::EdgeDurable, Row::Worker].iter().map(|r| parts[r.index()]).sum();
    ticks[Row::Engine.index()] = Some(engine);
    for row in [Row::EdgeShards, Row::EdgeDurable, Row::Worker, Row::Sampler] {
        ticks[row.index()] = Some(parts[row.index()]);
    }
    ticks[Row::EngineOther.index()] = Some(engine.saturating_sub(named));
}

fn sum(pids: &[u32], read: impl Fn(u32) -> Option<u64>) -> Option<u64> {
    let read: Vec<u64> = pids.iter().filter_map(|p| read(*p)).collect();
    (!read.is_empty()).then(|| read.iter().sum())
}

fn unix_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

fn take(pids: &Pids) -> Sample {
    let mut ticks = [None; Row::ALL.len()];
    engine_rows(cpu::self_ticks(), &cpu::thread_ticks("self"), &mut ticks);
    ticks[Row::Redis.index()] = sum(&pids.redis, cpu::process_ticks);
    ticks[Row::Nats.index()] = sum(&pids.nats, cpu::process_ticks);
    ticks[Row::Postgres.index()] = sum(&pids.postgres, cpu::postgres_ticks);
    ticks[Row::Loadgen.index()] = cpu::process_ticks(pids.loadgen);
    Sample { at_us: unix_us(), ticks }
}

/// The sampling thread.
pub struct Sampler {
    stop: mpsc::Sender<()>,
    thread: std::thread::JoinHandle<Vec<Sample>>,
    pids: Pids,
}

impl Sampler {
    /// Samples this process, the servers and the load generator `loadgen` until
    /// [`Sampler::finish`].
    pub fn start(servers: &[Server], loadgen: u32) -> std::io::Result<Sampler> {
        let of = |kind: Kind| servers.iter().filter(|s| s.kind == kind).map(|s| s.pid).collect();
        let pids = Pids {
            redis: of(Kind::Redis),
            nats: of(Kind::Nats),
            postgres: of(Kind::Postgres),
            loadgen,
        };
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = {
            let pids = pids.clone();
            std::thread::Builder::new().name(SAMPLER_THREAD.into()).spawn(move || {
                let mut samples = vec![take(&pids)];
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(SAMPLE_EVERY)
                {
                    samples.push(take(&pids));
                }
                samples.push(take(&pids));
                samples
            })?
        };
        Ok(Sampler { stop, thread, pids })
    }

    /// Stops sampling; the samples, and the pids per row.
    pub fn finish(self) -> (Vec<Sample>, serde_json::Value) {
        let _ = self.stop.send(());
        let samples = self.thread.join().unwrap_or_default();
        let pids = serde_json::json!({
            "engine": [std::process::id()],
            "redis": self.pids.redis,
            "nats": self.pids.nats,
            "postgres": self.pids.postgres,
            "loadgen": [self.pids.loadgen],
        });
        (samples, pids)
    }
}

/// The two phases, µs since the Unix epoch, and what was counted in them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Phases {
    pub start_us: u64,
    /// The first SOLD_OUT answer; `None`: the run never sold out (all of it was selling).
    pub sold_out_us: Option<u64>,
    pub end_us: u64,
    pub units_sold: u64,
    pub sold_out_answers: u64,
}

impl Phases {
    /// From the load generator's JSON report (`timing`, `reservations_new`, `counts`).
    pub fn from_report(report: &serde_json::Value) -> anyhow::Result<Phases> {
        let timing = &report["timing"];
        let start_us = timing["started_unix_us"].as_u64().context("no timing.started_unix_us")?;
        anyhow::ensure!(start_us > 0, "the load generator did not record its start");
        let end_us = start_us + timing["last_answer_us"].as_u64().unwrap_or(0);
        Ok(Phases {
            start_us,
            sold_out_us: timing["first_sold_out_us"].as_u64().map(|us| (start_us + us).min(end_us)),
            end_us,
            units_sold: report["reservations_new"].as_u64().unwrap_or(0),
            sold_out_answers: report["counts"]["SOLD_OUT"].as_u64().unwrap_or(0),
        })
    }

    fn selling(&self) -> (u64, u64) {
        (self.start_us, self.sold_out_us.unwrap_or(self.end_us))
    }
}

/// One row's figures: CPU µs in each phase and per item.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures {
    pub row: Row,
    pub selling_cpu_us: Option<f64>,
    pub sold_out_cpu_us: Option<f64>,
    pub us_per_unit: Option<f64>,
    pub us_per_sold_out: Option<f64>,
}

/// Every row's figures over `phases`.
pub fn figures(samples: &[Sample], phases: &Phases) -> Vec<Figures> {
    Row::ALL
        .iter()
        .map(|row| {
            let readings: Vec<Reading> = samples
                .iter()
                .filter_map(|s| s.ticks[row.index()].map(|ticks| Reading { at_us: s.at_us, ticks }))
                .collect();
            let (from, to) = phases.selling();
            let selling = cpu::cpu_us_between(&readings, from, to);
            let sold_out =
                phases.sold_out_us.and_then(|b| cpu::cpu_us_between(&readings, b, phases.end_us));
            Figures {
                row: *row,
                selling_cpu_us: selling,
                sold_out_cpu_us: sold_out,
                us_per_unit: cpu::per_item(selling, phases.units_sold),
                us_per_sold_out: cpu::per_item(sold_out, phases.sold_out_answers),
            }
        })
        .collect()
}

/// The printed table.
pub fn render(figures: &[Figures], phases: &Phases) -> String {
    use std::fmt::Write as _;
    let (from, to) = phases.selling();
    let seconds = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e6;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "CPU per process (/proc utime+stime): selling {:.2} s, {} units; sold-out {:.2} s, {} \
         SOLD_OUT answers",
        seconds(from, to),
        phases.units_sold,
        phases.sold_out_us.map_or(0.0, |b| seconds(b, phases.end_us)),
        phases.sold_out_answers,
    );
    let _ =
        writeln!(t, "  {:<16} {:>16} {:>19}", "process", "selling µs/unit", "sold-out µs/answer");
    let cell = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
    for f in figures {
        let name =
            if f.row.in_engine() { format!("  {}", f.row.name()) } else { f.row.name().to_owned() };
        let _ =
            writeln!(t, "  {name:<16} {:>16} {:>19}", cell(f.us_per_unit), cell(f.us_per_sold_out));
    }
    let total = |pick: fn(&Figures) -> Option<f64>| {
        let top = figures.iter().filter(|f| !f.row.in_engine() && f.row != Row::Sampler);
        top.filter_map(pick).reduce(|a, b| a + b)
    };
    let _ = writeln!(
        t,
        "  {:<16} {:>16} {:>19}",
        "all but sampler",
        cell(total(|f| f.us_per_unit)),
        cell(total(|f| f.us_per_sold_out))
    );
    t
}

/// The `cpu` object of the JSON report.
pub fn to_json(figures: &[Figures], phases: &Phases, pids: serde_json::Value) -> serde_json::Value {
    let (from, to) = phases.selling();
    let rows: Vec<serde_json::Value> = figures
        .iter()
        .map(|f| {
            serde_json::json!({
                "process": f.row.name(),
                "part_of_engine": f.row.in_engine(),
                "selling_cpu_ms": f.selling_cpu_us.map(|us| us / 1e3),
                "sold_out_cpu_ms": f.sold_out_cpu_us.map(|us| us / 1e3),
                "selling_us_per_unit": f.us_per_unit,
                "sold_out_us_per_answer": f.us_per_sold_out,
            })
        })
        .collect();
    serde_json::json!({
        "source": "/proc/PID/stat utime+stime (PostgreSQL: postmaster + live children + \
                   cutime/cstime), sampled every 100 ms, phase boundaries interpolated",
        "engine_split": "one process (the demo runs serve in-process), by thread name: edge \
                         shards = shard-*, edge durable = durable*, worker = flashsale-worker*, \
                         engine other = the rest (main thread, exited threads); the sampler \
                         thread is its own row",
        "selling": {
            "from_unix_us": from,
            "to_unix_us": to,
            "seconds": to.saturating_sub(from) as f64 / 1e6,
            "units_sold": phases.units_sold,
        },
        "sold_out": phases.sold_out_us.map(|b| serde_json::json!({
            "from_unix_us": b,
            "to_unix_us": phases.end_us,
            "seconds": phases.end_us.saturating_sub(b) as f64 / 1e6,
            "sold_out_answers": phases.sold_out_answers,
        })),
        "pids": pids,
        "processes": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_threads_split_by_name() {
        assert_eq!(thread_row("shard-0-3"), Row::EdgeShards);
        assert_eq!(thread_row("durable"), Row::EdgeDurable);
        assert_eq!(thread_row("durable-main"), Row::EdgeDurable);
        assert_eq!(thread_row("flashsale-worke"), Row::Worker);
        assert_eq!(thread_row("flashsale"), Row::EngineOther);
        assert_eq!(thread_row(SAMPLER_THREAD), Row::Sampler);
        let threads: Vec<(String, u64)> =
            [("flashsale", 5), ("shard-0-1", 40), ("durable", 10), ("flashsale-worke", 20)]
                .into_iter()
                .chain([(SAMPLER_THREAD, 3)])
                .map(|(n, t)| (n.to_owned(), t))
                .collect();
        let mut ticks = [None; Row::ALL.len()];
        // 90 in the process: 78 in live threads, 12 in threads that exited.
        engine_rows(90, &threads, &mut ticks);
        let at = |row: Row| ticks[row.index()];
        assert_eq!(at(Row::Engine), Some(87));
        assert_eq!(at(Row::EdgeShards), Some(40));
        assert_eq!(at(Row::Worker), Some(20));
        assert_eq!(at(Row::EngineOther), Some(87 - 40 - 10 - 20));
        assert_eq!(at(Row::Sampler), Some(3));
    }

    fn sample(at_us: u64, redis: u64) -> Sample {
        let mut ticks = [None; Row::ALL.len()];
        ticks[Row::Redis.index()] = Some(redis);
        Sample { at_us, ticks }
    }

    #[test]
    fn phases_split_at_the_first_sold_out_answer() {
        let report = serde_json::json!({
            "timing": {"started_unix_us": 10_000_000u64, "first_sold_out_us": 200_000,
                       "last_answer_us": 1_200_000},
            "reservations_new": 1_000,
            "counts": {"QUEUED": 1_000, "SOLD_OUT": 4_000},
        });
        let phases = Phases::from_report(&report).unwrap();
        assert_eq!(phases.sold_out_us, Some(10_200_000));
        assert_eq!(phases.end_us, 11_200_000);
        // Redis: 2 ticks per 100 ms while selling (the first 200 ms), then 1 per 100 ms.
        let samples: Vec<Sample> = (0..=14u64)
            .map(|i| {
                let at = 9_900_000 + i * 100_000;
                let ticks = match i {
                    0 | 1 => 0,
                    2 | 3 => (i - 1) * 2,
                    _ => 4 + (i - 3),
                };
                sample(at, ticks)
            })
            .collect();
        let f = figures(&samples, &phases)[Row::Redis.index()];
        // 4 ticks = 40 ms over 1,000 units = 40 µs/unit; 10 ticks = 100 ms over 4,000 answers.
        assert_eq!(f.selling_cpu_us, Some(40_000.0));
        assert_eq!(f.us_per_unit, Some(40.0));
        assert_eq!(f.us_per_sold_out, Some(25.0));
        // A row never read has no figures.
        assert_eq!(figures(&samples, &phases)[Row::Nats.index()].us_per_unit, None);
        let table = render(&figures(&samples, &phases), &phases);
        assert!(table.contains("redis") && table.contains("40.0") && table.contains("25.0"));
        // Never sold out: all of the run is selling, no sold-out figures.
        let mut never = report.clone();
        never["timing"]["first_sold_out_us"] = serde_json::Value::Null;
        let phases = Phases::from_report(&never).unwrap();
        let f = figures(&samples, &phases)[Row::Redis.index()];
        assert_eq!(f.selling_cpu_us, Some(140_000.0));
        assert_eq!((f.sold_out_cpu_us, f.us_per_sold_out), (None, None));
        assert!(Phases::from_report(&serde_json::json!({})).is_err());
    }
}
