//! The message on the wire: a row turned into routing key, properties and body,
//! exactly as the table in `docs/design.md` says. Pure, so every field is
//! unit-tested; a row that cannot be expressed in AMQP, or that RabbitMQ
//! would reject, is a [`Refusal`] (`invalid`, `too_large`) before anything is
//! sent, never a panic nor a broker error that would close the channel or the
//! connection the relay's sweeps share.
//!
//! What RabbitMQ checks of a publish (3.10, `rabbit_channel` and
//! `rabbit_basic`), and what the envelope does about each:
//!
//! - the content header frame (properties with the headers table) must fit
//!   one frame of the negotiated `frame_max`, else the broker closes the whole
//!   connection: measured here with the AMQP library's own encoder;
//! - the headers `CC` and `BCC` (sender-selected routing) must be arrays of
//!   strings, else `406 PRECONDITION_FAILED`: a row's headers cannot carry an
//!   array, so a row header with either name is refused;
//! - short strings (routing key, `type`, `message_id`, header names) are at
//!   most 255 bytes;
//! - `delivery_mode` must be 1 or 2 and `expiration` a number: the relay
//!   sets 2 and no expiration;
//! - the body must not exceed the broker's `max_message_size`, which AMQP does
//!   not announce: the publisher learns it from the broker's first refusal.
//!
//! No other header, `x-` prefixed ones included, is type-checked by the broker
//! when a message is published.

use std::collections::BTreeMap;

use bytes::Bytes;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use time::format_description::well_known::Rfc3339;

use crate::config::Config;
use crate::domain::{FailureReason, OutboxRow, Payload, Refusal};
use crate::template::{MessageId, RoutingKey};

/// The relay's `app_id`.
pub const APP_ID: &str = "outbox-relay";

/// The prefix of the relay's own headers: a row's headers of that name are
/// left out, so that a row can neither override the relay's nor pass for
/// one (`outbox-replay: true` marks a replay's messages alone).
pub const RESERVED_PREFIX: &str = "outbox-";

/// Headers RabbitMQ reads for routing (sender-selected distribution) and
/// requires to be arrays of strings, which a row's headers cannot express.
pub const ROUTING_HEADERS: [&str; 2] = ["CC", "BCC"];

/// Bytes of a content header frame besides its properties: frame type (1),
/// channel (2), payload size (4), class (2), weight (2), body size (8), frame
/// end (1).
pub const CONTENT_HEADER_OVERHEAD: usize = 20;

/// The longest `outbox-occurred-at` (RFC 3339, UTC, to the nanosecond).
const OCCURRED_AT_LEN: usize = "2026-11-30T08:15:01.123456789Z".len();

/// How much of a header name a refusal quotes.
const NAME_IN_ERRORS: usize = 64;

/// What is fixed for every message of a relay.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub routing_key: RoutingKey,
    /// The `message_id` of the configured table's rows (fits 255 bytes).
    pub message_id: MessageId,
    /// Checked once, when the publisher is built (configuration allows ≤ 255 bytes).
    pub content_type: ShortString,
    pub max_payload_bytes: usize,
}

/// One message ready for `basic_publish`.
#[derive(Debug)]
pub struct Message {
    pub routing_key: ShortString,
    pub properties: BasicProperties,
    /// The row's payload itself, shared: the relay never copies a body.
    pub body: Bytes,
}

impl Envelope {
    /// The envelope of `config`'s table and exchange: what the relay and any
    /// command that sends rows again put around each row.
    /// Refused (with the key) when a value does not fit AMQP, which
    /// configuration has already ruled out.
    pub fn from_config(config: &Config) -> Result<Envelope, String> {
        let content_type = ShortString::try_new(config.content_type.clone()).map_err(|_| {
            format!(
                "content_type is {} bytes; AMQP allows at most 255",
                config.content_type.len()
            )
        })?;
        Ok(Envelope {
            routing_key: config.routing_key.clone(),
            message_id: config
                .message_id
                .bind(&config.schema, &config.table)
                .map_err(|error| format!("message_id {error}"))?,
            content_type,
            max_payload_bytes: config.max_payload_bytes,
        })
    }

    /// The message for `row` of `tenant`, on a connection whose negotiated
    /// frame size is `frame_max`.
    pub fn message(
        &self,
        tenant: &str,
        row: &OutboxRow,
        frame_max: u32,
    ) -> Result<Message, Refusal> {
        self.message_traced(tenant, row, frame_max, |_| None)
    }

    /// As [`Envelope::message`], and `trace` is asked, once the routing key,
    /// the message id and the row's own trace context are known, for the
    /// trace context the message carries instead of the row's
    /// (`traceparent`, and `tracestate` or none if empty: the relay's span).
    /// The row's own is kept if the properties would then no longer fit one
    /// frame of `frame_max`.
    pub fn message_traced(
        &self,
        tenant: &str,
        row: &OutboxRow,
        frame_max: u32,
        trace: impl FnOnce(Traced<'_>) -> Option<(String, String)>,
    ) -> Result<Message, Refusal> {
        let body = self.body(row)?;
        if let Some(defect) = &row.defect {
            return Err(Refusal::new(FailureReason::Invalid, defect.clone()));
        }
        let key = self.routing_key.render(tenant, &row.kind, &row.subject_id);
        let routing_key = short(key, "routing key")?;
        let kind = short(row.kind.clone(), "kind (the message type)")?;
        let mut headers = relay_headers(tenant, row)?;
        if let Some(extra) = &row.headers {
            merge_row_headers(&mut headers, extra)?;
        }

        let message_id = ShortString::from(self.message_id.render(row.id));
        let (traceparent, tracestate) = header_text(&headers);
        let context = trace(Traced {
            routing_key: routing_key.as_str(),
            message_id: message_id.as_str(),
            traceparent,
            tracestate,
        });
        let rows_own = context.map(|(traceparent, tracestate)| {
            replace_trace_context(&mut headers, traceparent, tracestate)
        });
        let properties = BasicProperties::default()
            .with_message_id(message_id)
            .with_type(kind)
            .with_timestamp(u64::try_from(row.occurred_at.unix_timestamp()).unwrap_or(0))
            .with_delivery_mode(2)
            .with_content_type(self.content_type.clone())
            .with_app_id(APP_ID.into())
            .with_headers(FieldTable::from(headers));
        Ok(Message {
            routing_key,
            properties: fitted(properties, frame_max, rows_own)?,
            body,
        })
    }

    /// The row's body, shared: refused over `max_payload_bytes`, or when its
    /// payload was not read (over the byte budget); empty for a tombstone.
    fn body(&self, row: &OutboxRow) -> Result<Bytes, Refusal> {
        let too_large = |bytes: u64| {
            Refusal::new(
                FailureReason::TooLarge,
                format!(
                    "payload is {bytes} bytes, over max_payload_bytes ({})",
                    self.max_payload_bytes
                ),
            )
        };
        match &row.payload {
            Payload::Body(body) if body.len() > self.max_payload_bytes => {
                Err(too_large(body.len() as u64))
            }
            Payload::Body(body) => Ok(body.clone()),
            Payload::Tombstone => Ok(Bytes::new()),
            Payload::TooLarge { bytes } => Err(too_large(*bytes)),
            Payload::OverBudget { bytes } => Err(Refusal::new(
                FailureReason::Other,
                format!("the payload ({bytes} bytes) was not read"),
            )),
        }
    }
}

/// The headers the relay sets on `row`'s message of `tenant` (all named
/// under [`RESERVED_PREFIX`]), before the row's own are merged in.
fn relay_headers(tenant: &str, row: &OutboxRow) -> Result<Headers, Refusal> {
    // Written straight into the header's value.
    let mut occurred_at = Vec::with_capacity(OCCURRED_AT_LEN);
    row.occurred_at
        .to_offset(time::UtcOffset::UTC)
        .format_into(&mut occurred_at, &Rfc3339)
        .map_err(|e| {
            Refusal::new(
                FailureReason::Invalid,
                format!("occurred_at cannot be formatted: {e}"),
            )
        })?;
    let mut headers = BTreeMap::new();
    headers.insert("outbox-id".into(), AMQPValue::LongLongInt(row.id));
    headers.insert("outbox-tenant-id".into(), long_string(tenant));
    headers.insert(
        "outbox-subject-id".into(),
        long_string(row.subject_id.as_str()),
    );
    headers.insert(
        "outbox-occurred-at".into(),
        AMQPValue::LongString(occurred_at.into()),
    );
    if row.payload == Payload::Tombstone {
        headers.insert("outbox-tombstone".into(), AMQPValue::Boolean(true));
    }
    Ok(headers)
}

/// `properties` if they fit one frame of `frame_max`; else, when they carry
/// the relay's trace context instead of the row's own (`rows_own`), the
/// same with the row's own again, if that fits.
fn fitted(
    properties: BasicProperties,
    frame_max: u32,
    rows_own: Option<TraceHeaders>,
) -> Result<BasicProperties, Refusal> {
    match (fits_one_frame(&properties, frame_max), rows_own) {
        (Ok(()), _) => Ok(properties),
        (Err(refusal), None) => Err(refusal),
        // Too large with the relay's trace context: the row's own again.
        (Err(_), Some(rows_own)) => {
            let mut headers = properties
                .headers()
                .as_ref()
                .map(|table| table.inner().clone())
                .unwrap_or_default();
            restore_trace_context(&mut headers, rows_own);
            let properties = properties.with_headers(FieldTable::from(headers));
            fits_one_frame(&properties, frame_max)?;
            Ok(properties)
        }
    }
}

/// The trace context headers (W3C): a row's own pass through unchanged,
/// unless the relay's span replaces them (see [`Envelope::message_traced`]).
pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";

/// What a row's span starts from, while its message is built (see
/// [`Envelope::message_traced`]).
#[derive(Debug, Clone, Copy)]
pub struct Traced<'a> {
    pub routing_key: &'a str,
    pub message_id: &'a str,
    /// The row's own `traceparent` and `tracestate`, when strings.
    pub traceparent: Option<&'a str>,
    pub tracestate: Option<&'a str>,
}

type Headers = BTreeMap<ShortString, AMQPValue>;

/// The row's own trace context headers, as [`replace_trace_context`] found
/// them.
type TraceHeaders = (Option<AMQPValue>, Option<AMQPValue>);

/// The `traceparent` and `tracestate` among `headers`, when strings.
fn header_text(headers: &Headers) -> (Option<&str>, Option<&str>) {
    let text = |name: &str| match headers.get(name)? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
        _ => None,
    };
    (text(TRACEPARENT), text(TRACESTATE))
}

/// Puts `traceparent` (and `tracestate`, or none if it is empty) in
/// `headers` instead of the row's own, which it returns.
fn replace_trace_context(
    headers: &mut Headers,
    traceparent: String,
    tracestate: String,
) -> TraceHeaders {
    let parent = headers.insert(TRACEPARENT.into(), long_string(traceparent));
    let state = if tracestate.is_empty() {
        // The row's own belonged to another trace context, or to none.
        headers.remove(TRACESTATE)
    } else {
        headers.insert(TRACESTATE.into(), long_string(tracestate))
    };
    (parent, state)
}

/// Puts the row's own trace context headers back (see
/// [`replace_trace_context`]).
fn restore_trace_context(headers: &mut Headers, (parent, state): TraceHeaders) {
    for (name, value) in [(TRACEPARENT, parent), (TRACESTATE, state)] {
        match value {
            Some(value) => headers.insert(name.into(), value),
            None => headers.remove(name),
        };
    }
}

/// The size of the content header frame that carries `properties`, encoded
/// by the AMQP library exactly as it will be sent.
pub fn content_header_frame_len(properties: &BasicProperties) -> Result<usize, Refusal> {
    let encode = lapin::protocol::basic::gen_properties(properties);
    let written = encode(Vec::new().into()).map_err(|e| {
        Refusal::new(
            FailureReason::Invalid,
            format!("the message's properties cannot be encoded: {e:?}"),
        )
    })?;
    Ok(CONTENT_HEADER_OVERHEAD + written.write.len())
}

/// RabbitMQ closes the whole connection on a frame over `frame_max`, and the
/// properties (headers included) travel in one frame: refuse the row instead.
fn fits_one_frame(properties: &BasicProperties, frame_max: u32) -> Result<(), Refusal> {
    let limit = usize::try_from(frame_max).unwrap_or(usize::MAX);
    // Nearly every message is far below the limit: a bound from the field
    // lengths spares it an encoding on the hot path.
    if frame_len_bound(properties).is_some_and(|bound| bound <= limit) {
        return Ok(());
    }
    let len = content_header_frame_len(properties)?;
    if len <= limit {
        return Ok(());
    }
    let headers = properties.headers().as_ref().map(|headers| headers.inner());
    let largest = headers.and_then(|headers| {
        headers
            .iter()
            .max_by_key(|(_, value)| value_len(value))
            .map(|(name, value)| (name.as_str(), value_len(value)))
    });
    let mut detail = format!(
        "properties and headers take {len} bytes, over the broker's frame_max ({frame_max}): \
         they must fit one frame"
    );
    if let Some(headers) = headers {
        // Many small headers overflow it as surely as one large one.
        detail.push_str(&format!("; {} headers", headers.len()));
    }
    if let Some((name, bytes)) = largest {
        detail.push_str(&format!(
            ", the largest {:?} ({bytes} bytes)",
            truncate(name)
        ));
    }
    Err(Refusal::new(FailureReason::Invalid, detail))
}

/// At least what the content header frame of `properties` takes, from its
/// fields' lengths without encoding them; `None` when a header value is of a
/// kind the envelope never writes (then only the encoding can tell).
fn frame_len_bound(properties: &BasicProperties) -> Option<usize> {
    let short = |value: &Option<ShortString>| value.as_ref().map_or(0, |s| 1 + s.as_str().len());
    let mut headers = 4;
    if let Some(table) = properties.headers() {
        for (name, value) in table.inner() {
            let value = match value {
                AMQPValue::LongString(s) => 4 + s.as_bytes().len(),
                AMQPValue::Boolean(_) => 1,
                AMQPValue::LongLongInt(_) | AMQPValue::Double(_) => 8,
                _ => return None,
            };
            headers += 1 + name.as_str().len() + 1 + value;
        }
    }
    // Flags, body size, class, weight, and the fixed-size properties
    // (timestamp, delivery mode, priority), with room to spare.
    const FIXED: usize = 64;
    Some(
        CONTENT_HEADER_OVERHEAD
            + FIXED
            + headers
            + short(properties.content_type())
            + short(properties.content_encoding())
            + short(properties.correlation_id())
            + short(properties.reply_to())
            + short(properties.expiration())
            + short(properties.message_id())
            + short(properties.kind())
            + short(properties.user_id())
            + short(properties.app_id())
            + short(properties.cluster_id()),
    )
}

/// About what a header value takes on the wire (to name the largest one).
fn value_len(value: &AMQPValue) -> usize {
    match value {
        AMQPValue::LongString(s) => s.as_bytes().len(),
        AMQPValue::ShortString(s) => s.as_str().len(),
        _ => 8,
    }
}

fn short(value: String, what: &str) -> Result<ShortString, Refusal> {
    let len = value.len();
    ShortString::try_new(value).map_err(|_| {
        Refusal::new(
            FailureReason::Invalid,
            format!("{what} is {len} bytes; AMQP allows at most 255"),
        )
    })
}

/// A header value from text: owned text moves in, borrowed text is copied.
fn long_string(value: impl Into<Vec<u8>>) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.into()))
}

/// Adds a row's `headers` object (its JSON text): strings, numbers and
/// booleans; `null` means absent; anything else refuses the row rather than
/// dropping data silently. The text is read straight into the header table,
/// one name and value at a time: the row's headers are never held decoded
/// twice (a table of small keys takes some ten times its JSON).
fn merge_row_headers(headers: &mut Headers, json: &[u8]) -> Result<(), Refusal> {
    let mut refusal = None;
    let mut reader = serde_json::Deserializer::from_slice(json);
    let read = serde::Deserializer::deserialize_any(
        &mut reader,
        RowHeaders {
            headers,
            refusal: &mut refusal,
        },
    )
    .and_then(|()| reader.end());
    match (refusal, read) {
        (Some(refusal), _) => Err(refusal),
        (None, Ok(())) => Ok(()),
        // The database hands out valid JSON; this only says where it broke.
        (None, Err(error)) => Err(Refusal::new(
            FailureReason::Invalid,
            format!("headers cannot be read: {error}"),
        )),
    }
}

/// Reads a row's `headers` into the message's table (see
/// [`merge_row_headers`]); a refusal stops the reading and is left in
/// `refusal`.
struct RowHeaders<'a> {
    headers: &'a mut Headers,
    refusal: &'a mut Option<Refusal>,
}

impl RowHeaders<'_> {
    fn refuse<E: serde::de::Error>(self, refusal: Refusal) -> Result<(), E> {
        *self.refusal = Some(refusal);
        Err(E::custom("refused"))
    }

    fn not_an_object<E: serde::de::Error>(self, kind: &str) -> Result<(), E> {
        self.refuse(Refusal::new(
            FailureReason::Invalid,
            format!("headers must be a JSON object, found {kind}"),
        ))
    }
}

impl<'de> serde::de::Visitor<'de> for RowHeaders<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(name) = map.next_key::<String>()? {
            if name.starts_with(RESERVED_PREFIX) {
                map.next_value::<serde::de::IgnoredAny>()?;
                continue;
            }
            let value = map.next_value::<HeaderValue>()?;
            if ROUTING_HEADERS.contains(&name.as_str()) && !matches!(value, HeaderValue::Null) {
                return self.refuse(Refusal::new(
                    FailureReason::Invalid,
                    format!(
                        "header {name:?} is reserved by RabbitMQ for sender-selected routing \
                         (an array of queue names would send the message to them too; anything \
                         else closes the channel): a row may not set it, whatever its value; \
                         rename the header"
                    ),
                ));
            }
            let amqp = match value {
                HeaderValue::Null => continue,
                HeaderValue::String(s) => AMQPValue::LongString(LongString::from(s.into_bytes())),
                HeaderValue::Bool(b) => AMQPValue::Boolean(b),
                HeaderValue::Int(i) => AMQPValue::LongLongInt(i),
                HeaderValue::Float(f) => AMQPValue::Double(f),
                HeaderValue::Other(kind) => {
                    return self.refuse(Refusal::new(
                        FailureReason::Invalid,
                        format!(
                            "header {:?} is {kind}; only strings, numbers and booleans are allowed",
                            truncate(&name),
                        ),
                    ));
                }
            };
            if name.len() > 255 {
                return self.refuse(Refusal::new(
                    FailureReason::Invalid,
                    format!(
                        "header name {:?}… is {} bytes; AMQP allows at most 255",
                        truncate(&name),
                        name.len()
                    ),
                ));
            }
            let Ok(key) = ShortString::try_new(name) else {
                return self.refuse(Refusal::new(
                    FailureReason::Invalid,
                    "a header name is over 255 bytes",
                ));
            };
            self.headers.insert(key, amqp);
        }
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        self.not_an_object("an array")
    }

    fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<(), E> {
        self.not_an_object("a string")
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<(), E> {
        self.not_an_object("a boolean")
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<(), E> {
        self.not_an_object("a number")
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<(), E> {
        self.not_an_object("a number")
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<(), E> {
        self.not_an_object("a number")
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        self.not_an_object("null")
    }
}

/// One value of a row's `headers` object, as far as the message needs it.
enum HeaderValue {
    Null,
    String(String),
    Bool(bool),
    Int(i64),
    Float(f64),
    /// What no header can carry: an object or an array.
    Other(&'static str),
}

impl<'de> serde::Deserialize<'de> for HeaderValue {
    fn deserialize<D: serde::Deserializer<'de>>(reader: D) -> Result<HeaderValue, D::Error> {
        reader.deserialize_any(HeaderValueVisitor)
    }
}

struct HeaderValueVisitor;

impl<'de> serde::de::Visitor<'de> for HeaderValueVisitor {
    type Value = HeaderValue;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<HeaderValue, E> {
        Ok(HeaderValue::Null)
    }

    fn visit_str<E>(self, s: &str) -> Result<HeaderValue, E> {
        Ok(HeaderValue::String(s.to_owned()))
    }

    fn visit_string<E>(self, s: String) -> Result<HeaderValue, E> {
        Ok(HeaderValue::String(s))
    }

    fn visit_bool<E>(self, b: bool) -> Result<HeaderValue, E> {
        Ok(HeaderValue::Bool(b))
    }

    fn visit_i64<E>(self, i: i64) -> Result<HeaderValue, E> {
        Ok(HeaderValue::Int(i))
    }

    fn visit_u64<E>(self, u: u64) -> Result<HeaderValue, E> {
        // Past i64: a double, as JSON numbers are.
        Ok(i64::try_from(u).map_or(HeaderValue::Float(u as f64), HeaderValue::Int))
    }

    fn visit_f64<E>(self, f: f64) -> Result<HeaderValue, E> {
        Ok(HeaderValue::Float(f))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<HeaderValue, A::Error> {
        while map
            .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
            .is_some()
        {}
        Ok(HeaderValue::Other("an object"))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<HeaderValue, A::Error> {
        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(HeaderValue::Other("an array"))
    }
}

/// A header name as a refusal quotes it: its first characters only.
fn truncate(name: &str) -> String {
    name.chars().take(NAME_IN_ERRORS).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use time::macros::datetime;

    /// RabbitMQ's default `frame_max`.
    const FRAME_MAX: u32 = 131_072;

    fn envelope() -> Envelope {
        Envelope {
            routing_key: RoutingKey::parse("{tenant}.{kind}").unwrap(),
            message_id: MessageId::plain(),
            content_type: ShortString::from("application/json"),
            max_payload_bytes: 16,
        }
    }

    fn row(payload: Option<&str>, headers: Option<serde_json::Value>) -> OutboxRow {
        OutboxRow {
            id: 9_007_199_254_740_993,
            kind: "order.created".into(),
            subject_id: "o-17".into(),
            payload: payload.map_or(Payload::Tombstone, |p| {
                Payload::Body(Bytes::copy_from_slice(p.as_bytes()))
            }),
            defect: None,
            cost: 0,
            headers: headers.map(|h| Bytes::from(h.to_string())),
            occurred_at: datetime!(2026-11-30 09:15:01.25 +01:00),
        }
    }

    fn message(r: &OutboxRow) -> Result<Message, Refusal> {
        envelope().message("acme", r, FRAME_MAX)
    }

    fn header<'a>(m: &'a Message, name: &str) -> Option<&'a AMQPValue> {
        m.properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(name))
    }

    #[test]
    fn every_field_of_the_design_table() {
        let r = row(Some("{\"a\":1}"), None);
        let m = message(&r).unwrap();
        assert_eq!(m.routing_key.as_str(), "acme.order.created");
        assert_eq!(m.body, &b"{\"a\":1}"[..]);
        let p = &m.properties;
        assert_eq!(
            p.message_id().as_ref().unwrap().as_str(),
            "9007199254740993"
        );
        assert_eq!(p.kind().as_ref().unwrap().as_str(), "order.created");
        assert_eq!(*p.timestamp(), Some(1_796_026_501));
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(
            p.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        assert_eq!(p.app_id().as_ref().unwrap().as_str(), "outbox-relay");
        assert_eq!(
            header(&m, "outbox-id"),
            Some(&AMQPValue::LongLongInt(9_007_199_254_740_993))
        );
        assert_eq!(header(&m, "outbox-tenant-id"), Some(&long_string("acme")));
        assert_eq!(header(&m, "outbox-subject-id"), Some(&long_string("o-17")));
        assert_eq!(
            header(&m, "outbox-occurred-at"),
            Some(&long_string("2026-11-30T08:15:01.25Z"))
        );
        assert_eq!(header(&m, "outbox-tombstone"), None);
    }

    /// The row's own `traceparent` and `tracestate`, as the hook saw them.
    type Seen = (Option<String>, Option<String>);
    type Built = Result<Message, Refusal>;

    /// The row's trace context as the hook saw it, and the message built
    /// with `replaced` as the relay's.
    fn traced(r: &OutboxRow, frame_max: u32, replaced: (&str, &str)) -> (Option<Seen>, Built) {
        let mut seen = None;
        let m = envelope().message_traced("acme", r, frame_max, |t| {
            assert_eq!(t.routing_key, "acme.order.created");
            assert_eq!(t.message_id, r.id.to_string());
            seen = Some((
                t.traceparent.map(str::to_owned),
                t.tracestate.map(str::to_owned),
            ));
            Some((replaced.0.to_owned(), replaced.1.to_owned()))
        });
        (seen, m)
    }

    const ROWS: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    const RELAYS: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-b7ad6b7169203331-01";

    #[test]
    fn the_trace_context_is_read_and_replaced_and_the_rest_kept() {
        let r = row(
            Some("x"),
            Some(json!({"traceparent": ROWS, "tracestate": "v=1", "n": 3})),
        );
        let (seen, m) = traced(&r, FRAME_MAX, (RELAYS, "v=1"));
        assert_eq!(seen, Some((Some(ROWS.into()), Some("v=1".into()))));
        let m = m.unwrap();
        assert_eq!(header(&m, "traceparent"), Some(&long_string(RELAYS)));
        assert_eq!(header(&m, "tracestate"), Some(&long_string("v=1")));
        assert_eq!(header(&m, "n"), Some(&AMQPValue::LongLongInt(3)));
        assert_eq!(header(&m, "outbox-tenant-id"), Some(&long_string("acme")));
        // A root span has no tracestate: a row's stray one is dropped.
        let r = row(Some("x"), Some(json!({"tracestate": "v=1"})));
        let m = traced(&r, FRAME_MAX, (RELAYS, "")).1.unwrap();
        assert_eq!(header(&m, "traceparent"), Some(&long_string(RELAYS)));
        assert_eq!(header(&m, "tracestate"), None);
        // A non-string traceparent is no trace context.
        let r = row(Some("x"), Some(json!({"traceparent": 7})));
        assert_eq!(traced(&r, FRAME_MAX, (RELAYS, "")).0, Some((None, None)));
        // With no hook, the row's own pass through.
        let r = row(Some("x"), Some(json!({"traceparent": ROWS})));
        let m = message(&r).unwrap();
        assert_eq!(header(&m, "traceparent"), Some(&long_string(ROWS)));
    }

    #[test]
    fn a_trace_context_that_would_not_fit_the_frame_leaves_the_message_as_it_was() {
        // No trace context of the row's own: none is added.
        let r = row(Some("x"), None);
        let len = content_header_frame_len(&message(&r).unwrap().properties).unwrap();
        let frame_max = u32::try_from(len + 10).unwrap();
        let m = traced(&r, frame_max, (RELAYS, "")).1.unwrap();
        assert_eq!(header(&m, "traceparent"), None);
        // The row's own (shorter than the relay's, with its tracestate) are
        // put back, and the message still goes.
        let r = row(
            Some("x"),
            Some(json!({"traceparent": "00-ab-01", "tracestate": "v=1"})),
        );
        let own = message(&r).unwrap();
        let len = content_header_frame_len(&own.properties).unwrap();
        let frame_max = u32::try_from(len + 10).unwrap();
        let m = traced(&r, frame_max, (RELAYS, "")).1.unwrap();
        assert_eq!(header(&m, "traceparent"), Some(&long_string("00-ab-01")));
        assert_eq!(header(&m, "tracestate"), Some(&long_string("v=1")));
        assert_eq!(m.properties, own.properties);
    }

    #[test]
    fn a_null_payload_is_a_tombstone_with_an_empty_body() {
        let r = row(None, None);
        let m = message(&r).unwrap();
        assert!(m.body.is_empty());
        assert_eq!(
            header(&m, "outbox-tombstone"),
            Some(&AMQPValue::Boolean(true))
        );
    }

    #[test]
    fn row_headers_are_merged_but_never_override_the_relays() {
        let r = row(
            Some("x"),
            Some(json!({
                "traceparent": "00-abc-01",
                "retries": 3,
                "ratio": 0.5,
                "replay": false,
                "gone": null,
                "cc": "lower case is not the routing header",
                "CC": null,
                "outbox-id": "forged",
                "outbox-tombstone": true
            })),
        );
        let m = message(&r).unwrap();
        assert_eq!(header(&m, "traceparent"), Some(&long_string("00-abc-01")));
        assert_eq!(header(&m, "retries"), Some(&AMQPValue::LongLongInt(3)));
        assert_eq!(header(&m, "ratio"), Some(&AMQPValue::Double(0.5)));
        assert_eq!(header(&m, "replay"), Some(&AMQPValue::Boolean(false)));
        assert_eq!(header(&m, "gone"), None);
        assert_eq!(header(&m, "CC"), None, "null means absent");
        assert!(header(&m, "cc").is_some());
        assert_eq!(header(&m, "outbox-id"), Some(&AMQPValue::LongLongInt(r.id)));
        assert_eq!(header(&m, "outbox-tombstone"), None);
    }

    #[test]
    fn malformed_headers_are_refused_as_invalid() {
        let refusal = message(&row(Some("x"), Some(json!([1, 2])))).unwrap_err();
        assert_eq!(refusal.reason, FailureReason::Invalid);
        assert!(refusal.attributed);
        assert_eq!(
            refusal.last_error(),
            "invalid: headers must be a JSON object, found an array"
        );
        let refusal = message(&row(Some("x"), Some(json!({"nested": {"a": 1}})))).unwrap_err();
        assert_eq!(refusal.reason, FailureReason::Invalid);
        assert!(
            refusal.detail.contains("\"nested\" is an object"),
            "{refusal:?}"
        );
    }

    #[test]
    fn headers_read_from_their_json_text_keep_the_json_meaning() {
        let r = row(
            Some("x"),
            Some(json!({
                "big": 9_223_372_036_854_775_808_u64,
                "neg": -7,
                "gone": null,
                "esc": "a\"b\u{e9}",
                "outbox-occurred-at": {"nested": [1, 2]},
                "outbox-replay": true,
                "outbox-anything": "x",
            })),
        );
        let m = message(&r).unwrap();
        assert_eq!(
            header(&m, "big"),
            Some(&AMQPValue::Double(9_223_372_036_854_775_808.0)),
            "past i64, a double"
        );
        assert_eq!(header(&m, "neg"), Some(&AMQPValue::LongLongInt(-7)));
        assert_eq!(header(&m, "gone"), None, "null: left out, as if absent");
        assert_eq!(header(&m, "esc"), Some(&long_string("a\"bé")));
        assert_eq!(
            header(&m, "outbox-occurred-at"),
            Some(&long_string("2026-11-30T08:15:01.25Z")),
            "a reserved name is skipped whatever its value"
        );
        assert_eq!(
            header(&m, "outbox-replay"),
            None,
            "no row passes for a replay"
        );
        assert_eq!(
            header(&m, "outbox-anything"),
            None,
            "the prefix is the relay's"
        );
        for (headers, found) in [
            (json!(null), "null"),
            (json!("x"), "a string"),
            (json!(1.5), "a number"),
            (json!(true), "a boolean"),
        ] {
            let refusal = message(&row(Some("x"), Some(headers))).unwrap_err();
            assert_eq!(
                refusal.last_error(),
                format!("invalid: headers must be a JSON object, found {found}")
            );
        }
        let refusal = message(&row(Some("x"), Some(json!({"list": [1]})))).unwrap_err();
        assert!(
            refusal.detail.contains("\"list\" is an array"),
            "{refusal:?}"
        );
        let mut broken = row(Some("x"), None);
        broken.headers = Some(Bytes::from_static(b"{\"a\": 1"));
        let refusal = message(&broken).unwrap_err();
        assert_eq!(refusal.reason, FailureReason::Invalid);
        assert!(
            refusal.detail.starts_with("headers cannot be read: "),
            "{refusal:?}"
        );
    }

    #[test]
    fn routing_headers_are_refused_whatever_their_value_naming_only_the_header() {
        for name in ROUTING_HEADERS {
            for value in [
                json!("secret-route"),
                json!(7),
                json!(true),
                json!(["secret-route"]),
            ] {
                let r = row(Some("x"), Some(json!({ name: value })));
                let refusal = message(&r).unwrap_err();
                assert_eq!(refusal.reason, FailureReason::Invalid, "{name}");
                assert!(
                    refusal
                        .detail
                        .starts_with(&format!("header \"{name}\" is reserved by RabbitMQ")),
                    "{refusal:?}"
                );
                assert!(!refusal.detail.contains("secret-route"), "no header value");
            }
        }
    }

    #[test]
    fn an_overlong_header_name_is_refused_and_quoted_only_in_part() {
        let name = "n".repeat(300);
        let refusal = message(&row(Some("x"), Some(json!({ name: 1 })))).unwrap_err();
        assert_eq!(refusal.reason, FailureReason::Invalid);
        assert!(refusal.detail.contains("is 300 bytes"), "{refusal:?}");
        assert!(refusal.detail.len() < 200, "{refusal:?}");
    }

    #[test]
    fn the_content_header_frame_is_measured_as_the_library_encodes_it() {
        // Frame header 7, class 2, weight 2, body size 8, property flags 2,
        // frame end 1: nothing else without properties.
        let empty = BasicProperties::default();
        assert_eq!(content_header_frame_len(&empty).unwrap(), 22);
        // A short string: one length byte and its bytes.
        let typed = BasicProperties::default().with_type("abc".into());
        assert_eq!(content_header_frame_len(&typed).unwrap(), 22 + 1 + 3);
        // A table: four length bytes, then per field a short-string name, a
        // type byte and the value (a long string: four length bytes and its bytes).
        let mut headers = FieldTable::default();
        headers.insert("k".into(), long_string("vv"));
        let with_headers = BasicProperties::default().with_headers(headers);
        assert_eq!(
            content_header_frame_len(&with_headers).unwrap(),
            22 + 4 + (1 + 1) + 1 + (4 + 2)
        );
    }

    #[test]
    fn the_cheap_bound_is_never_below_the_exact_frame_length() {
        for (payload, headers) in [
            (None, None),
            (
                Some("{}"),
                Some(json!({"traceparent": "00-abc-01", "n": 3, "f": 0.5, "b": true})),
            ),
            (Some("x"), Some(json!({"long": "v".repeat(70_000)}))),
            (Some("x"), Some(json!({"k".repeat(200): "v"}))),
        ] {
            let r = row(payload, headers);
            let m = message(&r).unwrap_or_else(|e| panic!("{e:?}"));
            let exact = content_header_frame_len(&m.properties).unwrap();
            let bound = frame_len_bound(&m.properties).expect("the envelope's own kinds");
            assert!(bound >= exact, "bound {bound} < exact {exact}");
            assert!(
                bound <= exact + 128,
                "bound {bound} far above exact {exact}"
            );
        }
    }

    #[test]
    fn headers_must_fit_one_frame_of_frame_max() {
        let fits = row(Some("x"), Some(json!({"big": "v".repeat(1_000)})));
        let m = message(&fits).unwrap();
        let exact = content_header_frame_len(&m.properties).unwrap();
        let at_limit = envelope().message("acme", &fits, exact as u32);
        assert!(at_limit.is_ok(), "a frame of exactly frame_max fits");
        let refusal = envelope()
            .message("acme", &fits, exact as u32 - 1)
            .unwrap_err();
        assert_eq!(refusal.reason, FailureReason::Invalid);
        assert_eq!(
            refusal.detail,
            format!(
                "properties and headers take {exact} bytes, over the broker's frame_max ({}): \
                 they must fit one frame; 5 headers, the largest \"big\" (1000 bytes)",
                exact - 1
            )
        );

        // Many small headers: their count says why.
        let many: serde_json::Map<String, serde_json::Value> =
            (0..10_000).map(|k| (format!("key{k}"), json!(k))).collect();
        let refusal = message(&row(Some("x"), Some(many.into()))).unwrap_err();
        assert!(
            refusal.detail.contains("; 10004 headers, the largest"),
            "{refusal:?}"
        );

        // 200 kB in one header, the broker's default frame_max.
        let huge = row(Some("x"), Some(json!({"blob": "v".repeat(200_000)})));
        let refusal = message(&huge).unwrap_err();
        assert_eq!(refusal.reason, FailureReason::Invalid);
        assert!(refusal.detail.contains("(131072)"), "{refusal:?}");
        assert!(!refusal.detail.contains("vvvv"), "no header value");
    }

    #[test]
    fn the_message_id_is_the_rendered_template_and_nothing_else_changes() {
        let mut config = crate::config::Config::with_tenants(["acme"]);
        config.schema = "sales".into();
        config.message_id =
            crate::template::MessageIdTemplate::parse("{schema}.{table}:{id}").unwrap();
        let envelope = Envelope::from_config(&config).unwrap();
        let r = row(Some("{}"), None);
        let m = envelope.message("acme", &r, FRAME_MAX).unwrap();
        assert_eq!(
            m.properties.message_id().as_ref().unwrap().as_str(),
            "sales.outbox_message:9007199254740993"
        );
        assert_eq!(
            header(&m, "outbox-id"),
            Some(&AMQPValue::LongLongInt(9_007_199_254_740_993))
        );
        assert_eq!(m.routing_key.as_str(), "acme.order.created");
    }

    #[test]
    fn an_oversized_payload_is_refused_without_its_content() {
        let r = row(Some("0123456789abcdefX"), None);
        let refusal = message(&r).unwrap_err();
        assert_eq!(refusal.reason, FailureReason::TooLarge);
        assert_eq!(
            refusal.detail,
            "payload is 17 bytes, over max_payload_bytes (16)"
        );
        assert!(message(&row(Some("0123456789abcdef"), None)).is_ok());
    }

    #[test]
    fn an_overlong_routing_key_or_kind_is_refused_not_a_panic() {
        let mut r = row(Some("x"), None);
        r.kind = "k".repeat(300);
        let refusal = message(&r).unwrap_err();
        assert_eq!(refusal.reason, FailureReason::Invalid);
        assert!(
            refusal.detail.starts_with("routing key is 305 bytes"),
            "{refusal:?}"
        );
        let mut r = row(Some("x"), None);
        r.kind = "k".repeat(256);
        let refusal = Envelope {
            routing_key: RoutingKey::parse("{tenant}").unwrap(),
            ..envelope()
        }
        .message("acme", &r, FRAME_MAX)
        .unwrap_err();
        assert_eq!(
            refusal.last_error(),
            "invalid: kind (the message type) is 256 bytes; AMQP allows at most 255"
        );
    }
}
