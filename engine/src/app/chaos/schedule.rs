//! The nemesis' schedule for `flashsale chaos` (issue 27): which node gets which fault when,
//! derived from the seed alone, so the same seed gives the same schedule on any machine.
//!
//! What it is: [`Schedule::from_seed`] (sans-I/O: no clock, no process, no randomness but the
//! seed's own generator, [`SplitMix64`], whose output is fixed by its definition and not by a
//! crate's version), the fault kinds, and [`Schedule::render`] (what the run prints).
//!
//! The limits that keep a quorum possible, each with its reason:
//! - Faults come in **rounds**: one or two faults start together, hold together and heal
//!   together, and the next round starts after a gap. So at most two faults hold at once.
//! - The two faults of a round are in **different groups** (Redis, NATS, PostgreSQL, engine):
//!   one Redis node of six (a master and its replica never both), one NATS node of three
//!   (quorum 2; half the time the `SECKILL_ORDERS` leader), one PostgreSQL node of three (the primary's loss is a promotion; a standby's
//!   leaves `ANY 1` satisfied), one engine of two (the balancer has the other).
//! - A **partition** cuts a node off from the engines (its proxy stalls every connection of
//!   theirs) while it stays in its own cluster: every Redis, NATS and PostgreSQL node is
//!   fronted by a proxy (`run.rs`); the engines are not (the balancer is their front, and a
//!   freeze is what a partitioned engine looks like to it).
//!
//! What it is not: the execution (`nemesis.rs`), the buyers, or the auditor.

use std::fmt::Write as _;

/// A tiny, fixed generator (Steele, Lea, Flood 2014): the schedule must not change when a
/// dependency's generator does.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi` (the modulo bias is irrelevant at these ranges).
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        assert!(lo <= hi, "empty range {lo}..={hi}");
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// True with probability `percent` %.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.between(0, 99) < percent
    }
}

/// A node of the `ha` topology (indices as the stack numbers them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Node {
    /// One of the six Redis Cluster nodes (its role at the time decides what it means).
    Redis(u8),
    /// One of the three JetStream nodes.
    Nats(u8),
    /// Whichever JetStream node leads `SECKILL_ORDERS` at the time (Jepsen's lesson: the
    /// leader is where a fault hurts).
    NatsLeader,
    /// One of the three PostgreSQL nodes; whichever is primary at the time.
    PgPrimary,
    /// A standby of the current primary (the first or the second one).
    PgStandby(u8),
    /// One of the two engine instances behind the balancer.
    Engine(u8),
}

impl Node {
    fn group(self) -> Group {
        match self {
            Node::Redis(_) => Group::Redis,
            Node::Nats(_) | Node::NatsLeader => Group::Nats,
            Node::PgPrimary | Node::PgStandby(_) => Group::Pg,
            Node::Engine(_) => Group::Engine,
        }
    }

    pub fn name(self) -> String {
        match self {
            Node::Redis(i) => format!("redis-{i}"),
            Node::Nats(i) => format!("nats-{i}"),
            Node::NatsLeader => "nats-leader".to_owned(),
            Node::PgPrimary => "pg-primary".to_owned(),
            Node::PgStandby(i) => format!("pg-standby-{i}"),
            Node::Engine(i) => format!("engine-{i}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Group {
    Redis,
    Nats,
    Pg,
    Engine,
}

const GROUPS: [Group; 4] = [Group::Redis, Group::Nats, Group::Pg, Group::Engine];

/// What happens to the node; each is undone when its round heals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// kill -9, started again at the heal (the PostgreSQL primary: a standby is promoted at
    /// once, the old primary comes back as a standby of it).
    Kill,
    /// SIGSTOP, SIGCONT at the heal (a hung host).
    Freeze,
    /// The node's proxy refuses new connections and stalls the open ones; passes again at
    /// the heal.
    Partition,
}

impl Action {
    pub fn name(self) -> &'static str {
        match self {
            Action::Kill => "kill -9",
            Action::Freeze => "freeze",
            Action::Partition => "partition",
        }
    }
}

/// One fault of a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub node: Node,
    pub action: Action,
}

/// One or two faults started at `at_ms` (from the start of the sale) and healed at
/// `at_ms + hold_ms`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Round {
    pub at_ms: u64,
    pub hold_ms: u64,
    pub faults: Vec<Fault>,
}

/// The bounds of a schedule, with the values `flashsale chaos` uses.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Selling without faults first (the sale warms up, the buyers' baseline).
    pub warmup_ms: u64,
    /// No fault starts this close to the end: the last round heals before the sale ends.
    pub cooldown_ms: u64,
    pub hold_min_ms: u64,
    pub hold_max_ms: u64,
    pub gap_min_ms: u64,
    pub gap_max_ms: u64,
    /// The share of rounds with two faults at once.
    pub two_at_once_percent: u64,
}

impl Default for Bounds {
    fn default() -> Bounds {
        Bounds {
            warmup_ms: 3_000,
            cooldown_ms: 5_000,
            hold_min_ms: 2_000,
            hold_max_ms: 8_000,
            gap_min_ms: 3_000,
            gap_max_ms: 8_000,
            two_at_once_percent: 35,
        }
    }
}

/// The whole schedule of one seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub seed: u64,
    pub duration_ms: u64,
    pub rounds: Vec<Round>,
}

impl Schedule {
    /// The schedule of `seed` for a sale of `duration_ms`: rounds until the cool-down.
    pub fn from_seed(seed: u64, duration_ms: u64, bounds: &Bounds) -> Schedule {
        let mut rng = SplitMix64::new(seed);
        let mut rounds = Vec::new();
        let mut at_ms = bounds.warmup_ms;
        loop {
            let hold_ms = rng.between(bounds.hold_min_ms, bounds.hold_max_ms);
            if at_ms + hold_ms + bounds.cooldown_ms > duration_ms {
                break;
            }
            let count = if rng.chance(bounds.two_at_once_percent) { 2 } else { 1 };
            rounds.push(Round { at_ms, hold_ms, faults: pick_faults(&mut rng, count) });
            at_ms += hold_ms + rng.between(bounds.gap_min_ms, bounds.gap_max_ms);
        }
        Schedule { seed, duration_ms, rounds }
    }

    /// One line per round: `+12.3s hold 4.1s: kill -9 nats-1, freeze pg-primary`.
    pub fn render(&self) -> String {
        let mut out = format!(
            "chaos schedule of seed {} ({} s, {} rounds):\n",
            self.seed,
            self.duration_ms / 1_000,
            self.rounds.len()
        );
        for round in &self.rounds {
            let faults: Vec<String> = round
                .faults
                .iter()
                .map(|f| format!("{} {}", f.action.name(), f.node.name()))
                .collect();
            let _ = writeln!(
                out,
                "  +{:>5.1}s hold {:>4.1}s: {}",
                round.at_ms as f64 / 1_000.0,
                round.hold_ms as f64 / 1_000.0,
                faults.join(", ")
            );
        }
        out
    }
}

/// `count` faults in distinct groups.
fn pick_faults(rng: &mut SplitMix64, count: usize) -> Vec<Fault> {
    let mut faults: Vec<Fault> = Vec::with_capacity(count);
    while faults.len() < count {
        let group = GROUPS[rng.between(0, GROUPS.len() as u64 - 1) as usize];
        if faults.iter().any(|f| f.node.group() == group) {
            continue;
        }
        faults.push(pick_in(rng, group));
    }
    faults
}

fn pick_in(rng: &mut SplitMix64, group: Group) -> Fault {
    let node = match group {
        Group::Redis => Node::Redis(rng.between(0, 5) as u8),
        Group::Nats if rng.chance(50) => Node::NatsLeader,
        Group::Nats => Node::Nats(rng.between(0, 2) as u8),
        Group::Pg if rng.chance(50) => Node::PgPrimary,
        Group::Pg => Node::PgStandby(rng.between(0, 1) as u8),
        Group::Engine => Node::Engine(rng.between(0, 1) as u8),
    };
    // One draw whatever the node, so the draws after it are those of the schedule before
    // Redis and NATS nodes could be partitioned.
    let partitionable = !matches!(node, Node::Engine(_));
    let action = match rng.between(0, if partitionable { 2 } else { 1 }) {
        0 => Action::Kill,
        1 => Action::Freeze,
        _ => Action::Partition,
    };
    Fault { node, action }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_schedule_and_another_seed_another() {
        let bounds = Bounds::default();
        let a = Schedule::from_seed(7, 120_000, &bounds);
        assert_eq!(a, Schedule::from_seed(7, 120_000, &bounds));
        assert_eq!(a.render(), Schedule::from_seed(7, 120_000, &bounds).render());
        assert_ne!(a, Schedule::from_seed(8, 120_000, &bounds));
        assert!(a.rounds.len() >= 5, "{}", a.render());
    }

    #[test]
    fn the_generator_is_the_published_splitmix64() {
        // The first outputs for seed 1234567 (the reference implementation's test vector).
        let mut rng = SplitMix64::new(1_234_567);
        assert_eq!(rng.next_u64(), 6_457_827_717_110_365_317);
        assert_eq!(rng.next_u64(), 3_203_168_211_198_807_973);
    }

    #[test]
    fn every_schedule_keeps_within_its_limits() {
        let bounds = Bounds::default();
        for seed in 0..500 {
            let s = Schedule::from_seed(seed, 180_000, &bounds);
            let mut end = 0;
            let mut pairs = 0;
            for round in &s.rounds {
                assert!(round.at_ms >= end.max(bounds.warmup_ms), "overlap: {}", s.render());
                end = round.at_ms + round.hold_ms;
                assert!(end + bounds.cooldown_ms <= s.duration_ms);
                assert!((1..=2).contains(&round.faults.len()));
                pairs += usize::from(round.faults.len() == 2);
                if let [a, b] = round.faults[..] {
                    assert_ne!(a.node.group(), b.node.group(), "{}", s.render());
                }
                for f in &round.faults {
                    let fronted = !matches!(f.node, Node::Engine(_));
                    assert!(f.action != Action::Partition || fronted, "{f:?}");
                }
            }
            assert!(!s.rounds.is_empty());
            let _ = pairs;
        }
    }

    #[test]
    fn some_rounds_have_two_faults_and_every_kind_occurs() {
        let bounds = Bounds::default();
        let rounds: Vec<Round> =
            (0..50).flat_map(|seed| Schedule::from_seed(seed, 180_000, &bounds).rounds).collect();
        assert!(rounds.iter().any(|r| r.faults.len() == 2));
        for action in [Action::Kill, Action::Freeze, Action::Partition] {
            assert!(rounds.iter().flat_map(|r| &r.faults).any(|f| f.action == action));
        }
        for group in [Group::Redis, Group::Nats, Group::Pg] {
            let partitioned = |f: &&Fault| f.action == Action::Partition && f.node.group() == group;
            assert!(rounds.iter().flat_map(|r| &r.faults).any(|f| partitioned(&f)), "{group:?}");
        }
        for node in [Node::PgPrimary, Node::NatsLeader, Node::Redis(5), Node::Engine(1)] {
            assert!(rounds.iter().flat_map(|r| &r.faults).any(|f| f.node == node), "{node:?}");
        }
    }
}
