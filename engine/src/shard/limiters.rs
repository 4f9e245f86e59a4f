//! The shard's request limiters: per client address (before any HMAC: it is what protects
//! the CPU; loopback exempt), per buyer for submissions, per buyer for reads and order
//! changes, and the throttle of one noisy log line. Each is a fixed-size token-bucket table
//! (`logic::limiter`), one per shard.
//!
//! Not here: per-SKU admission (`logic::partition`) and adaptive overload shedding.

use std::cell::{Cell, RefCell};
use std::net::IpAddr;

use super::config::EdgeConfig;
use crate::logic::limiter::{ip_key, Limiter, Throttle};

pub struct Limiters {
    user: RefCell<Limiter>,
    ip: RefCell<Limiter>,
    read: RefCell<Limiter>,
    /// One log line a second for bad payment-callback signatures (the rest are counted).
    bad_signature_log: Cell<Throttle>,
}

impl Limiters {
    pub fn new(config: &EdgeConfig) -> Limiters {
        let slots = config.limiter_slots;
        Limiters {
            user: RefCell::new(Limiter::new(config.user_rate, slots)),
            ip: RefCell::new(Limiter::new(config.ip_rate, slots)),
            read: RefCell::new(Limiter::new(config.read_user_rate, slots)),
            bad_signature_log: Cell::new(Throttle::new(1_000)),
        }
    }

    /// The address limit; loopback is exempt. `Err(retry_after_ms)` when over it.
    pub fn check_address(&self, peer_ip: Option<IpAddr>, now_ms: u64) -> Result<(), u64> {
        match peer_ip.filter(|ip| !ip.is_loopback()) {
            Some(ip) => self.ip.borrow_mut().check(ip_key(ip), now_ms),
            None => Ok(()),
        }
    }

    /// The per-buyer limit of submissions.
    pub fn check_submitter(&self, user_id: u64, now_ms: u64) -> Result<(), u64> {
        self.user.borrow_mut().check(user_id, now_ms)
    }

    /// The per-buyer limit of reads and order changes.
    pub fn check_reader(&self, user_id: u64, now_ms: u64) -> Result<(), u64> {
        self.read.borrow_mut().check(user_id, now_ms)
    }

    /// Whether a bad-signature line may be logged now, and how many were not since.
    pub fn bad_signature_log(&self, now_ms: u64) -> Option<u64> {
        let mut throttle = self.bad_signature_log.get();
        let due = throttle.allow(now_ms);
        self.bad_signature_log.set(throttle);
        due
    }
}
