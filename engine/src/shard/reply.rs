//! The answers every handler shares: a state answer (head + flat JSON body) written through
//! the shard's JSON scratch, and the admin plane's small `{"state","reason_code"}` errors.
//!
//! Not here: the table from outcomes to HTTP states (`logic::outcome`), the HTTP writer
//! (`http::response`).

use bytes::BytesMut;
use serde_json::json;

use crate::http::{write_response, ResponseHead, StateBody, Status};

thread_local! {
    /// This shard's JSON scratch (one thread per shard): an answer's body is built here and
    /// then written after its head, so no answer allocates once the buffer has grown.
    static JSON_SCRATCH: std::cell::RefCell<BytesMut> =
        std::cell::RefCell::new(BytesMut::with_capacity(512));
}

/// Writes a state answer (head + flat JSON body) into the connection's buffer.
pub fn write_state(out: &mut BytesMut, head: &ResponseHead<'_>, body: &StateBody<'_>) {
    JSON_SCRATCH.with(|cell| {
        let mut json = cell.borrow_mut();
        json.clear();
        body.write_json(&mut json);
        write_response(out, head, &json);
    });
}

/// An admin-plane refusal: `status` with `{"state":"INVALID","reason_code":reason}`.
pub fn error(status: Status, reason: &str) -> (Status, String) {
    (status, json!({"state": "INVALID", "reason_code": reason}).to_string())
}

/// No route for the path.
pub fn not_found() -> (Status, String) {
    (Status::NotFound, r#"{"state":"INVALID","reason_code":"NO_SUCH_ROUTE"}"#.to_owned())
}
