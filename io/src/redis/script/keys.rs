//! The key names of one SKU (`seckill:{A:S}:...`, CONTRACT.md section 5): [`SkuKeys`], built
//! once per SKU, and [`KeyBuf`], a per-call key (user, request, reservation, compensation
//! marker) written on the stack so that a call allocates no key strings. Also the bound every
//! id sent to the library obeys ([`ID_LEN_MAX`]).
//!
//! What it is not: a command. Which keys each function takes (its KEYS) is spelled by the
//! calls in `client.rs`, in the order `lua/seckill.lua` documents.
//!
//! Read next: `client.rs`.

use std::fmt;

use super::error::ScriptError;
use crate::redis::slot::Slot;
use crate::resp::U64Text;

/// Longest id (request, reservation, message, order, payload hash) the library accepts; the
/// Lua side enforces the same bound (`ID_LEN_MAX`).
pub const ID_LEN_MAX: usize = 128;

/// Longest SKU prefix: `seckill:{` + u64 + `:` + u64 + `}:`.
const PREFIX_LEN_MAX: usize = 9 + 20 + 1 + 20 + 2;

/// Longest key built per call: prefix + `resv:` / `comp:` / `user:` + an id, or prefix +
/// `req:` + a u64 user id + `:` + an id (the longest).
const KEY_LEN_MAX: usize = PREFIX_LEN_MAX + 4 + 20 + 1 + ID_LEN_MAX;

const _: () = assert!(KEY_LEN_MAX <= 224, "per-call keys live on the stack; keep them small");
const _: () = assert!(20 <= ID_LEN_MAX, "a u64 user id must fit where an id fits");

/// The key names of one SKU (`seckill:{A:S}:...`, CONTRACT.md section 5), built once per SKU.
/// Per-call keys (user, request, reservation, compensation marker) are written into a
/// [`KeyBuf`] on the stack, so a call allocates no key strings.
#[derive(Debug, Clone)]
pub struct SkuKeys {
    /// The Redis Cluster slot of every key of this SKU (they share the `{A:S}` hash tag).
    slot: Slot,
    prefix: String,
    meta: String,
    stock: String,
    pending: String,
    stuck: String,
    soldout: String,
    rebuild: String,
}

impl SkuKeys {
    pub fn new(activity_id: u64, sku_id: u64) -> SkuKeys {
        let prefix = format!("seckill:{{{activity_id}:{sku_id}}}:");
        debug_assert!(prefix.len() <= PREFIX_LEN_MAX);
        SkuKeys {
            slot: Slot::of_key(prefix.as_bytes()),
            meta: format!("{prefix}meta"),
            stock: format!("{prefix}stock"),
            pending: format!("{prefix}resv:pending"),
            stuck: format!("{prefix}resv:stuck"),
            soldout: format!("{prefix}soldout"),
            rebuild: format!("{prefix}rebuild"),
            prefix,
        }
    }

    /// The slot all of this SKU's keys live in: what every call for this SKU routes by.
    pub fn slot(&self) -> Slot {
        self.slot
    }

    /// `seckill:{A:S}:`, the `key_prefix` argument of `claim_due`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    pub fn meta(&self) -> &str {
        &self.meta
    }
    pub fn stock(&self) -> &str {
        &self.stock
    }
    /// `resv:pending`: reservations whose outcome has not reached Redis, by next_retry_at.
    pub fn pending(&self) -> &str {
        &self.pending
    }
    /// `resv:stuck`: reservations past the recovery deadline, by the time they got stuck.
    pub fn stuck(&self) -> &str {
        &self.stuck
    }
    pub fn soldout(&self) -> &str {
        &self.soldout
    }
    /// `rebuild`: the lock of a rebuild from PostgreSQL (`restore`), held by one rebuilder.
    pub fn rebuild(&self) -> &str {
        &self.rebuild
    }

    pub fn user(&self, user_id: u64) -> KeyBuf {
        let digits = U64Text::new(user_id);
        // A u64 always fits (checked at compile time above), so this cannot fail.
        KeyBuf::build(&self.prefix, "user:", digits.as_bytes())
            .unwrap_or_else(|| unreachable!("u64 user key exceeds KEY_LEN_MAX"))
    }

    /// `req:{user_id}:{request_id}`: a request id is the buyer's own (another buyer can
    /// neither see nor squat it).
    pub fn req(&self, user_id: u64, request_id: &str) -> Result<KeyBuf, ScriptError> {
        check_id(request_id, "request_id")?;
        let digits = U64Text::new(user_id);
        let parts: [&[u8]; 4] = [b"req:", digits.as_bytes(), b":", request_id.as_bytes()];
        KeyBuf::build_parts(&self.prefix, &parts).ok_or(ScriptError::InvalidArgument("request_id"))
    }

    pub fn resv(&self, reservation_id: &str) -> Result<KeyBuf, ScriptError> {
        self.with_id("resv:", reservation_id, "reservation_id")
    }

    pub fn comp(&self, reservation_id: &str) -> Result<KeyBuf, ScriptError> {
        self.with_id("comp:", reservation_id, "reservation_id")
    }

    fn with_id(&self, kind: &str, id: &str, name: &'static str) -> Result<KeyBuf, ScriptError> {
        check_id(id, name)?;
        KeyBuf::build(&self.prefix, kind, id.as_bytes()).ok_or(ScriptError::InvalidArgument(name))
    }
}

/// An id the library accepts: 1..=[`ID_LEN_MAX`] bytes.
pub(super) fn check_id(id: &str, name: &'static str) -> Result<(), ScriptError> {
    if id.is_empty() || id.len() > ID_LEN_MAX {
        return Err(ScriptError::InvalidArgument(name));
    }
    Ok(())
}

/// A key built on the stack: prefix + kind + id, at most `KEY_LEN_MAX` bytes.
#[derive(Clone, Copy)]
pub struct KeyBuf {
    len: usize,
    bytes: [u8; KEY_LEN_MAX],
}

impl KeyBuf {
    fn build(prefix: &str, kind: &str, id: &[u8]) -> Option<KeyBuf> {
        KeyBuf::build_parts(prefix, &[kind.as_bytes(), id])
    }

    fn build_parts(prefix: &str, parts: &[&[u8]]) -> Option<KeyBuf> {
        let len = prefix.len() + parts.iter().map(|p| p.len()).sum::<usize>();
        if len > KEY_LEN_MAX {
            return None;
        }
        let mut bytes = [0u8; KEY_LEN_MAX];
        bytes[..prefix.len()].copy_from_slice(prefix.as_bytes());
        let mut at = prefix.len();
        for part in parts {
            bytes[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
        Some(KeyBuf { len, bytes })
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// The key as text (keys are built from UTF-8 parts, so this is lossless).
    pub fn as_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(self.as_bytes())
    }
}

impl fmt::Debug for KeyBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyBuf({:?})", self.as_str())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_contract() {
        let keys = SkuKeys::new(10001, 20001);
        assert_eq!(keys.prefix(), "seckill:{10001:20001}:");
        assert_eq!(keys.meta(), "seckill:{10001:20001}:meta");
        assert_eq!(keys.stock(), "seckill:{10001:20001}:stock");
        assert_eq!(keys.pending(), "seckill:{10001:20001}:resv:pending");
        assert_eq!(keys.stuck(), "seckill:{10001:20001}:resv:stuck");
        assert_eq!(keys.soldout(), "seckill:{10001:20001}:soldout");
        assert_eq!(keys.user(30001).as_str(), "seckill:{10001:20001}:user:30001");
        assert_eq!(keys.user(0).as_str(), "seckill:{10001:20001}:user:0");
        assert_eq!(keys.req(30001, "r1").unwrap().as_str(), "seckill:{10001:20001}:req:30001:r1");
        assert_eq!(keys.resv("v1").unwrap().as_str(), "seckill:{10001:20001}:resv:v1");
        assert_eq!(keys.comp("v1").unwrap().as_str(), "seckill:{10001:20001}:comp:v1");
    }

    #[test]
    fn longest_keys_fit_and_overlong_ids_are_refused() {
        let keys = SkuKeys::new(u64::MAX, u64::MAX);
        let id = "x".repeat(ID_LEN_MAX);
        let key = keys.resv(&id).unwrap();
        assert_eq!(key.as_bytes().len(), keys.prefix().len() + 5 + ID_LEN_MAX);
        assert_eq!(keys.user(u64::MAX).as_str(), format!("{}user:{}", keys.prefix(), u64::MAX));
        let too_long = "x".repeat(ID_LEN_MAX + 1);
        let longest = keys.req(u64::MAX, &id).unwrap();
        assert_eq!(longest.as_bytes().len(), keys.prefix().len() + 4 + 20 + 1 + ID_LEN_MAX);
        let too_long_req = keys.req(1, &too_long);
        assert!(matches!(too_long_req, Err(ScriptError::InvalidArgument("request_id"))));
        assert!(matches!(keys.comp(""), Err(ScriptError::InvalidArgument("reservation_id"))));
    }
}
