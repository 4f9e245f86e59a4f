//! The sans-I/O HTTP/1.1 layer of the edge: bytes in, a parsed [`Request`] or a
//! [`Rejection`] out; a response written into a caller-owned `BytesMut`.
//!
//! - [`parse`]: [`parse_request`], [`Request`].
//! - [`limits`]: [`Limits`], every bound on one request, shared by `parse` and `chunked`.
//! - [`rejection`]: [`Rejection`], its status and `reason_code`.
//! - [`chunked`]: the strict, bounded chunked decoder (used by `parse`).
//! - [`response`]: [`write_response`], [`write_rejection`], [`Status`], [`StateBody`].
//! - [`json`]: the allocation-free flat JSON object writer and the decimal writer the
//!   response head shares with it.
//! - [`proxy`]: the PROXY protocol v1/v2 header parser and the trusted-source list.
//!
//! What it deliberately does not do: I/O, clocks, spawning, routing, authentication,
//! metrics. The glommio connection loop (in `engine::shard`) drives it:
//!
//! 1. read into its buffer (capacity at least [`Limits::request_bytes_max`]);
//! 2. call [`parse_request`] on the unconsumed bytes until it says `Incomplete`,
//!    answering each `Complete` in order and advancing by `consumed` — at most
//!    [`Limits::pipeline_depth_max`] requests parsed ahead of their answers;
//! 3. after a request with `keep_alive == false`, answer it and close: nothing after
//!    it is parsed (its bytes may be the start of a smuggled request);
//! 4. on `Reject`, write [`write_rejection`] and close ([`Rejection::close_connection`]
//!    is true for every variant);
//! 5. enforce the deadlines itself (time is not ours): the head within the header deadline
//!    from its first byte, the body within the body deadline from the end of the head —
//!    [`progress`] says which applies to an incomplete request — and send `100 Continue`
//!    when [`Progress::Body`] says the client waits for it (RFC 9110 section 10.1.1; a head
//!    the parser refuses, e.g. 413 for an over-limit Content-Length, is answered at once).
//!
//! # Why no request smuggling is possible
//!
//! Smuggling needs two parsers on the path (a proxy or load balancer and us) to disagree
//! about where a request ends. Our rules leave no room for a disagreement that we would
//! resolve differently from a correct intermediary; every doubt is a 400 and a close:
//!
//! 1. **One framing per request.** Content-Length and Transfer-Encoding together are
//!    refused (not resolved in favour of one, as RFC 9112 permits). No framing header
//!    means an empty body.
//! 2. **Strict Content-Length.** Exactly one header, `1*DIGIT`, at most 20 digits, no
//!    sign, no inner space, no list (`5, 5`), no overflow. A duplicate is refused even
//!    when equal.
//! 3. **Strict Transfer-Encoding.** Exactly one header whose value is exactly `chunked`
//!    (any case). `gzip, chunked`, `chunked, chunked`, `identity`, two header lines, and
//!    any Transfer-Encoding in HTTP/1.0 are refused.
//! 4. **Strict chunks.** Hex-only sizes of at most 8 digits, nothing between size and
//!    CRLF but a bounded, visible-ASCII extension after `;`, CRLF after every chunk's
//!    data, no trailers. Validation and decoding are one function, so they cannot differ.
//! 5. **Strict lines.** Every line ends in CRLF: a bare LF or a bare CR anywhere in the
//!    head or the chunk framing is refused, and so is every other control character but
//!    HTAB (NUL, ESC, DEL). `httparse` accepts bare LF; a front end that does not would
//!    see a different header block (`X: a\nContent-Length: 5` is one header to it and
//!    two to a bare-LF parser), so we refuse rather than pick a side. No obs-fold: a
//!    header line starting with SP/HTAB is refused. No whitespace between a field name
//!    and its colon.
//! 6. **Two parsers agree or we refuse.** Our line pre-scan and `httparse` must find the
//!    same end of head; otherwise the request is refused.
//! 7. **Bounded everything.** The request line, header count, head size, body size and
//!    chunk framing size are limited, and the limits are enforced on partial input, so a
//!    never-ending head or body is refused as soon as it passes the limit.
//! 8. **Close on any rejection, and after `Connection: close`.** The bytes following a
//!    doubtful request are never interpreted as a request.
//!
//! # Deliberately not supported
//!
//! - Absolute-form, authority-form and asterisk-form targets (`501`): this is an origin
//!   server behind an L4 balancer, not a proxy.
//! - Trailers after a chunked body (`400`).
//! - `HEAD` responses carry a body if the caller writes one: the router decides what a
//!   `Method::Head` gets.
//!
//! # Chunked bodies
//!
//! [`parse_request`] keeps its allocation-free signature: a chunked body comes back as
//! [`Body::Chunked`], its chunk stream already validated, and [`Body::bytes`] decodes it
//! into a `Vec<u8>` scratch buffer owned by the connection (capacity
//! [`Limits::body_bytes_max`], reused, so no allocation). A Content-Length body is a
//! plain slice of the read buffer.
//!
//! # Fuzzing
//!
//! `fuzz/` (its own workspace, not built by `cargo test --workspace`) holds the cargo-fuzz
//! targets `http_parse` (the pipelined loop above, in two reads: a found request does not
//! change when more bytes arrive, a refused prefix stays refused) and `proxy_parse` (the
//! PROXY header: every strict prefix is `Incomplete`, trailing bytes change nothing), among
//! others; `fuzz/README.md` has the commands.
//!
//! Read next: `parse.rs` (the rules above, in code), then `engine::shard` for the
//! connection loop that drives this module.

pub mod chunked;
pub mod json;
pub mod limits;
mod line;
pub mod parse;
pub mod proxy;
pub mod rejection;
pub mod response;

#[cfg(test)]
mod proptests;

pub use limits::Limits;
pub use parse::{
    is_valid_traceparent, parse_request, progress, Body, Method, Parsed, Progress, Rejection,
    Request, Version,
};
pub use response::{
    write_rejection, write_response, Connection, ContentType, ResponseHead, StateBody, Status,
};
