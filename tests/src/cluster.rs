//! A private Redis Cluster shared by one test binary (3 masters + 3 replicas, started by the
//! stack's own `RedisCluster`), and the drills' levers: kill -9 a node, cut a replica's link,
//! find the master of a slot, migrate a slot by hand (SETSLOT MIGRATING/IMPORTING, MIGRATE,
//! SETSLOT NODE), and heal the cluster back to six healthy nodes.
//!
//! Started once per test binary ([`redis_cluster`], a `OnceLock`); tests stay independent by
//! using distinct SKUs, and serialise the drills that change the topology with
//! [`SharedCluster::exclusive`]. A static is never dropped, so a watchdog process stops the
//! nodes and deletes their directory when the test binary exits, however it exits.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use flashsale_engine::app::stack::{redis_call, RedisCluster};
use flashsale_io::redis::slot::{Slot, SlotMap};
use flashsale_io::resp::Reply;

pub struct SharedCluster {
    cluster: Mutex<RedisCluster>,
    drills: Mutex<()>,
    dir: PathBuf,
}

static CLUSTER: OnceLock<SharedCluster> = OnceLock::new();

/// The test binary's cluster, started on first use.
pub fn redis_cluster() -> &'static SharedCluster {
    CLUSTER.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("flashsale-test-rcluster-")
            .tempdir()
            .expect("temp dir for the cluster")
            .keep();
        crate::watchdog(&dir);
        let started = Instant::now();
        let cluster =
            RedisCluster::create(&dir).unwrap_or_else(|e| panic!("start redis cluster: {e}"));
        eprintln!("redis cluster up in {:?} at {}", started.elapsed(), cluster.url());
        SharedCluster { cluster: Mutex::new(cluster), drills: Mutex::new(()), dir }
    })
}

/// One command to one node; panics with the node and command on a transport failure.
pub fn call(addr: SocketAddr, args: &[&str]) -> Reply {
    redis_call(addr, args).unwrap_or_else(|e| panic!("redis {addr} {args:?}: {e}"))
}

/// `name:value` of an INFO reply.
pub fn info(addr: SocketAddr, section: &str, name: &str) -> Option<String> {
    let reply = redis_call(addr, &["INFO", section]).ok()?;
    flashsale_io::redis::router::info_field(&reply, name).map(str::to_owned)
}

impl SharedCluster {
    /// Held for the whole of a test that changes the topology (kill, failover, reshard) or
    /// needs it stable: such tests run one at a time.
    pub fn exclusive(&self) -> MutexGuard<'_, ()> {
        self.drills.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn cluster(&self) -> MutexGuard<'_, RedisCluster> {
        self.cluster.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn seeds(&self) -> Vec<SocketAddr> {
        self.cluster().seeds()
    }

    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// The slot map as a live node sees it.
    pub fn map(&self) -> SlotMap {
        for addr in self.seeds() {
            if let Ok(reply @ Reply::Array(_)) = redis_call(addr, &["CLUSTER", "SHARDS"]) {
                if let Ok(map) = SlotMap::from_shards(&reply, addr.ip()) {
                    if map.unassigned_count() == 0 {
                        return map;
                    }
                }
            }
        }
        panic!("no node gives a complete slot map");
    }

    pub fn master_of(&self, slot: Slot) -> SocketAddr {
        self.map().addr_of(slot).expect("every slot has a master")
    }

    pub fn masters(&self) -> Vec<SocketAddr> {
        self.map().masters.iter().map(|m| m.addr).collect()
    }

    pub fn node_id(&self, addr: SocketAddr) -> String {
        call(addr, &["CLUSTER", "MYID"]).as_str().expect("CLUSTER MYID").to_owned()
    }

    /// The (first) replica of `master`, as the replicas themselves say.
    pub fn replica_of(&self, master: SocketAddr) -> SocketAddr {
        let port = master.port().to_string();
        self.seeds()
            .into_iter()
            .find(|&addr| {
                info(addr, "replication", "role").as_deref() == Some("slave")
                    && info(addr, "replication", "master_port").as_deref() == Some(port.as_str())
            })
            .unwrap_or_else(|| panic!("no replica of {master}"))
    }

    /// kill -9 of the node at `addr`.
    pub fn kill(&self, addr: SocketAddr) {
        let cluster = self.cluster();
        let node = cluster.nodes.iter().find(|n| n.addr() == addr).expect("a node of ours");
        node.server.kill().unwrap_or_else(|e| panic!("kill -9 of Redis node {addr} refused: {e}"));
        crate::assert_gone("Redis node", node.server.pid);
    }

    /// SIGSTOP of the node at `addr` (a hung host: connections are accepted by the kernel,
    /// nothing answers); [`SharedCluster::thaw`] resumes it. Returns once it is stopped.
    pub fn freeze(&self, addr: SocketAddr) {
        self.signal(addr, "-STOP", |state| state == 'T');
    }

    /// SIGCONT of the node at `addr`; returns once it runs again.
    pub fn thaw(&self, addr: SocketAddr) {
        self.signal(addr, "-CONT", |state| state != 'T');
    }

    fn signal(&self, addr: SocketAddr, signal: &str, want: impl Fn(char) -> bool) {
        let pid = {
            let cluster = self.cluster();
            let node = cluster.nodes.iter().find(|n| n.addr() == addr).expect("a node of ours");
            node.server.check().unwrap_or_else(|e| panic!("kill {signal} of {addr}: {e}"));
            node.server.pid
        };
        let status = std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid}");
        let deadline = Instant::now() + Duration::from_secs(5);
        while !flashsale_engine::app::stack::process_state(pid).is_some_and(&want) {
            assert!(Instant::now() < deadline, "Redis node {addr}: no state change on {signal}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Cuts the replication link of `master` and keeps it cut: a password on the master
    /// (existing client connections stay authenticated; the replica's reconnect is refused
    /// with NOAUTH), then the replica's connection killed. SIGSTOP of the replica alone is not
    /// enough (the kernel buffers the stream and it catches up). Waits until the master
    /// reports no replica. The master keeps serving its clients.
    pub fn cut_replica_link(&self, master: SocketAddr) {
        call(master, &["CONFIG", "SET", "requirepass", "drill-cut-link"]);
        // The command above needs no password on this fresh connection only because it was
        // authenticated before the password existed: the next ones must authenticate.
        let kill = authed_call(master, &["CLIENT", "KILL", "TYPE", "replica"]);
        assert!(matches!(kill, Reply::Integer(n) if n >= 1), "CLIENT KILL TYPE replica: {kill:?}");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let reply = authed_call(master, &["INFO", "replication"]);
            let connected = flashsale_io::redis::router::info_field(&reply, "connected_slaves");
            if connected == Some("0") {
                return;
            }
            assert!(Instant::now() < deadline, "replica link of {master} still up");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until `replica` is a master (its failover); returns how long that took.
    pub fn wait_promoted(&self, replica: SocketAddr, timeout: Duration) -> Duration {
        let start = Instant::now();
        loop {
            if info(replica, "replication", "role").as_deref() == Some("master") {
                return start.elapsed();
            }
            assert!(start.elapsed() < timeout, "{replica} not promoted within {timeout:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Restarts every dead node on its port (it rejoins, as a replica where it was failed
    /// over), clears a drill's password, and waits for six healthy nodes.
    pub fn heal(&self) {
        let mut cluster = self.cluster();
        for index in 0..cluster.nodes.len() {
            let addr = cluster.nodes[index].addr();
            if redis_call(addr, &["PING"]).is_err() {
                cluster.restart_node(index).unwrap_or_else(|e| panic!("restart {addr}: {e}"));
            } else if matches!(redis_call(addr, &["PING"]), Ok(Reply::Error(_))) {
                authed_call(addr, &["CONFIG", "SET", "requirepass", ""]);
            }
        }
        cluster.wait_healthy(Duration::from_secs(60)).unwrap_or_else(|e| panic!("heal: {e}"));
    }

    /// Step 1 of a manual migration of `slot` from `from` to `to`.
    pub fn begin_migration(&self, slot: Slot, from: SocketAddr, to: SocketAddr) {
        let s = slot.get().to_string();
        let (from_id, to_id) = (self.node_id(from), self.node_id(to));
        assert!(call(to, &["CLUSTER", "SETSLOT", &s, "IMPORTING", &from_id]).is_ok());
        assert!(call(from, &["CLUSTER", "SETSLOT", &s, "MIGRATING", &to_id]).is_ok());
    }

    /// Step 2: MIGRATE every key of `slot` from `from` to `to`, 100 at a time; returns how
    /// many moved.
    pub fn migrate_keys(&self, slot: Slot, from: SocketAddr, to: SocketAddr) -> usize {
        let s = slot.get().to_string();
        let (host, port) = (to.ip().to_string(), to.port().to_string());
        let mut moved = 0;
        loop {
            let keys = call(from, &["CLUSTER", "GETKEYSINSLOT", &s, "100"]);
            let keys: Vec<String> = keys
                .as_array()
                .expect("GETKEYSINSLOT")
                .iter()
                .filter_map(|k| k.as_str().map(str::to_owned))
                .collect();
            if keys.is_empty() {
                return moved;
            }
            let mut args = vec!["MIGRATE", host.as_str(), port.as_str(), "", "0", "5000", "KEYS"];
            args.extend(keys.iter().map(String::as_str));
            let reply = call(from, &args);
            assert!(reply.is_ok(), "MIGRATE: {reply:?}");
            moved += keys.len();
        }
    }

    /// Step 3: `slot` belongs to `to` (told to the target, the source, then every master).
    pub fn finish_migration(&self, slot: Slot, from: SocketAddr, to: SocketAddr) {
        let s = slot.get().to_string();
        let to_id = self.node_id(to);
        let mut order = vec![to, from];
        order.extend(self.masters().into_iter().filter(|m| *m != to && *m != from));
        for node in order {
            let reply = call(node, &["CLUSTER", "SETSLOT", &s, "NODE", &to_id]);
            assert!(reply.is_ok(), "SETSLOT NODE on {node}: {reply:?}");
        }
    }
}

fn authed_call(addr: SocketAddr, args: &[&str]) -> Reply {
    // AUTH and the command on one connection: the stack's helper opens one per call.
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
    let mut out = bytes::BytesMut::new();
    flashsale_io::resp::encode_command(&mut out, &[b"AUTH", b"drill-cut-link"]);
    let raw: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    flashsale_io::resp::encode_command(&mut out, &raw);
    std::io::Write::write_all(&mut stream, &out).expect("write");
    let mut buf = bytes::BytesMut::new();
    let mut replies = Vec::new();
    let mut chunk = [0u8; 4096];
    while replies.len() < 2 {
        while let Ok(Some(reply)) = flashsale_io::resp::decode(&mut buf) {
            replies.push(reply);
        }
        if replies.len() == 2 {
            break;
        }
        let n = std::io::Read::read(&mut stream, &mut chunk).expect("read");
        assert!(n > 0, "{addr} closed the connection");
        buf.extend_from_slice(&chunk[..n]);
    }
    let reply = replies.pop().expect("two replies");
    let auth = replies.pop().expect("two replies");
    // Without a password set, AUTH answers an error and the command still runs.
    let _ = auth;
    reply
}
