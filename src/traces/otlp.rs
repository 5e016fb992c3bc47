//! The OTLP/HTTP request body for a batch of spans, an
//! `ExportTraceServiceRequest` in protobuf, written straight from the SDK's
//! span data into one buffer.
//!
//! The generic path (`opentelemetry-proto`'s messages, then `prost`) copies
//! every span into owned messages first: a `String` for each attribute's key
//! and value, a `Vec` for each id, a map to group the spans by scope. Most
//! of what tracing cost the relay per row was that copy, so the body is
//! written here field by field instead, in the order and with the values
//! that path gives (a test decodes both and compares them). The messages
//! are those of `opentelemetry/proto/trace/v1/trace.proto`,
//! `common/v1/common.proto` and `resource/v1/resource.proto`.

use opentelemetry::trace::{SpanId, SpanKind, Status, TraceFlags};
use opentelemetry::{Array, InstrumentationScope, Key, KeyValue, StringValue, Value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SpanData;
use std::time::{SystemTime, UNIX_EPOCH};

/// Protobuf wire types.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

/// `SpanFlags`: the span's `is_remote` says something (always, here), and
/// what: its parent was remote.
const HAS_IS_REMOTE: u32 = 0x100;
const IS_REMOTE: u32 = 0x200;

/// The resource of every span of the process, encoded once as a
/// `ResourceSpans`' first fields (`resource`, and `schema_url` last).
#[derive(Debug, Default, Clone)]
pub struct EncodedResource {
    resource: Vec<u8>,
    schema_url: String,
}

impl EncodedResource {
    pub fn new(resource: &Resource) -> EncodedResource {
        let mut attributes = Vec::new();
        for (key, value) in resource.iter() {
            message(&mut attributes, 1, |buf| key_value(buf, key, value));
        }
        EncodedResource {
            resource: attributes,
            schema_url: resource.schema_url().unwrap_or_default().to_owned(),
        }
    }
}

/// The request body for `spans`: one `ResourceSpans` holding one
/// `ScopeSpans` per instrumentation scope, in the order the scopes first
/// appear.
pub fn export_request(resource: &EncodedResource, spans: &[SpanData]) -> Vec<u8> {
    let mut scopes: Vec<(&InstrumentationScope, Vec<u8>)> = Vec::new();
    for data in spans {
        let at = match scopes
            .iter()
            .position(|(scope, _)| *scope == &data.instrumentation_scope)
        {
            Some(at) => at,
            None => {
                scopes.push((
                    &data.instrumentation_scope,
                    Vec::with_capacity(spans.len() * 400),
                ));
                scopes.len() - 1
            }
        };
        message(&mut scopes[at].1, 2, |buf| span(buf, data));
    }
    let mut body =
        Vec::with_capacity(scopes.iter().map(|(_, s)| s.len() + 64).sum::<usize>() + 256);
    message(&mut body, 1, |buf| {
        message(buf, 1, |buf| buf.extend_from_slice(&resource.resource));
        for (scope, spans) in &scopes {
            message(buf, 2, |buf| {
                message(buf, 1, |buf| instrumentation_scope(buf, scope));
                buf.extend_from_slice(spans);
                string(buf, 3, scope.schema_url().unwrap_or_default());
            });
        }
        string(buf, 3, &resource.schema_url);
    });
    body
}

/// One `Span`.
fn span(buf: &mut Vec<u8>, data: &SpanData) {
    let context = &data.span_context;
    bytes(buf, 1, &context.trace_id().to_bytes());
    bytes(buf, 2, &context.span_id().to_bytes());
    string(buf, 3, &context.trace_state().header());
    if data.parent_span_id != SpanId::INVALID {
        bytes(buf, 4, &data.parent_span_id.to_bytes());
    }
    string(buf, 5, &data.name);
    uint(buf, 6, kind(&data.span_kind));
    fixed64(buf, 7, nanos(data.start_time));
    fixed64(buf, 8, nanos(data.end_time));
    for attribute in &data.attributes {
        message(buf, 9, |buf| {
            key_value(buf, &attribute.key, &attribute.value)
        });
    }
    uint(buf, 10, data.dropped_attributes_count.into());
    for event in data.events.iter() {
        message(buf, 11, |buf| {
            fixed64(buf, 1, nanos(event.timestamp));
            string(buf, 2, &event.name);
            attributes(buf, 3, &event.attributes);
            uint(buf, 4, event.dropped_attributes_count.into());
        });
    }
    uint(buf, 12, data.events.dropped_count.into());
    for link in data.links.iter() {
        message(buf, 13, |buf| {
            let linked = &link.span_context;
            bytes(buf, 1, &linked.trace_id().to_bytes());
            bytes(buf, 2, &linked.span_id().to_bytes());
            string(buf, 3, &linked.trace_state().header());
            attributes(buf, 4, &link.attributes);
            uint(buf, 5, link.dropped_attributes_count.into());
            fixed32(buf, 6, flags(linked.trace_flags(), linked.is_remote()));
        });
    }
    uint(buf, 14, data.links.dropped_count.into());
    message(buf, 15, |buf| {
        if let Status::Error { description } = &data.status {
            string(buf, 2, description);
        }
        uint(buf, 3, status_code(&data.status));
    });
    fixed32(
        buf,
        16,
        flags(context.trace_flags(), data.parent_span_is_remote),
    );
}

/// `SpanFlags`: the W3C trace flags in the low byte, and whether the parent
/// (or the linked span) was remote.
fn flags(trace_flags: TraceFlags, remote: bool) -> u32 {
    let mut flags = u32::from(trace_flags.to_u8()) | HAS_IS_REMOTE;
    if remote {
        flags |= IS_REMOTE;
    }
    flags
}

/// `Span.SpanKind`.
fn kind(kind: &SpanKind) -> u64 {
    match kind {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    }
}

/// `Status.StatusCode`.
fn status_code(status: &Status) -> u64 {
    match status {
        Status::Unset => 0,
        Status::Ok => 1,
        Status::Error { .. } => 2,
    }
}

fn nanos(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64)
}

/// `InstrumentationScope`.
fn instrumentation_scope(buf: &mut Vec<u8>, scope: &InstrumentationScope) {
    string(buf, 1, scope.name());
    string(buf, 2, scope.version().unwrap_or_default());
    for attribute in scope.attributes() {
        message(buf, 3, |buf| {
            key_value(buf, &attribute.key, &attribute.value)
        });
    }
}

fn attributes(buf: &mut Vec<u8>, field: u32, attributes: &[KeyValue]) {
    for attribute in attributes {
        message(buf, field, |buf| {
            key_value(buf, &attribute.key, &attribute.value)
        });
    }
}

/// `KeyValue`.
fn key_value(buf: &mut Vec<u8>, key: &Key, value: &Value) {
    string(buf, 1, key.as_str());
    message(buf, 2, |buf| any_value(buf, value));
}

/// `AnyValue`: a oneof, so even a zero or an empty string is written.
fn any_value(buf: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Bool(value) => {
            tag(buf, 2, VARINT);
            varint(buf, u64::from(*value));
        }
        Value::I64(value) => {
            tag(buf, 3, VARINT);
            varint(buf, *value as u64);
        }
        Value::F64(value) => {
            tag(buf, 4, FIXED64);
            buf.extend_from_slice(&value.to_le_bytes());
        }
        Value::String(value) => {
            tag(buf, 1, LEN);
            length_delimited(buf, value.as_str().as_bytes());
        }
        Value::Array(array) => message(buf, 5, |buf| array_values(buf, array)),
        // A kind of value this encoder does not know yet: its text.
        other => {
            tag(buf, 1, LEN);
            length_delimited(buf, other.as_str().as_bytes());
        }
    }
}

/// `ArrayValue`: its `values`, each an `AnyValue`.
fn array_values(buf: &mut Vec<u8>, array: &Array) {
    fn each<T: Clone + Into<Value>>(buf: &mut Vec<u8>, values: &[T]) {
        for value in values {
            message(buf, 1, |buf| any_value(buf, &value.clone().into()));
        }
    }
    match array {
        Array::Bool(values) => each(buf, values),
        Array::I64(values) => each(buf, values),
        Array::F64(values) => each(buf, values),
        Array::String(values) => each::<StringValue>(buf, values),
        _ => {}
    }
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
    use std::borrow::Cow;
    use std::time::Duration;

    use opentelemetry::trace::{Event, Link, SpanContext, TraceId, TraceState};
    use opentelemetry::{InstrumentationScope, KeyValue};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
    use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
    use prost::Message;

    use super::*;

    fn scope(name: &'static str) -> InstrumentationScope {
        InstrumentationScope::builder(name)
            .with_version("1.2.3")
            .with_attributes([KeyValue::new("scope.flag", true)])
            .build()
    }

    fn span(n: u64, scope: InstrumentationScope, remote_parent: bool) -> SpanData {
        let at = UNIX_EPOCH + Duration::from_nanos(1_764_000_000_123_456_789 + n);
        let state = TraceState::from_key_value([("vendor", "v1"), ("other", "x")]).unwrap();
        let mut events = SpanEvents::default();
        events.events.push(Event::new(
            "retried",
            at + Duration::from_millis(1),
            vec![KeyValue::new("attempt", 2_i64)],
            1,
        ));
        events.dropped_count = 2;
        let mut links = SpanLinks::default();
        links.links.push(Link::new(
            SpanContext::new(
                TraceId::from(7_u128),
                SpanId::from(9),
                TraceFlags::default(),
                true,
                state.clone(),
            ),
            vec![KeyValue::new("link.kind", "follows")],
            0,
        ));
        SpanData {
            span_context: SpanContext::new(
                TraceId::from(0x0af7651916cd43dd8448eb211c80319c_u128 + u128::from(n)),
                SpanId::from(0xb7ad6b7169203331 + n),
                TraceFlags::SAMPLED,
                false,
                if n.is_multiple_of(2) {
                    state.clone()
                } else {
                    TraceState::default()
                },
            ),
            parent_span_id: if n == 0 {
                SpanId::INVALID
            } else {
                SpanId::from(n)
            },
            parent_span_is_remote: remote_parent,
            span_kind: [SpanKind::Producer, SpanKind::Internal, SpanKind::Consumer][n as usize % 3]
                .clone(),
            name: Cow::Borrowed("publish orders"),
            start_time: at,
            end_time: at + Duration::from_millis(3),
            attributes: vec![
                KeyValue::new("messaging.system", "rabbitmq"),
                KeyValue::new("outbox.tenant_id", format!("tenant-{n}")),
                KeyValue::new("outbox.delay_ms", -7_i64 + n as i64),
                KeyValue::new("zero", 0_i64),
                KeyValue::new("empty", ""),
                KeyValue::new("ratio", 0.25),
                KeyValue::new("no", false),
                KeyValue::new(
                    "list",
                    Value::Array(Array::String(vec!["a".into(), "".into()])),
                ),
                KeyValue::new("ints", Value::Array(Array::I64(vec![1, -1, 0]))),
            ],
            dropped_attributes_count: n as u32,
            events,
            links,
            status: match n % 3 {
                0 => Status::error("unroutable: no queue bound"),
                1 => Status::Ok,
                _ => Status::Unset,
            },
            instrumentation_scope: scope,
        }
    }

    #[test]
    fn the_body_decodes_to_what_the_generic_encoding_gives() {
        let resource = Resource::builder_empty()
            .with_service_name("outbox-relay")
            .with_attributes([KeyValue::new("deployment.environment", "prod")])
            .build();
        let spans = vec![
            span(0, scope("outbox-relay"), false),
            span(1, scope("other"), true),
            span(2, scope("outbox-relay"), true),
            span(3, scope("outbox-relay"), false),
        ];
        let ours = export_request(&EncodedResource::new(&resource), &spans);
        let decoded = ExportTraceServiceRequest::decode(ours.as_slice()).expect("decodes");
        let expected = ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(
                spans,
                &ResourceAttributesWithSchema::from(&resource),
            ),
        };
        assert_eq!(decoded, expected);
        assert_eq!(decoded.resource_spans[0].scope_spans.len(), 2);
        assert_eq!(decoded.resource_spans[0].scope_spans[0].spans.len(), 3);
    }

    #[test]
    fn long_fields_get_multi_byte_lengths() {
        let mut data = span(1, scope("outbox-relay"), false);
        data.attributes = vec![KeyValue::new("big", "x".repeat(70_000))];
        let resource = Resource::builder_empty().build();
        let ours = export_request(
            &EncodedResource::new(&resource),
            std::slice::from_ref(&data),
        );
        let decoded = ExportTraceServiceRequest::decode(ours.as_slice()).expect("decodes");
        let expected = ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(
                vec![data],
                &ResourceAttributesWithSchema::from(&resource),
            ),
        };
        assert_eq!(decoded, expected);
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
