//! What the broker's answer to one publish means, decided once for every
//! sender: the shared channel's collector (`confirms`), a row sent alone
//! (`isolation`) and `replay` (`lifecycle`) each read a confirm through
//! [`ConfirmOutcome::of`], and only word what it means their own way.
//!
//! A row is marked published only once the broker confirmed it: an ack of a
//! message that did not come back. Anything else refuses it, a confirm that
//! was not asked for (`NotRequested`) included: on a confirm-mode channel it
//! cannot happen, and taking it for an ack would mark a row that nobody
//! confirmed.

use lapin::Confirmation;
use lapin::message::BasicReturnMessage;

use crate::domain::{FailureReason, Refusal};

/// Why nothing more is sent while the broker blocks the connection: the
/// sweep's refusal (reason `timeout`, written on no row), and what a confirm
/// missing meanwhile is put down to.
pub const BLOCKED: &str = "the broker blocks publishers (connection.blocked: a resource alarm); the rows wait for it to unblock";

/// What became of one published message, as its confirm (or the lack of
/// one) says.
#[derive(Debug)]
pub enum ConfirmOutcome {
    /// Acked, and nothing came back with the ack: the broker has the message.
    Delivered,
    /// Acked, and a message came back with the ack: unroutable (the relay
    /// publishes `mandatory`). On a channel shared by several batches the
    /// message returned may be another's: its `message_id` says whose (see
    /// `confirms`).
    Returned(BasicReturnMessage),
    /// Refused: nacked (with the message returned beside it, if any), or not
    /// confirmed at all (`NotRequested`).
    Refused(Refusal, Option<BasicReturnMessage>),
    /// The channel or the connection failed before the answer came: what
    /// that says of the message is the sender's to judge (see `isolation`).
    Failed(lapin::Error),
    /// No answer in time.
    TimedOut,
}

impl ConfirmOutcome {
    /// What `answer` means; `None` is no answer in time.
    pub fn of(answer: Option<lapin::Result<Confirmation>>) -> ConfirmOutcome {
        match answer {
            None => ConfirmOutcome::TimedOut,
            Some(Ok(Confirmation::Ack(None))) => ConfirmOutcome::Delivered,
            Some(Ok(Confirmation::Ack(Some(returned)))) => ConfirmOutcome::Returned(returned),
            Some(Ok(Confirmation::Nack(returned))) => ConfirmOutcome::Refused(
                Refusal::new(FailureReason::Nack, "the broker nacked the message"),
                returned,
            ),
            // Not the row's doing, and nothing of the broker's: no confirm.
            Some(Ok(Confirmation::NotRequested)) => ConfirmOutcome::Refused(
                Refusal::shared(FailureReason::Other, "the channel is not in confirm mode"),
                None,
            ),
            Some(Err(error)) => ConfirmOutcome::Failed(error),
        }
    }
}

/// The refusal of the row whose message the broker returned.
pub fn unroutable(message: &BasicReturnMessage) -> Refusal {
    Refusal::new(FailureReason::Unroutable, returned_detail(message))
}

/// Why a returned message did not go out, as its row's `last_error` says.
fn returned_detail(message: &BasicReturnMessage) -> String {
    format!(
        "returned by the broker: {} {} (no queue bound for routing key {:?})",
        message.reply_code,
        message.reply_text,
        message.delivery.routing_key.as_str()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(outcome: ConfirmOutcome) -> Refusal {
        match outcome {
            ConfirmOutcome::Refused(refusal, None) => refusal,
            other => panic!("a refusal, not {other:?}"),
        }
    }

    #[test]
    fn only_an_ack_with_nothing_returned_is_delivered() {
        let acked = ConfirmOutcome::of(Some(Ok(Confirmation::Ack(None))));
        assert!(matches!(acked, ConfirmOutcome::Delivered));
    }

    #[test]
    fn a_confirm_not_requested_is_a_refusal_written_on_no_row() {
        let refusal = refusal(ConfirmOutcome::of(Some(Ok(Confirmation::NotRequested))));
        assert_eq!(refusal.reason, FailureReason::Other);
        assert!(!refusal.attributed, "not the row's doing");
        assert_eq!(refusal.detail, "the channel is not in confirm mode");
    }

    #[test]
    fn a_nack_is_the_rows_refusal() {
        let refusal = refusal(ConfirmOutcome::of(Some(Ok(Confirmation::Nack(None)))));
        assert_eq!(refusal.reason, FailureReason::Nack);
        assert!(refusal.attributed);
        assert_eq!(refusal.last_error(), "nack: the broker nacked the message");
    }

    #[test]
    fn a_failure_is_kept_for_the_sender_and_no_answer_is_a_timeout() {
        let io: lapin::Error = lapin::ErrorKind::IOError(std::sync::Arc::new(
            std::io::Error::other("connection reset"),
        ))
        .into();
        assert!(matches!(
            ConfirmOutcome::of(Some(Err(io))),
            ConfirmOutcome::Failed(_)
        ));
        assert!(matches!(ConfirmOutcome::of(None), ConfirmOutcome::TimedOut));
    }
}
