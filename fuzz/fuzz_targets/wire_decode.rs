//! Fuzzes the message decoders of `io::wire`: `decode_order_create` (every order-create
//! message the order writer reads) and `decode_event` (every outbox event `redis-sync`
//! applies). The first byte picks which.
//!
//! Checks: no panic on any bytes; a message that decodes encodes back to a body that
//! decodes to the same message (the writer and the reader agree on the schema).
//!
//! Run: `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run wire_decode -- -max_total_time=120`

#![no_main]

use flashsale_io::wire::{decode_event, decode_order_create};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else { return };
    if which & 1 == 0 {
        if let Ok(message) = decode_order_create(body) {
            let again = decode_order_create(&message.encode()).expect("re-encoded message decodes");
            assert_eq!(again, message);
        }
    } else if let Ok(event) = decode_event(body) {
        let again = decode_event(&event.encode()).expect("re-encoded event decodes");
        assert_eq!(again, event);
    }
});
