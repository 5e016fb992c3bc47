//! Each row's span (see `traces`), as the publisher starts and ends it: it
//! starts as the row's message is built, puts itself in the message's
//! trace context when sampled, and ends at the broker's confirm or with the
//! row's refusal. With tracing off, nothing here runs but a check.

use std::time::SystemTime;

use crate::domain::{OutboxRow, Refusal};
use crate::envelope::{Envelope, Message};
use crate::traces::{self, Publish, PublishSpan};

/// The message for `row` (see [`Envelope::message`]) and, tracing on, the
/// row's span, started as the message is built and carried in its trace
/// context when sampled. A row the envelope refuses has its span ended with
/// the refusal here, and none is returned.
pub(crate) fn message(
    envelope: &Envelope,
    exchange: &str,
    tenant: &str,
    row: &OutboxRow,
    frame_max: u32,
) -> (Result<Message, Refusal>, Option<PublishSpan>) {
    if !traces::enabled() {
        return (envelope.message(tenant, row, frame_max), None);
    }
    let mut span = None;
    let message = envelope.message_traced(tenant, row, frame_max, |traced| {
        span = PublishSpan::start(
            Publish {
                exchange,
                routing_key: traced.routing_key,
                message_id: traced.message_id,
                tenant,
                kind: &row.kind,
                delay_ms: delay_ms(row),
            },
            traced.traceparent,
            traced.tracestate,
        );
        span.as_ref().map(PublishSpan::headers)
    });
    match message {
        Ok(message) => (Ok(message), span),
        Err(refusal) => {
            match span {
                Some(span) => refused(span, tenant, row.id, &refusal),
                None => refused_unsent(envelope, exchange, tenant, row, &refusal),
            }
            (Err(refusal), None)
        }
    }
}

/// The span of a row the envelope refused before anything was sent: it
/// starts and ends at once, a root (the row's headers may be what is wrong).
fn refused_unsent(
    envelope: &Envelope,
    exchange: &str,
    tenant: &str,
    row: &OutboxRow,
    refusal: &Refusal,
) {
    if !traces::enabled() {
        return;
    }
    let routing_key = envelope
        .routing_key
        .render(tenant, &row.kind, &row.subject_id);
    let message_id = envelope.message_id.render(row.id);
    let span = PublishSpan::start(
        Publish {
            exchange,
            routing_key: &routing_key,
            message_id: &message_id,
            tenant,
            kind: &row.kind,
            delay_ms: delay_ms(row),
        },
        None,
        None,
    );
    if let Some(span) = span {
        refused(span, tenant, row.id, refusal);
    }
}

/// Ends a row's span as it went: confirmed at `confirmed_at`, or not.
/// `refusal` is the batch's refusal, if any; the row it names is `refused_at`.
pub(super) fn end(
    span: PublishSpan,
    tenant: &str,
    row_id: i64,
    confirmed_at: Option<SystemTime>,
    refusal: Option<(bool, &Refusal)>,
) {
    match (confirmed_at, refusal) {
        (_, Some((true, refusal))) => refused(span, tenant, row_id, refusal),
        (Some(at), _) => span.confirmed(at),
        (None, Some((false, refusal))) => span.refused(
            refusal.reason.as_str(),
            &format!(
                "not confirmed: an earlier row of the batch was refused ({})",
                refusal.detail
            ),
        ),
        (None, None) => span.refused("other", "not confirmed"),
    }
}

/// Ends the span of the row refused with `refusal`, and says so in a log
/// line written under the span (it carries the span's `trace_id` and
/// `span_id`, see `telemetry`).
pub(super) fn refused(span: PublishSpan, tenant: &str, row_id: i64, refusal: &Refusal) {
    let (trace_id, span_id) = span.ids();
    let under = tracing::info_span!(
        "publish",
        trace_id = trace_id.as_str(),
        span_id = span_id.as_str()
    )
    .entered();
    tracing::warn!(
        tenant,
        row = row_id,
        reason = refusal.reason.as_str(),
        error = %refusal.detail,
        "publish refused"
    );
    drop(under);
    span.refused(refusal.reason.as_str(), &refusal.detail);
}

/// The row's age at publish, since `occurred_at` (0 for a row from the
/// future: a writer's fast clock).
fn delay_ms(row: &OutboxRow) -> i64 {
    // Milliseconds since the epoch on both sides: no calendar date is made.
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as i128);
    let occurred = row.occurred_at.unix_timestamp_nanos() / 1_000_000;
    i64::try_from((now - occurred).max(0)).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use time::OffsetDateTime;

    use super::*;
    use crate::domain::Payload;

    fn row(occurred_at: OffsetDateTime) -> OutboxRow {
        OutboxRow {
            id: 1,
            kind: "k".into(),
            subject_id: "s".into(),
            payload: Payload::Tombstone,
            headers: None,
            occurred_at,
            defect: None,
            cost: 0,
        }
    }

    #[test]
    fn a_rows_delay_is_its_age_in_milliseconds_never_below_zero() {
        let now = OffsetDateTime::now_utc();
        let delay = delay_ms(&row(now - Duration::from_millis(1500)));
        // The clock moves between the two readings, a little.
        assert!((1500..61_500).contains(&delay), "{delay}");
        assert_eq!(delay_ms(&row(now + Duration::from_secs(3600))), 0);
        let ancient = delay_ms(&row(time::macros::datetime!(0001-01-01 00:00 UTC)));
        assert!(ancient > 60_000_000_000_000, "{ancient}");
    }
}
