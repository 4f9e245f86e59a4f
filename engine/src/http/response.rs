//! Writing responses into a caller-owned `BytesMut`: the status line and the handful of
//! headers the edge sends, then the body.
//!
//! What it does not do: choose the status or the body (the ONE outcome table in the API
//! layer does, and [`write_rejection`] for the parser's refusals), send anything, read a
//! clock (so there is no `Date` header: the connection may add one it caches per second,
//! as a `Date` is a SHOULD for us, not a MUST), or allocate: integers are formatted on
//! the stack, and `out` grows only if the caller's capacity is too small.
//!
//! Read next: [`super::json`] for the bodies, [`super::parse`] for the requests.

use bytes::BytesMut;

use super::json::{write_u64, JsonObject};
use super::parse::{Request, Version};
use super::rejection::Rejection;

/// The statuses the edge and its admin port send. A closed set, so that the reason
/// phrase is always known and a typo cannot send `HTTP/1.1 2002`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    Ok,
    Created,
    Accepted,
    NoContent,
    BadRequest,
    Unauthorized,
    Forbidden,
    NotFound,
    MethodNotAllowed,
    RequestTimeout,
    Conflict,
    PayloadTooLarge,
    UriTooLong,
    UnsupportedMediaType,
    TooManyRequests,
    RequestHeaderFieldsTooLarge,
    InternalServerError,
    NotImplemented,
    ServiceUnavailable,
    HttpVersionNotSupported,
}

impl Status {
    pub const fn code(self) -> u16 {
        match self {
            Status::Ok => 200,
            Status::Created => 201,
            Status::Accepted => 202,
            Status::NoContent => 204,
            Status::BadRequest => 400,
            Status::Unauthorized => 401,
            Status::Forbidden => 403,
            Status::NotFound => 404,
            Status::MethodNotAllowed => 405,
            Status::RequestTimeout => 408,
            Status::Conflict => 409,
            Status::PayloadTooLarge => 413,
            Status::UriTooLong => 414,
            Status::UnsupportedMediaType => 415,
            Status::TooManyRequests => 429,
            Status::RequestHeaderFieldsTooLarge => 431,
            Status::InternalServerError => 500,
            Status::NotImplemented => 501,
            Status::ServiceUnavailable => 503,
            Status::HttpVersionNotSupported => 505,
        }
    }

    pub const fn reason_phrase(self) -> &'static str {
        match self {
            Status::Ok => "OK",
            Status::Created => "Created",
            Status::Accepted => "Accepted",
            Status::NoContent => "No Content",
            Status::BadRequest => "Bad Request",
            Status::Unauthorized => "Unauthorized",
            Status::Forbidden => "Forbidden",
            Status::NotFound => "Not Found",
            Status::MethodNotAllowed => "Method Not Allowed",
            Status::RequestTimeout => "Request Timeout",
            Status::Conflict => "Conflict",
            Status::PayloadTooLarge => "Content Too Large",
            Status::UriTooLong => "URI Too Long",
            Status::UnsupportedMediaType => "Unsupported Media Type",
            Status::TooManyRequests => "Too Many Requests",
            Status::RequestHeaderFieldsTooLarge => "Request Header Fields Too Large",
            Status::InternalServerError => "Internal Server Error",
            Status::NotImplemented => "Not Implemented",
            Status::ServiceUnavailable => "Service Unavailable",
            Status::HttpVersionNotSupported => "HTTP Version Not Supported",
        }
    }

    /// The status for a code, if it is one of ours.
    pub const fn from_code(code: u16) -> Option<Status> {
        Some(match code {
            200 => Status::Ok,
            201 => Status::Created,
            202 => Status::Accepted,
            204 => Status::NoContent,
            400 => Status::BadRequest,
            401 => Status::Unauthorized,
            403 => Status::Forbidden,
            404 => Status::NotFound,
            405 => Status::MethodNotAllowed,
            408 => Status::RequestTimeout,
            409 => Status::Conflict,
            413 => Status::PayloadTooLarge,
            414 => Status::UriTooLong,
            415 => Status::UnsupportedMediaType,
            429 => Status::TooManyRequests,
            431 => Status::RequestHeaderFieldsTooLarge,
            500 => Status::InternalServerError,
            501 => Status::NotImplemented,
            503 => Status::ServiceUnavailable,
            505 => Status::HttpVersionNotSupported,
            _ => return None,
        })
    }

    /// The answer's status for a parser rejection.
    pub const fn of_rejection(rejection: Rejection) -> Status {
        match rejection.status() {
            413 => Status::PayloadTooLarge,
            414 => Status::UriTooLong,
            431 => Status::RequestHeaderFieldsTooLarge,
            501 => Status::NotImplemented,
            505 => Status::HttpVersionNotSupported,
            _ => Status::BadRequest,
        }
    }
}

/// The `content-type` of a non-empty body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentType {
    /// Every API answer.
    Json,
    /// Prometheus text exposition, for `/metrics` on the admin port.
    PrometheusText,
}

impl ContentType {
    const fn header_value(self) -> &'static [u8] {
        match self {
            ContentType::Json => b"application/json",
            ContentType::PrometheusText => b"text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// What the response says about the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connection {
    /// HTTP/1.1 persistence is the default: no header.
    KeepAlive,
    /// An HTTP/1.0 client that asked for keep-alive needs to be told it got it.
    KeepAliveHttp10,
    /// `connection: close`; the connection closes after writing this response.
    Close,
}

impl Connection {
    /// The answer to a parsed request, unless the server decides to close anyway
    /// (draining, a rejection, the end of a pipelined batch it refuses).
    pub fn for_request(request: &Request<'_>) -> Connection {
        match (request.keep_alive, request.version) {
            (false, _) => Connection::Close,
            (true, Version::Http11) => Connection::KeepAlive,
            (true, Version::Http10) => Connection::KeepAliveHttp10,
        }
    }
}

/// Everything about a response but its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseHead<'a> {
    pub status: Status,
    pub content_type: ContentType,
    /// Echoed from the request or generated; always sent (CONTRACT.md section 3).
    pub request_id: &'a str,
    /// Echoed when the client sent one.
    pub traceparent: Option<&'a str>,
    /// Sent as `retry-after` in whole seconds, rounded up (0 ms stays 0).
    pub retry_after_ms: Option<u64>,
    pub connection: Connection,
}

impl<'a> ResponseHead<'a> {
    /// A JSON, keep-alive response without trace context or retry hint.
    pub fn new(status: Status, request_id: &'a str) -> ResponseHead<'a> {
        ResponseHead {
            status,
            content_type: ContentType::Json,
            request_id,
            traceparent: None,
            retry_after_ms: None,
            connection: Connection::KeepAlive,
        }
    }
}

/// Bytes of head beyond the variable values, generously: the status line, the header
/// names, the content type, two 20-digit integers and CRLFs all fit in it.
const HEAD_FIXED_BYTES_MAX: usize = 256;

/// Writes a whole response. `out` is reserved once for the head and body; with enough
/// capacity already there (the connection's reused buffer), nothing is allocated.
///
/// `request_id` and `traceparent` are echoed from the client; a value that could break
/// the header block (CR, LF or another control character) is left out rather than
/// written, although the parser has already refused such values.
pub fn write_response(out: &mut BytesMut, head: &ResponseHead<'_>, body: &[u8]) {
    let traceparent = head.traceparent.filter(|value| is_safe_header_value(value));
    let request_id = Some(head.request_id).filter(|value| is_safe_header_value(value));
    out.reserve(
        HEAD_FIXED_BYTES_MAX
            + request_id.map_or(0, str::len)
            + traceparent.map_or(0, str::len)
            + body.len(),
    );
    out.extend_from_slice(b"HTTP/1.1 ");
    write_u64(out, u64::from(head.status.code()));
    out.extend_from_slice(b" ");
    out.extend_from_slice(head.status.reason_phrase().as_bytes());
    out.extend_from_slice(b"\r\ncontent-length: ");
    write_u64(out, body.len() as u64);
    if !body.is_empty() {
        out.extend_from_slice(b"\r\ncontent-type: ");
        out.extend_from_slice(head.content_type.header_value());
    }
    if let Some(request_id) = request_id {
        out.extend_from_slice(b"\r\nx-request-id: ");
        out.extend_from_slice(request_id.as_bytes());
    }
    if let Some(traceparent) = traceparent {
        out.extend_from_slice(b"\r\ntraceparent: ");
        out.extend_from_slice(traceparent.as_bytes());
    }
    if let Some(retry_after_ms) = head.retry_after_ms {
        out.extend_from_slice(b"\r\nretry-after: ");
        write_u64(out, retry_after_ms.div_ceil(1000));
    }
    match head.connection {
        Connection::KeepAlive => {}
        Connection::KeepAliveHttp10 => out.extend_from_slice(b"\r\nconnection: keep-alive"),
        Connection::Close => out.extend_from_slice(b"\r\nconnection: close"),
    }
    out.extend_from_slice(b"\r\n\r\n");
    out.extend_from_slice(body);
}

/// Longest body [`write_rejection`] writes: `{"state":"INVALID","reason_code":"…"}` with
/// the longest reason (checked by a test).
const REJECTION_BODY_BYTES_MAX: usize = 96;

/// Writes the answer to a parser rejection: its status, `{"state":"INVALID",
/// "reason_code":"<reason>"}`, and `connection: close` (every rejection closes).
/// `request_id` is the one the connection generated: the request's own never got parsed.
pub fn write_rejection(out: &mut BytesMut, rejection: Rejection, request_id: &str) {
    // The body is small and bounded: build it on the stack, so that the head can carry
    // its exact length without a second buffer.
    let mut body = [0u8; REJECTION_BODY_BYTES_MAX];
    let mut body_len = 0;
    for part in
        [br#"{"state":"INVALID","reason_code":""#.as_slice(), rejection.reason().as_bytes(), b"\"}"]
    {
        body[body_len..body_len + part.len()].copy_from_slice(part);
        body_len += part.len();
    }
    let head = ResponseHead {
        status: Status::of_rejection(rejection),
        connection: if rejection.close_connection() {
            Connection::Close
        } else {
            Connection::KeepAlive
        },
        ..ResponseHead::new(Status::BadRequest, request_id)
    };
    write_response(out, &head, &body[..body_len]);
}

/// Visible ASCII, SP and HTAB only: what may be echoed into a header value.
fn is_safe_header_value(value: &str) -> bool {
    value.bytes().all(|b| b == b'\t' || (b' '..=b'~').contains(&b))
}

/// The flat body of a reservation or query answer (CONTRACT.md sections 3.2 and 3.3):
/// fields in a fixed order, absent when `None` (and `replayed` absent when false).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateBody<'a> {
    pub request_id: Option<&'a str>,
    pub state: &'a str,
    pub reservation_id: Option<&'a str>,
    pub order_id: Option<&'a str>,
    pub reason_code: Option<&'a str>,
    pub retry_after_ms: Option<u64>,
    pub replayed: bool,
}

impl StateBody<'_> {
    pub fn write_json(&self, out: &mut BytesMut) {
        let mut object = JsonObject::begin(out);
        object
            .opt_str("request_id", self.request_id)
            .str("state", self.state)
            .opt_str("reservation_id", self.reservation_id)
            .opt_str("order_id", self.order_id)
            .opt_str("reason_code", self.reason_code)
            .opt_u64("retry_after_ms", self.retry_after_ms);
        if self.replayed {
            object.bool("replayed", true);
        }
        object.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::limits::Limits;
    use crate::http::parse::{parse_request, Parsed};

    fn text(out: &BytesMut) -> &str {
        std::str::from_utf8(out).expect("responses are ASCII")
    }

    #[test]
    fn minimal_keep_alive_response_without_body() {
        let mut out = BytesMut::new();
        write_response(&mut out, &ResponseHead::new(Status::NoContent, "rid-1"), b"");
        assert_eq!(
            text(&out),
            "HTTP/1.1 204 No Content\r\ncontent-length: 0\r\nx-request-id: rid-1\r\n\r\n"
        );
    }

    #[test]
    fn every_optional_header() {
        let mut out = BytesMut::new();
        let head = ResponseHead {
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            retry_after_ms: Some(1500),
            connection: Connection::Close,
            ..ResponseHead::new(Status::TooManyRequests, "req_9")
        };
        write_response(&mut out, &head, br#"{"state":"OVERLOADED"}"#);
        assert_eq!(
            text(&out),
            "HTTP/1.1 429 Too Many Requests\r\ncontent-length: 22\r\ncontent-type: application/json\r\n\
             x-request-id: req_9\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n\
             retry-after: 2\r\nconnection: close\r\n\r\n{\"state\":\"OVERLOADED\"}"
        );
    }

    #[test]
    fn retry_after_rounds_milliseconds_up() {
        for (ms, seconds) in [
            (0, "0"),
            (1, "1"),
            (999, "1"),
            (1000, "1"),
            (1001, "2"),
            (u64::MAX, "18446744073709552"),
        ] {
            let mut out = BytesMut::new();
            let head = ResponseHead {
                retry_after_ms: Some(ms),
                ..ResponseHead::new(Status::ServiceUnavailable, "r")
            };
            write_response(&mut out, &head, b"");
            assert!(
                text(&out).contains(&format!("\r\nretry-after: {seconds}\r\n")),
                "{ms} ms: {}",
                text(&out)
            );
        }
    }

    #[test]
    fn http10_keep_alive_is_announced() {
        let mut out = BytesMut::new();
        let head = ResponseHead {
            connection: Connection::KeepAliveHttp10,
            ..ResponseHead::new(Status::Ok, "r")
        };
        write_response(&mut out, &head, b"");
        assert!(text(&out).ends_with("\r\nconnection: keep-alive\r\n\r\n"));
    }

    #[test]
    fn unsafe_echoed_values_are_left_out() {
        let mut out = BytesMut::new();
        let head = ResponseHead {
            traceparent: Some("00-x\r\nset-cookie: a=b"),
            ..ResponseHead::new(Status::Ok, "evil\r\nx: y")
        };
        write_response(&mut out, &head, b"");
        assert_eq!(text(&out), "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
    }

    #[test]
    fn prometheus_content_type() {
        let mut out = BytesMut::new();
        let head = ResponseHead {
            content_type: ContentType::PrometheusText,
            ..ResponseHead::new(Status::Ok, "r")
        };
        write_response(&mut out, &head, b"up 1\n");
        assert!(
            text(&out).contains("\r\ncontent-type: text/plain; version=0.0.4; charset=utf-8\r\n")
        );
    }

    #[test]
    fn integers_are_formatted_exactly() {
        for value in [0, 7, 10, 99, 100, 4096, 1_000_000_007, u64::MAX] {
            let mut out = BytesMut::new();
            write_u64(&mut out, value);
            assert_eq!(text(&out), value.to_string());
        }
    }

    #[test]
    fn writing_into_a_buffer_with_room_does_not_reallocate() {
        let mut out = BytesMut::with_capacity(4096);
        let before = out.as_ptr();
        for _ in 0..8 {
            let head = ResponseHead {
                retry_after_ms: Some(500),
                ..ResponseHead::new(Status::Accepted, "req_1")
            };
            write_response(&mut out, &head, br#"{"state":"QUEUED"}"#);
        }
        assert_eq!(out.as_ptr(), before);
    }

    #[test]
    fn status_codes_round_trip_and_match_rejections() {
        for rejection in Rejection::ALL {
            assert_eq!(Status::of_rejection(rejection).code(), rejection.status(), "{rejection:?}");
        }
        for code in 100..600 {
            if let Some(status) = Status::from_code(code) {
                assert_eq!(status.code(), code);
                assert!(!status.reason_phrase().is_empty());
            }
        }
    }

    #[test]
    fn rejection_answers_are_exact_and_close() {
        let mut out = BytesMut::new();
        write_rejection(&mut out, Rejection::HeaderSectionTooLarge, "gen-1");
        let body = r#"{"state":"INVALID","reason_code":"header_section_too_large"}"#;
        assert_eq!(
            text(&out),
            format!(
                "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: {}\r\n\
                 content-type: application/json\r\nx-request-id: gen-1\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
        );
        for rejection in Rejection::ALL {
            let mut out = BytesMut::new();
            write_rejection(&mut out, rejection, "gen-2");
            let response = text(&out);
            assert!(
                response.starts_with(&format!("HTTP/1.1 {} ", rejection.status())),
                "{response}"
            );
            assert!(response.contains("\r\nconnection: close\r\n"));
            let body = format!(r#"{{"state":"INVALID","reason_code":"{}"}}"#, rejection.reason());
            assert!(response.ends_with(&body), "{response}");
            assert!(response.contains(&format!("\r\ncontent-length: {}\r\n", body.len())));
            assert!(body.len() <= REJECTION_BODY_BYTES_MAX);
            let reason = rejection.reason();
            assert!(
                reason.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{reason}"
            );
        }
    }

    #[test]
    fn state_body_fields_in_order_and_absent_when_empty() {
        let mut out = BytesMut::new();
        StateBody {
            request_id: Some("req_1"),
            state: "QUEUED",
            reservation_id: Some("resv_01J"),
            retry_after_ms: Some(500),
            replayed: true,
            ..StateBody::default()
        }
        .write_json(&mut out);
        assert_eq!(
            text(&out),
            r#"{"request_id":"req_1","state":"QUEUED","reservation_id":"resv_01J","retry_after_ms":500,"replayed":true}"#
        );
        let mut out = BytesMut::new();
        StateBody { state: "SOLD_OUT", ..StateBody::default() }.write_json(&mut out);
        assert_eq!(text(&out), r#"{"state":"SOLD_OUT"}"#);
        let mut out = BytesMut::new();
        StateBody {
            state: "SUCCEEDED",
            order_id: Some("ord_1"),
            reason_code: Some("x\"y"),
            ..StateBody::default()
        }
        .write_json(&mut out);
        assert_eq!(text(&out), r#"{"state":"SUCCEEDED","order_id":"ord_1","reason_code":"x\"y"}"#);
    }

    #[test]
    fn a_response_to_a_parsed_request_echoes_its_ids() {
        let buf = b"GET /v1/reservations/r1 HTTP/1.0\r\nConnection: keep-alive\r\nX-Request-Id: abc\r\n\r\n";
        let Parsed::Complete { request, .. } = parse_request(buf, &Limits::DEFAULT) else {
            panic!("valid request");
        };
        let head = ResponseHead {
            connection: Connection::for_request(&request),
            ..ResponseHead::new(Status::NotFound, request.x_request_id.unwrap_or("generated"))
        };
        let mut out = BytesMut::new();
        write_response(&mut out, &head, b"");
        assert_eq!(
            text(&out),
            "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nx-request-id: abc\r\nconnection: keep-alive\r\n\r\n"
        );
    }
}
