//! Replica fencing's setting: [`MinReplicaAcks`], how many replicas must hold a fenced command
//! (`FLASHSALE_REDIS_MIN_REPLICA_ACKS` / `[redis] min_replica_acks`, CONTRACT.md section 2),
//! and its default rule (`auto`: 1 when every master serving the SKUs has a replica online,
//! else 0 with a warning).
//!
//! What it is: the setting as parsed from configuration and resolved once at connect time, the
//! same way for a standalone server (`router.rs`) and a cluster (`cluster.rs`). Both topologies
//! import it from here, so neither imports the other for it.
//!
//! What it is not: the fencing itself. The resolved count becomes a
//! `connection::FenceConfig`, and the connection appends the one `WAIT` per batch
//! (`connection.rs`, DESIGN.md section 11).
//!
//! Read next: `connection.rs` (`FenceConfig`, `FenceOutcome`).

/// `FLASHSALE_REDIS_MIN_REPLICA_ACKS` / `[redis] min_replica_acks` (CONTRACT.md section 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MinReplicaAcks {
    /// 1 when every master serving the SKUs has a replica online, else 0 with a warning.
    Auto,
    Exactly(u32),
}

impl MinReplicaAcks {
    /// Parses the setting's text: a number, or `auto`.
    pub fn parse(text: &str) -> Result<MinReplicaAcks, String> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("auto") {
            return Ok(MinReplicaAcks::Auto);
        }
        match text.parse::<u32>() {
            Ok(n) if n <= 16 => Ok(MinReplicaAcks::Exactly(n)),
            _ => Err(format!("min_replica_acks must be `auto` or 0..=16, got {text:?}")),
        }
    }

    /// The number of acks, and the warning to log when `Auto` falls back to 0.
    pub fn resolve(
        self,
        every_master_has_a_replica: bool,
        warning: impl FnOnce() -> String,
    ) -> (u32, Option<String>) {
        match self {
            MinReplicaAcks::Exactly(n) => (n, None),
            MinReplicaAcks::Auto if every_master_has_a_replica => (1, None),
            MinReplicaAcks::Auto => (0, Some(warning())),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn min_replica_acks_setting() {
        assert_eq!(MinReplicaAcks::parse("auto").unwrap(), MinReplicaAcks::Auto);
        assert_eq!(MinReplicaAcks::parse(" 2 ").unwrap(), MinReplicaAcks::Exactly(2));
        assert!(MinReplicaAcks::parse("-1").is_err());
        assert!(MinReplicaAcks::parse("17").is_err());
        let warn = || "w".to_string();
        assert_eq!(MinReplicaAcks::Auto.resolve(true, warn), (1, None));
        assert_eq!(MinReplicaAcks::Auto.resolve(false, warn), (0, Some("w".into())));
        assert_eq!(MinReplicaAcks::Exactly(0).resolve(true, warn), (0, None));
        assert_eq!(MinReplicaAcks::Exactly(2).resolve(false, warn), (2, None));
    }
}
