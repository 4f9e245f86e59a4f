//! Fuzzes the public API's input validation (`engine::logic::api`): `parse_submit` on the
//! request body and `parse_query` on the query's path id and query string (the first byte
//! picks where the input splits into the two).
//!
//! Checks: no panic; an accepted submit has a request id of 1-64 `[A-Za-z0-9_-]` and
//! quantity 1 (CONTRACT.md 3.2), and re-serialised canonically it parses to the same
//! request; an accepted query has a request id in the same alphabet.
//!
//! Run: `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run api_body -- -max_total_time=120`

#![no_main]

use flashsale_engine::logic::api::{parse_query, parse_submit};
use libfuzzer_sys::fuzz_target;

fn valid_request_id(id: &str) -> bool {
    (1..=64).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fuzz_target!(|data: &[u8]| {
    if let Ok(submit) = parse_submit(data) {
        assert!(valid_request_id(submit.request_id.as_str()));
        assert_eq!(submit.quantity, 1);
        let canonical = format!(
            r#"{{"activity_id":{},"sku_id":{},"request_id":"{}","quantity":1}}"#,
            submit.activity_id.0,
            submit.sku_id.0,
            submit.request_id.as_str()
        );
        let again = parse_submit(canonical.as_bytes()).expect("the canonical form parses");
        assert_eq!(again, submit);
    }
    let Some((&split, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let mut cut = usize::from(split) * text.len() / 255;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let (path_id, query) = text.split_at(cut);
    if let Ok(query) = parse_query(path_id, query) {
        assert!(valid_request_id(query.request_id.as_str()));
    }
});
