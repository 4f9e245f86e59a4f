//! The Redis Cluster client of one glommio executor: the slot map, one pipelined
//! [`RedisClient`] per master (and a second, fencing one per master when replica fencing is
//! on), and the redirect loop. Single-threaded (`Rc`): each owner shard builds its own.
//!
//! How a command travels ([`ClusterClient::request`]):
//! - The caller names the command's [`Slot`] (computed once per SKU, `SkuKeys::slot`) and its
//!   [`Lane`]: `Fenced` for a command whose reply may be promised only once replicas hold it
//!   (a creating `reserve`), `Plain` for everything else. The map gives the master; the
//!   command goes into that master's pipeline for the lane.
//! - `MOVED slot addr`: the command did not run. The slot is pointed at `addr` at once, the
//!   command is resent there (same bytes, so the same ids: safe), and a full map refresh is
//!   scheduled in the background (rate-limited: at most one per `refresh_interval_min`).
//! - `ASK slot addr`: `ASKING` + the command go to `addr` once, adjacent in one batch; the
//!   map is unchanged (the slot is only being migrated).
//! - `TRYAGAIN` (a migrating slot whose keys are split, which a multi-key `FCALL` such as
//!   `reserve` sees for the whole migration): retried after a full-jitter backoff, bounded.
//! - Redirects and retries are bounded; past the bound the caller gets
//!   `NotSent(RedirectsExhausted | TryAgainExhausted)`: nothing ran.
//! - A connection failure on a node also schedules a refresh, so a promoted replica is found
//!   without waiting for a `MOVED` from a node that is dead.
//!
//! Health (the engine owns the circuits, `logic/circuit.rs`): [`ClusterClient::node_of`] says
//! which master serves a slot, [`ClusterClient::nodes`] gives each node's connection state, and
//! [`ClusterClient::topology_version`] moves whenever any slot changes owner, so the engine can
//! close exactly the SKUs of a master that is down or whose slots moved (a failover).
//!
//! Not here: the meaning of replies and "function not found" reloads (`super::script`, which
//! uses [`ClusterClient::request_on`] to load the library on the node that lacked it), the
//! standalone/cluster choice (`super::router`), parsing (`super::slot`).

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rand::Rng;

use super::connection::{FenceConfig, FenceOutcome, Fenced, NotSentReason, UnknownReason};
use super::fence::MinReplicaAcks;
use super::slot::{MapError, Redirect, Slot, SlotMap};
use super::{RedisClient, RedisConfig, RedisError};
use crate::resp::Reply;

/// Which connection of a master a command takes (see `connection::FenceConfig` for why
/// fenced commands have a connection of their own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    Plain,
    /// The reply comes with the `WAIT` answer of its batch. Without fencing configured this
    /// is the plain connection and the outcome is `FenceOutcome::NotFenced`.
    Fenced,
}

/// A reply, its fence, and the node that gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    pub reply: Reply,
    pub fence: FenceOutcome,
    pub node: SocketAddr,
}

/// Settings of one executor's cluster client.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Where to read the slot map from at start (any node of the cluster will do).
    pub seeds: Vec<SocketAddr>,
    /// Template of every node connection (its `addr` and `fence` are set per node and lane).
    pub node: RedisConfig,
    /// Replicas a fenced command must reach (resolved at connect, see [`MinReplicaAcks`]).
    pub min_replica_acks: MinReplicaAcks,
    /// `WAIT` timeout of the fenced lane; below `node.command_timeout`.
    pub fence_wait_timeout: Duration,
    /// `MOVED` + `ASK` hops one call may follow.
    pub redirects_max: u32,
    /// `TRYAGAIN` retries one call may make, and their full-jitter backoff.
    pub tryagain_attempts_max: u32,
    pub tryagain_backoff_base: Duration,
    pub tryagain_backoff_max: Duration,
    /// Least time between two full map refreshes.
    pub refresh_interval_min: Duration,
}

impl ClusterConfig {
    /// Values for shards next to the cluster; each spelled out here with its reason.
    pub fn new(seeds: Vec<SocketAddr>, node: RedisConfig) -> ClusterConfig {
        ClusterConfig {
            seeds,
            node,
            min_replica_acks: MinReplicaAcks::Auto,
            // A healthy replica acknowledges within a millisecond on a LAN; 50 ms leaves room
            // for a busy one while staying far below the 250 ms command deadline.
            fence_wait_timeout: Duration::from_millis(50),
            // One MOVED (stale map) plus one ASK (migration) is the normal worst case; a few
            // more cover a map that changes twice during one call.
            redirects_max: 5,
            // A slot migration of one SKU (a handful of keys) takes milliseconds; 8 retries
            // with a 5..80 ms jittered backoff wait up to ~0.3 s for it before giving up.
            tryagain_attempts_max: 8,
            tryagain_backoff_base: Duration::from_millis(5),
            tryagain_backoff_max: Duration::from_millis(80),
            // A failover takes ~2.5 s here; refreshing every 100 ms finds the new master soon
            // after without hammering a cluster in trouble.
            refresh_interval_min: Duration::from_millis(100),
        }
    }

    pub fn validate(&self) -> Result<(), &'static str> {
        self.node.validate()?;
        if self.seeds.is_empty() {
            return Err("redis cluster needs at least one seed");
        }
        if self.fence_wait_timeout.is_zero() || self.fence_wait_timeout >= self.node.command_timeout
        {
            return Err("redis fence_wait_timeout must be above zero and below command_timeout");
        }
        if self.tryagain_backoff_base.is_zero()
            || self.tryagain_backoff_base > self.tryagain_backoff_max
        {
            return Err("redis tryagain_backoff_base must be above zero and at most _max");
        }
        Ok(())
    }
}

/// One node's state, for health checks and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeState {
    pub addr: SocketAddr,
    /// Serves at least one slot in the current map.
    pub is_master: bool,
    /// Slots it serves in the current map.
    pub slots: u32,
    pub replicas_online: u32,
    pub connected: bool,
    pub in_flight: usize,
}

/// Redirect counters, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClusterStats {
    pub moved_total: u64,
    pub ask_total: u64,
    pub tryagain_total: u64,
    pub refreshes_total: u64,
    pub topology_version: u64,
}

struct Node {
    addr: SocketAddr,
    plain: RedisClient,
    fenced: Option<RedisClient>,
    /// Bumped by `script` after loading the library here (see `script::Functions`).
    library_generation: Cell<u64>,
}

impl Node {
    fn lane(&self, lane: Lane) -> &RedisClient {
        match (lane, &self.fenced) {
            (Lane::Fenced, Some(fenced)) => fenced,
            _ => &self.plain,
        }
    }

    fn never_connected(&self) -> bool {
        self.plain.connects_total() == 0
    }
}

struct Inner {
    config: ClusterConfig,
    fence: FenceConfig,
    fence_warning: Option<String>,
    map: RefCell<SlotMap>,
    /// Every node we hold connections to: the map's masters, plus ASK targets until the next
    /// refresh prunes them. Bounded by `NODES_MAX`.
    nodes: RefCell<Vec<Rc<Node>>>,
    stats: Cell<ClusterStats>,
    refresh_running: Cell<bool>,
    refresh_again: Cell<bool>,
    last_refresh: Cell<Option<Instant>>,
    closed: Cell<bool>,
    /// The plain connection to the first master at start (`first_client`).
    first: RefCell<Option<RedisClient>>,
}

/// Nodes one client keeps connections to.
const NODES_MAX: usize = SlotMap::MASTERS_MAX + 16;

/// A Redis Cluster client on the current glommio executor. Cheap to clone.
#[derive(Clone)]
pub struct ClusterClient {
    inner: Rc<Inner>,
}

impl ClusterClient {
    /// Reads the slot map from the first seed that answers, resolves the fence, and connects
    /// to every master (waiting for each, bounded by `connect_timeout`).
    pub async fn connect(config: ClusterConfig) -> Result<ClusterClient, RedisError> {
        if let Err(message) = config.validate() {
            panic!("invalid ClusterConfig: {message}");
        }
        let map = discover(&config, &config.seeds).await?;
        let (fence, fence_warning) = resolve_fence(&config, &map);
        if let Some(warning) = &fence_warning {
            tracing::warn!("{warning}");
        }
        let inner = Rc::new(Inner {
            config,
            fence,
            fence_warning,
            map: RefCell::new(SlotMap::empty()),
            nodes: RefCell::new(Vec::new()),
            stats: Cell::new(ClusterStats::default()),
            refresh_running: Cell::new(false),
            refresh_again: Cell::new(false),
            last_refresh: Cell::new(Some(Instant::now())),
            closed: Cell::new(false),
            first: RefCell::new(None),
        });
        inner.install(map).await;
        let first = inner.nodes.borrow().first().map(|n| n.plain.clone());
        *inner.first.borrow_mut() = first;
        Ok(ClusterClient { inner })
    }

    /// Sends one command for `slot` on `lane`, following redirects. `encode` must append
    /// exactly one command (it may be called again for a resend).
    pub async fn request(
        &self,
        slot: Slot,
        lane: Lane,
        encode: impl Fn(&mut BytesMut),
    ) -> Result<Routed, RedisError> {
        let inner = &self.inner;
        let mut hops = Hops::default();
        loop {
            let (node, ask) = match hops.asking.take() {
                Some(node) => (node, true),
                None => (
                    inner
                        .node_for(slot)
                        .ok_or(RedisError::NotSent(NotSentReason::NoNodeForSlot))?,
                    false,
                ),
            };
            let result = inner.send(&node, lane, ask, &encode).await;
            let fenced = match result {
                Ok(fenced) => fenced,
                Err(e) => {
                    if is_node_trouble(&e) {
                        inner.schedule_refresh();
                    }
                    return Err(e);
                }
            };
            let redirect = match &fenced.reply {
                Reply::Error(message) => Redirect::parse(message, node.addr.ip()),
                _ => None,
            };
            match inner.follow(redirect, &mut hops)? {
                Next::Answer => {
                    return Ok(Routed { reply: fenced.reply, fence: fenced.fence, node: node.addr })
                }
                Next::Resend => {}
                Next::ResendAfter(pause) => glommio::timer::sleep(pause).await,
            }
        }
    }

    /// One command to one node, without routing (e.g. `FUNCTION LOAD` on every master).
    pub async fn request_on(
        &self,
        addr: SocketAddr,
        lane: Lane,
        encode: impl FnOnce(&mut BytesMut),
    ) -> Result<Fenced, RedisError> {
        let node =
            self.inner.node_at(addr).ok_or(RedisError::NotSent(NotSentReason::NoNodeForSlot))?;
        if node.never_connected() {
            node.plain.wait_connected(self.inner.config.node.connect_timeout).await?;
        }
        node.lane(lane).request_fenced(encode).await
    }

    /// The plain connection to the first master of the map at start, unrouted (see
    /// `script::Functions::client`). `discover` refuses a map without masters, so there is
    /// one; should that ever fail, a closed client answers every request `Closed`.
    pub fn first_client(&self) -> RedisClient {
        if let Some(client) = self.inner.first.borrow().as_ref() {
            return client.clone();
        }
        let client = RedisClient::new(self.inner.config.node.clone());
        client.close();
        client
    }

    /// The master serving `slot` in the current map.
    pub fn node_of(&self, slot: Slot) -> Option<SocketAddr> {
        self.inner.map.borrow().addr_of(slot)
    }

    /// The masters of the current map.
    pub fn masters(&self) -> Vec<SocketAddr> {
        self.inner.map.borrow().masters.iter().map(|m| m.addr).collect()
    }

    /// Every node this client holds connections to, with its share of the map.
    pub fn nodes(&self) -> Vec<NodeState> {
        let map = self.inner.map.borrow();
        let mut slots = vec![0u32; map.masters.len()];
        for slot in 0..super::slot::SLOT_COUNT {
            if let Some(index) = Slot::new(slot).and_then(|s| map.master_of(s)) {
                slots[index] += 1;
            }
        }
        self.inner
            .nodes
            .borrow()
            .iter()
            .map(|node| {
                let index = map.masters.iter().position(|m| m.addr == node.addr);
                NodeState {
                    addr: node.addr,
                    is_master: index.is_some_and(|i| slots[i] > 0),
                    slots: index.map_or(0, |i| slots[i]),
                    replicas_online: index.map_or(0, |i| map.masters[i].replicas_online),
                    connected: node.plain.is_connected()
                        && node.fenced.as_ref().is_none_or(RedisClient::is_connected),
                    in_flight: node.plain.in_flight()
                        + node.fenced.as_ref().map_or(0, RedisClient::in_flight),
                }
            })
            .collect()
    }

    /// Moves whenever any slot changes owner (a `MOVED`, a failover, a reshard).
    pub fn topology_version(&self) -> u64 {
        self.inner.stats.get().topology_version
    }

    pub fn stats(&self) -> ClusterStats {
        self.inner.stats.get()
    }

    /// The fence the fenced lane applies (resolved from [`ClusterConfig::min_replica_acks`]).
    pub fn fence(&self) -> FenceConfig {
        self.inner.fence
    }

    /// Why fencing is off although it was left to default, if it is.
    pub fn fence_warning(&self) -> Option<&str> {
        self.inner.fence_warning.as_deref()
    }

    /// Refreshes the map now (the background refresh does this by itself after redirects and
    /// node failures).
    pub async fn refresh(&self) -> Result<(), RedisError> {
        self.inner.refresh_now().await
    }

    /// The library generation of a node (see `script::Functions`); 0 for an unknown node.
    pub fn library_generation(&self, addr: SocketAddr) -> u64 {
        self.inner.node_at_known(addr).map_or(0, |n| n.library_generation.get())
    }

    pub fn set_library_generation(&self, addr: SocketAddr, generation: u64) {
        if let Some(node) = self.inner.node_at_known(addr) {
            node.library_generation.set(generation);
        }
    }

    /// Stops background refreshes and drops every connection.
    pub fn close(&self) {
        self.inner.closed.set(true);
        for node in self.inner.nodes.borrow_mut().drain(..) {
            node.plain.close();
            if let Some(fenced) = &node.fenced {
                fenced.close();
            }
        }
    }
}

/// Failures after which the map may be stale: the node is gone or unreachable.
fn is_node_trouble(e: &RedisError) -> bool {
    matches!(
        e,
        RedisError::NotSent(
            NotSentReason::Disconnected
                | NotSentReason::ConnectionLost
                | NotSentReason::ConnectTimedOut
        ) | RedisError::OutcomeUnknown(UnknownReason::ConnectionLost | UnknownReason::TimedOut)
    )
}

/// How far one [`ClusterClient::request`] has travelled: redirects followed, `TRYAGAIN`
/// retries made, and the node an `ASK` sends the next attempt to.
#[derive(Default)]
struct Hops {
    redirects: u32,
    tryagain: u32,
    asking: Option<Rc<Node>>,
}

/// What a request does after one reply.
enum Next {
    /// The reply is the caller's (no redirect, or `CLUSTERDOWN`, which is the caller's too).
    Answer,
    /// Resend now: the map points elsewhere (`MOVED`), or `ASKING` goes first (`ASK`).
    Resend,
    /// Resend after this backoff (`TRYAGAIN`).
    ResendAfter(Duration),
}

impl Inner {
    /// Learns from one reply's redirect and decides the request's next step; past the bounds
    /// the command is `NotSent` (it did not run).
    #[inline]
    fn follow(
        self: &Rc<Self>,
        redirect: Option<Redirect>,
        hops: &mut Hops,
    ) -> Result<Next, RedisError> {
        match redirect {
            None => Ok(Next::Answer),
            Some(Redirect::ClusterDown) => {
                self.schedule_refresh();
                Ok(Next::Answer)
            }
            Some(Redirect::Moved { slot: moved, addr }) => {
                hops.redirects += 1;
                self.bump(|s| s.moved_total += 1);
                if hops.redirects > self.config.redirects_max {
                    return Err(RedisError::NotSent(NotSentReason::RedirectsExhausted));
                }
                self.apply_moved(moved, addr);
                self.schedule_refresh();
                Ok(Next::Resend)
            }
            Some(Redirect::Ask { addr, .. }) => {
                hops.redirects += 1;
                self.bump(|s| s.ask_total += 1);
                if hops.redirects > self.config.redirects_max {
                    return Err(RedisError::NotSent(NotSentReason::RedirectsExhausted));
                }
                let node =
                    self.node_at(addr).ok_or(RedisError::NotSent(NotSentReason::NoNodeForSlot))?;
                hops.asking = Some(node);
                Ok(Next::Resend)
            }
            Some(Redirect::TryAgain) => {
                hops.tryagain += 1;
                self.bump(|s| s.tryagain_total += 1);
                if hops.tryagain > self.config.tryagain_attempts_max {
                    return Err(RedisError::NotSent(NotSentReason::TryAgainExhausted));
                }
                Ok(Next::ResendAfter(self.tryagain_backoff(hops.tryagain)))
            }
        }
    }

    fn bump(&self, f: impl FnOnce(&mut ClusterStats)) {
        let mut stats = self.stats.get();
        f(&mut stats);
        self.stats.set(stats);
    }

    fn node_for(&self, slot: Slot) -> Option<Rc<Node>> {
        let addr = self.map.borrow().addr_of(slot)?;
        self.node_at(addr)
    }

    fn node_at_known(&self, addr: SocketAddr) -> Option<Rc<Node>> {
        self.nodes.borrow().iter().find(|n| n.addr == addr).cloned()
    }

    /// The node at `addr`, connecting to it (in the background) if it is new.
    fn node_at(&self, addr: SocketAddr) -> Option<Rc<Node>> {
        if let Some(node) = self.node_at_known(addr) {
            return Some(node);
        }
        let mut nodes = self.nodes.borrow_mut();
        if nodes.len() >= NODES_MAX || self.closed.get() {
            return None;
        }
        let node = Rc::new(self.new_node(addr));
        nodes.push(Rc::clone(&node));
        Some(node)
    }

    fn new_node(&self, addr: SocketAddr) -> Node {
        let plain = RedisClient::new(RedisConfig {
            addr,
            fence: FenceConfig::OFF,
            ..self.config.node.clone()
        });
        let fenced = self.fence.is_on().then(|| {
            RedisClient::new(RedisConfig { addr, fence: self.fence, ..self.config.node.clone() })
        });
        Node { addr, plain, fenced, library_generation: Cell::new(0) }
    }

    async fn send(
        &self,
        node: &Node,
        lane: Lane,
        ask: bool,
        encode: &impl Fn(&mut BytesMut),
    ) -> Result<Fenced, RedisError> {
        let client = node.lane(lane);
        // A node we just learned of (MOVED, ASK, a refresh) is still connecting: wait for it,
        // bounded. A node that was up and is down fails fast instead (the engine's circuit
        // and the background refresh deal with it).
        if client.connects_total() == 0 {
            client.wait_connected(self.config.node.connect_timeout).await?;
        }
        if ask {
            client.request_asking(|buf| encode(buf)).await
        } else {
            client.request_fenced(|buf| encode(buf)).await
        }
    }

    fn apply_moved(&self, slot: Slot, addr: SocketAddr) {
        if self.node_at(addr).is_none() {
            return;
        }
        let changed = {
            let mut map = self.map.borrow_mut();
            if map.addr_of(slot) == Some(addr) {
                false
            } else {
                map.assign(slot, addr).is_ok()
            }
        };
        if changed {
            self.bump(|s| s.topology_version += 1);
        }
    }

    fn tryagain_backoff(&self, attempt: u32) -> Duration {
        let ceiling = self
            .config
            .tryagain_backoff_base
            .saturating_mul(1u32 << attempt.min(16))
            .min(self.config.tryagain_backoff_max);
        let ceiling_us = u64::try_from(ceiling.as_micros()).unwrap_or(u64::MAX).max(1);
        Duration::from_micros(rand::thread_rng().gen_range(1..=ceiling_us))
    }

    /// Starts a background refresh unless one is running (then it runs once more after it),
    /// never sooner than `refresh_interval_min` after the last.
    fn schedule_refresh(self: &Rc<Self>) {
        if self.closed.get() {
            return;
        }
        if self.refresh_running.replace(true) {
            self.refresh_again.set(true);
            return;
        }
        let inner = Rc::clone(self);
        glommio::spawn_local(async move {
            loop {
                if let Some(last) = inner.last_refresh.get() {
                    let due = last + inner.config.refresh_interval_min;
                    let wait = due.saturating_duration_since(Instant::now());
                    if !wait.is_zero() {
                        glommio::timer::sleep(wait).await;
                    }
                }
                if inner.closed.get() {
                    break;
                }
                inner.refresh_again.set(false);
                if let Err(e) = inner.refresh_now().await {
                    tracing::warn!(error = %e, "redis cluster: slot map refresh failed");
                }
                if !inner.refresh_again.get() {
                    break;
                }
            }
            inner.refresh_running.set(false);
        })
        .detach();
    }

    /// Reads the map from a node we know (connected ones first), else from a seed, and
    /// installs it.
    async fn refresh_now(&self) -> Result<(), RedisError> {
        self.last_refresh.set(Some(Instant::now()));
        self.bump(|s| s.refreshes_total += 1);
        let mut candidates: Vec<SocketAddr> = {
            let nodes = self.nodes.borrow();
            let connected = nodes.iter().filter(|n| n.plain.is_connected()).map(|n| n.addr);
            connected.collect()
        };
        for seed in &self.config.seeds {
            if !candidates.contains(seed) {
                candidates.push(*seed);
            }
        }
        let map = discover(&self.config, &candidates).await?;
        self.install(map).await;
        Ok(())
    }

    /// Connects to the map's new masters (bounded wait), then swaps the map in and drops the
    /// nodes it no longer names.
    async fn install(&self, map: SlotMap) {
        let new_nodes: Vec<Rc<Node>> = map
            .masters
            .iter()
            .filter(|m| self.node_at_known(m.addr).is_none())
            .filter_map(|m| self.node_at(m.addr))
            .collect();
        let timeout = self.config.node.connect_timeout;
        let waits = new_nodes.iter().map(|n| n.plain.wait_connected(timeout));
        for (node, result) in new_nodes.iter().zip(futures::future::join_all(waits).await) {
            if let Err(e) = result {
                tracing::warn!(addr = %node.addr, error = %e, "redis cluster: new master not reachable yet");
            }
        }
        let changed = *self.map.borrow() != map;
        {
            let masters: Vec<SocketAddr> = map.masters.iter().map(|m| m.addr).collect();
            self.nodes.borrow_mut().retain(|n| masters.contains(&n.addr));
        }
        *self.map.borrow_mut() = map;
        if changed {
            self.bump(|s| s.topology_version += 1);
        }
    }
}

/// The map from the first of `candidates` that answers with a usable one.
async fn discover(
    config: &ClusterConfig,
    candidates: &[SocketAddr],
) -> Result<SlotMap, RedisError> {
    let mut last_error = RedisError::NotSent(NotSentReason::NoNodeForSlot);
    for &addr in candidates {
        match read_map(config, addr).await {
            Ok(map) if map.masters.is_empty() => {
                tracing::warn!(%addr, "redis cluster: node serves no slots; trying the next");
            }
            Ok(map) => return Ok(map),
            Err(e) => {
                tracing::warn!(%addr, error = %e, "redis cluster: no slot map from this node");
                last_error = e;
            }
        }
    }
    Err(last_error)
}

/// `CLUSTER SHARDS`, or `CLUSTER SLOTS` on servers older than 7, over a short-lived
/// connection (so a refresh never queues behind the hot path's pipeline).
async fn read_map(config: &ClusterConfig, addr: SocketAddr) -> Result<SlotMap, RedisError> {
    let client =
        RedisClient::connect(RedisConfig { addr, fence: FenceConfig::OFF, ..config.node.clone() })
            .await?;
    let shards = client.command(&[b"CLUSTER", b"SHARDS"]).await;
    let result = match shards {
        Ok(reply @ Reply::Array(_)) => SlotMap::from_shards(&reply, addr.ip()).map_err(map_error),
        Ok(Reply::Error(_)) => {
            let slots = client.command(&[b"CLUSTER", b"SLOTS"]).await?;
            SlotMap::from_slots(&slots, addr.ip()).map_err(map_error)
        }
        Ok(_) => Err(map_error(MapError::Shape("CLUSTER SHARDS"))),
        Err(e) => Err(e),
    };
    client.close();
    result
}

fn map_error(e: MapError) -> RedisError {
    tracing::warn!(error = %e, "redis cluster: unusable slot map");
    RedisError::NotSent(NotSentReason::NoNodeForSlot)
}

/// `Auto`: 1 when every master has an online replica, else 0 with a warning (CONTRACT.md
/// section 2).
fn resolve_fence(config: &ClusterConfig, map: &SlotMap) -> (FenceConfig, Option<String>) {
    let bare: Vec<String> =
        map.masters.iter().filter(|m| m.replicas_online == 0).map(|m| m.addr.to_string()).collect();
    let (acks, warning) = config.min_replica_acks.resolve(bare.is_empty(), || {
        format!(
            "redis: masters without an online replica ({}): replica fencing is off \
             (min_replica_acks 0); a failover can lose acknowledged reservations",
            bare.join(", ")
        )
    });
    (FenceConfig::replicas(acks, config.fence_wait_timeout), warning)
}
