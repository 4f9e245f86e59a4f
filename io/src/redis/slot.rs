//! Redis Cluster addressing, sans-I/O: the slot of a key (CRC16/XMODEM of its hash tag, per
//! the cluster specification), the slot map read from `CLUSTER SHARDS` (Redis 7) or
//! `CLUSTER SLOTS` (older servers), and the `MOVED` / `ASK` / `TRYAGAIN` redirect replies.
//!
//! Everything here is pure: bytes or replies in, values out, no socket, no clock, so every
//! parser is unit-tested below against the shapes real servers send (captured from Redis
//! 7.0.15) and never panics on what a server sent.
//!
//! Not here: connections, the refresh policy and the redirect loop (`super::cluster`).
//! Read next: the Redis Cluster specification, "Keys distribution model" and "Redirection".

use std::net::{IpAddr, SocketAddr};

use crate::resp::Reply;

/// Slots in a Redis Cluster (fixed by the protocol).
pub const SLOT_COUNT: u16 = 16_384;

/// One of the 16,384 hash slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot(u16);

impl Slot {
    /// `None` above 16,383.
    pub fn new(n: u16) -> Option<Slot> {
        (n < SLOT_COUNT).then_some(Slot(n))
    }

    pub fn get(self) -> u16 {
        self.0
    }

    /// The slot of `key`: CRC16 of the hash tag (the bytes between the first `{` and the
    /// first `}` after it, when not empty), else of the whole key, modulo 16,384.
    pub fn of_key(key: &[u8]) -> Slot {
        Slot(crc16_xmodem(hash_tag(key)) % SLOT_COUNT)
    }
}

/// The part of `key` that is hashed (cluster spec, "Hash tags").
fn hash_tag(key: &[u8]) -> &[u8] {
    let Some(open) = key.iter().position(|&b| b == b'{') else { return key };
    let rest = &key[open + 1..];
    match rest.iter().position(|&b| b == b'}') {
        Some(0) | None => key,
        Some(close) => &rest[..close],
    }
}

/// CRC16/XMODEM (poly 0x1021, init 0, no reflection), table-driven; the table is computed at
/// compile time.
pub fn crc16_xmodem(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc = (crc << 8) ^ CRC16_TABLE[usize::from(((crc >> 8) as u8) ^ b)];
    }
    crc
}

const CRC16_TABLE: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

// ---------------------------------------------------------------------------------------------
// The slot map
// ---------------------------------------------------------------------------------------------

/// One master as the cluster described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasterInfo {
    pub addr: SocketAddr,
    /// The 40-hex node id (empty when the server did not say).
    pub node_id: String,
    /// Replicas reported for this master and not failed (`CLUSTER SHARDS` health "online" or
    /// "loading"), or all listed replicas (`CLUSTER SLOTS` lists only the reachable ones).
    pub replicas_online: u32,
}

/// Which master serves each slot. `owner[slot]` indexes `masters`; [`SlotMap::UNASSIGNED`]
/// marks a slot no master serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotMap {
    pub masters: Vec<MasterInfo>,
    owner: Vec<u16>,
}

/// Why a slot-map reply could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    #[error("slot map reply has an unexpected shape: {0}")]
    Shape(&'static str),
    #[error("slot map names an address that is not an IP:port: {0}")]
    Address(String),
    #[error("slot map lists more than {0} masters")]
    TooManyMasters(usize),
}

impl SlotMap {
    pub const UNASSIGNED: u16 = u16::MAX;

    /// Most masters a map may hold (a bound on the client's connections per shard).
    pub const MASTERS_MAX: usize = 256;

    pub fn empty() -> SlotMap {
        SlotMap { masters: Vec::new(), owner: vec![SlotMap::UNASSIGNED; usize::from(SLOT_COUNT)] }
    }

    /// The index into `masters` of the slot's master.
    pub fn master_of(&self, slot: Slot) -> Option<usize> {
        let index = self.owner[usize::from(slot.0)];
        (index != SlotMap::UNASSIGNED).then_some(usize::from(index))
    }

    pub fn addr_of(&self, slot: Slot) -> Option<SocketAddr> {
        self.master_of(slot).map(|i| self.masters[i].addr)
    }

    /// Slots no master serves.
    pub fn unassigned_count(&self) -> usize {
        self.owner.iter().filter(|&&o| o == SlotMap::UNASSIGNED).count()
    }

    /// Points `slot` at `addr` (a `MOVED`), adding the master if it is new.
    pub fn assign(&mut self, slot: Slot, addr: SocketAddr) -> Result<(), MapError> {
        let index = match self.masters.iter().position(|m| m.addr == addr) {
            Some(i) => i,
            None => {
                if self.masters.len() >= SlotMap::MASTERS_MAX {
                    return Err(MapError::TooManyMasters(SlotMap::MASTERS_MAX));
                }
                // Replicas unknown until the next full refresh.
                self.masters.push(MasterInfo { addr, node_id: String::new(), replicas_online: 0 });
                self.masters.len() - 1
            }
        };
        self.owner[usize::from(slot.0)] = index as u16;
        Ok(())
    }

    fn add_range(&mut self, start: u16, end: u16, master: MasterInfo) -> Result<(), MapError> {
        if start > end || end >= SLOT_COUNT {
            return Err(MapError::Shape("slot range"));
        }
        let index = match self.masters.iter().position(|m| m.addr == master.addr) {
            Some(i) => i,
            None => {
                if self.masters.len() >= SlotMap::MASTERS_MAX {
                    return Err(MapError::TooManyMasters(SlotMap::MASTERS_MAX));
                }
                self.masters.push(master);
                self.masters.len() - 1
            }
        };
        for slot in &mut self.owner[usize::from(start)..=usize::from(end)] {
            *slot = index as u16;
        }
        Ok(())
    }

    /// Parses `CLUSTER SHARDS` (Redis 7): an array of shards, each a flat map with `slots`
    /// (start/end pairs) and `nodes` (flat maps with `ip`, `port`, `id`, `role`, `health`).
    /// `fallback_host` is used where a node reports an empty ip (the node we asked).
    pub fn from_shards(reply: &Reply, fallback_host: IpAddr) -> Result<SlotMap, MapError> {
        let shards = reply.as_array().ok_or(MapError::Shape("CLUSTER SHARDS is not an array"))?;
        let mut map = SlotMap::empty();
        for shard in shards {
            let fields = shard.as_array().ok_or(MapError::Shape("shard"))?;
            let slots = field(fields, "slots").and_then(Reply::as_array);
            let nodes = field(fields, "nodes").and_then(Reply::as_array);
            let (Some(slots), Some(nodes)) = (slots, nodes) else {
                return Err(MapError::Shape("shard without slots or nodes"));
            };
            if slots.is_empty() {
                continue; // a shard that serves nothing (e.g. a master being emptied)
            }
            let mut master = None;
            let mut replicas_online = 0;
            for node in nodes {
                let node = node.as_array().ok_or(MapError::Shape("node"))?;
                match field(node, "role").and_then(Reply::as_str) {
                    Some("master") => master = Some(shard_node(node, fallback_host)?),
                    Some("replica") => {
                        // Redis 7.0 says "loading" for any replica whose last reported offset
                        // is 0 — every replica of a master that has not been written yet —
                        // so only "fail" rules a replica out. WAIT is what proves a copy.
                        if field(node, "health").and_then(Reply::as_str) != Some("fail") {
                            replicas_online += 1;
                        }
                    }
                    _ => return Err(MapError::Shape("node role")),
                }
            }
            let Some((addr, node_id)) = master else { continue };
            let master = MasterInfo { addr, node_id, replicas_online };
            if slots.len() % 2 != 0 {
                return Err(MapError::Shape("odd slot list"));
            }
            for pair in slots.chunks_exact(2) {
                let (start, end) = (slot_number(&pair[0])?, slot_number(&pair[1])?);
                map.add_range(start, end, master.clone())?;
            }
        }
        Ok(map)
    }

    /// Parses `CLUSTER SLOTS`: `[start, end, [ip, port, id?], replicas...]` per range.
    pub fn from_slots(reply: &Reply, fallback_host: IpAddr) -> Result<SlotMap, MapError> {
        let ranges = reply.as_array().ok_or(MapError::Shape("CLUSTER SLOTS is not an array"))?;
        let mut map = SlotMap::empty();
        for range in ranges {
            let items = range.as_array().ok_or(MapError::Shape("slot range"))?;
            let [start, end, master, replicas @ ..] = items else {
                return Err(MapError::Shape("slot range entry"));
            };
            let node = master.as_array().ok_or(MapError::Shape("slot range master"))?;
            let (ip, port, id) = match node {
                [ip, port] => (ip, port, None),
                [ip, port, id, ..] => (ip, port, Some(id)),
                _ => return Err(MapError::Shape("slot range master")),
            };
            let addr = node_addr(ip.as_str(), port.as_int(), fallback_host)?;
            let node_id = id.and_then(Reply::as_str).unwrap_or_default().to_owned();
            let replicas_online = u32::try_from(replicas.len()).unwrap_or(u32::MAX);
            let master = MasterInfo { addr, node_id, replicas_online };
            map.add_range(slot_number(start)?, slot_number(end)?, master)?;
        }
        Ok(map)
    }
}

/// The value after `name` in a flat `[name, value, name, value...]` map.
fn field<'r>(fields: &'r [Reply], name: &str) -> Option<&'r Reply> {
    fields.chunks_exact(2).find(|kv| kv[0].as_str() == Some(name)).map(|kv| &kv[1])
}

fn shard_node(node: &[Reply], fallback_host: IpAddr) -> Result<(SocketAddr, String), MapError> {
    let port = field(node, "port").and_then(Reply::as_int);
    let ip = field(node, "ip").and_then(Reply::as_str);
    let addr = node_addr(ip, port, fallback_host)?;
    let id = field(node, "id").and_then(Reply::as_str).unwrap_or_default().to_owned();
    Ok((addr, id))
}

fn node_addr(
    ip: Option<&str>,
    port: Option<i64>,
    fallback_host: IpAddr,
) -> Result<SocketAddr, MapError> {
    let port = port.and_then(|p| u16::try_from(p).ok()).filter(|&p| p != 0);
    let Some(port) = port else { return Err(MapError::Address(format!("{ip:?}:{port:?}"))) };
    let ip = match ip {
        None | Some("") | Some("?") => fallback_host,
        Some(text) => text.parse().map_err(|_| MapError::Address(format!("{text}:{port}")))?,
    };
    Ok(SocketAddr::new(ip, port))
}

fn slot_number(reply: &Reply) -> Result<u16, MapError> {
    reply
        .as_int()
        .and_then(|n| u16::try_from(n).ok())
        .filter(|&n| n < SLOT_COUNT)
        .ok_or(MapError::Shape("slot number"))
}

// ---------------------------------------------------------------------------------------------
// Redirects
// ---------------------------------------------------------------------------------------------

/// What a cluster error reply asks the client to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redirect {
    /// `MOVED slot host:port`: the slot lives there now; the command did not run.
    Moved { slot: Slot, addr: SocketAddr },
    /// `ASK slot host:port`: send `ASKING` + this command there once; the map is unchanged.
    Ask { slot: Slot, addr: SocketAddr },
    /// `TRYAGAIN`: the slot is being migrated and the keys are split; retry shortly.
    TryAgain,
    /// `CLUSTERDOWN`: the cluster cannot serve the slot right now (e.g. mid-failover).
    ClusterDown,
}

impl Redirect {
    /// `None` for error replies that are not about routing. `from` answers for an empty host
    /// (`MOVED 3999 :6380`, sent when the node does not know its own address).
    pub fn parse(message: &[u8], from: IpAddr) -> Option<Redirect> {
        let text = std::str::from_utf8(message).ok()?;
        let mut words = text.split_ascii_whitespace();
        let code = words.next()?;
        match code {
            "TRYAGAIN" => return Some(Redirect::TryAgain),
            "CLUSTERDOWN" => return Some(Redirect::ClusterDown),
            "MOVED" | "ASK" => {}
            _ => return None,
        }
        let slot = Slot::new(words.next()?.parse().ok()?)?;
        let (host, port) = words.next()?.rsplit_once(':')?;
        let port: u16 = port.parse().ok()?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let ip = if host.is_empty() { from } else { host.parse().ok()? };
        let addr = SocketAddr::new(ip, port);
        Some(if code == "MOVED" {
            Redirect::Moved { slot, addr }
        } else {
            Redirect::Ask { slot, addr }
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn bulk(s: &str) -> Reply {
        Reply::Bulk(Bytes::copy_from_slice(s.as_bytes()))
    }

    const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    #[test]
    fn crc16_and_slot_vectors() {
        // The check value of CRC16/XMODEM, and the cluster spec's own example.
        assert_eq!(crc16_xmodem(b"123456789"), 0x31C3);
        assert_eq!(Slot::of_key(b"123456789").get(), 0x31C3 % SLOT_COUNT);
        // Measured with CLUSTER KEYSLOT on Redis 7.0.15.
        assert_eq!(Slot::of_key(b"{10001:20001}").get(), 13039);
        assert_eq!(Slot::of_key(b"seckill:{10001:20001}:stock").get(), 13039);
        assert_eq!(Slot::of_key(b"seckill:active-skus").get(), 15413);
        assert_eq!(Slot::of_key(b"foo").get(), 12182);
        assert_eq!(Slot::of_key(b"x{a}").get(), 15495);
        assert_eq!(Slot::of_key(b"").get(), 0);
    }

    #[test]
    fn hash_tags_follow_the_spec() {
        assert_eq!(hash_tag(b"{user1000}.following"), b"user1000");
        assert_eq!(hash_tag(b"foo{}{bar}"), b"foo{}{bar}", "empty first tag: whole key");
        assert_eq!(hash_tag(b"foo{{bar}}zap"), b"{bar", "tag up to the first closing brace");
        assert_eq!(hash_tag(b"foo{bar}{zap}"), b"bar", "only the first tag");
        assert_eq!(hash_tag(b"foo{bar"), b"foo{bar", "unclosed: whole key");
        assert_eq!(hash_tag(b"plain"), b"plain");
    }

    fn node(id: &str, port: i64, role: &str, health: &str) -> Reply {
        Reply::Array(vec![
            bulk("id"),
            bulk(id),
            bulk("port"),
            Reply::Integer(port),
            bulk("ip"),
            bulk("127.0.0.1"),
            bulk("endpoint"),
            bulk("127.0.0.1"),
            bulk("role"),
            bulk(role),
            bulk("replication-offset"),
            Reply::Integer(0),
            bulk("health"),
            bulk(health),
        ])
    }

    fn shard(ranges: &[(i64, i64)], nodes: Vec<Reply>) -> Reply {
        let slots = ranges.iter().flat_map(|&(a, b)| [Reply::Integer(a), Reply::Integer(b)]);
        Reply::Array(vec![
            bulk("slots"),
            Reply::Array(slots.collect()),
            bulk("nodes"),
            Reply::Array(nodes),
        ])
    }

    #[test]
    fn shards_reply_becomes_a_map() {
        let reply = Reply::Array(vec![
            shard(
                &[(10923, 16383)],
                vec![node("c", 7003, "master", "online"), node("f", 7004, "replica", "fail")],
            ),
            shard(
                &[(0, 5460)],
                vec![
                    node("a", 7001, "master", "online"),
                    node("d", 7005, "replica", "online"),
                    node("e", 7006, "replica", "loading"),
                ],
            ),
            shard(&[(5461, 10922)], vec![node("b", 7002, "master", "online")]),
        ]);
        let map = SlotMap::from_shards(&reply, LOCAL).unwrap();
        assert_eq!(map.unassigned_count(), 0);
        assert_eq!(map.addr_of(Slot(13039)), Some("127.0.0.1:7003".parse().unwrap()));
        assert_eq!(map.addr_of(Slot(0)), Some("127.0.0.1:7001".parse().unwrap()));
        assert_eq!(map.addr_of(Slot(10922)), Some("127.0.0.1:7002".parse().unwrap()));
        let c = &map.masters[map.master_of(Slot(16383)).unwrap()];
        assert_eq!(
            (c.node_id.as_str(), c.replicas_online),
            ("c", 0),
            "a failed replica does not count"
        );
        let a = &map.masters[map.master_of(Slot(1)).unwrap()];
        assert_eq!(a.replicas_online, 2, "a loading replica counts (offset 0 before writes)");
    }

    #[test]
    fn shards_reply_with_holes_and_junk() {
        let partial =
            Reply::Array(vec![shard(&[(0, 99)], vec![node("a", 7001, "master", "online")])]);
        let map = SlotMap::from_shards(&partial, LOCAL).unwrap();
        assert_eq!(map.unassigned_count(), usize::from(SLOT_COUNT) - 100);
        assert_eq!(map.master_of(Slot(100)), None);
        for junk in [
            Reply::Nil,
            Reply::Array(vec![Reply::Integer(1)]),
            Reply::Array(vec![shard(&[(5, 2)], vec![node("a", 7001, "master", "online")])]),
            Reply::Array(vec![shard(&[(0, 16384)], vec![node("a", 7001, "master", "online")])]),
            Reply::Array(vec![shard(&[(0, 1)], vec![node("a", 0, "master", "online")])]),
            Reply::Array(vec![shard(&[(0, 1)], vec![node("a", 7001, "boss", "online")])]),
        ] {
            assert!(SlotMap::from_shards(&junk, LOCAL).is_err(), "{junk:?}");
        }
    }

    #[test]
    fn slots_reply_becomes_a_map() {
        let entry = |a: i64, b: i64, port: i64, replicas: usize| {
            let mut items = vec![
                Reply::Integer(a),
                Reply::Integer(b),
                Reply::Array(vec![bulk("127.0.0.1"), Reply::Integer(port), bulk("id")]),
            ];
            for r in 0..replicas {
                items.push(Reply::Array(vec![bulk(""), Reply::Integer(port + 10 + r as i64)]));
            }
            Reply::Array(items)
        };
        let reply = Reply::Array(vec![entry(0, 8191, 7001, 1), entry(8192, 16383, 7002, 0)]);
        let map = SlotMap::from_slots(&reply, LOCAL).unwrap();
        assert_eq!(map.addr_of(Slot(8191)), Some("127.0.0.1:7001".parse().unwrap()));
        assert_eq!(map.addr_of(Slot(8192)), Some("127.0.0.1:7002".parse().unwrap()));
        assert_eq!(map.masters[0].replicas_online, 1);
        assert!(SlotMap::from_slots(&Reply::Array(vec![Reply::Array(vec![])]), LOCAL).is_err());
    }

    #[test]
    fn assign_follows_a_moved() {
        let mut map = SlotMap::empty();
        let addr: SocketAddr = "127.0.0.1:7009".parse().unwrap();
        map.assign(Slot(5), addr).unwrap();
        assert_eq!(map.addr_of(Slot(5)), Some(addr));
        assert_eq!(map.masters.len(), 1);
        map.assign(Slot(6), addr).unwrap();
        assert_eq!(map.masters.len(), 1, "a known master is reused");
    }

    #[test]
    fn redirects_parse() {
        let moved = Redirect::parse(b"MOVED 13039 127.0.0.1:31003", LOCAL);
        assert_eq!(
            moved,
            Some(Redirect::Moved { slot: Slot(13039), addr: "127.0.0.1:31003".parse().unwrap() })
        );
        let ask = Redirect::parse(b"ASK 13039 127.0.0.1:31001", LOCAL);
        assert_eq!(
            ask,
            Some(Redirect::Ask { slot: Slot(13039), addr: "127.0.0.1:31001".parse().unwrap() })
        );
        let empty_host = Redirect::parse(b"MOVED 1 :6380", LOCAL);
        assert_eq!(
            empty_host,
            Some(Redirect::Moved { slot: Slot(1), addr: "127.0.0.1:6380".parse().unwrap() })
        );
        let v6 = Redirect::parse(b"ASK 2 ::1:6380", LOCAL);
        assert_eq!(v6, Some(Redirect::Ask { slot: Slot(2), addr: "[::1]:6380".parse().unwrap() }));
        assert_eq!(
            Redirect::parse(b"TRYAGAIN Multiple keys request during rehashing of slot", LOCAL),
            Some(Redirect::TryAgain)
        );
        assert_eq!(
            Redirect::parse(b"CLUSTERDOWN The cluster is down", LOCAL),
            Some(Redirect::ClusterDown)
        );
        for other in [
            &b"ERR Function not found"[..],
            b"MOVED 16384 127.0.0.1:1",
            b"MOVED x 127.0.0.1:1",
            b"MOVED 1 nowhere",
            b"ASK 1 host.example:1",
            b"",
            &[0xff, 0xfe],
        ] {
            assert_eq!(Redirect::parse(other, LOCAL), None, "{:?}", String::from_utf8_lossy(other));
        }
    }
}
