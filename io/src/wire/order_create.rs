//! The order-create message (CONTRACT.md section 6) the edge publishes to
//! `seckill.order.create`: [`OrderCreate`], built by ONE constructor from the facts a
//! reservation fixed ([`ReservationFacts`]) so that a republish carries the same business ids,
//! its JSON body, its validation, the order id it becomes, and [`decode_order_create`] for the
//! worker.
//!
//! What it is not: I/O (publishing is `jetstream/publisher.rs`), nor the decision of what
//! becomes of the message (the worker's `classify.rs` and `plan.rs`).
//!
//! Read next: `event.rs` (what the worker announces back), `pg-worker/src/order_writer.rs`.

use serde::{Deserialize, Serialize};

use super::decode::{check_bigint, check_id, invalid, newer_schema, DecodeError, SCHEMA_VERSION};
use super::rfc3339::rfc3339_ms;

/// `event_type` of every order-create message.
pub const ORDER_CREATE_EVENT_TYPE: &str = "SECKILL_ORDER_CREATE_REQUESTED";

/// Largest order-create body accepted. A real one is about 500 bytes; anything much larger is
/// not ours, and bounding it bounds what a poisoned message can cost the worker.
pub const ORDER_CREATE_BODY_MAX: usize = 4096;

/// The prefix every reservation id carries (CONTRACT.md section 7). The worker derives the
/// order id from it (`resv_X` → `ord_X`), which is only injective if every id has it.
pub const RESERVATION_ID_PREFIX: &str = "resv_";

/// Prefix of order ids.
pub const ORDER_ID_PREFIX: &str = "ord_";

/// The order-create message (CONTRACT.md section 6). Times are milliseconds since the Unix
/// epoch in memory and RFC 3339 text (`2026-06-25T19:00:00.123Z`) on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderCreate {
    pub schema_version: u32,
    /// Always [`ORDER_CREATE_EVENT_TYPE`].
    pub event_type: String,
    /// `msg_…`; the `Nats-Msg-Id` of every (re)publish and the inbox key.
    pub message_id: String,
    /// The partitioning key (the reservation id).
    pub message_key: String,
    pub request_id: String,
    /// `resv_…`.
    pub reservation_id: String,
    pub activity_id: u64,
    pub sku_id: u64,
    pub user_id: u64,
    /// Must be 1 (CONTRACT.md 3.2).
    pub quantity: u32,
    #[serde(rename = "reserved_at", with = "rfc3339_ms")]
    pub reserved_at_ms: u64,
    #[serde(rename = "reservation_expires_at", with = "rfc3339_ms")]
    pub reservation_expires_at_ms: u64,
    /// How often the scanner republished it (observation only).
    pub retry_count: u32,
    /// `sha256:…` of the request payload; `redis-sync` needs it to recreate a lost `req`.
    pub payload_hash: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    #[serde(rename = "created_at", with = "rfc3339_ms")]
    pub created_at_ms: u64,
}

/// Everything a reservation fixed when it was made, from which its order-create message is
/// built: on the first publish from `reserve`'s answer, on a republish from the `resv`
/// record. The same facts give the same message in every business id.
#[derive(Debug, Clone, Copy)]
pub struct ReservationFacts<'a> {
    pub message_id: &'a str,
    pub reservation_id: &'a str,
    pub request_id: &'a str,
    pub activity_id: u64,
    pub sku_id: u64,
    pub user_id: u64,
    /// The units reserved.
    pub quantity: u32,
    pub reserved_at_ms: u64,
    pub expires_at_ms: u64,
    pub payload_hash: &'a str,
    pub traceparent: Option<&'a str>,
    /// How often it was sent before (0 on the first publish).
    pub send_attempts: u32,
}

impl OrderCreate {
    /// THE constructor of the order-create message (first publish and every republish).
    pub fn for_reservation(facts: &ReservationFacts<'_>, now_ms: u64) -> OrderCreate {
        OrderCreate {
            schema_version: SCHEMA_VERSION,
            event_type: ORDER_CREATE_EVENT_TYPE.to_owned(),
            message_id: facts.message_id.to_owned(),
            message_key: facts.reservation_id.to_owned(),
            request_id: facts.request_id.to_owned(),
            reservation_id: facts.reservation_id.to_owned(),
            activity_id: facts.activity_id,
            sku_id: facts.sku_id,
            user_id: facts.user_id,
            quantity: facts.quantity,
            reserved_at_ms: facts.reserved_at_ms,
            reservation_expires_at_ms: facts.expires_at_ms,
            retry_count: facts.send_attempts,
            payload_hash: facts.payload_hash.to_owned(),
            traceparent: facts.traceparent.map(str::to_owned),
            created_at_ms: now_ms,
        }
    }

    /// The JSON body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(512);
        self.encode_into(&mut out);
        out
    }

    /// Appends the JSON body to `out` (reuse one buffer per publisher).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        // Serializing a struct of strings and integers into a Vec cannot fail.
        if let Err(e) = serde_json::to_writer(&mut *out, self) {
            unreachable!("serializing OrderCreate into memory failed: {e}");
        }
    }

    /// Checks every field against the contract. [`decode_order_create`] calls it; a producer
    /// should call it before publishing.
    pub fn validate(&self) -> Result<(), DecodeError> {
        if self.schema_version == 0 {
            return Err(invalid("schema_version", "must be at least 1"));
        }
        if self.event_type != ORDER_CREATE_EVENT_TYPE {
            return Err(invalid("event_type", "must be SECKILL_ORDER_CREATE_REQUESTED"));
        }
        check_id(&self.message_id, "message_id")?;
        check_id(&self.message_key, "message_key")?;
        check_id(&self.request_id, "request_id")?;
        check_id(&self.reservation_id, "reservation_id")?;
        if !self.reservation_id.starts_with(RESERVATION_ID_PREFIX)
            || self.reservation_id.len() == RESERVATION_ID_PREFIX.len()
        {
            return Err(invalid("reservation_id", "must be resv_ followed by an id"));
        }
        check_bigint(self.activity_id, "activity_id")?;
        check_bigint(self.sku_id, "sku_id")?;
        check_bigint(self.user_id, "user_id")?;
        if !(1..=crate::bounds::QUANTITY_MAX).contains(&self.quantity) {
            return Err(invalid("quantity", "must be 1..=QUANTITY_MAX"));
        }
        if self.reservation_expires_at_ms <= self.reserved_at_ms {
            return Err(invalid("reservation_expires_at", "must be after reserved_at"));
        }
        check_id(&self.payload_hash, "payload_hash")?;
        if let Some(traceparent) = &self.traceparent {
            check_id(traceparent, "traceparent")?;
        }
        Ok(())
    }

    /// The id of the order this reservation becomes: `resv_X` → `ord_X`. Deterministic, so a
    /// retried transaction never mints a second business id for one reservation (DESIGN.md
    /// section 2), and injective because every reservation id carries the `resv_` prefix
    /// (checked by [`OrderCreate::validate`]).
    pub fn order_id(&self) -> String {
        let suffix =
            self.reservation_id.strip_prefix(RESERVATION_ID_PREFIX).unwrap_or(&self.reservation_id);
        let mut id = String::with_capacity(ORDER_ID_PREFIX.len() + suffix.len());
        id.push_str(ORDER_ID_PREFIX);
        id.push_str(suffix);
        id
    }
}

/// Decodes and validates an order-create body. Errors are permanent (see [`DecodeError`]).
pub fn decode_order_create(body: &[u8]) -> Result<OrderCreate, DecodeError> {
    if body.len() > ORDER_CREATE_BODY_MAX {
        return Err(DecodeError::TooLarge { len: body.len(), max: ORDER_CREATE_BODY_MAX });
    }
    match serde_json::from_slice::<OrderCreate>(body) {
        Ok(message) => {
            if u64::from(message.schema_version) > u64::from(SCHEMA_VERSION) {
                return Err(DecodeError::UnknownSchema {
                    version: u64::from(message.schema_version),
                });
            }
            message.validate()?;
            Ok(message)
        }
        Err(e) => Err(newer_schema(body).unwrap_or_else(|| DecodeError::Malformed(e.to_string()))),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::decode::ID_LEN_MAX;
    use super::*;

    /// 2026-06-25T19:00:00.123Z
    pub(crate) const T0: u64 = 1_782_414_000_123;

    pub(crate) fn sample() -> OrderCreate {
        OrderCreate {
            schema_version: 1,
            event_type: ORDER_CREATE_EVENT_TYPE.to_owned(),
            message_id: "msg_01J0Z3Q8YB3W5M2N7K4T9R6P1C".to_owned(),
            message_key: "resv_01J0Z3Q8YB3W5M2N7K4T9R6P1D".to_owned(),
            request_id: "req_1".to_owned(),
            reservation_id: "resv_01J0Z3Q8YB3W5M2N7K4T9R6P1D".to_owned(),
            activity_id: 10001,
            sku_id: 20001,
            user_id: 30001,
            quantity: 1,
            reserved_at_ms: T0,
            reservation_expires_at_ms: T0 + 300_000,
            retry_count: 0,
            payload_hash: "sha256:abc".to_owned(),
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            created_at_ms: T0 + 1,
        }
    }

    #[test]
    fn the_contract_example_decodes() {
        let body = br#"{"schema_version":1, "event_type":"SECKILL_ORDER_CREATE_REQUESTED",
 "message_id":"msg_1", "message_key":"resv_1", "request_id":"r1", "reservation_id":"resv_1",
 "activity_id":10001, "sku_id":20001, "user_id":30001, "quantity":1,
 "reserved_at":"2026-06-25T19:00:00.123Z", "reservation_expires_at":"2026-06-25T19:05:00Z",
 "retry_count":0, "payload_hash":"sha256:00", "traceparent":"00-ab-cd-01",
 "created_at":"2026-06-25T19:00:00.124Z", "a_field_from_the_future": {"x": [1, 2]}}"#;
        let m = decode_order_create(body).expect("decodes");
        assert_eq!(m.reserved_at_ms, T0);
        assert_eq!(m.reservation_expires_at_ms, T0 - 123 + 300_000);
        assert_eq!(m.created_at_ms, T0 + 1);
        assert_eq!(m.user_id, 30001);
        assert_eq!(m.order_id(), "ord_1");
    }

    #[test]
    fn encode_decode_round_trip() {
        let m = sample();
        let body = m.encode();
        assert_eq!(decode_order_create(&body), Ok(m.clone()));
        let text = String::from_utf8(body).expect("utf8");
        assert!(text.contains(r#""reserved_at":"2026-06-25T19:00:00.123Z""#), "{text}");
        let mut no_trace = m;
        no_trace.traceparent = None;
        let body = no_trace.encode();
        assert!(!String::from_utf8_lossy(&body).contains("traceparent"));
        assert_eq!(decode_order_create(&body), Ok(no_trace));
    }

    #[test]
    fn a_newer_schema_is_its_own_error() {
        let mut m = sample();
        m.schema_version = 2;
        assert_eq!(
            decode_order_create(&m.encode()),
            Err(DecodeError::UnknownSchema { version: 2 })
        );
        // Even when the new schema changed the shape beyond recognition.
        assert_eq!(
            decode_order_create(br#"{"schema_version": 7, "entirely": "different"}"#),
            Err(DecodeError::UnknownSchema { version: 7 })
        );
        // A version the probe cannot read is plain garbage.
        assert!(matches!(
            decode_order_create(br#"{"schema_version": "two"}"#),
            Err(DecodeError::Malformed(_))
        ));
    }

    #[test]
    fn malformed_and_invalid_bodies_are_refused() {
        assert!(matches!(decode_order_create(b"not json"), Err(DecodeError::Malformed(_))));
        assert!(matches!(decode_order_create(b"{}"), Err(DecodeError::Malformed(_))));
        let big = vec![b' '; ORDER_CREATE_BODY_MAX + 1];
        assert!(matches!(decode_order_create(&big), Err(DecodeError::TooLarge { .. })));

        type Mutation = Box<dyn Fn(&mut OrderCreate)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("schema_version", Box::new(|m| m.schema_version = 0)),
            ("event_type", Box::new(|m| m.event_type = "OTHER".into())),
            ("message_id", Box::new(|m| m.message_id.clear())),
            ("reservation_id", Box::new(|m| m.reservation_id = "r_1".into())),
            ("reservation_id", Box::new(|m| m.reservation_id = "resv_".into())),
            ("request_id", Box::new(|m| m.request_id = "a b".into())),
            ("request_id", Box::new(|m| m.request_id = "x".repeat(ID_LEN_MAX + 1))),
            ("activity_id", Box::new(|m| m.activity_id = 0)),
            ("user_id", Box::new(|m| m.user_id = u64::MAX)),
            ("quantity", Box::new(|m| m.quantity = 0)),
            ("quantity", Box::new(|m| m.quantity = crate::bounds::QUANTITY_MAX + 1)),
            ("reservation_expires_at", Box::new(|m| m.reservation_expires_at_ms = T0)),
            ("payload_hash", Box::new(|m| m.payload_hash = "nul\0".into())),
        ];
        for (field, mutate) in cases {
            let mut m = sample();
            mutate(&mut m);
            match decode_order_create(&m.encode()) {
                Err(DecodeError::Invalid { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: expected Invalid, got {other:?}"),
            }
        }
        let bad_time = String::from_utf8(sample().encode())
            .expect("utf8")
            .replace("2026-06-25T19:00:00.123Z", "2026-02-30T19:00:00Z");
        assert!(matches!(decode_order_create(bad_time.as_bytes()), Err(DecodeError::Malformed(_))));
    }

    #[test]
    fn order_id_is_derived_from_the_reservation_id() {
        let m = sample();
        assert_eq!(m.order_id(), "ord_01J0Z3Q8YB3W5M2N7K4T9R6P1D");
    }
}
