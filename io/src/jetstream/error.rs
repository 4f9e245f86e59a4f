//! The one error type of the JetStream client ([`LogError`]), with the two questions its
//! callers ask of it: worth retrying ([`LogError::is_transient`]) and may the publish have
//! happened anyway ([`LogError::is_outcome_unknown`]).
//!
//! What it is not: a business outcome. A full stream or a publish timeout is reported here; what
//! the edge answers the buyer (`QUEUED_PENDING`) and whether the worker NAKs or dead-letters is
//! decided by the callers.
//!
//! Read next: `publisher.rs`, where "outcome unknown" comes from.

/// Every failure of the log client.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A configuration that the server or client would refuse or silently change.
    #[error("invalid log configuration: {0}")]
    Config(String),
    #[error("cannot connect to NATS at {url}: {message}")]
    Connect { url: String, message: String },
    /// No ack within the publish timeout: the message may or may not be in the stream
    /// ("unknown is a state"); republishing with the same `Nats-Msg-Id` is safe.
    #[error("publish to {subject}: no ack within {timeout_ms} ms (outcome unknown)")]
    PublishTimeout { subject: String, timeout_ms: u64 },
    /// No stream answered for the subject until the deadline (a leader change that outlasted
    /// the publish timeout, or the streams were never created).
    #[error("publish to {subject}: no stream found (retried until the deadline)")]
    NoStream { subject: String },
    #[error("publish to {subject} failed: {message}")]
    Publish { subject: String, message: String, transient: bool },
    /// A JetStream API call (stream/consumer management, info) failed.
    #[error("jetstream {op}: {message}")]
    Api { op: &'static str, message: String, transient: bool },
    /// Pulling messages failed (connection trouble, consumer deleted).
    #[error("fetch from {consumer}: {message}")]
    Fetch { consumer: &'static str, message: String },
    /// Sending an ack/NAK/TERM failed. The server redelivers after `ack_wait`.
    #[error("{kind} failed: {message}")]
    Ack { kind: &'static str, message: String },
}

impl LogError {
    /// Worth retrying later with the same input.
    pub fn is_transient(&self) -> bool {
        match self {
            LogError::Config(_) => false,
            LogError::Connect { .. }
            | LogError::PublishTimeout { .. }
            | LogError::NoStream { .. }
            | LogError::Fetch { .. }
            | LogError::Ack { .. } => true,
            LogError::Publish { transient, .. } | LogError::Api { transient, .. } => *transient,
        }
    }

    /// True when a publish may have succeeded although we got no ack.
    pub fn is_outcome_unknown(&self) -> bool {
        matches!(self, LogError::PublishTimeout { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_classification() {
        assert!(LogError::PublishTimeout { subject: "s".into(), timeout_ms: 1 }.is_transient());
        assert!(
            LogError::PublishTimeout { subject: "s".into(), timeout_ms: 1 }.is_outcome_unknown()
        );
        assert!(LogError::NoStream { subject: "s".into() }.is_transient());
        assert!(!LogError::NoStream { subject: "s".into() }.is_outcome_unknown());
        assert!(!LogError::Config("x".into()).is_transient());
        assert!(!LogError::Publish { subject: "s".into(), message: "m".into(), transient: false }
            .is_transient());
    }
}
