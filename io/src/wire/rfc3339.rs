//! RFC 3339 timestamps as both schemas carry them (`2026-06-25T19:00:00.123Z`): milliseconds
//! since the Unix epoch formatted on the stack ([`format_rfc3339_ms`], [`Rfc3339`]), parsed
//! strictly ([`parse_rfc3339_ms`]: offsets and lowercase separators accepted, impossible
//! dates, leap seconds and times before 1970 refused), and the serde adapter the message
//! fields use ([`rfc3339_ms`]).
//!
//! What it is not: a clock. Nothing here reads the time; callers pass milliseconds in.
//!
//! Read next: `order_create.rs`, whose times are carried this way.

use std::fmt;

/// Length of the text [`format_rfc3339_ms`] writes: `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub const RFC3339_MS_LEN: usize = 24;

/// Latest time representable in the four-digit-year text: 9999-12-31T23:59:59.999Z.
pub const RFC3339_MS_MAX: u64 = 253_402_300_799_999;

/// Writes `unix_ms` as `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC, millisecond precision) into a stack
/// buffer. Times past [`RFC3339_MS_MAX`] are clamped to it.
pub fn format_rfc3339_ms(unix_ms: u64) -> Rfc3339 {
    let unix_ms = unix_ms.min(RFC3339_MS_MAX);
    let millis = unix_ms % 1000;
    let secs = unix_ms / 1000;
    // Bounded by RFC3339_MS_MAX, so the day count fits an i64 trivially.
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let second_of_day = secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    let mut bytes = *b"0000-00-00T00:00:00.000Z";
    let put = |bytes: &mut [u8; RFC3339_MS_LEN], at: usize, width: usize, mut value: u64| {
        for i in (0..width).rev() {
            bytes[at + i] = b'0' + (value % 10) as u8;
            value /= 10;
        }
    };
    put(&mut bytes, 0, 4, u64::try_from(year).unwrap_or(0));
    put(&mut bytes, 5, 2, u64::from(month));
    put(&mut bytes, 8, 2, u64::from(day));
    put(&mut bytes, 11, 2, second_of_day / 3600);
    put(&mut bytes, 14, 2, second_of_day / 60 % 60);
    put(&mut bytes, 17, 2, second_of_day % 60);
    put(&mut bytes, 20, 3, millis);
    Rfc3339 { bytes }
}

/// A formatted timestamp on the stack; derefs to `&str`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Rfc3339 {
    bytes: [u8; RFC3339_MS_LEN],
}

impl Rfc3339 {
    pub fn as_str(&self) -> &str {
        // Only ASCII digits and separators are ever written.
        std::str::from_utf8(&self.bytes).unwrap_or("1970-01-01T00:00:00.000Z")
    }
}

impl std::ops::Deref for Rfc3339 {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Debug for Rfc3339 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Rfc3339 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Parses an RFC 3339 date-time (`2026-06-25T19:00:00.123Z`, `…T19:00:00Z`,
/// `…T21:00:00+02:00`; `t`/space separators and a lowercase `z` accepted) into milliseconds
/// since the Unix epoch. Digits past milliseconds are truncated. `None` for anything else,
/// including times before 1970, leap seconds and impossible dates.
pub fn parse_rfc3339_ms(text: &str) -> Option<u64> {
    let b = text.as_bytes();
    if b.len() < 20 {
        return None;
    }
    let t = parse_date_time(b)?;
    let (millis, at) = parse_fraction(b, 19)?;
    let offset_secs = parse_offset(b, at)?;
    let days = days_from_civil(i64::from(t.year), t.month, t.day);
    let local = days * 86_400 + i64::from(t.hour * 3600 + t.minute * 60 + t.second);
    let utc_secs = local - offset_secs;
    let ms = utc_secs.checked_mul(1000)?.checked_add(i64::from(millis))?;
    u64::try_from(ms).ok()
}

/// The fields of `YYYY-MM-DDTHH:MM:SS`, each within the calendar and the clock.
struct DateTime {
    year: u32,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
}

/// `YYYY-MM-DDTHH:MM:SS` at the start of `b` (which holds at least 20 bytes).
fn parse_date_time(b: &[u8]) -> Option<DateTime> {
    let year = digits(b, 0..4)?;
    let month = digits(b, 5..7)?;
    let day = digits(b, 8..10)?;
    let hour = digits(b, 11..13)?;
    let minute = digits(b, 14..16)?;
    let second = digits(b, 17..19)?;
    if b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    if !(1..=12).contains(&month) || day == 0 || day > days_in_month(year, month) {
        return None;
    }
    if hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    Some(DateTime { year, month, day, hour, minute, second })
}

/// The optional `.d…` at `at`: its milliseconds (digits past the third truncated) and where
/// the text goes on after it. A dot without a digit is refused.
fn parse_fraction(b: &[u8], mut at: usize) -> Option<(u32, usize)> {
    let mut millis = 0u32;
    if b.get(at) == Some(&b'.') {
        at += 1;
        let start = at;
        while at < b.len() && b[at].is_ascii_digit() {
            if at - start < 3 {
                millis = millis * 10 + u32::from(b[at] - b'0');
            }
            at += 1;
        }
        let digits = at - start;
        if digits == 0 {
            return None;
        }
        for _ in digits..3 {
            millis *= 10;
        }
    }
    Some((millis, at))
}

/// The zone at `at`, which must end the text: `Z` (or `z`) or `±HH:MM`, as seconds east of UTC.
fn parse_offset(b: &[u8], at: usize) -> Option<i64> {
    match b.get(at)? {
        b'Z' | b'z' if at + 1 == b.len() => Some(0),
        sign @ (b'+' | b'-') if at + 6 == b.len() && b[at + 3] == b':' => {
            let oh = digits(b, at + 1..at + 3)?;
            let om = digits(b, at + 4..at + 6)?;
            if oh > 23 || om > 59 {
                return None;
            }
            let magnitude = i64::from(oh * 3600 + om * 60);
            Some(if *sign == b'+' { magnitude } else { -magnitude })
        }
        _ => None,
    }
}

/// The decimal value of `b[range]` when every byte there is an ASCII digit.
fn digits(b: &[u8], range: std::ops::Range<usize>) -> Option<u32> {
    let mut value = 0u32;
    for &d in b.get(range)? {
        if !d.is_ascii_digit() {
            return None;
        }
        value = value * 10 + u32::from(d - b'0');
    }
    Some(value)
}

fn is_leap(year: u32) -> bool {
    (year.is_multiple_of(4) && !year.is_multiple_of(100)) || year.is_multiple_of(400)
}

fn days_in_month(year: u32, month: u32) -> u32 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if is_leap(year) => 29,
        2 => 28,
        _ => 0,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = i64::from((month + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The inverse of [`days_from_civil`].
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// `#[serde(with = "rfc3339_ms")]` for `u64` milliseconds carried as RFC 3339 text.
pub mod rfc3339_ms {
    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(unix_ms: &u64, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(super::format_rfc3339_ms(*unix_ms).as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        struct Text;
        impl Visitor<'_> for Text {
            type Value = u64;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an RFC 3339 timestamp at or after 1970-01-01T00:00:00Z")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<u64, E> {
                super::parse_rfc3339_ms(text)
                    .ok_or_else(|| E::invalid_value(de::Unexpected::Str(text), &self))
            }
        }
        deserializer.deserialize_str(Text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-06-25T19:00:00.123Z
    const T0: u64 = 1_782_414_000_123;

    #[test]
    fn rfc3339_known_values() {
        assert_eq!(format_rfc3339_ms(0).as_str(), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_rfc3339_ms(T0).as_str(), "2026-06-25T19:00:00.123Z");
        assert_eq!(format_rfc3339_ms(951_782_400_000).as_str(), "2000-02-29T00:00:00.000Z");
        assert_eq!(format_rfc3339_ms(u64::MAX).as_str(), "9999-12-31T23:59:59.999Z");
        assert_eq!(parse_rfc3339_ms("2026-06-25T19:00:00.123Z"), Some(T0));
        assert_eq!(parse_rfc3339_ms("2026-06-25T19:00:00.123456789Z"), Some(T0));
        assert_eq!(parse_rfc3339_ms("2026-06-25t19:00:00.1z"), Some(T0 - 23));
        assert_eq!(parse_rfc3339_ms("2026-06-25T21:00:00.123+02:00"), Some(T0));
        assert_eq!(parse_rfc3339_ms("2026-06-25T18:30:00.123-00:30"), Some(T0));
        assert_eq!(parse_rfc3339_ms("2000-02-29T00:00:00Z"), Some(951_782_400_000));
        for bad in [
            "",
            "2026-06-25",
            "2026-06-25T19:00:00",
            "2026-06-25T19:00:00.Z",
            "2026-13-01T00:00:00Z",
            "2026-02-29T00:00:00Z",
            "1900-02-29T00:00:00Z",
            "2026-06-25T24:00:00Z",
            "2026-06-25T23:59:60Z",
            "2026-06-25T19:00:00+0200",
            "1969-12-31T23:59:59Z",
            "2026-06-25T19:00:00Zjunk",
        ] {
            assert_eq!(parse_rfc3339_ms(bad), None, "{bad}");
        }
    }

    #[test]
    fn rfc3339_round_trips_over_the_range() {
        // Every day boundary of four centuries (covers leap-year rules) plus odd offsets.
        let mut ms = 0u64;
        while ms < 13_000_000_000_000 {
            let text = format_rfc3339_ms(ms);
            assert_eq!(parse_rfc3339_ms(&text), Some(ms), "{text}");
            ms += 86_400_000 + 3_600_123;
        }
        assert_eq!(parse_rfc3339_ms(&format_rfc3339_ms(RFC3339_MS_MAX)), Some(RFC3339_MS_MAX));
    }
}
