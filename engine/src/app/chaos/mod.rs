//! `flashsale chaos --seed N --duration-s S --dir D [--json F]` (CONTRACT.md section 1, issue
//! 27): a sale on the `ha` topology with two engine instances behind the balancer, while a
//! nemesis driven only by the seed kills, freezes, restarts and partitions nodes — sometimes
//! two at once — and an auditor that judges every answer the buyers got against what the
//! stores hold at the end. The same seed gives the same schedule (printed first); the exit
//! status is 0 when no invariant broke.
//!
//! Files: `schedule.rs` (the seed → the rounds of faults, sans-I/O), `proxy.rs` (the
//! fault-injecting TCP proxy), `instances.rs` (the engines as child processes), `nemesis.rs`
//! (carrying the schedule out), `buyers.rs` (the generator and its record), `http.rs` (their
//! client), `audit.rs` (the rules, sans-I/O), `run.rs` (all of it in order). This file only
//! declares them and re-exports; no part imports it.

pub mod audit;
mod buyers;
mod http;
mod instances;
mod nemesis;
pub mod proxy;
mod run;
pub mod schedule;

pub use run::{run, ChaosPlan, NegativeControl, RoundFigures, Verdict};
