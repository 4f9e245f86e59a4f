//! Mode snapshots and their signatures: the canonical text a snapshot is signed over (one
//! spelling per snapshot), [`sign`] and [`verify`] with the control key. The rules of the
//! `modes` module documentation, "Signed, one spelling" and the order of the checks, live
//! here.

use std::fmt::Write as _;

use flashsale_io::bounds::MODE_VERSION_MAX;
use flashsale_io::key::HmacKey;
use serde::{Deserialize, Serialize};

use super::types::{Mode, ModeError, Scope};

/// Longest issuer name.
pub const ISSUER_LEN_MAX: usize = 64;
/// Longest canonical snapshot text: the fixed field names (~110 bytes), six decimals of at
/// most 20 digits, the longest mode name and the issuer; 512 leaves room.
pub const SNAPSHOT_TEXT_LEN_MAX: usize = 512;
/// Longest signed envelope accepted by [`SignedSnapshot::from_json`] (also a fit for the admin
/// body limit): the snapshot, 64 hex digits and whitespace a human may add.
pub const SIGNED_JSON_LEN_MAX: usize = 4096;
/// Domain separation: a MAC made for something else with the same key never verifies here.
const MAC_DOMAIN: &[u8] = b"flashsale-mode-v1\n";
/// Hex digits of an HMAC-SHA256 tag.
const SIG_HEX_LEN: usize = 64;

const _: () = assert!(SNAPSHOT_TEXT_LEN_MAX + SIG_HEX_LEN + 32 <= SIGNED_JSON_LEN_MAX);
const _: () = assert!(ISSUER_LEN_MAX + 200 <= SNAPSHOT_TEXT_LEN_MAX);

// ---------------------------------------------------------------------------------------------
// Snapshots
// ---------------------------------------------------------------------------------------------

/// One control decision: from `issued_at_ms` until `expires_at_ms` (exclusive), `scope` is in
/// `mode`; `version` orders the decisions of one scope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SnapshotWire", into = "SnapshotWire")]
pub struct ModeSnapshot {
    /// ≥ 1, strictly increasing per scope.
    pub version: u64,
    pub scope: Scope,
    pub mode: Mode,
    pub issued_at_ms: u64,
    /// Exclusive; must be after `issued_at_ms`.
    pub expires_at_ms: u64,
    /// Who issued it (an operator or the control plane), `[A-Za-z0-9_.@:-]{1,64}`.
    pub issuer: String,
}

/// The JSON shape of a snapshot (field order = the canonical order).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotWire {
    version: u64,
    scope: String,
    mode: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    admit_percent: Option<u8>,
    issued_at_ms: u64,
    expires_at_ms: u64,
    issuer: String,
}

impl TryFrom<SnapshotWire> for ModeSnapshot {
    type Error = ModeError;

    fn try_from(wire: SnapshotWire) -> Result<ModeSnapshot, ModeError> {
        let snapshot = ModeSnapshot {
            version: wire.version,
            scope: Scope::parse(&wire.scope).ok_or(ModeError::Malformed("scope"))?,
            mode: Mode::from_parts(&wire.mode, wire.admit_percent)?,
            issued_at_ms: wire.issued_at_ms,
            expires_at_ms: wire.expires_at_ms,
            issuer: wire.issuer,
        };
        snapshot.validate()?;
        Ok(snapshot)
    }
}

impl From<ModeSnapshot> for SnapshotWire {
    fn from(s: ModeSnapshot) -> SnapshotWire {
        SnapshotWire {
            version: s.version,
            scope: s.scope.to_string(),
            mode: s.mode.name().to_owned(),
            admit_percent: s.mode.percent_field(),
            issued_at_ms: s.issued_at_ms,
            expires_at_ms: s.expires_at_ms,
            issuer: s.issuer,
        }
    }
}

impl ModeSnapshot {
    /// The field rules a struct built in code may break (parsed ones are checked on parse).
    pub fn validate(&self) -> Result<(), ModeError> {
        if self.version == 0 {
            return Err(ModeError::Malformed("version must be at least 1"));
        }
        if self.version > MODE_VERSION_MAX {
            // 2^53 - 1 (io/src/bounds.rs): a version nobody can ever exceed would freeze its
            // scope for good (issue 23).
            return Err(ModeError::Malformed("version over MODE_VERSION_MAX (2^53 - 1)"));
        }
        if self.mode.admit_percent() > 100 {
            return Err(ModeError::Malformed("admit_percent over 100"));
        }
        if self.expires_at_ms <= self.issued_at_ms {
            return Err(ModeError::Malformed("expires_at_ms must be after issued_at_ms"));
        }
        let issuer_ok = !self.issuer.is_empty()
            && self.issuer.len() <= ISSUER_LEN_MAX
            && self.issuer.bytes().all(|b| {
                b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'@' | b':' | b'-')
            });
        if !issuer_ok {
            return Err(ModeError::Malformed("issuer"));
        }
        Ok(())
    }

    /// The text the signature covers: compact JSON, fields in a fixed order, `admit_percent`
    /// only for SHED_LOAD and RECOVERING. Written by hand (not through serde) so that its
    /// spelling is fixed here, in one place, whatever a JSON library version does.
    pub fn canonical_text(&self) -> Result<String, ModeError> {
        self.validate()?;
        let mut out = String::with_capacity(SNAPSHOT_TEXT_LEN_MAX / 2);
        // Writing into a String cannot fail.
        let _ = write!(
            out,
            "{{\"version\":{},\"scope\":\"{}\",\"mode\":\"{}\"",
            self.version,
            self.scope,
            self.mode.name()
        );
        if let Some(percent) = self.mode.percent_field() {
            let _ = write!(out, ",\"admit_percent\":{percent}");
        }
        let _ = write!(
            out,
            ",\"issued_at_ms\":{},\"expires_at_ms\":{},\"issuer\":\"{}\"}}",
            self.issued_at_ms, self.expires_at_ms, self.issuer
        );
        debug_assert!(out.len() <= SNAPSHOT_TEXT_LEN_MAX);
        Ok(out)
    }

    /// Parses a canonical text and refuses any other spelling of it.
    pub fn from_canonical_text(text: &str) -> Result<ModeSnapshot, ModeError> {
        if text.len() > SNAPSHOT_TEXT_LEN_MAX {
            return Err(ModeError::Malformed("snapshot too long"));
        }
        let wire: SnapshotWire =
            serde_json::from_str(text).map_err(|_| ModeError::Malformed("snapshot json"))?;
        let snapshot = ModeSnapshot::try_from(wire)?;
        if snapshot.canonical_text()? != text {
            return Err(ModeError::Malformed("snapshot not in canonical form"));
        }
        Ok(snapshot)
    }

    /// Whether the snapshot has expired at `now_ms`.
    pub fn is_expired(&self, now_ms: u64) -> bool {
        now_ms >= self.expires_at_ms
    }
}

/// A snapshot and its signature, as sent to `POST /admin/v1/mode`, replicated to every
/// instance and persisted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignedSnapshot {
    pub snapshot: ModeSnapshot,
    /// HMAC-SHA256 of the domain prefix and the canonical text: 64 lowercase hex digits.
    pub sig_hex: String,
}

impl SignedSnapshot {
    /// `{"snapshot":{...},"sig_hex":"..."}`, compact.
    pub fn to_json(&self) -> String {
        // Only integers and plain strings: serializing cannot fail.
        serde_json::to_string(self).expect("a signed snapshot always serializes")
    }

    /// Parses an envelope (any JSON spelling, bounded); the signature is checked by
    /// [`verify`] / [`ModeTable::apply`], not here.
    pub fn from_json(text: &str) -> Result<SignedSnapshot, ModeError> {
        if text.len() > SIGNED_JSON_LEN_MAX {
            return Err(ModeError::Malformed("signed snapshot too long"));
        }
        serde_json::from_str(text).map_err(|_| ModeError::Malformed("signed snapshot json"))
    }
}

// ---------------------------------------------------------------------------------------------
// Keys, signing, verification
// ---------------------------------------------------------------------------------------------

/// `FLASHSALE_CONTROL_KEY`, parsed once.
pub fn control_key(hex_key: &str) -> Result<HmacKey, ModeError> {
    HmacKey::from_hex(hex_key).map_err(ModeError::BadKey)
}

/// Signs a snapshot (the admin CLI, the control plane, tests). Refuses a malformed snapshot,
/// which no instance would accept.
pub fn sign(key: &HmacKey, snapshot: ModeSnapshot) -> Result<SignedSnapshot, ModeError> {
    let canonical = snapshot.canonical_text()?;
    let tag = key.tag(&[MAC_DOMAIN, canonical.as_bytes()]);
    Ok(SignedSnapshot { snapshot, sig_hex: hex::encode(tag) })
}

/// Checks form, signature and expiry; returns the snapshot it proves.
pub fn verify(
    key: &HmacKey,
    signed: &SignedSnapshot,
    now_ms: u64,
) -> Result<ModeSnapshot, ModeError> {
    verify_signature(key, signed)?;
    if signed.snapshot.is_expired(now_ms) {
        return Err(ModeError::Expired);
    }
    Ok(signed.snapshot.clone())
}

/// Form and signature only (persisted snapshots are re-verified this way: an expired one
/// still counts).
pub(super) fn verify_signature(key: &HmacKey, signed: &SignedSnapshot) -> Result<(), ModeError> {
    let canonical = signed.snapshot.canonical_text()?;
    let tag = decode_sig_hex(&signed.sig_hex).ok_or(ModeError::BadSignature)?;
    if key.verify(&[MAC_DOMAIN, canonical.as_bytes()], &tag) {
        Ok(())
    } else {
        Err(ModeError::BadSignature)
    }
}

/// Exactly 64 lowercase hex digits (one spelling per tag).
fn decode_sig_hex(sig_hex: &str) -> Option<[u8; 32]> {
    let bytes = sig_hex.as_bytes();
    if bytes.len() != SIG_HEX_LEN || !bytes.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut tag = [0u8; 32];
    hex::decode_to_slice(bytes, &mut tag).ok()?;
    Some(tag)
}
