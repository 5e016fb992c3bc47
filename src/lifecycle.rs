//! Bringing rows back, from the command line, while relays run: `requeue`
//! makes parked rows pending again, `discard` ends a parked row unsent, and
//! `replay` sends a tenant's published rows again. `requeue` and `discard`
//! are one statement each (`src/store/requeue*.sql`, `discard.sql`); `replay`
//! reads published rows page by page and publishes each with the relay's own
//! envelope, plus the header `outbox-replay: true`, waiting for the broker's
//! confirms. None of them touches a row's `published_at` or `attempts`
//! but `requeue`, which sets its attempts back to 0.

use std::time::{Duration, SystemTime};

use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, ShortString};

use crate::config::Config;
use crate::domain::{FailureReason, OutboxRow, Refusal};
use crate::envelope::Envelope;
use crate::publisher::{
    ConfirmOutcome, OpenError, close, in_time, open_channel, traced_message, unroutable,
};
use crate::store::{Changed, Store, StoreError};
use crate::traces::PublishSpan;

/// The header every replayed message carries, beside the relay's own.
pub const REPLAY_HEADER: &str = "outbox-replay";

/// What [`REPLAY_HEADER`] adds to a message's header frame, at most: its
/// name's length byte and name, a type tag and a boolean (16), rounded up.
const REPLAY_HEADER_BYTES: u32 = 32;

/// Why a replay stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("the broker refused a confirm-mode channel: {0}")]
    Channel(#[source] lapin::Error),
    /// The configuration cannot build a message (checked at load, so only
    /// for a configuration built in code).
    #[error("{0}")]
    Envelope(String),
    /// A row was refused (by the envelope or by the broker): the replay
    /// stopped there. The rows before it were sent and confirmed.
    #[error(
        "replay stopped at row {id}: {reason}; sent before it: {}{}",
        plural(sent.count),
        sent.range().map(|(first, last)| format!(" (ids {first} to {last})")).unwrap_or_default()
    )]
    Refused {
        id: i64,
        reason: String,
        sent: Replayed,
    },
}

/// What a replay sent.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Replayed {
    pub count: u64,
    pub first: Option<i64>,
    pub last: Option<i64>,
}

impl Replayed {
    fn add(&mut self, id: i64) {
        self.count += 1;
        self.first.get_or_insert(id);
        self.last = Some(id);
    }

    /// The first and the last id sent, when any was.
    pub fn range(&self) -> Option<(i64, i64)> {
        self.first.zip(self.last)
    }
}

fn plural(count: u64) -> String {
    match count {
        1 => "1 row".to_string(),
        n => format!("{n} rows"),
    }
}

/// The text `requeue` prints for the rows it made pending again.
pub fn requeued_text(rows: &[Changed]) -> String {
    format!(
        "requeued {}: {}\nThey are pending again (attempts 0) and go out next of their tenant's \
         pending rows: after the rows published while they were parked, so out of order with those.\n",
        plural(rows.len() as u64),
        describe(rows)
    )
}

/// The text `discard` prints for the row it ended.
pub fn discarded_text(rows: &[Changed]) -> String {
    format!(
        "discarded {}: {}\nIt stays in the table (parked_at, last_error, discarded_at), is never \
         published nor counted as published, and replay skips it.\n",
        plural(rows.len() as u64),
        describe(rows)
    )
}

/// The text `replay` prints once every row was confirmed.
pub fn replayed_text(tenant: &str, replayed: &Replayed) -> String {
    let (first, last) = replayed.range().unwrap_or_default();
    format!(
        "replayed {} of tenant {tenant:?}, ids {first} to {last}, in order, with their original \
         message_id and the header {REPLAY_HEADER}: true.\nConsumers that deduplicate on \
         message_id drop them.\n",
        plural(replayed.count)
    )
}

/// `id N (tenant "t")`, for each row.
fn describe(rows: &[Changed]) -> String {
    rows.iter()
        .map(|row| format!("id {} (tenant {:?})", row.id, row.tenant))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Sends again the published rows of `tenant` with `from` <= id <= `to`, in
/// id order, a page at a time (a batch, within the byte budget), each page
/// confirmed before the next is read. A refused row stops the replay.
pub async fn replay(
    config: &Config,
    store: &Store,
    tenant: &str,
    from: i64,
    to: i64,
) -> Result<Replayed, ReplayError> {
    // Which statements fit the table (with or without `discarded_at`).
    store.check_columns().await?;
    let (connection, channel) = open_channel(&config.amqp_url, "outbox-relay replay").await?;
    in_time(
        "selecting confirms",
        channel.confirm_select(ConfirmSelectOptions::default()),
    )
    .await?
    .map_err(ReplayError::Channel)?;
    let frame_max = connection.configuration().frame_max();
    let envelope = Envelope::from_config(config).map_err(ReplayError::Envelope)?;
    let exchange = ShortString::try_new(config.exchange.clone()).unwrap_or_default();
    let mut replayed = Replayed::default();
    let mut after = from.saturating_sub(1);
    let result = loop {
        let page = store
            .replay_page(tenant, after, to, config.max_bytes_in_flight)
            .await?;
        let Some(last) = page.last() else {
            break Ok(replayed);
        };
        after = last.id;
        if let Err((id, reason)) = send_page(
            &channel,
            &exchange,
            &envelope,
            tenant,
            &page,
            frame_max,
            config.confirm_timeout(),
            &mut replayed,
        )
        .await
        {
            break Err(ReplayError::Refused {
                id,
                reason,
                sent: replayed,
            });
        }
    };
    close(&connection, "replay done").await;
    result
}

/// Publishes a page's rows in order and waits for their confirms, in order;
/// the first refused row and why.
#[allow(clippy::too_many_arguments)]
async fn send_page(
    channel: &lapin::Channel,
    exchange: &ShortString,
    envelope: &Envelope,
    tenant: &str,
    rows: &[OutboxRow],
    frame_max: u32,
    confirm_timeout: Duration,
    replayed: &mut Replayed,
) -> Result<(), (i64, String)> {
    let mut confirms = Vec::with_capacity(rows.len());
    let mut refused = None;
    for row in rows {
        // The header frame must hold the replay's own header too. Tracing
        // on, each row has its publish span, as when the relay sends it.
        let (message, span) = traced_message(
            envelope,
            exchange.as_str(),
            tenant,
            row,
            frame_max.saturating_sub(REPLAY_HEADER_BYTES),
        );
        let message = match message {
            Ok(message) => message,
            Err(refusal) => {
                refused = Some((row.id, refusal.last_error()));
                break;
            }
        };
        let mut headers = message.properties.headers().clone().unwrap_or_default();
        headers.insert(REPLAY_HEADER.into(), AMQPValue::Boolean(true));
        let properties = message.properties.with_headers(headers);
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let publish = channel.basic_publish(
            exchange.clone(),
            message.routing_key,
            options,
            &message.body,
            properties,
        );
        // A broker that blocks publishers (or went silent) takes no more: the
        // replay stops at the row, as at a confirm that does not come.
        let Ok(published) = tokio::time::timeout(confirm_timeout, publish).await else {
            let refusal = Refusal::new(
                FailureReason::Timeout,
                format!(
                    "the broker took no message within {} ms (it blocks publishers, or went silent)",
                    confirm_timeout.as_millis()
                ),
            );
            if let Some(span) = span {
                span.refused(refusal.reason.as_str(), &refusal.detail);
            }
            refused = Some((row.id, refusal.last_error()));
            break;
        };
        match published {
            Ok(confirm) => confirms.push((row.id, confirm, span)),
            Err(error) => {
                let detail = error.to_string();
                if let Some(span) = span {
                    span.refused("connection", &detail);
                }
                refused = Some((row.id, format!("connection: {detail}")));
                break;
            }
        }
    }
    confirmed(confirms, confirm_timeout, replayed).await?;
    match refused {
        Some(refused) => Err(refused),
        None => Ok(()),
    }
}

/// Waits for the confirms of a page's rows, in order, ending each row's
/// span; the first row not confirmed and why. The rows after it are not
/// waited for: their spans end unconfirmed.
async fn confirmed(
    confirms: Vec<(
        i64,
        impl Future<Output = lapin::Result<Confirmation>>,
        Option<PublishSpan>,
    )>,
    confirm_timeout: Duration,
    replayed: &mut Replayed,
) -> Result<(), (i64, String)> {
    let mut confirms = confirms.into_iter();
    while let Some((id, confirm, span)) = confirms.next() {
        let answer = tokio::time::timeout(confirm_timeout, confirm).await.ok();
        let refusal = match ConfirmOutcome::of(answer) {
            ConfirmOutcome::Delivered => {
                if let Some(span) = span {
                    span.confirmed(SystemTime::now());
                }
                replayed.add(id);
                continue;
            }
            ConfirmOutcome::Returned(returned) => unroutable(&returned),
            ConfirmOutcome::Refused(refusal, _) => refusal,
            ConfirmOutcome::Failed(error) => {
                Refusal::new(FailureReason::Connection, error.to_string())
            }
            ConfirmOutcome::TimedOut => Refusal::new(
                FailureReason::Timeout,
                format!("no confirm within {} ms", confirm_timeout.as_millis()),
            ),
        };
        if let Some(span) = span {
            span.refused(refusal.reason.as_str(), &refusal.detail);
        }
        for (_, _, span) in confirms {
            if let Some(span) = span {
                span.refused(
                    "other",
                    "not confirmed: the replay stopped at an earlier row",
                );
            }
        }
        return Err((id, refusal.last_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_each_command_says() {
        let rows = [Changed {
            id: 7,
            tenant: "acme".into(),
        }];
        let text = requeued_text(&rows);
        assert!(
            text.starts_with("requeued 1 row: id 7 (tenant \"acme\")"),
            "{text}"
        );
        assert!(text.contains("out of order"), "{text}");
        let text = discarded_text(&rows);
        assert!(text.contains("replay skips it"), "{text}");
        let mut replayed = Replayed::default();
        for id in [3, 5, 9] {
            replayed.add(id);
        }
        let text = replayed_text("acme", &replayed);
        assert!(
            text.starts_with("replayed 3 rows of tenant \"acme\", ids 3 to 9"),
            "{text}"
        );
        assert!(text.contains("deduplicate on message_id"), "{text}");
    }

    #[test]
    fn a_stopped_replay_names_the_row_it_reached() {
        let mut sent = Replayed::default();
        sent.add(4);
        let error = ReplayError::Refused {
            id: 6,
            reason: "too_large: payload is 9 bytes, over max_payload_bytes (8)".into(),
            sent,
        };
        let text = error.to_string();
        assert!(
            text.starts_with("replay stopped at row 6: too_large"),
            "{text}"
        );
        assert!(
            text.ends_with("sent before it: 1 row (ids 4 to 4)"),
            "{text}"
        );
    }
}
