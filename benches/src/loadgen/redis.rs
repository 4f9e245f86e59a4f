//! A minimal tokio Redis client for the checks after a run: RESP2 over one `TcpStream`,
//! using the project's own codec (`flashsale_io::resp`), commands pipelined in batches.
//!
//! What it is not: the engine's glommio client (`flashsale_io::redis`), which needs a
//! glommio executor; this one runs off the hot path, a few thousand commands per run.
//!
//! Read next: `verify.rs`.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;
use flashsale_io::resp::{self, Reply};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bound on one round trip (a batch of commands).
const ROUND_TRIP_MS_MAX: u64 = 10_000;

/// One connection.
pub struct Redis {
    stream: TcpStream,
    read: BytesMut,
    write: BytesMut,
}

impl Redis {
    pub async fn connect(addr: SocketAddr) -> Result<Redis, String> {
        let connect = TcpStream::connect(addr);
        let stream = tokio::time::timeout(Duration::from_millis(ROUND_TRIP_MS_MAX), connect)
            .await
            .map_err(|_| format!("connect to Redis {addr}: timed out"))?
            .map_err(|e| format!("connect to Redis {addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        Ok(Redis { stream, read: BytesMut::with_capacity(64 * 1024), write: BytesMut::new() })
    }

    /// A connection to the node that serves `key`: `addr` itself (standalone, or the right
    /// cluster node), or where its `MOVED` answer points (a few hops at most).
    pub async fn connect_serving(addr: SocketAddr, key: &str) -> Result<Redis, String> {
        let mut addr = addr;
        for _ in 0..3 {
            let mut redis = Redis::connect(addr).await?;
            let reply = redis.command(&[b"EXISTS", key.as_bytes()]).await?;
            let moved = reply.as_error().and_then(|e| {
                let text = std::str::from_utf8(e).ok()?;
                text.strip_prefix("MOVED ")?.split(' ').nth(1)?.parse::<SocketAddr>().ok()
            });
            match moved {
                Some(next) => addr = next,
                None => return Ok(redis),
            }
        }
        Err(format!("Redis: too many redirects for {key}"))
    }

    /// One command; a server error reply is returned as a value.
    pub async fn command(&mut self, args: &[&[u8]]) -> Result<Reply, String> {
        let mut replies = self.pipeline(std::slice::from_ref(&args.to_vec())).await?;
        replies.pop().ok_or_else(|| "no reply".to_owned())
    }

    /// Several commands in one write; replies in order.
    pub async fn pipeline(&mut self, commands: &[Vec<&[u8]>]) -> Result<Vec<Reply>, String> {
        self.write.clear();
        for args in commands {
            resp::encode_command(&mut self.write, args);
        }
        let round_trip = async {
            self.stream.write_all(&self.write).await.map_err(|e| format!("Redis write: {e}"))?;
            let mut replies = Vec::with_capacity(commands.len());
            while replies.len() < commands.len() {
                match resp::decode(&mut self.read) {
                    Ok(Some(reply)) => replies.push(reply),
                    Ok(None) => {
                        let n = self
                            .stream
                            .read_buf(&mut self.read)
                            .await
                            .map_err(|e| format!("Redis read: {e}"))?;
                        if n == 0 {
                            return Err("Redis closed the connection".to_owned());
                        }
                    }
                    Err(e) => return Err(format!("Redis protocol: {e}")),
                }
            }
            Ok(replies)
        };
        tokio::time::timeout(Duration::from_millis(ROUND_TRIP_MS_MAX), round_trip)
            .await
            .map_err(|_| "Redis round trip timed out".to_owned())?
    }
}

/// A reply as UTF-8 text (bulk or simple string), if it is one.
pub fn text(reply: &Reply) -> Option<&str> {
    reply.as_str()
}
