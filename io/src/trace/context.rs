//! A reservation's trace context (DESIGN.md section 9; seed ch9 §8.4, §12.10), sans-I/O: the
//! W3C `traceparent` read and written, the head-sampling decision, and the ids a message id
//! fixes.
//!
//! The rule, decided once per reservation and honoured by every later step:
//!
//! - The reservation continues the buyer's trace when the request carried a valid
//!   `traceparent` (W3C Trace Context), otherwise it starts the trace its message id names
//!   ([`MessageIds::trace_id`]). Either way the reservation span's id is the one its message
//!   id names ([`MessageIds::reservation_span_id`]), so a step that knows only the message id
//!   (a republish by the scanner, an event that carries no context) can still link to it.
//! - Sampled or not is decided on the trace id by the configured ratio ([`SampleRatio`], the
//!   arithmetic of OpenTelemetry's `TraceIdRatioBased`), never by the buyer's own sampled
//!   flag: buyers do not choose what this service exports.
//! - The decision travels in the `traceparent` the order-create message carries (the
//!   reservation span's context, its flag set or not), and each step downstream records a
//!   span only when that flag says so ([`TraceContext::parse`]).
//!
//! What it is not: recording spans (`span.rs`), queueing them (`sink.rs`), or exporting them
//! (`export.rs`).

use sha2::{Digest, Sha256};

/// Length of a version-00 `traceparent`: `00-` 32 hex `-` 16 hex `-` 2 hex.
pub const TRACEPARENT_BYTES: usize = 55;

/// One span's place in a trace: the trace, the span, and whether the trace is sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

impl TraceContext {
    /// A W3C `traceparent`: version 00 exactly, or a later version's first 55 characters
    /// followed by `-` (forward compatibility, as the recommendation asks). None for anything
    /// else, all-zero ids and version `ff` included.
    pub fn parse(value: &str) -> Option<TraceContext> {
        let bytes = value.as_bytes();
        let version = bytes.get(..2)?;
        let fits = match version {
            b"00" => bytes.len() == TRACEPARENT_BYTES,
            b"ff" => false,
            _ => {
                bytes.len() == TRACEPARENT_BYTES
                    || (bytes.len() > TRACEPARENT_BYTES && bytes[TRACEPARENT_BYTES] == b'-')
            }
        };
        if !fits || bytes[2] != b'-' || bytes[35] != b'-' || bytes[52] != b'-' {
            return None;
        }
        hex_lower(version)?;
        let trace_id: [u8; 16] = hex_lower(&bytes[3..35])?.try_into().ok()?;
        let span_id: [u8; 8] = hex_lower(&bytes[36..52])?.try_into().ok()?;
        let flags = hex_lower(&bytes[53..55])?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceContext { trace_id, span_id, sampled: flags[0] & 1 == 1 })
    }

    /// The version-00 `traceparent` of this context.
    pub fn traceparent(&self) -> String {
        let mut out = String::with_capacity(TRACEPARENT_BYTES);
        out.push_str("00-");
        out.push_str(&hex::encode(self.trace_id));
        out.push('-');
        out.push_str(&hex::encode(self.span_id));
        out.push_str(if self.sampled { "-01" } else { "-00" });
        out
    }
}

/// Lowercase hex only (W3C: uppercase is invalid).
fn hex_lower(text: &[u8]) -> Option<Vec<u8>> {
    if text.iter().any(|b| !matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    hex::decode(text).ok()
}

/// The ids a message id names: the trace of a reservation whose buyer sent no
/// `traceparent`, and the reservation span's id. SHA-256 of the message id (itself a random
/// 128-bit id): as random as W3C asks, the same on every process that reads the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageIds {
    pub trace_id: [u8; 16],
    pub reservation_span_id: [u8; 8],
}

impl MessageIds {
    pub fn of(message_id: &str) -> MessageIds {
        let digest = Sha256::new()
            .chain_update(b"flashsale.trace\0")
            .chain_update(message_id.as_bytes())
            .finalize();
        let mut trace_id = [0u8; 16];
        trace_id.copy_from_slice(&digest[..16]);
        let mut reservation_span_id = [0u8; 8];
        reservation_span_id.copy_from_slice(&digest[16..24]);
        // All-zero ids are invalid; a digest with sixteen (or eight) zero bytes in a row is
        // not going to happen, but the ids must be valid whatever the input.
        trace_id[15] |= u8::from(trace_id == [0; 16]);
        reservation_span_id[7] |= u8::from(reservation_span_id == [0; 8]);
        MessageIds { trace_id, reservation_span_id }
    }
}

/// Parts per million of traces exported (`FLASHSALE_TRACE_SAMPLE_RATIO`, `0`..=`1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SampleRatio {
    ppm: u32,
}

impl SampleRatio {
    pub const PPM_MAX: u32 = 1_000_000;
    /// Every trace.
    pub const ALL: SampleRatio = SampleRatio { ppm: SampleRatio::PPM_MAX };
    /// None.
    pub const NONE: SampleRatio = SampleRatio { ppm: 0 };

    /// A decimal ratio between 0 and 1 (`0.25`, `1`, `0`), to a millionth.
    pub fn parse(text: &str) -> Result<SampleRatio, String> {
        let value: f64 =
            text.trim().parse().map_err(|_| format!("{text:?} is not a number between 0 and 1"))?;
        if !(0.0..=1.0).contains(&value) {
            return Err(format!("{text:?} is not between 0 and 1"));
        }
        Ok(SampleRatio { ppm: (value * f64::from(SampleRatio::PPM_MAX)).round() as u32 })
    }

    pub fn ppm(self) -> u32 {
        self.ppm
    }

    pub fn as_f64(self) -> f64 {
        f64::from(self.ppm) / f64::from(SampleRatio::PPM_MAX)
    }

    /// Whether the trace `trace_id` is sampled: its last 63 bits below ratio × 2^63, as
    /// OpenTelemetry's `TraceIdRatioBased` decides, so a service that samples the same trace
    /// at the same ratio agrees.
    pub fn samples(self, trace_id: &[u8; 16]) -> bool {
        if self.ppm >= SampleRatio::PPM_MAX {
            return true;
        }
        let mut low = [0u8; 8];
        low.copy_from_slice(&trace_id[8..]);
        let draw = u64::from_be_bytes(low) >> 1;
        let bound = (u128::from(self.ppm) << 63) / u128::from(SampleRatio::PPM_MAX);
        u128::from(draw) < bound
    }
}

/// A reservation's context and its parent: the buyer's span when the request carried one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReservationContext {
    pub context: TraceContext,
    /// The buyer's span (remote), when its `traceparent` was valid.
    pub parent: Option<[u8; 8]>,
}

impl ReservationContext {
    /// The rule of the module documentation: the buyer's trace or the message's, the span id
    /// of the message, sampled by `ratio` on the trace id.
    pub fn decide(
        buyer_traceparent: Option<&str>,
        message_id: &str,
        ratio: SampleRatio,
    ) -> ReservationContext {
        let ids = MessageIds::of(message_id);
        let buyer = buyer_traceparent.and_then(TraceContext::parse);
        let trace_id = buyer.map_or(ids.trace_id, |b| b.trace_id);
        let context = TraceContext {
            trace_id,
            span_id: ids.reservation_span_id,
            sampled: ratio.samples(&trace_id),
        };
        ReservationContext { context, parent: buyer.map(|b| b.span_id) }
    }

    /// What a step that knows only the message id can tell of its reservation: the trace the
    /// message id names, the reservation span, and the decision the ratio takes on that trace
    /// (the reservation's own decision when its buyer sent no `traceparent`).
    pub fn of_message(message_id: &str, ratio: SampleRatio) -> TraceContext {
        let ids = MessageIds::of(message_id);
        TraceContext {
            trace_id: ids.trace_id,
            span_id: ids.reservation_span_id,
            sampled: ratio.samples(&ids.trace_id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn a_traceparent_round_trips_and_invalid_ones_are_refused() {
        let context = TraceContext::parse(TRACE).expect("valid");
        assert!(context.sampled);
        assert_eq!(context.traceparent(), TRACE);
        let unsampled = TraceContext::parse(&TRACE.replace("-01", "-00")).expect("valid");
        assert!(!unsampled.sampled);
        // A later version with more fields: its first 55 characters.
        assert!(TraceContext::parse(&format!("{}-extra", TRACE.replacen("00", "01", 1))).is_some());
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "00_0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_ratio_decides_on_the_trace_id_at_its_bounds_and_in_proportion() {
        assert_eq!(SampleRatio::parse("1"), Ok(SampleRatio::ALL));
        assert_eq!(SampleRatio::parse("0"), Ok(SampleRatio::NONE));
        assert_eq!(SampleRatio::parse(" 0.25 ").map(SampleRatio::ppm), Ok(250_000));
        assert!(SampleRatio::parse("1.5").is_err() && SampleRatio::parse("half").is_err());
        assert!(SampleRatio::parse("-0.1").is_err() && SampleRatio::parse("NaN").is_err());
        let quarter = SampleRatio::parse("0.25").expect("ratio");
        let (mut all, mut none, mut some) = (0, 0, 0);
        for i in 0..4_000 {
            let trace_id = MessageIds::of(&format!("msg_{i}")).trace_id;
            all += usize::from(SampleRatio::ALL.samples(&trace_id));
            none += usize::from(SampleRatio::NONE.samples(&trace_id));
            some += usize::from(quarter.samples(&trace_id));
        }
        assert_eq!((all, none), (4_000, 0));
        assert!((850..1_150).contains(&some), "a quarter of 4,000 sampled, got {some}");
    }

    #[test]
    fn a_reservation_continues_the_buyers_trace_and_names_its_span_by_the_message() {
        let ids = MessageIds::of("msg_1");
        assert_eq!(ids, MessageIds::of("msg_1"), "the same on every process");
        assert_ne!(ids, MessageIds::of("msg_2"));
        let own = ReservationContext::decide(None, "msg_1", SampleRatio::ALL);
        assert_eq!(own.context.trace_id, ids.trace_id);
        assert_eq!(own.context.span_id, ids.reservation_span_id);
        assert_eq!(own.parent, None);
        assert_eq!(ReservationContext::of_message("msg_1", SampleRatio::ALL), own.context);
        let buyer = TraceContext::parse(TRACE).expect("valid");
        let continued = ReservationContext::decide(Some(TRACE), "msg_1", SampleRatio::ALL);
        assert_eq!(continued.context.trace_id, buyer.trace_id);
        assert_eq!(continued.context.span_id, ids.reservation_span_id);
        assert_eq!(continued.parent, Some(buyer.span_id));
        // The buyer's sampled flag is not theirs to set; a malformed one is ignored.
        assert!(
            !ReservationContext::decide(Some(TRACE), "msg_1", SampleRatio::NONE).context.sampled
        );
        assert_eq!(ReservationContext::decide(Some("junk"), "msg_1", SampleRatio::ALL), own);
    }
}
