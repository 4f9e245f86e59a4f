//! Fuzzes `engine::http::proxy::parse_proxy_header`, the PROXY protocol v1/v2 header parser
//! that runs on every connection from a trusted balancer.
//!
//! Beyond "no panic", it checks what the connection loop relies on: `consumed` is never zero
//! nor past the bytes given and never beyond the v2 bound; a header found is found the same
//! with any bytes after it and is `Incomplete` on every strict prefix (a header split across
//! reads gives the same answer); a refused prefix stays refused. The first input byte picks
//! a mode: raw bytes, or a well-formed v2 header built from the input (so that the deep paths
//! — TLVs, the CRC32C — are reached without the fuzzer guessing a signature first).
//!
//! Run: `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run proxy_parse -- -max_total_time=120`

#![no_main]

use flashsale_engine::http::proxy::{
    crc32c, parse_proxy_header, ProxyParse, ProxySource, V2_HEADER_BYTES_MAX, V2_SIGNATURE,
};
use libfuzzer_sys::fuzz_target;

/// A v2 header from fuzz bytes: command, family byte and block chosen by the input, and
/// (if the input says so) a correct CRC32C TLV appended.
fn v2_from(data: &[u8]) -> Vec<u8> {
    let (control, block) = data.split_at(data.len().min(3));
    let command = control.first().copied().unwrap_or(1) & 0x01;
    let family = [0x00, 0x11, 0x12, 0x21, 0x22, 0x31, 0x32][usize::from(control.get(1).copied().unwrap_or(1)) % 7];
    let with_crc = control.get(2).is_some_and(|b| b & 1 == 1);
    let mut block = block.to_vec();
    if with_crc {
        block.extend_from_slice(&[0x03, 0x00, 0x04, 0, 0, 0, 0]);
    }
    let mut header = V2_SIGNATURE.to_vec();
    header.push(0x20 | command);
    header.push(family);
    header.extend_from_slice(&(block.len().min(u16::MAX as usize) as u16).to_be_bytes());
    header.extend_from_slice(&block);
    if with_crc {
        let sum = crc32c(&header);
        let at = header.len() - 4;
        header[at..].copy_from_slice(&sum.to_be_bytes());
    }
    header
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let input = if mode & 1 == 0 { rest.to_vec() } else { v2_from(rest) };
    match parse_proxy_header(&input) {
        ProxyParse::Complete { source, consumed } => {
            assert!(consumed > 0 && consumed <= input.len());
            assert!(consumed <= V2_HEADER_BYTES_MAX);
            let mut followed = input[..consumed].to_vec();
            followed.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
            assert_eq!(parse_proxy_header(&followed), ProxyParse::Complete { source, consumed });
            for cut in 0..consumed {
                assert_eq!(parse_proxy_header(&input[..cut]), ProxyParse::Incomplete, "cut {cut}");
            }
            if let ProxySource::Relayed { source, destination } = source {
                assert_eq!(source.is_ipv4(), destination.is_ipv4());
            }
        }
        ProxyParse::Reject(rejection) => {
            let _ = rejection.name();
            let mut longer = input.clone();
            longer.extend_from_slice(rest);
            assert!(matches!(parse_proxy_header(&longer), ProxyParse::Reject(_)));
        }
        ProxyParse::Incomplete => {
            // Nothing decided yet: every prefix is undecided too.
            for cut in 0..input.len() {
                assert_eq!(parse_proxy_header(&input[..cut]), ProxyParse::Incomplete);
            }
        }
    }
});
