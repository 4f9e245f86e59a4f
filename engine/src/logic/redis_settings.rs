//! Whether the engine may start on the Redis it found (issue 26 item 3), and how the facts
//! read are shown: `/readyz`'s `redis` detail and the `flashsale_redis_*` gauges.
//!
//! The rule: every master must run `maxmemory-policy noeviction`. Any other policy may evict a
//! request record (a same-id retry then reserves again), a user marker (a second order for one
//! buyer reaches PostgreSQL's guard) or a pending entry (a lost reservation) under memory
//! pressure, silently; with `noeviction` Redis refuses writes instead and the engine fails
//! closed (`SYSTEM_BUSY`). A policy that cannot be read counts as not `noeviction`. The
//! operator may accept the risk explicitly (`[redis] allow_eviction = true`,
//! `FLASHSALE_REDIS_ALLOW_EVICTION=1`): the engine then starts, logs the warning, and says so
//! in `/readyz` and `flashsale_redis_eviction_override`. Persistence is reported, not judged
//! (a deployment may rely on replicas instead; README "Recovery").
//!
//! What it is not: reading the settings (`flashsale_io::redis::settings`, on shard 0 at start:
//! `shard::store`).

use std::fmt::Write as _;

use flashsale_io::redis::settings::NodeSettings;

/// The one eviction policy that keeps the engine's Redis records.
pub const SAFE_POLICY: &str = "noeviction";

/// Whether a master whose policy is not [`SAFE_POLICY`] stops the start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EvictionCheck {
    /// Refuse to start (the default).
    #[default]
    Enforce,
    /// The operator accepted eviction (`[redis] allow_eviction`): start, loudly.
    Overridden,
}

/// The settings read at start, with the check they were judged by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisFacts {
    pub check: EvictionCheck,
    pub nodes: Vec<NodeSettings>,
}

/// What [`judge`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Start; each warning is logged at start.
    Start { warnings: Vec<String> },
    /// Do not start: why, naming the setting and the fix.
    Refuse(String),
}

/// Judges the masters' settings (see the module documentation).
pub fn judge(facts: &RedisFacts) -> Verdict {
    let unsafe_nodes: Vec<String> = facts
        .nodes
        .iter()
        .filter(|n| n.maxmemory_policy.as_deref() != Some(SAFE_POLICY))
        .map(|n| match (&n.maxmemory_policy, &n.error) {
            (Some(policy), _) => format!("{} has maxmemory-policy {policy}", n.node),
            (None, error) => format!(
                "{}: maxmemory-policy could not be read ({})",
                n.node,
                error.as_deref().unwrap_or("no answer")
            ),
        })
        .collect();
    if facts.nodes.is_empty() {
        return Verdict::Refuse("redis: no master answered the settings check".into());
    }
    if unsafe_nodes.is_empty() {
        return Verdict::Start { warnings: Vec::new() };
    }
    let list = unsafe_nodes.join("; ");
    match facts.check {
        EvictionCheck::Enforce => Verdict::Refuse(format!(
            "redis: {list}: every master must run maxmemory-policy noeviction, or Redis may \
             silently evict request records and user markers under memory pressure (a retry \
             reserves twice, a reservation is lost). Fix: `CONFIG SET maxmemory-policy \
             noeviction` on each master and `maxmemory-policy noeviction` in its redis.conf \
             (tuning/redis.conf); or accept the risk explicitly with [redis] allow_eviction = \
             true / FLASHSALE_REDIS_ALLOW_EVICTION=1"
        )),
        EvictionCheck::Overridden => Verdict::Start {
            warnings: vec![format!(
                "REDIS EVICTION ALLOWED by [redis] allow_eviction / FLASHSALE_REDIS_ALLOW_EVICTION: \
                 {list}; Redis may silently evict request records and user markers under memory \
                 pressure"
            )],
        },
    }
}

impl RedisFacts {
    /// Whether the override is in force (configured, and some master needed it).
    pub fn overridden(&self) -> bool {
        self.check == EvictionCheck::Overridden
            && self.nodes.iter().any(|n| n.maxmemory_policy.as_deref() != Some(SAFE_POLICY))
    }

    /// `/readyz`'s `redis` detail: the override and each master's settings as read.
    pub fn readyz_detail(&self) -> serde_json::Value {
        let nodes: Vec<serde_json::Value> = self
            .nodes
            .iter()
            .map(|n| {
                serde_json::json!({
                    "node": n.node.to_string(),
                    "maxmemory_policy": n.maxmemory_policy,
                    "appendonly": n.appendonly,
                    "appendfsync": n.appendfsync,
                    "save": n.save,
                    "error": n.error,
                })
            })
            .collect();
        serde_json::json!({ "eviction_override": self.overridden(), "nodes": nodes })
    }

    /// `flashsale_redis_eviction_override` (1 while the override lets an evicting master
    /// serve) and `flashsale_redis_settings_info{node, maxmemory_policy, appendonly,
    /// appendfsync, save}` = 1 per master (a few masters: bounded labels).
    pub fn render_metrics(&self, out: &mut String) {
        let overridden = u8::from(self.overridden());
        let _ = writeln!(
            out,
            "# TYPE flashsale_redis_eviction_override gauge\n\
             flashsale_redis_eviction_override {overridden}\n\
             # TYPE flashsale_redis_settings_info gauge"
        );
        for n in &self.nodes {
            let label = |v: &Option<String>| {
                v.as_deref().unwrap_or("unknown").replace(['"', '\\', '\n'], "_")
            };
            let _ = writeln!(
                out,
                "flashsale_redis_settings_info{{node=\"{}\",maxmemory_policy=\"{}\",appendonly=\"{}\",appendfsync=\"{}\",save=\"{}\"}} 1",
                n.node,
                label(&n.maxmemory_policy),
                label(&n.appendonly),
                label(&n.appendfsync),
                label(&n.save),
            );
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn node(port: u16, policy: Option<&str>) -> NodeSettings {
        NodeSettings {
            node: std::net::SocketAddr::from(([127, 0, 0, 1], port)),
            maxmemory_policy: policy.map(str::to_owned),
            appendonly: Some("yes".into()),
            appendfsync: Some("everysec".into()),
            save: Some(String::new()),
            error: policy.is_none().then(|| "ERR unknown command 'CONFIG'".into()),
        }
    }

    #[test]
    fn only_noeviction_everywhere_starts_unless_overridden() {
        let facts = |check, nodes| RedisFacts { check, nodes };
        let good = facts(
            EvictionCheck::Enforce,
            vec![node(1, Some("noeviction")), node(2, Some("noeviction"))],
        );
        assert_eq!(judge(&good), Verdict::Start { warnings: vec![] });
        assert!(!good.overridden());
        let lru = facts(
            EvictionCheck::Enforce,
            vec![node(1, Some("noeviction")), node(2, Some("allkeys-lru"))],
        );
        let Verdict::Refuse(why) = judge(&lru) else { panic!("must refuse") };
        assert!(why.contains("127.0.0.1:2 has maxmemory-policy allkeys-lru"), "{why}");
        assert!(
            why.contains("CONFIG SET maxmemory-policy noeviction")
                && why.contains("allow_eviction"),
            "{why}"
        );
        assert!(!why.contains("127.0.0.1:1 "), "{why}");
        let unreadable = facts(EvictionCheck::Enforce, vec![node(3, None)]);
        assert!(
            matches!(judge(&unreadable), Verdict::Refuse(w) if w.contains("could not be read"))
        );
        assert!(matches!(judge(&facts(EvictionCheck::Enforce, vec![])), Verdict::Refuse(_)));
        let allowed = facts(EvictionCheck::Overridden, lru.nodes.clone());
        let Verdict::Start { warnings } = judge(&allowed) else { panic!("override starts") };
        assert!(warnings[0].contains("REDIS EVICTION ALLOWED"), "{warnings:?}");
        assert!(allowed.overridden());
        assert_eq!(allowed.readyz_detail()["eviction_override"], true);
        let mut text = String::new();
        allowed.render_metrics(&mut text);
        assert!(text.contains("flashsale_redis_eviction_override 1\n"), "{text}");
        assert!(text.contains("maxmemory_policy=\"allkeys-lru\",appendonly=\"yes\",appendfsync=\"everysec\",save=\"\"} 1"), "{text}");
    }
}
