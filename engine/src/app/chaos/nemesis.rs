//! The nemesis: carries out a [`Schedule`] on the running `ha` stack and the engine instances,
//! and records when each fault started and healed (and anything that went wrong doing it).
//!
//! How each fault is done:
//! - kill -9: Redis node (restarted on its port at the heal; a master's replica takes over
//!   meanwhile), NATS node (restarted), PostgreSQL standby (restarted, streams again),
//!   PostgreSQL primary (what a failover manager does: a standby promoted at once, the other
//!   re-pointed at it, `synchronous_standby_names` naming every node; at the heal the old
//!   primary is rebuilt as a standby of the new one), engine instance (restarted);
//! - freeze: SIGSTOP, SIGCONT at the heal (PostgreSQL: the postmaster and its backends);
//! - partition: the node's proxy stalls every connection of the engines' to it (the node
//!   stays in its cluster: Redis' bus, NATS' routes and PostgreSQL's replication do not go
//!   through the proxies; see `schedule.rs`).
//!
//! What it is not: the schedule (`schedule.rs`) or the judgement (`audit.rs`).

use std::time::{Duration, Instant};

use super::instances::Instance;
use super::proxy::Proxy;
use super::schedule::{Action, Fault, Node, Schedule};
use crate::app::stack::nats_cluster::NatsCluster;
use crate::app::stack::pg_standbys::{PgStandbys, NODE_NAMES};
use crate::app::stack::{signal_process, RedisCluster, StackError};

/// How late a round may start before it is skipped.
const LATE_MAX_MS: u64 = 2_000;

/// What the nemesis holds.
pub struct Targets {
    pub redis: RedisCluster,
    pub nats: NatsCluster,
    pub pg: PgStandbys,
    /// The proxies in front of each node, in node order.
    pub proxies: Proxies,
    pub engines: Vec<Instance>,
}

/// What fronts each node for the engines: the addresses they are given (PostgreSQL's URL) or
/// that the nodes announce (Redis' slot map, NATS' `connect_urls`) are these.
pub struct Proxies {
    pub redis: Vec<Proxy>,
    pub nats: Vec<Proxy>,
    pub pg: Vec<Proxy>,
}

impl Proxies {
    fn all(&self) -> impl Iterator<Item = &Proxy> {
        self.redis.iter().chain(&self.nats).chain(&self.pg)
    }
}

/// One thing the nemesis did, for the report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Event {
    pub at_ms: u64,
    pub round: usize,
    pub what: String,
    pub error: Option<String>,
}

/// A fault being held, with what its heal needs to know.
enum Held {
    Plain(Fault),
    /// The PostgreSQL node `index` is frozen (the primary or a standby).
    PgFrozen(usize),
    PgKilled(usize),
    /// The primary `old` was killed and `new` promoted.
    PgFailedOver {
        old: usize,
        new: usize,
    },
    PgPartitioned(usize),
    /// The NATS node `index` (the leader as it was when the fault began).
    Nats(usize, Action),
}

/// Runs every round at its time (from `started`); returns the events.
pub fn run(targets: &mut Targets, schedule: &Schedule, started: Instant) -> Vec<Event> {
    let mut events = Vec::new();
    let at = |started: Instant| started.elapsed().as_millis() as u64;
    for (round, r) in schedule.rounds.iter().enumerate() {
        // A round that cannot start on time (a slow heal before it) is skipped, and said: the
        // run then did less than the schedule, never something else.
        if at(started) > r.at_ms + LATE_MAX_MS {
            let what = format!("round skipped: {} ms late", at(started) - r.at_ms);
            events.push(Event { at_ms: at(started), round, what, error: None });
            continue;
        }
        sleep_until(started + Duration::from_millis(r.at_ms));
        let mut held = Vec::new();
        for fault in &r.faults {
            let (at_ms, begun) = (at(started), Instant::now());
            let result = inject(targets, *fault);
            let error = result.as_ref().err().map(|e| format!("{e:#}"));
            let took = begun.elapsed().as_millis();
            let what = format!("{} {} (took {took} ms)", fault.action.name(), fault.node.name());
            events.push(Event { at_ms, round, what, error });
            held.extend(result.ok());
        }
        sleep_until(started + Duration::from_millis(r.at_ms + r.hold_ms));
        held.sort_by_key(heal_order);
        for h in held {
            let (at_ms, begun, described) = (at(started), Instant::now(), describe(&h));
            let error = heal(targets, h).err().map(|e| format!("{e:#}"));
            let what = format!("heal {described} (took {} ms)", begun.elapsed().as_millis());
            events.push(Event { at_ms, round, what, error });
        }
    }
    events
}

/// The stores' heals first (instant), then an engine's restart, which needs them (one
/// restarted while the primary was still frozen failed every start for 51 s: campaign seed
/// 19), and the slow one last (an old primary rebuilt as a standby, which nothing waits for).
fn heal_order(held: &Held) -> u8 {
    match held {
        Held::PgFailedOver { .. } => 2,
        Held::Plain(Fault { node: Node::Engine(_), .. }) => 1,
        _ => 0,
    }
}

fn sleep_until(when: Instant) {
    let now = Instant::now();
    if when > now {
        std::thread::sleep(when - now);
    }
}

fn describe(held: &Held) -> String {
    match held {
        Held::Plain(f) => format!("{} {}", f.action.name(), f.node.name()),
        Held::PgFrozen(i) => format!("freeze {}", NODE_NAMES[*i]),
        Held::PgKilled(i) => format!("kill -9 {}", NODE_NAMES[*i]),
        Held::PgFailedOver { old, new } => {
            format!("failover {} -> {} (old primary rejoins)", NODE_NAMES[*old], NODE_NAMES[*new])
        }
        Held::PgPartitioned(i) => format!("partition {}", NODE_NAMES[*i]),
        Held::Nats(i, action) => format!("{} nats-{i}", action.name()),
    }
}

fn inject(t: &mut Targets, fault: Fault) -> anyhow::Result<Held> {
    match fault.node {
        Node::Redis(i) => {
            redis_inject(t, usize::from(i), fault.action).map(|()| Held::Plain(fault))
        }
        Node::Nats(i) => nats_inject(t, usize::from(i), fault.action),
        Node::NatsLeader => {
            let leader = t.nats.stream_leader(flashsale_io::jetstream::ORDERS_STREAM);
            let index = leader.and_then(|name| t.nats.index_of(&name));
            let index = index.ok_or_else(|| anyhow::anyhow!("SECKILL_ORDERS has no leader"))?;
            nats_inject(t, index, fault.action)
        }
        Node::Engine(i) => {
            let engine = &mut t.engines[usize::from(i)];
            match fault.action {
                Action::Kill => engine.kill()?,
                _ => engine.signal(libc::SIGSTOP),
            }
            Ok(Held::Plain(fault))
        }
        Node::PgPrimary => pg_primary_inject(t, fault.action),
        Node::PgStandby(k) => {
            let primary = primary_of(&t.pg)?;
            let standby = (0..NODE_NAMES.len()).filter(|&i| i != primary).nth(usize::from(k));
            let index = standby.ok_or_else(|| anyhow::anyhow!("no standby {k}"))?;
            pg_node_inject(t, index, fault.action)
        }
    }
}

fn heal(t: &mut Targets, held: Held) -> anyhow::Result<()> {
    match held {
        Held::Plain(f) => match f.node {
            Node::Redis(i) => redis_heal(t, usize::from(i), f.action),
            Node::Engine(i) => {
                let engine = &mut t.engines[usize::from(i)];
                match f.action {
                    Action::Kill => engine.restart().map(|_| ()),
                    _ => {
                        engine.signal(libc::SIGCONT);
                        Ok(())
                    }
                }
            }
            Node::Nats(_) | Node::NatsLeader | Node::PgPrimary | Node::PgStandby(_) => Ok(()),
        },
        Held::PgFrozen(i) => Ok(t.pg.thaw(i)?),
        Held::PgKilled(i) => Ok(t.pg.restart(i)?),
        Held::PgPartitioned(i) => {
            t.proxies.pg[i].heal();
            Ok(())
        }
        Held::PgFailedOver { old, new } => Ok(t.pg.rejoin(old, new)?),
        Held::Nats(index, action) => nats_heal(t, index, action),
    }
}

fn redis_inject(t: &mut Targets, index: usize, action: Action) -> anyhow::Result<()> {
    let node = &t.redis.nodes[index];
    match action {
        Action::Kill => node.server.kill()?,
        Action::Freeze => signal_process(node.server.pid, libc::SIGSTOP),
        Action::Partition => t.proxies.redis[index].partition(),
    }
    Ok(())
}

fn redis_heal(t: &mut Targets, index: usize, action: Action) -> anyhow::Result<()> {
    match action {
        Action::Kill => t.redis.restart_node(index)?,
        Action::Freeze => signal_process(t.redis.nodes[index].server.pid, libc::SIGCONT),
        Action::Partition => t.proxies.redis[index].heal(),
    }
    Ok(t.redis.wait_healthy(Duration::from_secs(60))?)
}

fn nats_inject(t: &mut Targets, index: usize, action: Action) -> anyhow::Result<Held> {
    match action {
        Action::Kill => t.nats.kill(index)?,
        Action::Freeze => {
            let pid = t.nats.nodes()[index].pid().ok_or_else(|| anyhow::anyhow!("not running"))?;
            signal_process(pid, libc::SIGSTOP);
        }
        Action::Partition => t.proxies.nats[index].partition(),
    }
    Ok(Held::Nats(index, action))
}

fn nats_heal(t: &mut Targets, index: usize, action: Action) -> anyhow::Result<()> {
    match action {
        Action::Kill => t.nats.restart(index)?,
        Action::Freeze => {
            let pid = t.nats.nodes()[index].pid().ok_or_else(|| anyhow::anyhow!("not running"))?;
            signal_process(pid, libc::SIGCONT);
        }
        Action::Partition => t.proxies.nats[index].heal(),
    }
    Ok(t.nats.wait_healthy(Duration::from_secs(60))?)
}

fn primary_of(pg: &PgStandbys) -> anyhow::Result<usize> {
    (0..NODE_NAMES.len())
        .find(|&i| pg.nodes()[i].is_running() && pg.is_primary(i))
        .ok_or_else(|| anyhow::anyhow!("no PostgreSQL primary"))
}

fn pg_primary_inject(t: &mut Targets, action: Action) -> anyhow::Result<Held> {
    let primary = primary_of(&t.pg)?;
    if action != Action::Kill {
        return pg_node_inject(t, primary, action);
    }
    t.pg.kill(primary)?;
    let standbys: Vec<usize> = (0..NODE_NAMES.len()).filter(|&i| i != primary).collect();
    let (new, other) = (standbys[0], standbys[1]);
    t.pg.promote(new)?;
    // Every node may be the synchronous standby from now on (the old primary rejoins as one).
    t.pg.query(new, "ALTER SYSTEM SET synchronous_standby_names = 'ANY 1 (pg0, s1, s2)'")?;
    t.pg.query(new, "SELECT pg_reload_conf()")?;
    t.pg.follow(other, new)?;
    Ok(Held::PgFailedOver { old: primary, new })
}

fn pg_node_inject(t: &mut Targets, index: usize, action: Action) -> anyhow::Result<Held> {
    match action {
        Action::Kill => {
            t.pg.kill(index)?;
            Ok(Held::PgKilled(index))
        }
        Action::Freeze => {
            t.pg.freeze(index)?;
            Ok(Held::PgFrozen(index))
        }
        Action::Partition => {
            t.proxies.pg[index].partition();
            Ok(Held::PgPartitioned(index))
        }
    }
}

/// Every node back: thawed, restarted where dead, proxies passing (after a run that stopped
/// part-way).
pub fn heal_all(t: &mut Targets) -> Result<(), StackError> {
    for proxy in t.proxies.all() {
        proxy.heal();
    }
    for engine in &t.engines {
        engine.signal(libc::SIGCONT);
    }
    for node in &t.redis.nodes {
        signal_process(node.server.pid, libc::SIGCONT);
    }
    for i in 0..NODE_NAMES.len() {
        let _ = t.pg.thaw(i);
    }
    t.redis.wait_healthy(Duration::from_secs(60))?;
    t.nats.wait_healthy(Duration::from_secs(60))
}
