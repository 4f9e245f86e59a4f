//! What a handler knows about the connection its request came on: the listener (plane), the
//! client's address (the TCP peer's, or the one a trusted balancer's PROXY header carried)
//! and whether the connection is a health probe's.
//!
//! Not here: the connection loop that fills it in (`conn.rs`).

use std::net::IpAddr;

/// Which listener a connection came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plane {
    Public,
    Admin,
}

/// Facts about the connection a handler may need.
pub struct RequestCtx {
    /// The client's address: the TCP peer's, or the source a trusted balancer's PROXY header
    /// carried (IPv4-mapped IPv6 as IPv4). What the per-address limits and logs use.
    pub peer_ip: Option<IpAddr>,
    /// Whether that address is loopback.
    pub peer_is_loopback: bool,
    pub plane: Plane,
    /// A connection admitted beyond the admin plane's budget: only the health probes
    /// (`/livez`, `/readyz`) are answered on it, once, within `conn::PROBE_DEADLINE_MS`.
    pub probe_only: bool,
}
