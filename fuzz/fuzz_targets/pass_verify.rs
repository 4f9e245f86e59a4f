//! Fuzzes the user-pass check (`engine::logic::auth::PassKeys::verify`), which runs on every
//! public request with attacker-chosen `Authorization` bytes.
//!
//! Checks: no panic on any header; a pass minted from fuzz-chosen valid ids verifies to those
//! ids while unexpired and is `Expired` after; flipping any one byte of a minted pass's
//! signature never yields a valid pass for another user or activity.
//!
//! Run: `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run pass_verify -- -max_total_time=120`

#![no_main]

use flashsale_engine::logic::auth::{PassError, PassKeys};
use flashsale_engine::logic::ids::{ActivityId, UserId};
use libfuzzer_sys::fuzz_target;

const KEYS: &str = "k1:0123456789abcdef0123456789abcdef,k2:fedcba9876543210fedcba9876543210";

fuzz_target!(|data: &[u8]| {
    let keys = PassKeys::parse(KEYS).expect("test keys");
    // Arbitrary header bytes: any answer but a panic.
    let _ = keys.verify(data, 1_800_000_000);
    if data.len() < 24 {
        return;
    }
    let word = |i: usize| u64::from_le_bytes(data[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let (user, activity, exp) = (word(0), word(1), word(2) % 4_000_000_000 + 1);
    // Valid ids only: `mint` signs any u64, but a pass for an id outside 1..=i64::MAX never
    // verifies (found by this target and reported; the callers are tests and tools).
    let (Some(user_id), Some(activity_id)) = (UserId::new(user), ActivityId::new(activity)) else {
        return;
    };
    let Some(pass) = keys.mint("k2", user_id, activity_id, exp) else { return };
    let header = format!("Bearer {pass}");
    let verified = keys.verify(header.as_bytes(), exp - 1).expect("a fresh pass verifies");
    assert_eq!((verified.user_id, verified.activity_id), (user_id, activity_id));
    assert_eq!(keys.verify(header.as_bytes(), exp).err(), Some(PassError::Expired));
    // One byte changed in the signature: refused.
    let mut forged = header.into_bytes();
    let at = forged.len() - 1 - usize::from(data[23]) % 8;
    forged[at] = if forged[at] == b'A' { b'B' } else { b'A' };
    if let Ok(pass) = keys.verify(&forged, exp - 1) {
        assert_eq!((pass.user_id, pass.activity_id), (user_id, activity_id));
    }
});
