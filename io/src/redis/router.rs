//! One door to Redis for the engine, whatever its topology: a [`Router`] is either one
//! standalone server (a plain connection, plus a fencing one when replica fencing is on) or a
//! [`ClusterClient`]. Which one is decided at connect time by asking the first seed that
//! answers (`INFO cluster`, `cluster_enabled:1`), not guessed from the URL.
//!
//! Every call names the slot of its keys (`SkuKeys::slot`, or [`Slot::of_key`] for a key of
//! its own such as `seckill:active-skus`) and a [`Lane`]; a standalone router ignores the
//! slot. So call sites are the same for both topologies, and no command is ever cross-slot:
//! each carries the keys of exactly one slot.
//!
//! Not here: redirects and the slot map (`super::cluster`), reply meaning (`super::script`), the
//! `min_replica_acks` setting (`super::fence`).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;

use super::cluster::{ClusterClient, ClusterConfig, Lane, Routed};
use super::connection::{FenceConfig, Fenced, NotSentReason};
use super::fence::MinReplicaAcks;
use super::slot::Slot;
use super::{RedisClient, RedisConfig, RedisError};
use crate::resp::Reply;

/// What [`Router::connect`] needs.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Seeds from `FLASHSALE_REDIS_URL` (`super::url::RedisUrl`).
    pub seeds: Vec<SocketAddr>,
    /// Template of every connection (`addr` and `fence` are set per node and lane).
    pub node: RedisConfig,
    pub min_replica_acks: MinReplicaAcks,
    pub fence_wait_timeout: Duration,
}

impl RouterConfig {
    pub fn new(seeds: Vec<SocketAddr>, node: RedisConfig) -> RouterConfig {
        let defaults = ClusterConfig::new(Vec::new(), node.clone());
        RouterConfig {
            seeds,
            node,
            min_replica_acks: MinReplicaAcks::Auto,
            fence_wait_timeout: defaults.fence_wait_timeout,
        }
    }

    /// The cluster settings these imply (bounds of redirects and refreshes at their defaults).
    pub fn cluster(&self) -> ClusterConfig {
        ClusterConfig {
            min_replica_acks: self.min_replica_acks,
            fence_wait_timeout: self.fence_wait_timeout,
            ..ClusterConfig::new(self.seeds.clone(), self.node.clone())
        }
    }
}

/// One standalone server: a plain connection, and a fencing one when fencing is on.
pub struct Standalone {
    plain: RedisClient,
    fenced: Option<RedisClient>,
    fence_warning: Option<String>,
}

/// Redis as one server or a cluster, behind the same calls.
pub enum Router {
    Standalone(Standalone),
    Cluster(ClusterClient),
}

impl Router {
    /// A standalone router over an existing client, without fencing (the engine's and the
    /// tests' start-up path before the cluster existed).
    pub fn standalone(client: RedisClient) -> Router {
        Router::Standalone(Standalone { plain: client, fenced: None, fence_warning: None })
    }

    /// Connects to the first seed that answers, asks whether it is a cluster node, and builds
    /// the matching router. Several seeds that turn out to be standalone are refused (they
    /// would be several independent stores, not one).
    pub async fn connect(config: RouterConfig) -> Result<Router, RedisError> {
        let mut last_error = RedisError::NotSent(NotSentReason::NoNodeForSlot);
        for &seed in &config.seeds {
            let probe = RedisConfig { addr: seed, fence: FenceConfig::OFF, ..config.node.clone() };
            let client = match RedisClient::connect(probe).await {
                Ok(client) => client,
                Err(e) => {
                    last_error = e;
                    continue;
                }
            };
            let info = client.command(&[b"INFO", b"cluster"]).await?;
            if info_field(&info, "cluster_enabled") == Some("1") {
                client.close();
                return Ok(Router::Cluster(ClusterClient::connect(config.cluster()).await?));
            }
            if config.seeds.len() > 1 {
                tracing::error!(%seed, "redis: several seeds given but this one is not a cluster node");
                return Err(RedisError::NotSent(NotSentReason::NoNodeForSlot));
            }
            return Ok(Router::Standalone(standalone(client, &config).await?));
        }
        Err(last_error)
    }

    /// Sends one command whose keys all hash to `slot`.
    pub async fn request(
        &self,
        slot: Slot,
        lane: Lane,
        encode: impl Fn(&mut BytesMut),
    ) -> Result<Routed, RedisError> {
        match self {
            Router::Standalone(s) => {
                let client = s.lane(lane);
                let Fenced { reply, fence } = client.request_fenced(encode).await?;
                Ok(Routed { reply, fence, node: client.config().addr })
            }
            Router::Cluster(c) => c.request(slot, lane, encode).await,
        }
    }

    /// A command given as its arguments, routed by `slot`, on the plain lane.
    pub async fn command(&self, slot: Slot, args: &[&[u8]]) -> Result<Reply, RedisError> {
        let routed =
            self.request(slot, Lane::Plain, |buf| crate::resp::encode_command(buf, args)).await?;
        Ok(routed.reply)
    }

    /// One command to one node, unrouted (the library load on every master).
    pub async fn request_on(
        &self,
        node: SocketAddr,
        encode: impl FnOnce(&mut BytesMut),
    ) -> Result<Reply, RedisError> {
        match self {
            Router::Standalone(s) => s.plain.request(encode).await,
            Router::Cluster(c) => c.request_on(node, Lane::Plain, encode).await.map(|f| f.reply),
        }
    }

    /// The masters (one for a standalone server).
    pub fn masters(&self) -> Vec<SocketAddr> {
        match self {
            Router::Standalone(s) => vec![s.plain.config().addr],
            Router::Cluster(c) => c.masters(),
        }
    }

    /// The node that serves `slot` now.
    pub fn node_of(&self, slot: Slot) -> Option<SocketAddr> {
        match self {
            Router::Standalone(s) => Some(s.plain.config().addr),
            Router::Cluster(c) => c.node_of(slot),
        }
    }

    /// Whether the connection(s) to the node serving `slot` are up (a per-node health input
    /// for the engine's circuits).
    pub fn is_connected(&self, slot: Slot) -> bool {
        match self {
            Router::Standalone(s) => {
                s.plain.is_connected() && s.fenced.as_ref().is_none_or(RedisClient::is_connected)
            }
            Router::Cluster(c) => c
                .node_of(slot)
                .is_some_and(|addr| c.nodes().iter().any(|n| n.addr == addr && n.connected)),
        }
    }

    /// The fence applied on [`Lane::Fenced`].
    pub fn fence(&self) -> FenceConfig {
        match self {
            Router::Standalone(s) => {
                s.fenced.as_ref().map_or(FenceConfig::OFF, |f| f.config().fence)
            }
            Router::Cluster(c) => c.fence(),
        }
    }

    /// Set when `MinReplicaAcks::Auto` turned fencing off (log it at start-up).
    pub fn fence_warning(&self) -> Option<&str> {
        match self {
            Router::Standalone(s) => s.fence_warning.as_deref(),
            Router::Cluster(c) => c.fence_warning(),
        }
    }

    pub fn cluster(&self) -> Option<&ClusterClient> {
        match self {
            Router::Cluster(c) => Some(c),
            Router::Standalone(_) => None,
        }
    }

    /// The standalone connection; for a cluster, the plain connection to the first master of
    /// the map at start (unrouted: only for call sites written before the cluster, which the
    /// engine is moving to [`Router::command`]).
    pub fn first_client(&self) -> RedisClient {
        match self {
            Router::Standalone(s) => s.plain.clone(),
            Router::Cluster(c) => c.first_client(),
        }
    }

    pub fn library_generation(&self, node: SocketAddr) -> u64 {
        match self {
            Router::Standalone(_) => 0,
            Router::Cluster(c) => c.library_generation(node),
        }
    }

    pub fn close(&self) {
        match self {
            Router::Standalone(s) => {
                s.plain.close();
                if let Some(f) = &s.fenced {
                    f.close();
                }
            }
            Router::Cluster(c) => c.close(),
        }
    }
}

impl Standalone {
    fn lane(&self, lane: Lane) -> &RedisClient {
        match (lane, &self.fenced) {
            (Lane::Fenced, Some(fenced)) => fenced,
            _ => &self.plain,
        }
    }
}

async fn standalone(plain: RedisClient, config: &RouterConfig) -> Result<Standalone, RedisError> {
    let info = plain.command(&[b"INFO", b"replication"]).await?;
    let replicas = info_field(&info, "connected_slaves").and_then(|n| n.parse::<u32>().ok());
    let addr = plain.config().addr;
    let (acks, fence_warning) = config.min_replica_acks.resolve(replicas.unwrap_or(0) > 0, || {
        format!(
            "redis: {addr} has no connected replica: replica fencing is off \
                 (min_replica_acks 0); a failover can lose acknowledged reservations"
        )
    });
    if let Some(warning) = &fence_warning {
        tracing::warn!("{warning}");
    }
    let fenced = if acks > 0 {
        let fence = FenceConfig::replicas(acks, config.fence_wait_timeout);
        Some(RedisClient::connect(RedisConfig { addr, fence, ..config.node.clone() }).await?)
    } else {
        None
    };
    Ok(Standalone { plain, fenced, fence_warning })
}

/// `name:value` from an `INFO` reply.
pub fn info_field<'r>(info: &'r Reply, name: &str) -> Option<&'r str> {
    info.as_str()?.lines().find_map(|line| {
        let value = line.strip_prefix(name)?.strip_prefix(':')?;
        Some(value.trim())
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn info_fields() {
        let info = Reply::Bulk(bytes::Bytes::from_static(
            b"# Cluster\r\ncluster_enabled:1\r\n# Replication\r\nconnected_slaves:0\r\n",
        ));
        assert_eq!(info_field(&info, "cluster_enabled"), Some("1"));
        assert_eq!(info_field(&info, "connected_slaves"), Some("0"));
        assert_eq!(info_field(&info, "cluster"), None);
        assert_eq!(info_field(&Reply::Nil, "x"), None);
    }
}
