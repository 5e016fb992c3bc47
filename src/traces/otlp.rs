//! OTLP over HTTP in protobuf, written by hand: a publish span's fields as
//! it starts and as it ends, and the `ExportTraceServiceRequest` around a
//! batch of them. A span is bytes from its start: nothing of it is copied
//! into owned messages, grouped or encoded again later, as the generic path
//! (`opentelemetry-proto` and `prost`) does, at several thousand
//! instructions per span. The messages are those of
//! `opentelemetry/proto/trace/v1/trace.proto`, `common/v1/common.proto` and
//! `resource/v1/resource.proto`; a test decodes what is written here with
//! `opentelemetry-proto`.

use std::time::{SystemTime, UNIX_EPOCH};

/// Protobuf wire types.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

/// `Span.SpanKind.SPAN_KIND_PRODUCER`.
const PRODUCER: u64 = 4;
/// `Status.StatusCode.STATUS_CODE_ERROR`.
const STATUS_ERROR: u64 = 2;
/// `SpanFlags`: the W3C sampled flag, and whether the parent's being remote
/// is known (always, here) and true.
const SAMPLED: u32 = 0x01;
const HAS_IS_REMOTE: u32 = 0x100;
const IS_REMOTE: u32 = 0x200;

/// A `Resource` message's fields: `service.name` and the other attributes.
pub fn resource(service_name: &str, attributes: &[(String, String)]) -> Vec<u8> {
    let mut buf = Vec::new();
    attribute_str(&mut buf, 1, "service.name", service_name);
    for (key, value) in attributes {
        attribute_str(&mut buf, 1, key, value);
    }
    buf
}

/// An `InstrumentationScope` message's fields.
pub fn scope(name: &str, version: &str) -> Vec<u8> {
    let mut buf = Vec::new();
    string(&mut buf, 1, name);
    string(&mut buf, 2, version);
    buf
}

/// The request body for a batch: `spans` is the batch's spans, each written
/// as a `ScopeSpans.spans` field (see [`push_span`]), all of one resource
/// and one scope.
pub fn export_request(resource: &[u8], scope: &[u8], spans: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(spans.len() + resource.len() + scope.len() + 32);
    message(&mut body, 1, |buf| {
        message(buf, 1, |buf| buf.extend_from_slice(resource));
        message(buf, 2, |buf| {
            message(buf, 1, |buf| buf.extend_from_slice(scope));
            buf.extend_from_slice(spans);
        });
    });
    body
}

/// Appends one finished span's fields to a batch, as a `ScopeSpans.spans`
/// field.
pub fn push_span(batch: &mut Vec<u8>, span: &[u8]) {
    tag(batch, 2, LEN);
    length_delimited(batch, span);
}

/// What a span holds from its start.
pub struct Opening<'a> {
    pub trace_id: u128,
    pub span_id: u64,
    /// The W3C `tracestate` header ("" for none).
    pub trace_state: &'a str,
    /// The remote parent's span id, if the span has one.
    pub parent_span_id: Option<u64>,
    pub name: &'a str,
    pub start: SystemTime,
}

/// A span's fields known at its start, kind PRODUCER. Its attributes
/// follow (see [`attribute_str`], [`attribute_i64`], [`constant`]), then
/// [`close`].
pub fn open(buf: &mut Vec<u8>, span: &Opening<'_>) {
    bytes(buf, 1, &span.trace_id.to_be_bytes());
    bytes(buf, 2, &span.span_id.to_be_bytes());
    string(buf, 3, span.trace_state);
    if let Some(parent) = span.parent_span_id {
        bytes(buf, 4, &parent.to_be_bytes());
    }
    string(buf, 5, span.name);
    uint(buf, 6, PRODUCER);
    fixed64(buf, 7, nanos(span.start));
}

/// Attributes written once and copied into every span (those whose key and
/// value never change for a name): `Span.attributes` fields.
pub fn constant(attributes: &[(&str, &str)]) -> Vec<u8> {
    let mut buf = Vec::new();
    for (key, value) in attributes {
        attribute_str(&mut buf, 9, key, value);
    }
    buf
}

/// A string attribute of a span (`field` 9), or of a resource (1).
pub fn attribute_str(buf: &mut Vec<u8>, field: u32, key: &str, value: &str) {
    message(buf, field, |buf| {
        string(buf, 1, key);
        message(buf, 2, |buf| {
            // AnyValue.string_value: a oneof, written even when empty.
            tag(buf, 1, LEN);
            length_delimited(buf, value.as_bytes());
        });
    });
}

/// An integer attribute of a span.
pub fn attribute_i64(buf: &mut Vec<u8>, key: &str, value: i64) {
    message(buf, 9, |buf| {
        string(buf, 1, key);
        message(buf, 2, |buf| {
            tag(buf, 3, VARINT);
            varint(buf, value as u64);
        });
    });
}

/// A span's last fields: its end, its status (ERROR with `error`'s text, or
/// unset), its flags (sampled; whether its parent was remote).
pub fn close(buf: &mut Vec<u8>, end: SystemTime, error: Option<&str>, remote_parent: bool) {
    fixed64(buf, 8, nanos(end));
    message(buf, 15, |buf| {
        if let Some(error) = error {
            string(buf, 2, error);
            uint(buf, 3, STATUS_ERROR);
        }
    });
    let mut flags = SAMPLED | HAS_IS_REMOTE;
    if remote_parent {
        flags |= IS_REMOTE;
    }
    fixed32(buf, 16, flags);
}

fn nanos(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64)
}

fn tag(buf: &mut Vec<u8>, field: u32, wire: u32) {
    varint(buf, u64::from((field << 3) | wire));
}

fn varint(buf: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        buf.push((value as u8) | 0x80);
        value >>= 7;
    }
    buf.push(value as u8);
}

fn length_delimited(buf: &mut Vec<u8>, bytes: &[u8]) {
    varint(buf, bytes.len() as u64);
    buf.extend_from_slice(bytes);
}

/// A `bytes` field; proto3 leaves an empty one out.
fn bytes(buf: &mut Vec<u8>, field: u32, value: &[u8]) {
    if !value.is_empty() {
        tag(buf, field, LEN);
        length_delimited(buf, value);
    }
}

/// A `string` field; proto3 leaves an empty one out.
fn string(buf: &mut Vec<u8>, field: u32, value: &str) {
    bytes(buf, field, value.as_bytes());
}

/// A `uint32`, `uint64` or enum field; proto3 leaves a zero out.
fn uint(buf: &mut Vec<u8>, field: u32, value: u64) {
    if value != 0 {
        tag(buf, field, VARINT);
        varint(buf, value);
    }
}

fn fixed64(buf: &mut Vec<u8>, field: u32, value: u64) {
    if value != 0 {
        tag(buf, field, FIXED64);
        buf.extend_from_slice(&value.to_le_bytes());
    }
}

fn fixed32(buf: &mut Vec<u8>, field: u32, value: u32) {
    if value != 0 {
        tag(buf, field, FIXED32);
        buf.extend_from_slice(&value.to_le_bytes());
    }
}

/// An embedded message: `write` appends its fields, then its length is
/// put in front of them. One byte is kept for it beforehand, which is all
/// a message under 128 bytes needs (nearly all of them: an attribute, a
/// value, a span's status); a longer one has the rest of its length put in
/// by moving what it wrote (a span, a batch's scope: a few per batch).
fn message(buf: &mut Vec<u8>, field: u32, write: impl FnOnce(&mut Vec<u8>)) {
    tag(buf, field, LEN);
    let at = buf.len();
    buf.push(0);
    write(buf);
    let len = buf.len() - at - 1;
    if len < 0x80 {
        buf[at] = len as u8;
        return;
    }
    let mut prefix = Vec::with_capacity(10);
    varint(&mut prefix, len as u64);
    buf[at] = prefix[0];
    buf.splice(at + 1..at + 1, prefix[1..].iter().copied());
}

/// What an endpoint's answer (`ExportTraceServiceResponse`) says it
/// rejected, in its `partial_success`: `None` when it rejected nothing, or
/// the answer is empty or not one.
pub fn rejected(answer: &[u8]) -> Option<Rejected> {
    let partial = fields(answer).find_map(|(field, value)| match (field, value) {
        (1, Field::Bytes(partial)) => Some(partial),
        _ => None,
    })?;
    let mut rejected = Rejected::default();
    for (field, value) in fields(partial) {
        match (field, value) {
            (1, Field::Varint(spans)) => rejected.spans = spans,
            (2, Field::Bytes(message)) => {
                rejected.message = String::from_utf8_lossy(message).into_owned();
            }
            _ => {}
        }
    }
    (rejected.spans > 0 || !rejected.message.is_empty()).then_some(rejected)
}

/// Spans an endpoint took but rejected, and what it said of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rejected {
    pub spans: u64,
    pub message: String,
}

/// A field's value as read off the wire.
enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

/// The fields of an encoded message, in order; it stops at the first that
/// cannot be read.
fn fields(mut buf: &[u8]) -> impl Iterator<Item = (u64, Field<'_>)> {
    std::iter::from_fn(move || {
        let tag = read_varint(&mut buf)?;
        let value = match (tag & 7) as u32 {
            VARINT => Field::Varint(read_varint(&mut buf)?),
            FIXED64 => {
                buf = buf.get(8..)?;
                Field::Fixed
            }
            LEN => {
                let len = usize::try_from(read_varint(&mut buf)?).ok()?;
                let value = buf.get(..len)?;
                buf = &buf[len..];
                Field::Bytes(value)
            }
            FIXED32 => {
                buf = buf.get(4..)?;
                Field::Fixed
            }
            _ => return None,
        };
        Some((tag >> 3, value))
    })
}

fn read_varint(buf: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for (n, byte) in buf.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * n);
        if byte & 0x80 == 0 {
            *buf = &buf[n + 1..];
            return Some(value);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
    use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
    use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
    use prost::Message;

    use super::*;

    fn text(key: &str, value: &str) -> KeyValue {
        KeyValue {
            key: key.into(),
            value: Some(AnyValue {
                value: Some(Value::StringValue(value.into())),
            }),
            ..Default::default()
        }
    }

    fn span(n: u64, parent: Option<u64>, error: Option<&str>, big: usize) -> Vec<u8> {
        let start = UNIX_EPOCH + Duration::from_nanos(1_764_000_000_123_456_789 + n);
        let mut buf = Vec::new();
        open(
            &mut buf,
            &Opening {
                trace_id: 0x0af7651916cd43dd8448eb211c80319c + u128::from(n),
                span_id: 0xb7ad6b7169203331 + n,
                trace_state: if n == 0 { "vendor=v1,other=x" } else { "" },
                parent_span_id: parent,
                name: "publish orders",
                start,
            },
        );
        buf.extend_from_slice(&constant(&[("messaging.system", "rabbitmq")]));
        attribute_str(&mut buf, 9, "outbox.tenant_id", &"t".repeat(big));
        attribute_str(&mut buf, 9, "empty", "");
        attribute_i64(&mut buf, "outbox.delay_ms", -7 + n as i64);
        close(
            &mut buf,
            start + Duration::from_millis(3),
            error,
            parent.is_some(),
        );
        buf
    }

    #[test]
    fn a_request_decodes_with_opentelemetry_proto_to_what_was_written() {
        let mut batch = Vec::new();
        push_span(&mut batch, &span(0, Some(0x00f067aa0ba902b7), None, 1));
        push_span(
            &mut batch,
            &span(1, None, Some("unroutable: no queue"), 70_000),
        );
        let body = export_request(
            &resource(
                "billing",
                &[("deployment.environment".into(), "prod".into())],
            ),
            &scope("outbox-relay", "0.1.0"),
            &batch,
        );
        let request = ExportTraceServiceRequest::decode(body.as_slice()).expect("decodes");
        assert_eq!(request.resource_spans.len(), 1);
        let resource_spans = &request.resource_spans[0];
        assert_eq!(
            resource_spans.resource.as_ref().unwrap().attributes,
            vec![
                text("service.name", "billing"),
                text("deployment.environment", "prod")
            ]
        );
        let scope_spans = &resource_spans.scope_spans;
        assert_eq!(scope_spans.len(), 1);
        let scope = scope_spans[0].scope.as_ref().unwrap();
        assert_eq!(
            (scope.name.as_str(), scope.version.as_str()),
            ("outbox-relay", "0.1.0")
        );
        let spans = &scope_spans[0].spans;
        assert_eq!(spans.len(), 2);

        let first = &spans[0];
        assert_eq!(
            first.trace_id,
            0x0af7651916cd43dd8448eb211c80319c_u128.to_be_bytes()
        );
        assert_eq!(first.span_id, 0xb7ad6b7169203331_u64.to_be_bytes());
        assert_eq!(first.parent_span_id, 0x00f067aa0ba902b7_u64.to_be_bytes());
        assert_eq!(first.trace_state, "vendor=v1,other=x");
        assert_eq!(first.name, "publish orders");
        assert_eq!(first.kind, SpanKind::Producer as i32);
        assert_eq!(first.start_time_unix_nano, 1_764_000_000_123_456_789);
        assert_eq!(first.end_time_unix_nano, 1_764_000_000_126_456_789);
        assert_eq!(first.flags, 0x301, "sampled, remote parent");
        assert_eq!(
            first.attributes,
            vec![
                text("messaging.system", "rabbitmq"),
                text("outbox.tenant_id", "t"),
                text("empty", ""),
                KeyValue {
                    key: "outbox.delay_ms".into(),
                    value: Some(AnyValue {
                        value: Some(Value::IntValue(-7)),
                    }),
                    ..Default::default()
                },
            ]
        );
        let status = first.status.as_ref().expect("a status");
        assert_eq!(
            (status.code, status.message.as_str()),
            (StatusCode::Unset as i32, "")
        );

        let second = &spans[1];
        assert!(second.parent_span_id.is_empty(), "a root");
        assert_eq!(second.trace_state, "");
        assert_eq!(second.flags, 0x101, "sampled, local root");
        assert_eq!(attribute_len(second, "outbox.tenant_id"), 70_000);
        let status = second.status.as_ref().expect("a status");
        assert_eq!(status.code, StatusCode::Error as i32);
        assert_eq!(status.message, "unroutable: no queue");
    }

    fn attribute_len(span: &opentelemetry_proto::tonic::trace::v1::Span, key: &str) -> usize {
        match &span
            .attributes
            .iter()
            .find(|kv| kv.key == key)
            .unwrap()
            .value
        {
            Some(AnyValue {
                value: Some(Value::StringValue(s)),
            }) => s.len(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_answer_names_what_it_rejected() {
        use opentelemetry_proto::tonic::collector::trace::v1::{
            ExportTracePartialSuccess, ExportTraceServiceResponse,
        };
        let answer = |rejected_spans, error_message: &str| {
            ExportTraceServiceResponse {
                partial_success: Some(ExportTracePartialSuccess {
                    rejected_spans,
                    error_message: error_message.into(),
                }),
            }
            .encode_to_vec()
        };
        assert_eq!(
            rejected(&answer(3, "too old")),
            Some(Rejected {
                spans: 3,
                message: "too old".into()
            })
        );
        assert_eq!(rejected(&answer(0, "")), None);
        assert_eq!(rejected(&[]), None);
        assert_eq!(rejected(b"\xff\xff\xff"), None);
        let empty = ExportTraceServiceResponse {
            partial_success: None,
        };
        assert_eq!(rejected(&empty.encode_to_vec()), None);
    }
}
