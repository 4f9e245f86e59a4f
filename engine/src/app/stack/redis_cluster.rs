//! A private Redis Cluster on loopback: 3 masters + 3 replicas (`stack up --topology
//! cluster`, and the shared cluster of `tests/tests/redis_cluster.rs`).
//!
//! Layout: `DIR/node-0` .. `DIR/node-5`, each with the usual `pid`, `port`, `server.log`,
//! and the node's `nodes.conf` (the cluster's own record of who is who, which lets a node
//! restarted on its port rejoin). Ports are below 55536 with port + 10000 free, because the
//! cluster bus listens there.
//!
//! `ensure` is idempotent: six healthy nodes are reused; a cluster created before with some
//! nodes dead gets those restarted on their ports (they rejoin, as replicas if they were
//! failed over); anything else is created afresh with `redis-cli --cluster create`. It
//! returns only once `cluster_state:ok` holds on every node and every replica is in sync. A
//! call that fails part-way stops the nodes it started.
//!
//! Also here: a blocking one-command client ([`call`]) for start-up checks and drills, so
//! tests and the stack speak to nodes the same way.
//!
//! Not here: the engine's cluster client (`flashsale_io::redis::cluster`).

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bytes::BytesMut;
use flashsale_io::resp::{self, Reply};

use super::error::{io_err, StackError};
use super::kind::{find_binary, Kind};
use super::process::process_matches;
use super::server::{free_port, poll_until_clear, spawn_and_wait_with, Server};

/// 3 masters, each with one replica.
pub const NODE_COUNT: usize = 6;
pub const MASTER_COUNT: usize = 3;

/// Names `stack down` reports, one per node.
const NODE_NAMES: [&str; NODE_COUNT] = [
    "redis-cluster node-0",
    "redis-cluster node-1",
    "redis-cluster node-2",
    "redis-cluster node-3",
    "redis-cluster node-4",
    "redis-cluster node-5",
];

/// The cluster bus is the client port + 10000 (Redis' fixed offset).
const BUS_PORT_OFFSET: u16 = 10_000;

/// Measured here: creation to `cluster_state:ok` takes ~2 s, a restarted node resyncs in well
/// under a second; this bound is for a loaded machine.
const HEALTHY_TIMEOUT: Duration = Duration::from_secs(60);

/// One node's command-line settings, each with its reason.
const NODE_ARGS: [&str; 6] = [
    "--cluster-enabled",
    "yes",
    // A dead master is failed over in ~2.5 s (measured): short enough for drills.
    "--cluster-node-timeout",
    "1000",
    // One master down must close only its own slots, not the whole cluster: the client
    // keeps a circuit per node (DESIGN.md section 11).
    "--cluster-require-full-coverage",
    "no",
];

/// One node of the cluster as started (its role changes with failovers: ask the node).
#[derive(Debug)]
pub struct ClusterNode {
    pub index: usize,
    pub server: Server,
}

impl ClusterNode {
    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }
}

/// A running private cluster.
#[derive(Debug)]
pub struct RedisCluster {
    pub dir: PathBuf,
    pub nodes: Vec<ClusterNode>,
    /// The client port each node announces instead of its own, by node index (empty: its
    /// own); see [`RedisCluster::announce_clients`].
    announced: Vec<u16>,
}

impl RedisCluster {
    /// The running cluster under `dir`, repaired or created as needed (see the module doc).
    /// Returns it and whether any node was started by this call.
    pub fn ensure(dir: &Path) -> Result<(RedisCluster, bool), StackError> {
        fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
        let dir = dir.canonicalize().map_err(io_err(format!("canonicalize {}", dir.display())))?;
        let running: Vec<Option<Server>> = (0..NODE_COUNT)
            .map(|i| Server::find_running(Kind::Redis, &node_dir(&dir, i)))
            .collect();
        let created_before = (0..NODE_COUNT).all(|i| was_created(&node_dir(&dir, i)));
        if running.iter().all(Option::is_some) {
            let nodes = running.into_iter().flatten().enumerate();
            let cluster = RedisCluster {
                dir: dir.clone(),
                nodes: nodes.map(|(index, server)| ClusterNode { index, server }).collect(),
                announced: Vec::new(),
            };
            if cluster.wait_healthy(Duration::from_secs(10)).is_ok() {
                return Ok((cluster, false));
            }
            tracing::warn!(
                "redis cluster: six nodes run but the cluster is not healthy; recreating"
            );
            cluster.stop();
            return RedisCluster::create(&dir).map(|c| (c, true));
        }
        if created_before {
            return RedisCluster::revive(&dir, running).map(|c| (c, true));
        }
        for server in running.into_iter().flatten() {
            server.stop()?;
        }
        RedisCluster::create(&dir).map(|c| (c, true))
    }

    /// Six fresh nodes (old node directories wiped) and `redis-cli --cluster create`.
    pub fn create(dir: &Path) -> Result<RedisCluster, StackError> {
        let mut cluster =
            RedisCluster { dir: dir.to_path_buf(), nodes: Vec::new(), announced: Vec::new() };
        let result = (|| {
            for index in 0..NODE_COUNT {
                let node = node_dir(dir, index);
                if node.exists() {
                    fs::remove_dir_all(&node)
                        .map_err(io_err(format!("wipe {}", node.display())))?;
                }
                let server = start_node(&node, None)?;
                cluster.nodes.push(ClusterNode { index, server });
            }
            cluster.run_create()?;
            cluster.wait_healthy(HEALTHY_TIMEOUT)
        })();
        match result {
            Ok(()) => Ok(cluster),
            Err(e) => {
                cluster.stop();
                Err(e)
            }
        }
    }

    /// Restarts the dead nodes of a cluster created before on their recorded ports.
    fn revive(dir: &Path, running: Vec<Option<Server>>) -> Result<RedisCluster, StackError> {
        let mut cluster =
            RedisCluster { dir: dir.to_path_buf(), nodes: Vec::new(), announced: Vec::new() };
        let mut started = Vec::new();
        let result = (|| {
            for (index, server) in running.into_iter().enumerate() {
                let server = match server {
                    Some(server) => server,
                    None => {
                        let node = node_dir(dir, index);
                        let port = recorded_port(&node);
                        started.push(index);
                        start_node(&node, port)?
                    }
                };
                cluster.nodes.push(ClusterNode { index, server });
            }
            cluster.wait_healthy(HEALTHY_TIMEOUT)
        })();
        match result {
            Ok(()) => Ok(cluster),
            Err(e) => {
                for node in cluster.nodes.iter().filter(|n| started.contains(&n.index)) {
                    let _ = node.server.stop();
                }
                Err(e)
            }
        }
    }

    /// Every node's address: the seeds of `FLASHSALE_REDIS_URL`.
    pub fn seeds(&self) -> Vec<SocketAddr> {
        self.nodes.iter().map(ClusterNode::addr).collect()
    }

    /// `redis://h:p,h:p,...` of every node.
    pub fn url(&self) -> String {
        flashsale_io::redis::url::RedisUrl::render(&self.seeds())
    }

    /// The master serving `slot`, as the first node that answers with a complete slot map
    /// says (`None`: no node does).
    pub fn master_of(&self, slot: flashsale_io::redis::slot::Slot) -> Option<SocketAddr> {
        self.seeds().into_iter().find_map(|addr| {
            let reply = call(addr, &["CLUSTER", "SHARDS"]).ok()?;
            let map = flashsale_io::redis::slot::SlotMap::from_shards(&reply, addr.ip()).ok()?;
            (map.unassigned_count() == 0).then(|| map.addr_of(slot)).flatten()
        })
    }

    /// Stops every node this value knows of.
    pub fn stop(&self) {
        for node in &self.nodes {
            let _ = node.server.stop();
        }
    }

    /// Starts node `index` again on its port and data directory (after a kill -9): it
    /// rejoins the cluster from its `nodes.conf`.
    pub fn restart_node(&mut self, index: usize) -> Result<(), StackError> {
        let node = &mut self.nodes[index];
        node.server.stop()?;
        let port = node.server.port;
        let dir = node.server.dir.clone();
        let mut last = None;
        // The old listener may linger for a moment after a kill -9.
        for _ in 0..50 {
            match start_node(&dir, Some(port)) {
                Ok(server) => {
                    node.server = server;
                    return match self.announced.get(index) {
                        Some(&announced) => announce(&self.nodes[index].server, announced),
                        None => Ok(()),
                    };
                }
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(last.unwrap_or_else(|| service(format!("restart node-{index} failed"))))
    }

    /// Makes node `i` tell clients and replicas to reach it on `ports[i]` of loopback
    /// (`cluster-announce-port`; the bus stays on the node's own port + 10000, so the
    /// cluster's own gossip is untouched), kept across [`RedisCluster::restart_node`], and
    /// waits until every node's `CLUSTER NODES` shows only those ports: a client that reads
    /// the slot map then connects nowhere else (`flashsale chaos` puts a proxy of its own at
    /// each). Replication links made before keep their direct connection.
    pub fn announce_clients(&mut self, ports: &[u16]) -> Result<(), StackError> {
        for (node, &port) in self.nodes.iter().zip(ports) {
            announce(&node.server, port)?;
        }
        self.announced = ports.to_vec();
        let stale = || {
            self.nodes.iter().find_map(|node| {
                let nodes = call(node.addr(), &["CLUSTER", "NODES"]).ok();
                let text = nodes.and_then(|r| r.as_str().map(str::to_owned)).unwrap_or_default();
                let seen: Vec<u16> = text.lines().filter_map(announced_port).collect();
                let stale = seen.len() != ports.len() || !seen.iter().all(|p| ports.contains(p));
                stale.then(|| format!("node-{} sees {seen:?}", node.index))
            })
        };
        poll_until_clear(HEALTHY_TIMEOUT, stale).map_err(|problem| {
            service(format!("ports {ports:?} not announced within {HEALTHY_TIMEOUT:?}: {problem}"))
        })
    }

    /// Waits until every node answers, says `cluster_state:ok`, every replica's link is up
    /// and not syncing, and every master serving slots has an online replica.
    pub fn wait_healthy(&self, timeout: Duration) -> Result<(), StackError> {
        poll_until_clear(timeout, || self.health_problem())
            .map_err(|problem| service(format!("not healthy within {timeout:?}: {problem}")))
    }

    /// What is still wrong, or `None` when healthy.
    fn health_problem(&self) -> Option<String> {
        let mut masters_with_slots = 0;
        for node in &self.nodes {
            let addr = node.addr();
            let info = match call(addr, &["CLUSTER", "INFO"]) {
                Ok(reply) => reply,
                Err(e) => return Some(format!("{addr}: {e}")),
            };
            if field(&info, "cluster_state") != Some("ok") {
                return Some(format!("{addr}: cluster_state not ok"));
            }
            let replication = match call(addr, &["INFO", "replication"]) {
                Ok(reply) => reply,
                Err(e) => return Some(format!("{addr}: {e}")),
            };
            match field(&replication, "role") {
                Some("slave") => {
                    if field(&replication, "master_link_status") != Some("up")
                        || field(&replication, "master_sync_in_progress") != Some("0")
                    {
                        return Some(format!("{addr}: replica not in sync"));
                    }
                }
                Some("master") => {
                    let myself = call(addr, &["CLUSTER", "MYID"]).ok();
                    let serves = myself
                        .as_ref()
                        .and_then(Reply::as_str)
                        .is_some_and(|id| master_serves_slots(addr, id));
                    if serves {
                        masters_with_slots += 1;
                        let online = replication.as_str().is_some_and(|text| {
                            text.lines()
                                .any(|l| l.starts_with("slave") && l.contains("state=online"))
                        });
                        if !online {
                            return Some(format!("{addr}: master without an online replica"));
                        }
                    }
                }
                _ => return Some(format!("{addr}: unknown role")),
            }
        }
        (masters_with_slots != MASTER_COUNT)
            .then(|| format!("{masters_with_slots} masters serve slots, want {MASTER_COUNT}"))
    }

    fn run_create(&self) -> Result<(), StackError> {
        let cli = find_binary(Kind::Redis, "redis-cli")?;
        let mut command = Command::new(cli);
        command.arg("--cluster").arg("create");
        for node in &self.nodes {
            command.arg(node.addr().to_string());
        }
        command.args(["--cluster-replicas", "1", "--cluster-yes"]);
        let output = command.output().map_err(io_err("run redis-cli --cluster create"))?;
        if !output.status.success() {
            return Err(service(format!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )));
        }
        Ok(())
    }
}

/// Whether `id` serves any slot, as node `addr` sees it (`CLUSTER SHARDS`).
fn master_serves_slots(addr: SocketAddr, id: &str) -> bool {
    let Ok(Reply::Array(shards)) = call(addr, &["CLUSTER", "SHARDS"]) else { return false };
    shards.iter().any(|shard| {
        let Some(fields) = shard.as_array() else { return false };
        let value = |name: &str| {
            fields.chunks_exact(2).find(|kv| kv[0].as_str() == Some(name)).map(|kv| &kv[1])
        };
        let has_slots = value("slots").and_then(Reply::as_array).is_some_and(|s| !s.is_empty());
        let lists_me = value("nodes").and_then(Reply::as_array).is_some_and(|nodes| {
            nodes.iter().any(|n| {
                let f = n.as_array().unwrap_or_default();
                let get = |name: &str| {
                    f.chunks_exact(2)
                        .find(|kv| kv[0].as_str() == Some(name))
                        .and_then(|kv| kv[1].as_str())
                };
                get("id") == Some(id) && get("role") == Some("master")
            })
        });
        has_slots && lists_me
    })
}

fn node_dir(dir: &Path, index: usize) -> PathBuf {
    dir.join(format!("node-{index}"))
}

fn recorded_port(dir: &Path) -> Option<u16> {
    fs::read_to_string(dir.join("port")).ok()?.trim().parse().ok()
}

/// `cluster-announce-port` of a running node (its bus port stays its own).
fn announce(server: &Server, port: u16) -> Result<(), StackError> {
    let bus = (server.port + BUS_PORT_OFFSET).to_string();
    for (name, value) in
        [("cluster-announce-bus-port", bus), ("cluster-announce-port", port.to_string())]
    {
        if let Reply::Error(e) = call(server.addr(), &["CONFIG", "SET", name, &value])? {
            let e = String::from_utf8_lossy(&e);
            return Err(service(format!("CONFIG SET {name} {value}: {e}")));
        }
    }
    Ok(())
}

/// The client port of one `CLUSTER NODES` line (`id ip:port@bus flags ...`).
fn announced_port(line: &str) -> Option<u16> {
    let addr = line.split_whitespace().nth(1)?;
    addr.split('@').next()?.rsplit(':').next()?.parse().ok()
}

/// A node's `nodes.conf` names more than itself once the cluster was created.
fn was_created(dir: &Path) -> bool {
    fs::read_to_string(dir.join("nodes.conf")).is_ok_and(|text| {
        text.contains("myself") && text.lines().filter(|l| !l.starts_with("vars")).count() > 1
    })
}

/// A free port below 55536 whose bus port (+10000) is free too.
fn cluster_port() -> Result<u16, StackError> {
    for _ in 0..100 {
        let port = free_port()?;
        if port < u16::MAX - BUS_PORT_OFFSET
            && TcpListener::bind(("127.0.0.1", port + BUS_PORT_OFFSET)).is_ok()
        {
            return Ok(port);
        }
    }
    Err(service("no free port pair (port, port + 10000) on 127.0.0.1".into()))
}

/// One cluster node under `dir`; `port` None picks a fresh pair (retried if it races away).
fn start_node(dir: &Path, port: Option<u16>) -> Result<Server, StackError> {
    fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
    let dir = dir.canonicalize().map_err(io_err(format!("canonicalize {}", dir.display())))?;
    let conf = dir.join("nodes.conf");
    let conf = conf.to_string_lossy().into_owned();
    let mut args: Vec<&str> = NODE_ARGS.to_vec();
    args.extend(["--cluster-config-file", conf.as_str()]);
    if let Some(port) = port {
        return spawn_and_wait_with(Kind::Redis, &dir, port, &args);
    }
    let mut last = None;
    for _ in 0..3 {
        match spawn_and_wait_with(Kind::Redis, &dir, cluster_port()?, &args) {
            Ok(server) => return Ok(server),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| service("could not start a cluster node".into())))
}

/// Stops the cluster nodes recorded under `dir` (by pid, checked against the command line).
pub(super) fn down(dir: &Path) -> Result<Vec<&'static str>, StackError> {
    let mut stopped = Vec::new();
    for (index, name) in NODE_NAMES.iter().enumerate() {
        let node = node_dir(dir, index);
        let pid = fs::read_to_string(node.join("pid")).ok().and_then(|p| p.trim().parse().ok());
        if let (Some(pid), Some(port)) = (pid, recorded_port(&node)) {
            if process_matches(pid, Kind::Redis, port) {
                Server { kind: Kind::Redis, port, pid, dir: node }.stop()?;
                stopped.push(*name);
            }
        }
    }
    Ok(stopped)
}

fn service(message: String) -> StackError {
    StackError::Service { service: "redis-cluster", message }
}

/// `name:value` from an `INFO`-style reply.
pub fn field<'r>(reply: &'r Reply, name: &str) -> Option<&'r str> {
    flashsale_io::redis::router::info_field(reply, name)
}

/// Sends one command to `addr` over a fresh blocking connection and returns its reply (an
/// error reply is `Ok(Reply::Error)`). Bounded: 2 s to connect, read and write.
pub fn call(addr: SocketAddr, args: &[&str]) -> Result<Reply, StackError> {
    let timeout = Duration::from_secs(2);
    let context = || format!("redis {addr} {}", args.first().copied().unwrap_or(""));
    let mut stream = TcpStream::connect_timeout(&addr, timeout).map_err(io_err(context()))?;
    stream.set_read_timeout(Some(timeout)).map_err(io_err(context()))?;
    stream.set_write_timeout(Some(timeout)).map_err(io_err(context()))?;
    let mut out = BytesMut::new();
    let raw: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    resp::encode_command(&mut out, &raw);
    stream.write_all(&out).map_err(io_err(context()))?;
    let mut buf = BytesMut::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        match resp::decode(&mut buf) {
            Ok(Some(reply)) => return Ok(reply),
            Ok(None) => {}
            Err(e) => return Err(service(format!("{}: bad reply: {e}", context()))),
        }
        let n = stream.read(&mut chunk).map_err(io_err(context()))?;
        if n == 0 {
            return Err(service(format!("{}: connection closed", context())));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_nodes_line_gives_the_client_port_it_announces() {
        let line = "d5e2 127.0.0.1:27001@46015 myself,master - 0 0 1 connected 0-5460";
        assert_eq!(announced_port(line), Some(27001));
        // A node not yet met has no address.
        assert_eq!(
            announced_port("d5e2 :27001@27002 myself,master - 0 0 0 connected"),
            Some(27001)
        );
        assert_eq!(announced_port("d5e2 :0@0 handshake - 0 0 0 connected"), Some(0));
        assert_eq!(announced_port(""), None);
    }
}
