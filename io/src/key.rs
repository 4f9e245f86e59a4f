//! THE prepared HMAC-SHA256 key of the system: user pass keys (`FLASHSALE_PASS_KEYS`), the
//! control key that signs mode snapshots (`FLASHSALE_CONTROL_KEY`) and the payment provider's
//! key (`FLASHSALE_PAYMENT_KEY`) are all one [`HmacKey`]: parsed from hex once at start-up,
//! the HMAC pads computed then (each use clones the prepared state: no per-request key
//! schedule), compared in constant time, and never printed.
//!
//! It lives in `io`, below the engine and the worker, because both sign with the payment key:
//! the engine checks callbacks, the worker's closer signs its status requests to the provider
//! (`pg-worker/src/provider.rs`); the engine imports it from here.
//!
//! What it is not: a signature scheme. What each key signs, and how, lives with its user
//! (engine `auth.rs` passes, `modes.rs` snapshots; [`crate::payment`] callbacks and status
//! requests).

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub type HmacSha256 = Hmac<Sha256>;

/// Shortest key accepted, in bytes (128 bits).
pub const KEY_LEN_MIN: usize = 16;
/// Longest key accepted, in bytes (one SHA-256 block: longer keys would be hashed first).
pub const KEY_LEN_MAX: usize = 64;

/// Why a hex key was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("not hex")]
    NotHex,
    #[error("key has {bytes} bytes, at least {KEY_LEN_MIN} required")]
    TooShort { bytes: usize },
    #[error("key has more than {KEY_LEN_MAX} bytes")]
    TooLong,
}

/// A prepared HMAC-SHA256 key.
#[derive(Clone)]
pub struct HmacKey {
    prepared: HmacSha256,
}

impl fmt::Debug for HmacKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print key material.
        f.write_str("HmacKey(..)")
    }
}

/// Two keys are equal when they are the same key (compared by the tag of a fixed text, so the
/// key bytes need not be kept); lets configurations that hold a key compare.
impl PartialEq for HmacKey {
    fn eq(&self, other: &HmacKey) -> bool {
        const PROBE: &[u8] = b"flashsale key identity probe";
        self.tag(&[PROBE]) == other.tag(&[PROBE])
    }
}

impl Eq for HmacKey {}

impl HmacKey {
    /// A key of [`KEY_LEN_MIN`]..=[`KEY_LEN_MAX`] bytes in hex (surrounding white space is
    /// ignored). Decoded on the stack: the key bytes never sit in a heap allocation.
    pub fn from_hex(hex_key: &str) -> Result<HmacKey, KeyError> {
        let hex_key = hex_key.trim();
        if !hex_key.len().is_multiple_of(2) {
            return Err(KeyError::NotHex);
        }
        let len = hex_key.len() / 2;
        if len > KEY_LEN_MAX {
            return Err(KeyError::TooLong);
        }
        let mut bytes = [0u8; KEY_LEN_MAX];
        hex::decode_to_slice(hex_key, &mut bytes[..len]).map_err(|_| KeyError::NotHex)?;
        if len < KEY_LEN_MIN {
            return Err(KeyError::TooShort { bytes: len });
        }
        // HMAC accepts every key length; the error arm cannot happen.
        let prepared = HmacSha256::new_from_slice(&bytes[..len]).map_err(|_| KeyError::NotHex)?;
        Ok(HmacKey { prepared })
    }

    /// The MAC of the concatenation of `parts`.
    pub fn mac(&self, parts: &[&[u8]]) -> HmacSha256 {
        let mut mac = self.prepared.clone();
        for part in parts {
            mac.update(part);
        }
        mac
    }

    /// The 32-byte tag of the concatenation of `parts`.
    pub fn tag(&self, parts: &[&[u8]]) -> [u8; 32] {
        self.mac(parts).finalize().into_bytes().into()
    }

    /// Whether `tag` is the tag of `parts` (constant-time: `verify_slice` compares with
    /// `subtle`).
    pub fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        self.mac(parts).verify_slice(tag).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "000102030405060708090a0b0c0d0e0f";

    #[test]
    fn bounds_and_hex_are_checked() {
        assert!(HmacKey::from_hex(KEY).is_ok());
        assert!(HmacKey::from_hex(&format!("  {KEY}\n")).is_ok());
        assert_eq!(HmacKey::from_hex("00").err(), Some(KeyError::TooShort { bytes: 1 }));
        assert_eq!(HmacKey::from_hex(&"ab".repeat(65)).err(), Some(KeyError::TooLong));
        assert_eq!(HmacKey::from_hex(&"zz".repeat(16)).err(), Some(KeyError::NotHex));
        assert_eq!(HmacKey::from_hex("abc").err(), Some(KeyError::NotHex));
        assert!(HmacKey::from_hex(&"ab".repeat(64)).is_ok());
    }

    #[test]
    fn tags_verify_and_nothing_else_does() {
        let key = HmacKey::from_hex(KEY).expect("key");
        let tag = key.tag(&[b"v1|", b"abc"]);
        // The parts are concatenated: the split does not matter, the bytes do.
        assert!(key.verify(&[b"v1|abc"], &tag));
        assert!(!key.verify(&[b"v1|abd"], &tag));
        let other = HmacKey::from_hex(&"11".repeat(16)).expect("key");
        assert!(!other.verify(&[b"v1|abc"], &tag));
        assert!(!key.verify(&[b"v1|abc"], &tag[..31]));
        assert_eq!(format!("{key:?}"), "HmacKey(..)");
        assert_eq!(key, HmacKey::from_hex(KEY).expect("key"));
        assert_ne!(key, other);
    }
}
