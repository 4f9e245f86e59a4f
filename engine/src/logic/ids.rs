//! Identifiers: the id newtypes every edge module shares, and the business ids the engine
//! mints (`resv_…`, `msg_…`, `ord_…`).
//!
//! What it is:
//! - [`ActivityId`], [`SkuId`], [`UserId`]: positive integers that fit a PostgreSQL `bigint`
//!   (1..=`i64::MAX`), with one strict decimal spelling ([`parse_decimal_u64`]: no sign, no
//!   leading zeros, no spaces) so that one id never has two textual forms in a pass, a query
//!   string or a Redis key.
//! - [`RequestId`]: the client's idempotency key, 1–64 bytes of `[A-Za-z0-9_-]`
//!   (CONTRACT.md 3.2), borrowed from the request.
//! - [`IdGenerator`] and [`BusinessId`]: time-ordered 128-bit ids in ULID text (26 chars of
//!   Crockford base32: 48-bit millisecond timestamp + 80 random bits), monotonic within one
//!   millisecond per generator, written into a fixed stack buffer (no heap per id).
//!
//! What it is not: a clock or an entropy source. `now_ms` and the generator's seed are
//! arguments; `main` seeds each shard's generator from the OS and the shard passes its clock
//! reading. No locks, no shared state: one generator per shard.
//!
//! Read next: `auth.rs` (passes carry user and activity ids), `api.rs` (request validation).

use std::fmt;
use std::ops::Deref;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

// ---------------------------------------------------------------------------------------------
// Numeric ids
// ---------------------------------------------------------------------------------------------

/// Most decimal digits of a `u64` (`18446744073709551615`).
pub const DECIMAL_U64_DIGITS_MAX: usize = 20;

/// Parses the one canonical decimal spelling of a `u64`: ASCII digits only, no sign, no
/// spaces, no leading zeros (`"0"` is the only spelling of zero), at most 20 digits, no
/// overflow. `None` for anything else.
///
/// Leading zeros are refused so that `"7"` and `"007"` cannot name the same id in two
/// spellings (a pass or a key built from one would not match the other).
pub fn parse_decimal_u64(text: &[u8]) -> Option<u64> {
    if text.is_empty() || text.len() > DECIMAL_U64_DIGITS_MAX {
        return None;
    }
    if text[0] == b'0' && text.len() > 1 {
        return None;
    }
    let mut value: u64 = 0;
    for &byte in text {
        let digit = byte.wrapping_sub(b'0');
        if digit > 9 {
            return None;
        }
        value = value.checked_mul(10)?.checked_add(u64::from(digit))?;
    }
    Some(value)
}

/// Largest id value (`io/src/bounds.rs`: PostgreSQL `bigint`, and what Lua accepts as text).
pub use flashsale_io::bounds::ID_VALUE_MAX;

macro_rules! numeric_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub u64);

        impl $name {
            /// The id if `value` is in 1..=[`ID_VALUE_MAX`].
            pub const fn new(value: u64) -> Option<$name> {
                if value >= 1 && value <= ID_VALUE_MAX {
                    Some($name(value))
                } else {
                    None
                }
            }

            /// Parses the canonical decimal spelling ([`parse_decimal_u64`]) of a valid id.
            pub fn parse_decimal(text: &[u8]) -> Option<$name> {
                parse_decimal_u64(text).and_then($name::new)
            }

            pub const fn get(self) -> u64 {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

numeric_id!(
    /// An activity (a sale event), CONTRACT.md 3.2.
    ActivityId
);
numeric_id!(
    /// A SKU within an activity.
    SkuId
);
numeric_id!(
    /// A buyer. Trusted only when it comes from a verified pass (`auth.rs`), never a body.
    UserId
);

// ---------------------------------------------------------------------------------------------
// Request ids
// ---------------------------------------------------------------------------------------------

/// Longest client request id (CONTRACT.md 3.2).
pub const REQUEST_ID_LEN_MAX: usize = 64;

/// The client's idempotency key: 1–[`REQUEST_ID_LEN_MAX`] bytes of `[A-Za-z0-9_-]`,
/// borrowed from the request it came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestId<'a>(&'a str);

impl<'a> RequestId<'a> {
    /// The request id if `text` has the allowed length and alphabet.
    pub fn parse(text: &'a str) -> Option<RequestId<'a>> {
        let ok = !text.is_empty()
            && text.len() <= REQUEST_ID_LEN_MAX
            && text.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        ok.then_some(RequestId(text))
    }

    pub fn as_str(&self) -> &'a str {
        self.0
    }
}

impl fmt::Display for RequestId<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

// ---------------------------------------------------------------------------------------------
// Business ids
// ---------------------------------------------------------------------------------------------

/// Which business object an id names; decides the prefix (CONTRACT.md section 7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdKind {
    Reservation,
    Message,
    Order,
}

impl IdKind {
    pub const fn prefix(self) -> &'static str {
        match self {
            IdKind::Reservation => "resv_",
            IdKind::Message => "msg_",
            IdKind::Order => "ord_",
        }
    }
}

/// Characters of a ULID in text.
pub const ULID_LEN: usize = 26;
/// Longest prefix ([`IdKind::prefix`]).
const PREFIX_LEN_MAX: usize = 5;
/// Longest business id in bytes.
pub const BUSINESS_ID_LEN_MAX: usize = PREFIX_LEN_MAX + ULID_LEN;

const _: () = assert!(IdKind::Reservation.prefix().len() <= PREFIX_LEN_MAX);
const _: () = assert!(IdKind::Message.prefix().len() <= PREFIX_LEN_MAX);
const _: () = assert!(IdKind::Order.prefix().len() <= PREFIX_LEN_MAX);
// The Redis function library refuses ids longer than 128 bytes (`io::redis::script::ID_LEN_MAX`).
const _: () = assert!(BUSINESS_ID_LEN_MAX <= 128);

/// Crockford's base32 alphabet (no I, L, O, U), as ULID uses it. Its characters are in
/// ascending ASCII order, so text order equals numeric order.
const CROCKFORD: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";

/// Largest timestamp a ULID holds (48 bits of milliseconds: year 10889).
pub const ULID_TIMESTAMP_MS_MAX: u64 = (1 << 48) - 1;
const RANDOM_BITS: u32 = 80;
const RANDOM_MASK: u128 = (1 << RANDOM_BITS) - 1;

/// A business id such as `resv_01J0Z3Q8YB3W5M2N7K4T9R6P1C` on the stack; derefs to `&str`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BusinessId {
    len: u8,
    bytes: [u8; BUSINESS_ID_LEN_MAX],
}

impl BusinessId {
    fn new(kind: IdKind, ulid: u128) -> BusinessId {
        let prefix = kind.prefix().as_bytes();
        let mut bytes = [0u8; BUSINESS_ID_LEN_MAX];
        bytes[..prefix.len()].copy_from_slice(prefix);
        encode_ulid(ulid, &mut bytes[prefix.len()..prefix.len() + ULID_LEN]);
        // At most 31: fits a u8.
        let len = (prefix.len() + ULID_LEN) as u8;
        BusinessId { len, bytes }
    }

    pub fn as_str(&self) -> &str {
        match std::str::from_utf8(&self.bytes[..usize::from(self.len)]) {
            Ok(text) => text,
            // Built only from an ASCII prefix and the ASCII Crockford alphabet.
            Err(_) => unreachable!("a business id is ASCII"),
        }
    }
}

impl Deref for BusinessId {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Display for BusinessId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for BusinessId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

/// This engine process's name among the instances sharing one set of stores (DESIGN.md
/// section 11): `[engine] instance_id` / `FLASHSALE_INSTANCE_ID`, else 8 random hex digits
/// drawn at start ([`InstanceId::from_random`]: distinct across hosts and restarts without
/// reading the host name). It prefixes generated request ids and is a field of every
/// shard's log lines.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct InstanceId(std::sync::Arc<str>);

/// Longest configured instance id.
pub const INSTANCE_ID_LEN_MAX: usize = 32;

impl InstanceId {
    /// 1..=32 characters of `[A-Za-z0-9_.-]` (a header value, a log field and a NATS
    /// subject token without escaping).
    pub fn parse(text: &str) -> Result<InstanceId, String> {
        let ok = |b: u8| b.is_ascii_alphanumeric() || b"_.-".contains(&b);
        if text.is_empty() || text.len() > INSTANCE_ID_LEN_MAX || !text.bytes().all(ok) {
            return Err(format!(
                "{text:?}: 1 to {INSTANCE_ID_LEN_MAX} characters of A-Z a-z 0-9 _ . -"
            ));
        }
        Ok(InstanceId(text.into()))
    }

    /// The default: `seed` as 8 lowercase hex digits.
    pub fn from_random(seed: u32) -> InstanceId {
        InstanceId(format!("{seed:08x}").into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// The `x-request-id` of an answer whose request carried none: `fs-{instance}-{shard}-{seq}`,
/// built on the stack (an answer must not allocate); derefs to `&str`.
#[derive(Clone, Copy)]
pub struct GeneratedRequestId {
    len: u8,
    bytes: [u8; GENERATED_REQUEST_ID_LEN_MAX],
}

/// `fs-` + the instance id + `-` + two decimals of at most 20 digits and a `-`.
const GENERATED_REQUEST_ID_LEN_MAX: usize = 3 + INSTANCE_ID_LEN_MAX + 1 + 20 + 1 + 20;

impl GeneratedRequestId {
    pub fn new(instance: &InstanceId, shard: usize, seq: u64) -> GeneratedRequestId {
        let mut bytes = [0u8; GENERATED_REQUEST_ID_LEN_MAX];
        let mut len = 0;
        let shard_text = flashsale_io::resp::U64Text::new(shard as u64);
        let seq_text = flashsale_io::resp::U64Text::new(seq);
        let parts = [
            b"fs-".as_slice(),
            instance.as_str().as_bytes(),
            b"-",
            shard_text.as_bytes(),
            b"-",
            seq_text.as_bytes(),
        ];
        for part in parts {
            bytes[len..len + part.len()].copy_from_slice(part);
            len += part.len();
        }
        // At most 77: fits a u8.
        GeneratedRequestId { len: len as u8, bytes }
    }

    pub fn as_str(&self) -> &str {
        match std::str::from_utf8(&self.bytes[..usize::from(self.len)]) {
            Ok(text) => text,
            // Built only from ASCII digits and separators.
            Err(_) => unreachable!("a generated request id is ASCII"),
        }
    }
}

impl Deref for GeneratedRequestId {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

/// Writes the 26-character Crockford base32 text of `value` (most significant first; the
/// first character carries the top 3 bits, so it is at most `7`).
pub fn encode_ulid(value: u128, out: &mut [u8]) {
    debug_assert_eq!(out.len(), ULID_LEN);
    for (index, slot) in out.iter_mut().enumerate().take(ULID_LEN) {
        let shift = 5 * (ULID_LEN - 1 - index);
        // Masked to 5 bits: a valid index into the 32-entry alphabet.
        *slot = CROCKFORD[((value >> shift) & 0x1f) as usize];
    }
}

/// Mints time-ordered ids for one shard.
///
/// Ids from one generator are strictly increasing (as 128-bit numbers and as text, prefix
/// aside): a new millisecond draws 80 fresh random bits; within the same millisecond, or when
/// the clock steps back, the previous value is incremented by one (the ULID monotonic rule),
/// so a clock step never reorders or repeats ids. If the 80 random bits overflow within one
/// millisecond (2^80 ids — not reachable in practice, but defined) the timestamp part moves
/// on by one millisecond, which keeps ids unique and ordered.
///
/// The kinds share one sequence, so the ULID part is unique across `resv_`, `msg_` and
/// `ord_` too. Ids of different generators are unique with overwhelming probability as long
/// as each generator's seed comes from OS entropy.
pub struct IdGenerator {
    rng: StdRng,
    /// The last ULID minted (timestamp << 80 | random); 0 before the first.
    last: u128,
}

impl IdGenerator {
    /// A generator seeded with `seed` (take it from OS entropy in `main`, e.g.
    /// `rand::random()`; tests pass fixed seeds to be reproducible).
    pub fn new(seed: [u8; 32]) -> IdGenerator {
        IdGenerator { rng: StdRng::from_seed(seed), last: 0 }
    }

    /// The next id of `kind` at wall-clock time `now_ms` (Unix milliseconds).
    pub fn next(&mut self, kind: IdKind, now_ms: u64) -> BusinessId {
        BusinessId::new(kind, self.next_ulid(now_ms))
    }

    /// The next raw ULID value (timestamp in the top 48 bits).
    pub fn next_ulid(&mut self, now_ms: u64) -> u128 {
        let now_ms = now_ms.min(ULID_TIMESTAMP_MS_MAX);
        let last_ms = (self.last >> RANDOM_BITS) as u64;
        let next = if now_ms > last_ms {
            (u128::from(now_ms) << RANDOM_BITS) | (self.rng.gen::<u128>() & RANDOM_MASK)
        } else {
            // Same millisecond or the clock stepped back: stay monotonic. A carry out of the
            // random bits moves the timestamp on by one; at the very end of ULID time (not
            // reachable before year 10889) it wraps, which the assert below refuses.
            self.last.wrapping_add(1)
        };
        assert!(next > self.last, "business ids must increase");
        self.last = next;
        next
    }
}

impl fmt::Debug for IdGenerator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The RNG state is a secret of sorts (it predicts future ids): do not print it.
        f.debug_struct("IdGenerator").field("last", &self.last).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    const SEED: [u8; 32] = [7; 32];

    #[test]
    fn decimal_has_one_spelling() {
        assert_eq!(parse_decimal_u64(b"0"), Some(0));
        assert_eq!(parse_decimal_u64(b"10001"), Some(10001));
        assert_eq!(parse_decimal_u64(b"18446744073709551615"), Some(u64::MAX));
        for bad in [
            &b""[..],
            b"00",
            b"007",
            b"+7",
            b"-7",
            b" 7",
            b"7 ",
            b"7a",
            b"1.0",
            b"18446744073709551616",
            b"000000000000000000001",
        ] {
            assert_eq!(parse_decimal_u64(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn decimal_writer_round_trips() {
        for value in [0, 1, 9, 10, 10001, u64::from(u32::MAX), u64::MAX] {
            let text = flashsale_io::resp::U64Text::new(value).as_bytes().to_vec();
            assert_eq!(text, value.to_string().into_bytes());
            assert_eq!(parse_decimal_u64(&text), Some(value));
        }
    }

    #[test]
    fn numeric_ids_are_positive_bigints() {
        assert_eq!(ActivityId::new(0), None);
        assert_eq!(ActivityId::new(1), Some(ActivityId(1)));
        assert_eq!(SkuId::new(i64::MAX as u64), Some(SkuId(i64::MAX as u64)));
        assert_eq!(UserId::new(i64::MAX as u64 + 1), None);
        assert_eq!(UserId::parse_decimal(b"9223372036854775808"), None);
        assert_eq!(UserId::parse_decimal(b"0"), None);
        assert_eq!(UserId::parse_decimal(b"30001"), Some(UserId(30001)));
    }

    #[test]
    fn request_id_alphabet_and_length() {
        assert_eq!(RequestId::parse("req_01J-x").map(|r| r.as_str()), Some("req_01J-x"));
        assert!(RequestId::parse(&"a".repeat(64)).is_some());
        assert!(RequestId::parse(&"a".repeat(65)).is_none());
        for bad in ["", "a b", "a.b", "a/b", "é", "a\u{0}", "a%41", "a+b"] {
            assert!(RequestId::parse(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn prefix_and_length() {
        let mut ids = IdGenerator::new(SEED);
        let now_ms = 1_750_000_000_000;
        for (kind, prefix) in
            [(IdKind::Reservation, "resv_"), (IdKind::Message, "msg_"), (IdKind::Order, "ord_")]
        {
            let id = ids.next(kind, now_ms);
            assert!(id.starts_with(prefix), "{id}");
            assert_eq!(id.len(), prefix.len() + ULID_LEN);
            let body = &id[prefix.len()..];
            assert!(body.bytes().all(|b| CROCKFORD.contains(&b)), "{id}");
            assert!(body.as_bytes()[0] <= b'7', "top character carries 3 bits: {id}");
        }
    }

    #[test]
    fn encoding_matches_the_ulid_crate() {
        let mut ids = IdGenerator::new(SEED);
        for now_ms in [0, 1, 1_750_000_000_000, ULID_TIMESTAMP_MS_MAX] {
            let value = ids.next_ulid(now_ms);
            let mut ours = [0u8; ULID_LEN];
            encode_ulid(value, &mut ours);
            let theirs = ulid::Ulid(value).to_string();
            assert_eq!(std::str::from_utf8(&ours).ok(), Some(theirs.as_str()));
            let parsed = ulid::Ulid::from_string(&theirs).map(|u| u.timestamp_ms()).ok();
            assert_eq!(parsed, Some(now_ms));
        }
        let mut all_ones = [0u8; ULID_LEN];
        encode_ulid(u128::MAX, &mut all_ones);
        assert_eq!(&all_ones, b"7ZZZZZZZZZZZZZZZZZZZZZZZZZ");
    }

    #[test]
    fn text_order_follows_time() {
        let mut ids = IdGenerator::new(SEED);
        let mut previous = ids.next(IdKind::Reservation, 1_000);
        for now_ms in [1_001, 2_000, 1_750_000_000_000, 1_750_000_000_001] {
            let id = ids.next(IdKind::Reservation, now_ms);
            assert!(id.as_str() > previous.as_str(), "{id} after {previous}");
            previous = id;
        }
        // Independent generators too: time dominates the random part.
        let mut other = IdGenerator::new([9; 32]);
        let later = other.next(IdKind::Reservation, 1_750_000_000_002);
        assert!(later.as_str() > previous.as_str());
    }

    #[test]
    fn monotonic_within_one_millisecond_and_across_clock_steps_back() {
        let mut ids = IdGenerator::new(SEED);
        let first = ids.next_ulid(5_000);
        let second = ids.next_ulid(5_000);
        assert_eq!(second, first + 1, "same millisecond increments the random part");
        let stepped_back = ids.next_ulid(4_000);
        assert_eq!(stepped_back, second + 1, "a clock step back must not reorder ids");
        assert_eq!((stepped_back >> RANDOM_BITS) as u64, 5_000);
        let later = ids.next_ulid(5_001);
        assert_eq!((later >> RANDOM_BITS) as u64, 5_001);
    }

    #[test]
    fn random_overflow_moves_to_the_next_millisecond() {
        let mut ids = IdGenerator::new(SEED);
        ids.last = (7_000u128 << RANDOM_BITS) | RANDOM_MASK;
        let next = ids.next_ulid(7_000);
        assert_eq!((next >> RANDOM_BITS) as u64, 7_001);
        assert_eq!(next & RANDOM_MASK, 0);
    }

    #[test]
    fn one_million_ids_are_unique_and_increasing() {
        let mut ids = IdGenerator::new(SEED);
        let mut seen = HashSet::with_capacity(1_000_000);
        let mut previous = String::new();
        for i in 0..1_000_000u64 {
            // About 100 ids per millisecond, mixing kinds, like a busy shard.
            let kind = if i % 2 == 0 { IdKind::Reservation } else { IdKind::Message };
            let id = ids.next(kind, 1_750_000_000_000 + i / 100);
            let body = &id[kind.prefix().len()..];
            assert!(body > previous.as_str(), "{body} after {previous}");
            previous.clear();
            previous.push_str(body);
            assert!(seen.insert(body.to_owned()), "duplicate {id}");
        }
        assert_eq!(seen.len(), 1_000_000);
    }

    #[test]
    fn different_seeds_give_different_ids() {
        let a = IdGenerator::new([1; 32]).next(IdKind::Order, 42);
        let b = IdGenerator::new([2; 32]).next(IdKind::Order, 42);
        assert_ne!(a, b);
    }

    #[test]
    fn generated_request_ids_name_the_instance() {
        let long = InstanceId::parse(&"x".repeat(INSTANCE_ID_LEN_MAX)).unwrap();
        for instance in
            [InstanceId::from_random(0xab), InstanceId::parse("pod-7.eu_1").unwrap(), long]
        {
            for (shard, seq) in [(0, 1), (3, 1_000_000), (usize::MAX, u64::MAX)] {
                assert_eq!(
                    &*GeneratedRequestId::new(&instance, shard, seq),
                    format!("fs-{instance}-{shard}-{seq}")
                );
            }
        }
        assert_eq!(InstanceId::from_random(0xab).as_str(), "000000ab");
    }

    #[test]
    fn instance_ids_are_bounded_plain_tokens() {
        for bad in ["", "a b", "a:b", "é", &"x".repeat(INSTANCE_ID_LEN_MAX + 1)] {
            assert!(InstanceId::parse(bad).is_err(), "{bad:?}");
        }
    }
}
