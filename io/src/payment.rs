//! The payment provider's signature scheme (CONTRACT.md 3.4), shared by the engine (callbacks)
//! and the worker's closer (status requests to the provider and their answers). Every text is
//! signed with the payment key (`FLASHSALE_PAYMENT_KEY`, one [`HmacKey`]): `signature` =
//! lowercase hex HMAC-SHA256(key, text), compared in constant time; anything but exactly 64
//! lowercase hex digits is refused (one spelling per tag).
//!
//! The three texts (fields joined by `|`, numbers in decimal):
//!
//! - callback ([`Signed`]): `v1|payment_id|order_id|status|amount_cents`;
//! - status request ([`StatusRequest`]), the closer asking about one order before it closes
//!   it: `v1|status_request|order_id|nonce|requested_at_ms`;
//! - status answer ([`StatusAnswer`]), the provider's reply, bound to the request by its
//!   nonce so that an old answer cannot be replayed for a new question:
//!   `v1|status_answer|nonce|payment_id|order_id|status|amount_cents` (an empty `payment_id`
//!   and amount 0 when nothing was paid).
//!
//! The domain words `status_request` / `status_answer` keep the three kinds apart: a callback
//! signature never verifies as an answer (nor the other way round) unless the provider signs a
//! payment id literally named so; fields containing `|` are refused when an answer is checked.

use crate::key::HmacKey;
use crate::resp::U64Text;

/// Lowercase hex of the tag of `parts`.
fn sign_parts(key: &HmacKey, parts: &[&[u8]]) -> String {
    hex::encode(key.tag(parts))
}

/// Whether `signature_hex` (exactly 64 lowercase hex digits) is the tag of `parts`.
fn verify_parts(key: &HmacKey, parts: &[&[u8]], signature_hex: &str) -> bool {
    let mut tag = [0u8; 32];
    if signature_hex.len() != 64
        || !signature_hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        || hex::decode_to_slice(signature_hex, &mut tag).is_err()
    {
        return false;
    }
    key.verify(parts, &tag)
}

/// The fields a payment callback signature covers.
#[derive(Debug, Clone, Copy)]
pub struct Signed<'a> {
    pub payment_id: &'a str,
    pub order_id: &'a str,
    pub status: &'a str,
    pub amount_cents: u64,
}

impl Signed<'_> {
    /// The signature a provider sends (lowercase hex); for providers' SDKs and tests.
    pub fn sign(&self, key: &HmacKey) -> String {
        let amount = U64Text::new(self.amount_cents);
        sign_parts(key, &self.parts(&amount))
    }

    /// Whether `signature_hex` signs these fields under `key`.
    pub fn verify(&self, key: &HmacKey, signature_hex: &str) -> bool {
        let amount = U64Text::new(self.amount_cents);
        verify_parts(key, &self.parts(&amount), signature_hex)
    }

    fn parts<'s>(&'s self, amount: &'s U64Text) -> [&'s [u8]; 8] {
        [
            b"v1|",
            self.payment_id.as_bytes(),
            b"|",
            self.order_id.as_bytes(),
            b"|",
            self.status.as_bytes(),
            b"|",
            amount.as_bytes(),
        ]
    }
}

/// The closer's question "what became of this order's payment?" (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct StatusRequest<'a> {
    pub order_id: &'a str,
    /// 32 lowercase hex digits, fresh per request; echoed in the signed answer.
    pub nonce: &'a str,
    pub requested_at_ms: u64,
}

impl StatusRequest<'_> {
    pub fn sign(&self, key: &HmacKey) -> String {
        let at = U64Text::new(self.requested_at_ms);
        sign_parts(key, &self.parts(&at))
    }

    /// For the provider (and the tests' stand-in).
    pub fn verify(&self, key: &HmacKey, signature_hex: &str) -> bool {
        let at = U64Text::new(self.requested_at_ms);
        verify_parts(key, &self.parts(&at), signature_hex)
    }

    fn parts<'s>(&'s self, at: &'s U64Text) -> [&'s [u8]; 6] {
        [
            b"v1|status_request|",
            self.order_id.as_bytes(),
            b"|",
            self.nonce.as_bytes(),
            b"|",
            at.as_bytes(),
        ]
    }

    /// The JSON body of the request (`POST {status_url}`), signature included. Ids and nonces
    /// are visible ASCII without quotes or backslashes (the caller checks), so no escaping.
    pub fn body(&self, key: &HmacKey) -> String {
        format!(
            r#"{{"order_id":"{}","nonce":"{}","requested_at_ms":{},"signature":"{}"}}"#,
            self.order_id,
            self.nonce,
            self.requested_at_ms,
            self.sign(key)
        )
    }
}

/// The provider's signed answer to a [`StatusRequest`].
#[derive(Debug, Clone, Copy)]
pub struct StatusAnswer<'a> {
    pub nonce: &'a str,
    pub payment_id: &'a str,
    pub order_id: &'a str,
    pub status: &'a str,
    pub amount_cents: u64,
}

impl StatusAnswer<'_> {
    /// For the provider (and the tests' stand-in).
    pub fn sign(&self, key: &HmacKey) -> String {
        let amount = U64Text::new(self.amount_cents);
        sign_parts(key, &self.parts(&amount))
    }

    /// Whether `signature_hex` signs these fields under `key`; a field containing `|` never
    /// verifies (the text must split back into the same fields).
    pub fn verify(&self, key: &HmacKey, signature_hex: &str) -> bool {
        let fields = [self.nonce, self.payment_id, self.order_id, self.status];
        if fields.iter().any(|f| f.contains('|')) {
            return false;
        }
        let amount = U64Text::new(self.amount_cents);
        verify_parts(key, &self.parts(&amount), signature_hex)
    }

    fn parts<'s>(&'s self, amount: &'s U64Text) -> [&'s [u8]; 10] {
        [
            b"v1|status_answer|",
            self.nonce.as_bytes(),
            b"|",
            self.payment_id.as_bytes(),
            b"|",
            self.order_id.as_bytes(),
            b"|",
            self.status.as_bytes(),
            b"|",
            amount.as_bytes(),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::HmacSha256;
    use hmac::Mac;

    const KEY: &str = "00112233445566778899aabbccddeeff";

    fn signed(amount_cents: u64) -> Signed<'static> {
        Signed { payment_id: "pay_1", order_id: "ord_1", status: "PAID", amount_cents }
    }

    fn reference(text: &str) -> String {
        let mut mac = HmacSha256::new_from_slice(&hex::decode(KEY).expect("test")).expect("test");
        mac.update(text.as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }

    #[test]
    fn signatures_verify_and_anything_else_does_not() {
        let key = HmacKey::from_hex(KEY).expect("test");
        let sig = signed(1999).sign(&key);
        assert_eq!(sig.len(), 64);
        assert!(signed(1999).verify(&key, &sig));
        assert!(!signed(1998).verify(&key, &sig));
        assert!(!Signed { order_id: "ord_2", ..signed(1999) }.verify(&key, &sig));
        assert!(!Signed { status: "FAILED", ..signed(1999) }.verify(&key, &sig));
        assert!(!signed(1999).verify(&key, &sig.to_uppercase()));
        assert!(!signed(1999).verify(&key, &sig[..63]));
        let other = HmacKey::from_hex("ff112233445566778899aabbccddeeff").expect("test");
        assert!(!signed(1999).verify(&other, &sig));
    }

    #[test]
    fn the_signatures_are_hmac_sha256_over_the_documented_texts() {
        let key = HmacKey::from_hex(KEY).expect("test");
        assert_eq!(signed(1999).sign(&key), reference("v1|pay_1|ord_1|PAID|1999"));
        let request = StatusRequest { order_id: "ord_1", nonce: "ab12", requested_at_ms: 77 };
        assert_eq!(request.sign(&key), reference("v1|status_request|ord_1|ab12|77"));
        assert!(request.verify(&key, &request.sign(&key)));
        assert!(request.body(&key).contains(r#""order_id":"ord_1","nonce":"ab12""#));
        let answer = StatusAnswer {
            nonce: "ab12",
            payment_id: "pay_1",
            order_id: "ord_1",
            status: "PAID",
            amount_cents: 1999,
        };
        assert_eq!(answer.sign(&key), reference("v1|status_answer|ab12|pay_1|ord_1|PAID|1999"));
        assert!(answer.verify(&key, &answer.sign(&key)));
    }

    #[test]
    fn the_three_kinds_never_verify_as_each_other() {
        let key = HmacKey::from_hex(KEY).expect("test");
        let answer = StatusAnswer {
            nonce: "n1",
            payment_id: "pay_1",
            order_id: "ord_1",
            status: "PAID",
            amount_cents: 5,
        };
        let sig = answer.sign(&key);
        // Another nonce (a replayed answer) or a callback signature: refused.
        assert!(!StatusAnswer { nonce: "n2", ..answer }.verify(&key, &sig));
        let callback = signed(5).sign(&key);
        assert!(!answer.verify(&key, &callback));
        // Fields that would shift the text are refused outright.
        let shifted = StatusAnswer { nonce: "n1|pay_1", payment_id: "ord_1", ..answer };
        assert!(!shifted.verify(&key, &sig));
    }
}
