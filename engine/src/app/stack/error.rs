//! The stack's one error type, [`StackError`], and `io_err`, the adapter every starter uses
//! to name what it was doing when an I/O call failed.
//!
//! Not here: what a failure means to a caller (`flashsale stack up` prints it and exits 1, a
//! test fails); retrying on a fresh port is `server.rs`'s own business.

#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error(
        "`{binary}` not found (looked in PATH and {searched}); install the Debian package: \
         apt-get install -y {package}"
    )]
    MissingBinary { binary: &'static str, package: &'static str, searched: String },
    #[error("{service}: {message}")]
    Service { service: &'static str, message: String },
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    /// A signal was not sent (or did not take): the recorded process is gone, or is not the
    /// server we started, or did not reach the state the signal asks for.
    #[error("{service}: refused to signal pid {pid}: {reason}")]
    Refused { service: &'static str, pid: u32, reason: String },
}

pub(super) fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> StackError {
    let context = context.into();
    move |source| StackError::Io { context, source }
}
