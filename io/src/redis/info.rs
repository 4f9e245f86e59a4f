//! Redis' own health for the dependency metrics (seed ch9 §12.3: memory, evictions, replication
//! lag): one `INFO memory stats replication` per master (the sections in one round trip, Redis
//! 7), read into a plain record: memory used and its limit, keys evicted, connected replicas,
//! and how many bytes of the replication stream each replica is behind the master's offset.
//!
//! What it is: [`read_info`] and [`parse_info`] (sans-I/O, tested on real `INFO` text). What it
//! is not: the loop (the edge's shard 0 samples it at a modest interval) or a decision: an
//! eviction is alerted on (`FlashsaleRedisEvictions`), not acted on here.

use std::net::SocketAddr;

use super::router::Router;
use crate::resp::Reply;

/// Replicas of one master that are reported (a master rarely has more than two).
pub const REPLICAS_REPORTED_MAX: usize = 8;

/// One replica as its master sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaInfo {
    /// `ip:port` as the master lists it.
    pub addr: String,
    /// `online`, `wait_bgsave`, `send_bulk`, ...
    pub state: String,
    /// `master_repl_offset` minus the replica's acknowledged offset.
    pub offset_lag_bytes: u64,
}

/// One master's figures (`None`: not in the reply); `error` when it could not be asked.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeInfo {
    pub node: Option<SocketAddr>,
    pub used_memory_bytes: Option<u64>,
    /// 0 when no limit is set (`maxmemory 0`).
    pub maxmemory_bytes: Option<u64>,
    pub evicted_keys_total: Option<u64>,
    pub connected_replicas: Option<u64>,
    pub replicas: Vec<ReplicaInfo>,
    pub error: Option<String>,
}

/// The figures of every master of `router`, in its order of masters.
pub async fn read_info(router: &Router) -> Vec<NodeInfo> {
    let args: [&[u8]; 4] = [b"INFO", b"memory", b"stats", b"replication"];
    let mut nodes = Vec::new();
    for node in router.masters() {
        let reply = router.request_on(node, |buf| crate::resp::encode_command(buf, &args)).await;
        let mut info = match reply {
            Ok(Reply::Error(message)) => NodeInfo {
                error: Some(format!("INFO: {}", String::from_utf8_lossy(&message))),
                ..NodeInfo::default()
            },
            Ok(reply) => parse_info(reply.as_str().unwrap_or("")),
            Err(e) => NodeInfo { error: Some(format!("INFO: {e}")), ..NodeInfo::default() },
        };
        info.node = Some(node);
        nodes.push(info);
    }
    nodes
}

/// Reads the fields out of `INFO` text.
pub fn parse_info(text: &str) -> NodeInfo {
    let field = |name: &str| -> Option<u64> {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
    };
    let master_offset = field("master_repl_offset");
    let replicas = text
        .lines()
        .filter(|line| line.starts_with("slave") && line.contains(":ip="))
        .filter_map(|line| replica(line, master_offset.unwrap_or(0)))
        .take(REPLICAS_REPORTED_MAX)
        .collect();
    NodeInfo {
        node: None,
        used_memory_bytes: field("used_memory"),
        maxmemory_bytes: field("maxmemory"),
        evicted_keys_total: field("evicted_keys"),
        connected_replicas: field("connected_slaves"),
        replicas,
        error: None,
    }
}

/// `slave0:ip=127.0.0.1,port=6380,state=online,offset=1234,lag=0`.
fn replica(line: &str, master_offset: u64) -> Option<ReplicaInfo> {
    let (_, fields) = line.split_once(':')?;
    let value = |key: &str| {
        fields.split(',').find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')).map(str::trim)
    };
    let offset: u64 = value("offset")?.parse().ok()?;
    Some(ReplicaInfo {
        addr: format!("{}:{}", value("ip")?, value("port")?),
        state: value("state").unwrap_or("").to_owned(),
        offset_lag_bytes: master_offset.saturating_sub(offset),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn info_text_is_read() {
        let text = "# Memory\r\nused_memory:1048576\r\nused_memory_human:1.00M\r\n\
                    maxmemory:2097152\r\nmaxmemory_human:2.00M\r\n# Stats\r\nevicted_keys:3\r\n\
                    # Replication\r\nrole:master\r\nconnected_slaves:2\r\n\
                    slave0:ip=127.0.0.1,port=7001,state=online,offset=900,lag=0\r\n\
                    slave1:ip=127.0.0.1,port=7002,state=wait_bgsave,offset=0,lag=1\r\n\
                    master_failover_state:no-failover\r\nmaster_repl_offset:1000\r\n";
        let info = parse_info(text);
        assert_eq!(info.used_memory_bytes, Some(1_048_576), "not used_memory_human");
        assert_eq!(info.maxmemory_bytes, Some(2_097_152));
        assert_eq!(info.evicted_keys_total, Some(3));
        assert_eq!(info.connected_replicas, Some(2));
        assert_eq!(info.replicas.len(), 2);
        assert_eq!(info.replicas[0].addr, "127.0.0.1:7001");
        assert_eq!(info.replicas[0].offset_lag_bytes, 100);
        assert_eq!(info.replicas[1].state, "wait_bgsave");
        assert_eq!(info.replicas[1].offset_lag_bytes, 1_000);
        let empty = parse_info("");
        assert_eq!((empty.used_memory_bytes, empty.replicas.len()), (None, 0));
    }
}
