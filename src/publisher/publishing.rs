//! Publishing one batch: its rows go out in order on the shared channel, at
//! most `max_in_flight` unconfirmed, or one at a time alone (see
//! `isolation`), and the sweep is told as the confirmed prefix grows and at
//! last what became of the batch.
//!
//! A batch's publishes are issued without awaiting each hand-off to the I/O
//! side in turn (each `basic_publish` is polled once, in row order, which is
//! where lapin assigns the delivery tag and queues the frames); the channel's
//! collector resolves the confirms, each within `confirm_timeout_ms` of its
//! send.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::confirms::{BatchConfirms, ConfirmChannel};
use super::isolation;
use super::link::Link;
use super::outcome::BLOCKED;
use super::spans;
use crate::domain::{BatchReport, FailureReason, Lease, OutboxRow, Refusal};
use crate::traces::PublishSpan;

/// The confirmed prefix is reported (see [`Progress::Confirmed`]) in steps
/// of this many rows while the rest of a run is still being confirmed, and
/// each step is marked ahead of the commit by one statement. Each statement
/// costs the server about 0.1 ms besides its rows (an `UPDATE`'s executor
/// with the table's indexes): steps of 64 cost it about 1.4 µs more per row
/// than steps of 256, which leave at most 255 rows for the commit to mark.
pub const PROGRESS_STEP: usize = 256;

/// How far a batch being published has come.
#[derive(Debug)]
pub enum Progress {
    /// The broker confirmed the batch's first rows, this many (at least
    /// [`PROGRESS_STEP`] more than last told); a refusal found later may
    /// still shorten the prefix: the report has the final word.
    Confirmed(usize),
    /// Every row of the run is sent and more were promised
    /// ([`Publishing::expect_more`]): the caller extends the run or ends it.
    Sent,
    /// The confirm of everything sent is resolved: what became of the run.
    Resolved(BatchReport),
}

/// One run of a claim's rows being published: they go out in order, at most
/// `max_in_flight` unconfirmed, until all are sent, one is refused, or the
/// lease is lost; every message sent is then resolved. The rows are the
/// claim's, passed to each call: the run is their first `run`.
pub struct Publishing<'a> {
    link: &'a Link,
    tenant: &'a str,
    /// How many of the claim's rows, from the first, the run holds.
    run: usize,
    /// Rows of the claim follow the run: they go another way.
    cut_short: bool,
    /// The run goes alone, one row at a time, on a channel of its own.
    alone: bool,
    /// The caller may extend the run: once all of it is sent, the window
    /// stays open for more ([`Progress::Sent`]).
    more: bool,
    channel: Option<Arc<ConfirmChannel>>,
    confirms: Arc<BatchConfirms>,
    /// Rows handed to the channel so far.
    sent: usize,
    /// More rows may still be sent.
    sending: bool,
    /// Rows confirmed from the start, as last seen, and as last told.
    prefix: usize,
    reported: usize,
    /// Each row's span, by its index, while tracing is on (empty when off).
    spans: Vec<Option<PublishSpan>>,
}

impl<'a> Publishing<'a> {
    /// Starts publishing `rows` of `tenant`, in order: the caller drives it
    /// with [`Publishing::next`]. Only the first run of rows that go the same
    /// way (alone, or on the shared channel) is published: see
    /// [`Publishing::cut_short`].
    pub(super) fn new(link: &'a Link, tenant: &'a str, rows: &[OutboxRow]) -> Publishing<'a> {
        let (alone, run) = link.isolation.first_run(rows);
        Publishing {
            link,
            tenant,
            run,
            cut_short: run < rows.len(),
            alone,
            more: false,
            channel: None,
            confirms: BatchConfirms::new(run),
            sent: 0,
            sending: true,
            prefix: 0,
            reported: 0,
            spans: Vec::new(),
        }
    }
}

impl Publishing<'_> {
    /// Whether rows of the batch were left for the next sweep, because they
    /// go another way (alone, or on the shared channel) than those before
    /// them: the tenant is to be swept again at once.
    pub fn cut_short(&self) -> bool {
        self.cut_short
    }

    /// Says whether the caller may still extend the run (it is reading the
    /// claim's next batch): while it may, the run's end is not the end of
    /// sending. Never for a run sent alone or cut short.
    pub fn expect_more(&mut self, more: bool) {
        self.more = more && !self.alone && !self.cut_short;
    }

    /// Extends the run over the claim's rows appended since (`rows` is all of
    /// them, the run's included): the first run of the new rows that goes on
    /// the shared channel joins it, behind the rows still in flight. Rows
    /// after that are left, and the run is cut short. Only while the run is
    /// still sending (see [`Progress::Sent`]); otherwise nothing joins.
    pub fn extend(&mut self, rows: &[OutboxRow]) {
        let joining = match rows.get(self.run..) {
            Some(new) if self.more && self.sending => match self.link.isolation.first_run(new) {
                (false, run) => run,
                (true, _) => 0,
            },
            _ => 0,
        };
        self.run += joining;
        self.cut_short = self.run < rows.len();
        self.more = false;
        self.confirms.grow(self.run);
    }

    /// Sends what the window allows and waits until the confirmed prefix has
    /// grown by a [`PROGRESS_STEP`], every row of the run is sent while more
    /// were promised, or the confirm of everything sent is resolved. `rows`:
    /// the claim's, whose first `run` the run is; `lease`: the claim, which
    /// must still hold for a row to be sent.
    pub async fn next(&mut self, rows: &[OutboxRow], lease: &dyn Lease) -> Progress {
        let rows = &rows[..self.run];
        if self.alone {
            return Progress::Resolved(self.publish_alone(rows, lease).await);
        }
        let channel = match &self.channel {
            Some(channel) => channel.clone(),
            None => match self.link.confirm_channel().await {
                Ok(channel) => self.channel.insert(channel).clone(),
                Err(error) => return Progress::Resolved(BatchReport::refused(error.refusal())),
            },
        };
        loop {
            let now = self.follow();
            if now.done {
                return Progress::Resolved(self.report(rows));
            }
            // The last step is left to the caller's settlement.
            if self.prefix >= self.reported + PROGRESS_STEP {
                self.reported = self.prefix;
                return Progress::Confirmed(self.prefix);
            }
            if self.sending {
                let all_sent = self.sent == rows.len();
                if now.refused || (all_sent && !self.more) || !lease.is_held() {
                    // Everything sent is resolved, even after a refusal: a
                    // later confirm may carry the return of an earlier row.
                    self.sending = false;
                    channel.sending_done(&self.confirms);
                    continue;
                }
                if all_sent {
                    // The rows in flight stay in flight meanwhile.
                    return Progress::Sent;
                }
                if now.in_flight < self.link.max_in_flight {
                    if channel.is_blocked() {
                        // Nothing new is handed to lapin: the rows from here
                        // wait for the unblock; those in flight are resolved.
                        self.confirms
                            .tally()
                            .report
                            .refuse(self.sent, Refusal::shared(FailureReason::Timeout, BLOCKED));
                        continue;
                    }
                    self.send(rows, &channel);
                    continue;
                }
            }
            if !channel.changed(&self.confirms).await {
                // Nothing of the batch is known to be resolved: it is not marked.
                self.confirms.tally().report.refuse(
                    0,
                    Refusal::new(FailureReason::Other, "the confirm collector stopped"),
                );
                channel.retire();
                return Progress::Resolved(self.report(rows));
            }
        }
    }

    /// Sends the run's rows one at a time, each alone on a channel of its
    /// own and confirmed before the next, until one is refused: whatever the
    /// broker says of a row is that row's.
    async fn publish_alone(&self, rows: &[OutboxRow], lease: &dyn Lease) -> BatchReport {
        let link = self.link;
        let (channel, frame_max) = match link.channel_alone().await {
            Ok(opened) => opened,
            Err(error) => return BatchReport::refused(error.refusal()),
        };
        let mut report = BatchReport::default();
        for (index, row) in rows.iter().enumerate() {
            if !lease.is_held() {
                break;
            }
            if link.is_blocked() {
                report.refuse(index, Refusal::shared(FailureReason::Timeout, BLOCKED));
                break;
            }
            let exchange = link.exchange.name.as_str();
            let (message, span) =
                spans::message(&link.envelope, exchange, self.tenant, row, frame_max);
            let sent = match message {
                Ok(message) => {
                    let sent = isolation::send_alone(
                        &link.isolation,
                        &channel,
                        link.exchange.name.clone(),
                        message,
                        row,
                        link.confirm_timeout,
                    )
                    .await;
                    if let Some(span) = span {
                        match &sent {
                            Ok(at) => span.confirmed(*at),
                            Err(refusal) => spans::refused(span, self.tenant, row.id, refusal),
                        }
                    }
                    sent
                }
                Err(refusal) => Err(refusal),
            };
            match sent {
                Ok(confirmed_at) => report.confirmed_at.push(confirmed_at),
                Err(mut refusal) => {
                    if refusal.reason == FailureReason::Timeout {
                        if link.is_blocked() {
                            // Not the row's doing: the broker blocks.
                            refusal = Refusal::shared(FailureReason::Timeout, BLOCKED);
                        }
                        // A silent connection: drop it, as the collector
                        // does (not while blocked, see `Session::broke`).
                        link.reset();
                    }
                    report.refuse(index, refusal);
                    break;
                }
            }
        }
        if channel.status().connected() {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                channel.close(200, "sent alone".into()),
            )
            .await;
        }
        report
    }

    /// Hands the next row to the channel, or refuses it if it cannot be a
    /// message.
    fn send(&mut self, rows: &[OutboxRow], channel: &ConfirmChannel) {
        let index = self.sent;
        let row = &rows[index];
        self.sent += 1;
        let link = self.link;
        let frame_max = channel.frame_max();
        let exchange = link.exchange.name.as_str();
        let (message, span) = spans::message(&link.envelope, exchange, self.tenant, row, frame_max);
        match message {
            Ok(message) => {
                if let Some(span) = span {
                    self.spans.resize_with(index, || None);
                    self.spans.push(Some(span));
                }
                channel.publish(
                    &self.confirms,
                    (index, row.id),
                    link.exchange.name.clone(),
                    message,
                    Instant::now() + link.confirm_timeout,
                );
            }
            Err(refusal) => self.confirms.tally().report.refuse(index, refusal),
        }
    }

    /// Ends the spans of the rows sent (tracing on): each at its confirm, or
    /// with the batch's refusal.
    fn end_spans(
        &mut self,
        rows: &[OutboxRow],
        confirmed: &[Option<SystemTime>],
        refusal: Option<&(usize, Refusal)>,
    ) {
        for (index, span) in self.spans.drain(..).enumerate() {
            let Some(span) = span else { continue };
            let refusal = refusal.map(|(at, refusal)| (*at == index, refusal));
            let confirmed_at = confirmed.get(index).copied().flatten();
            spans::end(span, self.tenant, rows[index].id, confirmed_at, refusal);
        }
    }

    /// Catches up with what the collector has resolved: while nothing is
    /// refused, the prefix reaches over every row confirmed from the start.
    fn follow(&mut self) -> BatchStanding {
        let tally = self.confirms.tally();
        if tally.report.refusal.is_none() {
            self.prefix += tally.confirmed[self.prefix..]
                .iter()
                .take_while(|at| at.is_some())
                .count();
        }
        BatchStanding {
            in_flight: tally.in_flight(),
            refused: tally.report.refusal.is_some(),
            done: tally.done,
        }
    }

    /// The run's report: the confirmed prefix up to the first refusal.
    fn report(&mut self, rows: &[OutboxRow]) -> BatchReport {
        let mut tally = self.confirms.tally();
        let mut report = std::mem::take(&mut tally.report);
        // A row the broker nacked or returned goes alone until it is
        // confirmed: retrying it with the window behind it would send those
        // rows again at every retry (duplicates for every other queue bound).
        if let Some((at, refusal)) = &report.refusal
            && refusal.attributed
            && matches!(
                refusal.reason,
                FailureReason::Nack | FailureReason::Unroutable
            )
            && let Some(row) = rows.get(*at)
        {
            self.link.isolation.suspect(row.id);
        }
        let limit = report.refusal.as_ref().map_or(rows.len(), |(at, _)| *at);
        report.confirmed_at = tally
            .confirmed
            .iter()
            .take(limit)
            .map_while(|at| *at)
            .collect();
        // The spans end (and a refusal is logged) once the batch is let go.
        let confirmed = (!self.spans.is_empty()).then(|| tally.confirmed.clone());
        drop(tally);
        if let Some(confirmed) = confirmed {
            self.end_spans(rows, &confirmed, report.refusal.as_ref());
        }
        report
    }
}

/// Where a batch stands, as `Publishing::follow` last saw it.
struct BatchStanding {
    in_flight: usize,
    refused: bool,
    done: bool,
}
