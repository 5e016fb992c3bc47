//! One confirm-mode channel shared by all of a relay's sweeps, and the task
//! that resolves its publisher confirms.
//!
//! One channel, because RabbitMQ's cost per message grows with the number of
//! channels publishing at once: a channel per running sweep multiplied them by
//! `concurrency` (docs/benchmarks.md).
//!
//! One task resolves every confirm, because lapin hands a returned
//! (unroutable) message to whichever confirm the next ack frame resolves
//! first; with a multiple-ack that may be the confirm of a message another
//! sweep published on the same channel, even a later one. So the collector
//! owns every confirm of the channel, resolves them in publish (delivery-tag)
//! order, and gives each return to the batch whose row has its `message_id`.
//! A batch is done only when every message published on the channel before
//! its last confirm was seen has been resolved as well: RabbitMQ sends a
//! message's return before its ack, so by then the return has reached one of
//! those confirms and been routed.
//!
//! A confirm not seen by its deadline while the broker blocks the connection
//! (`connection.blocked`) is a timeout that names no row and keeps the
//! connection: the block explains the silence (see the `publisher` module).
//!
//! When the broker closes the channel, every confirm still open fails alike:
//! the collector judges the broker's reason once (see `isolation`), blames no
//! row for it, and names the rows in flight as suspects to be sent again
//! alone. The connection stays up for a channel-level error.
//!
//! What a confirm means is `outcome`'s to say; the collector adds what the
//! sharing of the channel changes: whose a return is, and whether a timeout
//! or a failure names its row. A silent or lost connection raises the
//! session's `Alarm`: the collector never reaches the session itself.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use lapin::message::BasicReturnMessage;
use lapin::options::BasicPublishOptions;
use lapin::types::ShortString;
use lapin::{Channel, Confirmation, ConnectionStatus};
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use super::alarm::Alarm;
use super::isolation::{Isolation, Verdict};
use super::outcome::{self, BLOCKED, ConfirmOutcome};
use crate::domain::{BatchReport, FailureReason, Refusal};
use crate::envelope::Message;
use crate::started::Started;

/// The collector waits for the newest of this many unresolved confirms before
/// resolving them in order: the broker confirms mostly in order, so this wakes
/// it about once per step rather than once per ack frame.
const STEP: usize = 64;

type Confirm = Started<lapin::Result<Confirmation>>;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A confirm-mode channel whose confirms the collector resolves.
pub(super) struct ConfirmChannel {
    channel: Arc<Channel>,
    ledger: Arc<Mutex<Ledger>>,
    submit: mpsc::UnboundedSender<Published>,
    /// A confirm timed out or failed: the channel is not used for new batches.
    broken: Arc<AtomicBool>,
    collector: tokio::task::JoinHandle<()>,
    /// The connection's negotiated frame size, which every message's
    /// properties must fit (see `envelope`).
    frame_max: u32,
    /// The connection's status: whether the broker blocks it.
    status: ConnectionStatus,
}

/// The channel's counts, shared by the publishing sweeps and the collector.
#[derive(Default)]
struct Ledger {
    /// Messages published so far: the next message's sequence number, which
    /// follows the channel's delivery tags.
    published: u64,
    /// Every message with a lower sequence number is resolved.
    resolved: u64,
    /// Batches with all their own confirms resolved, and the `resolved` count
    /// they wait for.
    waiting: Vec<(u64, Arc<BatchConfirms>)>,
    /// Batches that have published and are not done, oldest first: those a
    /// return can still name.
    open: Vec<Arc<BatchConfirms>>,
}

impl Ledger {
    /// Every message below `seq` is resolved: the batches waiting for that are
    /// done (see `finish`).
    fn resolve_to(&mut self, seq: u64) -> Vec<Arc<BatchConfirms>> {
        self.resolved = seq;
        let (finished, waiting) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|(until, _)| *until <= seq);
        self.waiting = waiting;
        finished.into_iter().map(|(_, batch)| batch).collect()
    }

    /// The batch is done: a return can no longer name its rows.
    fn finish(&mut self, batch: &Arc<BatchConfirms>, tally: &mut ConfirmTally) {
        tally.done = true;
        self.open.retain(|open| !Arc::ptr_eq(open, batch));
    }
}

/// The batch not done whose rows include `row_id`, and its index there; the
/// newest if the row was sent again.
fn owner_of(ledger: &Mutex<Ledger>, row_id: i64) -> Option<(Arc<BatchConfirms>, usize)> {
    let open = lock(ledger).open.clone();
    open.into_iter().rev().find_map(|batch| {
        // Rows go out in order from index 0: a row's position among the
        // ids published is its index. (Returns are rare; a scan will do.)
        let index = batch.tally().ids.iter().position(|id| *id == row_id)?;
        Some((batch, index))
    })
}

/// A published message, as the collector sees it.
struct Published {
    seq: u64,
    batch: Arc<BatchConfirms>,
    index: usize,
    row_id: i64,
    deadline: Instant,
    confirm: Confirm,
}

/// The confirms of one sweep's batch, shared by the sweep and the
/// collector: what became of its messages so far, and a wake-up for the
/// sweep when the collector changed that.
pub(super) struct BatchConfirms {
    tally: Mutex<ConfirmTally>,
    changed: Notify,
}

/// What the collector has resolved of a batch's confirms, and the report
/// they add up to.
pub(super) struct ConfirmTally {
    /// When the broker acked each row (and it was not returned).
    pub confirmed: Vec<Option<SystemTime>>,
    pub report: BatchReport,
    /// The batch's messages published, and resolved, so far.
    published: usize,
    resolved: usize,
    /// Row ids published, in row order.
    ids: Vec<i64>,
    sending_done: bool,
    /// Registered to wait for the channel's `resolved` count.
    waiting: bool,
    /// Every confirm that could carry one of its returns is resolved.
    pub done: bool,
}

impl BatchConfirms {
    pub fn new(rows: usize) -> Arc<BatchConfirms> {
        Arc::new(BatchConfirms {
            tally: Mutex::new(ConfirmTally {
                confirmed: vec![None; rows],
                report: BatchReport::default(),
                published: 0,
                resolved: 0,
                ids: Vec::with_capacity(rows),
                sending_done: false,
                waiting: false,
                done: false,
            }),
            changed: Notify::new(),
        })
    }

    pub fn tally(&self) -> MutexGuard<'_, ConfirmTally> {
        lock(&self.tally)
    }

    /// The batch's run grew to `rows` (see `Publishing::extend`).
    pub fn grow(&self, rows: usize) {
        let mut tally = self.tally();
        if rows > tally.confirmed.len() {
            tally.confirmed.resize(rows, None);
        }
    }
}

impl ConfirmTally {
    /// Published but not resolved.
    pub fn in_flight(&self) -> usize {
        self.published - self.resolved
    }
}

impl ConfirmChannel {
    /// Wraps a confirm-mode `channel` of a connection whose frame size is
    /// `frame_max`, and starts its collector. `alarm` is raised (the
    /// connection is to be dropped) when a confirm times out or the
    /// connection fails; `isolation` judges the broker's closing of the
    /// channel and keeps its suspects.
    pub fn start(
        channel: Channel,
        frame_max: u32,
        status: ConnectionStatus,
        alarm: Alarm,
        isolation: Arc<Isolation>,
    ) -> Arc<ConfirmChannel> {
        let (submit, submissions) = mpsc::unbounded_channel();
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let broken = Arc::new(AtomicBool::new(false));
        let collector = Collector {
            queue: VecDeque::new(),
            next_seq: 0,
            ledger: ledger.clone(),
            broken: broken.clone(),
            alarm,
            isolation,
            status: status.clone(),
            closed_by_broker: false,
        };
        let collector = tokio::spawn(collector.run(submissions));
        Arc::new(ConfirmChannel {
            channel: Arc::new(channel),
            ledger,
            submit,
            broken,
            collector,
            frame_max,
            status,
        })
    }

    pub fn frame_max(&self) -> u32 {
        self.frame_max
    }

    /// The broker blocks the connection: nothing is to be published on it
    /// (lapin would hold it until the unblock).
    pub fn is_blocked(&self) -> bool {
        self.status.blocked()
    }

    /// Open, and no confirm on it has timed out or failed.
    pub fn is_usable(&self) -> bool {
        !self.broken.load(Ordering::Relaxed) && self.channel.status().connected()
    }

    /// Waits until the collector changes `batch`. `false` if the collector
    /// has stopped (it only does once the channel is dropped, or if it
    /// panicked): nothing more will be resolved.
    pub async fn changed(&self, batch: &BatchConfirms) -> bool {
        loop {
            let changed = tokio::time::timeout(COLLECTOR_CHECK, batch.changed.notified()).await;
            if changed.is_ok() {
                return true;
            }
            if self.collector.is_finished() {
                return false;
            }
        }
    }

    /// New batches are to use a new channel.
    pub fn retire(&self) {
        self.broken.store(true, Ordering::Relaxed);
    }

    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Publishes `message`, the row `row_id` at `index` of `batch`, to
    /// `exchange`; the collector resolves its confirm.
    pub fn publish(
        &self,
        batch: &Arc<BatchConfirms>,
        (index, row_id): (usize, i64),
        exchange: ShortString,
        message: Message,
        deadline: Instant,
    ) {
        let channel = self.channel.clone();
        let Message {
            routing_key,
            properties,
            body,
        } = message;
        // Shared with the row, not copied: the collector outlives the
        // sweep's borrow of its rows.
        let send = async move {
            let options = BasicPublishOptions {
                mandatory: true,
                immediate: false,
            };
            channel
                .basic_publish(exchange, routing_key, options, &body, properties)
                .await?
                .await
        };
        let first = {
            let mut tally = batch.tally();
            tally.published += 1;
            tally.ids.push(row_id);
            tally.published == 1
        };
        // Started, the send takes the next delivery tag and queues the
        // frames. Under the ledger's lock, so sequence numbers follow
        // delivery tags whichever thread publishes. It leaves a no-op waker
        // behind: only the confirm the collector waits for registers a real
        // one.
        let mut ledger = lock(&self.ledger);
        let confirm = Started::new(send);
        let seq = ledger.published;
        ledger.published += 1;
        if first {
            ledger.open.push(batch.clone());
        }
        let published = Published {
            seq,
            batch: batch.clone(),
            index,
            row_id,
            deadline,
            confirm,
        };
        if let Err(mpsc::error::SendError(published)) = self.submit.send(published) {
            // The collector is gone (it never stops while the channel is
            // held); resolve here so the batch still ends.
            drop(ledger);
            self.retire();
            let mut tally = batch.tally();
            tally.resolved += 1;
            tally.report.refuse(
                published.index,
                Refusal::new(FailureReason::Other, "the confirm collector stopped"),
            );
        }
    }

    /// The batch will publish nothing more: it is done once its confirms, and
    /// every confirm that could carry one of its returns, are resolved.
    pub fn sending_done(&self, batch: &Arc<BatchConfirms>) {
        let mut tally = batch.tally();
        tally.sending_done = true;
        if tally.resolved == tally.published {
            wait_for_channel(&self.ledger, batch, &mut tally);
        }
        drop(tally);
        batch.changed.notify_one();
    }
}

/// A batch whose own confirms are all resolved waits for every message
/// published on the channel until now to be resolved.
fn wait_for_channel(ledger: &Mutex<Ledger>, batch: &Arc<BatchConfirms>, tally: &mut ConfirmTally) {
    if tally.waiting || tally.done {
        return;
    }
    let mut ledger = lock(ledger);
    if ledger.resolved >= ledger.published {
        ledger.finish(batch, tally);
    } else {
        tally.waiting = true;
        let until = ledger.published;
        ledger.waiting.push((until, batch.clone()));
    }
}

/// Resolves the confirms of one channel, in publish order.
struct Collector {
    queue: VecDeque<Published>,
    /// The sequence number of the next message to resolve.
    next_seq: u64,
    ledger: Arc<Mutex<Ledger>>,
    broken: Arc<AtomicBool>,
    /// The session's: raised to have a silent or lost connection dropped.
    alarm: Alarm,
    isolation: Arc<Isolation>,
    /// The connection's status: whether the broker blocks it.
    status: ConnectionStatus,
    /// The broker closed the channel over a message or the configuration
    /// (every confirm still open fails with it: it is logged once, and what
    /// fails on the channel after it is no row's doing).
    closed_by_broker: bool,
}

impl Collector {
    async fn run(mut self, mut submissions: mpsc::UnboundedReceiver<Published>) {
        loop {
            if self.queue.is_empty() {
                match submissions.recv().await {
                    Some(published) => self.queue.push_back(published),
                    None => return,
                }
            }
            self.accept_all(&mut submissions);
            let deadline = self.queue[0].deadline;
            let step_end = self.queue.len().min(STEP) - 1;
            let target = if self.queue[step_end].confirm.is_done() {
                0
            } else {
                step_end
            };
            let _ = tokio::time::timeout_at(deadline, &mut self.queue[target].confirm).await;
            // Resolve as far as has arrived, including messages published since.
            self.accept_all(&mut submissions);
            self.resolve_ready();
        }
    }

    fn accept_all(&mut self, submissions: &mut mpsc::UnboundedReceiver<Published>) {
        while let Ok(published) = submissions.try_recv() {
            self.queue.push_back(published);
        }
    }

    /// Resolves, in order, every confirm from the oldest that has arrived (or
    /// whose deadline has passed), then tells the batches concerned.
    fn resolve_ready(&mut self) {
        let mut touched: Vec<Arc<BatchConfirms>> = Vec::new();
        let now = Instant::now();
        while let Some(oldest) = self.queue.front_mut() {
            let arrived = oldest.confirm.poll_now();
            if !arrived && now < oldest.deadline {
                break;
            }
            let published = self.queue.pop_front().expect("checked above");
            self.next_seq = published.seq + 1;
            self.resolve(published, &mut touched);
        }

        // Batches whose own confirms are now all resolved start waiting for the
        // channel; those whose wait is over are done.
        for batch in &touched {
            let mut tally = batch.tally();
            if tally.sending_done && tally.resolved == tally.published {
                wait_for_channel(&self.ledger, batch, &mut tally);
            }
        }
        let finished = lock(&self.ledger).resolve_to(self.next_seq);
        for batch in finished {
            let mut tally = batch.tally();
            lock(&self.ledger).finish(&batch, &mut tally);
            drop(tally);
            batch.changed.notify_one();
        }
        for batch in touched {
            batch.changed.notify_one();
        }
    }

    fn resolve(&mut self, mut published: Published, touched: &mut Vec<Arc<BatchConfirms>>) {
        let index = published.index;
        let mut returned = None;
        let mut reset = false;
        let refusal = match ConfirmOutcome::of(published.confirm.take()) {
            ConfirmOutcome::Delivered => None,
            ConfirmOutcome::Returned(message) => {
                returned = Some(message);
                None
            }
            ConfirmOutcome::Refused(refusal, message) => {
                returned = message;
                Some(refusal)
            }
            ConfirmOutcome::TimedOut if self.status.blocked() => {
                // The broker blocks the connection: it is kept, and the row
                // is not blamed. (The channel is retired all the same: the
                // confirm may still come, after the unblock.)
                Some(Refusal::shared(
                    FailureReason::Timeout,
                    format!("no confirm from the broker in time: {BLOCKED}"),
                ))
            }
            ConfirmOutcome::TimedOut => {
                reset = true;
                Some(self.not_the_rows(
                    FailureReason::Timeout,
                    "no confirm from the broker in time".into(),
                ))
            }
            ConfirmOutcome::Failed(error) => {
                reset = !self.status.connected();
                Some(self.judge_failure(&error, published.row_id))
            }
        };
        // Anything but an ack or a nack leaves the channel in doubt.
        let failed = refusal
            .as_ref()
            .is_some_and(|r| r.reason != FailureReason::Nack);
        {
            let mut tally = published.batch.tally();
            tally.resolved += 1;
            match refusal {
                Some(refusal) => tally.report.refuse(index, refusal),
                None if returned_id_is(&returned, published.row_id) => {}
                None => tally.confirmed[index] = Some(SystemTime::now()),
            }
        }
        if failed {
            self.broken.store(true, Ordering::Relaxed);
        }
        if reset {
            // A silent or lost connection: drop it; the supervisor reconnects.
            self.alarm.raise();
        }
        add_touched(touched, &published.batch);
        if let Some(message) = returned {
            self.route_return(message, &published, touched);
        }
    }

    /// The refusal of row `row_id`, in flight on the channel when it failed
    /// with `error`: the broker's reason is judged (see `isolation`), and
    /// logged once per channel.
    fn judge_failure(&mut self, error: &lapin::Error, row_id: i64) -> Refusal {
        match self.isolation.judge(error) {
            Verdict::Refused(_, detail) => {
                // Which message the broker refused is not known:
                // every one in flight goes alone next (`isolation`).
                self.isolation.suspect(row_id);
                self.tell_closed(|| {
                    tracing::warn!(
                        error = %detail,
                        "the broker closed the shared channel over a message; \
                         the rows in flight are sent again one at a time to find it"
                    );
                });
                Refusal::shared(
                    FailureReason::Connection,
                    format!(
                        "the broker closed the shared channel ({detail}) while this \
                         row was in flight; the rows in flight go again one at a time"
                    ),
                )
            }
            Verdict::Configuration(detail) => {
                let isolation = self.isolation.clone();
                self.tell_closed(|| isolation.log_configuration_problem(&detail));
                self.isolation.configuration_problem(&detail)
            }
            Verdict::Connection(detail) => self.not_the_rows(FailureReason::Connection, detail),
        }
    }

    /// A timeout or a lost connection, not the row's doing: written on its
    /// row only if no other batch was in flight beside it and the broker had
    /// not closed the channel over another message (then it names no other
    /// row's doing; see `Refusal::attributed`).
    fn not_the_rows(&self, reason: FailureReason, detail: String) -> Refusal {
        if !self.closed_by_broker && lock(&self.ledger).open.len() == 1 {
            Refusal::new(reason, detail)
        } else {
            Refusal::shared(reason, detail)
        }
    }

    /// Runs `tell` the first time the broker's closing of the channel is seen.
    fn tell_closed(&mut self, tell: impl FnOnce()) {
        if !self.closed_by_broker {
            self.closed_by_broker = true;
            tell();
        }
    }

    /// Refuses the row a returned message names, in whichever batch holds it.
    fn route_return(
        &self,
        message: BasicReturnMessage,
        carrier: &Published,
        touched: &mut Vec<Arc<BatchConfirms>>,
    ) {
        let owner = match returned_id(&message) {
            Some(id) if id == carrier.row_id => Some((carrier.batch.clone(), carrier.index)),
            Some(id) => owner_of(&self.ledger, id),
            // Not one of ours by its id: it can only be the carrier's.
            None => Some((carrier.batch.clone(), carrier.index)),
        };
        match owner {
            Some((batch, index)) => {
                let mut tally = batch.tally();
                tally.confirmed[index] = None;
                tally.report.refuse(index, outcome::unroutable(&message));
                drop(tally);
                add_touched(touched, &batch);
            }
            None => tracing::error!(
                message_id = ?returned_id(&message),
                "a returned message names no row in flight; its row may have been marked published"
            ),
        }
    }
}

fn returned_id(message: &BasicReturnMessage) -> Option<i64> {
    message
        .delivery
        .properties
        .message_id()
        .as_ref()
        .and_then(|id| id.as_str().parse().ok())
}

/// The returned message (if any) is the row's own.
fn returned_id_is(message: &Option<BasicReturnMessage>, row_id: i64) -> bool {
    message
        .as_ref()
        .is_some_and(|m| returned_id(m) == Some(row_id))
}

fn add_touched(touched: &mut Vec<Arc<BatchConfirms>>, batch: &Arc<BatchConfirms>) {
    if !touched.iter().any(|b| Arc::ptr_eq(b, batch)) {
        touched.push(batch.clone());
    }
}

/// How often a batch waiting for the collector checks that it still runs.
/// (The collector enforces every confirm's deadline; this only guards against
/// it having stopped.)
const COLLECTOR_CHECK: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve_own(ledger: &Mutex<Ledger>, batch: &Arc<BatchConfirms>, published: usize) {
        let mut tally = batch.tally();
        tally.published = published;
        tally.resolved = published;
        tally.sending_done = true;
        wait_for_channel(ledger, batch, &mut tally);
    }

    /// Records row `id` as the next one `batch` published.
    fn publish_row(ledger: &Mutex<Ledger>, batch: &Arc<BatchConfirms>, id: i64) {
        let first = {
            let mut tally = batch.tally();
            tally.ids.push(id);
            tally.ids.len() == 1
        };
        if first {
            lock(ledger).open.push(batch.clone());
        }
    }

    fn finish_all(ledger: &Mutex<Ledger>, seq: u64) {
        let finished = lock(ledger).resolve_to(seq);
        for batch in finished {
            let mut tally = batch.tally();
            lock(ledger).finish(&batch, &mut tally);
        }
    }

    #[test]
    fn a_batch_is_done_once_everything_published_before_it_resolved() {
        let ledger = Mutex::new(Ledger::default());
        lock(&ledger).published = 10;
        lock(&ledger).resolve_to(4);
        // Its own confirms are all resolved, but messages 4..10 (other
        // batches') may still carry one of its returns.
        let batch = BatchConfirms::new(3);
        resolve_own(&ledger, &batch, 3);
        assert!(!batch.tally().done);
        // Published after it finished: not waited for.
        lock(&ledger).published = 15;
        assert!(lock(&ledger).resolve_to(9).is_empty());
        assert!(!batch.tally().done);
        let finished = lock(&ledger).resolve_to(10);
        assert_eq!(finished.len(), 1);
        assert!(Arc::ptr_eq(&finished[0], &batch));
        assert!(lock(&ledger).waiting.is_empty());
    }

    #[test]
    fn a_batch_is_done_at_once_when_nothing_else_is_in_flight() {
        let ledger = Mutex::new(Ledger::default());
        lock(&ledger).published = 5;
        lock(&ledger).resolve_to(5);
        let batch = BatchConfirms::new(5);
        resolve_own(&ledger, &batch, 5);
        assert!(batch.tally().done);
        assert!(lock(&ledger).waiting.is_empty());
    }

    #[test]
    fn returns_can_name_a_batch_only_until_it_is_done() {
        let ledger = Mutex::new(Ledger::default());
        let first = BatchConfirms::new(2);
        publish_row(&ledger, &first, 10);
        publish_row(&ledger, &first, 11);
        let second = BatchConfirms::new(1);
        publish_row(&ledger, &second, 20);
        lock(&ledger).published = 3;
        resolve_own(&ledger, &first, 2);
        assert!(owner_of(&ledger, 10).is_some(), "not done: still named");
        assert_eq!(owner_of(&ledger, 11).map(|(_, index)| index), Some(1));
        finish_all(&ledger, 3);
        assert!(first.tally().done);
        assert!(owner_of(&ledger, 10).is_none());
        assert!(owner_of(&ledger, 11).is_none());
        // Done at once (nothing else in flight): forgotten just the same.
        resolve_own(&ledger, &second, 1);
        assert!(second.tally().done);
        assert!(lock(&ledger).open.is_empty());
    }

    #[test]
    fn a_row_sent_again_stays_named_for_its_new_batch() {
        let ledger = Mutex::new(Ledger::default());
        let abandoned = BatchConfirms::new(1);
        publish_row(&ledger, &abandoned, 7);
        let again = BatchConfirms::new(1);
        publish_row(&ledger, &again, 7);
        lock(&ledger).published = 2;
        resolve_own(&ledger, &abandoned, 1);
        finish_all(&ledger, 2);
        assert!(abandoned.tally().done);
        let named = owner_of(&ledger, 7).map(|(b, _)| b);
        assert!(named.is_some_and(|b| Arc::ptr_eq(&b, &again)));
    }

    #[test]
    fn a_batch_waits_once_however_often_it_is_checked() {
        let ledger = Mutex::new(Ledger::default());
        lock(&ledger).published = 8;
        let batch = BatchConfirms::new(2);
        resolve_own(&ledger, &batch, 2);
        resolve_own(&ledger, &batch, 2);
        assert_eq!(lock(&ledger).waiting.len(), 1);
        assert_eq!(lock(&ledger).resolve_to(8).len(), 1);
    }
}
