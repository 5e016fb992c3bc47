//! One confirm-mode channel shared by all of a relay's sweeps, and the task
//! that settles its publisher confirms.
//!
//! One channel, because RabbitMQ's cost per message grows with the number of
//! channels publishing at once: a channel per running sweep multiplied them by
//! `concurrency` (README › Benchmarks).
//!
//! One task settles every confirm, because lapin hands a returned
//! (unroutable) message to whichever confirm the next ack frame resolves
//! first; with a multiple-ack that may be the confirm of a message another
//! sweep published on the same channel, even a later one. So the collector
//! owns every confirm of the channel, settles them in publish (delivery-tag)
//! order, and gives each return to the batch whose row has its `message_id`.
//! A batch is done only when every message published on the channel before
//! its last confirm was seen has been settled as well: RabbitMQ sends a
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

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, SystemTime};

use lapin::message::BasicReturnMessage;
use lapin::options::BasicPublishOptions;
use lapin::types::ShortString;
use lapin::{Channel, Confirmation, ConnectionStatus};
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use super::Session;
use super::isolation::{Isolation, Verdict};
use super::outcome::{self, ConfirmOutcome};
use crate::domain::{BatchReport, FailureReason, Refusal};
use crate::envelope::Message;
use crate::started::Started;

/// The collector waits for the newest of this many unsettled confirms before
/// settling them in order: the broker confirms mostly in order, so this wakes
/// it about once per step rather than once per ack frame.
const STEP: usize = 64;

type Confirm = Started<lapin::Result<Confirmation>>;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A confirm-mode channel whose confirms the collector settles.
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
    /// Every message with a lower sequence number is settled.
    settled: u64,
    /// Batches with all their own confirms settled, and the `settled` count
    /// they wait for.
    waiting: Vec<(u64, Arc<Batch>)>,
    /// Batches that have published and are not done, oldest first: those a
    /// return can still name.
    open: Vec<Arc<Batch>>,
}

impl Ledger {
    /// Every message below `seq` is settled: the batches waiting for that are
    /// done (see `finish`).
    fn settle_to(&mut self, seq: u64) -> Vec<Arc<Batch>> {
        self.settled = seq;
        let (finished, waiting) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|(until, _)| *until <= seq);
        self.waiting = waiting;
        finished.into_iter().map(|(_, batch)| batch).collect()
    }

    /// The batch is done: a return can no longer name its rows.
    fn finish(&mut self, batch: &Arc<Batch>, state: &mut BatchState) {
        state.done = true;
        self.open.retain(|open| !Arc::ptr_eq(open, batch));
    }
}

/// The batch not done whose rows include `row_id`, and its index there; the
/// newest if the row was sent again.
fn owner_of(ledger: &Mutex<Ledger>, row_id: i64) -> Option<(Arc<Batch>, usize)> {
    let open = lock(ledger).open.clone();
    open.into_iter().rev().find_map(|batch| {
        // Rows go out in order from index 0: a row's position among the
        // ids published is its index. (Returns are rare; a scan will do.)
        let index = batch.state().ids.iter().position(|id| *id == row_id)?;
        Some((batch, index))
    })
}

/// A published message, as the collector sees it.
struct Published {
    seq: u64,
    batch: Arc<Batch>,
    index: usize,
    row_id: i64,
    deadline: Instant,
    confirm: Confirm,
}

/// One sweep's batch: what became of its messages so far.
pub(super) struct Batch {
    state: Mutex<BatchState>,
    changed: Notify,
}

pub(super) struct BatchState {
    /// When the broker acked each row (and it was not returned).
    pub confirmed: Vec<Option<SystemTime>>,
    pub report: BatchReport,
    /// The batch's messages published, and settled, so far.
    published: usize,
    settled: usize,
    /// Row ids published, in row order.
    ids: Vec<i64>,
    sending_done: bool,
    /// Registered to wait for the channel's `settled` count.
    waiting: bool,
    /// Every confirm that could carry one of its returns is settled.
    pub done: bool,
}

impl Batch {
    pub fn new(rows: usize) -> Arc<Batch> {
        Arc::new(Batch {
            state: Mutex::new(BatchState {
                confirmed: vec![None; rows],
                report: BatchReport::default(),
                published: 0,
                settled: 0,
                ids: Vec::with_capacity(rows),
                sending_done: false,
                waiting: false,
                done: false,
            }),
            changed: Notify::new(),
        })
    }

    pub fn state(&self) -> MutexGuard<'_, BatchState> {
        lock(&self.state)
    }
}

impl BatchState {
    /// Published but not settled.
    pub fn in_flight(&self) -> usize {
        self.published - self.settled
    }
}

impl ConfirmChannel {
    /// Wraps a confirm-mode `channel` of a connection whose frame size is
    /// `frame_max`, and starts its collector. `session` is told (reset) when a
    /// confirm times out or the connection fails; `isolation` judges the
    /// broker's closing of the channel and keeps its suspects.
    pub fn start(
        channel: Channel,
        frame_max: u32,
        status: ConnectionStatus,
        session: Weak<Session>,
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
            session,
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
    /// panicked): nothing more will be settled.
    pub async fn changed(&self, batch: &Batch) -> bool {
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
    /// `exchange`; the collector settles its confirm.
    pub fn publish(
        &self,
        batch: &Arc<Batch>,
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
            let mut state = batch.state();
            state.published += 1;
            state.ids.push(row_id);
            state.published == 1
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
            // held); settle here so the batch still ends.
            drop(ledger);
            self.retire();
            let mut state = batch.state();
            state.settled += 1;
            state.report.refuse(
                published.index,
                Refusal::new(FailureReason::Other, "the confirm collector stopped"),
            );
        }
    }

    /// The batch will publish nothing more: it is done once its confirms, and
    /// every confirm that could carry one of its returns, are settled.
    pub fn sending_done(&self, batch: &Arc<Batch>) {
        let mut state = batch.state();
        state.sending_done = true;
        if state.settled == state.published {
            wait_for_channel(&self.ledger, batch, &mut state);
        }
        drop(state);
        batch.changed.notify_one();
    }
}

/// A batch whose own confirms are all settled waits for every message
/// published on the channel until now to be settled.
fn wait_for_channel(ledger: &Mutex<Ledger>, batch: &Arc<Batch>, state: &mut BatchState) {
    if state.waiting || state.done {
        return;
    }
    let mut ledger = lock(ledger);
    if ledger.settled >= ledger.published {
        ledger.finish(batch, state);
    } else {
        state.waiting = true;
        let until = ledger.published;
        ledger.waiting.push((until, batch.clone()));
    }
}

/// Settles the confirms of one channel, in publish order.
struct Collector {
    queue: VecDeque<Published>,
    /// The sequence number of the next message to settle.
    next_seq: u64,
    ledger: Arc<Mutex<Ledger>>,
    broken: Arc<AtomicBool>,
    session: Weak<Session>,
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
            // Settle as far as has arrived, including messages published since.
            self.accept_all(&mut submissions);
            self.settle_ready();
        }
    }

    fn accept_all(&mut self, submissions: &mut mpsc::UnboundedReceiver<Published>) {
        while let Ok(published) = submissions.try_recv() {
            self.queue.push_back(published);
        }
    }

    /// Settles, in order, every confirm from the oldest that has arrived (or
    /// whose deadline has passed), then tells the batches concerned.
    fn settle_ready(&mut self) {
        let mut touched: Vec<Arc<Batch>> = Vec::new();
        let now = Instant::now();
        while let Some(oldest) = self.queue.front_mut() {
            let arrived = oldest.confirm.poll_now();
            if !arrived && now < oldest.deadline {
                break;
            }
            let published = self.queue.pop_front().expect("checked above");
            self.next_seq = published.seq + 1;
            self.settle(published, &mut touched);
        }

        // Batches whose own confirms are now all settled start waiting for the
        // channel; those whose wait is over are done.
        for batch in &touched {
            let mut state = batch.state();
            if state.sending_done && state.settled == state.published {
                wait_for_channel(&self.ledger, batch, &mut state);
            }
        }
        let finished = lock(&self.ledger).settle_to(self.next_seq);
        for batch in finished {
            let mut state = batch.state();
            lock(&self.ledger).finish(&batch, &mut state);
            drop(state);
            batch.changed.notify_one();
        }
        for batch in touched {
            batch.changed.notify_one();
        }
    }

    fn settle(&mut self, mut published: Published, touched: &mut Vec<Arc<Batch>>) {
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
                    format!("no confirm from the broker in time: {}", super::BLOCKED),
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
                reset = !self
                    .session
                    .upgrade()
                    .is_some_and(|s| s.connection.status().connected());
                Some(self.judge_failure(&error, published.row_id))
            }
        };
        // Anything but an ack or a nack leaves the channel in doubt.
        let failed = refusal
            .as_ref()
            .is_some_and(|r| r.reason != FailureReason::Nack);
        {
            let mut state = published.batch.state();
            state.settled += 1;
            match refusal {
                Some(refusal) => state.report.refuse(index, refusal),
                None if returned_id_is(&returned, published.row_id) => {}
                None => state.confirmed[index] = Some(SystemTime::now()),
            }
        }
        if failed {
            self.broken.store(true, Ordering::Relaxed);
        }
        if reset {
            // A silent or lost connection: drop it; the supervisor reconnects.
            if let Some(session) = self.session.upgrade() {
                session.broke();
            }
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
        touched: &mut Vec<Arc<Batch>>,
    ) {
        let owner = match returned_id(&message) {
            Some(id) if id == carrier.row_id => Some((carrier.batch.clone(), carrier.index)),
            Some(id) => owner_of(&self.ledger, id),
            // Not one of ours by its id: it can only be the carrier's.
            None => Some((carrier.batch.clone(), carrier.index)),
        };
        match owner {
            Some((batch, index)) => {
                let mut state = batch.state();
                state.confirmed[index] = None;
                state.report.refuse(index, outcome::unroutable(&message));
                drop(state);
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

fn add_touched(touched: &mut Vec<Arc<Batch>>, batch: &Arc<Batch>) {
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

    fn settle_own(ledger: &Mutex<Ledger>, batch: &Arc<Batch>, published: usize) {
        let mut state = batch.state();
        state.published = published;
        state.settled = published;
        state.sending_done = true;
        wait_for_channel(ledger, batch, &mut state);
    }

    /// Records row `id` as the next one `batch` published.
    fn publish_row(ledger: &Mutex<Ledger>, batch: &Arc<Batch>, id: i64) {
        let first = {
            let mut state = batch.state();
            state.ids.push(id);
            state.ids.len() == 1
        };
        if first {
            lock(ledger).open.push(batch.clone());
        }
    }

    fn finish_all(ledger: &Mutex<Ledger>, seq: u64) {
        let finished = lock(ledger).settle_to(seq);
        for batch in finished {
            let mut state = batch.state();
            lock(ledger).finish(&batch, &mut state);
        }
    }

    #[test]
    fn a_batch_is_done_once_everything_published_before_it_settled() {
        let ledger = Mutex::new(Ledger::default());
        lock(&ledger).published = 10;
        lock(&ledger).settle_to(4);
        // Its own confirms are all settled, but messages 4..10 (other
        // batches') may still carry one of its returns.
        let batch = Batch::new(3);
        settle_own(&ledger, &batch, 3);
        assert!(!batch.state().done);
        // Published after it finished: not waited for.
        lock(&ledger).published = 15;
        assert!(lock(&ledger).settle_to(9).is_empty());
        assert!(!batch.state().done);
        let finished = lock(&ledger).settle_to(10);
        assert_eq!(finished.len(), 1);
        assert!(Arc::ptr_eq(&finished[0], &batch));
        assert!(lock(&ledger).waiting.is_empty());
    }

    #[test]
    fn a_batch_is_done_at_once_when_nothing_else_is_in_flight() {
        let ledger = Mutex::new(Ledger::default());
        lock(&ledger).published = 5;
        lock(&ledger).settle_to(5);
        let batch = Batch::new(5);
        settle_own(&ledger, &batch, 5);
        assert!(batch.state().done);
        assert!(lock(&ledger).waiting.is_empty());
    }

    #[test]
    fn returns_can_name_a_batch_only_until_it_is_done() {
        let ledger = Mutex::new(Ledger::default());
        let first = Batch::new(2);
        publish_row(&ledger, &first, 10);
        publish_row(&ledger, &first, 11);
        let second = Batch::new(1);
        publish_row(&ledger, &second, 20);
        lock(&ledger).published = 3;
        settle_own(&ledger, &first, 2);
        assert!(owner_of(&ledger, 10).is_some(), "not done: still named");
        assert_eq!(owner_of(&ledger, 11).map(|(_, index)| index), Some(1));
        finish_all(&ledger, 3);
        assert!(first.state().done);
        assert!(owner_of(&ledger, 10).is_none());
        assert!(owner_of(&ledger, 11).is_none());
        // Done at once (nothing else in flight): forgotten just the same.
        settle_own(&ledger, &second, 1);
        assert!(second.state().done);
        assert!(lock(&ledger).open.is_empty());
    }

    #[test]
    fn a_row_sent_again_stays_named_for_its_new_batch() {
        let ledger = Mutex::new(Ledger::default());
        let abandoned = Batch::new(1);
        publish_row(&ledger, &abandoned, 7);
        let again = Batch::new(1);
        publish_row(&ledger, &again, 7);
        lock(&ledger).published = 2;
        settle_own(&ledger, &abandoned, 1);
        finish_all(&ledger, 2);
        assert!(abandoned.state().done);
        let named = owner_of(&ledger, 7).map(|(b, _)| b);
        assert!(named.is_some_and(|b| Arc::ptr_eq(&b, &again)));
    }

    #[test]
    fn a_batch_waits_once_however_often_it_is_checked() {
        let ledger = Mutex::new(Ledger::default());
        lock(&ledger).published = 8;
        let batch = Batch::new(2);
        settle_own(&ledger, &batch, 2);
        settle_own(&ledger, &batch, 2);
        assert_eq!(lock(&ledger).waiting.len(), 1);
        assert_eq!(lock(&ledger).settle_to(8).len(), 1);
    }
}
