//! The readers every reply parser shares: a Lua string, an optional string ("" is absent in
//! the library's flat replies), an integer (a reply or a hash field's digits), an array of an
//! exact length. Pure; none panics on what a server sent.
//!
//! What it is not: the meaning of any reply. Each function's parser (`reserve.rs`,
//! `claim_due.rs`, ...) says which element is what.
//!
//! Read next: `reserve.rs`, the largest of the parsers.

use super::error::{unexpected, ScriptError};
use crate::resp::Reply;

/// A string element (Lua strings arrive as bulk strings; status replies as simple strings).
pub(super) fn text(reply: &Reply) -> Option<&str> {
    match reply {
        Reply::Bulk(b) | Reply::Simple(b) => std::str::from_utf8(b).ok(),
        _ => None,
    }
}

/// [`text`], owned.
pub(super) fn owned(reply: &Reply) -> Option<String> {
    text(reply).map(str::to_owned)
}

/// "" means absent in the library's flat replies.
pub(super) fn optional(reply: &Reply) -> Option<Option<String>> {
    text(reply).map(|s| if s.is_empty() { None } else { Some(s.to_owned()) })
}

/// An integer element: an integer reply, or a bulk string of decimal digits (hash fields).
pub(super) fn int(reply: &Reply) -> Option<i64> {
    match reply {
        Reply::Integer(n) => Some(*n),
        Reply::Bulk(b) | Reply::Simple(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

/// [`int`], when it is not negative.
pub(super) fn uint(reply: &Reply) -> Option<u64> {
    int(reply).and_then(|n| u64::try_from(n).ok())
}

/// The elements of an array reply of exactly `len` elements (anything else is unexpected).
pub(super) fn array<'r>(
    function: &str,
    reply: &'r Reply,
    len: usize,
) -> Result<&'r [Reply], ScriptError> {
    match reply {
        Reply::Array(items) if items.len() == len => Ok(items),
        _ => Err(unexpected(function, "wrong shape", reply)),
    }
}

/// Replies as a server sends them, for the parsers' unit tests.
#[cfg(test)]
pub(super) mod fixtures {
    use std::fmt;

    use bytes::Bytes;

    use super::super::error::ScriptError;
    use crate::resp::Reply;

    pub fn bulk(s: &str) -> Reply {
        Reply::Bulk(Bytes::copy_from_slice(s.as_bytes()))
    }

    pub fn arr(items: Vec<Reply>) -> Reply {
        Reply::Array(items)
    }

    pub fn expect_unexpected<T: fmt::Debug>(r: Result<T, ScriptError>) {
        match r {
            Err(ScriptError::UnexpectedReply(_)) => {}
            other => panic!("expected UnexpectedReply, got {other:?}"),
        }
    }
}
