//! Public API request validation (CONTRACT.md 3.2 and 3.3) and the canonical payload hash.
//!
//! What it is:
//! - [`parse_submit`]: the `POST /v1/reservations` body → [`SubmitRequest`], or [`Invalid`]
//!   with the `reason_code` that names the field. The request id is borrowed from the body.
//! - [`parse_query`]: `GET /v1/reservations/{request_id}?activity_id=..&sku_id=..` →
//!   [`QueryRequest`].
//! - [`payload_hash`]: SHA-256 of the canonical (activity, sku, user, quantity), rendered
//!   `sha256:<64 hex>` on the stack; the Redis `reserve` function compares it to tell a retry
//!   from an idempotency conflict.
//!
//! Decisions, with their reasons:
//! - **Unknown body fields are ignored**, as the log schema does (CONTRACT.md 6): clients can
//!   add fields (a client timestamp, a trace hint) before the server knows them, and rolling
//!   upgrades never turn a working client into a 400. A misspelt field cannot slip through,
//!   because every field the engine uses is required. The cost of skipping is bounded by the
//!   4 KiB body (serde_json skips a value without recursion, whatever its depth).
//! - **A known field given twice is `DUPLICATE_FIELD`.** Parsers disagree on which copy wins
//!   (first or last); refusing means a proxy or WAF in front can never see a different
//!   request than the engine.
//! - **Numbers are JSON integers, never strings or floats** (`1.0`, `1e3` and `"10001"` are
//!   refused): ids are 1..=`i64::MAX` (PostgreSQL `bigint`), `quantity` is exactly 1.
//! - **A `request_id` written with JSON escapes is refused.** Its alphabet `[A-Za-z0-9_-]`
//!   never needs an escape, and refusing keeps one spelling per id and lets the id borrow
//!   from the body in every accepted case (no allocation).
//! - **The JSON backend is serde_json**, measured against simd-json on the real ~90-byte body
//!   and a 4 KiB one in `benches/benches/auth_json.rs` (figures in the edge issue's closing
//!   note). [`SubmitFields`] is public so that bench can drive the same validation through
//!   simd-json's serde deserializer.
//!
//! What it is not: HTTP. Routing, the 4 KiB limit's 413, the header limits and the mapping of
//! [`Invalid`] to `400 {"state":"INVALID","reason_code":..}` live in `engine::http`. No I/O.
//!
//! Read next: `auth.rs` (the user id comes from the pass, never the body), `ids.rs`.

use std::fmt;
use std::ops::Deref;

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use sha2::{Digest, Sha256};

use crate::logic::ids::{ActivityId, RequestId, SkuId, UserId};
use flashsale_io::resp::U64Text;

/// Largest submit body (CONTRACT.md 3.2); the HTTP layer answers 413 first, this is the
/// cheap second line for callers that did not.
pub const BODY_LEN_MAX: usize = 4096;

/// The most units one request may ask (CONTRACT.md 3.2; the SKU's own `max_per_buyer`, which
/// Redis checks, is at most this).
pub const QUANTITY_MAX: u32 = flashsale_io::bounds::QUANTITY_MAX;

/// Why a request is `400 INVALID`; [`Invalid::reason_code`] is the client-visible name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalid {
    BodyTooLarge,
    /// Not JSON at all: syntax error, invalid UTF-8, trailing bytes, too deep.
    BodyNotJson,
    /// JSON, but not an object.
    BodyNotObject,
    DuplicateField,
    ActivityIdInvalid,
    SkuIdInvalid,
    RequestIdInvalid,
    QuantityInvalid,
}

impl Invalid {
    pub const fn reason_code(self) -> &'static str {
        match self {
            Invalid::BodyTooLarge => "BODY_TOO_LARGE",
            Invalid::BodyNotJson => "BODY_NOT_JSON",
            Invalid::BodyNotObject => "BODY_NOT_OBJECT",
            Invalid::DuplicateField => "DUPLICATE_FIELD",
            Invalid::ActivityIdInvalid => "ACTIVITY_ID_INVALID",
            Invalid::SkuIdInvalid => "SKU_ID_INVALID",
            Invalid::RequestIdInvalid => "REQUEST_ID_INVALID",
            Invalid::QuantityInvalid => "QUANTITY_INVALID",
        }
    }
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason_code())
    }
}

// ---------------------------------------------------------------------------------------------
// Submit
// ---------------------------------------------------------------------------------------------

/// A valid submit body. The user is not here: it comes from the pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubmitRequest<'a> {
    pub activity_id: ActivityId,
    pub sku_id: SkuId,
    pub request_id: RequestId<'a>,
    pub quantity: u32,
}

impl SubmitRequest<'_> {
    /// The payload hash of this request made by `user_id`.
    pub fn payload_hash(&self, user_id: UserId) -> PayloadHash {
        payload_hash(self.activity_id, self.sku_id, user_id, self.quantity)
    }
}

/// Parses and validates a submit body (see the module docs for the rules). Field errors are
/// reported in a fixed order — duplicate, activity, sku, request id, quantity — and only for
/// a body that is valid JSON throughout.
pub fn parse_submit(body: &[u8]) -> Result<SubmitRequest<'_>, Invalid> {
    if body.len() > BODY_LEN_MAX {
        return Err(Invalid::BodyTooLarge);
    }
    let fields: SubmitFields<'_> = serde_json::from_slice(body).map_err(|error| {
        match error.classify() {
            // Our visitors never fail, so a data error is the top level not being an object.
            serde_json::error::Category::Data => Invalid::BodyNotObject,
            _ => Invalid::BodyNotJson,
        }
    })?;
    fields.validate()
}

/// A JSON value as far as validation needs to know it. Compound values are skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JsonValue<'de> {
    Unsigned(u64),
    Negative,
    Float,
    /// A string borrowed from the input (no escapes with serde_json).
    Str(&'de str),
    /// A string the parser had to unescape into a scratch buffer.
    EscapedStr,
    /// `null`, a bool, an array or an object.
    Other,
}

/// The submit body's fields as the JSON parser saw them, before validation. Deserialize it
/// with any serde backend borrowing from the input, then call [`SubmitFields::validate`].
#[derive(Debug, Default, Clone, Copy)]
pub struct SubmitFields<'de> {
    activity_id: Option<JsonValue<'de>>,
    sku_id: Option<JsonValue<'de>>,
    request_id: Option<JsonValue<'de>>,
    quantity: Option<JsonValue<'de>>,
    duplicate: bool,
}

impl<'de> SubmitFields<'de> {
    /// Applies the field rules.
    pub fn validate(self) -> Result<SubmitRequest<'de>, Invalid> {
        if self.duplicate {
            return Err(Invalid::DuplicateField);
        }
        let activity_id = match self.activity_id {
            Some(JsonValue::Unsigned(value)) => ActivityId::new(value),
            _ => None,
        };
        let sku_id = match self.sku_id {
            Some(JsonValue::Unsigned(value)) => SkuId::new(value),
            _ => None,
        };
        let request_id = match self.request_id {
            Some(JsonValue::Str(text)) => RequestId::parse(text),
            _ => None,
        };
        let quantity = match self.quantity {
            Some(JsonValue::Unsigned(n)) if (1..=u64::from(QUANTITY_MAX)).contains(&n) => {
                u32::try_from(n).ok()
            }
            _ => None,
        };
        Ok(SubmitRequest {
            activity_id: activity_id.ok_or(Invalid::ActivityIdInvalid)?,
            sku_id: sku_id.ok_or(Invalid::SkuIdInvalid)?,
            request_id: request_id.ok_or(Invalid::RequestIdInvalid)?,
            quantity: quantity.ok_or(Invalid::QuantityInvalid)?,
        })
    }
}

impl<'de> Deserialize<'de> for SubmitFields<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(SubmitVisitor)
    }
}

struct SubmitVisitor;

impl<'de> Visitor<'de> for SubmitVisitor {
    type Value = SubmitFields<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = SubmitFields::default();
        // Every entry is read, even after a duplicate, so the whole body must be valid JSON
        // before any field error is reported.
        while let Some(key) = map.next_key::<SubmitKey>()? {
            let slot = match key {
                SubmitKey::ActivityId => &mut fields.activity_id,
                SubmitKey::SkuId => &mut fields.sku_id,
                SubmitKey::RequestId => &mut fields.request_id,
                SubmitKey::Quantity => &mut fields.quantity,
                SubmitKey::Unknown => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            let value = map.next_value::<JsonValue<'de>>()?;
            if slot.is_some() {
                fields.duplicate = true;
            }
            *slot = Some(value);
        }
        Ok(fields)
    }
}

#[derive(Clone, Copy)]
enum SubmitKey {
    ActivityId,
    SkuId,
    RequestId,
    Quantity,
    Unknown,
}

impl<'de> Deserialize<'de> for SubmitKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_str(SubmitKeyVisitor)
    }
}

struct SubmitKeyVisitor;

impl Visitor<'_> for SubmitKeyVisitor {
    type Value = SubmitKey;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    // An escaped key arrives here unescaped; `"sku\u005fid"` is `sku_id` to every JSON
    // parser, so it is to this one too (duplicate detection must agree with other parsers).
    fn visit_str<E: de::Error>(self, key: &str) -> Result<SubmitKey, E> {
        Ok(match key {
            "activity_id" => SubmitKey::ActivityId,
            "sku_id" => SubmitKey::SkuId,
            "request_id" => SubmitKey::RequestId,
            "quantity" => SubmitKey::Quantity,
            _ => SubmitKey::Unknown,
        })
    }
}

impl<'de> Deserialize<'de> for JsonValue<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(JsonValueVisitor)
    }
}

struct JsonValueVisitor;

impl<'de> Visitor<'de> for JsonValueVisitor {
    type Value = JsonValue<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Self::Value, E> {
        Ok(JsonValue::Unsigned(value))
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<Self::Value, E> {
        Ok(u64::try_from(value).map_or(JsonValue::Negative, JsonValue::Unsigned))
    }

    fn visit_u128<E: de::Error>(self, value: u128) -> Result<Self::Value, E> {
        Ok(u64::try_from(value).map_or(JsonValue::Float, JsonValue::Unsigned))
    }

    fn visit_i128<E: de::Error>(self, value: i128) -> Result<Self::Value, E> {
        Ok(u64::try_from(value).map_or(JsonValue::Negative, JsonValue::Unsigned))
    }

    fn visit_f64<E: de::Error>(self, _value: f64) -> Result<Self::Value, E> {
        Ok(JsonValue::Float)
    }

    fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Self::Value, E> {
        Ok(JsonValue::Str(text))
    }

    fn visit_str<E: de::Error>(self, _text: &str) -> Result<Self::Value, E> {
        Ok(JsonValue::EscapedStr)
    }

    fn visit_bool<E: de::Error>(self, _value: bool) -> Result<Self::Value, E> {
        Ok(JsonValue::Other)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(JsonValue::Other)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(JsonValue::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(JsonValue::Other)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(JsonValue::Other)
    }
}

// ---------------------------------------------------------------------------------------------
// Query
// ---------------------------------------------------------------------------------------------

/// A valid `GET /v1/reservations/{request_id}?activity_id=..&sku_id=..`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryRequest<'a> {
    pub request_id: RequestId<'a>,
    pub activity_id: ActivityId,
    pub sku_id: SkuId,
}

/// Validates a query: `path_id` is the `{request_id}` path segment as sent (no slash; no
/// percent-decoding is needed or done, the id alphabet never needs it, so `%` is refused),
/// `query_string` is what follows `?` (without it). Parameter values use the canonical
/// decimal spelling (no sign, no leading zeros, no percent-encoding). Unknown and empty
/// parameters are ignored, as unknown body fields are; a known one twice is
/// `DUPLICATE_FIELD`. The scan is linear and allocation-free; its length is bounded by the
/// HTTP layer's request-line limit.
pub fn parse_query<'a>(path_id: &'a str, query_string: &str) -> Result<QueryRequest<'a>, Invalid> {
    let mut activity: Option<&str> = None;
    let mut sku: Option<&str> = None;
    for pair in query_string.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let slot = match name {
            "activity_id" => &mut activity,
            "sku_id" => &mut sku,
            _ => continue,
        };
        if slot.replace(value).is_some() {
            return Err(Invalid::DuplicateField);
        }
    }
    let request_id = RequestId::parse(path_id).ok_or(Invalid::RequestIdInvalid)?;
    let activity_id = activity
        .and_then(|text| ActivityId::parse_decimal(text.as_bytes()))
        .ok_or(Invalid::ActivityIdInvalid)?;
    let sku_id =
        sku.and_then(|text| SkuId::parse_decimal(text.as_bytes())).ok_or(Invalid::SkuIdInvalid)?;
    Ok(QueryRequest { request_id, activity_id, sku_id })
}

// ---------------------------------------------------------------------------------------------
// Payload hash
// ---------------------------------------------------------------------------------------------

/// Length of `sha256:` + 64 hex digits.
pub const PAYLOAD_HASH_LEN: usize = 7 + 64;

/// `sha256:<64 lowercase hex>` on the stack; derefs to `&str`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PayloadHash {
    bytes: [u8; PAYLOAD_HASH_LEN],
}

impl PayloadHash {
    pub fn as_str(&self) -> &str {
        match std::str::from_utf8(&self.bytes) {
            Ok(text) => text,
            // Built from an ASCII prefix and ASCII hex digits only.
            Err(_) => unreachable!("a payload hash is ASCII"),
        }
    }
}

impl Deref for PayloadHash {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Display for PayloadHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for PayloadHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

/// SHA-256 of the canonical encoding `v1|<activity_id>|<sku_id>|<user_id>|<quantity>`, each
/// number in plain decimal (no sign, no leading zeros), e.g. `v1|10001|20001|30001|1`.
///
/// Unambiguous: every field is a decimal number and `|` is not a digit, so two different
/// tuples never encode to the same bytes; the `v1` tag lets a future encoding change without
/// colliding with stored hashes. The request id is not included because it is the key the
/// hash is stored under (`seckill:{a:s}:req:{user_id}:{request_id}`).
pub fn payload_hash(
    activity_id: ActivityId,
    sku_id: SkuId,
    user_id: UserId,
    quantity: u32,
) -> PayloadHash {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut hasher = Sha256::new();
    hasher.update(b"v1");
    for value in [activity_id.get(), sku_id.get(), user_id.get(), u64::from(quantity)] {
        hasher.update(b"|");
        hasher.update(U64Text::new(value).as_bytes());
    }
    let digest = hasher.finalize();
    let mut bytes = [0u8; PAYLOAD_HASH_LEN];
    bytes[..7].copy_from_slice(b"sha256:");
    for (index, byte) in digest.iter().enumerate() {
        bytes[7 + 2 * index] = HEX[usize::from(byte >> 4)];
        bytes[7 + 2 * index + 1] = HEX[usize::from(byte & 0x0f)];
    }
    PayloadHash { bytes }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BODY: &[u8] =
        br#"{"activity_id": 10001, "sku_id": 20001, "request_id": "req_01J0Z3Q8YB", "quantity": 1}"#;

    fn submit(body: &str) -> Result<SubmitRequest<'_>, Invalid> {
        parse_submit(body.as_bytes())
    }

    fn reason(body: &str) -> Option<&'static str> {
        submit(body).err().map(Invalid::reason_code)
    }

    #[test]
    fn valid_body_borrows_the_request_id() {
        let request = parse_submit(BODY).expect("valid");
        assert_eq!(request.activity_id, ActivityId(10001));
        assert_eq!(request.sku_id, SkuId(20001));
        assert_eq!(request.request_id.as_str(), "req_01J0Z3Q8YB");
        assert_eq!(request.quantity, 1);
        let id = request.request_id.as_str().as_ptr() as usize;
        let body = BODY.as_ptr() as usize;
        assert!(id > body && id < body + BODY.len(), "request id points into the body");
    }

    #[test]
    fn field_order_whitespace_and_unknown_fields_do_not_matter() {
        let body = " {\n\"quantity\":1,\"request_id\":\"r\",\"extra\":{\"a\":[1,2,{\"b\":null}]},\
                    \"sku_id\":2,\"x\":\"\\u00e9\",\"activity_id\":1}\n ";
        let request = submit(body).expect("valid");
        assert_eq!((request.activity_id, request.sku_id), (ActivityId(1), SkuId(2)));
        assert_eq!(request.request_id.as_str(), "r");
        assert!(submit(&format!(
            r#"{{"activity_id":1,"sku_id":2,"request_id":"{}","quantity":1}}"#,
            "a".repeat(64)
        ))
        .is_ok());
        let largest = i64::MAX;
        assert!(submit(&format!(
            r#"{{"activity_id":{largest},"sku_id":{largest},"request_id":"r","quantity":1}}"#
        ))
        .is_ok());
    }

    #[test]
    fn body_level_errors() {
        assert_eq!(reason(""), Some("BODY_NOT_JSON"));
        assert_eq!(reason("{"), Some("BODY_NOT_JSON"));
        assert_eq!(reason(r#"{"activity_id":1,}"#), Some("BODY_NOT_JSON"));
        assert_eq!(reason("{} {}"), Some("BODY_NOT_JSON"));
        assert_eq!(reason("{'a':1}"), Some("BODY_NOT_JSON"));
        assert_eq!(
            reason(&format!("{}{}", "[".repeat(200), "]".repeat(200))),
            Some("BODY_NOT_OBJECT")
        );
        // Skipped values are walked without recursion (serde_json's `IgnoredAny`), so depth
        // costs nothing beyond the 4 KiB bound; unbalanced nesting is still a syntax error.
        let deep = format!(
            r#"{{"x":{}{},"activity_id":1,"sku_id":2,"request_id":"r","quantity":1}}"#,
            "[".repeat(1000),
            "]".repeat(1000)
        );
        assert!(submit(&deep).is_ok());
        let unbalanced = format!(r#"{{"x":{}{}}}"#, "[".repeat(1000), "]".repeat(999));
        assert_eq!(reason(&unbalanced), Some("BODY_NOT_JSON"));
        assert_eq!(reason("[1]"), Some("BODY_NOT_OBJECT"));
        assert_eq!(reason("\"x\""), Some("BODY_NOT_OBJECT"));
        assert_eq!(reason("null"), Some("BODY_NOT_OBJECT"));
        assert_eq!(parse_submit(b"{\"request_id\":\"\xff\"}").err(), Some(Invalid::BodyNotJson));
        let mut big = BODY.to_vec();
        big.resize(BODY_LEN_MAX + 1, b' ');
        assert_eq!(parse_submit(&big).err(), Some(Invalid::BodyTooLarge));
        big.truncate(BODY_LEN_MAX);
        assert!(parse_submit(&big).is_ok(), "4 KiB including trailing whitespace is fine");
    }

    #[test]
    fn syntax_errors_win_over_field_errors() {
        assert_eq!(reason(r#"{"activity_id":0,"sku_id":1,"#), Some("BODY_NOT_JSON"));
        assert_eq!(reason(r#"{"activity_id":1,"activity_id":1,"x":}"#), Some("BODY_NOT_JSON"));
    }

    #[test]
    fn id_fields() {
        let with = |activity: &str, sku: &str| {
            reason(&format!(
                r#"{{"activity_id":{activity},"sku_id":{sku},"request_id":"r","quantity":1}}"#
            ))
        };
        for bad in [
            "0",
            "-1",
            "1.0",
            "1e3",
            "\"10001\"",
            "null",
            "true",
            "[1]",
            "{}",
            "9223372036854775808",
            "18446744073709551616",
        ] {
            assert_eq!(with(bad, "1"), Some("ACTIVITY_ID_INVALID"), "{bad}");
            assert_eq!(with("1", bad), Some("SKU_ID_INVALID"), "{bad}");
        }
        assert_eq!(
            reason(r#"{"sku_id":1,"request_id":"r","quantity":1}"#),
            Some("ACTIVITY_ID_INVALID")
        );
        assert_eq!(
            reason(r#"{"activity_id":1,"request_id":"r","quantity":1}"#),
            Some("SKU_ID_INVALID")
        );
        assert_eq!(reason("{}"), Some("ACTIVITY_ID_INVALID"), "fixed order: activity first");
    }

    #[test]
    fn request_id_field() {
        let with = |id: &str| {
            reason(&format!(r#"{{"activity_id":1,"sku_id":2,"request_id":{id},"quantity":1}}"#))
        };
        let too_long = format!("\"{}\"", "a".repeat(65));
        for bad in [
            "\"\"",
            "\"a b\"",
            "\"a.b\"",
            "\"é\"",
            too_long.as_str(),
            "1",
            "null",
            "[\"a\"]",
            "\"req\\u005f1\"",
            "\"a\\n\"",
        ] {
            assert_eq!(with(bad), Some("REQUEST_ID_INVALID"), "{bad}");
        }
        assert_eq!(
            reason(r#"{"activity_id":1,"sku_id":2,"quantity":1}"#),
            Some("REQUEST_ID_INVALID")
        );
    }

    #[test]
    fn quantity_field() {
        let with = |q: &str| {
            reason(&format!(r#"{{"activity_id":1,"sku_id":2,"request_id":"r","quantity":{q}}}"#))
        };
        for bad in ["0", "101", "-1", "1.0", "\"1\"", "null", "true"] {
            assert_eq!(with(bad), Some("QUANTITY_INVALID"), "{bad}");
        }
        // 1..=QUANTITY_MAX; whether the SKU allows that many is Redis' word (its limit).
        for good in ["1", "2", "100"] {
            assert_eq!(with(good), None, "{good}");
        }
        assert_eq!(
            reason(r#"{"activity_id":1,"sku_id":2,"request_id":"r"}"#),
            Some("QUANTITY_INVALID")
        );
    }

    #[test]
    fn duplicate_known_fields_are_refused_even_when_equal_or_escaped() {
        let body = r#"{"activity_id":1,"sku_id":2,"request_id":"r","quantity":1,"activity_id":1}"#;
        assert_eq!(reason(body), Some("DUPLICATE_FIELD"));
        let escaped =
            r#"{"activity_id":1,"sku_id":2,"request_id":"r","quantity":1,"sku\u005fid":3}"#;
        assert_eq!(reason(escaped), Some("DUPLICATE_FIELD"));
        let unknown_twice =
            r#"{"activity_id":1,"sku_id":2,"request_id":"r","quantity":1,"x":1,"x":2}"#;
        assert!(submit(unknown_twice).is_ok(), "unknown fields are ignored, repeated or not");
    }

    #[test]
    fn query_paths() {
        let query = parse_query("req_1", "activity_id=10001&sku_id=20001").expect("valid");
        assert_eq!(
            query,
            QueryRequest {
                request_id: RequestId::parse("req_1").expect("valid id"),
                activity_id: ActivityId(10001),
                sku_id: SkuId(20001),
            }
        );
        assert!(parse_query("r", "sku_id=2&x=&&activity_id=1&trace").is_ok());
        let cases = [
            ("", "activity_id=1&sku_id=2", Invalid::RequestIdInvalid),
            ("a%5Fb", "activity_id=1&sku_id=2", Invalid::RequestIdInvalid),
            ("a/b", "activity_id=1&sku_id=2", Invalid::RequestIdInvalid),
            ("r", "sku_id=2", Invalid::ActivityIdInvalid),
            ("r", "activity_id&sku_id=2", Invalid::ActivityIdInvalid),
            ("r", "activity_id=&sku_id=2", Invalid::ActivityIdInvalid),
            ("r", "activity_id=01&sku_id=2", Invalid::ActivityIdInvalid),
            ("r", "activity_id=%31&sku_id=2", Invalid::ActivityIdInvalid),
            ("r", "activity_id=+1&sku_id=2", Invalid::ActivityIdInvalid),
            ("r", "activity_id=0&sku_id=2", Invalid::ActivityIdInvalid),
            ("r", "activity_id=1", Invalid::SkuIdInvalid),
            ("r", "activity_id=1&sku_id=9223372036854775808", Invalid::SkuIdInvalid),
            ("r", "activity_id=1&sku_id=2&activity_id=1", Invalid::DuplicateField),
            ("r", "activity_id=1&sku_id=2&sku_id=", Invalid::DuplicateField),
            ("r", "", Invalid::ActivityIdInvalid),
        ];
        for (path_id, query_string, expected) in cases {
            assert_eq!(
                parse_query(path_id, query_string).err(),
                Some(expected),
                "{path_id}?{query_string}"
            );
        }
    }

    #[test]
    fn payload_hash_known_vector() {
        // printf 'v1|10001|20001|30001|1' | sha256sum
        let hash = payload_hash(ActivityId(10001), SkuId(20001), UserId(30001), 1);
        assert_eq!(
            hash.as_str(),
            "sha256:6bd3ef236450f0954d8756cc050775f307731c53624d11b94b5cf696125173bc"
        );
        assert_eq!(hash.len(), PAYLOAD_HASH_LEN);
        let request = parse_submit(BODY).expect("valid");
        assert_eq!(request.payload_hash(UserId(30001)), hash);
        assert_ne!(request.payload_hash(UserId(30002)), hash, "another user, another payload");
    }

    proptest! {
        #[test]
        fn payload_hash_is_sha256_of_the_canonical_text(
            activity in 1..=i64::MAX as u64,
            sku in 1..=i64::MAX as u64,
            user in 1..=i64::MAX as u64,
            quantity in any::<u32>(),
        ) {
            let canonical = format!("v1|{activity}|{sku}|{user}|{quantity}");
            let expected = format!("sha256:{}", hex::encode(Sha256::digest(canonical.as_bytes())));
            let hash = payload_hash(ActivityId(activity), SkuId(sku), UserId(user), quantity);
            prop_assert_eq!(hash.as_str(), expected.as_str());
        }

        #[test]
        fn valid_bodies_round_trip(
            activity in 1..=i64::MAX as u64,
            sku in 1..=i64::MAX as u64,
            request_id in "[A-Za-z0-9_-]{1,64}",
        ) {
            let body = serde_json::json!({
                "activity_id": activity, "sku_id": sku, "request_id": request_id, "quantity": 1,
            }).to_string();
            let request = parse_submit(body.as_bytes());
            prop_assert_eq!(request.map(|r| (r.activity_id, r.sku_id, r.request_id.as_str())),
                Ok((ActivityId(activity), SkuId(sku), request_id.as_str())));
        }

        #[test]
        fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_submit(&body);
            if let Ok(text) = std::str::from_utf8(&body) {
                let _ = parse_query(text, text);
            }
        }
    }
}
