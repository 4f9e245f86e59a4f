//! The RESP2 codec: commands out, replies in. Runtime-agnostic (bytes in, values out), no
//! I/O, no clock, no glommio — so it can be fuzzed and property-tested on its own.
//!
//! - Encoding ([`encode_command`], [`encode_fcall`]) is written by hand straight into a reused
//!   `BytesMut`: one `reserve` of the exact size, integers formatted on the stack, no frame
//!   objects. On the hot `FCALL reserve` path this is several times cheaper than building a
//!   `redis-protocol` frame and encoding it (see `benches/benches/resp.rs`).
//! - Decoding ([`decode`]) first runs a cheap bounded pre-scan ([`DecodeLimits`]) over the
//!   frame headers, then lets `redis-protocol` 6 build the frame zero-copy out of the read
//!   buffer, and converts it into a [`Reply`]. The pre-scan exists because `redis-protocol`
//!   has no limits of its own: it recurses once per nesting level (a hostile `*1\r\n*1\r\n…`
//!   overflows the stack), it waits forever for a line with no CRLF, and it would make the
//!   caller buffer a declared `$2000000000` bulk string. With the pre-scan, malformed or
//!   oversized input is a [`ProtocolError`], never a panic or an unbounded allocation, and a
//!   partial frame costs one header walk per read instead of a full parse.
//! - "Not enough bytes yet" is `Ok(None)`, a normal value, not an error (mini-redis style).
//!
//! Not here: sockets, pipelining, timeouts, reconnects (`crate::redis::connection`); the
//! meaning of a function's reply (`crate::redis::script`). RESP3 is not spoken: the client
//! never sends `HELLO 3`.

use bytes::{Buf, Bytes, BytesMut};
use redis_protocol::resp2::{decode::decode_bytes_mut, types::BytesFrame};

/// One RESP2 reply as the client sees it. Server errors (`-ERR …`) are values here
/// ([`Reply::Error`]): the caller decides what they mean.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+OK` — a simple string (bytes, not necessarily UTF-8).
    Simple(Bytes),
    /// `-ERR message` — a server error reply, whole line without the `-`.
    Error(Bytes),
    /// `:42`
    Integer(i64),
    /// `$3\r\nfoo` — a bulk string.
    Bulk(Bytes),
    /// `$-1` or `*-1` — the null bulk string or null array.
    Nil,
    /// `*N` — an array of replies.
    Array(Vec<Reply>),
}

impl Reply {
    /// The bytes of a simple or bulk string; `None` for every other kind (errors included, so
    /// an error is never mistaken for data).
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Reply::Simple(b) | Reply::Bulk(b) => Some(b),
            _ => None,
        }
    }

    /// [`Reply::as_bytes`] as UTF-8; `None` if not a string or not UTF-8.
    pub fn as_str(&self) -> Option<&str> {
        self.as_bytes().and_then(|b| std::str::from_utf8(b).ok())
    }

    /// The value of an integer reply. Lua numbers come back from Redis as integers; bulk
    /// strings are not parsed here (say so explicitly at the call site if you need that).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Reply::Integer(i) => Some(*i),
            _ => None,
        }
    }

    /// The elements of an array reply.
    pub fn as_array(&self) -> Option<&[Reply]> {
        match self {
            Reply::Array(items) => Some(items),
            _ => None,
        }
    }

    /// Takes the elements of an array reply, without copying them.
    pub fn into_array(self) -> Result<Vec<Reply>, Reply> {
        match self {
            Reply::Array(items) => Ok(items),
            other => Err(other),
        }
    }

    /// The whole message of a server error reply (e.g. `ERR Function not found`).
    pub fn as_error(&self) -> Option<&[u8]> {
        match self {
            Reply::Error(b) => Some(b),
            _ => None,
        }
    }

    /// The error code of a server error: its first word (`ERR`, `NOSCRIPT`, `BUSY`, `MOVED`).
    pub fn error_code(&self) -> Option<&[u8]> {
        let message = self.as_error()?;
        let end = message.iter().position(|&b| b == b' ').unwrap_or(message.len());
        Some(&message[..end])
    }

    pub fn is_error(&self) -> bool {
        matches!(self, Reply::Error(_))
    }

    pub fn is_nil(&self) -> bool {
        matches!(self, Reply::Nil)
    }

    /// `+OK`.
    pub fn is_ok(&self) -> bool {
        matches!(self, Reply::Simple(b) if b.as_ref() == b"OK")
    }
}

/// Why a byte stream is not a RESP2 reply we accept. Any of these means the connection's
/// byte stream can no longer be trusted: the connection drops it and reconnects.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("invalid RESP2 type byte 0x{0:02x}")]
    InvalidType(u8),
    #[error("invalid integer or length in a RESP2 header line")]
    InvalidNumber,
    #[error("negative RESP2 length {0}")]
    NegativeLength(i64),
    #[error("RESP2 line longer than line_len_max ({max} bytes)")]
    LineTooLong { max: usize },
    #[error("bulk string of {len} bytes exceeds bulk_len_max ({max})")]
    BulkTooLong { len: i64, max: usize },
    #[error("array of {len} elements exceeds array_len_max ({max})")]
    ArrayTooLong { len: i64, max: usize },
    #[error("arrays nested deeper than depth_max ({max})")]
    TooDeep { max: usize },
    #[error("reply has more than elements_total_max ({max}) elements")]
    TooManyElements { max: usize },
    #[error("reply larger than frame_bytes_max ({max} bytes)")]
    FrameTooLarge { max: usize },
    #[error("bulk string not terminated by CRLF")]
    MissingCrlf,
    /// An error reply (`-...`) whose text is not UTF-8 (redis-protocol decodes error text as a
    /// string; the pre-scan refuses it first so that both agree).
    #[error("RESP2 error reply text is not UTF-8")]
    InvalidErrorText,
    #[error("RESP2 decoder: {0}")]
    Decoder(String),
    #[error("reply received while no command was waiting for one")]
    Unsolicited,
}

/// Hard cap on [`DecodeLimits::depth_max`]: the pre-scan keeps one counter per open array in
/// a fixed stack array, so nesting costs no allocation.
pub const DEPTH_MAX_LIMIT: usize = 16;

/// Bounds on one decoded reply. Everything a peer declares is checked against these before
/// any byte is buffered for it or any element allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Deepest array nesting (a flat array is depth 1). At most [`DEPTH_MAX_LIMIT`].
    pub depth_max: usize,
    /// Most elements in one array.
    pub array_len_max: usize,
    /// Most elements in one reply, all levels together (bounds the `Vec<Reply>` memory).
    pub elements_total_max: usize,
    /// Longest bulk string.
    pub bulk_len_max: usize,
    /// Longest header or simple-string/error line, CRLF excluded.
    pub line_len_max: usize,
    /// Largest whole reply in bytes. Also bounds how much a connection buffers for one
    /// incomplete reply.
    pub frame_bytes_max: usize,
}

impl DecodeLimits {
    /// Sized for this project's replies (a handful of short strings per `FCALL`) with ample
    /// room for admin commands (`FUNCTION LIST`, `INFO`), and still refusing anything that
    /// would make one connection hold more than a few MiB.
    pub const DEFAULT: DecodeLimits = DecodeLimits {
        depth_max: 8,
        array_len_max: 65_536,
        elements_total_max: 262_144,
        bulk_len_max: 4 * 1024 * 1024,
        line_len_max: 64 * 1024,
        frame_bytes_max: 8 * 1024 * 1024,
    };
}

const _: () = assert!(DecodeLimits::DEFAULT.depth_max <= DEPTH_MAX_LIMIT);
const _: () = assert!(DecodeLimits::DEFAULT.bulk_len_max < DecodeLimits::DEFAULT.frame_bytes_max);

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits::DEFAULT
    }
}

/// Decodes one reply from the front of `buf` with [`DecodeLimits::DEFAULT`]. On
/// `Ok(Some(_))` the reply's bytes are split off `buf` (the reply's `Bytes` share them, no
/// copy); on `Ok(None)` nothing is consumed: read more bytes and call again.
pub fn decode(buf: &mut BytesMut) -> Result<Option<Reply>, ProtocolError> {
    decode_with(buf, &DecodeLimits::DEFAULT)
}

/// [`decode`] with explicit limits.
pub fn decode_with(
    buf: &mut BytesMut,
    limits: &DecodeLimits,
) -> Result<Option<Reply>, ProtocolError> {
    let frame_len = match scan(buf, limits)? {
        Some(frame_len) => frame_len,
        None => return Ok(None),
    };
    // The pre-scan has walked the whole frame within the limits, so redis-protocol's
    // recursion depth and allocations are bounded by it; any disagreement between the two
    // parsers is reported, not trusted.
    match decode_bytes_mut(buf) {
        Ok(Some((frame, consumed, _))) if consumed == frame_len => Ok(Some(convert(frame))),
        Ok(Some((_, consumed, _))) => Err(ProtocolError::Decoder(format!(
            "frame length {consumed} disagrees with pre-scan {frame_len}"
        ))),
        Ok(None) => Err(ProtocolError::Decoder("incomplete frame after complete pre-scan".into())),
        Err(e) => Err(ProtocolError::Decoder(e.to_string())),
    }
}

/// Walks the headers of the first frame in `buf` without allocating: returns the frame's
/// length once it is complete, `None` while bytes are missing, or the first limit broken.
/// Bulk bodies are skipped by length, so a large reply arriving in pieces costs one header
/// walk per read, not a re-parse of the body.
pub fn scan(buf: &[u8], limits: &DecodeLimits) -> Result<Option<usize>, ProtocolError> {
    let depth_max = limits.depth_max.min(DEPTH_MAX_LIMIT);
    // remaining[d] = elements still expected by the array open at nesting level d.
    let mut remaining = [0usize; DEPTH_MAX_LIMIT];
    let mut depth = 0usize;
    let mut elements = 0usize;
    let mut pos = 0usize;
    loop {
        let Some(&kind) = buf.get(pos) else { return Ok(None) };
        let Some((line, next)) = read_line(buf, pos + 1, limits.line_len_max)? else {
            return Ok(None);
        };
        pos = next;
        elements += 1;
        if elements > limits.elements_total_max {
            return Err(ProtocolError::TooManyElements { max: limits.elements_total_max });
        }
        match scan_element(kind, line, buf, pos, limits)? {
            Element::Incomplete => return Ok(None),
            Element::OpensArray(len) => {
                if depth == depth_max {
                    return Err(ProtocolError::TooDeep { max: depth_max });
                }
                remaining[depth] = len;
                depth += 1;
                // The array completes when its last element does.
                continue;
            }
            Element::Complete(end) => pos = end,
        }
        if pos > limits.frame_bytes_max {
            return Err(ProtocolError::FrameTooLarge { max: limits.frame_bytes_max });
        }
        if close_arrays(&mut remaining, &mut depth) {
            return Ok(Some(pos));
        }
    }
}

/// What one element's header line (and, for a bulk string, its body) does to [`scan`]'s walk.
enum Element {
    /// The element is complete; the walk goes on at this offset.
    Complete(usize),
    /// An array of this many (at least one) elements opens; they follow its header line.
    OpensArray(usize),
    /// A bulk string's body has not all arrived yet.
    Incomplete,
}

/// Checks one element whose header `line` (type byte `kind`) ends at `pos`.
#[inline]
fn scan_element(
    kind: u8,
    line: &[u8],
    buf: &[u8],
    pos: usize,
    limits: &DecodeLimits,
) -> Result<Element, ProtocolError> {
    match kind {
        b'+' => Ok(Element::Complete(pos)),
        b'-' => {
            // Found by fuzzing (fuzz/fuzz_targets/resp_decode.rs): without this the
            // pre-scan accepted `-\xff\r\n` and the decoder then failed on it.
            if std::str::from_utf8(line).is_err() {
                return Err(ProtocolError::InvalidErrorText);
            }
            Ok(Element::Complete(pos))
        }
        b':' => {
            parse_i64(line)?;
            Ok(Element::Complete(pos))
        }
        b'$' => skip_bulk(parse_i64(line)?, buf, pos, limits),
        b'*' => {
            let len = parse_i64(line)?;
            if len > 0 {
                if len as u64 > limits.array_len_max as u64 {
                    return Err(ProtocolError::ArrayTooLong { len, max: limits.array_len_max });
                }
                Ok(Element::OpensArray(len as usize))
            } else if len < -1 {
                Err(ProtocolError::NegativeLength(len))
            } else {
                Ok(Element::Complete(pos))
            }
        }
        other => Err(ProtocolError::InvalidType(other)),
    }
}

/// A bulk string of declared length `len` whose body starts at `pos`: skipped by length, never
/// buffered past the limits.
#[inline]
fn skip_bulk(
    len: i64,
    buf: &[u8],
    pos: usize,
    limits: &DecodeLimits,
) -> Result<Element, ProtocolError> {
    if len < 0 {
        return if len == -1 {
            Ok(Element::Complete(pos))
        } else {
            Err(ProtocolError::NegativeLength(len))
        };
    }
    if len as u64 > limits.bulk_len_max as u64 {
        return Err(ProtocolError::BulkTooLong { len, max: limits.bulk_len_max });
    }
    // `len` ≤ bulk_len_max, so this cannot overflow.
    let end = pos + len as usize;
    if end + 2 > limits.frame_bytes_max {
        return Err(ProtocolError::FrameTooLarge { max: limits.frame_bytes_max });
    }
    if buf.len() < end + 2 {
        return Ok(Element::Incomplete);
    }
    if &buf[end..end + 2] != b"\r\n" {
        return Err(ProtocolError::MissingCrlf);
    }
    Ok(Element::Complete(end + 2))
}

/// One element is complete: closes every open array it completes. True when that closed the
/// outermost one (or there was none): the frame is complete.
#[inline]
fn close_arrays(remaining: &mut [usize; DEPTH_MAX_LIMIT], depth: &mut usize) -> bool {
    loop {
        if *depth == 0 {
            return true;
        }
        remaining[*depth - 1] -= 1;
        if remaining[*depth - 1] > 0 {
            return false;
        }
        *depth -= 1;
    }
}

/// The line starting at `start` up to the first CRLF, and the offset after the CRLF.
fn read_line(
    buf: &[u8],
    start: usize,
    line_len_max: usize,
) -> Result<Option<(&[u8], usize)>, ProtocolError> {
    let window_end = buf.len().min(start.saturating_add(line_len_max).saturating_add(2));
    let window = buf.get(start..window_end).unwrap_or(&[]);
    match window.windows(2).position(|w| w == b"\r\n") {
        Some(len) => Ok(Some((&window[..len], start + len + 2))),
        // The window is full and holds no CRLF: the line can only get longer.
        None if window_end - start.min(window_end) >= line_len_max + 2 => {
            Err(ProtocolError::LineTooLong { max: line_len_max })
        }
        None => Ok(None),
    }
}

/// Same acceptance as redis-protocol (`str::parse::<i64>`), so both parsers agree.
fn parse_i64(line: &[u8]) -> Result<i64, ProtocolError> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .ok_or(ProtocolError::InvalidNumber)
}

fn convert(frame: BytesFrame) -> Reply {
    match frame {
        BytesFrame::SimpleString(b) => Reply::Simple(b),
        BytesFrame::Error(s) => Reply::Error(s.into_inner()),
        BytesFrame::Integer(i) => Reply::Integer(i),
        BytesFrame::BulkString(b) => Reply::Bulk(b),
        BytesFrame::Null => Reply::Nil,
        // Same element size on both sides, so this collect reuses the Vec in place.
        BytesFrame::Array(items) => Reply::Array(items.into_iter().map(convert).collect()),
    }
}

// ---------------------------------------------------------------------------------------
// Encoding.

/// Longest decimal form of a `u64`/`i64` (20 digits, or 19 and a sign).
const DIGITS_MAX: usize = 20;

/// A `u64` in decimal on the stack: the one integer formatter of the workspace (RESP
/// headers, Redis function arguments, HTTP heads, pass and hash texts). No allocation.
#[derive(Debug, Clone, Copy)]
pub struct U64Text {
    start: usize,
    bytes: [u8; DIGITS_MAX],
}

impl U64Text {
    pub fn new(mut n: u64) -> U64Text {
        let mut bytes = [0u8; DIGITS_MAX];
        let mut start = DIGITS_MAX;
        loop {
            start -= 1;
            // n % 10 < 10, so the cast cannot truncate.
            bytes[start] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        U64Text { start, bytes }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[self.start..]
    }
}

fn digits(n: usize) -> usize {
    let mut n = n;
    let mut count = 1;
    while n >= 10 {
        n /= 10;
        count += 1;
    }
    count
}

/// Bytes of `$len\r\n<arg>\r\n`.
fn bulk_len(arg_len: usize) -> usize {
    1 + digits(arg_len) + 2 + arg_len + 2
}

fn put_header(buf: &mut BytesMut, kind: u8, n: usize) {
    buf.extend_from_slice(&[kind]);
    buf.extend_from_slice(U64Text::new(n as u64).as_bytes());
    buf.extend_from_slice(b"\r\n");
}

fn put_bulk(buf: &mut BytesMut, arg: &[u8]) {
    put_header(buf, b'$', arg.len());
    buf.extend_from_slice(arg);
    buf.extend_from_slice(b"\r\n");
}

/// Appends one command as a RESP2 array of bulk strings: `*N\r\n$len\r\narg\r\n…`.
/// Reserves the exact size once, so a reused buffer never reallocates in steady state.
pub fn encode_command(buf: &mut BytesMut, args: &[&[u8]]) {
    let total = 1 + digits(args.len()) + 2 + args.iter().map(|a| bulk_len(a.len())).sum::<usize>();
    buf.reserve(total);
    put_header(buf, b'*', args.len());
    for arg in args {
        put_bulk(buf, arg);
    }
}

/// Appends `FCALL function numkeys key… arg…` by hand (no frame objects, no `format!`).
pub fn encode_fcall(buf: &mut BytesMut, function: &[u8], keys: &[&[u8]], args: &[&[u8]]) {
    let count = 3 + keys.len() + args.len();
    let numkeys_text = U64Text::new(keys.len() as u64);
    let numkeys = numkeys_text.as_bytes();
    let total = 1
        + digits(count)
        + 2
        + bulk_len(b"FCALL".len())
        + bulk_len(function.len())
        + bulk_len(numkeys.len())
        + keys.iter().chain(args).map(|a| bulk_len(a.len())).sum::<usize>();
    buf.reserve(total);
    put_header(buf, b'*', count);
    buf.extend_from_slice(b"$5\r\nFCALL\r\n");
    put_bulk(buf, function);
    put_bulk(buf, numkeys);
    for arg in keys.iter().chain(args) {
        put_bulk(buf, arg);
    }
}

/// Appends `reply` as a server would send it. For fake servers in tests and for the
/// property tests here; the client itself never sends replies.
pub fn encode_reply(buf: &mut BytesMut, reply: &Reply) {
    match reply {
        Reply::Simple(b) => put_line(buf, b'+', b),
        Reply::Error(b) => put_line(buf, b'-', b),
        Reply::Integer(i) => {
            buf.extend_from_slice(b":");
            if *i < 0 {
                buf.extend_from_slice(b"-");
            }
            buf.extend_from_slice(U64Text::new(i.unsigned_abs()).as_bytes());
            buf.extend_from_slice(b"\r\n");
        }
        Reply::Bulk(b) => put_bulk(buf, b),
        Reply::Nil => buf.extend_from_slice(b"$-1\r\n"),
        Reply::Array(items) => {
            put_header(buf, b'*', items.len());
            for item in items {
                encode_reply(buf, item);
            }
        }
    }
}

fn put_line(buf: &mut BytesMut, kind: u8, line: &[u8]) {
    buf.extend_from_slice(&[kind]);
    buf.extend_from_slice(line);
    buf.extend_from_slice(b"\r\n");
}

/// Splits `n` complete replies off the front of `buf` and drops them; for callers that only
/// need to skip (e.g. a fake server counting commands). Returns how many were skipped.
pub fn skip_frames(buf: &mut BytesMut, limits: &DecodeLimits) -> Result<usize, ProtocolError> {
    let mut skipped = 0;
    while let Some(len) = scan(buf, limits)? {
        buf.advance(len);
        skipped += 1;
    }
    Ok(skipped)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decode_all(bytes: &[u8]) -> Result<Option<Reply>, ProtocolError> {
        decode(&mut BytesMut::from(bytes))
    }

    fn bulk(s: &str) -> Reply {
        Reply::Bulk(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn an_error_reply_that_is_not_utf8_is_refused_by_the_pre_scan() {
        // The fuzzer's input, reduced: a simple string may hold any bytes, an error may not.
        let limits = DecodeLimits::DEFAULT;
        assert_eq!(scan(b"-\xff\r\n", &limits), Err(ProtocolError::InvalidErrorText));
        let mut buf = BytesMut::from(&b"-\xff\r\n"[..]);
        assert_eq!(decode(&mut buf), Err(ProtocolError::InvalidErrorText));
        let mut buf = BytesMut::from(&b"+\xff\r\n"[..]);
        assert!(matches!(decode(&mut buf), Ok(Some(Reply::Simple(_)))));
        let mut buf = BytesMut::from(&b"-ERR caf\xc3\xa9\r\n"[..]);
        assert!(matches!(decode(&mut buf), Ok(Some(Reply::Error(_)))));
    }

    #[test]
    fn decodes_every_resp2_type() {
        let cases: Vec<(&[u8], Reply)> = vec![
            (b"+OK\r\n", Reply::Simple(Bytes::from_static(b"OK"))),
            (b"+\r\n", Reply::Simple(Bytes::new())),
            (
                b"-ERR Function not found\r\n",
                Reply::Error(Bytes::from_static(b"ERR Function not found")),
            ),
            (b":0\r\n", Reply::Integer(0)),
            (b":-42\r\n", Reply::Integer(-42)),
            (b":9223372036854775807\r\n", Reply::Integer(i64::MAX)),
            (b":-9223372036854775808\r\n", Reply::Integer(i64::MIN)),
            (b"$3\r\nfoo\r\n", bulk("foo")),
            (b"$0\r\n\r\n", bulk("")),
            (b"$4\r\na\r\nb\r\n", bulk("a\r\nb")),
            (b"$-1\r\n", Reply::Nil),
            (b"*-1\r\n", Reply::Nil),
            (b"*0\r\n", Reply::Array(vec![])),
            (
                b"*4\r\n+CREATED\r\n$26\r\n01J0000000000000000000000R\r\n:7\r\n$-1\r\n",
                Reply::Array(vec![
                    Reply::Simple(Bytes::from_static(b"CREATED")),
                    bulk("01J0000000000000000000000R"),
                    Reply::Integer(7),
                    Reply::Nil,
                ]),
            ),
            (
                b"*2\r\n*1\r\n:1\r\n*0\r\n",
                Reply::Array(vec![Reply::Array(vec![Reply::Integer(1)]), Reply::Array(vec![])]),
            ),
        ];
        for (bytes, expected) in cases {
            let mut buf = BytesMut::from(bytes);
            buf.extend_from_slice(b":99\r\n");
            assert_eq!(decode(&mut buf).unwrap(), Some(expected), "{:?}", bytes);
            // Exactly the frame was consumed: the next one is intact.
            assert_eq!(decode(&mut buf).unwrap(), Some(Reply::Integer(99)));
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn partial_input_at_every_split_is_none_then_the_frame() {
        let frame: &[u8] = b"*3\r\n+CREATED\r\n*2\r\n$5\r\nhello\r\n:-7\r\n$-1\r\n";
        let expected = decode_all(frame).unwrap().unwrap();
        for split in 0..frame.len() {
            let mut buf = BytesMut::from(&frame[..split]);
            assert_eq!(decode(&mut buf).unwrap(), None, "split {split}");
            assert_eq!(buf.len(), split, "nothing consumed at split {split}");
            buf.extend_from_slice(&frame[split..]);
            assert_eq!(decode(&mut buf).unwrap().as_ref(), Some(&expected), "split {split}");
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn malformed_input_is_an_error() {
        let cases: Vec<(&[u8], ProtocolError)> = vec![
            (b"?x\r\n", ProtocolError::InvalidType(b'?')),
            (b"foobar\r\n", ProtocolError::InvalidType(b'f')),
            (b":12a\r\n", ProtocolError::InvalidNumber),
            (b":\r\n", ProtocolError::InvalidNumber),
            (b":99999999999999999999\r\n", ProtocolError::InvalidNumber),
            (b"$x\r\n", ProtocolError::InvalidNumber),
            (b"$-2\r\n", ProtocolError::NegativeLength(-2)),
            (b"*-5\r\n", ProtocolError::NegativeLength(-5)),
            (b"$3\r\nfooXY", ProtocolError::MissingCrlf),
            (b"*2\r\n:1\r\n!\r\n", ProtocolError::InvalidType(b'!')),
        ];
        for (bytes, expected) in cases {
            assert_eq!(decode_all(bytes), Err(expected), "{:?}", String::from_utf8_lossy(bytes));
        }
    }

    #[test]
    fn oversize_and_deep_input_is_an_error_before_buffering() {
        let limits = DecodeLimits::DEFAULT;
        // Declared sizes are refused at the header, with the body nowhere in sight.
        assert_eq!(
            decode_all(b"$2000000000\r\nabc"),
            Err(ProtocolError::BulkTooLong { len: 2_000_000_000, max: limits.bulk_len_max })
        );
        assert_eq!(
            decode_all(b"$9223372036854775807\r\n"),
            Err(ProtocolError::BulkTooLong { len: i64::MAX, max: limits.bulk_len_max })
        );
        assert_eq!(
            decode_all(b"*100000000\r\n"),
            Err(ProtocolError::ArrayTooLong { len: 100_000_000, max: limits.array_len_max })
        );
        // Deep nesting: refused at depth_max + 1, whatever follows.
        let deep = b"*1\r\n".repeat(100_000);
        assert_eq!(decode_all(&deep), Err(ProtocolError::TooDeep { max: limits.depth_max }));
        let mut exact = b"*1\r\n".repeat(limits.depth_max);
        exact.extend_from_slice(b":1\r\n");
        assert!(decode_all(&exact).unwrap().is_some());
        // A line that never ends.
        let endless = [b"+".as_slice(), &vec![b'a'; limits.line_len_max + 2]].concat();
        assert_eq!(
            decode_all(&endless),
            Err(ProtocolError::LineTooLong { max: limits.line_len_max })
        );
        let almost = [b"+".as_slice(), &vec![b'a'; limits.line_len_max]].concat();
        assert_eq!(decode_all(&almost), Ok(None));
    }

    #[test]
    fn tiny_limits_hit_every_bound() {
        let limits = DecodeLimits {
            depth_max: 2,
            array_len_max: 3,
            elements_total_max: 6,
            bulk_len_max: 4,
            line_len_max: 8,
            frame_bytes_max: 40,
        };
        let dec = |b: &[u8]| decode_with(&mut BytesMut::from(b), &limits);
        assert!(dec(b"*3\r\n*2\r\n:1\r\n:2\r\n$4\r\nabcd\r\n$-1\r\n").unwrap().is_some());
        assert_eq!(dec(b"*4\r\n"), Err(ProtocolError::ArrayTooLong { len: 4, max: 3 }));
        assert_eq!(dec(b"*1\r\n*1\r\n*1\r\n"), Err(ProtocolError::TooDeep { max: 2 }));
        assert_eq!(dec(b"$5\r\n"), Err(ProtocolError::BulkTooLong { len: 5, max: 4 }));
        assert_eq!(dec(b"+1234567890"), Err(ProtocolError::LineTooLong { max: 8 }));
        assert_eq!(
            dec(b"*3\r\n*3\r\n:1\r\n:2\r\n:3\r\n*3\r\n:1\r\n"),
            Err(ProtocolError::TooManyElements { max: 6 })
        );
        assert_eq!(
            dec(b"*3\r\n*3\r\n$4\r\nabcd\r\n$4\r\nabcd\r\n$4\r\nabcd\r\n$4\r\n"),
            Err(ProtocolError::FrameTooLarge { max: 40 })
        );
    }

    #[test]
    fn encode_command_matches_the_protocol_text() {
        let mut buf = BytesMut::new();
        encode_command(&mut buf, &[b"SET", b"k", b""]);
        assert_eq!(&buf[..], b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n");
    }

    #[test]
    fn encode_fcall_matches_encode_command() {
        let keys: [&[u8]; 3] = [b"{a:s}:stock", b"{a:s}:user:1", b"{a:s}:req:r"];
        let args: [&[u8]; 2] = [b"r", b"1700000000000"];
        let mut by_hand = BytesMut::new();
        encode_fcall(&mut by_hand, b"reserve", &keys, &args);
        let mut generic = BytesMut::new();
        let mut all: Vec<&[u8]> = vec![b"FCALL", b"reserve", b"3"];
        all.extend_from_slice(&keys);
        all.extend_from_slice(&args);
        encode_command(&mut generic, &all);
        assert_eq!(by_hand, generic);
        // The exact-size reserve: a second encode into a cleared buffer does not grow it.
        let capacity = by_hand.capacity();
        by_hand.clear();
        encode_fcall(&mut by_hand, b"reserve", &keys, &args);
        assert_eq!(by_hand.capacity(), capacity);
    }

    #[test]
    fn reply_accessors() {
        let err = Reply::Error(Bytes::from_static(b"ERR Function not found"));
        assert_eq!(err.error_code(), Some(&b"ERR"[..]));
        assert_eq!(err.as_bytes(), None);
        assert!(Reply::Simple(Bytes::from_static(b"OK")).is_ok());
        assert_eq!(bulk("x").as_str(), Some("x"));
        assert_eq!(Reply::Integer(3).as_int(), Some(3));
        assert_eq!(bulk("3").as_int(), None);
        assert_eq!(Reply::Array(vec![Reply::Nil]).as_array(), Some(&[Reply::Nil][..]));
    }

    #[test]
    fn skip_frames_counts_whole_frames_only() {
        let mut buf = BytesMut::from(&b"*1\r\n$4\r\nPING\r\n*1\r\n$4\r\nPI"[..]);
        assert_eq!(skip_frames(&mut buf, &DecodeLimits::DEFAULT), Ok(1));
        assert_eq!(&buf[..], b"*1\r\n$4\r\nPI");
    }

    fn arb_reply() -> impl Strategy<Value = Reply> {
        let bytes = proptest::collection::vec(any::<u8>(), 0..40).prop_map(Bytes::from);
        // Simple strings and errors are lines: no CR or LF inside.
        let line = proptest::collection::vec(
            any::<u8>().prop_filter("no CR/LF", |b| *b != b'\r' && *b != b'\n'),
            0..30,
        )
        .prop_map(Bytes::from);
        // Error lines must be UTF-8 for redis-protocol; Redis only sends ASCII there.
        let error_line = "[ -~]{0,30}".prop_map(|s| Bytes::from(s.into_bytes()));
        let leaf = prop_oneof![
            line.prop_map(Reply::Simple),
            error_line.prop_map(Reply::Error),
            any::<i64>().prop_map(Reply::Integer),
            bytes.prop_map(Reply::Bulk),
            Just(Reply::Nil),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            proptest::collection::vec(inner, 0..8).prop_map(Reply::Array)
        })
    }

    proptest! {
        #[test]
        fn command_round_trips_as_the_server_sees_it(
            args in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 1..12)
        ) {
            let refs: Vec<&[u8]> = args.iter().map(|a| a.as_slice()).collect();
            let mut buf = BytesMut::new();
            encode_command(&mut buf, &refs);
            let expected = Reply::Array(args.iter().map(|a| Reply::Bulk(Bytes::copy_from_slice(a))).collect());
            prop_assert_eq!(decode(&mut buf).unwrap(), Some(expected));
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn reply_round_trips_at_every_split(reply in arb_reply(), split_seed in any::<usize>()) {
            let mut encoded = BytesMut::new();
            encode_reply(&mut encoded, &reply);
            let split = split_seed % (encoded.len() + 1);
            let mut buf = BytesMut::from(&encoded[..split]);
            if split < encoded.len() {
                prop_assert_eq!(decode(&mut buf).unwrap(), None);
            }
            buf.extend_from_slice(&encoded[split..]);
            prop_assert_eq!(decode(&mut buf).unwrap(), Some(reply));
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn corrupted_replies_never_panic(reply in arb_reply(), at_seed in any::<usize>(), byte in any::<u8>()) {
            let mut encoded = BytesMut::new();
            encode_reply(&mut encoded, &reply);
            let at = at_seed % encoded.len();
            encoded[at] = byte;
            let before = encoded.len();
            match decode(&mut encoded) {
                Ok(Some(_)) => prop_assert!(encoded.len() < before),
                Ok(None) => prop_assert_eq!(encoded.len(), before),
                Err(_) => {}
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut buf = BytesMut::from(&bytes[..]);
            // Any outcome is fine except a panic; a success must consume something.
            let before = buf.len();
            if let Ok(Some(_)) = decode(&mut buf) {
                prop_assert!(buf.len() < before);
            }
        }
    }

    #[test]
    fn u64_text() {
        for n in [0, 7, 10, 1_234_567_890_123, u64::MAX] {
            assert_eq!(U64Text::new(n).as_bytes(), n.to_string().as_bytes());
        }
    }
}
