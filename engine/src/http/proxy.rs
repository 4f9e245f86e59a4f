//! The PROXY protocol, versions 1 and 2 (haproxy's `doc/proxy-protocol.txt`): the header an
//! L4 balancer puts in front of a relayed connection to say who the client really is.
//! Sans-I/O: bytes in, a [`ProxyParse`] out — "not enough bytes yet" is the normal value
//! [`ProxyParse::Incomplete`], never an error.
//!
//! Also here: [`TrustedSources`], the CIDR list (`FLASHSALE_PROXY_PROTOCOL_FROM`) of the
//! balancers whose header is required and believed. The protocol has no authentication of
//! its own: a header from anyone else would let a client choose the address it is limited
//! and logged by, so the connection loop refuses it (400, close), and a trusted balancer's
//! connection without a valid header is closed (the spec: "the receiver MUST NOT try to
//! guess whether the protocol header is present or not").
//!
//! Strictness, each rule a door closed:
//! - v1: `PROXY` SP (`TCP4`|`TCP6`) SP src SP dst SP sport SP dport CRLF, single spaces,
//!   canonical IPv4 (no leading zeros), IPv6 in hex-and-colon form only, decimal ports without
//!   leading zeros; `PROXY UNKNOWN` followed by anything visible up to CRLF. The whole line
//!   is at most [`V1_LINE_BYTES_MAX`] bytes; a bare CR or LF is refused.
//! - v2: the 12-byte signature, version 2, command LOCAL or PROXY, one of the seven
//!   family/protocol bytes the spec lists, an address block at least as long as its family
//!   needs, TLVs that exactly tile the rest, a CRC32C TLV (if sent) that matches, and the
//!   whole header at most [`V2_HEADER_BYTES_MAX`] bytes (refused as soon as the fixed part
//!   announces more, before the rest arrives).
//!
//! What it does not do: I/O, deadlines (the connection bounds the header's arrival with the
//! header-read deadline), or using the TLVs (they are validated and skipped).
//!
//! Read next: `engine::shard::conn`, which reads the header from trusted peers and puts the
//! address it carries into `RequestCtx::peer_ip`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The first 12 bytes of every v2 header (a NUL at the 5th position: not a C string).
pub const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// The v2 fixed part: signature, version/command, family/protocol, length.
pub const V2_FIXED_BYTES: usize = 16;
/// Longest v2 header accepted, TLVs included. The spec designs headers to fit 536 bytes
/// (the smallest TCP segment); balancers' TLVs (unique id up to 128 bytes, authority, SSL
/// details) stay well under this. Beyond it: refused, so a header can never hold a
/// connection's buffer with up to 64 KiB of announced TLVs.
pub const V2_HEADER_BYTES_MAX: usize = 1024;
/// Longest v1 line including its CRLF (the spec's worst case, `PROXY UNKNOWN` with two full
/// IPv6 addresses and ports).
pub const V1_LINE_BYTES_MAX: usize = 107;
const V1_PREFIX: &[u8] = b"PROXY ";
/// Most CIDRs in [`TrustedSources`]: a list of balancers, not a firewall.
pub const TRUSTED_SOURCES_MAX: usize = 64;

/// Who the connection is for, according to a valid header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxySource {
    /// A relayed TCP connection: the client's address and the address it connected to.
    Relayed { source: SocketAddr, destination: SocketAddr },
    /// v2 LOCAL: the balancer's own connection (its health checks); use the TCP peer.
    Local,
    /// v1 `UNKNOWN`, or v2 PROXY for a family we do not use (UNSPEC, UDP, UNIX): the sender
    /// could not describe the client; use the TCP peer.
    Unknown,
}

/// The outcome of one call to [`parse_proxy_header`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyParse {
    /// Every byte so far is a valid prefix of a header; read more and call again with the
    /// whole buffer (no state is kept between calls).
    Incomplete,
    /// A valid header: the connection's own bytes start at `buf[consumed..]`.
    Complete { source: ProxySource, consumed: usize },
    /// Not a valid header: close the connection.
    Reject(ProxyRejection),
}

/// Why a header was refused (for logs and metrics; the connection closes either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyRejection {
    /// Neither signature: the header is missing.
    Missing,
    /// A v1 line that does not match the grammar exactly.
    V1Malformed,
    /// No CRLF within [`V1_LINE_BYTES_MAX`] bytes.
    V1TooLong,
    /// v2 version nibble other than 2.
    V2Version,
    /// v2 command other than LOCAL (0) and PROXY (1).
    V2Command,
    /// A family/protocol byte the spec does not list.
    V2Family,
    /// An address block shorter than its family needs.
    V2AddressTruncated,
    /// The header announces more than [`V2_HEADER_BYTES_MAX`] bytes.
    V2TooLarge,
    /// TLVs that do not exactly fill the rest of the header.
    V2Tlv,
    /// A CRC32C TLV that does not match the header.
    V2Checksum,
}

impl ProxyRejection {
    /// Stable lower snake case name (logs).
    pub const fn name(self) -> &'static str {
        match self {
            ProxyRejection::Missing => "missing",
            ProxyRejection::V1Malformed => "v1_malformed",
            ProxyRejection::V1TooLong => "v1_too_long",
            ProxyRejection::V2Version => "v2_version",
            ProxyRejection::V2Command => "v2_command",
            ProxyRejection::V2Family => "v2_family",
            ProxyRejection::V2AddressTruncated => "v2_address_truncated",
            ProxyRejection::V2TooLarge => "v2_too_large",
            ProxyRejection::V2Tlv => "v2_tlv",
            ProxyRejection::V2Checksum => "v2_checksum",
        }
    }
}

/// Parses the PROXY header at the start of `buf` (v1 or v2, told apart by the first byte).
/// Looks at no more than [`V2_HEADER_BYTES_MAX`] bytes whatever `buf` holds; a header is
/// never reported complete before its last byte has arrived.
pub fn parse_proxy_header(buf: &[u8]) -> ProxyParse {
    match buf.first() {
        None => ProxyParse::Incomplete,
        Some(b'\r') => parse_v2(buf),
        Some(_) => parse_v1(buf),
    }
}

/// Whether `buf` (the first bytes of a connection) is, or may still become, a PROXY header:
/// `Some(true)` it is one, `Some(false)` it cannot be, `None` too few bytes to tell. Used on
/// connections from untrusted peers, which get a 400 for one. Every HTTP request is told
/// apart within its first three bytes (`P` then `O`, or a CRLF then a letter).
pub fn looks_like_proxy_header(buf: &[u8]) -> Option<bool> {
    let matches_prefix = |signature: &[u8]| {
        let n = buf.len().min(signature.len());
        buf[..n] == signature[..n]
    };
    let candidate: &[u8] = if buf.first() == Some(&b'\r') { &V2_SIGNATURE } else { V1_PREFIX };
    if !matches_prefix(candidate) {
        Some(false)
    } else if buf.len() >= candidate.len() {
        Some(true)
    } else {
        None
    }
}

// ---- version 1 ------------------------------------------------------------------------------

fn parse_v1(buf: &[u8]) -> ProxyParse {
    let prefix_len = buf.len().min(V1_PREFIX.len());
    if buf[..prefix_len] != V1_PREFIX[..prefix_len] {
        return ProxyParse::Reject(ProxyRejection::Missing);
    }
    let window = &buf[..buf.len().min(V1_LINE_BYTES_MAX)];
    let Some(end) = window.iter().position(|&b| b == b'\r' || b == b'\n') else {
        if let Some(rejection) = check_v1_bytes(window) {
            return ProxyParse::Reject(rejection);
        }
        // The CRLF still to come would end the line past the limit.
        return if buf.len() + 2 > V1_LINE_BYTES_MAX {
            ProxyParse::Reject(ProxyRejection::V1TooLong)
        } else {
            ProxyParse::Incomplete
        };
    };
    if let Some(rejection) = check_v1_bytes(&window[..end]) {
        return ProxyParse::Reject(rejection);
    }
    match (window[end], buf.get(end + 1)) {
        (b'\r', Some(b'\n')) if end + 2 > V1_LINE_BYTES_MAX => {
            ProxyParse::Reject(ProxyRejection::V1TooLong)
        }
        (b'\r', Some(b'\n')) => match parse_v1_line(&buf[V1_PREFIX.len()..end]) {
            Some(source) => ProxyParse::Complete { source, consumed: end + 2 },
            None => ProxyParse::Reject(ProxyRejection::V1Malformed),
        },
        // A CR at the end of the window's last byte with nothing after it yet.
        (b'\r', None) if end + 2 <= V1_LINE_BYTES_MAX => ProxyParse::Incomplete,
        (b'\r', None) => ProxyParse::Reject(ProxyRejection::V1TooLong),
        _ => ProxyParse::Reject(ProxyRejection::V1Malformed),
    }
}

/// Only visible ASCII and SP may appear before the CRLF (refused as soon as it arrives).
fn check_v1_bytes(line: &[u8]) -> Option<ProxyRejection> {
    line.iter().any(|&b| !(b' '..=b'~').contains(&b)).then_some(ProxyRejection::V1Malformed)
}

/// The line after `PROXY `, without its CRLF.
fn parse_v1_line(line: &[u8]) -> Option<ProxySource> {
    // The spec: for UNKNOWN "the receiver must ignore anything presented before the CRLF".
    if line == b"UNKNOWN" || line.starts_with(b"UNKNOWN ") {
        return Some(ProxySource::Unknown);
    }
    let text = std::str::from_utf8(line).ok()?;
    let mut fields = text.split(' ');
    let family = fields.next()?;
    let (source_ip, destination_ip) = (fields.next()?, fields.next()?);
    let (source_port, destination_port) = (v1_port(fields.next()?)?, v1_port(fields.next()?)?);
    if fields.next().is_some() {
        return None;
    }
    let (source, destination) = match family {
        "TCP4" => (IpAddr::V4(v1_ipv4(source_ip)?), IpAddr::V4(v1_ipv4(destination_ip)?)),
        "TCP6" => (IpAddr::V6(v1_ipv6(source_ip)?), IpAddr::V6(v1_ipv6(destination_ip)?)),
        _ => return None,
    };
    Some(ProxySource::Relayed {
        source: SocketAddr::new(source, source_port),
        destination: SocketAddr::new(destination, destination_port),
    })
}

/// Four decimal octets without leading zeros: exactly the canonical form std prints.
fn v1_ipv4(text: &str) -> Option<Ipv4Addr> {
    let ip: Ipv4Addr = text.parse().ok()?;
    (ip.to_string() == text).then_some(ip)
}

/// Hex groups and colons only (no embedded dotted IPv4, no zone), as the spec writes them.
fn v1_ipv6(text: &str) -> Option<Ipv6Addr> {
    if !text.bytes().all(|b| b.is_ascii_hexdigit() || b == b':') {
        return None;
    }
    text.parse().ok()
}

/// `0..=65535` in decimal, no sign, no leading zero.
fn v1_port(text: &str) -> Option<u16> {
    let bytes = text.as_bytes();
    let well_formed = !bytes.is_empty()
        && bytes.len() <= 5
        && bytes.iter().all(u8::is_ascii_digit)
        && (bytes[0] != b'0' || bytes.len() == 1);
    if !well_formed {
        return None;
    }
    text.parse().ok()
}

// ---- version 2 ------------------------------------------------------------------------------

const V2_COMMAND_LOCAL: u8 = 0x0;
const V2_COMMAND_PROXY: u8 = 0x1;
const V2_TCP4: u8 = 0x11;
const V2_TCP6: u8 = 0x21;
const V2_TLV_CRC32C: u8 = 0x03;

fn parse_v2(buf: &[u8]) -> ProxyParse {
    let signature_len = buf.len().min(V2_SIGNATURE.len());
    if buf[..signature_len] != V2_SIGNATURE[..signature_len] {
        return ProxyParse::Reject(ProxyRejection::Missing);
    }
    if let Some(&version_command) = buf.get(12) {
        if version_command >> 4 != 2 {
            return ProxyParse::Reject(ProxyRejection::V2Version);
        }
        if !matches!(version_command & 0x0f, V2_COMMAND_LOCAL | V2_COMMAND_PROXY) {
            return ProxyParse::Reject(ProxyRejection::V2Command);
        }
    }
    if let Some(&family) = buf.get(13) {
        if address_bytes_of(family).is_none() {
            return ProxyParse::Reject(ProxyRejection::V2Family);
        }
    }
    let (Some(&version_command), Some(&family), Some(length)) =
        (buf.get(12), buf.get(13), buf.get(14..16))
    else {
        return ProxyParse::Incomplete;
    };
    let header_len = V2_FIXED_BYTES + usize::from(u16::from_be_bytes([length[0], length[1]]));
    if header_len > V2_HEADER_BYTES_MAX {
        return ProxyParse::Reject(ProxyRejection::V2TooLarge);
    }
    let Some(header) = buf.get(..header_len) else {
        return ProxyParse::Incomplete;
    };
    // LOCAL: "the receiver must ... use the real connection endpoints and discard the
    // protocol block including the family".
    if version_command & 0x0f == V2_COMMAND_LOCAL {
        return ProxyParse::Complete { source: ProxySource::Local, consumed: header_len };
    }
    if let Err(rejection) = check_v2_block(header, family) {
        return ProxyParse::Reject(rejection);
    }
    let source = match family {
        V2_TCP4 => relayed_v4(&header[V2_FIXED_BYTES..]),
        V2_TCP6 => relayed_v6(&header[V2_FIXED_BYTES..]),
        _ => ProxySource::Unknown,
    };
    ProxyParse::Complete { source, consumed: header_len }
}

/// Address bytes a family/protocol byte needs; `None` for the bytes the spec does not list.
fn address_bytes_of(family: u8) -> Option<usize> {
    match family {
        0x00 => Some(0),
        0x11 | 0x12 => Some(12),
        0x21 | 0x22 => Some(36),
        0x31 | 0x32 => Some(216),
        _ => None,
    }
}

/// The address block is long enough for its family, and the TLVs after it tile the rest
/// exactly; a CRC32C TLV must match the header.
fn check_v2_block(header: &[u8], family: u8) -> Result<(), ProxyRejection> {
    let address_len = address_bytes_of(family).ok_or(ProxyRejection::V2Family)?;
    let block = &header[V2_FIXED_BYTES..];
    if family == 0x00 {
        // UNSPEC: "the receiver should ignore address information", whatever it is.
        return Ok(());
    }
    let mut tlvs = block.get(address_len..).ok_or(ProxyRejection::V2AddressTruncated)?;
    let mut offset = V2_FIXED_BYTES + address_len;
    while !tlvs.is_empty() {
        let [kind, high, low, ..] = *tlvs else { return Err(ProxyRejection::V2Tlv) };
        let value_len = usize::from(u16::from_be_bytes([high, low]));
        let value = tlvs.get(3..3 + value_len).ok_or(ProxyRejection::V2Tlv)?;
        if kind == V2_TLV_CRC32C {
            check_crc32c(header, offset + 3, value)?;
        }
        tlvs = &tlvs[3 + value_len..];
        offset += 3 + value_len;
    }
    Ok(())
}

/// The spec: the CRC32C of the whole header with the checksum's own 4 bytes as zeros.
fn check_crc32c(header: &[u8], value_at: usize, value: &[u8]) -> Result<(), ProxyRejection> {
    let Ok(expected) = <[u8; 4]>::try_from(value) else {
        return Err(ProxyRejection::V2Tlv);
    };
    let mut crc = Crc32c::new();
    crc.update(&header[..value_at]);
    crc.update(&[0; 4]);
    crc.update(&header[value_at + 4..]);
    if crc.finish() == u32::from_be_bytes(expected) {
        Ok(())
    } else {
        Err(ProxyRejection::V2Checksum)
    }
}

fn relayed_v4(block: &[u8]) -> ProxySource {
    let ip = |at: usize| Ipv4Addr::new(block[at], block[at + 1], block[at + 2], block[at + 3]);
    let port = |at: usize| u16::from_be_bytes([block[at], block[at + 1]]);
    ProxySource::Relayed {
        source: SocketAddr::new(IpAddr::V4(ip(0)), port(8)),
        destination: SocketAddr::new(IpAddr::V4(ip(4)), port(10)),
    }
}

fn relayed_v6(block: &[u8]) -> ProxySource {
    let ip = |at: usize| {
        let mut octets = [0u8; 16];
        octets.copy_from_slice(&block[at..at + 16]);
        Ipv6Addr::from(octets)
    };
    let port = |at: usize| u16::from_be_bytes([block[at], block[at + 1]]);
    ProxySource::Relayed {
        source: SocketAddr::new(IpAddr::V6(ip(0)), port(32)),
        destination: SocketAddr::new(IpAddr::V6(ip(16)), port(34)),
    }
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), RFC 4960 appendix B: the checksum
/// the PROXY v2 `PP2_TYPE_CRC32C` TLV carries. Table-driven; the table is built at compile
/// time.
struct Crc32c(u32);

const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

impl Crc32c {
    fn new() -> Crc32c {
        Crc32c(0xFFFF_FFFF)
    }

    fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = CRC32C_TABLE[((self.0 ^ u32::from(b)) & 0xff) as usize] ^ (self.0 >> 8);
        }
    }

    fn finish(&self) -> u32 {
        !self.0
    }
}

/// The CRC32C of `bytes` (for building test headers and for the fuzz target).
pub fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = Crc32c::new();
    crc.update(bytes);
    crc.finish()
}

// ---- trusted sources ------------------------------------------------------------------------

/// One `address/prefix` network (a bare address is a /32 or /128).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    network: IpAddr,
    prefix_len: u8,
}

impl Cidr {
    pub fn parse(text: &str) -> Result<Cidr, String> {
        let text = text.trim();
        let (address, prefix) = match text.split_once('/') {
            Some((address, prefix)) => (address, Some(prefix)),
            None => (text, None),
        };
        let network: IpAddr =
            address.parse().map_err(|_| format!("{text:?}: {address:?} is not an IP address"))?;
        let network = network.to_canonical();
        let bits = if network.is_ipv4() { 32 } else { 128 };
        let prefix_len = match prefix {
            None => bits,
            Some(p) => match p.parse::<u8>() {
                Ok(n) if n <= bits && !p.starts_with('+') => n,
                _ => return Err(format!("{text:?}: prefix length must be 0..={bits}")),
            },
        };
        let cidr = Cidr { network, prefix_len };
        if mask(network, prefix_len) != network {
            return Err(format!("{text:?}: host bits set below the /{prefix_len} prefix"));
        }
        Ok(cidr)
    }

    /// Whether `ip` (IPv4-mapped IPv6 counts as its IPv4 address) is in this network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        ip.is_ipv4() == self.network.is_ipv4() && mask(ip, self.prefix_len) == self.network
    }
}

/// `ip` with every bit past `prefix_len` cleared.
fn mask(ip: IpAddr, prefix_len: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let bits = u32::from(v4);
            let kept = if prefix_len == 0 { 0 } else { bits & (u32::MAX << (32 - prefix_len)) };
            IpAddr::V4(Ipv4Addr::from(kept))
        }
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let kept = if prefix_len == 0 { 0 } else { bits & (u128::MAX << (128 - prefix_len)) };
            IpAddr::V6(Ipv6Addr::from(kept))
        }
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix_len)
    }
}

/// The balancers whose PROXY header is required and believed (`FLASHSALE_PROXY_PROTOCOL_FROM`,
/// `[http] proxy_protocol_from`). Empty: nobody's (the default), every header refused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedSources {
    cidrs: Vec<Cidr>,
}

impl TrustedSources {
    /// Comma-separated CIDRs; blanks between commas are ignored; at most
    /// [`TRUSTED_SOURCES_MAX`].
    pub fn parse(text: &str) -> Result<TrustedSources, String> {
        let cidrs = text
            .split(',')
            .filter(|part| !part.trim().is_empty())
            .map(Cidr::parse)
            .collect::<Result<Vec<_>, _>>()?;
        if cidrs.len() > TRUSTED_SOURCES_MAX {
            return Err(format!("at most {TRUSTED_SOURCES_MAX} CIDRs, got {}", cidrs.len()));
        }
        Ok(TrustedSources { cidrs })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        self.cidrs.iter().any(|cidr| cidr.contains(ip))
    }

    pub fn is_empty(&self) -> bool {
        self.cidrs.is_empty()
    }

    pub fn cidrs(&self) -> &[Cidr] {
        &self.cidrs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v2(command: u8, family: u8, block: &[u8]) -> Vec<u8> {
        let mut header = V2_SIGNATURE.to_vec();
        header.push(0x20 | command);
        header.push(family);
        header.extend_from_slice(&(block.len() as u16).to_be_bytes());
        header.extend_from_slice(block);
        header
    }

    fn tcp4_block() -> Vec<u8> {
        let mut block = vec![203, 0, 113, 7, 10, 0, 0, 1];
        block.extend_from_slice(&51_000u16.to_be_bytes());
        block.extend_from_slice(&443u16.to_be_bytes());
        block
    }

    fn tlv(kind: u8, value: &[u8]) -> Vec<u8> {
        let mut out = vec![kind];
        out.extend_from_slice(&(value.len() as u16).to_be_bytes());
        out.extend_from_slice(value);
        out
    }

    fn relayed(source: &str, destination: &str) -> ProxySource {
        ProxySource::Relayed {
            source: source.parse().expect("addr"),
            destination: destination.parse().expect("addr"),
        }
    }

    /// Every strict prefix is Incomplete, the whole is `expected`, and bytes after it do not
    /// change the answer.
    #[track_caller]
    fn assert_complete(header: &[u8], expected: ProxySource) {
        for cut in 0..header.len() {
            assert_eq!(parse_proxy_header(&header[..cut]), ProxyParse::Incomplete, "cut {cut}");
        }
        let complete = ProxyParse::Complete { source: expected, consumed: header.len() };
        assert_eq!(parse_proxy_header(header), complete);
        let mut followed = header.to_vec();
        followed.extend_from_slice(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n");
        assert_eq!(parse_proxy_header(&followed), complete);
    }

    #[track_caller]
    fn rejected(header: &[u8]) -> ProxyRejection {
        match parse_proxy_header(header) {
            ProxyParse::Reject(rejection) => rejection,
            other => panic!("expected a rejection of {header:?}, got {other:?}"),
        }
    }

    #[test]
    fn v1_tcp4_tcp6_and_unknown() {
        assert_complete(
            b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n",
            relayed("192.168.0.1:56324", "192.168.0.11:443"),
        );
        assert_complete(
            b"PROXY TCP6 2001:db8::1 2001:DB8:0:0:0:0:0:2 0 65535\r\n",
            relayed("[2001:db8::1]:0", "[2001:db8::2]:65535"),
        );
        assert_complete(b"PROXY UNKNOWN\r\n", ProxySource::Unknown);
        assert_complete(b"PROXY UNKNOWN ffff:f::f ffff:f::f 65535 65535\r\n", ProxySource::Unknown);
        // The spec's worst case is exactly the limit.
        let longest = format!("PROXY UNKNOWN {0} {0} 65535 65535\r\n", ["ffff"; 8].join(":"));
        assert_eq!(longest.len(), V1_LINE_BYTES_MAX);
        assert_complete(longest.as_bytes(), ProxySource::Unknown);
    }

    #[test]
    fn v1_malformed_lines_are_refused() {
        for line in [
            "PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\n",
            "PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\r\n",
            "PROXY TCP4  192.168.0.1 192.168.0.11 56324 443\r\n",
            "PROXY TCP4 192.168.0.1 192.168.0.11 56324 443 \r\n",
            "PROXY TCP4 192.168.000.1 192.168.0.11 56324 443\r\n",
            "PROXY TCP4 192.168.0.1 192.168.0.11 056324 443\r\n",
            "PROXY TCP4 192.168.0.1 192.168.0.11 65536 443\r\n",
            "PROXY TCP4 192.168.0.1 192.168.0.11 -1 443\r\n",
            "PROXY TCP4 2001:db8::1 192.168.0.11 1 443\r\n",
            "PROXY TCP6 192.168.0.1 2001:db8::2 1 443\r\n",
            "PROXY TCP6 ::ffff:1.2.3.4 2001:db8::2 1 443\r\n",
            "PROXY TCP6 fe80::1%eth0 2001:db8::2 1 443\r\n",
            "PROXY TCP5 1.2.3.4 1.2.3.4 1 1\r\n",
            "PROXY tcp4 1.2.3.4 1.2.3.4 1 1\r\n",
            "PROXY TCP4 1.2.3.4 1.2.3.4 1\r\n",
            "PROXY UNKNOWNX\r\n",
            "PROXY \r\n",
        ] {
            assert!(matches!(rejected(line.as_bytes()), ProxyRejection::V1Malformed), "{line:?}");
        }
        // A control character or a bare LF is refused as soon as it arrives.
        assert_eq!(rejected(b"PROXY TCP4 1.2\x00"), ProxyRejection::V1Malformed);
        assert_eq!(rejected(b"PROXY TCP4 1.2\n"), ProxyRejection::V1Malformed);
        // 105 bytes and a CRLF is the longest line; a 106th byte before the CR is refused at
        // once, whatever follows.
        let mut long = b"PROXY UNKNOWN ".to_vec();
        long.resize(V1_LINE_BYTES_MAX - 2, b'a');
        assert_eq!(parse_proxy_header(&long), ProxyParse::Incomplete);
        long.push(b'\r');
        assert_eq!(parse_proxy_header(&long), ProxyParse::Incomplete);
        long.push(b'\n');
        assert!(matches!(parse_proxy_header(&long), ProxyParse::Complete { consumed: 107, .. }));
        long.truncate(V1_LINE_BYTES_MAX - 2);
        long.push(b'a');
        assert_eq!(rejected(&long), ProxyRejection::V1TooLong);
        long.extend_from_slice(b"\r\n");
        assert_eq!(rejected(&long), ProxyRejection::V1TooLong);
    }

    #[test]
    fn v2_tcp4_tcp6_local_and_unknown_families() {
        assert_complete(
            &v2(1, V2_TCP4, &tcp4_block()),
            relayed("203.0.113.7:51000", "10.0.0.1:443"),
        );
        let mut block6 = Vec::new();
        block6.extend_from_slice(&"2001:db8::7".parse::<Ipv6Addr>().expect("v6").octets());
        block6.extend_from_slice(&Ipv6Addr::LOCALHOST.octets());
        block6.extend_from_slice(&4_000u16.to_be_bytes());
        block6.extend_from_slice(&8_080u16.to_be_bytes());
        assert_complete(&v2(1, V2_TCP6, &block6), relayed("[2001:db8::7]:4000", "[::1]:8080"));
        // LOCAL ignores the family and any block; UNSPEC, UDP and UNIX use the TCP peer.
        assert_complete(&v2(0, 0x00, &[]), ProxySource::Local);
        assert_complete(&v2(0, V2_TCP4, &tcp4_block()), ProxySource::Local);
        assert_complete(&v2(1, 0x00, &[1, 2, 3]), ProxySource::Unknown);
        assert_complete(&v2(1, 0x12, &tcp4_block()), ProxySource::Unknown);
        assert_complete(&v2(1, 0x31, &[0; 216]), ProxySource::Unknown);
    }

    #[test]
    fn v2_tlvs_are_validated_and_skipped() {
        let mut block = tcp4_block();
        block.extend(tlv(0x05, b"unique-id-123"));
        block.extend(tlv(0x04, b""));
        block.extend(tlv(0xE0, &[7; 100]));
        assert_complete(&v2(1, V2_TCP4, &block), relayed("203.0.113.7:51000", "10.0.0.1:443"));
        // A TLV that claims more than the header holds, or a torn TLV head.
        let mut oversized = tcp4_block();
        oversized.extend_from_slice(&[0x05, 0x00, 0x20, b'x']);
        assert_eq!(rejected(&v2(1, V2_TCP4, &oversized)), ProxyRejection::V2Tlv);
        let mut torn = tcp4_block();
        torn.extend_from_slice(&[0x05, 0x00]);
        assert_eq!(rejected(&v2(1, V2_TCP4, &torn)), ProxyRejection::V2Tlv);
    }

    #[test]
    fn v2_crc32c_is_checked_when_sent() {
        // RFC 3720's check value of CRC-32C.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        let mut block = tcp4_block();
        block.extend(tlv(V2_TLV_CRC32C, &[0; 4]));
        let mut header = v2(1, V2_TCP4, &block);
        let sum = crc32c(&header);
        let at = header.len() - 4;
        header[at..].copy_from_slice(&sum.to_be_bytes());
        assert_complete(&header, relayed("203.0.113.7:51000", "10.0.0.1:443"));
        header[16] ^= 1; // the source address changed in transit
        assert_eq!(rejected(&header), ProxyRejection::V2Checksum);
        let mut short = tcp4_block();
        short.extend(tlv(V2_TLV_CRC32C, &[0; 3]));
        assert_eq!(rejected(&v2(1, V2_TCP4, &short)), ProxyRejection::V2Tlv);
    }

    #[test]
    fn v2_bad_fixed_parts_are_refused_as_soon_as_they_arrive() {
        let good = v2(1, V2_TCP4, &tcp4_block());
        let mut bad_signature = good.clone();
        bad_signature[7] = b'q';
        assert_eq!(rejected(&bad_signature[..8]), ProxyRejection::Missing);
        let mut version = good.clone();
        version[12] = 0x11;
        assert_eq!(rejected(&version[..13]), ProxyRejection::V2Version);
        let mut command = good.clone();
        command[12] = 0x22;
        assert_eq!(rejected(&command[..13]), ProxyRejection::V2Command);
        for family in [0x01, 0x10, 0x13, 0x41, 0xff] {
            let mut bad = good.clone();
            bad[13] = family;
            assert_eq!(rejected(&bad[..14]), ProxyRejection::V2Family, "{family:#x}");
        }
        // Announcing more than the bound is refused before the bytes arrive.
        let mut huge = good[..14].to_vec();
        huge.extend_from_slice(&((V2_HEADER_BYTES_MAX - V2_FIXED_BYTES + 1) as u16).to_be_bytes());
        assert_eq!(rejected(&huge), ProxyRejection::V2TooLarge);
        let mut at_limit = tcp4_block();
        at_limit.extend(tlv(0x04, &vec![0; V2_HEADER_BYTES_MAX - V2_FIXED_BYTES - 12 - 3]));
        assert!(matches!(
            parse_proxy_header(&v2(1, V2_TCP4, &at_limit)),
            ProxyParse::Complete { consumed: V2_HEADER_BYTES_MAX, .. }
        ));
        // An address block shorter than the family needs.
        assert_eq!(rejected(&v2(1, V2_TCP4, &[1, 2, 3, 4])), ProxyRejection::V2AddressTruncated);
        assert_eq!(rejected(&v2(1, V2_TCP6, &tcp4_block())), ProxyRejection::V2AddressTruncated);
    }

    #[test]
    fn missing_headers_and_http_are_told_apart() {
        for http in [&b"GET / HTTP/1.1\r\n"[..], b"POST /v1/reservations", b"\r\nGET /"] {
            assert_eq!(rejected(http), ProxyRejection::Missing, "{http:?}");
            assert_eq!(looks_like_proxy_header(&http[..3]), Some(false), "{http:?}");
        }
        assert_eq!(rejected(b"\x16\x03\x01\x02\x00"), ProxyRejection::Missing, "a TLS hello");
        assert_eq!(looks_like_proxy_header(b""), None);
        assert_eq!(looks_like_proxy_header(b"PROX"), None);
        assert_eq!(looks_like_proxy_header(b"PROXY "), Some(true));
        assert_eq!(looks_like_proxy_header(b"\r\n\r\n\0"), None);
        assert_eq!(looks_like_proxy_header(&V2_SIGNATURE), Some(true));
    }

    #[test]
    fn a_header_split_across_reads_gives_the_same_answer() {
        let mut stream = b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\n".to_vec();
        stream.extend_from_slice(b"GET / HTTP/1.1\r\n");
        let first = parse_proxy_header(&stream);
        for cut in 0..32 {
            assert_eq!(parse_proxy_header(&stream[..cut]), ProxyParse::Incomplete, "{cut}");
        }
        assert_eq!(parse_proxy_header(&stream[..32]), first);
    }

    #[test]
    fn trusted_sources_parse_and_match() {
        let trusted = TrustedSources::parse("10.0.0.0/8, 192.168.1.7 ,2001:db8::/32,").expect("ok");
        assert_eq!(trusted.cidrs().len(), 3);
        for ip in ["10.1.2.3", "192.168.1.7", "2001:db8:1::9", "::ffff:10.9.9.9"] {
            assert!(trusted.contains(ip.parse().expect("ip")), "{ip}");
        }
        for ip in ["11.0.0.1", "192.168.1.8", "2001:db9::1", "::1", "127.0.0.1"] {
            assert!(!trusted.contains(ip.parse().expect("ip")), "{ip}");
        }
        assert!(TrustedSources::parse("").expect("empty").is_empty());
        assert!(TrustedSources::parse("0.0.0.0/0")
            .expect("all")
            .contains("8.8.8.8".parse().expect("ip")));
        for bad in ["10.0.0.0/33", "10.0.0.1/8", "nonsense", "10.0.0.0/+8", "::/129"] {
            assert!(TrustedSources::parse(bad).is_err(), "{bad}");
        }
        let many = vec!["10.0.0.1"; TRUSTED_SOURCES_MAX + 1].join(",");
        assert!(TrustedSources::parse(&many).is_err());
    }
}
