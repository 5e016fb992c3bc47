//! The W3C trace context of a row (`traceparent`, `tracestate`): read from
//! the row's headers, and written for the relay's span.

/// A valid `traceparent`: version `00` (or a later one, read as `00`), a
/// trace id and a parent id that are not all zeros, and the flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: u128,
    pub span_id: u64,
    pub sampled: bool,
}

impl TraceParent {
    /// The context `header` names, or `None` if it is not a valid
    /// `traceparent` (the relay's span is then the root of a new trace).
    pub fn parse(header: &str) -> Option<TraceParent> {
        let header = header.trim();
        let mut parts = header.split('-');
        let version = parts.next()?;
        let trace_id = parts.next()?;
        let span_id = parts.next()?;
        let flags = parts.next()?;
        let rest = parts.next();
        if version.len() != 2 || !is_lower_hex(version) || version == "ff" {
            return None;
        }
        // Version 00 has exactly four fields; a later one may add more.
        if version == "00" && rest.is_some() {
            return None;
        }
        if trace_id.len() != 32 || span_id.len() != 16 || flags.len() != 2 {
            return None;
        }
        if !is_lower_hex(trace_id) || !is_lower_hex(span_id) || !is_lower_hex(flags) {
            return None;
        }
        let trace_id = u128::from_str_radix(trace_id, 16).ok()?;
        let span_id = u64::from_str_radix(span_id, 16).ok()?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        if trace_id == 0 || span_id == 0 {
            return None;
        }
        Some(TraceParent {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
        })
    }

    /// The header's text, version `00` (written digit by digit: it is made
    /// for every row whose span is sampled).
    pub fn header(&self) -> String {
        let mut text = String::with_capacity(55);
        text.push_str("00-");
        push_hex(&mut text, &self.trace_id.to_be_bytes());
        text.push('-');
        push_hex(&mut text, &self.span_id.to_be_bytes());
        text.push_str(if self.sampled { "-01" } else { "-00" });
        text
    }
}

/// `bytes` in lower-case hex, two digits each.
fn push_hex(text: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for byte in bytes {
        text.push(char::from(DIGITS[usize::from(byte >> 4)]));
        text.push(char::from(DIGITS[usize::from(byte & 0xf)]));
    }
}

fn is_lower_hex(text: &str) -> bool {
    text.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_header_round_trips() {
        let parent = TraceParent::parse(VALID).expect("valid");
        assert_eq!(parent.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(parent.span_id, 0x00f067aa0ba902b7);
        assert!(parent.sampled);
        assert_eq!(parent.header(), VALID);
        let unsampled = TraceParent::parse(&VALID.replace("-01", "-00")).expect("valid");
        assert!(!unsampled.sampled);
    }

    #[test]
    fn invalid_headers_are_no_parent() {
        for header in [
            "",
            "00-abc-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceParent::parse(header), None, "{header:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_as_00() {
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes";
        let parent = TraceParent::parse(later).expect("read");
        assert_eq!(parent.header(), VALID);
    }
}
