//! [`UsageError`]: input a backup command refuses before it touches anything (no such backup
//! directory, a restore time before the backup finished or in the future, a backup directory
//! that is not empty). `main` exits 2 for it, as for a command line clap refused (CONTRACT.md
//! section 1: 2 on usage errors).
//!
//! Not here: failures of the servers or of a restore (exit 1).

/// A refused input, in words the operator can act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);
