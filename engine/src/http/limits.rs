//! The bounds on one request ([`Limits`]): request line, header count, head and body size,
//! chunk framing on the wire, and the pipelining depth the connection loop takes from here,
//! with the relations between them checked at compile time ([`Limits::DEFAULT`]) or once at
//! start-up ([`Limits::validate`]).
//!
//! Not here: enforcing them (`parse.rs` for the head and the body, `chunked.rs` for the chunk
//! stream, the connection loop in `engine::shard` for the depth). Both parsers import this
//! file, and it imports neither.

/// Number of `httparse::Header` slots on the stack (left uninitialised until parsed). [`Limits::headers_max`] may not exceed
/// it ([`Limits::validate`]); the pre-scan rejects a 65th header line before `httparse`
/// ever runs out of slots.
pub const HEADER_SLOTS: usize = 64;

/// Limits on one request. The connection loop also takes [`Limits::pipeline_depth_max`]
/// from here so that every bound on a request lives in one struct.
///
/// Validate a non-default value once at start-up with [`Limits::validate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest request line (method, target, version; without CRLF). Beyond: 414.
    pub request_line_bytes_max: usize,
    /// Most header lines. Beyond: 431. At most [`HEADER_SLOTS`].
    pub headers_max: usize,
    /// Longest head: leading empty lines, request line, header lines and the blank line,
    /// all CRLFs included. Beyond: 431.
    pub header_section_bytes_max: usize,
    /// Largest (decoded) body. Beyond: 413.
    pub body_bytes_max: usize,
    /// Most requests a connection parses ahead of its answers. Not used by the parser;
    /// the connection stops reading (leaves bytes in its buffer) at this depth.
    pub pipeline_depth_max: usize,
}

/// Extra bytes allowed on the wire for chunk framing on top of twice the body limit
/// (see [`Limits::chunked_body_wire_bytes_max`]).
const CHUNKED_FRAMING_BYTES_EXTRA: usize = 256;

/// Largest `body_bytes_max` [`Limits::validate`] accepts: keeps every sum below in
/// `usize` without thinking, and a body this size is already far beyond the API's needs.
const BODY_BYTES_MAX_CEILING: usize = 1 << 24;

impl Limits {
    /// The edge's limits (issue 3, item 2).
    pub const DEFAULT: Limits = Limits {
        request_line_bytes_max: 8192,
        headers_max: 64,
        header_section_bytes_max: 16384,
        body_bytes_max: 4096,
        pipeline_depth_max: 16,
    };

    /// Checks the relations between the limits. The parser relies on them: a request
    /// line longer than the header section could never yield 414, more headers than
    /// [`HEADER_SLOTS`] would overflow the stack array, a zero pipeline depth would never
    /// serve anything.
    pub const fn validate(&self) -> Result<(), &'static str> {
        if self.request_line_bytes_max == 0 {
            return Err("request_line_bytes_max must be at least 1");
        }
        if self.request_line_bytes_max > self.header_section_bytes_max {
            return Err("request_line_bytes_max must not exceed header_section_bytes_max");
        }
        if self.headers_max == 0 || self.headers_max > HEADER_SLOTS {
            return Err("headers_max must be in 1..=HEADER_SLOTS (64)");
        }
        if self.body_bytes_max > BODY_BYTES_MAX_CEILING {
            return Err("body_bytes_max must not exceed 16 MiB");
        }
        if self.pipeline_depth_max == 0 {
            return Err("pipeline_depth_max must be at least 1");
        }
        Ok(())
    }

    /// Most bytes a chunked body may take on the wire, framing included. Bounded so that
    /// one request can never need more buffer than [`Limits::request_bytes_max`], even if
    /// it sends its 4 KiB in one-byte chunks with long extensions.
    pub const fn chunked_body_wire_bytes_max(&self) -> usize {
        2 * self.body_bytes_max + CHUNKED_FRAMING_BYTES_EXTRA
    }

    /// Most bytes one complete request can occupy in the connection's buffer. A read
    /// buffer of this size (times nothing: pipelined requests are consumed as parsed)
    /// always has room for the request being parsed.
    pub const fn request_bytes_max(&self) -> usize {
        self.header_section_bytes_max + self.chunked_body_wire_bytes_max()
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

const _: () = match Limits::DEFAULT.validate() {
    Ok(()) => (),
    Err(_) => panic!("Limits::DEFAULT breaks Limits::validate"),
};
// Spelled out as well, so that the relations the issue names are visible here.
const _: () =
    assert!(Limits::DEFAULT.request_line_bytes_max <= Limits::DEFAULT.header_section_bytes_max);
const _: () = assert!(Limits::DEFAULT.headers_max <= HEADER_SLOTS);
const _: () =
    assert!(Limits::DEFAULT.body_bytes_max <= Limits::DEFAULT.chunked_body_wire_bytes_max());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_validation() {
        assert_eq!(Limits::default(), Limits::DEFAULT);
        assert_eq!(Limits::DEFAULT.validate(), Ok(()));
        assert_eq!(Limits::DEFAULT.request_bytes_max(), 16384 + 2 * 4096 + 256);
        let bad = [
            Limits { request_line_bytes_max: 0, ..Limits::DEFAULT },
            Limits { request_line_bytes_max: 16385, ..Limits::DEFAULT },
            Limits { headers_max: 0, ..Limits::DEFAULT },
            Limits { headers_max: HEADER_SLOTS + 1, ..Limits::DEFAULT },
            Limits { body_bytes_max: BODY_BYTES_MAX_CEILING + 1, ..Limits::DEFAULT },
            Limits { pipeline_depth_max: 0, ..Limits::DEFAULT },
        ];
        for limits in bad {
            assert!(limits.validate().is_err(), "{limits:?}");
        }
    }
}
