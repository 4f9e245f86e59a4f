//! Property tests for the HTTP layer: arbitrary bytes never panic or over-consume, and
//! generated valid requests (random headers, Content-Length or chunked framing) parse
//! back to the same body with the exact `consumed`, whatever follows them.

use proptest::prelude::*;

use super::limits::Limits;
use super::parse::{parse_request, Parsed};

const LIMITS: Limits = Limits::DEFAULT;

/// Header names the parser interprets; generated extra headers avoid them.
const SPECIAL_NAMES: [&str; 9] = [
    "expect",
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "authorization",
    "x-request-id",
    "traceparent",
    "content-type",
];

fn header_name() -> impl Strategy<Value = String> {
    "[A-Za-z0-9!#$%&'*+.^_`|~-]{1,24}".prop_filter("not a header the parser interprets", |name| {
        !SPECIAL_NAMES.contains(&name.to_ascii_lowercase().as_str())
    })
}

/// Visible ASCII with inner spaces; no leading or trailing whitespace (it would be
/// trimmed, which is fine but makes the value comparison noisier).
fn header_value() -> impl Strategy<Value = String> {
    "([!-~]([ !-~]{0,60}[!-~])?)?"
}

#[derive(Debug, Clone)]
enum Framing {
    ContentLength,
    /// Chunk sizes to cut the body into (cycled), and whether to add an extension. Chunks
    /// of at least 32 bytes keep the framing within `chunked_body_wire_bytes_max`.
    Chunked {
        cuts: Vec<usize>,
        extension: bool,
    },
}

fn framing() -> impl Strategy<Value = Framing> {
    prop_oneof![
        Just(Framing::ContentLength),
        (prop::collection::vec(32usize..600, 1..8), any::<bool>())
            .prop_map(|(cuts, extension)| Framing::Chunked { cuts, extension }),
    ]
}

fn encode_request(headers: &[(String, String)], body: &[u8], framing: &Framing) -> Vec<u8> {
    let mut buf = b"POST /v1/reservations?x=1 HTTP/1.1\r\nHost: edge\r\n".to_vec();
    for (name, value) in headers {
        buf.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    match framing {
        Framing::ContentLength => {
            buf.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
            buf.extend_from_slice(body);
        }
        Framing::Chunked { cuts, extension } => {
            buf.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
            let mut rest = body;
            let mut cut = cuts.iter().cycle();
            while !rest.is_empty() {
                let size = cut.next().copied().unwrap_or(1).min(rest.len());
                let ext = if *extension { ";name=\"v a l\"" } else { "" };
                buf.extend_from_slice(format!("{size:x}{ext}\r\n").as_bytes());
                buf.extend_from_slice(&rest[..size]);
                buf.extend_from_slice(b"\r\n");
                rest = &rest[size..];
            }
            buf.extend_from_slice(b"0\r\n\r\n");
        }
    }
    buf
}

fn valid_request() -> impl Strategy<Value = (Vec<u8>, Vec<u8>)> {
    (
        prop::collection::vec((header_name(), header_value()), 0..60),
        prop::collection::vec(any::<u8>(), 0..=4096),
        framing(),
    )
        .prop_map(|(headers, body, framing)| (encode_request(&headers, &body, &framing), body))
}

proptest! {
    // No failure persistence: a regression file would land in the crate directory; a
    // failure prints its minimal input, which belongs in a unit test.
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic_nor_over_consume(buf in prop::collection::vec(any::<u8>(), 0..2048)) {
        if let Parsed::Complete { consumed, .. } = parse_request(&buf, &LIMITS) {
            prop_assert!(consumed > 0 && consumed <= buf.len());
        }
    }

    #[test]
    fn plausible_heads_with_random_tails_never_panic(
        prefix in prop::sample::select(vec![
            "POST / HTTP/1.1\r\nHost: h\r\n",
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\n",
            "GET / HTTP/1.0\r\n",
            "\r\n",
        ]),
        tail in prop::collection::vec(
            prop_oneof![Just(b'\r'), Just(b'\n'), Just(b':'), Just(b' '), Just(b'0'), Just(b';'), any::<u8>()],
            0..512,
        ),
    ) {
        let buf = [prefix.as_bytes(), &tail].concat();
        let mut offset = 0;
        // The connection's loop: parse while complete, advance by `consumed`.
        while let Parsed::Complete { consumed, .. } = parse_request(&buf[offset..], &LIMITS) {
            prop_assert!(consumed > 0 && offset + consumed <= buf.len());
            offset += consumed;
        }
    }

    #[test]
    fn valid_requests_round_trip_their_body(
        (request_bytes, body) in valid_request(),
        garbage in prop::collection::vec(any::<u8>(), 0..64),
        cut_seed in any::<prop::sample::Index>(),
    ) {
        let mut scratch = Vec::with_capacity(LIMITS.body_bytes_max);
        match parse_request(&request_bytes, &LIMITS) {
            Parsed::Complete { request, consumed } => {
                prop_assert_eq!(consumed, request_bytes.len());
                prop_assert_eq!(request.body.len(), body.len());
                prop_assert_eq!(request.body.bytes(&mut scratch), &body[..]);
                prop_assert_eq!(request.path, "/v1/reservations");
            }
            other => prop_assert!(false, "valid request not parsed: {:?}", other),
        }
        // Whatever follows does not change the first request.
        let followed = [&request_bytes[..], &garbage].concat();
        match parse_request(&followed, &LIMITS) {
            Parsed::Complete { request, consumed } => {
                prop_assert_eq!(consumed, request_bytes.len());
                prop_assert_eq!(request.body.bytes(&mut scratch), &body[..]);
            }
            other => prop_assert!(false, "valid request followed by garbage not parsed: {:?}", other),
        }
        // A strict prefix is never complete.
        let cut = cut_seed.index(request_bytes.len());
        prop_assert_eq!(parse_request(&request_bytes[..cut], &LIMITS), Parsed::Incomplete);
    }

    #[test]
    fn pipelined_valid_requests_parse_in_order(
        requests in prop::collection::vec(valid_request(), 1..6),
    ) {
        let buf: Vec<u8> = requests.iter().flat_map(|(bytes, _)| bytes.iter().copied()).collect();
        let mut offset = 0;
        let mut scratch = Vec::new();
        for (bytes, body) in &requests {
            match parse_request(&buf[offset..], &LIMITS) {
                Parsed::Complete { request, consumed } => {
                    prop_assert_eq!(consumed, bytes.len());
                    prop_assert_eq!(request.body.bytes(&mut scratch), &body[..]);
                    offset += consumed;
                }
                other => prop_assert!(false, "pipelined request not parsed: {:?}", other),
            }
        }
        prop_assert_eq!(offset, buf.len());
        prop_assert_eq!(parse_request(&buf[offset..], &LIMITS), Parsed::Incomplete);
    }
}
