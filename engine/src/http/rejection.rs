//! Why a request is refused: [`Rejection`], one variant per rule of `parse.rs` and
//! `chunked.rs`, with its HTTP status, its stable `reason_code`, and whether the
//! connection must close (always, see [`Rejection::close_connection`]).
//!
//! What it does not hold: business refusals (`INVALID` body fields, `UNAUTHORIZED`, ...),
//! which the API layer decides after a request parsed; nor the response bytes
//! ([`super::response::write_rejection`]).

/// Why a request was refused. Every variant closes the connection
/// ([`Rejection::close_connection`]): the parser stops at the first doubt and does not
/// say where the bad request ends, so nothing after it can be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rejection {
    /// A bare LF, or a CR not followed by LF, anywhere in the head or chunk framing.
    InvalidLineEnding,
    /// Too many empty lines before the request line
    /// ([`LEADING_EMPTY_LINES_MAX`](super::parse::LEADING_EMPTY_LINES_MAX)), or a request
    /// line `httparse` refuses (bad method token, bad target bytes, wrong spacing, no
    /// version).
    MalformedRequestLine,
    /// An origin-form target containing `#` (fragments are never sent).
    InvalidRequestTarget,
    /// Absolute-, authority- or asterisk-form target: this edge is not a proxy.
    RequestTargetFormNotSupported,
    /// `HTTP/x.y` other than 1.0 and 1.1.
    HttpVersionNotSupported,
    RequestLineTooLong,
    TooManyHeaders,
    HeaderSectionTooLarge,
    /// A header line starting with SP or HTAB (obsolete line folding).
    ObsFold,
    /// `Name : value` — whitespace between a field name and its colon.
    WhitespaceBeforeColon,
    InvalidHeaderName,
    /// A control character (NUL included) or DEL in any header value, or a non-ASCII byte
    /// in one of the headers the edge reads.
    InvalidHeaderValue,
    MissingHost,
    DuplicateHost,
    InvalidHost,
    /// `Authorization`, `X-Request-Id`, `Traceparent` or `Content-Type` sent twice.
    DuplicateHeader,
    ContentLengthWithTransferEncoding,
    DuplicateContentLength,
    InvalidContentLength,
    /// Anything but exactly one `Transfer-Encoding: chunked` header.
    InvalidTransferEncoding,
    /// `Transfer-Encoding` in an HTTP/1.0 request (RFC 9112 section 6.1: faulty framing).
    TransferEncodingInHttp10,
    InvalidChunkSize,
    /// Bad chunk extension, over-long chunk line, data not followed by CRLF.
    InvalidChunkedEncoding,
    /// A trailer field after the last chunk.
    ChunkedTrailerNotAllowed,
    /// Body (declared or decoded) above
    /// [`Limits::body_bytes_max`](super::Limits::body_bytes_max), or chunk framing above
    /// [`Limits::chunked_body_wire_bytes_max`](super::Limits::chunked_body_wire_bytes_max).
    BodyTooLarge,
}

impl Rejection {
    /// Every variant, for tests and for pre-registering metric labels.
    pub const ALL: [Rejection; 25] = [
        Rejection::InvalidLineEnding,
        Rejection::MalformedRequestLine,
        Rejection::InvalidRequestTarget,
        Rejection::RequestTargetFormNotSupported,
        Rejection::HttpVersionNotSupported,
        Rejection::RequestLineTooLong,
        Rejection::TooManyHeaders,
        Rejection::HeaderSectionTooLarge,
        Rejection::ObsFold,
        Rejection::WhitespaceBeforeColon,
        Rejection::InvalidHeaderName,
        Rejection::InvalidHeaderValue,
        Rejection::MissingHost,
        Rejection::DuplicateHost,
        Rejection::InvalidHost,
        Rejection::DuplicateHeader,
        Rejection::ContentLengthWithTransferEncoding,
        Rejection::DuplicateContentLength,
        Rejection::InvalidContentLength,
        Rejection::InvalidTransferEncoding,
        Rejection::TransferEncodingInHttp10,
        Rejection::InvalidChunkSize,
        Rejection::InvalidChunkedEncoding,
        Rejection::ChunkedTrailerNotAllowed,
        Rejection::BodyTooLarge,
    ];

    /// The HTTP status code of the answer.
    pub const fn status(self) -> u16 {
        match self {
            Rejection::RequestLineTooLong => 414,
            Rejection::TooManyHeaders | Rejection::HeaderSectionTooLarge => 431,
            Rejection::BodyTooLarge => 413,
            Rejection::HttpVersionNotSupported => 505,
            Rejection::RequestTargetFormNotSupported => 501,
            Rejection::InvalidLineEnding
            | Rejection::MalformedRequestLine
            | Rejection::InvalidRequestTarget
            | Rejection::ObsFold
            | Rejection::WhitespaceBeforeColon
            | Rejection::InvalidHeaderName
            | Rejection::InvalidHeaderValue
            | Rejection::MissingHost
            | Rejection::DuplicateHost
            | Rejection::InvalidHost
            | Rejection::DuplicateHeader
            | Rejection::ContentLengthWithTransferEncoding
            | Rejection::DuplicateContentLength
            | Rejection::InvalidContentLength
            | Rejection::InvalidTransferEncoding
            | Rejection::TransferEncodingInHttp10
            | Rejection::InvalidChunkSize
            | Rejection::InvalidChunkedEncoding
            | Rejection::ChunkedTrailerNotAllowed => 400,
        }
    }

    /// Whether the connection must close after the answer. True for every variant: the
    /// parser does not report where a refused request ends, so the bytes after it cannot
    /// be framed. Spelled out per variant so a new one forces the decision.
    pub const fn close_connection(self) -> bool {
        match self {
            Rejection::InvalidLineEnding
            | Rejection::MalformedRequestLine
            | Rejection::InvalidRequestTarget
            | Rejection::RequestTargetFormNotSupported
            | Rejection::HttpVersionNotSupported
            | Rejection::RequestLineTooLong
            | Rejection::TooManyHeaders
            | Rejection::HeaderSectionTooLarge
            | Rejection::ObsFold
            | Rejection::WhitespaceBeforeColon
            | Rejection::InvalidHeaderName
            | Rejection::InvalidHeaderValue
            | Rejection::MissingHost
            | Rejection::DuplicateHost
            | Rejection::InvalidHost
            | Rejection::DuplicateHeader
            | Rejection::ContentLengthWithTransferEncoding
            | Rejection::DuplicateContentLength
            | Rejection::InvalidContentLength
            | Rejection::InvalidTransferEncoding
            | Rejection::TransferEncodingInHttp10
            | Rejection::InvalidChunkSize
            | Rejection::InvalidChunkedEncoding
            | Rejection::ChunkedTrailerNotAllowed
            | Rejection::BodyTooLarge => true,
        }
    }

    /// The `reason_code` of the JSON answer: lower snake case ASCII, stable (clients and
    /// dashboards key on it).
    pub const fn reason(self) -> &'static str {
        match self {
            Rejection::InvalidLineEnding => "invalid_line_ending",
            Rejection::MalformedRequestLine => "malformed_request_line",
            Rejection::InvalidRequestTarget => "invalid_request_target",
            Rejection::RequestTargetFormNotSupported => "request_target_form_not_supported",
            Rejection::HttpVersionNotSupported => "http_version_not_supported",
            Rejection::RequestLineTooLong => "request_line_too_long",
            Rejection::TooManyHeaders => "too_many_headers",
            Rejection::HeaderSectionTooLarge => "header_section_too_large",
            Rejection::ObsFold => "obs_fold",
            Rejection::WhitespaceBeforeColon => "whitespace_before_colon",
            Rejection::InvalidHeaderName => "invalid_header_name",
            Rejection::InvalidHeaderValue => "invalid_header_value",
            Rejection::MissingHost => "missing_host",
            Rejection::DuplicateHost => "duplicate_host",
            Rejection::InvalidHost => "invalid_host",
            Rejection::DuplicateHeader => "duplicate_header",
            Rejection::ContentLengthWithTransferEncoding => "content_length_with_transfer_encoding",
            Rejection::DuplicateContentLength => "duplicate_content_length",
            Rejection::InvalidContentLength => "invalid_content_length",
            Rejection::InvalidTransferEncoding => "invalid_transfer_encoding",
            Rejection::TransferEncodingInHttp10 => "transfer_encoding_in_http10",
            Rejection::InvalidChunkSize => "invalid_chunk_size",
            Rejection::InvalidChunkedEncoding => "invalid_chunked_encoding",
            Rejection::ChunkedTrailerNotAllowed => "chunked_trailer_not_allowed",
            Rejection::BodyTooLarge => "body_too_large",
        }
    }
}
