//! The vocabulary of the mode rules: [`Mode`] (what submissions are switched to), [`Scope`]
//! (which submissions a snapshot governs, with its one text spelling) and [`ModeError`] (why
//! a snapshot, key or persisted state was refused, with its stable label).
//!
//! Not here: the signed snapshot (`snapshot.rs`), the rules between modes (`table.rs`), the
//! persisted text (`persist.rs`). No I/O, no clock.

use std::fmt;

use flashsale_io::key::KeyError;

// ---------------------------------------------------------------------------------------------
// Modes and scopes
// ---------------------------------------------------------------------------------------------

/// A degradation mode (seed chapter 9 §6.9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Submissions open.
    Normal,
    /// Admit `admit_percent` % of submissions (raised limits during overload).
    ShedLoad { admit_percent: u8 },
    /// No new reservations; existing messages, queries and payments continue.
    SubmitClosed,
    /// Only queries, payment confirmation and operations.
    QueryOnly,
    /// Re-opening after a closure: admit `admit_percent` %, raised in steps.
    Recovering { admit_percent: u8 },
}

impl Mode {
    /// The name used in snapshots, logs and the admin API.
    pub const fn name(self) -> &'static str {
        match self {
            Mode::Normal => "NORMAL",
            Mode::ShedLoad { .. } => "SHED_LOAD",
            Mode::SubmitClosed => "SUBMIT_CLOSED",
            Mode::QueryOnly => "QUERY_ONLY",
            Mode::Recovering { .. } => "RECOVERING",
        }
    }

    /// The share of submissions this mode admits, in percent.
    pub const fn admit_percent(self) -> u8 {
        match self {
            Mode::Normal => 100,
            Mode::ShedLoad { admit_percent } | Mode::Recovering { admit_percent } => admit_percent,
            Mode::SubmitClosed | Mode::QueryOnly => 0,
        }
    }

    /// The value of the `flashsale_mode` gauge: higher is more closed, so the maximum over
    /// instances or SKUs is the worst one. NORMAL 0, SHED_LOAD 1, RECOVERING 2,
    /// SUBMIT_CLOSED 3, QUERY_ONLY 4.
    pub const fn metric_value(self) -> u8 {
        match self {
            Mode::Normal => 0,
            Mode::ShedLoad { .. } => 1,
            Mode::Recovering { .. } => 2,
            Mode::SubmitClosed => 3,
            Mode::QueryOnly => 4,
        }
    }

    /// Whether this mode refuses every new submission.
    pub const fn closes_submissions(self) -> bool {
        matches!(self, Mode::SubmitClosed | Mode::QueryOnly)
    }

    pub(super) fn percent_field(self) -> Option<u8> {
        match self {
            Mode::ShedLoad { admit_percent } | Mode::Recovering { admit_percent } => {
                Some(admit_percent)
            }
            _ => None,
        }
    }

    /// A mode from its name and, for SHED_LOAD / RECOVERING only, its share (the snapshot's
    /// `mode` and `admit_percent` fields; the admin CLI's flags).
    pub fn from_parts(name: &str, percent: Option<u8>) -> Result<Mode, ModeError> {
        let mode = match (name, percent) {
            ("NORMAL", None) => Mode::Normal,
            ("SUBMIT_CLOSED", None) => Mode::SubmitClosed,
            ("QUERY_ONLY", None) => Mode::QueryOnly,
            ("SHED_LOAD", Some(admit_percent)) => Mode::ShedLoad { admit_percent },
            ("RECOVERING", Some(admit_percent)) => Mode::Recovering { admit_percent },
            ("SHED_LOAD" | "RECOVERING", None) => {
                return Err(ModeError::Malformed("admit_percent required"))
            }
            ("NORMAL" | "SUBMIT_CLOSED" | "QUERY_ONLY", Some(_)) => {
                return Err(ModeError::Malformed("admit_percent not allowed"))
            }
            _ => return Err(ModeError::Malformed("unknown mode")),
        };
        if mode.admit_percent() > 100 {
            return Err(ModeError::Malformed("admit_percent over 100"));
        }
        Ok(mode)
    }
}

/// Which submissions a snapshot governs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    Global,
    /// Every SKU of one activity.
    Activity(u64),
    /// One SKU of one activity: `(activity_id, sku_id)`.
    Sku(u64, u64),
}

impl Scope {
    /// `"global"`, `"activity:<a>"` or `"sku:<a>:<s>"` (decimals without sign or leading zeros).
    pub fn parse(text: &str) -> Option<Scope> {
        if text == "global" {
            return Some(Scope::Global);
        }
        if let Some(rest) = text.strip_prefix("activity:") {
            return canonical_u64(rest).map(Scope::Activity);
        }
        let rest = text.strip_prefix("sku:")?;
        let (activity, sku) = rest.split_once(':')?;
        Some(Scope::Sku(canonical_u64(activity)?, canonical_u64(sku)?))
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scope::Global => f.write_str("global"),
            Scope::Activity(a) => write!(f, "activity:{a}"),
            Scope::Sku(a, s) => write!(f, "sku:{a}:{s}"),
        }
    }
}

/// A decimal u64 in its one spelling: digits only, no leading zero (except "0" itself).
fn canonical_u64(text: &str) -> Option<u64> {
    let bytes = text.as_bytes();
    let well_formed = !bytes.is_empty()
        && bytes.len() <= 20
        && bytes.iter().all(u8::is_ascii_digit)
        && (bytes[0] != b'0' || bytes.len() == 1);
    if !well_formed {
        return None;
    }
    text.parse().ok()
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Why a snapshot (or a key, or a persisted state) was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModeError {
    /// Not a well-formed snapshot / envelope / persisted state; says which part.
    Malformed(&'static str),
    /// The signature does not match (forged, altered, or signed with another key).
    BadSignature,
    /// Genuine but past `expires_at_ms`.
    Expired,
    /// The scope already holds this version or a newer one.
    StaleVersion { scope: Scope, current: u64, offered: u64 },
    /// An operator's snapshot jumps more than `MODE_VERSION_STEP_MAX` above the scope's
    /// current version (a typo of a few digits would otherwise take every version above it).
    VersionJump { scope: Scope, current: u64, offered: u64, step_max: u64 },
    /// Leaving QUERY_ONLY (or a recovery in progress) other than through RECOVERING.
    MustRecover { scope: Scope, from: Mode, to: Mode },
    /// RECOVERING raised by more than the configured step (or NORMAL before 100 %).
    StepTooLarge { scope: Scope, from_percent: u8, to_percent: u8, step_max: u8 },
    /// A new scope while [`ModeConfig::scopes_max`] scopes are held.
    TableFull { scopes_max: usize },
    /// `FLASHSALE_CONTROL_KEY` unusable.
    BadKey(KeyError),
}

impl ModeError {
    /// A short stable label (metrics, the admin API's `reason_code`).
    pub const fn label(&self) -> &'static str {
        match self {
            ModeError::Malformed(_) => "MALFORMED",
            ModeError::BadSignature => "BAD_SIGNATURE",
            ModeError::Expired => "EXPIRED",
            ModeError::StaleVersion { .. } => "STALE_VERSION",
            ModeError::VersionJump { .. } => "VERSION_JUMP",
            ModeError::MustRecover { .. } => "MUST_RECOVER",
            ModeError::StepTooLarge { .. } => "STEP_TOO_LARGE",
            ModeError::TableFull { .. } => "TABLE_FULL",
            ModeError::BadKey(_) => "BAD_KEY",
        }
    }
}

impl fmt::Display for ModeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModeError::Malformed(what) => write!(f, "malformed mode snapshot: {what}"),
            ModeError::BadSignature => f.write_str("mode snapshot signature does not verify"),
            ModeError::Expired => f.write_str("mode snapshot expired"),
            ModeError::StaleVersion { scope, current, offered } => {
                write!(f, "{scope}: version {offered} is not above the current {current}")
            }
            ModeError::VersionJump { scope, current, offered, step_max } => write!(
                f,
                "{scope}: version {offered} jumps more than {step_max} above the current {current}"
            ),
            ModeError::MustRecover { scope, from, to } => write!(
                f,
                "{scope}: {} -> {} refused; leave QUERY_ONLY through RECOVERING steps",
                from.name(),
                to.name()
            ),
            ModeError::StepTooLarge { scope, from_percent, to_percent, step_max } => write!(
                f,
                "{scope}: RECOVERING {from_percent}% -> {to_percent}% exceeds the step of \
                 {step_max}%"
            ),
            ModeError::TableFull { scopes_max } => {
                write!(f, "mode table full ({scopes_max} scopes)")
            }
            ModeError::BadKey(why) => write!(f, "FLASHSALE_CONTROL_KEY: {why}"),
        }
    }
}

impl std::error::Error for ModeError {}
