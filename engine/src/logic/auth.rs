//! User passes (CONTRACT.md 3.1): HMAC-SHA256 tokens that carry the only user id the engine
//! trusts.
//!
//! ```text
//! pass = "v1." kid "." user_id "." activity_id "." exp_unix_s "." sig
//! sig  = base64url_nopad( HMAC-SHA256( key[kid], "v1." kid "." user_id "." activity_id "." exp_unix_s ) )
//! ```
//!
//! What it is: [`PassKeys`] (the keys of `FLASHSALE_PASS_KEYS`, several at once so that keys
//! can rotate: mint with the new kid while passes of the old one are still accepted),
//! [`PassKeys::verify`] on the raw `Authorization` header value, [`UserPass`] (what a valid
//! pass proves) and [`PassKeys::mint`] for tests, the demo and the load generator.
//!
//! Rules, each with its reason:
//! - One spelling per pass: ids are canonical decimals (no sign, no leading zeros), the
//!   signature is exactly 43 base64url characters with no padding and zero trailing bits.
//!   Any other spelling is refused, so a signed pass cannot be re-spelled into a second
//!   accepted string (and every single-byte change of a pass fails, which a property test
//!   checks).
//! - Everything is bounded before it is looked at: the pass ≤ [`PASS_LEN_MAX`] bytes, a kid ≤
//!   [`KID_LEN_MAX`], at most [`PASS_KEYS_MAX`] keys, ids ≤ 20 digits.
//! - The signature is compared in constant time (`hmac`'s `verify_slice`, built on
//!   `subtle`), decoded into a stack array; verification allocates nothing.
//! - The signature is checked before the expiry, so [`PassError::Expired`] (a metric label)
//!   only ever counts genuine passes that ran out, never forgeries.
//! - A pass is valid while `now_unix_s < exp_unix_s`: at `exp_unix_s` itself it has expired.
//! - Each key's HMAC state (inner and outer pads) is computed once in [`PassKeys::parse`]
//!   and cloned per verification; re-keying per call costs two extra SHA-256 block
//!   compressions (see `benches/benches/auth_json.rs` for both figures).
//!
//! What it is not: the HTTP layer (it maps every [`PassError`] to `401 UNAUTHORIZED`) nor the
//! activity policy beyond [`UserPass::authorizes`]. No I/O, no clock: `now_unix_s` is an
//! argument.
//!
//! Read next: `api.rs` (the request bodies the pass authorizes), `ids.rs` (id newtypes).

use std::fmt;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use flashsale_io::key::{HmacKey, KeyError, KEY_LEN_MAX, KEY_LEN_MIN};
use flashsale_io::resp::U64Text;

use crate::logic::ids::{parse_decimal_u64, ActivityId, UserId};

/// The development key installed by `serve --insecure-dev-auth` (kid `dev`). Public by
/// design: anyone can mint passes with it, so it is only for local runs and tests.
pub const DEV_PASS_KEYS: &str = "dev:00112233445566778899aabbccddeeff";

/// Longest pass accepted (the longest well-formed one is about 3 + 32 + 3 × 20 + 4 + 43 =
/// 142 bytes; the margin costs nothing).
pub const PASS_LEN_MAX: usize = 256;
/// Longest key id; kids are `[A-Za-z0-9_-]` (no `.`, `:` or `,`, which delimit passes and
/// the key list).
pub const KID_LEN_MAX: usize = 32;
/// Most keys configured at once (rotation needs two; a few more cover staged roll-outs).
pub const PASS_KEYS_MAX: usize = 16;
/// Longest a pass may still be valid for when it is shown: a day. A pass is minted for one
/// sale (minutes to hours); one that expires later than this was minted wrong, and a leaked
/// one must not keep buying for months.
pub const PASS_LIFETIME_MAX_S: u64 = 24 * 3600;

/// Bytes of an HMAC-SHA256 tag.
const SIG_LEN: usize = 32;
/// base64url without padding of 32 bytes: ceil(32 × 8 / 6).
const SIG_B64_LEN: usize = 43;
const VERSION_PREFIX: &[u8] = b"v1.";
/// The longest signed message: prefix, kid, three decimal u64 and four dots.
const MESSAGE_LEN_MAX: usize = VERSION_PREFIX.len() + KID_LEN_MAX + 3 * 20 + 3;

const _: () = assert!(MESSAGE_LEN_MAX + 1 + SIG_B64_LEN <= PASS_LEN_MAX);
const _: () = assert!(PASS_KEYS_MAX <= u8::MAX as usize, "kid_index is a u8");

// ---------------------------------------------------------------------------------------------
// Keys
// ---------------------------------------------------------------------------------------------

/// Why `FLASHSALE_PASS_KEYS` was refused. Messages name the entry and kid, never key bytes
/// (they end up in logs).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PassKeyError {
    #[error("no pass keys given (expected `kid:hexkey[,kid:hexkey...]`)")]
    Empty,
    #[error("pass key entry {entry}: expected `kid:hexkey`")]
    MissingColon { entry: usize },
    #[error("pass key entry {entry}: empty kid")]
    EmptyKid { entry: usize },
    #[error("pass key entry {entry}: kid must be 1-{KID_LEN_MAX} characters of [A-Za-z0-9_-]")]
    InvalidKid { entry: usize },
    #[error("pass key `{kid}`: key is not an even number of hex digits")]
    BadHex { kid: String },
    #[error("pass key `{kid}`: key has {bytes} bytes, at least {KEY_LEN_MIN} required")]
    KeyTooShort { kid: String, bytes: usize },
    #[error("pass key `{kid}`: key has more than {KEY_LEN_MAX} bytes")]
    KeyTooLong { kid: String },
    #[error("pass key `{kid}` given twice")]
    DuplicateKid { kid: String },
    #[error("more than {PASS_KEYS_MAX} pass keys")]
    TooManyKeys,
}

#[derive(Clone)]
struct PassKey {
    kid: String,
    key: HmacKey,
}

/// The configured pass keys, parsed once at start-up and shared read-only by every shard.
#[derive(Clone)]
pub struct PassKeys {
    keys: Vec<PassKey>,
}

impl fmt::Debug for PassKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Kids only: the key material never reaches a log line.
        f.debug_list().entries(self.keys.iter().map(|key| &key.kid)).finish()
    }
}

fn is_kid(text: &[u8]) -> bool {
    !text.is_empty()
        && text.len() <= KID_LEN_MAX
        && text.iter().all(|&b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl PassKeys {
    /// Parses `kid:hexkey[,kid:hexkey...]` (the `FLASHSALE_PASS_KEYS` format). Spaces around
    /// entries are ignored (`a:00…, b:11…` reads as typed); everything else is strict.
    pub fn parse(text: &str) -> Result<PassKeys, PassKeyError> {
        if text.trim().is_empty() {
            return Err(PassKeyError::Empty);
        }
        let mut keys: Vec<PassKey> = Vec::new();
        for (index, entry) in text.split(',').enumerate() {
            let entry_number = index + 1;
            if keys.len() == PASS_KEYS_MAX {
                return Err(PassKeyError::TooManyKeys);
            }
            let (kid, hex_key) = entry
                .trim()
                .split_once(':')
                .ok_or(PassKeyError::MissingColon { entry: entry_number })?;
            if kid.is_empty() {
                return Err(PassKeyError::EmptyKid { entry: entry_number });
            }
            if !is_kid(kid.as_bytes()) {
                return Err(PassKeyError::InvalidKid { entry: entry_number });
            }
            if keys.iter().any(|key| key.kid == kid) {
                return Err(PassKeyError::DuplicateKid { kid: kid.to_owned() });
            }
            // No white space inside an entry: `kid: 00…` is refused as not hex.
            if hex_key.trim() != hex_key {
                return Err(PassKeyError::BadHex { kid: kid.to_owned() });
            }
            let key = HmacKey::from_hex(hex_key).map_err(|e| {
                let kid = kid.to_owned();
                match e {
                    KeyError::NotHex => PassKeyError::BadHex { kid },
                    KeyError::TooShort { bytes } => PassKeyError::KeyTooShort { kid, bytes },
                    KeyError::TooLong => PassKeyError::KeyTooLong { kid },
                }
            })?;
            keys.push(PassKey { kid: kid.to_owned(), key });
        }
        Ok(PassKeys { keys })
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Always false for a parsed set ([`PassKeys::parse`] refuses an empty list).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The kid of a verified pass's [`UserPass::kid_index`] (for metrics labels).
    pub fn kid(&self, kid_index: u8) -> Option<&str> {
        self.keys.get(usize::from(kid_index)).map(|key| key.kid.as_str())
    }

    /// Verifies an `Authorization` header value `Bearer <pass>` (the scheme is matched
    /// without regard to case, RFC 7235; one or more spaces follow it). An empty value is
    /// [`PassError::Missing`]. The pass is valid while `now_unix_s < exp_unix_s`.
    pub fn verify(
        &self,
        authorization_header: &[u8],
        now_unix_s: u64,
    ) -> Result<UserPass, PassError> {
        let pass = bearer_token(authorization_header)?;
        let parts = PassParts::split(pass).ok_or(PassError::Malformed)?;
        let kid_index = self
            .keys
            .iter()
            .position(|key| key.kid.as_bytes() == parts.kid)
            .ok_or(PassError::UnknownKid)?;
        if !self.keys[kid_index].key.verify(&[parts.message], &parts.sig) {
            return Err(PassError::BadSignature);
        }
        if now_unix_s >= parts.exp_unix_s {
            return Err(PassError::Expired);
        }
        if parts.exp_unix_s - now_unix_s > PASS_LIFETIME_MAX_S {
            return Err(PassError::LifetimeTooLong);
        }
        Ok(UserPass {
            user_id: parts.user_id,
            activity_id: parts.activity_id,
            exp_unix_s: parts.exp_unix_s,
            // At most PASS_KEYS_MAX (16) keys: fits a u8 (checked at compile time above).
            kid_index: kid_index as u8,
        })
    }

    /// Mints a pass signed with `kid` (for tests, the demo and the load generator), or
    /// `None` when no key has that kid.
    pub fn mint(
        &self,
        kid: &str,
        user_id: UserId,
        activity_id: ActivityId,
        exp_unix_s: u64,
    ) -> Option<String> {
        let key = self.keys.iter().find(|key| key.kid == kid)?;
        let mut pass = String::with_capacity(MESSAGE_LEN_MAX + 1 + SIG_B64_LEN);
        pass.push_str("v1.");
        pass.push_str(kid);
        for value in [user_id.get(), activity_id.get(), exp_unix_s] {
            pass.push('.');
            // Decimal digits are ASCII.
            pass.extend(U64Text::new(value).as_bytes().iter().map(|&b| char::from(b)));
        }
        let tag = key.key.tag(&[pass.as_bytes()]);
        pass.push('.');
        URL_SAFE_NO_PAD.encode_string(tag, &mut pass);
        Some(pass)
    }
}

// ---------------------------------------------------------------------------------------------
// Verification
// ---------------------------------------------------------------------------------------------

/// Why a pass was refused. Every variant is `401 UNAUTHORIZED` to the client; the variant
/// exists for metrics ([`PassError::as_str`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PassError {
    #[error("no pass")]
    Missing,
    #[error("malformed pass")]
    Malformed,
    #[error("unknown pass key id")]
    UnknownKid,
    #[error("bad pass signature")]
    BadSignature,
    #[error("pass expired")]
    Expired,
    /// Expires further ahead than [`PASS_LIFETIME_MAX_S`]: a leaked pass must not buy for
    /// months, so the issuer's clock or code is wrong and the pass is refused.
    #[error("pass lifetime over the maximum")]
    LifetimeTooLong,
}

impl PassError {
    /// A stable metrics label.
    pub const fn as_str(self) -> &'static str {
        match self {
            PassError::Missing => "missing",
            PassError::Malformed => "malformed",
            PassError::UnknownKid => "unknown_kid",
            PassError::BadSignature => "bad_signature",
            PassError::Expired => "expired",
            PassError::LifetimeTooLong => "lifetime_too_long",
        }
    }
}

/// What a valid pass proves: this user may act in this activity until `exp_unix_s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UserPass {
    pub user_id: UserId,
    pub activity_id: ActivityId,
    pub exp_unix_s: u64,
    /// Which configured key signed it ([`PassKeys::kid`]).
    pub kid_index: u8,
}

impl UserPass {
    /// True when the pass was issued for `activity_id`; a pass for one sale never buys in
    /// another.
    pub fn authorizes(&self, activity_id: ActivityId) -> bool {
        self.activity_id == activity_id
    }
}

/// The credential of an `Authorization: Bearer <credential>` value: the scheme matched
/// without regard to case (RFC 9110 section 11.1), one or more spaces, a non-empty rest.
/// `None` for anything else. The one reading of a bearer header, for passes and the admin
/// token alike.
pub fn bearer_credential(header: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer";
    if header.len() <= SCHEME.len() || !header[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
        return None;
    }
    let after_scheme = &header[SCHEME.len()..];
    let spaces = after_scheme.iter().take_while(|&&b| b == b' ').count();
    let credential = &after_scheme[spaces..];
    (spaces > 0 && !credential.is_empty()).then_some(credential)
}

/// The pass of a `Bearer` credential, or why there is none.
fn bearer_token(header: &[u8]) -> Result<&[u8], PassError> {
    if header.is_empty() {
        return Err(PassError::Missing);
    }
    match bearer_credential(header) {
        Some(pass) if pass.len() <= PASS_LEN_MAX => Ok(pass),
        _ => Err(PassError::Malformed),
    }
}

/// A syntactically valid pass, split; borrowed from the header.
struct PassParts<'a> {
    kid: &'a [u8],
    user_id: UserId,
    activity_id: ActivityId,
    exp_unix_s: u64,
    /// The signed bytes: everything before the last `.`.
    message: &'a [u8],
    sig: [u8; SIG_LEN],
}

impl<'a> PassParts<'a> {
    fn split(pass: &'a [u8]) -> Option<PassParts<'a>> {
        let rest = pass.strip_prefix(VERSION_PREFIX)?;
        let mut fields = rest.split(|&b| b == b'.');
        let kid = fields.next()?;
        let user_id = fields.next()?;
        let activity_id = fields.next()?;
        let exp_unix_s = fields.next()?;
        let sig_b64 = fields.next()?;
        if fields.next().is_some() || !is_kid(kid) || sig_b64.len() != SIG_B64_LEN {
            return None;
        }
        Some(PassParts {
            kid,
            user_id: UserId::parse_decimal(user_id)?,
            activity_id: ActivityId::parse_decimal(activity_id)?,
            exp_unix_s: parse_decimal_u64(exp_unix_s)?,
            message: &pass[..pass.len() - SIG_B64_LEN - 1],
            sig: decode_sig(sig_b64)?,
        })
    }
}

/// Decodes exactly 43 base64url characters into a 32-byte tag. The engine refuses padding
/// and non-zero trailing bits, so each tag has one spelling.
fn decode_sig(sig_b64: &[u8]) -> Option<[u8; SIG_LEN]> {
    // The decoder's conservative output estimate for 43 characters is 33 bytes.
    let mut out = [0u8; SIG_LEN + 1];
    let len = URL_SAFE_NO_PAD.decode_slice(sig_b64, &mut out).ok()?;
    if len != SIG_LEN {
        return None;
    }
    let mut sig = [0u8; SIG_LEN];
    sig.copy_from_slice(&out[..SIG_LEN]);
    Some(sig)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsale_io::key::HmacSha256;
    use hmac::Mac;
    use proptest::prelude::*;

    const KEY_A: &str = "000102030405060708090a0b0c0d0e0f";
    const KEY_B: &str = "f0e1d2c3b4a5968778695a4b3c2d1e0ff0e1d2c3b4a5968778695a4b3c2d1e0f";
    const NOW: u64 = 1_750_000_000;
    const EXP: u64 = NOW + 600;

    fn keys() -> PassKeys {
        PassKeys::parse(&format!("ka:{KEY_A}, kb:{KEY_B}")).expect("test keys parse")
    }

    fn mint(keys: &PassKeys, kid: &str, user: u64, activity: u64, exp: u64) -> String {
        keys.mint(kid, UserId(user), ActivityId(activity), exp).expect("known kid")
    }

    fn bearer(pass: &str) -> Vec<u8> {
        format!("Bearer {pass}").into_bytes()
    }

    /// Re-signs `message` with `key_hex`, independently of the code under test.
    fn sign(key_hex: &str, message: &str) -> String {
        let key = hex::decode(key_hex).expect("hex");
        let mut mac = HmacSha256::new_from_slice(&key).expect("any key length");
        mac.update(message.as_bytes());
        let sig = URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
        format!("{message}.{sig}")
    }

    #[test]
    fn valid_pass_for_each_key() {
        let keys = keys();
        for (kid, index) in [("ka", 0u8), ("kb", 1u8)] {
            let pass = mint(&keys, kid, 30001, 10001, EXP);
            let verified = keys.verify(&bearer(&pass), NOW).expect("valid pass");
            assert_eq!(
                verified,
                UserPass {
                    user_id: UserId(30001),
                    activity_id: ActivityId(10001),
                    exp_unix_s: EXP,
                    kid_index: index,
                }
            );
            assert_eq!(keys.kid(verified.kid_index), Some(kid));
            assert!(verified.authorizes(ActivityId(10001)));
            assert!(!verified.authorizes(ActivityId(10002)));
        }
    }

    #[test]
    fn mint_matches_the_contract_formula() {
        let keys = keys();
        let expected = sign(KEY_B, &format!("v1.kb.30001.10001.{EXP}"));
        assert_eq!(mint(&keys, "kb", 30001, 10001, EXP), expected);
        assert_eq!(keys.mint("nope", UserId(1), ActivityId(1), EXP), None);
    }

    #[test]
    fn scheme_is_case_insensitive_and_spaces_are_counted() {
        let keys = keys();
        let pass = mint(&keys, "ka", 7, 8, EXP);
        for header in [format!("bearer {pass}"), format!("BEARER   {pass}")] {
            assert!(keys.verify(header.as_bytes(), NOW).is_ok(), "{header}");
        }
        for header in [
            format!("Bearer{pass}"),
            format!("Basic {pass}"),
            format!("Bearer {pass} "),
            format!(" Bearer {pass}"),
            format!("Bearer\t{pass}"),
            "Bearer ".to_owned(),
            "Bearer".to_owned(),
        ] {
            assert_eq!(
                keys.verify(header.as_bytes(), NOW),
                Err(PassError::Malformed),
                "{header:?}"
            );
        }
        assert_eq!(keys.verify(b"", NOW), Err(PassError::Missing));
    }

    #[test]
    fn tampered_fields_fail_the_signature() {
        let keys = keys();
        let pass = mint(&keys, "ka", 30001, 10001, EXP);
        let tampered = [
            pass.replacen(".30001.", ".30002.", 1),
            pass.replacen(".10001.", ".10002.", 1),
            pass.replacen(&format!(".{EXP}."), &format!(".{}.", EXP + 1), 1),
            // Signed by the other key but labelled with this kid.
            sign(KEY_B, &format!("v1.ka.30001.10001.{EXP}")),
        ];
        for forged in tampered {
            assert_ne!(forged, pass);
            assert_eq!(
                keys.verify(&bearer(&forged), NOW),
                Err(PassError::BadSignature),
                "{forged}"
            );
        }
        // The last signature character flipped to another canonical one.
        let mut bytes = pass.clone().into_bytes();
        let last = bytes.len() - 1;
        bytes[last] = if bytes[last] == b'A' { b'E' } else { b'A' };
        let forged = String::from_utf8(bytes).expect("ascii");
        assert_eq!(keys.verify(&bearer(&forged), NOW), Err(PassError::BadSignature));
    }

    #[test]
    fn unknown_kid() {
        let keys = keys();
        let foreign = sign(KEY_A, &format!("v1.kc.30001.10001.{EXP}"));
        assert_eq!(keys.verify(&bearer(&foreign), NOW), Err(PassError::UnknownKid));
    }

    #[test]
    fn expiry_is_exclusive() {
        let keys = keys();
        let pass = mint(&keys, "ka", 1, 2, EXP);
        assert!(keys.verify(&bearer(&pass), EXP - 1).is_ok());
        assert_eq!(keys.verify(&bearer(&pass), EXP), Err(PassError::Expired), "exp == now");
        assert_eq!(keys.verify(&bearer(&pass), EXP + 1), Err(PassError::Expired));
        // A forged pass that is also expired reports the forgery, not the expiry.
        let forged = pass.replacen(".1.", ".3.", 1);
        assert_eq!(keys.verify(&bearer(&forged), EXP + 1), Err(PassError::BadSignature));
    }

    #[test]
    fn malformed_shapes() {
        let keys = keys();
        let pass = mint(&keys, "ka", 30001, 10001, EXP);
        let sig = pass.rsplit('.').next().expect("has a sig").to_owned();
        let cases = [
            format!("v2.ka.30001.10001.{EXP}.{sig}"),
            format!("ka.30001.10001.{EXP}.{sig}"),
            format!("v1.ka.30001.10001.{sig}"),
            format!("v1.ka.30001.10001.{EXP}"),
            format!("v1.ka.30001.10001.{EXP}.{sig}.x"),
            format!("v1.ka.30001..10001.{EXP}.{sig}"),
            format!("v1..30001.10001.{EXP}.{sig}"),
            format!("v1.k!.30001.10001.{EXP}.{sig}"),
            format!("v1.{}.30001.10001.{EXP}.{sig}", "k".repeat(KID_LEN_MAX + 1)),
            format!("v1.ka.+30001.10001.{EXP}.{sig}"),
            format!("v1.ka.030001.10001.{EXP}.{sig}"),
            format!("v1.ka.3000a.10001.{EXP}.{sig}"),
            format!("v1.ka.0.10001.{EXP}.{sig}"),
            format!("v1.ka.9223372036854775808.10001.{EXP}.{sig}"),
            format!("v1.ka.30001.10001.99999999999999999999.{sig}"),
            format!("v1.ka.30001.10001.{EXP}.{sig}="),
            format!("v1.ka.30001.10001.{EXP}.{}=", &sig[..42]),
            format!("v1.ka.30001.10001.{EXP}.{}", &sig[..42]),
            format!("v1.ka.30001.10001.{EXP}.{}+", &sig[..42]),
            format!("v1.ka.30001.10001.{EXP}.{}/", &sig[..42]),
            format!("v1.ka.30001.10001.{EXP}.{}", "A".repeat(44)),
            format!("v1.ka.30001.10001.{EXP}.{sig}{}", "A".repeat(PASS_LEN_MAX)),
        ];
        for case in cases {
            assert_eq!(keys.verify(&bearer(&case), NOW), Err(PassError::Malformed), "{case}");
        }
        // Non-zero trailing bits: the same 32 bytes in a second spelling.
        let last = sig.as_bytes()[42];
        let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let position = alphabet.iter().position(|&c| c == last).expect("base64url");
        assert_eq!(position % 4, 0, "the canonical last character has zero trailing bits");
        let respelled =
            format!("{}{}", &pass[..pass.len() - 1], char::from(alphabet[position + 1]));
        assert_eq!(keys.verify(&bearer(&respelled), NOW), Err(PassError::Malformed));
    }

    #[test]
    fn key_list_errors() {
        let a16 = "00".repeat(16);
        assert!(PassKeys::parse(&format!("k1:{a16}")).is_ok());
        assert_eq!(PassKeys::parse("").err(), Some(PassKeyError::Empty));
        assert_eq!(PassKeys::parse("  ").err(), Some(PassKeyError::Empty));
        assert_eq!(PassKeys::parse(&a16).err(), Some(PassKeyError::MissingColon { entry: 1 }));
        assert_eq!(
            PassKeys::parse(&format!("k1:{a16},:{a16}")).err(),
            Some(PassKeyError::EmptyKid { entry: 2 })
        );
        assert_eq!(
            PassKeys::parse(&format!("k.1:{a16}")).err(),
            Some(PassKeyError::InvalidKid { entry: 1 })
        );
        assert_eq!(
            PassKeys::parse(&format!("k1:{a16},")).err(),
            Some(PassKeyError::MissingColon { entry: 2 })
        );
        let bad_hex = PassKeyError::BadHex { kid: "k1".to_owned() };
        assert_eq!(PassKeys::parse(&format!("k1:{a16}0")).err(), Some(bad_hex.clone()));
        assert_eq!(PassKeys::parse(&format!("k1:zz{}", "00".repeat(15))).err(), Some(bad_hex));
        assert_eq!(
            PassKeys::parse(&format!("k1:{}", "00".repeat(15))).err(),
            Some(PassKeyError::KeyTooShort { kid: "k1".to_owned(), bytes: 15 })
        );
        assert_eq!(
            PassKeys::parse(&format!("k1:{}", "00".repeat(65))).err(),
            Some(PassKeyError::KeyTooLong { kid: "k1".to_owned() })
        );
        assert_eq!(
            PassKeys::parse(&format!("k1:{a16},k1:{a16}")).err(),
            Some(PassKeyError::DuplicateKid { kid: "k1".to_owned() })
        );
        let sixteen: Vec<String> = (0..16).map(|i| format!("k{i}:{a16}")).collect();
        assert_eq!(PassKeys::parse(&sixteen.join(",")).map(|k| k.len()).ok(), Some(16));
        let seventeen: Vec<String> = (0..17).map(|i| format!("k{i}:{a16}")).collect();
        assert_eq!(PassKeys::parse(&seventeen.join(",")).err(), Some(PassKeyError::TooManyKeys));
    }

    #[test]
    fn debug_and_errors_hide_key_material() {
        let keys = keys();
        let shown = format!("{keys:?}");
        assert_eq!(shown, r#"["ka", "kb"]"#);
        let Err(error) = PassKeys::parse(&format!("k1:{}", "ab".repeat(15))) else {
            panic!("a 15-byte key must be refused");
        };
        assert!(!error.to_string().contains("abab"), "{error}");
    }

    proptest! {
        #[test]
        fn mint_verify_round_trips(
            user in 1..=i64::MAX as u64,
            activity in 1..=i64::MAX as u64,
            exp in 1..=u64::MAX,
            use_b in any::<bool>(),
        ) {
            let keys = keys();
            let kid = if use_b { "kb" } else { "ka" };
            let pass = mint(&keys, kid, user, activity, exp);
            prop_assert!(pass.len() <= PASS_LEN_MAX);
            let verified = keys.verify(&bearer(&pass), exp - 1);
            prop_assert_eq!(verified.map(|p| (p.user_id, p.activity_id, p.exp_unix_s)),
                Ok((UserId(user), ActivityId(activity), exp)));
        }

        #[test]
        fn any_single_byte_change_fails(
            user in 1..=i64::MAX as u64,
            activity in 1..=i64::MAX as u64,
            position in any::<prop::sample::Index>(),
            replacement in any::<u8>(),
        ) {
            let keys = keys();
            let mut pass = mint(&keys, "ka", user, activity, EXP).into_bytes();
            let at = position.index(pass.len());
            prop_assume!(pass[at] != replacement);
            pass[at] = replacement;
            let mut header = b"Bearer ".to_vec();
            header.extend_from_slice(&pass);
            prop_assert!(keys.verify(&header, NOW).is_err());
        }
    }
}
