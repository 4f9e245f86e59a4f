//! Redis' own settings that the engine's guarantees rest on, read from every master at start
//! (issue 26 item 3; seed ch9: "maxmemory-policy noeviction，避免静默淘汰幂等和 reservation
//! 数据"): the eviction policy (anything but `noeviction` may silently drop request records and
//! user markers under memory pressure) and the persistence settings (`appendonly`,
//! `appendfsync`, `save`), which decide how much a restart loses.
//!
//! What it is: [`read_settings`], one `CONFIG GET` per setting on each master of a router
//! (one node when standalone, every master of a cluster), and the plain record it returns.
//! A node that cannot be asked (down, `CONFIG` renamed away) reads as settings unknown, with
//! the reason; whether to start is not decided here (`engine::logic::redis_settings`).

use std::net::SocketAddr;

use super::router::Router;
use crate::resp::Reply;

/// The settings read, in the order of [`NodeSettings`]' fields.
pub const SETTINGS: [&str; 4] = ["maxmemory-policy", "appendonly", "appendfsync", "save"];

/// One master's settings (`None`: not read, see `error`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSettings {
    pub node: SocketAddr,
    pub maxmemory_policy: Option<String>,
    pub appendonly: Option<String>,
    pub appendfsync: Option<String>,
    /// RDB snapshot rules as Redis prints them (`3600 1 300 100`), `""` when off.
    pub save: Option<String>,
    /// Why a setting could not be read (the first failure).
    pub error: Option<String>,
}

/// The settings of every master of `router`, in its order of masters.
pub async fn read_settings(router: &Router) -> Vec<NodeSettings> {
    let mut nodes = Vec::new();
    for node in router.masters() {
        let mut values: [Option<String>; 4] = Default::default();
        let mut error = None;
        for (name, value) in SETTINGS.iter().zip(values.iter_mut()) {
            let args: [&[u8]; 3] = [b"CONFIG", b"GET", name.as_bytes()];
            match router.request_on(node, |buf| crate::resp::encode_command(buf, &args)).await {
                Ok(reply) => match config_value(&reply, name) {
                    Ok(v) => *value = Some(v),
                    Err(why) => {
                        error.get_or_insert(why);
                    }
                },
                Err(e) => {
                    error.get_or_insert(format!("CONFIG GET {name}: {e}"));
                }
            }
        }
        let [maxmemory_policy, appendonly, appendfsync, save] = values;
        nodes.push(NodeSettings { node, maxmemory_policy, appendonly, appendfsync, save, error });
    }
    nodes
}

/// The value of `name` in a `CONFIG GET name` reply (`[name, value]`).
fn config_value(reply: &Reply, name: &str) -> Result<String, String> {
    if let Reply::Error(message) = reply {
        return Err(format!("CONFIG GET {name}: {}", String::from_utf8_lossy(message)));
    }
    let pairs = reply.as_array().unwrap_or(&[]);
    pairs
        .chunks(2)
        .find(|pair| pair.first().and_then(Reply::as_str) == Some(name))
        .and_then(|pair| pair.get(1).and_then(Reply::as_str))
        .map(str::to_owned)
        .ok_or_else(|| format!("CONFIG GET {name}: no such setting in the reply"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn bulk(s: &'static str) -> Reply {
        Reply::Bulk(Bytes::from_static(s.as_bytes()))
    }

    #[test]
    fn config_replies_are_read() {
        let reply = Reply::Array(vec![bulk("maxmemory-policy"), bulk("allkeys-lru")]);
        assert_eq!(config_value(&reply, "maxmemory-policy").unwrap(), "allkeys-lru");
        let empty_save = Reply::Array(vec![bulk("save"), bulk("")]);
        assert_eq!(config_value(&empty_save, "save").unwrap(), "");
        assert!(config_value(&Reply::Array(vec![]), "save").is_err());
        let refused = Reply::Error(Bytes::from_static(b"ERR unknown command 'CONFIG'"));
        assert!(config_value(&refused, "save").unwrap_err().contains("unknown command"));
    }
}
