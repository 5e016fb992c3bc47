//! Keeping a broker-side refusal with the row that caused it.
//!
//! The relay's sweeps share one channel (see `confirms`). When the broker
//! closes it over one message — a refusal the envelope could not foresee,
//! such as a body over the broker's `max_message_size`, which AMQP does not
//! announce — every message in flight on it fails alike, and nobody knows yet
//! which one the broker refused. None of those rows is blamed (their
//! refusals are not attributed, see `Refusal::attributed`); they become
//! *suspects*: each is sent again alone, on a channel of its own, one at a
//! time, before its tenant goes back to the shared channel. If the broker
//! closes that channel, the row alone on it is the one: it gets the attempt
//! and `last_error` with the reason the broker's refusal maps to, and it keeps
//! going alone, at its tenant's back-off, until it is confirmed. So one
//! unforeseen refusal re-sends the messages in flight when it happened, once,
//! not at every retry.
//!
//! A row the broker nacked or returned becomes a suspect too: retried with
//! the window behind it, those rows would reach every other bound queue again
//! at each retry; alone, only the refused row is sent again.
//!
//! A refusal for a body over the broker's `max_message_size` names the limit:
//! it is learned, and a row whose body is over it goes alone from then on,
//! before any incident. (Alone rather than refused: if the limit is raised,
//! the first such row confirmed forgets it.)
//!
//! What is no row's doing is told apart: a missing exchange or a refused
//! permission is a configuration problem, and a lost connection is the
//! connection's.

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use lapin::options::BasicPublishOptions;
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::types::ShortString;
use lapin::{Channel, ErrorKind};

use super::outcome::{self, ConfirmOutcome};
use crate::domain::{FailureReason, OutboxRow, Refusal};
use crate::envelope::Message;

/// Suspects kept at most (row ids, a few bytes each); past it, more are not
/// added and may cause another incident rather than grow without bound.
const MAX_SUSPECTS: usize = 100_000;

/// How much of the broker's reply text a refusal keeps.
const BROKER_TEXT: usize = 200;

/// What the broker's closing of a channel (or connection) says about the
/// messages that were in flight on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// The broker refused one message and closed the channel for it (a 406,
    /// say): one row's doing, with this reason once that row is known.
    Refused(FailureReason, String),
    /// The exchange is missing or the user may not write to it: a
    /// configuration problem, no row's doing.
    Configuration(String),
    /// The connection failed (or the channel was already closed): no row's
    /// doing.
    Connection(String),
}

/// The relay's suspects and what it learned of the broker's limits; shared by
/// the publisher and every collector, across reconnects.
pub(super) struct Isolation {
    suspects: Mutex<HashSet<i64>>,
    /// The broker's `max_message_size` as its last refusal named it; 0:
    /// not known.
    max_message_size: AtomicUsize,
    /// For the configuration problem's message.
    exchange: String,
    declare_exchange: bool,
}

impl Isolation {
    pub fn new(exchange: &str, declare_exchange: bool) -> Isolation {
        Isolation {
            suspects: Mutex::new(HashSet::new()),
            max_message_size: AtomicUsize::new(0),
            exchange: exchange.to_string(),
            declare_exchange,
        }
    }

    fn suspects(&self) -> std::sync::MutexGuard<'_, HashSet<i64>> {
        self.suspects.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The first run of `rows` that go the same way: whether they go alone,
    /// each on a channel of its own, and how many they are.
    pub fn first_run(&self, rows: &[OutboxRow]) -> (bool, usize) {
        let limit = self.max_message_size.load(Ordering::Relaxed);
        let suspects = self.suspects();
        if limit == 0 && suspects.is_empty() {
            return (false, rows.len());
        }
        let alone = |row: &OutboxRow| {
            let body = row.payload.len();
            (limit > 0 && body > limit) || suspects.contains(&row.id)
        };
        let first = rows.first().is_some_and(alone);
        let run = rows
            .iter()
            .position(|row| alone(row) != first)
            .unwrap_or(rows.len());
        (first, run)
    }

    /// Row `id` was in flight on a channel the broker closed over one
    /// message, or was itself nacked or returned: it goes alone until it is
    /// confirmed.
    pub fn suspect(&self, id: i64) {
        let mut suspects = self.suspects();
        if suspects.len() < MAX_SUSPECTS {
            suspects.insert(id);
        }
    }

    /// `row`, sent alone, was confirmed: it is no suspect, and a body this
    /// size is no longer over the broker's limit.
    pub fn cleared(&self, row: &OutboxRow) {
        self.suspects().remove(&row.id);
        let body = row.payload.len();
        let limit = self.max_message_size.load(Ordering::Relaxed);
        if limit > 0 && body > limit {
            self.max_message_size.store(0, Ordering::Relaxed);
        }
    }

    /// What a failed confirm's error says; a refusal over the broker's
    /// `max_message_size` teaches the limit.
    pub fn judge(&self, error: &lapin::Error) -> Verdict {
        let verdict = judge(error);
        if let Verdict::Refused(FailureReason::TooLarge, detail) = &verdict
            && let Some(limit) = max_size_named(detail)
        {
            self.max_message_size.store(limit, Ordering::Relaxed);
        }
        verdict
    }

    /// The refusal of a row that met a configuration problem: not its own.
    pub fn configuration_problem(&self, detail: &str) -> Refusal {
        Refusal::shared(
            FailureReason::Other,
            format!(
                "the broker refused publishing to exchange {:?} ({detail}; declare_exchange = {}): \
                 a configuration problem, not the row's",
                self.exchange, self.declare_exchange
            ),
        )
    }

    /// Says, once per failed channel, what an operator must fix.
    pub fn log_configuration_problem(&self, detail: &str) {
        let hint = if self.declare_exchange {
            "the exchange was deleted or may not be written to; it is declared again with the next channel"
        } else {
            "create the exchange (or set declare_exchange = true), or grant the user write access to it"
        };
        tracing::error!(
            exchange = %self.exchange,
            declare_exchange = self.declare_exchange,
            error = %detail,
            "the broker refuses publishing to the exchange: {hint}"
        );
    }
}

/// The pure part of [`Isolation::judge`].
fn judge(error: &lapin::Error) -> Verdict {
    let ErrorKind::ProtocolError(amqp) = error.kind() else {
        return Verdict::Connection(error.to_string());
    };
    let text = amqp.get_message().as_str();
    let detail: String = format!("{} {text}", amqp.get_id())
        .chars()
        .take(BROKER_TEXT)
        .collect();
    match amqp.kind() {
        AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND | AMQPSoftError::ACCESSREFUSED) => {
            Verdict::Configuration(detail)
        }
        AMQPErrorKind::Soft(AMQPSoftError::CONTENTTOOLARGE) => {
            Verdict::Refused(FailureReason::TooLarge, detail)
        }
        AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
            if text.contains("is larger than") && text.contains("max size") =>
        {
            Verdict::Refused(FailureReason::TooLarge, detail)
        }
        AMQPErrorKind::Soft(_) => Verdict::Refused(FailureReason::Invalid, detail),
        // The broker could not take a frame the relay sent: a message's doing,
        // although it closes the connection.
        AMQPErrorKind::Hard(
            AMQPHardError::FRAMEERROR | AMQPHardError::SYNTAXERROR | AMQPHardError::UNEXPECTEDFRAME,
        ) => Verdict::Refused(FailureReason::Invalid, detail),
        AMQPErrorKind::Hard(_) => Verdict::Connection(detail),
    }
}

/// The limit in "message size N is larger than configured max size M".
fn max_size_named(detail: &str) -> Option<usize> {
    let (_, after) = detail.rsplit_once("max size")?;
    after
        .trim()
        .trim_end_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .ok()
}

/// Publishes `message`, the row `row`, alone on `channel` (no other message
/// in flight on it) and waits for its confirm: whatever the broker says is
/// that row's.
pub(super) async fn send_alone(
    isolation: &Isolation,
    channel: &Channel,
    exchange: ShortString,
    message: Message,
    row: &OutboxRow,
    confirm_timeout: Duration,
) -> Result<SystemTime, Refusal> {
    let Message {
        routing_key,
        properties,
        body,
    } = message;
    let options = BasicPublishOptions {
        mandatory: true,
        immediate: false,
    };
    let confirm = tokio::time::timeout(confirm_timeout, async {
        channel
            .basic_publish(exchange, routing_key, options, &body, properties)
            .await?
            .await
    })
    .await;
    let refusal = match ConfirmOutcome::of(confirm.ok()) {
        ConfirmOutcome::Delivered => {
            isolation.cleared(row);
            return Ok(SystemTime::now());
        }
        ConfirmOutcome::TimedOut => Refusal::new(
            FailureReason::Timeout,
            "no confirm from the broker in time (sent alone)",
        ),
        ConfirmOutcome::Returned(returned) => outcome::unroutable(&returned),
        ConfirmOutcome::Refused(refusal, _) => refusal,
        ConfirmOutcome::Failed(error) => match isolation.judge(&error) {
            Verdict::Refused(reason, detail) => {
                Refusal::new(reason, format!("refused by the broker: {detail}"))
            }
            Verdict::Configuration(detail) => {
                isolation.log_configuration_problem(&detail);
                isolation.configuration_problem(&detail)
            }
            Verdict::Connection(detail) => Refusal::shared(FailureReason::Connection, detail),
        },
    };
    Err(refusal)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::AMQPError;
    use time::macros::datetime;

    fn closed(code: u16, text: &str) -> lapin::Error {
        let error = AMQPError::from_id(code, text.into()).expect("a known code");
        ErrorKind::ProtocolError(error).into()
    }

    fn row(id: i64, body: usize) -> OutboxRow {
        OutboxRow {
            id,
            kind: "k".into(),
            subject_id: "s".into(),
            payload: crate::domain::Payload::Body("x".repeat(body).into()),
            headers: None,
            occurred_at: datetime!(2026-12-01 10:00 UTC),
            defect: None,
            cost: 0,
        }
    }

    #[test]
    fn the_brokers_closes_map_to_reasons() {
        let too_large =
            "PRECONDITION_FAILED - message size 2097152 is larger than configured max size 1048576";
        assert_eq!(
            judge(&closed(406, too_large)),
            Verdict::Refused(FailureReason::TooLarge, format!("406 {too_large}"))
        );
        let cc =
            "PRECONDITION_FAILED - invalid message: {unacceptable_type_in_header,\"CC\",longstr}";
        assert!(matches!(
            judge(&closed(406, cc)),
            Verdict::Refused(FailureReason::Invalid, _)
        ));
        let missing = "NOT_FOUND - no exchange 'gone' in vhost '/'";
        assert_eq!(
            judge(&closed(404, missing)),
            Verdict::Configuration(format!("404 {missing}"))
        );
        assert!(matches!(
            judge(&closed(
                403,
                "ACCESS_REFUSED - access to exchange 'x' refused"
            )),
            Verdict::Configuration(_)
        ));
        assert!(matches!(
            judge(&closed(501, "FRAME_ERROR - frame too large")),
            Verdict::Refused(FailureReason::Invalid, _)
        ));
        assert!(matches!(
            judge(&closed(
                320,
                "CONNECTION_FORCED - broker forced connection closure"
            )),
            Verdict::Connection(_)
        ));
        let io: lapin::Error = ErrorKind::IOError(std::sync::Arc::new(std::io::Error::other(
            "connection reset",
        )))
        .into();
        assert!(matches!(judge(&io), Verdict::Connection(_)));
    }

    #[test]
    fn the_brokers_text_is_kept_short() {
        let long = format!("PRECONDITION_FAILED - {}", "y".repeat(220));
        let Verdict::Refused(_, detail) = judge(&closed(406, &long)) else {
            panic!("a refusal");
        };
        assert_eq!(detail.chars().count(), BROKER_TEXT);
    }

    #[test]
    fn suspects_go_alone_until_confirmed() {
        let isolation = Isolation::new("x", false);
        let rows = [row(1, 10), row(2, 10), row(3, 10), row(4, 10)];
        assert_eq!(isolation.first_run(&rows), (false, 4));
        isolation.suspect(2);
        isolation.suspect(3);
        assert_eq!(isolation.first_run(&rows), (false, 1), "up to the suspects");
        assert_eq!(isolation.first_run(&rows[1..]), (true, 2), "suspects alone");
        assert_eq!(isolation.first_run(&rows[3..]), (false, 1));
        isolation.cleared(&rows[1]);
        assert_eq!(isolation.first_run(&rows[1..]), (false, 1));
        assert_eq!(isolation.first_run(&[]), (false, 0));
    }

    #[test]
    fn a_max_message_size_refusal_teaches_the_limit_until_a_larger_body_is_confirmed() {
        let isolation = Isolation::new("x", false);
        let (small, large) = (row(1, 1_000), row(2, 2_000));
        let rows = [small.clone(), large.clone()];
        assert_eq!(isolation.first_run(&rows), (false, 2));
        isolation.judge(&closed(
            406,
            "PRECONDITION_FAILED - message size 2000 is larger than configured max size 1500",
        ));
        assert_eq!(
            isolation.first_run(&rows),
            (false, 1),
            "small on the shared channel"
        );
        assert_eq!(isolation.first_run(&rows[1..]), (true, 1), "large alone");
        // The limit was raised: the large row went through alone.
        isolation.cleared(&large);
        assert_eq!(isolation.first_run(&rows), (false, 2));
        assert_eq!(
            max_size_named("… is larger than max size 536870912"),
            Some(536_870_912)
        );
        assert_eq!(max_size_named("406 PRECONDITION_FAILED - invalid"), None);
    }
}
