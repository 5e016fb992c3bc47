//! The message on the wire: a row turned into routing key, properties and body,
//! exactly as the table in `docs/design.md` says. Pure, so every field is unit-tested; a
//! row that cannot be expressed in AMQP is a [`Refusal`], never a panic.

use bytes::Bytes;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use time::format_description::well_known::Rfc3339;

use crate::domain::{FailureReason, OutboxRow, Payload, Refusal};
use crate::template::RoutingKey;

/// The relay's `app_id`.
pub const APP_ID: &str = "outbox-relay";

/// The headers the relay sets itself; a row's own headers never override them.
pub const RESERVED_HEADERS: [&str; 5] = [
    "outbox-id",
    "outbox-tenant-id",
    "outbox-subject-id",
    "outbox-occurred-at",
    "outbox-tombstone",
];

/// What is fixed for every message of a relay.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub routing_key: RoutingKey,
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
    /// The message for `row` of `tenant`.
    pub fn message(&self, tenant: &str, row: &OutboxRow) -> Result<Message, Refusal> {
        let too_large = |bytes: u64| {
            Refusal::new(
                FailureReason::TooLarge,
                format!(
                    "payload is {bytes} bytes, over max_payload_bytes ({})",
                    self.max_payload_bytes
                ),
            )
        };
        let body = match &row.payload {
            Payload::Body(body) if body.len() > self.max_payload_bytes => {
                return Err(too_large(body.len() as u64));
            }
            Payload::Body(body) => body.clone(),
            Payload::Tombstone => Bytes::new(),
            Payload::TooLarge { bytes } => return Err(too_large(*bytes)),
            Payload::OverBudget { bytes } => {
                return Err(Refusal::new(
                    FailureReason::Other,
                    format!("the payload ({bytes} bytes) was not read"),
                ));
            }
        };
        if let Some(defect) = &row.defect {
            return Err(Refusal::new(FailureReason::Invalid, defect.clone()));
        }
        let key = self.routing_key.render(tenant, &row.kind, &row.subject_id);
        let routing_key = short(key, "routing key")?;
        let kind = short(row.kind.clone(), "kind (the message type)")?;

        let occurred_at = row
            .occurred_at
            .to_offset(time::UtcOffset::UTC)
            .format(&Rfc3339)
            .map_err(|e| {
                Refusal::new(
                    FailureReason::Other,
                    format!("occurred_at cannot be formatted: {e}"),
                )
            })?;
        let mut headers = FieldTable::default();
        headers.insert("outbox-id".into(), AMQPValue::LongLongInt(row.id));
        headers.insert("outbox-tenant-id".into(), long_string(tenant));
        headers.insert("outbox-subject-id".into(), long_string(&row.subject_id));
        headers.insert("outbox-occurred-at".into(), long_string(&occurred_at));
        if row.payload == Payload::Tombstone {
            headers.insert("outbox-tombstone".into(), AMQPValue::Boolean(true));
        }
        if let Some(extra) = &row.headers {
            merge_row_headers(&mut headers, extra)?;
        }

        let properties = BasicProperties::default()
            .with_message_id(row.id.to_string().into())
            .with_type(kind)
            .with_timestamp(u64::try_from(row.occurred_at.unix_timestamp()).unwrap_or(0))
            .with_delivery_mode(2)
            .with_content_type(self.content_type.clone())
            .with_app_id(APP_ID.into())
            .with_headers(headers);
        Ok(Message {
            routing_key,
            properties,
            body,
        })
    }
}

fn short(value: String, what: &str) -> Result<ShortString, Refusal> {
    let len = value.len();
    ShortString::try_new(value).map_err(|_| {
        Refusal::new(
            FailureReason::Other,
            format!("{what} is {len} bytes; AMQP allows at most 255"),
        )
    })
}

fn long_string(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes().to_vec()))
}

/// Adds a row's `headers` object: strings, numbers and booleans; `null` means
/// absent; anything else refuses the row rather than dropping data silently.
fn merge_row_headers(headers: &mut FieldTable, extra: &serde_json::Value) -> Result<(), Refusal> {
    let serde_json::Value::Object(map) = extra else {
        return Err(Refusal::new(
            FailureReason::Other,
            format!("headers must be a JSON object, found {}", json_kind(extra)),
        ));
    };
    for (name, value) in map {
        if RESERVED_HEADERS.contains(&name.as_str()) {
            continue;
        }
        let amqp = match value {
            serde_json::Value::Null => continue,
            serde_json::Value::String(s) => long_string(s),
            serde_json::Value::Bool(b) => AMQPValue::Boolean(*b),
            serde_json::Value::Number(n) => match n.as_i64() {
                Some(i) => AMQPValue::LongLongInt(i),
                None => AMQPValue::Double(n.as_f64().unwrap_or(f64::NAN)),
            },
            other => {
                return Err(Refusal::new(
                    FailureReason::Other,
                    format!(
                        "header {:?} is {}; only strings, numbers and booleans are allowed",
                        truncate(name),
                        json_kind(other)
                    ),
                ));
            }
        };
        let key = ShortString::try_new(name.clone()).map_err(|_| {
            Refusal::new(
                FailureReason::Other,
                format!(
                    "a header name is {} bytes; AMQP allows at most 255",
                    name.len()
                ),
            )
        })?;
        headers.insert(key, amqp);
    }
    Ok(())
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn truncate(name: &str) -> String {
    name.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use time::macros::datetime;

    fn envelope() -> Envelope {
        Envelope {
            routing_key: RoutingKey::parse("{tenant}.{kind}").unwrap(),
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
            headers,
            occurred_at: datetime!(2026-11-30 09:15:01.25 +01:00),
        }
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
        let m = envelope().message("acme", &r).unwrap();
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

    #[test]
    fn a_null_payload_is_a_tombstone_with_an_empty_body() {
        let r = row(None, None);
        let m = envelope().message("acme", &r).unwrap();
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
                "outbox-id": "forged",
                "outbox-tombstone": true
            })),
        );
        let m = envelope().message("acme", &r).unwrap();
        assert_eq!(header(&m, "traceparent"), Some(&long_string("00-abc-01")));
        assert_eq!(header(&m, "retries"), Some(&AMQPValue::LongLongInt(3)));
        assert_eq!(header(&m, "ratio"), Some(&AMQPValue::Double(0.5)));
        assert_eq!(header(&m, "replay"), Some(&AMQPValue::Boolean(false)));
        assert_eq!(header(&m, "gone"), None);
        assert_eq!(header(&m, "outbox-id"), Some(&AMQPValue::LongLongInt(r.id)));
        assert_eq!(header(&m, "outbox-tombstone"), None);
    }

    #[test]
    fn malformed_headers_are_refused_with_a_reason() {
        let refusal = envelope()
            .message("acme", &row(Some("x"), Some(json!([1, 2]))))
            .unwrap_err();
        assert_eq!(refusal.reason, FailureReason::Other);
        assert_eq!(
            refusal.last_error(),
            "other: headers must be a JSON object, found an array"
        );
        let refusal = envelope()
            .message("acme", &row(Some("x"), Some(json!({"nested": {"a": 1}}))))
            .unwrap_err();
        assert!(
            refusal.detail.contains("\"nested\" is an object"),
            "{refusal:?}"
        );
    }

    #[test]
    fn an_oversized_payload_is_refused_without_its_content() {
        let r = row(Some("0123456789abcdefX"), None);
        let refusal = envelope().message("acme", &r).unwrap_err();
        assert_eq!(refusal.reason, FailureReason::TooLarge);
        assert_eq!(
            refusal.detail,
            "payload is 17 bytes, over max_payload_bytes (16)"
        );
        assert!(
            envelope()
                .message("acme", &row(Some("0123456789abcdef"), None))
                .is_ok()
        );
    }

    #[test]
    fn an_overlong_routing_key_is_refused_not_a_panic() {
        let mut r = row(Some("x"), None);
        r.kind = "k".repeat(300);
        let refusal = envelope().message("acme", &r).unwrap_err();
        assert_eq!(refusal.reason, FailureReason::Other);
        assert!(
            refusal.detail.starts_with("routing key is 305 bytes"),
            "{refusal:?}"
        );
    }
}
