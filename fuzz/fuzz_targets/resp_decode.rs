//! Fuzzes `io::resp::decode` (the RESP2 decoder every Redis reply goes through) the way the
//! connection drives it: bytes arrive in two reads, replies are decoded until "not enough
//! bytes yet", the first byte picks where the first read ends.
//!
//! Checks: the allocation-free pre-scan (`scan`) and the decoder agree on where a frame ends
//! (the decoder reports a disagreement as an error, which must never happen); a decoded
//! reply re-encoded by `encode_reply` decodes to the same reply and the same length; a
//! frame found in a prefix is found the same with more bytes; nothing is consumed on "not
//! enough bytes yet".
//!
//! Run: `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run resp_decode -- -max_total_time=120`

#![no_main]

use bytes::BytesMut;
use flashsale_io::resp::{decode, encode_reply, scan, DecodeLimits, ProtocolError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&split, input)) = data.split_first() else { return };
    let first_read = usize::from(split) * input.len() / 255;
    let limits = DecodeLimits::DEFAULT;
    let mut buf = BytesMut::new();
    let mut fed = 0;
    for received in [first_read, input.len()] {
        buf.extend_from_slice(&input[fed..received]);
        fed = received;
        loop {
            let before = buf.clone();
            let scanned = scan(&before, &limits);
            match decode(&mut buf) {
                Ok(Some(reply)) => {
                    let Ok(Some(frame_len)) = scanned else {
                        panic!("decoded a reply the pre-scan did not find: {scanned:?}");
                    };
                    assert_eq!(before.len() - buf.len(), frame_len);
                    let mut encoded = BytesMut::new();
                    encode_reply(&mut encoded, &reply);
                    let again = decode(&mut encoded).expect("re-encoded reply decodes");
                    assert_eq!(again.as_ref(), Some(&reply));
                    assert!(encoded.is_empty(), "the re-encoded reply is one frame");
                }
                Ok(None) => {
                    assert_eq!(scanned, Ok(None));
                    assert_eq!(buf, before, "nothing consumed while incomplete");
                    break;
                }
                Err(ProtocolError::Decoder(message)) => {
                    panic!("pre-scan and decoder disagree: {message}");
                }
                Err(_) => {
                    assert!(scanned.is_err(), "a limit the pre-scan did not see");
                    return;
                }
            }
        }
    }
});
