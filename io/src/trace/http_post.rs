//! The one HTTP call of trace export: `POST` an OTLP/HTTP protobuf body to the collector and
//! read its status, over a fresh tokio TCP connection (`Connection: close`).
//!
//! Why our own: the export sends one small request at most every few hundred milliseconds
//! to a collector on loopback or the private network (a sidecar, seed ch9 §2); an HTTP/1.1
//! request line, four headers and a bounded read of the answer do that, where reqwest or
//! hyper would add their build to a 2-core box. No TLS, no redirects, no proxies: an `https`
//! endpoint is refused at start.
//!
//! Every call is bounded by the caller's deadline (`export.rs` wraps it in a timeout): a
//! collector that accepts and never answers costs one idle connection until then.
//!
//! What it is not: encoding the body (`export.rs`).

use std::fmt;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The path OTLP/HTTP receives traces on (OTLP specification, "OTLP/HTTP Request").
pub const TRACES_PATH: &str = "/v1/traces";

/// Largest answer head and body read from a collector; an OTLP answer is a few bytes.
const ANSWER_BYTES_MAX: usize = 16 * 1024;

/// Where spans go: `http://host:port[/path]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpEndpoint {
    /// `host:port`, resolved at each connection (a collector's address may move).
    authority: String,
    /// `/v1/traces` unless the URL names a path of its own.
    path: String,
}

impl OtlpEndpoint {
    /// `http://host:port` (spans go to `/v1/traces`, as the OTLP specification does for a
    /// base endpoint) or `http://host:port/path/to/traces` (a path of its own, used as given).
    pub fn parse(url: &str) -> Result<OtlpEndpoint, String> {
        let url = url.trim();
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("{url:?}: only http://host:port[/path] is supported"))?;
        let (authority, path) = match rest.find('/') {
            Some(at) => rest.split_at(at),
            None => (rest, ""),
        };
        let (host, port) = authority
            .rsplit_once(':')
            .ok_or_else(|| format!("{url:?}: the port is missing (OTLP/HTTP listens on 4318)"))?;
        let port_ok = port.parse::<u16>().is_ok_and(|p| p != 0);
        let host_ok = !host.is_empty()
            && host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.[]:".contains(&b));
        if !port_ok || !host_ok || authority.contains('@') {
            return Err(format!("{url:?}: not a host:port"));
        }
        if path.bytes().any(|b| b.is_ascii_control() || b == b' ' || b == b'?' || b == b'#') {
            return Err(format!("{url:?}: the path must be a plain path"));
        }
        let path = match path.trim_end_matches('/') {
            "" => TRACES_PATH.to_owned(),
            given => given.to_owned(),
        };
        Ok(OtlpEndpoint { authority: authority.to_owned(), path })
    }

    pub fn authority(&self) -> &str {
        &self.authority
    }

    pub fn path(&self) -> &str {
        &self.path
    }
}

impl fmt::Display for OtlpEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}{}", self.authority, self.path)
    }
}

/// Why a POST did not get a 2xx answer.
#[derive(Debug, thiserror::Error)]
pub enum PostError {
    #[error("collector at {endpoint}: {source}")]
    Io { endpoint: String, source: std::io::Error },
    #[error("collector at {endpoint} answered {status}")]
    Status { endpoint: String, status: u16 },
    #[error("collector at {endpoint}: unreadable answer ({why})")]
    Answer { endpoint: String, why: &'static str },
}

/// POSTs `body` as `content_type` and returns the answer's status when it is 2xx.
pub async fn post(
    endpoint: &OtlpEndpoint,
    content_type: &str,
    body: &[u8],
) -> Result<u16, PostError> {
    let io = |source| PostError::Io { endpoint: endpoint.to_string(), source };
    let mut stream = TcpStream::connect(&endpoint.authority).await.map_err(io)?;
    stream.set_nodelay(true).map_err(io)?;
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: {content_type}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        endpoint.path,
        endpoint.authority,
        body.len()
    );
    stream.write_all(head.as_bytes()).await.map_err(io)?;
    stream.write_all(body).await.map_err(io)?;
    let status = read_status(&mut stream, endpoint).await?;
    if (200..300).contains(&status) {
        Ok(status)
    } else {
        Err(PostError::Status { endpoint: endpoint.to_string(), status })
    }
}

/// Reads the answer's head (bounded) and returns its status; the body is not needed (a
/// partial success is the collector's to log).
async fn read_status(stream: &mut TcpStream, endpoint: &OtlpEndpoint) -> Result<u16, PostError> {
    let answer = |why| PostError::Answer { endpoint: endpoint.to_string(), why };
    let mut buf = vec![0u8; ANSWER_BYTES_MAX];
    let mut filled = 0;
    loop {
        let read = stream
            .read(&mut buf[filled..])
            .await
            .map_err(|source| PostError::Io { endpoint: endpoint.to_string(), source })?;
        if read == 0 {
            return Err(answer("closed before the status line"));
        }
        filled += read;
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut response = httparse::Response::new(&mut headers);
        match response.parse(&buf[..filled]) {
            Ok(httparse::Status::Complete(_)) => {
                return response.code.ok_or_else(|| answer("no status"));
            }
            Ok(httparse::Status::Partial) if filled < buf.len() => continue,
            Ok(httparse::Status::Partial) => return Err(answer("head too large")),
            Err(_) => return Err(answer("not HTTP/1.x")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_is_plain_http_with_a_port_and_a_path_defaulting_to_v1_traces() {
        let base = OtlpEndpoint::parse("http://127.0.0.1:4318").expect("valid");
        assert_eq!((base.authority(), base.path()), ("127.0.0.1:4318", "/v1/traces"));
        assert_eq!(
            OtlpEndpoint::parse("http://collector:4318/").expect("valid").path(),
            "/v1/traces"
        );
        let own = OtlpEndpoint::parse(" http://[::1]:9000/otlp/v1/traces ").expect("valid");
        assert_eq!((own.authority(), own.path()), ("[::1]:9000", "/otlp/v1/traces"));
        assert_eq!(own.to_string(), "http://[::1]:9000/otlp/v1/traces");
        for bad in [
            "https://c:4318",
            "127.0.0.1:4318",
            "http://collector",
            "http://c:0",
            "http://c:99999",
            "http://user@c:4318",
            "http://c:4318/a b",
            "http://c:4318/x?y",
            "http://:4318",
        ] {
            assert!(OtlpEndpoint::parse(bad).is_err(), "{bad:?}");
        }
    }
}
