//! A tiny JSON object writer for flat response bodies: string, integer and boolean
//! fields written straight into the caller's `BytesMut`, strings escaped per RFC 8259.
//!
//! What it does not do: nesting, arrays, floats, parsing (request bodies are parsed in
//! the API layer), or allocation. Field names are written escaped too, although ours are
//! static identifiers: the writer stays correct whatever it is given.
//!
//! Also the one decimal writer of the layer, [`write_u64`]: JSON integers here, and the
//! status code, `content-length` and `retry-after` of the response head.
//!
//! Read next: [`super::response::StateBody`], the body every reservation answer uses.

use bytes::BytesMut;

/// An open JSON object. [`JsonObject::finish`] closes it; it is `#[must_use]` so that an
/// object left open is a warning, not a malformed body on the wire.
#[must_use = "call finish() to close the object"]
pub struct JsonObject<'o> {
    out: &'o mut BytesMut,
    fields: usize,
}

impl<'o> JsonObject<'o> {
    pub fn begin(out: &'o mut BytesMut) -> JsonObject<'o> {
        out.extend_from_slice(b"{");
        JsonObject { out, fields: 0 }
    }

    pub fn str(&mut self, name: &str, value: &str) -> &mut Self {
        self.name(name);
        write_json_string(self.out, value);
        self
    }

    /// Nothing at all when `value` is `None`.
    pub fn opt_str(&mut self, name: &str, value: Option<&str>) -> &mut Self {
        if let Some(value) = value {
            self.str(name, value);
        }
        self
    }

    pub fn u64(&mut self, name: &str, value: u64) -> &mut Self {
        self.name(name);
        write_u64(self.out, value);
        self
    }

    /// Nothing at all when `value` is `None`.
    pub fn opt_u64(&mut self, name: &str, value: Option<u64>) -> &mut Self {
        if let Some(value) = value {
            self.u64(name, value);
        }
        self
    }

    pub fn bool(&mut self, name: &str, value: bool) -> &mut Self {
        self.name(name);
        self.out.extend_from_slice(if value { b"true" } else { b"false" });
        self
    }

    pub fn finish(self) {
        self.out.extend_from_slice(b"}");
    }

    fn name(&mut self, name: &str) {
        if self.fields > 0 {
            self.out.extend_from_slice(b",");
        }
        self.fields += 1;
        write_json_string(self.out, name);
        self.out.extend_from_slice(b":");
    }
}

/// `value` as a JSON string: quotes, backslash and C0 controls escaped (`\n`, `\r`, `\t`
/// short forms, `\u00XX` for the rest); everything else, UTF-8 included, as is. Runs of
/// plain bytes are copied at once.
pub fn write_json_string(out: &mut BytesMut, value: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = value.as_bytes();
    out.extend_from_slice(b"\"");
    let mut plain_start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let short: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[plain_start..i]);
        if short.is_empty() {
            out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 0xf)],
            ]);
        } else {
            out.extend_from_slice(short);
        }
        plain_start = i + 1;
    }
    out.extend_from_slice(&bytes[plain_start..]);
    out.extend_from_slice(b"\"");
}

/// Decimal digits of `value`, formatted on the stack.
pub(super) fn write_u64(out: &mut BytesMut, value: u64) {
    out.extend_from_slice(flashsale_io::resp::U64Text::new(value).as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(write: impl FnOnce(&mut BytesMut)) -> String {
        let mut out = BytesMut::new();
        write(&mut out);
        String::from_utf8(out.to_vec()).expect("the writer emits UTF-8")
    }

    #[test]
    fn empty_object_and_every_field_kind() {
        assert_eq!(written(|out| JsonObject::begin(out).finish()), "{}");
        let text = written(|out| {
            let mut object = JsonObject::begin(out);
            object
                .str("a", "x")
                .u64("b", 0)
                .bool("c", false)
                .bool("d", true)
                .opt_str("e", None)
                .opt_u64("f", None);
            object.opt_u64("g", Some(u64::MAX)).opt_str("h", Some(""));
            object.finish();
        });
        assert_eq!(text, r#"{"a":"x","b":0,"c":false,"d":true,"g":18446744073709551615,"h":""}"#);
    }

    #[test]
    fn escaping_matches_serde_json() {
        let samples = [
            "plain",
            "quote\"back\\slash",
            "nl\ncr\rtab\t",
            "\u{0}\u{1}\u{1f}\u{7f}",
            "é€😀",
            "</script>",
        ];
        for sample in samples {
            let text = written(|out| write_json_string(out, sample));
            let decoded: String = serde_json::from_str(&text).expect("valid JSON string");
            assert_eq!(decoded, sample);
            assert_eq!(text, serde_json::to_string(sample).expect("serializable"));
        }
    }

    #[test]
    fn object_with_hostile_values_is_valid_json() {
        let text = written(|out| {
            let mut object = JsonObject::begin(out);
            object.str("request_id", "a\"}],{\"x\":1").str("we\"ird", "\u{8}");
            object.finish();
        });
        let value: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
        assert_eq!(value["request_id"], "a\"}],{\"x\":1");
        assert_eq!(value["we\"ird"], "\u{8}");
        assert_eq!(value.as_object().map(|o| o.len()), Some(2));
    }
}
