//! What goes wrong on the broker's side of a batch and is not one row's
//! doing: [`PublishError`], and the refusal a batch that met it reports.

use super::outcome::BLOCKED;
use crate::domain::{FailureReason, Refusal};

/// A failure on the broker side that is not one row's refusal.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// A configured name does not fit an AMQP short string.
    #[error("{what} is {len} bytes; AMQP allows at most 255")]
    TooLong { what: &'static str, len: usize },
    /// The configured message templates do not fit AMQP.
    #[error("{0}")]
    Envelope(String),
    #[error("not connected to the broker")]
    NotConnected,
    #[error("cannot open a channel: {0}")]
    Channel(#[source] lapin::Error),
    #[error("opening a channel timed out")]
    ChannelTimeout,
    #[error("{BLOCKED}")]
    Blocked,
}

impl PublishError {
    /// What a batch that met this error reports for its first row: the
    /// broker's trouble, not the row's, so nothing is written on the row.
    pub(super) fn refusal(&self) -> Refusal {
        let reason = match self {
            PublishError::ChannelTimeout | PublishError::Blocked => FailureReason::Timeout,
            _ => FailureReason::Connection,
        };
        Refusal::shared(reason, self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_a_timeout_written_on_no_row() {
        let refusal = PublishError::Blocked.refusal();
        assert_eq!(refusal.reason, FailureReason::Timeout);
        assert!(!refusal.attributed, "the broker's trouble, not the row's");
        assert!(refusal.detail.contains("blocks publishers"));
    }
}
