//! Fuzzes `engine::http::parse_request` the way the connection loop drives it: the input
//! arrives in two reads (the first byte chooses where the first read ends), and after
//! each read the loop parses pipelined requests until `Incomplete`, advancing by
//! `consumed`, stopping at a rejection or at a request without keep-alive.
//!
//! Beyond "no panic", it checks the properties the connection relies on: `consumed` is
//! never zero nor past the bytes received; a request found in a prefix is the same
//! request once more bytes arrive; a prefix that is refused stays refused; a decoded body
//! has the announced length, within the limit; every rejection closes and can be written.
//!
//! Run (stable toolchain): `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run http_parse -- -max_total_time=60`

#![no_main]

use bytes::BytesMut;
use flashsale_engine::http::{parse_request, write_rejection, Limits, Parsed};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&split_byte, input)) = data.split_first() else {
        return;
    };
    let limits = Limits::DEFAULT;
    let first_read_len = usize::from(split_byte) * input.len() / 255;
    let mut scratch = Vec::with_capacity(limits.body_bytes_max);
    let mut out = BytesMut::with_capacity(1024);
    let mut offset = 0;
    for received in [first_read_len, input.len()] {
        loop {
            let unconsumed = &input[offset..received];
            match parse_request(unconsumed, &limits) {
                Parsed::Incomplete => break,
                Parsed::Reject(rejection) => {
                    assert!(rejection.close_connection());
                    // Refused on a prefix: refused with everything that follows too.
                    assert!(matches!(parse_request(&input[offset..], &limits), Parsed::Reject(_)));
                    write_rejection(&mut out, rejection, "fuzz");
                    return;
                }
                Parsed::Complete { request, consumed } => {
                    assert!(consumed > 0 && consumed <= unconsumed.len());
                    // The same request, however much arrives after it.
                    let with_rest = parse_request(&input[offset..], &limits);
                    assert_eq!(with_rest, Parsed::Complete { request: request.clone(), consumed });
                    let exact = parse_request(&unconsumed[..consumed], &limits);
                    assert_eq!(exact, Parsed::Complete { request: request.clone(), consumed });
                    let body = request.body.bytes(&mut scratch);
                    assert_eq!(body.len(), request.body.len());
                    assert!(body.len() <= limits.body_bytes_max);
                    offset += consumed;
                    if !request.keep_alive {
                        return;
                    }
                }
            }
        }
    }
});
