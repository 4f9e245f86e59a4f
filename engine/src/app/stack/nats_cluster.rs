//! A 3-node NATS JetStream cluster on loopback (DESIGN.md section 11, CONTRACT.md section 1's
//! `--topology ha`): three `nats-server -js` processes with their own store directories,
//! client, cluster (route) and monitoring ports, routed to each other.
//!
//! What it is: [`NatsCluster::up`] (start, or reuse the nodes recorded under a directory),
//! [`NatsCluster::wait_healthy`] (every live node answers `/healthz` and knows the meta
//! leader), the drill operations (`kill` = kill -9 of one node, `restart` on the same ports
//! and store), and the leader look-ups a drill needs (meta leader, a stream's leader, a
//! consumer's leader) read from the monitoring endpoint (`/jsz`), which also shows each
//! stream's replicas. [`down`] stops the nodes by the pids they recorded.
//!
//! Measured on this kind of machine (FIELD-NOTES.md): healthy in ~0.4 s; an R3 stream is
//! created in ~0.2 s; after kill -9 of the stream leader the first acknowledged publish comes
//! ~5 s later.
//!
//! What it is not: the engine's view of the cluster (that is `io::jetstream`, which only needs the
//! comma-separated client URLs of [`NatsCluster::url`]), nor the single-node stack
//! (`stack::up`). Layout: `DIR/n1`, `DIR/n2`, `DIR/n3`, each with `store/`, `server.log`,
//! `pid`, `port` (client port) and `ports` (client, cluster and monitoring ports).

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::error::{io_err, StackError};
use super::kind::{find_binary, Kind};
use super::process::process_matches;
use super::server::{
    free_port, jetstream_limits, poll_until_clear, spawn_command_and_wait, Server,
};

/// Nodes of the cluster (JetStream's R3 needs three for a majority that survives one loss).
pub const NODES: usize = 3;
/// The `--cluster_name` every node shares.
pub const CLUSTER_NAME: &str = "flashsale";
/// How long [`NatsCluster::up`] waits for a healthy cluster (measured: ~0.4 s).
const HEALTHY_TIMEOUT: Duration = Duration::from_secs(30);
/// Whole-cluster start attempts (a port picked free may be taken before a node binds it).
const CLUSTER_START_ATTEMPTS_MAX: u32 = 3;
/// Bound on one monitoring request.
const MONITOR_TIMEOUT: Duration = Duration::from_secs(2);

fn service_err(message: String) -> StackError {
    StackError::Service { service: "nats cluster", message }
}

/// The three ports of one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodePorts {
    pub client: u16,
    pub cluster: u16,
    pub http: u16,
}

impl NodePorts {
    fn read(dir: &Path) -> Option<NodePorts> {
        let text = fs::read_to_string(dir.join("ports")).ok()?;
        let mut parts = text.split_whitespace().map(|p| p.parse::<u16>().ok());
        Some(NodePorts { client: parts.next()??, cluster: parts.next()??, http: parts.next()?? })
    }

    fn write(&self, dir: &Path) -> Result<(), StackError> {
        let text = format!("{} {} {}\n", self.client, self.cluster, self.http);
        fs::write(dir.join("ports"), text).map_err(io_err("write nats ports"))
    }

    fn fresh() -> Result<NodePorts, StackError> {
        Ok(NodePorts { client: free_port()?, cluster: free_port()?, http: free_port()? })
    }
}

/// One node: its name (`n1`..), ports, directory, and the process while it runs.
#[derive(Debug)]
pub struct NatsNode {
    pub name: String,
    pub ports: NodePorts,
    pub dir: PathBuf,
    /// The client address this node tells clients to use instead of its own (a proxy in
    /// front of it, see [`NatsCluster::advertise_clients`]); kept across restarts.
    pub client_advertise: Option<SocketAddr>,
    server: Option<Server>,
}

impl NatsNode {
    pub fn is_running(&self) -> bool {
        self.server.is_some()
    }

    pub fn url(&self) -> String {
        Kind::Nats.url(self.ports.client)
    }

    pub fn pid(&self) -> Option<u32> {
        self.server.as_ref().map(|s| s.pid)
    }
}

/// The running cluster.
#[derive(Debug)]
pub struct NatsCluster {
    dir: PathBuf,
    nodes: Vec<NatsNode>,
}

impl NatsCluster {
    /// Starts the three nodes under `dir` (or reuses those still running from an earlier
    /// `up`, restarting missing ones on their recorded ports) and waits until healthy. A
    /// failure part-way stops every node this call started.
    pub fn up(dir: &Path) -> Result<NatsCluster, StackError> {
        fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
        let dir = dir.canonicalize().map_err(io_err(format!("canonicalize {}", dir.display())))?;
        let recorded: Option<Vec<NodePorts>> =
            (1..=NODES).map(|i| NodePorts::read(&dir.join(format!("n{i}")))).collect();
        if let Some(ports) = recorded {
            let mut cluster = NatsCluster::with_ports(&dir, &ports);
            for node in &mut cluster.nodes {
                node.server = Server::find_running(Kind::Nats, &node.dir)
                    .filter(|s| s.port == node.ports.client);
            }
            let started = cluster.start_missing();
            match started.and_then(|_| cluster.wait_healthy(HEALTHY_TIMEOUT)) {
                Ok(()) => return Ok(cluster),
                // Recorded ports taken by someone else: start over on fresh ones below.
                Err(e) => {
                    tracing::warn!(error = %e, "recorded NATS cluster did not come up; fresh ports");
                    cluster.stop();
                }
            }
        }
        let mut last_error = None;
        for _ in 0..CLUSTER_START_ATTEMPTS_MAX {
            let ports: Vec<NodePorts> =
                (0..NODES).map(|_| NodePorts::fresh()).collect::<Result<_, _>>()?;
            let mut cluster = NatsCluster::with_ports(&dir, &ports);
            match cluster.start_missing().and_then(|_| cluster.wait_healthy(HEALTHY_TIMEOUT)) {
                Ok(()) => return Ok(cluster),
                Err(e) => {
                    cluster.stop();
                    last_error = Some(e);
                }
            }
        }
        Err(last_error.unwrap_or_else(|| service_err("could not start".into())))
    }

    fn with_ports(dir: &Path, ports: &[NodePorts]) -> NatsCluster {
        let nodes = ports
            .iter()
            .enumerate()
            .map(|(i, ports)| NatsNode {
                name: format!("n{}", i + 1),
                ports: *ports,
                dir: dir.join(format!("n{}", i + 1)),
                client_advertise: None,
                server: None,
            })
            .collect();
        NatsCluster { dir: dir.to_path_buf(), nodes }
    }

    /// Starts every node that is not running (on its recorded ports and store).
    fn start_missing(&mut self) -> Result<(), StackError> {
        for index in 0..self.nodes.len() {
            if !self.nodes[index].is_running() {
                self.start_node(index)?;
            }
        }
        Ok(())
    }

    fn start_node(&mut self, index: usize) -> Result<(), StackError> {
        let routes: Vec<String> =
            self.nodes.iter().map(|n| format!("nats://127.0.0.1:{}", n.ports.cluster)).collect();
        let node = &self.nodes[index];
        fs::create_dir_all(&node.dir).map_err(io_err(format!("create {}", node.dir.display())))?;
        node.ports.write(&node.dir)?;
        let mut command = Command::new(find_binary(Kind::Nats, "nats-server")?);
        command
            .arg("-c")
            .arg(jetstream_limits(&node.dir)?)
            .args(["-n", &node.name, "--cluster_name", CLUSTER_NAME])
            .args(["-a", "127.0.0.1", "-p", &node.ports.client.to_string()])
            .args(["--cluster", &format!("nats://127.0.0.1:{}", node.ports.cluster)])
            .args(["--routes", &routes.join(",")])
            .args(["-m", &node.ports.http.to_string(), "-js", "-sd"])
            .arg(node.dir.join("store"));
        if let Some(addr) = node.client_advertise {
            command.args(["--client_advertise", &addr.to_string()]);
        }
        let server = spawn_command_and_wait(Kind::Nats, &node.dir, node.ports.client, command)?;
        self.nodes[index].server = Some(server);
        Ok(())
    }

    /// Makes every node tell clients to reach it at `addrs[i]` (`--client_advertise`; each
    /// running node is restarted with it, one at a time, and it is kept across later
    /// restarts) and waits until every node's `connect_urls` lists only those: a client given
    /// these addresses then never learns a way around them (`flashsale chaos` puts a proxy of
    /// its own at each). A reload cannot do it: nats-server reloads only a configuration that
    /// is wholly in its file. Meant before any stream exists.
    pub fn advertise_clients(&mut self, addrs: &[SocketAddr]) -> Result<(), StackError> {
        for (index, addr) in addrs.iter().enumerate().take(self.nodes.len()) {
            self.nodes[index].client_advertise = Some(*addr);
            if self.nodes[index].is_running() {
                self.restart(index)?;
                self.wait_healthy(HEALTHY_TIMEOUT)?;
            }
        }
        let wanted: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
        let stale = || {
            self.nodes.iter().filter(|n| n.is_running()).find_map(|node| {
                let varz = monitor_json(node.ports.http, "/varz").unwrap_or_default();
                let urls = varz["connect_urls"].as_array().cloned().unwrap_or_default();
                let urls: Vec<&str> = urls.iter().filter_map(|u| u.as_str()).collect();
                let stale = urls.len() != wanted.len()
                    || !urls.iter().all(|u| wanted.iter().any(|w| w == u));
                stale.then(|| format!("node {} advertises {urls:?}", node.name))
            })
        };
        poll_until_clear(HEALTHY_TIMEOUT, stale).map_err(|problem| {
            service_err(format!("{wanted:?} not advertised within {HEALTHY_TIMEOUT:?}: {problem}"))
        })
    }

    /// The comma-separated client URLs (`FLASHSALE_NATS_URL` for a cluster).
    pub fn url(&self) -> String {
        self.nodes.iter().map(NatsNode::url).collect::<Vec<_>>().join(",")
    }

    pub fn nodes(&self) -> &[NatsNode] {
        &self.nodes
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The index of the node called `name` (as the monitoring endpoint names leaders).
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    /// kill -9 of one node (no shutdown: its peers see it vanish). `Err(Refused)` when the
    /// node is not running or its pid is not our server (nothing signalled, node kept).
    pub fn kill(&mut self, index: usize) -> Result<(), StackError> {
        let node = &mut self.nodes[index];
        let Some(server) = node.server.as_ref() else {
            return Err(StackError::Refused {
                service: Kind::Nats.name(),
                pid: 0,
                reason: format!("node {} is not running (killed or stopped before)", node.name),
            });
        };
        server.kill()?;
        node.server = None;
        Ok(())
    }

    /// Starts a killed or stopped node again on the same ports and store directory.
    pub fn restart(&mut self, index: usize) -> Result<(), StackError> {
        if let Some(server) = self.nodes[index].server.take() {
            server.stop()?;
        }
        // The killed process's listening sockets can linger for a moment.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.start_node(index) {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// Stops every node (SIGTERM, then SIGKILL after the stop timeout).
    pub fn stop(&mut self) {
        for node in &mut self.nodes {
            if let Some(server) = node.server.take() {
                let _ = server.stop();
            }
        }
    }

    /// Waits until every running node answers `/healthz` with ok and reports a meta leader.
    pub fn wait_healthy(&self, timeout: Duration) -> Result<(), StackError> {
        let unhealthy = || {
            self.nodes.iter().filter(|n| n.is_running()).find_map(|node| {
                let healthy = http_get(node.ports.http, "/healthz")
                    .is_ok_and(|(status, body)| status == 200 && body.contains("ok"));
                let leader = monitor_json(node.ports.http, "/jsz")
                    .ok()
                    .and_then(|jsz| jsz["meta_cluster"]["leader"].as_str().map(str::to_owned))
                    .filter(|leader| !leader.is_empty());
                (!healthy || leader.is_none()).then(|| node.name.clone())
            })
        };
        poll_until_clear(timeout, unhealthy).map_err(|name| {
            service_err(format!(
                "node {name} not healthy (or no meta leader) within {timeout:?}; see {}",
                self.dir.display()
            ))
        })
    }

    /// The JetStream meta leader's node name, as the first answering node sees it.
    pub fn meta_leader(&self) -> Option<String> {
        self.first_answer("/jsz", |jsz| jsz["meta_cluster"]["leader"].as_str().map(str::to_owned))
    }

    /// The leader of `stream`'s RAFT group.
    pub fn stream_leader(&self, stream: &str) -> Option<String> {
        self.stream_detail(stream)
            .and_then(|detail| detail["cluster"]["leader"].as_str().map(str::to_owned))
    }

    /// The configured replicas of `stream` (`config.num_replicas`).
    pub fn stream_replicas(&self, stream: &str) -> Option<u64> {
        self.stream_detail(stream).and_then(|detail| detail["config"]["num_replicas"].as_u64())
    }

    /// The leader of the durable `consumer` on `stream`.
    pub fn consumer_leader(&self, stream: &str, consumer: &str) -> Option<String> {
        self.first_answer("/jsz?consumers=true", |jsz| {
            let stream = find_stream(jsz, stream)?;
            let consumers = stream["consumer_detail"].as_array()?;
            let detail = consumers.iter().find(|c| c["name"].as_str() == Some(consumer))?;
            detail["cluster"]["leader"].as_str().map(str::to_owned)
        })
    }

    fn stream_detail(&self, stream: &str) -> Option<serde_json::Value> {
        self.first_answer("/jsz?streams=true&config=true", |jsz| find_stream(jsz, stream).cloned())
    }

    /// Every running node's view of `stream` and its consumers, one line each: the leader it
    /// knows, its copy's messages and sequences, and per consumer the delivered and acked
    /// stream sequences and what is pending (only the consumer's leader tracks those). What
    /// a run records at its end: replicas that disagree, or a consumer past the stream's last
    /// sequence, explain messages that are stored and never delivered.
    pub fn stream_views(&self, stream: &str) -> Vec<String> {
        let path = "/jsz?accounts=true&streams=true&consumers=true";
        let view = |node: &NatsNode| {
            let jsz = monitor_json(node.ports.http, path).ok()?;
            let s = find_stream(&jsz, stream)?;
            let consumers: Vec<String> = s["consumer_detail"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| {
                    format!(
                        "{} delivered {} acked {} pending {} ack_pending {}",
                        c["name"].as_str().unwrap_or("?"),
                        c["delivered"]["stream_seq"],
                        c["ack_floor"]["stream_seq"],
                        c["num_pending"],
                        c["num_ack_pending"]
                    )
                })
                .collect();
            Some(format!(
                "{stream} on {}: leader {} messages {} seq {}..{}; {}",
                node.name,
                s["cluster"]["leader"].as_str().unwrap_or("none"),
                s["state"]["messages"],
                s["state"]["first_seq"],
                s["state"]["last_seq"],
                consumers.join("; ")
            ))
        };
        self.nodes.iter().filter(|n| n.is_running()).filter_map(view).collect()
    }

    /// Asks the running nodes in turn; the first `Some` wins (a stream with fewer replicas
    /// than nodes is listed only by the nodes that hold it).
    fn first_answer<T>(
        &self,
        path: &str,
        pick: impl Fn(&serde_json::Value) -> Option<T>,
    ) -> Option<T> {
        self.nodes
            .iter()
            .filter(|n| n.is_running())
            .filter_map(|n| monitor_json(n.ports.http, path).ok())
            .find_map(|jsz| pick(&jsz))
    }
}

fn find_stream<'a>(jsz: &'a serde_json::Value, stream: &str) -> Option<&'a serde_json::Value> {
    jsz["account_details"].as_array()?.iter().find_map(|account| {
        account["stream_detail"].as_array()?.iter().find(|s| s["name"].as_str() == Some(stream))
    })
}

fn monitor_json(port: u16, path: &str) -> Result<serde_json::Value, StackError> {
    let (status, body) = http_get(port, path)?;
    if status != 200 {
        return Err(service_err(format!("GET {path} on :{port} answered {status}")));
    }
    serde_json::from_str(&body).map_err(|e| service_err(format!("GET {path}: {e}")))
}

/// One blocking HTTP/1.0 GET on loopback (the monitoring endpoint closes after answering).
fn http_get(port: u16, path: &str) -> Result<(u16, String), StackError> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let context = format!("GET {path} on {addr}");
    let mut stream =
        TcpStream::connect_timeout(&addr, MONITOR_TIMEOUT).map_err(io_err(context.clone()))?;
    stream.set_read_timeout(Some(MONITOR_TIMEOUT)).map_err(io_err(context.clone()))?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .map_err(io_err(context.clone()))?;
    let mut raw = Vec::with_capacity(16 * 1024);
    stream.read_to_end(&mut raw).map_err(io_err(context.clone()))?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    Ok((status, body.to_owned()))
}

/// Stops the nodes recorded under `dir` (only processes that are still our `nats-server` on
/// the recorded port); returns the names of those stopped.
pub fn down(dir: &Path) -> Result<Vec<String>, StackError> {
    let mut stopped = Vec::new();
    for i in 1..=NODES {
        let node_dir = dir.join(format!("n{i}"));
        let pid = fs::read_to_string(node_dir.join("pid")).ok().and_then(|p| p.trim().parse().ok());
        let port = NodePorts::read(&node_dir).map(|p| p.client);
        if let (Some(pid), Some(port)) = (pid, port) {
            if process_matches(pid, Kind::Nats, port) {
                Server { kind: Kind::Nats, port, pid, dir: node_dir }.stop()?;
                stopped.push(format!("n{i}"));
            }
        }
    }
    Ok(stopped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_round_trip_through_their_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ports = NodePorts { client: 4222, cluster: 6222, http: 8222 };
        ports.write(dir.path()).expect("write");
        assert_eq!(NodePorts::read(dir.path()), Some(ports));
        fs::write(dir.path().join("ports"), "4222 x").expect("write");
        assert_eq!(NodePorts::read(dir.path()), None);
    }

    #[test]
    fn streams_are_found_in_a_jsz_answer() {
        let jsz = serde_json::json!({"account_details": [{"stream_detail": [
            {"name": "A", "cluster": {"leader": "n2"}, "config": {"num_replicas": 3}}
        ]}]});
        assert_eq!(find_stream(&jsz, "A").unwrap()["cluster"]["leader"], "n2");
        assert!(find_stream(&jsz, "B").is_none());
    }
}
