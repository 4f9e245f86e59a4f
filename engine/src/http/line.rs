//! Line scanning shared by the head pre-scan and the chunked decoder: find the CRLF that
//! ends a line, refusing bare CR, bare LF and every other control character on the way.
//!
//! This is the hottest loop of the parser (it touches every byte of the head once), so
//! it looks at 8 bytes per step with the SWAR "has a byte less than n" test (Bit Twiddling
//! Hacks, exact for n ≤ 128) instead of comparing byte by byte; only an 8-byte word that
//! holds a control character is looked at byte by byte. Safe code, no dependency.
//!
//! What it does not do: interpret the line (see `parse.rs` and `chunked.rs`).

/// Where the line starting at `bytes[0]` ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LineEnd {
    /// `bytes[..len]` is the line, `bytes[len..len + 2]` is CRLF.
    Found { len: usize },
    /// No line end yet (a trailing CR may be waiting for its LF).
    Partial,
    /// A bare LF, or a CR followed by anything but LF.
    Invalid,
    /// A control character other than HTAB, CR and LF (NUL, ESC, DEL, ...) at `bytes[at]`.
    Control { at: usize },
}

/// Finds the CRLF ending the line at the start of `bytes`. HTAB is the one control
/// character a line may hold (header values allow it; the callers refuse it elsewhere).
pub(super) fn find_line_end(bytes: &[u8]) -> LineEnd {
    let mut from = 0;
    loop {
        let Some(at) = find_control(&bytes[from..]).map(|i| from + i) else {
            return LineEnd::Partial;
        };
        match bytes[at] {
            b'\t' => from = at + 1,
            b'\n' => return LineEnd::Invalid,
            b'\r' => {
                return match bytes.get(at + 1) {
                    None => LineEnd::Partial,
                    Some(b'\n') => LineEnd::Found { len: at },
                    Some(_) => LineEnd::Invalid,
                }
            }
            _ => return LineEnd::Control { at },
        }
    }
}

fn is_control(b: u8) -> bool {
    b < 0x20 || b == 0x7f
}

/// Index of the first byte below 0x20 or equal to 0x7F.
fn find_control(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    let mut words = bytes.chunks_exact(8);
    let mut offset = 0;
    for word in &mut words {
        let mut array = [0u8; 8];
        array.copy_from_slice(word);
        let x = u64::from_le_bytes(array);
        let below_space = x.wrapping_sub(ONES * 0x20) & !x & HIGHS;
        let del = x ^ (ONES * 0x7f);
        let is_del = del.wrapping_sub(ONES) & !del & HIGHS;
        if below_space | is_del != 0 {
            if let Some(i) = word.iter().position(|&b| is_control(b)) {
                return Some(offset + i);
            }
        }
        offset += 8;
    }
    words.remainder().iter().position(|&b| is_control(b)).map(|i| offset + i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_every_control_byte_at_every_offset() {
        for control in (0u8..0x20).chain([0x7f]) {
            for at in 0..40 {
                let mut bytes = vec![b'a'; 40];
                // Bytes that are not controls but sit near the SWAR thresholds.
                bytes[(at + 1) % 40] = 0x80;
                bytes[(at + 3) % 40] = 0xff;
                bytes[(at + 5) % 40] = b' ';
                bytes[(at + 7) % 40] = 0x7e;
                bytes[at] = control;
                assert_eq!(find_control(&bytes), Some(at), "control {control:#x} at {at}");
            }
        }
        let plain: Vec<u8> = (0x20u8..=0xff).filter(|&b| b != 0x7f).collect();
        assert_eq!(find_control(&plain), None);
    }

    #[test]
    fn line_ends() {
        assert_eq!(find_line_end(b"abc\r\ndef"), LineEnd::Found { len: 3 });
        assert_eq!(find_line_end(b"\r\n"), LineEnd::Found { len: 0 });
        assert_eq!(find_line_end(b"a\tb\tc\r\n"), LineEnd::Found { len: 5 });
        assert_eq!(find_line_end(b"abc"), LineEnd::Partial);
        assert_eq!(find_line_end(b"abc\r"), LineEnd::Partial);
        assert_eq!(find_line_end(b""), LineEnd::Partial);
        assert_eq!(find_line_end(b"abc\n"), LineEnd::Invalid);
        assert_eq!(find_line_end(b"abc\rd\r\n"), LineEnd::Invalid);
        assert_eq!(find_line_end(b"abcdefghij\x00\r\n"), LineEnd::Control { at: 10 });
        assert_eq!(find_line_end(b"a\x7f"), LineEnd::Control { at: 1 });
    }
}
