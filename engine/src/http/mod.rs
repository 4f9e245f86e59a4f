//! The sans-I/O HTTP/1.1 layer of the edge: bytes in, a parsed [`Request`] or a
//! [`Rejection`] out; a response written into a caller-owned `BytesMut`.
//!
//! - [`parse`]: [`parse_request`], [`Limits`], [`Request`].
//! - [`rejection`]: [`Rejection`], its status and `reason_code`.
//! - [`chunked`]: the strict, bounded chunked decoder (used by `parse`).
//! - [`response`]: [`write_response`], [`write_rejection`], [`Status`], [`StateBody`].
//! - [`json`]: the allocation-free flat JSON object writer.
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
//! 5. enforce the header-read deadline and idle timeout itself (time is not ours).
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
//! - `Expect: 100-continue` gets no interim `100 Continue`: bodies are at most 4 KiB, and
//!   clients that wait for it (curl, for large bodies only) send the body after their own
//!   short timeout. If that ever matters, the connection can send it when the head is
//!   complete and the body is not (add a head-only result to the parser for that).
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
//! `fuzz/fuzz_targets/http_parse.rs` (its own workspace, not built by
//! `cargo test --workspace`) feeds arbitrary bytes through the pipelined loop above, in
//! two reads, and checks that a found request does not change when more bytes arrive and
//! that a refused prefix stays refused. On the stable toolchain (`RUSTC_BOOTSTRAP=1`
//! unlocks the sanitizer flags cargo-fuzz needs):
//!
//! ```text
//! cargo install cargo-fuzz
//! cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run http_parse -- -max_total_time=60
//! # with the checked-in seeds and dictionary, and heads past the 16 KiB limit:
//! cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run http_parse corpus/http_parse seeds/http_parse \
//!     -- -max_total_time=60 -max_len=32768 -dict=http_parse.dict
//! ```
//!
//! The first build takes about 5 minutes on 2 cores; a run does about 30,000 inputs/s.

//! Read next: `parse.rs` (the rules above, in code), then `engine::shard` for the
//! connection loop that drives this module.

pub mod chunked;
pub mod json;
mod line;
pub mod parse;
pub mod rejection;
pub mod response;

#[cfg(test)]
mod proptests;

pub use parse::{parse_request, Body, Limits, Method, Parsed, Rejection, Request, Version};
pub use response::{
    write_rejection, write_response, Connection, ContentType, ResponseHead, StateBody, Status,
};
