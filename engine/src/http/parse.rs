//! Request parsing: bytes in, one [`Parsed`] out — a borrowed [`Request`], "not enough
//! bytes yet" ([`Parsed::Incomplete`]) or a [`Rejection`] the connection answers and then
//! closes on.
//!
//! What it does: a strict pre-scan of the head (`scan_head`: CRLF only, no obs-fold, no
//! whitespace before a colon, the request-line and header-section limits enforced on
//! whatever has arrived so far), then `httparse` over the complete head into a fixed
//! stack array of [`HEADER_SLOTS`] headers ([`super::limits`]), then our own validation of the few headers
//! that matter (framing, `Host`, `Connection`, and the ones the edge reads), then the body
//! (Content-Length, or chunked via [`super::chunked`]).
//!
//! What it does not do: any I/O, allocation, clock reading, routing or authentication.
//! It does not decide 404/405/501 for a method or path (the router does) and it does not
//! enforce time limits or the pipelining depth (the connection does, with
//! [`Limits::pipeline_depth_max`]).
//!
//! Read next: [`super::chunked`] for the chunked body, [`super::response`] for what is
//! written back, and the smuggling rules in [`super`] (the module doc of `http`).

use std::mem::MaybeUninit;
use std::ops::ControlFlow;

use super::chunked::{self, ChunkedScan};
use super::limits::{Limits, HEADER_SLOTS};
use super::line::{find_line_end, LineEnd};
pub use super::rejection::Rejection;

/// Empty lines (CRLF) tolerated before the request line. RFC 9112 section 2.2 asks a
/// server to ignore "at least one" (some clients send a stray CRLF after a POST body);
/// more than a few is not a client bug but junk, and we would rather not loop on it.
pub const LEADING_EMPTY_LINES_MAX: usize = 2;

/// Longest `Content-Length` value accepted, in digits. 20 digits hold every `u64`;
/// anything longer is either an overflow or absurd zero padding: rejected as malformed.
pub const CONTENT_LENGTH_DIGITS_MAX: usize = 20;

/// The outcome of one call to [`parse_request`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed<'b> {
    /// Every byte so far is a valid prefix within the limits; read more and call again
    /// with the whole buffer (the parser keeps no state between calls).
    Incomplete,
    /// One request; the next one (pipelining) starts at `buf[consumed..]`.
    Complete { request: Request<'b>, consumed: usize },
    /// Answer with [`super::response::write_rejection`], then close the connection.
    Reject(Rejection),
}

/// Request methods the router distinguishes; everything else is `Other` (405/501 is the
/// router's call, not the parser's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Post,
    Head,
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    Http10,
    Http11,
}

/// A parsed request, borrowing from the connection's buffer.
///
/// The header values the edge reads are ASCII by their grammar and are checked to be, so
/// they are `&str`. Other headers are validated (no control characters) and ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request<'b> {
    pub method: Method,
    /// The method as sent, for logs and for the router's 405/501 on `Method::Other`.
    pub method_token: &'b str,
    pub version: Version,
    /// Origin-form path, starting with `/`, without the query.
    pub path: &'b str,
    /// What follows the first `?`, without it (`Some("")` for a bare `?`).
    pub query: Option<&'b str>,
    /// Always `Some` for HTTP/1.1 (required); may be `None` for HTTP/1.0.
    pub host: Option<&'b str>,
    pub authorization: Option<&'b str>,
    pub x_request_id: Option<&'b str>,
    /// A valid W3C `traceparent` ([`is_valid_traceparent`]); an invalid one is `None`, as if
    /// absent, so that it is never echoed nor stored in a message.
    pub traceparent: Option<&'b str>,
    pub content_type: Option<&'b str>,
    /// Whether the connection may carry another request after this one's answer. When
    /// false the connection answers this request, then closes, and parses nothing after it.
    pub keep_alive: bool,
    pub body: Body<'b>,
}

/// A request body. Content-Length bodies are a slice of the buffer; chunked bodies stay
/// encoded (already validated) until [`Body::bytes`] decodes them into the caller's
/// scratch buffer, so that [`parse_request`] needs no buffer of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body<'b> {
    /// No framing header, or Content-Length (possibly 0).
    Fixed(&'b [u8]),
    /// A validated chunked encoding (`wire` is the whole chunk stream including the last
    /// chunk and final CRLF) whose decoded length is `len`.
    Chunked { wire: &'b [u8], len: usize },
}

impl<'b> Body<'b> {
    /// Decoded length in bytes (at most [`Limits::body_bytes_max`]).
    pub fn len(&self) -> usize {
        match self {
            Body::Fixed(bytes) => bytes.len(),
            Body::Chunked { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The body's bytes. A `Fixed` body is returned as is and `scratch` is untouched; a
    /// chunked body is decoded into `scratch` (cleared first). The connection keeps one
    /// `scratch` with capacity [`Limits::body_bytes_max`], so decoding never allocates.
    pub fn bytes<'s>(&'s self, scratch: &'s mut Vec<u8>) -> &'s [u8] {
        match *self {
            Body::Fixed(bytes) => bytes,
            Body::Chunked { wire, len } => {
                scratch.clear();
                scratch.reserve(len);
                // `wire` passed the same scan in `parse_request`, and its exact lengths
                // are the tightest bounds that still admit it, so this cannot fail.
                let bounds = chunked::Bounds { body_bytes_max: len, wire_bytes_max: wire.len() };
                let outcome = chunked::scan(wire, bounds, |data| scratch.extend_from_slice(data));
                debug_assert_eq!(
                    outcome,
                    ChunkedScan::Complete { wire_len: wire.len(), body_len: len }
                );
                scratch
            }
        }
    }
}

/// Parses one request from the front of `buf`.
///
/// Stateless: call it again with the whole (grown) buffer after every read; a complete
/// request is never reported before its last byte has arrived, and every limit is
/// enforced on a prefix as soon as the prefix alone breaks it. Cost: linear in the
/// request's bytes, and never more than [`Limits::request_bytes_max`] bytes are looked at
/// however large `buf` is.
pub fn parse_request<'b>(buf: &'b [u8], limits: &Limits) -> Parsed<'b> {
    let (head, head_len) = match parse_head(buf, limits) {
        HeadParse::Complete { head, head_len } => (head, head_len),
        HeadParse::Incomplete => return Parsed::Incomplete,
        HeadParse::Reject(rejection) => return Parsed::Reject(rejection),
    };
    let after_head = &buf[head_len..];
    let (body, body_wire_len) = match head.framing {
        Framing::Length(length) => match after_head.get(..length) {
            Some(bytes) => (Body::Fixed(bytes), length),
            None => return Parsed::Incomplete,
        },
        Framing::Chunked => match chunked::scan(after_head, chunked::Bounds::of(limits), |_| {}) {
            ChunkedScan::Complete { wire_len, body_len } => {
                (Body::Chunked { wire: &after_head[..wire_len], len: body_len }, wire_len)
            }
            ChunkedScan::Incomplete => return Parsed::Incomplete,
            ChunkedScan::Reject(rejection) => return Parsed::Reject(rejection),
        },
    };
    let consumed = head_len + body_wire_len;
    assert!(consumed <= buf.len(), "a request never extends past the bytes received");
    Parsed::Complete { request: head.into_request(body), consumed }
}

/// Where a request that [`parse_request`] called [`Parsed::Incomplete`] stands: the
/// connection needs it for its deadlines (the head within the header deadline from its first
/// byte, the body within the body deadline from the end of the head) and for `100 Continue`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// The head has not all arrived.
    Head,
    /// The head is complete and valid; (some of) the body is missing. `expect_continue`: an
    /// HTTP/1.1 request with `Expect: 100-continue`, whose client waits for `100 Continue`
    /// before it sends the body (RFC 9110 section 10.1.1).
    Body { expect_continue: bool },
}

/// [`Progress`] of the incomplete request at the start of `buf`. Call it only after
/// [`parse_request`] answered `Incomplete` on the same bytes (it parses the head again: a
/// cost paid only by requests that arrive in pieces).
pub fn progress(buf: &[u8], limits: &Limits) -> Progress {
    match parse_head(buf, limits) {
        HeadParse::Complete { head, .. } => {
            Progress::Body { expect_continue: head.expect_continue }
        }
        HeadParse::Incomplete | HeadParse::Reject(_) => Progress::Head,
    }
}

/// The head of the request at the start of `buf`, validated.
enum HeadParse<'b> {
    Incomplete,
    Complete { head: Head<'b>, head_len: usize },
    Reject(Rejection),
}

fn parse_head<'b>(buf: &'b [u8], limits: &Limits) -> HeadParse<'b> {
    // No byte past the largest acceptable head can belong to the head: scanning no
    // further bounds the cost of a call whatever the buffer holds, and changes no answer
    // (a head not complete within the window breaks a limit within it).
    let head_window = &buf[..buf.len().min(limits.header_section_bytes_max + 1)];
    let head_len = match scan_head(head_window, limits) {
        HeadScan::Complete { head_len } => head_len,
        HeadScan::Reject(rejection) => return HeadParse::Reject(rejection),
        HeadScan::Incomplete => {
            return match syntax_check_prefix(head_window) {
                Some(rejection) => HeadParse::Reject(rejection),
                None => HeadParse::Incomplete,
            };
        }
    };
    let head_bytes = &buf[..head_len];
    // Uninitialised slots: httparse's safe `parse_with_uninit_headers` writes only what it
    // parses, which saves zeroing 64 headers (1.5 KiB) on every request.
    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; HEADER_SLOTS];
    let mut parsed = httparse::Request::new(&mut []);
    match parsed.parse_with_uninit_headers(head_bytes, &mut slots) {
        // The pre-scan and httparse must agree on where the head ends: two parsers
        // disagreeing about framing is exactly how smuggling happens, so any doubt closes.
        Ok(httparse::Status::Complete(len)) if len == head_len => {}
        Ok(_) => return HeadParse::Reject(Rejection::MalformedRequestLine),
        Err(error) => return HeadParse::Reject(map_httparse_error(error, head_bytes)),
    }
    match interpret_head(&parsed, limits) {
        Ok(head) => HeadParse::Complete { head, head_len },
        Err(rejection) => HeadParse::Reject(rejection),
    }
}

/// How far the strict pre-scan of the head got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeadScan {
    /// The blank line has not arrived; what did arrive passed the checks above.
    Incomplete,
    /// The head (up to and including the blank line) is `buf[..head_len]`.
    Complete {
        head_len: usize,
    },
    Reject(Rejection),
}

/// The strict framing pre-scan of the head. It checks, on complete lines and on the
/// partial line still arriving: CRLF line endings only, no control character but HTAB, at most
/// [`LEADING_EMPTY_LINES_MAX`] leading empty lines, the request-line length (414), the
/// header-line count and the head length (431), no obs-fold, no whitespace before a
/// colon. `httparse` would refuse most of these too, but with less precise reasons and
/// only once the line is complete; and it accepts bare LF, which we do not.
fn scan_head(buf: &[u8], limits: &Limits) -> HeadScan {
    // Each step checks its lines and hands on the offset of the next line, or ends the scan.
    let request_line_start = match skip_leading_empty_lines(buf) {
        ControlFlow::Continue(at) => at,
        ControlFlow::Break(scan) => return scan,
    };
    let headers_start = match scan_request_line(buf, request_line_start, limits) {
        ControlFlow::Continue(at) => at,
        ControlFlow::Break(scan) => return scan,
    };
    scan_header_lines(buf, headers_start, limits)
}

/// Step 1 of [`scan_head`]: at most [`LEADING_EMPTY_LINES_MAX`] empty lines; continues at the
/// request line.
fn skip_leading_empty_lines(buf: &[u8]) -> ControlFlow<HeadScan, usize> {
    let mut line_start = 0;
    let mut empty_lines = 0;
    loop {
        match find_line_end(&buf[line_start..]) {
            LineEnd::Found { len: 0 } => {
                empty_lines += 1;
                if empty_lines > LEADING_EMPTY_LINES_MAX {
                    return reject(Rejection::MalformedRequestLine);
                }
                line_start += 2;
            }
            LineEnd::Invalid => return reject(Rejection::InvalidLineEnding),
            LineEnd::Partial if buf.len() - line_start <= 1 => {
                // Nothing, or a lone CR that may be the start of one more empty line.
                return ControlFlow::Break(HeadScan::Incomplete);
            }
            _ => return ControlFlow::Continue(line_start),
        }
    }
}

/// Step 2 of [`scan_head`]: the request line at `line_start`, within its limit (also while
/// it is still arriving), with room left for the blank line; continues at the first header
/// line.
fn scan_request_line(
    buf: &[u8],
    line_start: usize,
    limits: &Limits,
) -> ControlFlow<HeadScan, usize> {
    let request_line_len = match find_line_end(&buf[line_start..]) {
        LineEnd::Found { len } => len,
        LineEnd::Invalid => return reject(Rejection::InvalidLineEnding),
        LineEnd::Control { .. } => return reject(Rejection::MalformedRequestLine),
        LineEnd::Partial => {
            let partial = strip_trailing_cr(&buf[line_start..]);
            if partial.len() > limits.request_line_bytes_max {
                return reject(Rejection::RequestLineTooLong);
            }
            return ControlFlow::Break(HeadScan::Incomplete);
        }
    };
    if request_line_len > limits.request_line_bytes_max {
        return reject(Rejection::RequestLineTooLong);
    }
    if request_line_len == 0 {
        return reject(Rejection::MalformedRequestLine);
    }
    let next = line_start + request_line_len + 2;
    // The head needs at least the blank line (2 bytes) more.
    if next + 2 > limits.header_section_bytes_max {
        return reject(Rejection::HeaderSectionTooLarge);
    }
    ControlFlow::Continue(next)
}

/// Step 3 of [`scan_head`]: header lines from `line_start` up to the blank line, each checked
/// and counted, the head kept within its limit.
fn scan_header_lines(buf: &[u8], mut line_start: usize, limits: &Limits) -> HeadScan {
    let mut header_lines = 0;
    loop {
        let rest = &buf[line_start..];
        match find_line_end(rest) {
            LineEnd::Found { len: 0 } => {
                let head_len = line_start + 2;
                if head_len > limits.header_section_bytes_max {
                    return HeadScan::Reject(Rejection::HeaderSectionTooLarge);
                }
                return HeadScan::Complete { head_len };
            }
            LineEnd::Found { len } => {
                header_lines += 1;
                if let Some(rejection) = check_header_line(&rest[..len]) {
                    return HeadScan::Reject(rejection);
                }
                if header_lines > limits.headers_max {
                    return HeadScan::Reject(Rejection::TooManyHeaders);
                }
                line_start += len + 2;
                if line_start + 2 > limits.header_section_bytes_max {
                    return HeadScan::Reject(Rejection::HeaderSectionTooLarge);
                }
            }
            LineEnd::Invalid => return HeadScan::Reject(Rejection::InvalidLineEnding),
            LineEnd::Control { at } => return HeadScan::Reject(control_in_header(&rest[..at])),
            LineEnd::Partial => return partial_header_line(buf, rest, header_lines, limits),
        }
    }
}

/// Why a header line holding a control character (before `line`'s end) is refused: what its
/// text so far already breaks, else a bad value after a colon or a bad name without one.
fn control_in_header(line: &[u8]) -> Rejection {
    check_header_line(line).unwrap_or(if line.contains(&b':') {
        Rejection::InvalidHeaderValue
    } else {
        Rejection::InvalidHeaderName
    })
}

/// The header line still arriving (`rest`, after `header_lines` complete ones): refused as
/// soon as its text or the count breaks a rule, or the head cannot fit any more.
fn partial_header_line(buf: &[u8], rest: &[u8], header_lines: usize, limits: &Limits) -> HeadScan {
    let partial = strip_trailing_cr(rest);
    if !partial.is_empty() {
        if let Some(rejection) = check_header_line(partial) {
            return HeadScan::Reject(rejection);
        }
        if header_lines + 1 > limits.headers_max {
            return HeadScan::Reject(Rejection::TooManyHeaders);
        }
    }
    // The head is at least everything received plus the missing line end.
    if buf.len() >= limits.header_section_bytes_max {
        return HeadScan::Reject(Rejection::HeaderSectionTooLarge);
    }
    HeadScan::Incomplete
}

/// A step of [`scan_head`] that ends the scan with `rejection`.
fn reject<T>(rejection: Rejection) -> ControlFlow<HeadScan, T> {
    ControlFlow::Break(HeadScan::Reject(rejection))
}

fn strip_trailing_cr(bytes: &[u8]) -> &[u8] {
    match bytes.split_last() {
        Some((b'\r', rest)) => rest,
        _ => bytes,
    }
}

/// Checks a complete header line, or the prefix of one, for the two framing sins that a
/// lenient intermediary might read differently: obs-fold (a line starting with SP/HTAB,
/// which some parsers join to the previous value) and whitespace before the colon (which
/// some parsers strip, making `Content-Length :` a Content-Length for them but not for us).
fn check_header_line(line: &[u8]) -> Option<Rejection> {
    match line.first() {
        Some(b' ' | b'\t') => return Some(Rejection::ObsFold),
        None => return None,
        Some(_) => {}
    }
    match line.iter().find(|&&b| b == b':' || b == b' ' || b == b'\t') {
        Some(b' ' | b'\t') => Some(Rejection::WhitespaceBeforeColon),
        _ => None,
    }
}

/// Runs `httparse` over an incomplete head, so that garbage (a TLS hello on the plain
/// port, a bad method or header name, a NUL in a value) is refused at once rather than
/// after 8 KiB or at the header-read deadline. `httparse` answers `Partial` for every
/// valid prefix; its errors on a prefix are final, except that a version is only judged
/// (400 or 505) once its line is complete, so both answers are the same on any split.
fn syntax_check_prefix(prefix: &[u8]) -> Option<Rejection> {
    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; HEADER_SLOTS];
    let mut parsed = httparse::Request::new(&mut []);
    match parsed.parse_with_uninit_headers(prefix, &mut slots) {
        Ok(_) => None,
        Err(httparse::Error::Version)
            if request_line(prefix).is_none() && may_become_a_version(prefix) =>
        {
            None
        }
        Err(error) => Some(map_httparse_error(error, prefix)),
    }
}

fn map_httparse_error(error: httparse::Error, head: &[u8]) -> Rejection {
    match error {
        httparse::Error::HeaderName => Rejection::InvalidHeaderName,
        httparse::Error::HeaderValue => Rejection::InvalidHeaderValue,
        // Line endings were checked by the pre-scan; httparse reports NewLine when
        // something else sits where the request line should end (`HTTP/1.1 x`).
        httparse::Error::NewLine => Rejection::MalformedRequestLine,
        httparse::Error::TooManyHeaders => Rejection::TooManyHeaders,
        httparse::Error::Version if request_line(head).is_some_and(is_other_http_version) => {
            Rejection::HttpVersionNotSupported
        }
        httparse::Error::Version | httparse::Error::Token | httparse::Error::Status => {
            Rejection::MalformedRequestLine
        }
    }
}

/// The request line of (a prefix of) a head that passed [`scan_head`], leading CRLFs
/// skipped; `None` while the line is incomplete.
fn request_line(head: &[u8]) -> Option<&[u8]> {
    let rest = skip_empty_lines(head);
    match find_line_end(rest) {
        LineEnd::Found { len } => Some(&rest[..len]),
        LineEnd::Partial | LineEnd::Invalid | LineEnd::Control { .. } => None,
    }
}

/// Whether an incomplete request line's version could still grow into `HTTP/d.d`.
fn may_become_a_version(prefix: &[u8]) -> bool {
    match version_part(skip_empty_lines(prefix)) {
        Some(version) => {
            version.len() <= 8
                && version.iter().zip(b"HTTP/0.0").all(|(&b, &pattern)| {
                    if pattern == b'0' {
                        b.is_ascii_digit()
                    } else {
                        b == pattern
                    }
                })
        }
        None => true,
    }
}

/// What follows the second SP of a request line: the version, if the line is well formed.
fn version_part(request_line: &[u8]) -> Option<&[u8]> {
    request_line.splitn(3, |&b| b == b' ').nth(2)
}

fn skip_empty_lines(head: &[u8]) -> &[u8] {
    let mut rest = head;
    while let Some(after) = rest.strip_prefix(b"\r\n") {
        rest = after;
    }
    rest
}

/// `METHOD SP target SP HTTP/d.d` where `d.d` is a well-formed version we do not speak:
/// 505, not 400. Anything else malformed in the version position stays 400.
fn is_other_http_version(request_line: &[u8]) -> bool {
    let Some(version) = version_part(request_line) else {
        return false;
    };
    matches!(version, [b'H', b'T', b'T', b'P', b'/', major, b'.', minor]
        if major.is_ascii_digit() && minor.is_ascii_digit())
        && version != b"HTTP/1.0"
        && version != b"HTTP/1.1"
}

/// How the body is delimited (RFC 9112 section 6.3, the subset we allow).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// Content-Length, or 0 when there is neither Content-Length nor Transfer-Encoding.
    Length(usize),
    Chunked,
}

/// The head, validated and reduced to what the edge needs.
struct Head<'b> {
    method: Method,
    method_token: &'b str,
    version: Version,
    path: &'b str,
    query: Option<&'b str>,
    host: Option<&'b str>,
    authorization: Option<&'b str>,
    x_request_id: Option<&'b str>,
    traceparent: Option<&'b str>,
    content_type: Option<&'b str>,
    keep_alive: bool,
    framing: Framing,
    /// `Expect: 100-continue` on an HTTP/1.1 request (RFC 9110 section 10.1.1: an HTTP/1.0
    /// request's expectation is ignored).
    expect_continue: bool,
}

impl<'b> Head<'b> {
    fn into_request(self, body: Body<'b>) -> Request<'b> {
        Request {
            method: self.method,
            method_token: self.method_token,
            version: self.version,
            path: self.path,
            query: self.query,
            host: self.host,
            authorization: self.authorization,
            x_request_id: self.x_request_id,
            traceparent: self.traceparent,
            content_type: self.content_type,
            keep_alive: self.keep_alive,
            body,
        }
    }
}

/// The header fields as they were found, before the cross-field rules are applied.
#[derive(Default)]
struct Fields<'b> {
    host: Option<&'b str>,
    authorization: Option<&'b str>,
    x_request_id: Option<&'b str>,
    traceparent: Option<&'b str>,
    content_type: Option<&'b str>,
    content_length: Option<u64>,
    transfer_encoding_chunked: bool,
    connection_close: bool,
    connection_keep_alive: bool,
    /// A `traceparent` line was seen (valid or not): a second one is still a duplicate.
    traceparent_seen: bool,
    expect_continue: bool,
}

fn interpret_head<'b>(
    parsed: &httparse::Request<'_, 'b>,
    limits: &Limits,
) -> Result<Head<'b>, Rejection> {
    // A complete parse always sets these three; a missing one is still not a panic.
    let (Some(method_token), Some(target), Some(minor)) =
        (parsed.method, parsed.path, parsed.version)
    else {
        return Err(Rejection::MalformedRequestLine);
    };
    let version = match minor {
        0 => Version::Http10,
        1 => Version::Http11,
        _ => return Err(Rejection::HttpVersionNotSupported),
    };
    let method = match method_token {
        "GET" => Method::Get,
        "POST" => Method::Post,
        "HEAD" => Method::Head,
        _ => Method::Other,
    };
    let (path, query) = split_target(target)?;
    let fields = collect_fields(parsed.headers)?;
    let framing = decide_framing(&fields, version, limits)?;
    if version == Version::Http11 && fields.host.is_none() {
        return Err(Rejection::MissingHost);
    }
    let keep_alive = match version {
        Version::Http11 => !fields.connection_close,
        Version::Http10 => fields.connection_keep_alive && !fields.connection_close,
    };
    Ok(Head {
        method,
        method_token,
        version,
        path,
        query,
        host: fields.host,
        authorization: fields.authorization,
        x_request_id: fields.x_request_id,
        traceparent: fields.traceparent,
        content_type: fields.content_type,
        keep_alive,
        framing,
        expect_continue: fields.expect_continue && version == Version::Http11,
    })
}

/// Origin-form only (`/path?query`). `httparse` has already refused spaces, controls and
/// invalid UTF-8 in the target.
fn split_target(target: &str) -> Result<(&str, Option<&str>), Rejection> {
    if !target.starts_with('/') {
        return Err(Rejection::RequestTargetFormNotSupported);
    }
    if target.contains('#') {
        return Err(Rejection::InvalidRequestTarget);
    }
    Ok(match target.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (target, None),
    })
}

fn collect_fields<'b>(headers: &[httparse::Header<'b>]) -> Result<Fields<'b>, Rejection> {
    let mut fields = Fields::default();
    for header in headers {
        let value = header.value;
        // The pre-scan refused every control character but HTAB in the head (and
        // httparse does too): a NUL or CR echoed into a log or a response header is how
        // injection starts, so the guarantee is asserted in tests and fuzzing.
        debug_assert!(!value.iter().any(|&b| (b < 0x20 && b != b'\t') || b == 0x7f));
        let name = header.name;
        // Dispatch on the length first: most headers are rejected by one comparison.
        match name.len() {
            4 if name.eq_ignore_ascii_case("host") => {
                let host = set_once(&mut fields.host, value, Rejection::DuplicateHost)?;
                if !host.bytes().all(is_host_byte) {
                    return Err(Rejection::InvalidHost);
                }
            }
            10 if name.eq_ignore_ascii_case("connection") => {
                for token in value.split(|&b| b == b',') {
                    let token = token.trim_ascii();
                    fields.connection_close |= token.eq_ignore_ascii_case(b"close");
                    fields.connection_keep_alive |= token.eq_ignore_ascii_case(b"keep-alive");
                }
            }
            6 if name.eq_ignore_ascii_case("expect") => {
                // Other expectations are ignored (RFC 9110 permits a 417, does not require it).
                fields.expect_continue |= value.eq_ignore_ascii_case(b"100-continue");
            }
            11 if name.eq_ignore_ascii_case("traceparent") => {
                if fields.traceparent_seen {
                    return Err(Rejection::DuplicateHeader);
                }
                fields.traceparent_seen = true;
                let mut traceparent = None;
                let value = set_once(&mut traceparent, value, Rejection::DuplicateHeader)?;
                // An invalid one is treated as absent: never echoed, never put in a message.
                fields.traceparent = Some(value).filter(|v| is_valid_traceparent(v));
            }
            12 if name.eq_ignore_ascii_case("x-request-id") => {
                set_once(&mut fields.x_request_id, value, Rejection::DuplicateHeader)?;
            }
            12 if name.eq_ignore_ascii_case("content-type") => {
                set_once(&mut fields.content_type, value, Rejection::DuplicateHeader)?;
            }
            13 if name.eq_ignore_ascii_case("authorization") => {
                set_once(&mut fields.authorization, value, Rejection::DuplicateHeader)?;
            }
            14 if name.eq_ignore_ascii_case("content-length") => {
                if fields.content_length.is_some() {
                    return Err(Rejection::DuplicateContentLength);
                }
                fields.content_length = Some(parse_content_length(value)?);
            }
            17 if name.eq_ignore_ascii_case("transfer-encoding") => {
                // A second Transfer-Encoding line would be joined to the first
                // ("chunked, chunked"): refused like any other list.
                if fields.transfer_encoding_chunked || !value.eq_ignore_ascii_case(b"chunked") {
                    return Err(Rejection::InvalidTransferEncoding);
                }
                fields.transfer_encoding_chunked = true;
            }
            _ => {}
        }
    }
    Ok(fields)
}

/// Length of a version-00 `traceparent`: `00-` 32 hex `-` 16 hex `-` 2 hex.
pub const TRACEPARENT_V00_BYTES: usize = 55;

/// W3C Trace Context `traceparent` (section 3.2): `version-traceid-parentid-flags`, lowercase
/// hex only; version `ff` is invalid; trace-id (32 hex) and parent-id (16 hex) not all
/// zeros; version `00` exactly [`TRACEPARENT_V00_BYTES`] bytes. A later version is read by
/// the same first 55 bytes and, if longer, continues with `-` (the spec's rule for versions
/// this code does not know).
pub fn is_valid_traceparent(value: &str) -> bool {
    let bytes = value.as_bytes();
    let hex = |range: std::ops::Range<usize>| {
        bytes
            .get(range)
            .is_some_and(|part| part.iter().all(|&b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
    };
    let not_zeros = |range: std::ops::Range<usize>| bytes[range].iter().any(|&b| b != b'0');
    let version_ok = match bytes.get(..2) {
        Some(b"00") => bytes.len() == TRACEPARENT_V00_BYTES,
        Some(b"ff") => false,
        Some(_) => {
            bytes.len() == TRACEPARENT_V00_BYTES
                || (bytes.len() > TRACEPARENT_V00_BYTES && bytes[TRACEPARENT_V00_BYTES] == b'-')
        }
        None => false,
    };
    version_ok
        && hex(0..2)
        && bytes[2] == b'-'
        && hex(3..35)
        && bytes[35] == b'-'
        && hex(36..52)
        && bytes[52] == b'-'
        && hex(53..55)
        && not_zeros(3..35)
        && not_zeros(36..52)
}

/// Stores a header the edge reads, refusing a second occurrence and non-ASCII bytes.
fn set_once<'b>(
    slot: &mut Option<&'b str>,
    value: &'b [u8],
    duplicate: Rejection,
) -> Result<&'b str, Rejection> {
    if slot.is_some() {
        return Err(duplicate);
    }
    if !value.is_ascii() {
        return Err(Rejection::InvalidHeaderValue);
    }
    let text = std::str::from_utf8(value).map_err(|_| Rejection::InvalidHeaderValue)?;
    *slot = Some(text);
    Ok(text)
}

/// `uri-host [ ":" port ]` characters (RFC 3986: unreserved, pct-encoded, sub-delims,
/// IP-literal brackets, the port colon). Empty is allowed (RFC 9112 section 3.2).
fn is_host_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~%!$&'()*+,;=:[]".contains(&b)
}

/// `1*DIGIT`, nothing else: no sign, no inner whitespace (httparse trims the outer),
/// no list (`5, 5`), at most [`CONTENT_LENGTH_DIGITS_MAX`] digits, no overflow.
fn parse_content_length(value: &[u8]) -> Result<u64, Rejection> {
    if value.is_empty() || value.len() > CONTENT_LENGTH_DIGITS_MAX {
        return Err(Rejection::InvalidContentLength);
    }
    let mut length: u64 = 0;
    for &b in value {
        if !b.is_ascii_digit() {
            return Err(Rejection::InvalidContentLength);
        }
        length = length
            .checked_mul(10)
            .and_then(|l| l.checked_add(u64::from(b - b'0')))
            .ok_or(Rejection::InvalidContentLength)?;
    }
    Ok(length)
}

/// One framing per request (RFC 9112 section 6.3, made strict): Content-Length and
/// Transfer-Encoding together are refused rather than resolved in favour of one.
fn decide_framing(
    fields: &Fields<'_>,
    version: Version,
    limits: &Limits,
) -> Result<Framing, Rejection> {
    match (fields.content_length, fields.transfer_encoding_chunked) {
        (Some(_), true) => Err(Rejection::ContentLengthWithTransferEncoding),
        (None, true) if version == Version::Http10 => Err(Rejection::TransferEncodingInHttp10),
        (None, true) => Ok(Framing::Chunked),
        (Some(length), false) => match usize::try_from(length) {
            Ok(length) if length <= limits.body_bytes_max => Ok(Framing::Length(length)),
            _ => Err(Rejection::BodyTooLarge),
        },
        (None, false) => Ok(Framing::Length(0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits::DEFAULT;

    fn parse(buf: &[u8]) -> Parsed<'_> {
        parse_request(buf, &LIMITS)
    }

    #[track_caller]
    fn rejected(buf: &[u8]) -> Rejection {
        match parse(buf) {
            Parsed::Reject(rejection) => rejection,
            other => {
                panic!("expected a rejection for {:?}, got {other:?}", String::from_utf8_lossy(buf))
            }
        }
    }

    #[track_caller]
    fn complete(buf: &[u8]) -> (Request<'_>, usize) {
        match parse(buf) {
            Parsed::Complete { request, consumed } => (request, consumed),
            other => {
                panic!("expected a request from {:?}, got {other:?}", String::from_utf8_lossy(buf))
            }
        }
    }

    /// `GET /` with `Host` and the given extra header lines (each with its CRLF).
    fn get_with(headers: &str) -> Vec<u8> {
        format!("GET / HTTP/1.1\r\nHost: example\r\n{headers}\r\n").into_bytes()
    }

    const RESERVATION: &[u8] = b"POST /v1/reservations HTTP/1.1\r\n\
        Host: edge.example\r\n\
        Authorization: Bearer v1.k1.30001.10001.1893456000.c2lnbmF0dXJl\r\n\
        Content-Type: application/json\r\n\
        X-Request-Id: rid-42\r\n\
        traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n\
        Content-Length: 72\r\n\
        \r\n\
        {\"activity_id\":10001,\"sku_id\":20001,\"request_id\":\"req_01J\",\"quantity\":1}";

    #[test]
    fn realistic_reservation_request() {
        let (request, consumed) = complete(RESERVATION);
        assert_eq!(consumed, RESERVATION.len());
        assert_eq!(request.method, Method::Post);
        assert_eq!(request.method_token, "POST");
        assert_eq!(request.version, Version::Http11);
        assert_eq!(request.path, "/v1/reservations");
        assert_eq!(request.query, None);
        assert_eq!(request.host, Some("edge.example"));
        assert_eq!(request.authorization, Some("Bearer v1.k1.30001.10001.1893456000.c2lnbmF0dXJl"));
        assert_eq!(request.content_type, Some("application/json"));
        assert_eq!(request.x_request_id, Some("rid-42"));
        assert_eq!(
            request.traceparent,
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        );
        assert!(request.keep_alive);
        assert_eq!(
            request.body,
            Body::Fixed(
                br#"{"activity_id":10001,"sku_id":20001,"request_id":"req_01J","quantity":1}"#
            )
        );
    }

    #[test]
    fn path_and_query_are_split_at_the_first_question_mark() {
        let buf =
            b"GET /v1/reservations/req_1?activity_id=1&sku_id=2?x HTTP/1.1\r\nHost: h\r\n\r\n";
        let (request, _) = complete(buf);
        assert_eq!(request.path, "/v1/reservations/req_1");
        assert_eq!(request.query, Some("activity_id=1&sku_id=2?x"));
        assert_eq!(request.body, Body::Fixed(b""));
        let (request, _) = complete(b"GET /a? HTTP/1.1\r\nHost: h\r\n\r\n");
        assert_eq!((request.path, request.query), ("/a", Some("")));
    }

    #[test]
    fn methods() {
        for (token, method) in [
            ("GET", Method::Get),
            ("POST", Method::Post),
            ("HEAD", Method::Head),
            ("PUT", Method::Other),
            ("get", Method::Other),
            ("PATCH", Method::Other),
        ] {
            let buf = format!("{token} / HTTP/1.1\r\nHost: h\r\n\r\n");
            let (request, _) = complete(buf.as_bytes());
            assert_eq!((request.method, request.method_token), (method, token));
        }
    }

    #[test]
    fn header_names_are_case_insensitive_and_values_trimmed() {
        let buf = b"POST / HTTP/1.1\r\nhOsT: h\r\ncontent-LENGTH:   3  \r\nX-REQUEST-ID:\tid \r\nX-Empty:\r\n\r\nabc";
        let (request, consumed) = complete(buf);
        assert_eq!(consumed, buf.len());
        assert_eq!(request.host, Some("h"));
        assert_eq!(request.x_request_id, Some("id"));
        assert_eq!(request.body, Body::Fixed(b"abc"));
    }

    #[test]
    fn keep_alive_rules() {
        let cases: [(&str, bool); 11] = [
            ("GET / HTTP/1.1\r\nHost: h\r\n\r\n", true),
            ("GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n", false),
            ("GET / HTTP/1.1\r\nHost: h\r\nConnection: CLOSE\r\n\r\n", false),
            ("GET / HTTP/1.1\r\nHost: h\r\nConnection: keep-alive, close\r\n\r\n", false),
            (
                "GET / HTTP/1.1\r\nHost: h\r\nConnection: upgrade\r\nConnection: close\r\n\r\n",
                false,
            ),
            ("GET / HTTP/1.1\r\nHost: h\r\nConnection: keep-alive\r\n\r\n", true),
            ("GET / HTTP/1.1\r\nHost: h\r\nConnection: closed\r\n\r\n", true),
            ("GET / HTTP/1.0\r\n\r\n", false),
            ("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", true),
            ("GET / HTTP/1.0\r\nConnection: te, keep-alive\r\n\r\n", true),
            ("GET / HTTP/1.0\r\nConnection: keep-alive, close\r\n\r\n", false),
        ];
        for (buf, keep_alive) in cases {
            assert_eq!(complete(buf.as_bytes()).0.keep_alive, keep_alive, "{buf:?}");
        }
    }

    #[test]
    fn http10_needs_no_host() {
        let (request, _) = complete(b"GET / HTTP/1.0\r\n\r\n");
        assert_eq!((request.version, request.host), (Version::Http10, None));
    }

    #[test]
    fn pipelined_requests_parse_back_to_back() {
        let first = b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n".as_slice();
        let second = b"POST /b HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\nhi".as_slice();
        let third = b"POST /c HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nyo\r\n0\r\n\r\n".as_slice();
        let fourth = b"GET /d HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n".as_slice();
        let buf = [first, second, third, fourth, b"GET /e HT"].concat();
        let mut offset = 0;
        let mut paths = Vec::new();
        let mut scratch = Vec::with_capacity(LIMITS.body_bytes_max);
        for expected_len in [first.len(), second.len(), third.len(), fourth.len()] {
            let (request, consumed) = complete(&buf[offset..]);
            assert_eq!(consumed, expected_len);
            paths.push((
                request.path.to_owned(),
                request.body.bytes(&mut scratch).to_vec(),
                request.keep_alive,
            ));
            offset += consumed;
        }
        assert_eq!(parse(&buf[offset..]), Parsed::Incomplete);
        assert_eq!(
            paths,
            [
                ("/a".to_owned(), b"".to_vec(), true),
                ("/b".to_owned(), b"hi".to_vec(), true),
                ("/c".to_owned(), b"yo".to_vec(), true),
                ("/d".to_owned(), b"".to_vec(), false),
            ]
        );
    }

    #[test]
    fn every_split_of_a_valid_request_is_incomplete_until_the_last_byte() {
        let chunked =
            b"\r\nPOST /x?y=1 HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3;e=1\r\nabc\r\n1\r\nd\r\n0\r\n\r\n";
        let http10 = b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n";
        for valid in [RESERVATION, chunked.as_slice(), http10.as_slice()] {
            let whole = parse(valid);
            assert!(matches!(whole, Parsed::Complete { consumed, .. } if consumed == valid.len()));
            for end in 0..valid.len() {
                assert_eq!(parse(&valid[..end]), Parsed::Incomplete, "prefix of {end} bytes");
            }
            // The same request again with anything after it.
            let mut longer = valid.to_vec();
            longer.extend_from_slice(b"\x00garbage\n\r");
            assert_eq!(parse(&longer), whole);
        }
    }

    #[test]
    fn chunked_body_decodes_into_reused_scratch() {
        let buf = b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: Chunked\r\n\r\n4\r\nWiki\r\n5;x\r\npedia\r\n0\r\n\r\n";
        let (request, consumed) = complete(buf);
        assert_eq!(consumed, buf.len());
        assert_eq!(request.body.len(), 9);
        let mut scratch = Vec::with_capacity(LIMITS.body_bytes_max);
        let before = scratch.as_ptr();
        scratch.extend_from_slice(b"old contents are cleared");
        assert_eq!(request.body.bytes(&mut scratch), b"Wikipedia");
        assert_eq!(scratch.as_ptr(), before, "decoding within capacity must not reallocate");
    }

    #[test]
    fn chunked_body_may_be_empty_and_may_use_its_full_budget() {
        let (request, _) =
            complete(b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n");
        assert!(request.body.is_empty());
        let mut buf = b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        for _ in 0..4 {
            buf.extend_from_slice(b"400\r\n");
            buf.extend_from_slice(&[b'z'; 1024]);
            buf.extend_from_slice(b"\r\n");
        }
        buf.extend_from_slice(b"0\r\n\r\n");
        let (request, consumed) = complete(&buf);
        assert_eq!((request.body.len(), consumed), (4096, buf.len()));
        let mut scratch = Vec::new();
        assert_eq!(request.body.bytes(&mut scratch), [b'z'; 4096]);
    }

    #[test]
    fn bodies_at_the_limit_are_accepted_one_more_byte_is_413() {
        let body = [b'b'; 4096];
        let mut buf = b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 4096\r\n\r\n".to_vec();
        buf.extend_from_slice(&body);
        assert_eq!(complete(&buf).0.body, Body::Fixed(&body));
        // 413 from the header alone, before any body byte arrives.
        assert_eq!(
            rejected(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 4097\r\n\r\n"),
            Rejection::BodyTooLarge
        );
        assert_eq!(
            rejected(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 9999999999999999999\r\n\r\n"),
            Rejection::BodyTooLarge
        );
        let mut chunked =
            b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n800\r\n".to_vec();
        chunked.extend_from_slice(&[b'c'; 2048]);
        chunked.extend_from_slice(b"\r\n801\r\n");
        assert_eq!(rejected(&chunked), Rejection::BodyTooLarge);
    }

    #[test]
    fn content_length_body_waits_for_its_last_byte() {
        let buf = b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\n012345678";
        assert_eq!(parse(buf), Parsed::Incomplete);
        let mut full = buf.to_vec();
        full.push(b'9');
        assert_eq!(complete(&full).0.body, Body::Fixed(b"0123456789"));
    }

    #[test]
    fn leading_empty_lines() {
        let (_, consumed) = complete(b"\r\n\r\nGET / HTTP/1.1\r\nHost: h\r\n\r\n");
        assert_eq!(consumed, 31);
        assert_eq!(
            rejected(b"\r\n\r\n\r\nGET / HTTP/1.1\r\nHost: h\r\n\r\n"),
            Rejection::MalformedRequestLine
        );
        assert_eq!(rejected(b"\nGET / HTTP/1.1\r\nHost: h\r\n\r\n"), Rejection::InvalidLineEnding);
        assert_eq!(parse(b"\r\n\r"), Parsed::Incomplete);
    }

    #[test]
    fn bare_lf_and_bare_cr_are_refused() {
        for buf in [
            &b"GET / HTTP/1.1\nHost: h\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nHost: h\n\r\n",
            b"GET / HTTP/1.1\r\nHost: h\r\n\n",
            b"GET / HTTP/1.1\r\nHost: h\r\nX: a\nContent-Length: 5\r\n\r\nhello",
            b"GET / HTTP/1.1\r\nHost: h\rX: y\r\n\r\n",
            b"GET / HTTP/1.1\r\nX: a\rb",
            b"GET / HTTP/1.1\rHost: h\r\n\r\n",
        ] {
            assert_eq!(
                rejected(buf),
                Rejection::InvalidLineEnding,
                "{:?}",
                String::from_utf8_lossy(buf)
            );
        }
    }

    #[test]
    fn malformed_request_lines() {
        for buf in [
            &b"GET  / HTTP/1.1\r\nHost: h\r\n\r\n"[..],
            b"GET /  HTTP/1.1\r\nHost: h\r\n\r\n",
            b"GET / HTTP/1.1 \r\nHost: h\r\n\r\n",
            b"GET /\r\nHost: h\r\n\r\n",
            b"G(T / HTTP/1.1\r\nHost: h\r\n\r\n",
            b" GET / HTTP/1.1\r\nHost: h\r\n\r\n",
            b"GET / http/1.1\r\nHost: h\r\n\r\n",
            b"GET / HTTP/1.10\r\nHost: h\r\n\r\n",
            b"GET / HTTP/1\r\nHost: h\r\n\r\n",
        ] {
            assert_eq!(
                rejected(buf),
                Rejection::MalformedRequestLine,
                "{:?}",
                String::from_utf8_lossy(buf)
            );
        }
        // Garbage is refused at once, without waiting for the line or the head to end.
        assert_eq!(rejected(b"\x16\x03\x01\x02\x00\x01"), Rejection::MalformedRequestLine);
        assert_eq!(rejected(b"GET / HTTX"), Rejection::MalformedRequestLine);
        assert_eq!(
            rejected(b"GET / HTTP/1.1\r\nHost: h\r\nX: \x00"),
            Rejection::InvalidHeaderValue
        );
        assert_eq!(rejected(b"GET / HTTP/1.1\r\nHost: h\r\nX(: "), Rejection::InvalidHeaderName);
        // A version is judged once its line is complete: 505 on every split.
        assert_eq!(parse(b"GET / HTTP/2.0"), Parsed::Incomplete);
        assert_eq!(parse(b"GET / HTTP/2"), Parsed::Incomplete);
        // Found by the fuzzer: a space later on the line does not start a new version.
        assert_eq!(rejected(b"\r\nGET / HTTP/0.1sss"), Rejection::MalformedRequestLine);
        assert_eq!(rejected(b"\r\nGET / HTTP/0.1sss-Type: "), Rejection::MalformedRequestLine);
        assert_eq!(rejected(b"GET / HTTP/1.1 x"), Rejection::MalformedRequestLine);
    }

    #[test]
    fn request_targets() {
        assert_eq!(
            rejected(b"GET /a#frag HTTP/1.1\r\nHost: h\r\n\r\n"),
            Rejection::InvalidRequestTarget
        );
        for buf in [
            &b"GET http://h/a HTTP/1.1\r\nHost: h\r\n\r\n"[..],
            b"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n",
            b"CONNECT h:443 HTTP/1.1\r\nHost: h:443\r\n\r\n",
        ] {
            let rejection = rejected(buf);
            assert_eq!(
                (rejection, rejection.status()),
                (Rejection::RequestTargetFormNotSupported, 501)
            );
        }
        assert_eq!(
            rejected(b"GET /\x7f HTTP/1.1\r\nHost: h\r\n\r\n"),
            Rejection::MalformedRequestLine
        );
    }

    #[test]
    fn other_http_versions_are_505() {
        for version in ["HTTP/2.0", "HTTP/1.2", "HTTP/0.9", "HTTP/3.0"] {
            let buf = format!("GET / {version}\r\nHost: h\r\n\r\n");
            let rejection = rejected(buf.as_bytes());
            assert_eq!(
                (rejection, rejection.status()),
                (Rejection::HttpVersionNotSupported, 505),
                "{version}"
            );
            // Known as soon as the request line is complete.
            assert_eq!(
                rejected(format!("GET / {version}\r\n").as_bytes()),
                Rejection::HttpVersionNotSupported
            );
        }
    }

    #[test]
    fn request_line_limit_is_414_even_before_the_line_ends() {
        let line_of = |len: usize| {
            let fixed = "GET / HTTP/1.1".len();
            format!("GET /{} HTTP/1.1", "a".repeat(len - fixed))
        };
        let at_limit = format!("{}\r\nHost: h\r\n\r\n", line_of(8192));
        assert_eq!(complete(at_limit.as_bytes()).1, at_limit.len());
        let over = format!("{}\r\nHost: h\r\n\r\n", line_of(8193));
        let rejection = rejected(over.as_bytes());
        assert_eq!((rejection, rejection.status()), (Rejection::RequestLineTooLong, 414));
        // Without its end: 8192 bytes (plus a CR) may still end well, 8193 cannot.
        let partial = format!("GET /{}", "a".repeat(8192 - 5));
        assert_eq!(parse(partial.as_bytes()), Parsed::Incomplete);
        assert_eq!(rejected(format!("{partial}a").as_bytes()), Rejection::RequestLineTooLong);
        let line = line_of(8192);
        assert_eq!(parse(line.as_bytes()), Parsed::Incomplete);
        assert_eq!(parse(format!("{line}\r").as_bytes()), Parsed::Incomplete);
        assert_eq!(rejected(format!("{line}1").as_bytes()), Rejection::RequestLineTooLong);
    }

    #[test]
    fn header_count_limit_is_431() {
        let lines = |count: usize| (1..count).map(|i| format!("X-H{i}: v\r\n")).collect::<String>();
        // 64 header lines: Host and 63 others.
        let at_limit = get_with(&lines(64));
        assert_eq!(complete(&at_limit).1, at_limit.len());
        let over = get_with(&lines(65));
        let rejection = rejected(&over);
        assert_eq!((rejection, rejection.status()), (Rejection::TooManyHeaders, 431));
        // The 65th line is refused as soon as it starts.
        let mut partial = format!("GET / HTTP/1.1\r\nHost: example\r\n{}", lines(64)).into_bytes();
        assert_eq!(parse(&partial), Parsed::Incomplete);
        partial.push(b'X');
        assert_eq!(rejected(&partial), Rejection::TooManyHeaders);
    }

    #[test]
    fn header_section_limit_is_431_as_soon_as_it_is_exceeded() {
        // Big values so that the byte limit, not the count, is what trips.
        let prefix = b"GET / HTTP/1.1\r\nHost: h\r\n".to_vec();
        let mut head = prefix.clone();
        while head.len() < 20 * 1024 {
            head.extend_from_slice(b"X-Pad: ");
            head.extend_from_slice(&[b'p'; 1000]);
            head.extend_from_slice(b"\r\n");
        }
        assert_eq!(parse(&head[..16383]), Parsed::Incomplete);
        let rejection = rejected(&head[..16384]);
        assert_eq!((rejection, rejection.status()), (Rejection::HeaderSectionTooLarge, 431));
        assert_eq!(rejected(&head), Rejection::HeaderSectionTooLarge);

        // A complete head of exactly 16384 bytes is accepted, 16385 is not.
        let exact = |total: usize| {
            let mut head = prefix.clone();
            let pad = total - head.len() - "X-Pad: \r\n\r\n".len();
            head.extend_from_slice(b"X-Pad: ");
            head.extend_from_slice(&vec![b'p'; pad]);
            head.extend_from_slice(b"\r\n\r\n");
            assert_eq!(head.len(), total);
            head
        };
        assert_eq!(complete(&exact(16384)).1, 16384);
        assert_eq!(rejected(&exact(16385)), Rejection::HeaderSectionTooLarge);
    }

    #[test]
    fn a_huge_buffer_is_judged_on_its_first_bytes() {
        let mut huge = b"GET /".to_vec();
        huge.resize(1 << 20, b'a');
        assert_eq!(rejected(&huge), Rejection::RequestLineTooLong);
        let mut huge = b"GET / HTTP/1.1\r\nX: ".to_vec();
        huge.resize(1 << 20, b'a');
        assert_eq!(rejected(&huge), Rejection::HeaderSectionTooLarge);
    }

    #[test]
    fn obs_fold_is_refused() {
        assert_eq!(rejected(&get_with("X-A: a\r\n  folded\r\n")), Rejection::ObsFold);
        assert_eq!(rejected(&get_with("X-A: a\r\n\tfolded\r\n")), Rejection::ObsFold);
        assert_eq!(rejected(b"GET / HTTP/1.1\r\nHost: h\r\n "), Rejection::ObsFold);
        assert_eq!(rejected(b"GET / HTTP/1.1\r\n Host: h\r\n\r\n"), Rejection::ObsFold);
    }

    #[test]
    fn whitespace_before_colon_is_refused() {
        assert_eq!(
            rejected(b"GET / HTTP/1.1\r\nHost : h\r\n\r\n"),
            Rejection::WhitespaceBeforeColon
        );
        assert_eq!(
            rejected(&get_with("Content-Length\t: 0\r\n")),
            Rejection::WhitespaceBeforeColon
        );
        assert_eq!(rejected(b"GET / HTTP/1.1\r\nHost "), Rejection::WhitespaceBeforeColon);
    }

    #[test]
    fn invalid_header_names_and_values() {
        assert_eq!(rejected(&get_with("X(A): 1\r\n")), Rejection::InvalidHeaderName);
        assert_eq!(rejected(&get_with("NoColon\r\n")), Rejection::InvalidHeaderName);
        assert_eq!(rejected(&get_with(": empty-name\r\n")), Rejection::InvalidHeaderName);
        for value in ["a\u{0}b", "a\u{1}", "\u{7f}", "a\u{1b}[31m"] {
            assert_eq!(
                rejected(&get_with(&format!("X-A: {value}\r\n"))),
                Rejection::InvalidHeaderValue,
                "{value:?}"
            );
        }
        // obs-text is tolerated in headers we ignore, not in those we read.
        assert!(matches!(parse(&get_with("X-A: caf\u{e9}\r\n")), Parsed::Complete { .. }));
        assert_eq!(
            rejected(&get_with("Authorization: caf\u{e9}\r\n")),
            Rejection::InvalidHeaderValue
        );
    }

    #[test]
    fn host_rules() {
        assert_eq!(rejected(b"GET / HTTP/1.1\r\nX-A: b\r\n\r\n"), Rejection::MissingHost);
        assert_eq!(rejected(&get_with("Host: other\r\n")), Rejection::DuplicateHost);
        assert_eq!(rejected(&get_with("host: example\r\n")), Rejection::DuplicateHost);
        assert_eq!(
            rejected(b"GET / HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n"),
            Rejection::DuplicateHost
        );
        for host in ["a b", "a/b", "a@b", "a\"b"] {
            assert_eq!(
                rejected(format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes()),
                Rejection::InvalidHost
            );
        }
        for host in ["", "example.com:8080", "[::1]:80", "127.0.0.1", "xn--bcher-kva.example"] {
            let buf = format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
            assert_eq!(complete(buf.as_bytes()).0.host, Some(host));
        }
    }

    #[test]
    fn headers_the_edge_reads_may_not_repeat() {
        for name in ["Authorization", "X-Request-Id", "traceparent", "Content-Type"] {
            let buf = get_with(&format!("{name}: a\r\n{}: b\r\n", name.to_ascii_lowercase()));
            assert_eq!(rejected(&buf), Rejection::DuplicateHeader, "{name}");
        }
    }

    #[test]
    fn content_length_with_transfer_encoding_is_refused_in_either_order() {
        for headers in [
            "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
            "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
            "Transfer-Encoding: chunked\r\nContent-Length: 0\r\n",
        ] {
            let buf = format!("POST / HTTP/1.1\r\nHost: h\r\n{headers}\r\n0\r\n\r\n");
            assert_eq!(
                rejected(buf.as_bytes()),
                Rejection::ContentLengthWithTransferEncoding,
                "{headers:?}"
            );
        }
    }

    #[test]
    fn duplicate_content_length_is_refused_even_if_equal() {
        for headers in [
            "Content-Length: 5\r\nContent-Length: 5\r\n",
            "Content-Length: 5\r\ncontent-length: 6\r\n",
        ] {
            let buf = format!("POST / HTTP/1.1\r\nHost: h\r\n{headers}\r\nhello!");
            assert_eq!(rejected(buf.as_bytes()), Rejection::DuplicateContentLength, "{headers:?}");
        }
    }

    #[test]
    fn malformed_content_length_is_refused() {
        for value in [
            "+5",
            "-5",
            "5 5",
            "0x5",
            "",
            "5,5",
            "5, 5",
            "1e3",
            "5;",
            "\u{663}",
            "18446744073709551616",
            "000000000000000000005",
        ] {
            let buf = format!("POST / HTTP/1.1\r\nHost: h\r\nContent-Length: {value}\r\n\r\nhello");
            assert_eq!(rejected(buf.as_bytes()), Rejection::InvalidContentLength, "{value:?}");
        }
        // Leading zeros within the digit bound are plain `1*DIGIT`.
        let (request, _) =
            complete(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 0005\r\n\r\nhello");
        assert_eq!(request.body, Body::Fixed(b"hello"));
    }

    #[test]
    fn only_exactly_chunked_transfer_encoding_is_accepted() {
        for value in [
            "gzip, chunked",
            "chunked, chunked",
            "identity",
            "gzip",
            "chunked;q=1",
            "chunked,",
            "x-chunked",
        ] {
            let buf = format!(
                "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: {value}\r\n\r\n0\r\n\r\n"
            );
            assert_eq!(rejected(buf.as_bytes()), Rejection::InvalidTransferEncoding, "{value:?}");
        }
        let twice = b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        assert_eq!(rejected(twice), Rejection::InvalidTransferEncoding);
        let http10 = b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        assert_eq!(rejected(http10), Rejection::TransferEncodingInHttp10);
        let (request, _) =
            complete(b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: CHUNKED \r\n\r\n0\r\n\r\n");
        assert_eq!(request.body, Body::Chunked { wire: b"0\r\n\r\n", len: 0 });
    }

    #[test]
    fn chunk_framing_errors_reach_the_request() {
        let with = |chunks: &str| {
            format!("POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n{chunks}")
        };
        assert_eq!(
            rejected(with("+3\r\nabc\r\n0\r\n\r\n").as_bytes()),
            Rejection::InvalidChunkSize
        );
        assert_eq!(
            rejected(with("3\r\nabcd\r\n0\r\n\r\n").as_bytes()),
            Rejection::InvalidChunkedEncoding
        );
        assert_eq!(
            rejected(with("0\r\nX-Trailer: 1\r\n\r\n").as_bytes()),
            Rejection::ChunkedTrailerNotAllowed
        );
        assert_eq!(rejected(with("3\nabc\r\n").as_bytes()), Rejection::InvalidLineEnding);
    }

    #[test]
    fn every_rejection_is_reachable_and_closes() {
        // One input per variant, so that a variant nobody can produce is noticed.
        let samples: [(&[u8], Rejection); 25] = [
            (b"GET / HTTP/1.1\nHost: h\r\n\r\n", Rejection::InvalidLineEnding),
            (b"GET  / HTTP/1.1\r\n\r\n", Rejection::MalformedRequestLine),
            (b"GET /# HTTP/1.1\r\nHost: h\r\n\r\n", Rejection::InvalidRequestTarget),
            (b"GET * HTTP/1.1\r\nHost: h\r\n\r\n", Rejection::RequestTargetFormNotSupported),
            (b"GET / HTTP/2.0\r\n", Rejection::HttpVersionNotSupported),
            (&[b'a'; 8193], Rejection::RequestLineTooLong),
            (&get_with(&"X: y\r\n".repeat(64)), Rejection::TooManyHeaders),
            (&get_with(&format!("X: {}\r\n", "y".repeat(16384))), Rejection::HeaderSectionTooLarge),
            (&get_with("X: y\r\n z\r\n"), Rejection::ObsFold),
            (&get_with("X : y\r\n"), Rejection::WhitespaceBeforeColon),
            (&get_with("X\u{1}: y\r\n"), Rejection::InvalidHeaderName),
            (&get_with("X: \u{0}\r\n"), Rejection::InvalidHeaderValue),
            (b"GET / HTTP/1.1\r\n\r\n", Rejection::MissingHost),
            (&get_with("Host: h\r\n"), Rejection::DuplicateHost),
            (b"GET / HTTP/1.1\r\nHost: <h>\r\n\r\n", Rejection::InvalidHost),
            (&get_with("Traceparent: a\r\nTraceparent: a\r\n"), Rejection::DuplicateHeader),
            (
                &get_with("Content-Length: 0\r\nTransfer-Encoding: chunked\r\n"),
                Rejection::ContentLengthWithTransferEncoding,
            ),
            (
                &get_with("Content-Length: 0\r\nContent-Length: 0\r\n"),
                Rejection::DuplicateContentLength,
            ),
            (&get_with("Content-Length: -0\r\n"), Rejection::InvalidContentLength),
            (&get_with("Transfer-Encoding: identity\r\n"), Rejection::InvalidTransferEncoding),
            (
                b"GET / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
                Rejection::TransferEncodingInHttp10,
            ),
            (
                &[get_with("Transfer-Encoding: chunked\r\n").as_slice(), b"x\r\n"].concat(),
                Rejection::InvalidChunkSize,
            ),
            (
                &[get_with("Transfer-Encoding: chunked\r\n").as_slice(), b"1\r\nab"].concat(),
                Rejection::InvalidChunkedEncoding,
            ),
            (
                &[get_with("Transfer-Encoding: chunked\r\n").as_slice(), b"0\r\nA: b\r\n\r\n"]
                    .concat(),
                Rejection::ChunkedTrailerNotAllowed,
            ),
            (&get_with("Content-Length: 4097\r\n"), Rejection::BodyTooLarge),
        ];
        for ((buf, expected), variant) in samples.iter().zip(Rejection::ALL) {
            assert_eq!(*expected, variant, "samples follow Rejection::ALL");
            assert_eq!(rejected(buf), variant);
            assert!(variant.close_connection());
            assert!(matches!(variant.status(), 400 | 413 | 414 | 431 | 501 | 505));
        }
    }

    #[test]
    fn smaller_limits_are_honoured() {
        // A tiny configuration that hits every bound with short inputs.
        let tiny = Limits {
            request_line_bytes_max: 20,
            headers_max: 2,
            header_section_bytes_max: 60,
            body_bytes_max: 4,
            pipeline_depth_max: 1,
        };
        assert_eq!(tiny.validate(), Ok(()));
        let parse_tiny = |buf: &[u8]| match parse_request(buf, &tiny) {
            Parsed::Complete { consumed, .. } => Ok(consumed),
            Parsed::Incomplete => Err(None),
            Parsed::Reject(rejection) => Err(Some(rejection)),
        };
        assert_eq!(
            parse_tiny(b"POST /a HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\n\r\nabcd"),
            Ok(52)
        );
        assert_eq!(
            parse_tiny(b"GET /abcdefgh HTTP/1.1\r\n"),
            Err(Some(Rejection::RequestLineTooLong))
        );
        assert_eq!(
            parse_tiny(b"GET / HTTP/1.1\r\nHost: h\r\nA: b\r\nC: d\r\n\r\n"),
            Err(Some(Rejection::TooManyHeaders))
        );
        assert_eq!(
            parse_tiny(b"GET / HTTP/1.1\r\nHost: h\r\nA: bbbbbbbbbbbbbbbbbbbbbbbbbbbbb\r\n\r\n"),
            Err(Some(Rejection::HeaderSectionTooLarge))
        );
        assert_eq!(
            parse_tiny(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\n"),
            Err(Some(Rejection::BodyTooLarge))
        );
    }

    const TRACE: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn traceparent_is_validated_per_w3c_and_an_invalid_one_is_dropped() {
        assert!(is_valid_traceparent(TRACE));
        assert!(is_valid_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"));
        // A later version: same first 55 bytes, more after a dash.
        assert!(is_valid_traceparent("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"));
        assert!(is_valid_traceparent(
            "cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-what-comes-next"
        ));
        for bad in [
            "",
            "00-<script>-INJECT\"x\\y-zz",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
            "00-0af7651916cd43dd8448eb211c80319-cb7ad6b7169203331-01",
            "00_0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "0g-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01x",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0g",
        ] {
            assert!(!is_valid_traceparent(bad), "{bad:?}");
            let (request, _) = complete_owned(&get_with(&format!("traceparent: {bad}\r\n")));
            assert_eq!(request, None, "{bad:?} must be dropped");
        }
        let (request, _) = complete_owned(&get_with(&format!("Traceparent: {TRACE}\r\n")));
        assert_eq!(request.as_deref(), Some(TRACE));
        // Dropping an invalid one does not let a second one in.
        let twice = get_with(&format!("traceparent: junk\r\ntraceparent: {TRACE}\r\n"));
        assert_eq!(rejected(&twice), Rejection::DuplicateHeader);
    }

    /// The traceparent a complete request parsed to, owned.
    fn complete_owned(buf: &[u8]) -> (Option<String>, usize) {
        let (request, consumed) = complete(buf);
        (request.traceparent.map(str::to_owned), consumed)
    }

    #[test]
    fn progress_tells_head_from_body_and_sees_expect_continue() {
        let post = |headers: &str| {
            format!("POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n{headers}\r\nhe")
        };
        let head_only = b"POST / HTTP/1.1\r\nHost: h\r\nContent-Len";
        assert_eq!(parse(head_only), Parsed::Incomplete);
        assert_eq!(progress(head_only, &LIMITS), Progress::Head);
        assert_eq!(progress(b"", &LIMITS), Progress::Head);
        let plain = post("");
        assert_eq!(parse(plain.as_bytes()), Parsed::Incomplete);
        assert_eq!(progress(plain.as_bytes(), &LIMITS), Progress::Body { expect_continue: false });
        for value in ["100-continue", "100-Continue"] {
            let expecting = post(&format!("Expect: {value}\r\n"));
            assert_eq!(
                progress(expecting.as_bytes(), &LIMITS),
                Progress::Body { expect_continue: true }
            );
        }
        let other = post("Expect: something-else\r\n");
        assert_eq!(progress(other.as_bytes(), &LIMITS), Progress::Body { expect_continue: false });
        // HTTP/1.0: the expectation is ignored (RFC 9110 section 10.1.1).
        let http10 = b"POST / HTTP/1.0\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\nhe";
        assert_eq!(progress(http10, &LIMITS), Progress::Body { expect_continue: false });
        // An over-limit Content-Length is refused by parse_request at once, Expect or not.
        let too_big =
            b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n";
        assert_eq!(rejected(too_big), Rejection::BodyTooLarge);
        // Chunked bodies have progress too.
        let chunked = b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab";
        assert_eq!(parse(chunked), Parsed::Incomplete);
        assert_eq!(progress(chunked, &LIMITS), Progress::Body { expect_continue: false });
    }
}
