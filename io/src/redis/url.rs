//! `FLASHSALE_REDIS_URL` (CONTRACT.md section 2): `redis://host:port[/db]`, or several
//! comma-separated seeds for a Redis Cluster: `redis://h1:p1,h2:p2` (each seed may repeat the
//! `redis://` scheme). Whether the server is a cluster is decided at connect time
//! (`super::router`), not by the number of seeds: one seed of a cluster is enough, and
//! several seeds of one standalone server are refused there.
//!
//! Parsed once where the configuration is read; host names are resolved here (blocking), so
//! nothing below start-up resolves names.
//!
//! Not here: credentials and TLS (refused with a clear error: the client sends no `AUTH`,
//! and silently dropping a password would be worse).

use std::net::{SocketAddr, ToSocketAddrs};

/// Most seeds one URL may list.
pub const SEEDS_MAX: usize = 64;

const DEFAULT_PORT: u16 = 6379;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisUrl {
    /// At least one, in the order given, duplicates removed.
    pub seeds: Vec<SocketAddr>,
    /// `/db`; Redis Cluster has only database 0.
    pub db: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    #[error("FLASHSALE_REDIS_URL must start with redis:// (got {0:?})")]
    Scheme(String),
    #[error("FLASHSALE_REDIS_URL has an empty seed")]
    EmptySeed,
    #[error("FLASHSALE_REDIS_URL lists more than {SEEDS_MAX} seeds")]
    TooManySeeds,
    #[error("FLASHSALE_REDIS_URL: credentials (user:password@) are not supported")]
    Credentials,
    #[error("FLASHSALE_REDIS_URL: bad port in {0:?}")]
    Port(String),
    #[error("FLASHSALE_REDIS_URL: bad database number in {0:?}")]
    Database(String),
    #[error("FLASHSALE_REDIS_URL: several seeds name different databases; a cluster has only 0")]
    ClusterDatabase,
    #[error("FLASHSALE_REDIS_URL: cannot resolve {host}: {message}")]
    Resolve { host: String, message: String },
}

impl RedisUrl {
    pub fn parse(url: &str) -> Result<RedisUrl, UrlError> {
        let rest =
            url.trim().strip_prefix("redis://").ok_or_else(|| UrlError::Scheme(url.into()))?;
        let mut seeds = Vec::new();
        let mut db = None;
        for part in rest.split(',') {
            let part = part.trim();
            let part = part.strip_prefix("redis://").unwrap_or(part);
            let (host_port, seed_db) = match part.split_once('/') {
                Some((hp, "")) => (hp, 0),
                Some((hp, d)) => (hp, d.parse().map_err(|_| UrlError::Database(part.into()))?),
                None => (part, 0),
            };
            if host_port.is_empty() {
                return Err(UrlError::EmptySeed);
            }
            if host_port.contains('@') {
                return Err(UrlError::Credentials);
            }
            match db {
                Some(d) if d != seed_db => return Err(UrlError::ClusterDatabase),
                _ => db = Some(seed_db),
            }
            for addr in resolve(host_port)? {
                if !seeds.contains(&addr) {
                    if seeds.len() >= SEEDS_MAX {
                        return Err(UrlError::TooManySeeds);
                    }
                    seeds.push(addr);
                }
            }
        }
        Ok(RedisUrl { seeds, db: db.unwrap_or(0) })
    }

    /// `redis://h:p,h:p` of these seeds (what `stack up --topology cluster` writes).
    pub fn render(seeds: &[SocketAddr]) -> String {
        let list: Vec<String> = seeds.iter().map(SocketAddr::to_string).collect();
        format!("redis://{}", list.join(","))
    }
}

/// `host[:port]`, `[v6]:port`; the first address a name resolves to.
fn resolve(host_port: &str) -> Result<Vec<SocketAddr>, UrlError> {
    let (host, port) = split_host_port(host_port)?;
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let resolved = (host, port)
        .to_socket_addrs()
        .map_err(|e| UrlError::Resolve { host: host.to_owned(), message: e.to_string() })?;
    let first = resolved.take(1).collect::<Vec<_>>();
    if first.is_empty() {
        return Err(UrlError::Resolve { host: host.to_owned(), message: "no address".into() });
    }
    Ok(first)
}

fn split_host_port(host_port: &str) -> Result<(&str, u16), UrlError> {
    let port_of = |p: &str| p.parse::<u16>().ok().filter(|&p| p != 0);
    if let Some(v6) = host_port.strip_prefix('[') {
        let (host, after) = v6.split_once(']').ok_or_else(|| UrlError::Port(host_port.into()))?;
        return match after.strip_prefix(':') {
            Some(p) => Ok((host, port_of(p).ok_or_else(|| UrlError::Port(host_port.into()))?)),
            None if after.is_empty() => Ok((host, DEFAULT_PORT)),
            None => Err(UrlError::Port(host_port.into())),
        };
    }
    match host_port.rsplit_once(':') {
        Some((host, p)) => Ok((host, port_of(p).ok_or_else(|| UrlError::Port(host_port.into()))?)),
        None => Ok((host_port, DEFAULT_PORT)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn one_seed_and_many() {
        let one = RedisUrl::parse("redis://127.0.0.1:6400/2").unwrap();
        assert_eq!(one, RedisUrl { seeds: vec![addr("127.0.0.1:6400")], db: 2 });
        let many = RedisUrl::parse("redis://127.0.0.1:7001,127.0.0.1:7002, redis://127.0.0.1:7003")
            .unwrap();
        assert_eq!(
            many.seeds,
            vec![addr("127.0.0.1:7001"), addr("127.0.0.1:7002"), addr("127.0.0.1:7003")]
        );
        assert_eq!(many.db, 0);
        let dup = RedisUrl::parse("redis://127.0.0.1:7001,127.0.0.1:7001").unwrap();
        assert_eq!(dup.seeds.len(), 1);
        assert_eq!(
            RedisUrl::parse("redis://127.0.0.1").unwrap().seeds,
            vec![addr("127.0.0.1:6379")]
        );
        assert_eq!(RedisUrl::parse("redis://[::1]:7000").unwrap().seeds, vec![addr("[::1]:7000")]);
        assert_eq!(RedisUrl::parse("redis://localhost:7000").unwrap().seeds[0].port(), 7000);
    }

    #[test]
    fn render_round_trips() {
        let seeds = vec![addr("127.0.0.1:7001"), addr("127.0.0.1:7002")];
        let url = RedisUrl::render(&seeds);
        assert_eq!(url, "redis://127.0.0.1:7001,127.0.0.1:7002");
        assert_eq!(RedisUrl::parse(&url).unwrap().seeds, seeds);
    }

    #[test]
    fn refusals() {
        assert!(matches!(RedisUrl::parse("http://x:1"), Err(UrlError::Scheme(_))));
        assert_eq!(RedisUrl::parse("redis://"), Err(UrlError::EmptySeed));
        assert_eq!(RedisUrl::parse("redis://127.0.0.1:1,"), Err(UrlError::EmptySeed));
        assert_eq!(RedisUrl::parse("redis://u:p@127.0.0.1:1"), Err(UrlError::Credentials));
        assert!(matches!(RedisUrl::parse("redis://127.0.0.1:0"), Err(UrlError::Port(_))));
        assert!(matches!(RedisUrl::parse("redis://127.0.0.1:x"), Err(UrlError::Port(_))));
        assert!(matches!(RedisUrl::parse("redis://127.0.0.1:1/x"), Err(UrlError::Database(_))));
        assert_eq!(
            RedisUrl::parse("redis://127.0.0.1:1/1,127.0.0.1:2"),
            Err(UrlError::ClusterDatabase)
        );
        let many: Vec<String> = (1..=65).map(|p| format!("127.0.0.1:{p}")).collect();
        assert_eq!(
            RedisUrl::parse(&format!("redis://{}", many.join(","))),
            Err(UrlError::TooManySeeds)
        );
    }
}
