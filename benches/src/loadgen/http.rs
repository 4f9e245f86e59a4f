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

use std::borrow::Cow;
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
        // A match, not a search of ALL: this runs once per answer.
        match text {
            "QUEUED" => State::Queued,
            "QUEUED_PENDING" => State::QueuedPending,
            "SOLD_OUT" => State::SoldOut,
            "DUPLICATE_USER" => State::DuplicateUser,
            "ACTIVITY_NOT_ACTIVE" => State::ActivityNotActive,
            "IDEMPOTENCY_CONFLICT" => State::IdempotencyConflict,
            "INVALID" => State::Invalid,
            "UNAUTHORIZED" => State::Unauthorized,
            "RATE_LIMITED" => State::RateLimited,
            "OVERLOADED" => State::Overloaded,
            "SUBMIT_CLOSED" => State::SubmitClosed,
            "SYSTEM_BUSY" => State::SystemBusy,
            "UNKNOWN" => State::Unknown,
            _ => State::Other,
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    /// The buyer holds a place in the queue (a reservation in Redis).
    pub fn is_reserved(self) -> bool {
        matches!(self, State::Queued | State::QueuedPending)
    }

    /// Worth retrying with the same request id (CONTRACT.md 3.2, issue 24 item 3): nothing
    /// was done because the engine or its dependencies were busy or closed for now
    /// (`OVERLOADED`, `RATE_LIMITED`, `SUBMIT_CLOSED`, `SYSTEM_BUSY`, each with a
    /// `Retry-After`), or the outcome is unknown (`UNKNOWN`: retry with the SAME id).
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            State::Overloaded
                | State::RateLimited
                | State::SubmitClosed
                | State::SystemBusy
                | State::Unknown
        )
    }

    /// The engine shed this request (its admission limit was reached; nothing reserved).
    pub fn is_shed(self) -> bool {
        self == State::Overloaded
    }
}

/// The parts of a submit request that are the same for the whole run, joined once: encoding
/// a request is then six copies and two numbers, no formatting machinery and no allocation
/// (the buffer is reused). The bytes are exactly those [`encode_submit`] documents.
#[derive(Debug, Clone)]
pub struct SubmitTemplate {
    /// `POST /v1/reservations HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer `
    head: Vec<u8>,
    /// `{"activity_id":{a},"sku_id":{s},"request_id":"{run_id}-`
    body_prefix: Vec<u8>,
}

/// Between the pass and the body's length.
const SUBMIT_MID: &[u8] = b"\r\nContent-Type: application/json\r\nContent-Length: ";
/// After the request id's sequence number.
const SUBMIT_BODY_SUFFIX: &[u8] = br#"","quantity":1}"#;

impl SubmitTemplate {
    /// `run_id` must already be valid (`[A-Za-z0-9_-]`, at most 43 characters: checked once
    /// at configuration time), so that `{run_id}-{seq}` is a valid request id.
    pub fn new(host: &str, activity_id: u64, sku_id: u64, run_id: &str) -> SubmitTemplate {
        let mut head = Vec::with_capacity(64 + host.len());
        head.extend_from_slice(b"POST /v1/reservations HTTP/1.1\r\nHost: ");
        head.extend_from_slice(host.as_bytes());
        head.extend_from_slice(b"\r\nAuthorization: Bearer ");
        let mut body_prefix = Vec::with_capacity(96);
        body_prefix.extend_from_slice(br#"{"activity_id":"#);
        push_u64(&mut body_prefix, activity_id);
        body_prefix.extend_from_slice(br#","sku_id":"#);
        push_u64(&mut body_prefix, sku_id);
        body_prefix.extend_from_slice(br#","request_id":""#);
        body_prefix.extend_from_slice(run_id.as_bytes());
        body_prefix.push(b'-');
        SubmitTemplate { head, body_prefix }
    }

    /// Appends the submit of request id `{run_id}-{seq}` with `pass`.
    pub fn encode(&self, buf: &mut Vec<u8>, pass: &str, seq: u64) {
        let mut digits = [0u8; 20];
        let seq_digits = u64_digits(seq, &mut digits);
        let body_len = self.body_prefix.len() + seq_digits.len() + SUBMIT_BODY_SUFFIX.len();
        buf.extend_from_slice(&self.head);
        buf.extend_from_slice(pass.as_bytes());
        buf.extend_from_slice(SUBMIT_MID);
        push_u64(buf, body_len as u64);
        buf.extend_from_slice(b"\r\n\r\n");
        buf.extend_from_slice(&self.body_prefix);
        buf.extend_from_slice(seq_digits);
        buf.extend_from_slice(SUBMIT_BODY_SUFFIX);
    }
}

/// The decimal digits of `n`, written at the end of `out`.
fn u64_digits(mut n: u64, out: &mut [u8; 20]) -> &[u8] {
    let mut at = out.len();
    loop {
        at -= 1;
        out[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &out[at..];
        }
    }
}

fn push_u64(buf: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; 20];
    buf.extend_from_slice(u64_digits(n, &mut digits));
}

/// Appends one submit request:
///
/// ```text
/// POST /v1/reservations HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {pass}\r\n
/// Content-Type: application/json\r\nContent-Length: {n}\r\n\r\n
/// {"activity_id":{a},"sku_id":{s},"request_id":"{run_id}-{seq}","quantity":1}
/// ```
///
/// One-off convenience over [`SubmitTemplate`] (which the driver builds once per run).
pub fn encode_submit(
    buf: &mut Vec<u8>,
    host: &str,
    pass: &str,
    activity_id: u64,
    sku_id: u64,
    request_id: (&str, u64),
) {
    SubmitTemplate::new(host, activity_id, sku_id, request_id.0).encode(buf, pass, request_id.1);
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
    /// `Retry-After` in delta-seconds (an HTTP-date, which the engine never sends, is
    /// ignored); the body's `retry_after_ms` is the finer hint and wins when both are there.
    pub retry_after_s: Option<u64>,
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
    let mut lines = Lines(Some(head)).map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let status = parse_status_line(lines.next().unwrap_or_default())?;
    let mut length: Option<usize> = None;
    let mut close = false;
    let mut retry_after_s = None;
    for line in lines {
        let colon = find_byte(line, b':').ok_or(ResponseError::Header)?;
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
        } else if name.eq_ignore_ascii_case(b"retry-after") {
            retry_after_s = parse_delta_seconds(value);
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
    Ok(Some(Response { status, body: &buf[body_start..total], close, retry_after_s, len: total }))
}

/// `Retry-After: 120` (RFC 9110 10.2.3 delta-seconds); `None` for a date or garbage.
fn parse_delta_seconds(value: &[u8]) -> Option<u64> {
    if value.is_empty() || value.len() > 10 || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(value.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

/// The pieces of a head between `\n`s, exactly as `split(|&b| b == b'\n')` yields them (the
/// last one after the last `\n`, even if empty), found with [`find_byte`].
struct Lines<'a>(Option<&'a [u8]>);

impl<'a> Iterator for Lines<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let rest = self.0?;
        match find_byte(rest, b'\n') {
            Some(nl) => {
                self.0 = Some(&rest[nl + 1..]);
                Some(&rest[..nl])
            }
            None => {
                self.0 = None;
                Some(rest)
            }
        }
    }
}

/// A one in the lowest bit of every byte (for the word-at-a-time searches below).
const BYTES_LO: u64 = 0x0101_0101_0101_0101;
/// A one in the highest bit of every byte.
const BYTES_HI: u64 = 0x8080_8080_8080_8080;

/// The high bit of every byte of `x` that is below `n` (`n` ≤ 128) is set. Only the lowest
/// flagged byte is sure to be one (a borrow out of a flagged byte can flag the byte above
/// it), which is all [`find_by`] reads. `n` = 1 flags the zero bytes.
fn bytes_below(x: u64, n: u8) -> u64 {
    x.wrapping_sub(BYTES_LO * u64::from(n)) & !x & BYTES_HI
}

/// The first byte of `hay` for which `byte` holds, looked for eight bytes at a time: `word`
/// gives a word's flags as [`bytes_below`] does (exact in its lowest flagged byte), `byte`
/// the same test for the tail. The response head and the body are searched with this once
/// per answer; a byte-at-a-time iterator cost ~8 instructions a byte (callgrind).
fn find_by(hay: &[u8], word: impl Fn(u64) -> u64, byte: impl Fn(u8) -> bool) -> Option<usize> {
    let mut chunks = hay.chunks_exact(8);
    let mut at = 0;
    for chunk in &mut chunks {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(chunk);
        let flags = word(u64::from_le_bytes(bytes));
        if flags != 0 {
            // Little-endian: the lowest flagged bit is the first flagged byte.
            return Some(at + (flags.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    chunks.remainder().iter().position(|&b| byte(b)).map(|i| at + i)
}

/// The first `needle` in `hay`.
fn find_byte(hay: &[u8], needle: u8) -> Option<usize> {
    let pattern = BYTES_LO * u64::from(needle);
    find_by(hay, |x| bytes_below(x ^ pattern, 1), |b| b == needle)
}

/// The first byte that ends a plain JSON string: a quote, a backslash or a control byte.
fn find_string_end(hay: &[u8]) -> Option<usize> {
    let quote = BYTES_LO * u64::from(b'"');
    let backslash = BYTES_LO * u64::from(b'\\');
    find_by(
        hay,
        |x| bytes_below(x ^ quote, 1) | bytes_below(x ^ backslash, 1) | bytes_below(x, 0x20),
        |b| b == b'"' || b == b'\\' || b < 0x20,
    )
}

/// Where the head's closing `\r\n\r\n` starts. Found through the `\n`s (one compare per
/// byte, then a look around each line end) rather than a four-byte window at every offset:
/// this runs once per answer, and the window scan was a third of the generator's own work
/// (callgrind, 2026-12-03). The first `\n` with `\r` before and `\r\n` after it is the
/// first `\r\n\r\n`, so the answer is the window scan's.
fn find_head_end(buf: &[u8]) -> Option<usize> {
    // A `\n` at 0 has no `\r` before it.
    let mut from = 1;
    while let Some(i) = find_byte(buf.get(from..)?, b'\n') {
        let nl = from + i;
        if buf[nl - 1] == b'\r' && buf.get(nl + 1..nl + 3) == Some(b"\r\n") {
            return Some(nl - 1);
        }
        from = nl + 1;
    }
    None
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

/// What a submit answer says, as far as the load generator cares (borrowed from the read
/// buffer: nothing is allocated per answer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmitAnswer<'a> {
    pub state: State,
    pub reservation_id: Option<Cow<'a, str>>,
    pub retry_after_ms: Option<u64>,
    pub replayed: bool,
}

#[derive(serde::Deserialize)]
struct Body<'a> {
    #[serde(borrow)]
    state: Option<Cow<'a, str>>,
    #[serde(borrow)]
    reservation_id: Option<Cow<'a, str>>,
    retry_after_ms: Option<u64>,
    replayed: Option<bool>,
}

impl<'a> SubmitAnswer<'a> {
    const OTHER: SubmitAnswer<'static> = SubmitAnswer {
        state: State::Other,
        reservation_id: None,
        retry_after_ms: None,
        replayed: false,
    };

    /// Reads the body; a body that is not the contract's JSON is state `OTHER`.
    ///
    /// The engine's answers are one flat object of strings, integers and booleans
    /// (CONTRACT.md 3.2), which [`scan_flat`] reads in one pass; anything it is not sure of
    /// (an escape, a nested value, a repeated field, a float) goes to serde_json, so the
    /// answer is always the one serde_json would give.
    pub fn parse(body: &'a [u8]) -> SubmitAnswer<'a> {
        if let Some(answer) = scan_flat(body) {
            return answer;
        }
        match serde_json::from_slice::<Body<'a>>(body) {
            Ok(b) => SubmitAnswer {
                state: b.state.as_deref().map_or(State::Other, State::parse),
                reservation_id: b.reservation_id,
                retry_after_ms: b.retry_after_ms,
                replayed: b.replayed.unwrap_or(false),
            },
            Err(_) => SubmitAnswer::OTHER,
        }
    }
}

/// One value of a flat JSON object, as far as [`scan_flat`] reads it.
enum Flat<'a> {
    Str(&'a str),
    Uint(u64),
    Bool(bool),
    Null,
}

/// Reads a flat JSON object `{"k":v,...}` whose values are strings without escapes, unsigned
/// integers, booleans or null; `None` for anything else (the caller then asks serde_json).
fn scan_flat(body: &[u8]) -> Option<SubmitAnswer<'_>> {
    // serde_json refuses a body that is not UTF-8 anywhere; so does this.
    let text = std::str::from_utf8(body).ok()?;
    let mut s = Scanner { text, at: 0 };
    let mut answer = SubmitAnswer::OTHER;
    let mut known = [false; 4];
    s.skip_ws();
    s.expect(b'{')?;
    s.skip_ws();
    if s.peek() == Some(b'}') {
        s.at += 1;
    } else {
        loop {
            s.skip_ws();
            let key = s.plain_string()?;
            s.skip_ws();
            s.expect(b':')?;
            s.skip_ws();
            let value = s.value()?;
            let slot = match key {
                "state" => 0,
                "reservation_id" => 1,
                "retry_after_ms" => 2,
                "replayed" => 3,
                _ => usize::MAX,
            };
            if slot != usize::MAX {
                // serde_json refuses a repeated field.
                if std::mem::replace(&mut known[slot], true) {
                    return None;
                }
                match (slot, value) {
                    (_, Flat::Null) => {}
                    (0, Flat::Str(v)) => answer.state = State::parse(v),
                    (1, Flat::Str(v)) => answer.reservation_id = Some(Cow::Borrowed(v)),
                    (2, Flat::Uint(v)) => answer.retry_after_ms = Some(v),
                    (3, Flat::Bool(v)) => answer.replayed = v,
                    // A field of the wrong type: serde_json's error, not ours to guess.
                    _ => return None,
                }
            }
            s.skip_ws();
            match s.next()? {
                b',' => continue,
                b'}' => break,
                _ => return None,
            }
        }
    }
    s.skip_ws();
    (s.at == text.len()).then_some(answer)
}

struct Scanner<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.at += 1;
        Some(b)
    }

    fn expect(&mut self, b: u8) -> Option<()> {
        (self.next()? == b).then_some(())
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// A string without escapes or control characters (JSON forbids raw ones).
    fn plain_string(&mut self) -> Option<&'a str> {
        self.expect(b'"')?;
        let start = self.at;
        // One word-at-a-time search for whatever ends the plain run (most of a body is
        // strings).
        let rest = self.text.as_bytes().get(start..)?;
        let len = find_string_end(rest)?;
        if rest[len] != b'"' {
            return None;
        }
        self.at = start + len + 1;
        self.text.get(start..start + len)
    }

    fn value(&mut self) -> Option<Flat<'a>> {
        match self.peek()? {
            b'"' => self.plain_string().map(Flat::Str),
            b'0'..=b'9' => self.uint().map(Flat::Uint),
            b't' => self.word("true").map(|()| Flat::Bool(true)),
            b'f' => self.word("false").map(|()| Flat::Bool(false)),
            b'n' => self.word("null").map(|()| Flat::Null),
            _ => None,
        }
    }

    /// `0` or `[1-9][0-9]*` that fits a u64 and is not followed by a fraction or exponent.
    fn uint(&mut self) -> Option<u64> {
        let bytes = self.text.as_bytes();
        let start = self.at;
        while bytes.get(self.at).is_some_and(u8::is_ascii_digit) {
            self.at += 1;
        }
        let digits = &bytes[start..self.at];
        if (digits.len() > 1 && digits[0] == b'0')
            || matches!(self.peek(), Some(b'.' | b'e' | b'E'))
        {
            return None;
        }
        digits.iter().try_fold(0u64, |n, d| n.checked_mul(10)?.checked_add(u64::from(d - b'0')))
    }

    fn word(&mut self, word: &str) -> Option<()> {
        let end = self.at + word.len();
        (self.text.get(self.at..end)? == word).then(|| self.at = end)
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

    /// The line-end search finds what a four-byte window scan finds: every string of up to
    /// eight bytes over `\r`, `\n` and one other byte, and a real head cut anywhere.
    #[test]
    fn head_end_is_the_window_scans() {
        let window = |b: &[u8]| b.windows(4).position(|w| w == b"\r\n\r\n");
        let alphabet = [b'\r', b'\n', b'a'];
        for len in 0..=8u32 {
            for mut code in 0..3usize.pow(len) {
                let bytes: Vec<u8> = (0..len)
                    .map(|_| {
                        let b = alphabet[code % 3];
                        code /= 3;
                        b
                    })
                    .collect();
                assert_eq!(find_head_end(&bytes), window(&bytes), "{bytes:?}");
            }
        }
        let head = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx: a\n\r\n\r\n{}\r\n\r\n";
        for cut in 0..=head.len() {
            assert_eq!(find_head_end(&head[..cut]), window(&head[..cut]), "cut at {cut}");
        }
    }

    /// The word-at-a-time searches find what a byte loop finds: each byte value at each
    /// position of a word and its tail, over fillers on both sides of every boundary the
    /// flag arithmetic has (0x00, 0x1f/0x20, 0x7f/0x80, 0xff, and neighbours of the needles).
    #[test]
    fn word_searches_agree_with_a_byte_loop() {
        let fillers = [b'a', 0x00, 0x1f, 0x20, 0x7f, 0x80, 0xff, b'\n' + 1, b'"' - 1, b'\\' + 1];
        for len in 0..=19 {
            for filler in fillers {
                for at in 0..=len {
                    for value in 0..=255u8 {
                        let mut hay = vec![filler; len];
                        if at < len {
                            hay[at] = value;
                        }
                        for needle in [b'\n', b':', b'"'] {
                            let by_loop = hay.iter().position(|&b| b == needle);
                            assert_eq!(find_byte(&hay, needle), by_loop, "{hay:?} {needle}");
                        }
                        let by_loop = hay.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20);
                        assert_eq!(find_string_end(&hay), by_loop, "{hay:?}");
                    }
                }
            }
        }
        let lines: Vec<&[u8]> = Lines(Some(b"a\nbc\n\nd\n")).collect();
        assert_eq!(lines, b"a\nbc\n\nd\n".split(|&b| b == b'\n').collect::<Vec<_>>());
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

    #[test]
    fn retry_after_header_is_read_in_seconds() {
        let raw =
            b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 2\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse_response(raw).unwrap().unwrap().retry_after_s, Some(2));
        let date = b"HTTP/1.1 503 X\r\nretry-after: Fri, 31 Dec 1999 23:59:59 GMT\r\n\
                     content-length: 0\r\n\r\n";
        assert_eq!(parse_response(date).unwrap().unwrap().retry_after_s, None);
        let none = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(parse_response(none).unwrap().unwrap().retry_after_s, None);
    }

    /// The template writes, request after request, what a fresh `encode_submit` writes.
    #[test]
    fn template_encodes_like_encode_submit_into_a_reused_buffer() {
        let template = SubmitTemplate::new("127.0.0.1:8080", 10_001, 20_001, "lgx");
        let mut buf = Vec::new();
        for seq in [0u64, 9, 10, 99, 12_345, u64::MAX] {
            buf.clear();
            template.encode(&mut buf, "v1.dev.7.10001.99.sig", seq);
            let mut fresh = Vec::new();
            encode_submit(
                &mut fresh,
                "127.0.0.1:8080",
                "v1.dev.7.10001.99.sig",
                10_001,
                20_001,
                ("lgx", seq),
            );
            assert_eq!(buf, fresh);
            let text = String::from_utf8(buf.clone()).unwrap();
            let (head, body) = text.split_once("\r\n\r\n").unwrap();
            assert!(head.ends_with(&format!("Content-Length: {}", body.len())), "{text}");
            assert!(body.contains(&format!(r#""request_id":"lgx-{seq}""#)), "{text}");
        }
    }

    /// The one-pass scanner gives serde_json's answer on every body: the engine's, and odd
    /// ones it must hand over (escapes, nesting, repeated or mistyped fields, junk).
    #[test]
    fn scanner_agrees_with_serde_json() {
        let bodies: &[&[u8]] = &[
            br#"{"request_id":"lg1-5","state":"SOLD_OUT"}"#,
            br#"{"request_id":"lg1-5","state":"QUEUED","reservation_id":"resv_01J","replayed":true}"#,
            br#"{"request_id":"r","state":"OVERLOADED","reason_code":"IN_FLIGHT","retry_after_ms":137}"#,
            br#" { "state" : "SYSTEM_BUSY" , "retry_after_ms" : 0 } "#,
            br#"{}"#,
            br#"{"state":null,"replayed":null,"retry_after_ms":null}"#,
            br#"{"state":"QUE\u0055ED"}"#,
            br#"{"state":"SOLD_OUT","extra":{"nested":[1,2]}}"#,
            br#"{"state":"SOLD_OUT","extra":1.5e3}"#,
            br#"{"state":"SOLD_OUT","state":"QUEUED"}"#,
            br#"{"state":5}"#,
            br#"{"state":"SOLD_OUT","retry_after_ms":-1}"#,
            br#"{"state":"SOLD_OUT","retry_after_ms":1.0}"#,
            br#"{"state":"SOLD_OUT","retry_after_ms":012}"#,
            br#"{"state":"SOLD_OUT","retry_after_ms":99999999999999999999999}"#,
            br#"{"state":"SOLD_OUT"} trailing"#,
            br#"{"state":"SOLD_OUT",}"#,
            br#"{"state":"SOLD_OUT""#,
            br#"["SOLD_OUT"]"#,
            b"{\"state\":\"SOLD\tOUT\"}",
            b"{\"state\":\"SOLD_OUT\",\"x\":\"\xff\"}",
            br#"{"replayed":true,"reservation_id":"resv_a","state":"DUPLICATE_USER"}"#,
            b"",
            b"not json",
        ];
        for body in bodies {
            let fallback = match serde_json::from_slice::<Body<'_>>(body) {
                Ok(b) => SubmitAnswer {
                    state: b.state.as_deref().map_or(State::Other, State::parse),
                    reservation_id: b.reservation_id,
                    retry_after_ms: b.retry_after_ms,
                    replayed: b.replayed.unwrap_or(false),
                },
                Err(_) => SubmitAnswer::OTHER,
            };
            assert_eq!(SubmitAnswer::parse(body), fallback, "{}", String::from_utf8_lossy(body));
        }
        // The engine's own answers never leave the fast path.
        assert!(scan_flat(bodies[1]).is_some() && scan_flat(bodies[2]).is_some());
        assert!(scan_flat(bodies[6]).is_none() && scan_flat(bodies[7]).is_none());
    }
}
