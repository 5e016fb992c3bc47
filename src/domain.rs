//! The words every layer shares: the outbox row, why a row did not go out, and
//! how a sweep ended. This module imports nothing of the relay's, so the store,
//! the publisher, the envelope, the scheduler and the metrics may all speak it.

use std::time::SystemTime;

use bytes::Bytes;
use time::OffsetDateTime;

/// One pending outbox row, as the relay publishes it.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    pub id: i64,
    pub kind: String,
    pub subject_id: String,
    pub payload: Payload,
    /// The row's `headers` as JSON text, kept as read: they become AMQP
    /// headers only when the message is built (see `envelope`), so a batch
    /// never holds them decoded.
    pub headers: Option<Bytes>,
    pub occurred_at: OffsetDateTime,
    /// Why the row as stored cannot become a message (a value the relay
    /// could not read or that no message can carry); such a row is refused
    /// as `invalid` without being sent, and the fields above hold
    /// placeholders where it could not be read.
    pub defect: Option<String>,
    /// What the row holds of the relay's byte budget while it is in flight
    /// (`max_bytes_in_flight`): every copy of it held at once, from the
    /// database connection's read buffer to the AMQP client's frames and
    /// decoded header table (see `budget`), and a fixed overhead.
    pub cost: usize,
}

/// A row's payload as read: the bytes of its body, or why there are none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    /// Sent as the message body (shared, never copied by the relay).
    Body(Bytes),
    /// A NULL payload: sent with an empty body and `outbox-tombstone: true`.
    Tombstone,
    /// Over `max_payload_bytes`: left in the database, never read whole;
    /// the row is refused as `too_large`.
    TooLarge { bytes: u64 },
    /// Within `max_payload_bytes` but over what the sweep had of the byte
    /// budget: read separately once the budget allows.
    OverBudget { bytes: u64 },
}

/// Why a row did not go out: the `reason` of `outbox_publish_failures_total`
/// and the prefix of `last_error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureReason {
    /// The broker nacked the message.
    Nack,
    /// No queue was bound for its routing key (a `mandatory` return).
    Unroutable,
    /// No confirm arrived within `confirm_timeout_ms`.
    Timeout,
    /// The connection or channel failed while the row was in flight.
    Connection,
    /// The payload is over `max_payload_bytes`, or over what the broker
    /// takes.
    TooLarge,
    /// The row holds something the broker would reject or the relay cannot
    /// decode (a reserved header, a name or value too long for its field, a
    /// timestamp no message can carry): refused before it is sent.
    Invalid,
    /// The relay's own trouble (e.g. its confirm collector stopped).
    Other,
}

impl FailureReason {
    pub const ALL: [FailureReason; 7] = [
        FailureReason::Nack,
        FailureReason::Unroutable,
        FailureReason::Timeout,
        FailureReason::Connection,
        FailureReason::TooLarge,
        FailureReason::Invalid,
        FailureReason::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::Nack => "nack",
            FailureReason::Unroutable => "unroutable",
            FailureReason::Timeout => "timeout",
            FailureReason::Connection => "connection",
            FailureReason::TooLarge => "too_large",
            FailureReason::Invalid => "invalid",
            FailureReason::Other => "other",
        }
    }

    /// Whether a refusal for this reason is the message's own and counts in
    /// its row's `attempts`. A timeout, a lost connection or the relay's own
    /// trouble is not the row's doing: it is recorded in `last_error` of the
    /// row it stopped at, never counted.
    pub fn counts_as_attempt(self) -> bool {
        matches!(
            self,
            FailureReason::Nack
                | FailureReason::Unroutable
                | FailureReason::TooLarge
                | FailureReason::Invalid
        )
    }
}

/// Why one row was not published. The detail is safe to log and to store in
/// `last_error`: it never contains the payload nor a header's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: FailureReason,
    pub detail: String,
    /// Whether the refusal is known to be this row's: its own doing (the
    /// envelope refused it, the broker nacked or returned it, or refused it
    /// while it was alone on a channel), or a failure that nothing else of the
    /// relay's had in flight. Only such a refusal is written on the row. The
    /// failure of something the row shared with other tenants' rows (the
    /// shared channel, the connection) names none of them: nobody knows yet
    /// which row caused it.
    pub attributed: bool,
}

impl Refusal {
    /// A refusal known to be the row's (see [`Refusal::attributed`]).
    pub fn new(reason: FailureReason, detail: impl Into<String>) -> Refusal {
        Refusal {
            reason,
            detail: detail.into(),
            attributed: true,
        }
    }

    /// A failure the row met with other rows in flight beside it: recorded in
    /// the metrics and the logs, never on the row.
    pub fn shared(reason: FailureReason, detail: impl Into<String>) -> Refusal {
        Refusal {
            attributed: false,
            ..Refusal::new(reason, detail)
        }
    }

    /// The text stored in `last_error`: `<reason>: <detail>`.
    pub fn last_error(&self) -> String {
        format!("{}: {}", self.reason.as_str(), self.detail)
    }
}

/// How a sweep of one tenant ended, which decides when it is swept next; the
/// `outcome` label of the sweep metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A full batch went out: sweep again at once.
    Published,
    /// Fewer rows than a batch (maybe none): wait for the poll.
    Idle,
    /// Another relay holds the tenant: wait for the poll.
    Skipped,
    /// Nothing, or only a prefix, went out: back off.
    Failed,
}

impl Outcome {
    pub const ALL: [Outcome; 4] = [
        Outcome::Published,
        Outcome::Idle,
        Outcome::Skipped,
        Outcome::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Published => "published",
            Outcome::Idle => "idle",
            Outcome::Skipped => "skipped",
            Outcome::Failed => "failed",
        }
    }
}

impl Payload {
    /// The body's length in bytes, read or not.
    pub fn len(&self) -> usize {
        match self {
            Payload::Body(body) => body.len(),
            Payload::Tombstone => 0,
            Payload::TooLarge { bytes } | Payload::OverBudget { bytes } => {
                usize::try_from(*bytes).unwrap_or(usize::MAX)
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What became of a published batch: how many rows from the start the broker
/// confirmed, when, and the first row that did not go out.
#[derive(Debug, Default)]
pub struct BatchReport {
    /// Confirm times of the confirmed prefix, one per row.
    pub confirmed_at: Vec<SystemTime>,
    /// The first row refused (its index in the batch), and why.
    pub refusal: Option<(usize, Refusal)>,
}

impl BatchReport {
    /// A batch of which nothing went out, because of its first row or of
    /// something that concerns the whole batch (no connection, no channel).
    pub fn refused(refusal: Refusal) -> BatchReport {
        BatchReport {
            confirmed_at: Vec::new(),
            refusal: Some((0, refusal)),
        }
    }

    /// Rows confirmed from the start of the batch.
    pub fn confirmed(&self) -> usize {
        self.confirmed_at.len()
    }

    /// Records a refusal at `index`; the earliest one is kept.
    pub fn refuse(&mut self, index: usize, refusal: Refusal) {
        if self.refusal.as_ref().is_none_or(|(at, _)| index < *at) {
            self.refusal = Some((index, refusal));
        }
    }
}

/// A tenant's claim, as the publisher sees it: once it is no longer held,
/// another relay may be publishing the same rows, so no more are sent.
pub trait Lease: Sync {
    fn is_held(&self) -> bool;
}
