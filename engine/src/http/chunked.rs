//! The chunked transfer coding (RFC 9112 section 7.1), strict and bounded.
//!
//! One function, `scan`, both validates (when [`super::parse::parse_request`] needs to
//! know where the body ends) and decodes (when [`super::parse::Body::bytes`] copies the
//! data into the caller's scratch buffer): the same code decides the framing both times,
//! so validation and decoding cannot disagree.
//!
//! Strictness, each rule closing a door a lenient parser leaves open:
//! - chunk size: 1 to [`CHUNK_SIZE_DIGITS_MAX`] hex digits and nothing else — no sign,
//!   no `0x`, no whitespace, followed directly by CRLF or `;`;
//! - chunk extensions: ignored, but only visible ASCII, SP and HTAB, and the whole size
//!   line at most [`CHUNK_LINE_BYTES_MAX`] bytes;
//! - every chunk's data is followed by exactly CRLF;
//! - no trailer fields: the last chunk is followed by exactly CRLF;
//! - the decoded total is bounded by `Bounds::body_bytes_max` (413 as soon as a size
//!   line announces more) and the bytes on the wire by `Bounds::wire_bytes_max`.
//!
//! Not here: the head, `Transfer-Encoding` itself (see `parse.rs`), and any allocation.

use super::limits::Limits;
use super::line::{find_line_end, LineEnd};
use super::rejection::Rejection;

/// Most hex digits in a chunk size. 8 digits reach 4 GiB, far past any body we accept;
/// a longer run is zero padding or an overflow attempt.
pub const CHUNK_SIZE_DIGITS_MAX: usize = 8;

/// Longest chunk-size line (size and extensions, without CRLF).
pub const CHUNK_LINE_BYTES_MAX: usize = 128;

/// The two bounds a scan enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Bounds {
    /// Most decoded bytes.
    pub body_bytes_max: usize,
    /// Most bytes of chunk stream (sizes, extensions, data, CRLFs).
    pub wire_bytes_max: usize,
}

impl Bounds {
    pub(super) fn of(limits: &Limits) -> Bounds {
        Bounds {
            body_bytes_max: limits.body_bytes_max,
            wire_bytes_max: limits.chunked_body_wire_bytes_max(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ChunkedScan {
    /// A valid prefix; more bytes needed.
    Incomplete,
    /// The chunk stream is `wire[..wire_len]` and decodes to `body_len` bytes.
    Complete {
        wire_len: usize,
        body_len: usize,
    },
    Reject(Rejection),
}

/// Scans the chunk stream at the start of `wire`, handing each chunk's data to `sink` in
/// order (only once the chunk and its CRLF are complete).
pub(super) fn scan(wire: &[u8], bounds: Bounds, mut sink: impl FnMut(&[u8])) -> ChunkedScan {
    // Bytes past the wire bound can never belong to an acceptable body: scan without them,
    // and if what remains is not enough, the body is too large.
    let reachable = &wire[..wire.len().min(bounds.wire_bytes_max)];
    match scan_reachable(reachable, bounds.body_bytes_max, &mut sink) {
        ChunkedScan::Incomplete if wire.len() >= bounds.wire_bytes_max => {
            ChunkedScan::Reject(Rejection::BodyTooLarge)
        }
        outcome => outcome,
    }
}

fn scan_reachable(wire: &[u8], body_bytes_max: usize, sink: &mut impl FnMut(&[u8])) -> ChunkedScan {
    let mut pos = 0;
    let mut body_len: usize = 0;
    loop {
        let rest = &wire[pos..];
        let line_len = match find_line_end(rest) {
            LineEnd::Found { len } => len,
            LineEnd::Invalid => return ChunkedScan::Reject(Rejection::InvalidLineEnding),
            LineEnd::Control { .. } => {
                return ChunkedScan::Reject(Rejection::InvalidChunkedEncoding);
            }
            LineEnd::Partial => {
                let partial = rest.strip_suffix(b"\r").unwrap_or(rest);
                return match parse_size_line(partial, LineState::Partial) {
                    Ok(_) => ChunkedScan::Incomplete,
                    Err(rejection) => ChunkedScan::Reject(rejection),
                };
            }
        };
        let size = match parse_size_line(&rest[..line_len], LineState::Complete) {
            Ok(size) => size,
            Err(rejection) => return ChunkedScan::Reject(rejection),
        };
        let budget = (body_bytes_max - body_len) as u64;
        if size > budget {
            return ChunkedScan::Reject(Rejection::BodyTooLarge);
        }
        // `size <= budget <= body_bytes_max`, a usize: the cast is lossless.
        let size = size as usize;
        pos += line_len + 2;
        if size == 0 {
            return finish(wire, pos, body_len);
        }
        let data_end = pos + size;
        match wire.get(data_end..data_end + 2) {
            Some(b"\r\n") => {}
            Some(_) => return ChunkedScan::Reject(Rejection::InvalidChunkedEncoding),
            None => {
                return match wire.get(data_end) {
                    Some(b'\r') | None => ChunkedScan::Incomplete,
                    Some(_) => ChunkedScan::Reject(Rejection::InvalidChunkedEncoding),
                };
            }
        }
        sink(&wire[pos..data_end]);
        body_len += size;
        pos = data_end + 2;
    }
}

/// After the last chunk (`0` line) at `pos`: exactly CRLF, no trailer fields.
fn finish(wire: &[u8], pos: usize, body_len: usize) -> ChunkedScan {
    match wire.get(pos..) {
        Some([b'\r', b'\n', ..]) => ChunkedScan::Complete { wire_len: pos + 2, body_len },
        Some([] | [b'\r']) | None => ChunkedScan::Incomplete,
        Some([b'\r' | b'\n', ..]) => ChunkedScan::Reject(Rejection::InvalidLineEnding),
        Some(_) => ChunkedScan::Reject(Rejection::ChunkedTrailerNotAllowed),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LineState {
    /// The CRLF has arrived: the line must be a whole, valid size line.
    Complete,
    /// Still arriving: refuse only what no continuation could make valid.
    Partial,
}

/// `1*8HEXDIG [ ";" ext ]`; returns the size (0 for a partial line).
fn parse_size_line(line: &[u8], state: LineState) -> Result<u64, Rejection> {
    if line.len() > CHUNK_LINE_BYTES_MAX {
        return Err(Rejection::InvalidChunkedEncoding);
    }
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits > CHUNK_SIZE_DIGITS_MAX {
        return Err(Rejection::InvalidChunkSize);
    }
    match line.get(digits) {
        None if digits == 0 && state == LineState::Complete => {
            return Err(Rejection::InvalidChunkSize);
        }
        None => {}
        Some(b';') if digits > 0 => {
            let extension = &line[digits + 1..];
            if !extension.iter().all(|&b| b == b'\t' || (b' '..=b'~').contains(&b)) {
                return Err(Rejection::InvalidChunkedEncoding);
            }
        }
        Some(_) => return Err(Rejection::InvalidChunkSize),
    }
    // At most 8 hex digits: at most 32 bits, no overflow possible in a u64.
    Ok(line[..digits].iter().fold(0u64, |size, &b| (size << 4) | u64::from(hex_value(b))))
}

fn hex_value(b: u8) -> u8 {
    match b {
        b'0'..=b'9' => b - b'0',
        b'a'..=b'f' => b - b'a' + 10,
        b'A'..=b'F' => b - b'A' + 10,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: Bounds = Bounds { body_bytes_max: 4096, wire_bytes_max: 2 * 4096 + 256 };

    fn decode(wire: &[u8]) -> (ChunkedScan, Vec<u8>) {
        let mut body = Vec::new();
        let outcome = scan(wire, BOUNDS, |data| body.extend_from_slice(data));
        (outcome, body)
    }

    fn rejected(wire: &[u8]) -> Rejection {
        match decode(wire).0 {
            ChunkedScan::Reject(rejection) => rejection,
            other => panic!(
                "expected a rejection for {:?}, got {other:?}",
                String::from_utf8_lossy(wire)
            ),
        }
    }

    #[test]
    fn decodes_several_chunks_and_reports_exact_wire_length() {
        let wire = b"5\r\nhello\r\n1;name=value\r\n \r\nA\r\n0123456789\r\n0\r\n\r\nGET /next";
        let (outcome, body) = decode(wire);
        assert_eq!(outcome, ChunkedScan::Complete { wire_len: wire.len() - 9, body_len: 16 });
        assert_eq!(body, b"hello 0123456789");
    }

    #[test]
    fn empty_body_is_just_the_last_chunk() {
        assert_eq!(decode(b"0\r\n\r\n").0, ChunkedScan::Complete { wire_len: 5, body_len: 0 });
        assert_eq!(decode(b"000\r\n\r\n").0, ChunkedScan::Complete { wire_len: 7, body_len: 0 });
        assert_eq!(decode(b"0;ext\r\n\r\n").0, ChunkedScan::Complete { wire_len: 9, body_len: 0 });
    }

    #[test]
    fn hex_digits_in_either_case() {
        let data = [b'x'; 0xAB];
        let mut wire = b"aB\r\n".to_vec();
        wire.extend_from_slice(&data);
        wire.extend_from_slice(b"\r\n0\r\n\r\n");
        let (outcome, body) = decode(&wire);
        assert_eq!(outcome, ChunkedScan::Complete { wire_len: wire.len(), body_len: 0xAB });
        assert_eq!(body, data);
    }

    #[test]
    fn every_prefix_of_a_valid_stream_is_incomplete() {
        let wire = b"3;a=b\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        for end in 0..wire.len() {
            assert_eq!(decode(&wire[..end]).0, ChunkedScan::Incomplete, "prefix {end}");
        }
        assert_eq!(decode(wire).0, ChunkedScan::Complete { wire_len: wire.len(), body_len: 5 });
    }

    #[test]
    fn strict_chunk_size() {
        for bad in [
            &b"+5\r\nhello\r\n0\r\n\r\n"[..],
            b"-5\r\nhello\r\n0\r\n\r\n",
            b"0x5\r\nhello\r\n0\r\n\r\n",
            b" 5\r\nhello\r\n0\r\n\r\n",
            b"5 \r\nhello\r\n0\r\n\r\n",
            b"5 ;x\r\nhello\r\n0\r\n\r\n",
            b"\r\nhello\r\n0\r\n\r\n",
            b";x\r\nhello\r\n0\r\n\r\n",
            b"g\r\n",
            b"000000005\r\nhello\r\n0\r\n\r\n",
            b"fffffffff\r\n",
        ] {
            assert_eq!(
                rejected(bad),
                Rejection::InvalidChunkSize,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // Refused before the line is even complete.
        assert_eq!(rejected(b"+"), Rejection::InvalidChunkSize);
        assert_eq!(rejected(b"123456789"), Rejection::InvalidChunkSize);
    }

    #[test]
    fn eight_digit_size_is_parsed_then_bounded() {
        assert_eq!(rejected(b"00001001\r\n"), Rejection::BodyTooLarge);
        assert_eq!(rejected(b"ffffffff\r\n"), Rejection::BodyTooLarge);
        assert_eq!(decode(b"00000001\r\nx\r\n0\r\n\r\n").1, b"x");
    }

    #[test]
    fn body_bound_counts_every_chunk() {
        // 4096 in one chunk is fine; 4096 + 1 over two chunks is not.
        let mut wire = b"1000\r\n".to_vec();
        wire.extend_from_slice(&[b'a'; 4096]);
        wire.extend_from_slice(b"\r\n0\r\n\r\n");
        assert_eq!(decode(&wire).0, ChunkedScan::Complete { wire_len: wire.len(), body_len: 4096 });
        let mut wire = b"fff\r\n".to_vec();
        wire.extend_from_slice(&[b'a'; 4095]);
        wire.extend_from_slice(b"\r\n2\r\n");
        assert_eq!(rejected(&wire), Rejection::BodyTooLarge);
    }

    #[test]
    fn wire_bound_stops_tiny_chunks_with_long_extensions() {
        let mut wire = Vec::new();
        while wire.len() < BOUNDS.wire_bytes_max {
            wire.extend_from_slice(b"1;padding-padding-padding-padding\r\nx\r\n");
        }
        assert_eq!(rejected(&wire), Rejection::BodyTooLarge);
    }

    #[test]
    fn extensions_are_bounded_and_visible_ascii() {
        let mut long = b"1;".to_vec();
        long.extend_from_slice(&[b'e'; CHUNK_LINE_BYTES_MAX]);
        assert_eq!(rejected(&long), Rejection::InvalidChunkedEncoding);
        long.extend_from_slice(b"\r\nx\r\n0\r\n\r\n");
        assert_eq!(rejected(&long), Rejection::InvalidChunkedEncoding);
        assert_eq!(rejected(b"1;a\x00b\r\nx\r\n0\r\n\r\n"), Rejection::InvalidChunkedEncoding);
        assert_eq!(rejected(b"1;a\x7fb\r\nx\r\n0\r\n\r\n"), Rejection::InvalidChunkedEncoding);
        assert_eq!(rejected(b"1;\xc3\xa9\r\nx\r\n0\r\n\r\n"), Rejection::InvalidChunkedEncoding);
        // A quoted extension value with spaces and tabs is fine, and ignored.
        let (outcome, body) = decode(b"1;a=\"b c\td\"\r\nx\r\n0\r\n\r\n");
        assert!(matches!(outcome, ChunkedScan::Complete { body_len: 1, .. }));
        assert_eq!(body, b"x");
    }

    #[test]
    fn data_must_be_followed_by_crlf() {
        assert_eq!(rejected(b"3\r\nabcd\r\n0\r\n\r\n"), Rejection::InvalidChunkedEncoding);
        assert_eq!(rejected(b"3\r\nabc\n0\r\n\r\n"), Rejection::InvalidChunkedEncoding);
        assert_eq!(rejected(b"3\r\nabcX"), Rejection::InvalidChunkedEncoding);
        assert_eq!(decode(b"3\r\nab").0, ChunkedScan::Incomplete);
        assert_eq!(decode(b"3\r\nabc\r").0, ChunkedScan::Incomplete);
    }

    #[test]
    fn line_endings_are_crlf_only() {
        assert_eq!(rejected(b"3\nabc\r\n0\r\n\r\n"), Rejection::InvalidLineEnding);
        assert_eq!(rejected(b"3\rabc\r\n0\r\n\r\n"), Rejection::InvalidLineEnding);
        assert_eq!(rejected(b"0\r\n\n"), Rejection::InvalidLineEnding);
        assert_eq!(rejected(b"0\r\n\rX"), Rejection::InvalidLineEnding);
        assert_eq!(rejected(b"0\n\r\n"), Rejection::InvalidLineEnding);
    }

    #[test]
    fn trailers_are_refused() {
        assert_eq!(rejected(b"0\r\nExpires: never\r\n\r\n"), Rejection::ChunkedTrailerNotAllowed);
        assert_eq!(rejected(b"0\r\nX"), Rejection::ChunkedTrailerNotAllowed);
    }
}
