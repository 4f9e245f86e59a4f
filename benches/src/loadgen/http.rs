//! The load generator's minimal HTTP/1.1 client side, sans-I/O: request bytes out, response
//! frames in, and the submit answer's business state.
//!
//! What it is:
//! - [`encode_submit`]: one `POST /v1/reservations` (CONTRACT.md 3.2) appended to a reused
//!   buffer, so pipelined requests go out in one write.
//! - [`parse_response`]: status line, headers, `Content-Length` body. "Not enough bytes yet"
//!   is `Ok(None)`; anything the engine never sends (chunked bodies, a missing or repeated
//!   length, a head over [`HEAD_BYTES_MAX`], a body over [`BODY_BYTES_MAX`]) is an error, so
//!   a confused stream is closed instead of being read as garbage.
//! - [`SubmitAnswer::parse`] and [`State`]: the closed set of submit states, plus `OTHER` for
//!   a body that carries none (a 404 from a wrong `--target`, say).
//!
//! What it is not: sockets, timeouts or reconnects (`driver.rs`), a general HTTP client
//! (no chunked encoding, no redirects, no 1xx).
//!
//! Read next: `driver.rs`.

use std::io::Write as _;

/// Longest response head accepted (the engine's heads are about 150 bytes).
pub const HEAD_BYTES_MAX: usize = 8 * 1024;
/// Longest response body accepted (submit answers are about 150 bytes; admin answers more).
pub const BODY_BYTES_MAX: usize = 1 << 20;

/// The submit states of CONTRACT.md 3.2, and `Other` for anything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    Queued,
    QueuedPending,
    SoldOut,
    DuplicateUser,
    ActivityNotActive,
    IdempotencyConflict,
    Invalid,
    Unauthorized,
    RateLimited,
    Overloaded,
    SubmitClosed,
    SystemBusy,
    Unknown,
    Other,
}

impl State {
    pub const COUNT: usize = 14;
    pub const ALL: [State; State::COUNT] = [
        State::Queued,
        State::QueuedPending,
        State::SoldOut,
        State::DuplicateUser,
        State::ActivityNotActive,
        State::IdempotencyConflict,
        State::Invalid,
        State::Unauthorized,
        State::RateLimited,
        State::Overloaded,
        State::SubmitClosed,
        State::SystemBusy,
        State::Unknown,
        State::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Queued => "QUEUED",
            State::QueuedPending => "QUEUED_PENDING",
            State::SoldOut => "SOLD_OUT",
            State::DuplicateUser => "DUPLICATE_USER",
            State::ActivityNotActive => "ACTIVITY_NOT_ACTIVE",
            State::IdempotencyConflict => "IDEMPOTENCY_CONFLICT",
            State::Invalid => "INVALID",
            State::Unauthorized => "UNAUTHORIZED",
            State::RateLimited => "RATE_LIMITED",
            State::Overloaded => "OVERLOADED",
            State::SubmitClosed => "SUBMIT_CLOSED",
            State::SystemBusy => "SYSTEM_BUSY",
            State::Unknown => "UNKNOWN",
            State::Other => "OTHER",
        }
    }

    pub fn parse(text: &str) -> State {
        State::ALL
            .into_iter()
            .find(|s| s.as_str() == text && *s != State::Other)
            .unwrap_or(State::Other)
    }

    pub fn index(self) -> usize {
        self as usize
    }

    /// The buyer holds a place in the queue (a reservation in Redis).
    pub fn is_reserved(self) -> bool {
        matches!(self, State::Queued | State::QueuedPending)
    }

    /// Worth retrying with the same request id (the retry policy of issue 5): the outcome
    /// is unknown, or nothing was done because the engine was busy.
    pub fn is_retryable(self) -> bool {
        matches!(self, State::Unknown | State::Overloaded | State::SystemBusy)
    }
}

/// Appends one submit request. `request_id` must already be valid
/// (`[A-Za-z0-9_-]{1,64}`, checked once at configuration time for its prefix).
pub fn encode_submit(
    buf: &mut Vec<u8>,
    host: &str,
    pass: &str,
    activity_id: u64,
    sku_id: u64,
    request_id: (&str, u64),
) {
    // The body is formatted first, on the stack, because the head carries its length; no
    // allocation per request. 160 bytes hold the longest body: 3 × 20 digits, a 64-byte id
    // and 60 bytes of JSON.
    let mut body = [0u8; 160];
    let mut cursor = std::io::Cursor::new(&mut body[..]);
    let _ = write!(
        cursor,
        r#"{{"activity_id":{activity_id},"sku_id":{sku_id},"request_id":"{}-{}","quantity":1}}"#,
        request_id.0, request_id.1
    );
    let body_len = cursor.position() as usize;
    let _ = write!(
        buf,
        "POST /v1/reservations HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {pass}\r\n\
         Content-Type: application/json\r\nContent-Length: {body_len}\r\n\r\n"
    );
    buf.extend_from_slice(&body[..body_len]);
}

/// Appends any request with an optional bearer token and JSON body (admin calls).
pub fn encode_request(
    buf: &mut Vec<u8>,
    method: &str,
    host: &str,
    path: &str,
    bearer: Option<&str>,
    body: Option<&str>,
) {
    let _ = write!(buf, "{method} {path} HTTP/1.1\r\nHost: {host}\r\n");
    if let Some(token) = bearer {
        let _ = write!(buf, "Authorization: Bearer {token}\r\n");
    }
    match body {
        Some(body) => {
            let _ = write!(
                buf,
                "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
        }
        None => buf.extend_from_slice(b"Content-Length: 0\r\n\r\n"),
    }
}

/// Why a response stream was given up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResponseError {
    #[error("malformed status line")]
    StatusLine,
    #[error("malformed header line")]
    Header,
    #[error("response head longer than {HEAD_BYTES_MAX} bytes")]
    HeadTooLarge,
    #[error("response body of {0} bytes is over the limit")]
    BodyTooLarge(usize),
    #[error("response without Content-Length")]
    NoLength,
    #[error("unsupported framing (Transfer-Encoding or repeated Content-Length)")]
    Framing,
}

/// One complete response, borrowed from the read buffer.
#[derive(Debug, PartialEq, Eq)]
pub struct Response<'a> {
    pub status: u16,
    pub body: &'a [u8],
    /// The server said `Connection: close`: nothing more will come on this stream.
    pub close: bool,
    /// Bytes of the buffer this response used (head and body).
    pub len: usize,
}

/// Parses one response from the front of `buf`; `Ok(None)` until it is complete.
pub fn parse_response(buf: &[u8]) -> Result<Option<Response<'_>>, ResponseError> {
    let Some(head_end) = find_head_end(buf) else {
        if buf.len() > HEAD_BYTES_MAX {
            return Err(ResponseError::HeadTooLarge);
        }
        return Ok(None);
    };
    if head_end > HEAD_BYTES_MAX {
        return Err(ResponseError::HeadTooLarge);
    }
    let head = &buf[..head_end];
    let mut lines = head.split(|&b| b == b'\n').map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let status = parse_status_line(lines.next().unwrap_or_default())?;
    let mut length: Option<usize> = None;
    let mut close = false;
    for line in lines {
        let colon = line.iter().position(|&b| b == b':').ok_or(ResponseError::Header)?;
        let (name, value) = (&line[..colon], trim(&line[colon + 1..]));
        if name.eq_ignore_ascii_case(b"content-length") {
            if length.is_some() {
                return Err(ResponseError::Framing);
            }
            length = Some(parse_length(value)?);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            return Err(ResponseError::Framing);
        } else if name.eq_ignore_ascii_case(b"connection") {
            close = value.eq_ignore_ascii_case(b"close");
        }
    }
    let length = match (length, status) {
        (Some(n), _) => n,
        // No body by definition (RFC 9112 6.3).
        (None, 204 | 304) => 0,
        (None, _) => return Err(ResponseError::NoLength),
    };
    let body_start = head_end + 4;
    let total = body_start + length;
    if buf.len() < total {
        return Ok(None);
    }
    Ok(Some(Response { status, body: &buf[body_start..total], close, len: total }))
}

fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n")
}

fn parse_status_line(line: &[u8]) -> Result<u16, ResponseError> {
    // "HTTP/1.1 202 Accepted": the version, one space, exactly three digits, then a space or
    // the end of the line.
    let rest = line
        .strip_prefix(b"HTTP/1.1 ")
        .or_else(|| line.strip_prefix(b"HTTP/1.0 "))
        .ok_or(ResponseError::StatusLine)?;
    let digits = rest.get(..3).ok_or(ResponseError::StatusLine)?;
    if !digits.iter().all(u8::is_ascii_digit) || rest.get(3).is_some_and(|&b| b != b' ') {
        return Err(ResponseError::StatusLine);
    }
    Ok(digits.iter().fold(0u16, |n, d| n * 10 + u16::from(d - b'0')))
}

fn parse_length(value: &[u8]) -> Result<usize, ResponseError> {
    if value.is_empty() || value.len() > 10 || !value.iter().all(u8::is_ascii_digit) {
        return Err(ResponseError::Framing);
    }
    let n = value.iter().fold(0usize, |n, d| n * 10 + usize::from(d - b'0'));
    if n > BODY_BYTES_MAX {
        return Err(ResponseError::BodyTooLarge(n));
    }
    Ok(n)
}

fn trim(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// What a submit answer says, as far as the load generator cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmitAnswer {
    pub state: State,
    pub reservation_id: Option<String>,
    pub retry_after_ms: Option<u64>,
    pub replayed: bool,
}

#[derive(serde::Deserialize)]
struct Body<'a> {
    #[serde(borrow)]
    state: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow)]
    reservation_id: Option<std::borrow::Cow<'a, str>>,
    retry_after_ms: Option<u64>,
    replayed: Option<bool>,
}

impl SubmitAnswer {
    /// Reads the body; a body that is not the contract's JSON is state `OTHER`.
    pub fn parse(body: &[u8]) -> SubmitAnswer {
        match serde_json::from_slice::<Body<'_>>(body) {
            Ok(b) => SubmitAnswer {
                state: b.state.as_deref().map_or(State::Other, State::parse),
                reservation_id: b.reservation_id.map(|r| r.into_owned()),
                retry_after_ms: b.retry_after_ms,
                replayed: b.replayed.unwrap_or(false),
            },
            Err(_) => SubmitAnswer {
                state: State::Other,
                reservation_id: None,
                retry_after_ms: None,
                replayed: false,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submit_request_is_exact() {
        let mut buf = Vec::new();
        encode_submit(&mut buf, "h:1", "v1.dev.1.2.3.sig", 10001, 20001, ("run7", 42));
        let text = String::from_utf8(buf).unwrap();
        let body = r#"{"activity_id":10001,"sku_id":20001,"request_id":"run7-42","quantity":1}"#;
        assert_eq!(
            text,
            format!(
                "POST /v1/reservations HTTP/1.1\r\nHost: h:1\r\nAuthorization: Bearer \
                 v1.dev.1.2.3.sig\r\nContent-Type: application/json\r\nContent-Length: {}\
                 \r\n\r\n{body}",
                body.len()
            )
        );
        // The longest body still fits the scratch buffer.
        let mut buf = Vec::new();
        let id = "r".repeat(43);
        encode_submit(&mut buf, "h", "p", u64::MAX, u64::MAX, (&id, u64::MAX));
        assert!(buf.ends_with(br#"-18446744073709551615","quantity":1}"#));
    }

    #[test]
    fn responses_parse_incrementally_and_in_pipeline_order() {
        let one = b"HTTP/1.1 202 Accepted\r\ncontent-type: application/json\r\n\
                    content-length: 18\r\nx-request-id: a\r\n\r\n{\"state\":\"QUEUED\"}";
        let two = b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\nConnection: close\r\n\r\n\
                    {\"state\":\"SOLD_OUT\"}";
        let mut stream = one.to_vec();
        stream.extend_from_slice(two);
        for cut in 0..one.len() {
            assert_eq!(parse_response(&stream[..cut]), Ok(None), "cut at {cut}");
        }
        let first = parse_response(&stream).unwrap().unwrap();
        assert_eq!((first.status, first.close, first.len), (202, false, one.len()));
        assert_eq!(SubmitAnswer::parse(first.body).state, State::Queued);
        let second = parse_response(&stream[first.len..]).unwrap().unwrap();
        assert_eq!((second.status, second.close), (200, true));
        assert_eq!(SubmitAnswer::parse(second.body).state, State::SoldOut);
    }

    #[test]
    fn framing_the_engine_never_sends_is_an_error() {
        let cases: [(&[u8], ResponseError); 6] = [
            (b"HTTP/1.1 20 OK\r\n\r\n", ResponseError::StatusLine),
            (b"SPDY 200 OK\r\n\r\n", ResponseError::StatusLine),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", ResponseError::Framing),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
                ResponseError::Framing,
            ),
            (b"HTTP/1.1 200 OK\r\nX\r\n\r\n", ResponseError::Header),
            (b"HTTP/1.1 200 OK\r\n\r\n", ResponseError::NoLength),
        ];
        for (raw, err) in cases {
            assert_eq!(parse_response(raw), Err(err), "{:?}", String::from_utf8_lossy(raw));
        }
        assert_eq!(
            parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 99999999\r\n\r\n"),
            Err(ResponseError::BodyTooLarge(99_999_999))
        );
        assert_eq!(
            parse_response(&vec![b'a'; HEAD_BYTES_MAX + 1]),
            Err(ResponseError::HeadTooLarge)
        );
        let no_content = parse_response(b"HTTP/1.1 204 No Content\r\n\r\n").unwrap().unwrap();
        assert_eq!((no_content.status, no_content.body.len()), (204, 0));
    }

    #[test]
    fn answers_carry_state_ids_and_retry_hints() {
        let a = SubmitAnswer::parse(
            br#"{"request_id":"r","state":"DUPLICATE_USER","reservation_id":"resv_1"}"#,
        );
        assert_eq!(a.state, State::DuplicateUser);
        assert_eq!(a.reservation_id.as_deref(), Some("resv_1"));
        let b = SubmitAnswer::parse(br#"{"state":"OVERLOADED","retry_after_ms":200}"#);
        assert_eq!((b.state, b.retry_after_ms), (State::Overloaded, Some(200)));
        assert!(b.state.is_retryable() && !State::SoldOut.is_retryable());
        let c = SubmitAnswer::parse(br#"{"state":"QUEUED","replayed":true}"#);
        assert!(c.replayed && c.state.is_reserved());
        assert_eq!(SubmitAnswer::parse(b"not json").state, State::Other);
        assert_eq!(SubmitAnswer::parse(br#"{"state":"NEW_THING"}"#).state, State::Other);
        for s in State::ALL {
            assert_eq!(State::ALL[s.index()], s);
            if s != State::Other {
                assert_eq!(State::parse(s.as_str()), s);
            }
        }
    }
}
