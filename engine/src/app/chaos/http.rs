//! The buyers' and the auditor's HTTP/1.1 client: one request per connection
//! (`Connection: close`), every step bounded by a timeout, the answer's status, body and
//! `retry_after_ms`. Deliberately tiny: the soak measures the engine, not a client library,
//! and a broken connection must be visible as such (`Err`), never retried here.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// One answer.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub body: serde_json::Value,
}

/// Biggest answer read (the engine's bodies are a few hundred bytes; a reconcile report a few
/// KiB).
const BODY_MAX_BYTES: u64 = 1 << 20;

/// `method path` to `addr` with an optional bearer and JSON body; `Err` when the connection
/// broke or timed out before a whole answer.
pub fn request(
    addr: SocketAddr,
    (method, path): (&str, &str),
    bearer: Option<&str>,
    body: Option<&str>,
    timeout: Duration,
) -> std::io::Result<Response> {
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let mut raw = format!("{method} {path} HTTP/1.1\r\nHost: chaos\r\nConnection: close\r\n");
    if let Some(token) = bearer {
        raw.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    let body = body.unwrap_or("");
    raw.push_str(&format!(
        "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    ));
    raw.push_str(body);
    stream.write_all(raw.as_bytes())?;
    let mut text = Vec::new();
    stream.take(BODY_MAX_BYTES).read_to_end(&mut text)?;
    parse(&text).ok_or_else(|| std::io::Error::other("an incomplete answer"))
}

fn parse(raw: &[u8]) -> Option<Response> {
    let text = std::str::from_utf8(raw).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let body = serde_json::from_str(body.trim()).unwrap_or(serde_json::Value::Null);
    Some(Response { status, body })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_status_and_json_body() {
        let raw = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 22\r\n\r\n{\"state\":\"SYSTEM_BUSY\"}";
        let r = parse(raw).unwrap();
        assert_eq!(r.status, 503);
        assert_eq!(r.body["state"], "SYSTEM_BUSY");
        assert!(parse(b"HTTP/1.1 200 OK\r\n").is_none(), "no end of head: incomplete");
    }
}
