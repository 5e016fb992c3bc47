//! What a claim sends ahead of its commit on its connection: the marks of
//! the confirmed prefix ([`Claim::mark_ahead`]) and the read of the next
//! batch ([`Claim::read_ahead`]), and the waits for their answers.

use std::task::{Context, Poll};

use super::Claim;
use crate::domain::OutboxRow;
use crate::started::Started;
use crate::store::StoreError;
use crate::store::query::{deadline, mark_ids};
use crate::store::read::ReadRows;

/// An UPDATE marking rows published ahead of the commit: sent when first
/// polled, its outcome read before the commit.
type MarkAhead = Started<Result<u64, StoreError>>;

/// The read of the next batch, sent ahead in the claim's transaction while
/// the current batch is published.
type ReadAhead = Started<Result<ReadRows, StoreError>>;

/// What [`Claim::answered`] waits for.
#[derive(Clone, Copy)]
enum Answers {
    /// Every mark and the read.
    All,
    /// The read ahead (and so every mark sent before it).
    ReadAhead,
}

/// What a claim has sent ahead of its commit on its connection: marks, and
/// the read of its next batch. Their answers come back in the order they
/// were sent, so whoever waits for one polls them all.
#[derive(Default)]
pub(super) struct MarksAhead {
    /// The claim's rows, from its first, that the marks cover.
    pub(super) rows: usize,
    /// The rows the marks answered so far changed, all told: short of
    /// `rows` once they are all answered when the table kept some marks
    /// from taking (see [`Claim::settle`]).
    pub(super) marked: u64,
    pub(super) sent: Vec<MarkAhead>,
    pub(super) next: Option<ReadAhead>,
    /// The read and the mark were prepared, by the claim's first read ahead
    /// (see `Statements::prepare`): the statements sent after it run them.
    pub(super) prepared: bool,
}

impl MarksAhead {
    /// Whether a read ahead is still under way.
    fn reading(&self) -> bool {
        self.next.as_ref().is_some_and(|next| !next.is_done())
    }

    /// Polls everything sent; ready when every mark has its answer and the
    /// read (if any) is done.
    fn poll_all(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let mut done = true;
        for mark in &mut self.sent {
            done &= mark.poll_done(cx).is_ready();
        }
        if let Some(next) = &mut self.next {
            done &= next.poll_done(cx).is_ready();
        }
        if done { Poll::Ready(()) } else { Poll::Pending }
    }

    /// Polls everything sent; ready once `which` is answered.
    fn poll_answered(&mut self, which: Answers, cx: &mut Context<'_>) -> Poll<()> {
        let all = self.poll_all(cx);
        match which {
            Answers::All => all,
            // The read's answer comes after those of the marks sent before
            // it.
            Answers::ReadAhead if self.reading() => Poll::Pending,
            Answers::ReadAhead => Poll::Ready(()),
        }
    }

    /// Polls everything sent with a waker that does nothing, so answers
    /// that arrived are taken off the connection.
    fn poll_now(&mut self) {
        for mark in &mut self.sent {
            mark.poll_now();
        }
        if let Some(next) = &mut self.next {
            next.poll_now();
        }
    }

    /// The ids of the claim's first `prefix` rows that no mark sent covers
    /// yet, now noted as covered; `None`, and nothing noted, when `prefix`
    /// is behind what the marks cover or past the batch.
    fn cover(&mut self, rows: &[OutboxRow], prefix: usize) -> Option<Vec<i64>> {
        let ids = rows
            .get(self.rows..prefix)?
            .iter()
            .map(|row| row.id)
            .collect();
        self.rows = prefix;
        Some(ids)
    }

    /// Takes in the answers that came: the rows the answered marks marked,
    /// or the first error among them. A failed read ahead has aborted the
    /// transaction too (its COMMIT would only roll back): its error ends the
    /// claim. A batch read is left for [`Claim::append_ahead`].
    fn take_answers(&mut self) -> Result<u64, StoreError> {
        let mut marked = 0;
        let mut first_error = None;
        self.sent.retain_mut(|mark| match mark.take() {
            Some(Ok(rows)) => {
                marked += rows;
                false
            }
            Some(Err(error)) => {
                first_error.get_or_insert(error);
                false
            }
            None => true,
        });
        self.marked += marked;
        if let Some(error) = first_error {
            return Err(error);
        }
        if let Some(next) = &mut self.next
            && matches!(next.output(), Some(Err(_)))
            && let Some(Err(error)) = next.take()
        {
            self.next = None;
            return Err(error);
        }
        Ok(marked)
    }

    /// What the settlement of a claim's rows (`rows`) whose first `confirmed` rows
    /// were confirmed has left to do: the ids to mark (confirmed, not marked
    /// ahead) and the ids to unmark (marked ahead past the confirmed
    /// prefix).
    pub(super) fn settlement(&self, rows: &[OutboxRow], confirmed: usize) -> (Vec<i64>, Vec<i64>) {
        let ids = |from: usize, to: usize| -> Vec<i64> {
            rows[from.min(to)..to].iter().map(|r| r.id).collect()
        };
        (ids(self.rows, confirmed), ids(confirmed, self.rows))
    }
}

impl Claim {
    /// Sends the UPDATE marking the claim's first `prefix` rows published
    /// (those not marked yet), inside the claim's transaction, while the rest
    /// of the batch is still being confirmed; the marks become visible only at
    /// the commit, and [`Claim::settle`] undoes any that end up past the
    /// confirmed prefix.
    pub fn mark_ahead(&self, prefix: usize) {
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        let Some(ids) = ahead.cover(&self.rows, prefix) else {
            return;
        };
        let conn = self.conn.clone().expect("a claim holds its connection");
        let store = self.store.clone();
        let prepared = ahead.prepared;
        // Started, the statement is sent. The marks sent before are polled
        // too: the driver hands a statement's answer over only once the one
        // before it has taken its own, so answers left waiting would hold up
        // the connection.
        ahead.sent.push(Started::new(async move {
            mark_ids(&conn, store.statements(), prepared, &ids).await
        }));
        ahead.poll_now();
    }

    /// Sends the read of the batch after the claim's last (the tenant's
    /// pending rows after its last id, as many as `budget` bytes hold) in
    /// the claim's transaction, so that it is done while the rows before it
    /// are published; see [`Claim::reading_ahead`] and
    /// [`Claim::append_ahead`].
    pub fn read_ahead(&self, budget: usize) {
        let Some(after) = self.rows.last().map(|row| row.id) else {
            return;
        };
        let conn = self.conn.clone().expect("a claim holds its connection");
        let (store, tenant) = (self.store.clone(), self.tenant.clone());
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        let prepare = !std::mem::replace(&mut ahead.prepared, true);
        // Started, the statements are sent: the first read ahead prepares
        // the read and the mark, and runs the read, in one round trip.
        let read = Started::new(async move {
            let prepared = async {
                if prepare {
                    conn.batch_execute(&store.statements().prepare).await?;
                }
                Ok::<_, tokio_postgres::Error>(())
            };
            let read = store.read_batch(&conn, true, &tenant, after, budget);
            let (prepared, read) = tokio::join!(prepared, read);
            prepared?;
            read
        });
        ahead.next = Some(read);
        ahead.poll_now();
    }

    /// Whether a read ahead is still under way.
    pub fn reading_ahead(&self) -> bool {
        self.ahead
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reading()
    }

    /// Drives what was sent ahead (the read, and the marks it holds up)
    /// until the read is done; the publishing loop awaits it beside the
    /// broker's confirms.
    pub async fn read_ahead_progress(&self) {
        std::future::poll_fn(|cx| {
            let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            let _ = ahead.poll_all(cx);
            if ahead.reading() {
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await
    }

    /// Once the read ahead is answered, appends the batch it read to the
    /// claim's rows: the claim's batches go out as one run, and the marks
    /// keep counting from its first row. `Ok(false)`, and the claim
    /// unchanged, when there is no batch to go on with: none was read, it is
    /// empty, or its first row was too large for the read's share (its own
    /// sweep reads it). A failed read or mark has aborted the transaction:
    /// its error.
    pub async fn append_ahead(&mut self) -> Result<bool, StoreError> {
        let answered = self.answered(Answers::ReadAhead).await;
        self.store.dropping_idle_if_read_only(answered)?;
        let ahead = self.ahead.get_mut().unwrap_or_else(|e| e.into_inner());
        let Some(mut next) = ahead.next.take() else {
            return Ok(false);
        };
        let batch = next.take().expect("the read ahead is done once answered")?;
        if !batch.can_follow() {
            return Ok(false);
        }
        self.batch_start = self.rows.len();
        self.rows.extend(batch.rows);
        self.cut_by_budget = batch.cut_by_budget;
        self.largest_read = self.largest_read.max(batch.largest_read);
        Ok(true)
    }

    /// Waits for the marks and the read sent ahead, within
    /// [`QUERY_TIMEOUT`](crate::store::QUERY_TIMEOUT) of being asked (not of being sent: a long batch may be sending for
    /// longer); the rows the marks marked. A failed mark or read has aborted
    /// the transaction: the claim can only be dropped.
    pub async fn marks_ahead_done(&self) -> Result<u64, StoreError> {
        let done = self.answered(Answers::All).await;
        self.store.dropping_idle_if_read_only(done)
    }

    /// Waits for `which` of what was sent ahead to be answered; the rows the
    /// marks answered so far marked, or the first error among them or the
    /// read's.
    async fn answered(&self, which: Answers) -> Result<u64, StoreError> {
        // Polled where they are: the claim must always know every holder of
        // its connection (see `Drop`), even if this wait is abandoned.
        let answered = std::future::poll_fn(|cx| {
            let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            ahead.poll_answered(which, cx).map(Ok)
        });
        deadline("marking ahead", answered).await?;
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        ahead.take_answers()
    }
}

#[cfg(test)]
mod tests {
    use std::task::Waker;

    use time::OffsetDateTime;

    use super::*;
    use crate::domain::Payload;

    fn rows(ids: std::ops::RangeInclusive<i64>) -> Vec<OutboxRow> {
        ids.map(|id| OutboxRow {
            id,
            kind: "k".into(),
            subject_id: "s".into(),
            payload: Payload::Tombstone,
            headers: None,
            occurred_at: OffsetDateTime::UNIX_EPOCH,
            defect: None,
            cost: 0,
        })
        .collect()
    }

    fn answered(rows: u64) -> MarkAhead {
        Started::new(async move { Ok(rows) })
    }

    fn failed(why: &str) -> MarkAhead {
        let error = StoreError::Sequence(why.into());
        Started::new(async move { Err(error) })
    }

    fn waiting<T: Send + 'static>() -> Started<Result<T, StoreError>> {
        Started::new(std::future::pending())
    }

    fn poll(ahead: &mut MarksAhead, which: Answers) -> Poll<()> {
        ahead.poll_answered(which, &mut Context::from_waker(Waker::noop()))
    }

    #[test]
    fn each_mark_covers_the_rows_no_mark_covered_before() {
        let batch = rows(1..=4);
        let mut ahead = MarksAhead::default();
        assert_eq!(ahead.cover(&batch, 2), Some(vec![1, 2]));
        assert_eq!(ahead.cover(&batch, 2), Some(vec![]), "nothing new");
        assert_eq!(ahead.cover(&batch, 1), None, "behind the marks");
        assert_eq!(ahead.cover(&batch, 5), None, "past the batch");
        assert_eq!(ahead.rows, 2, "a mark refused notes nothing");
        assert_eq!(ahead.cover(&batch, 4), Some(vec![3, 4]));
        assert_eq!(ahead.rows, 4);
    }

    #[test]
    fn a_settlement_marks_the_confirmed_rest_and_undoes_marks_past_the_confirmed_prefix() {
        let batch = rows(1..=5);
        let mut ahead = MarksAhead::default();
        assert_eq!(ahead.settlement(&batch, 3), (vec![1, 2, 3], vec![]));
        ahead.cover(&batch, 2);
        assert_eq!(ahead.settlement(&batch, 5), (vec![3, 4, 5], vec![]));
        assert_eq!(ahead.settlement(&batch, 2), (vec![], vec![]));
        ahead.cover(&batch, 4);
        assert_eq!(
            ahead.settlement(&batch, 1),
            (vec![], vec![2, 3, 4]),
            "a refusal at the second row: the marks sent past it are undone"
        );
        assert_eq!(ahead.settlement(&batch, 0), (vec![], vec![1, 2, 3, 4]));
    }

    #[test]
    fn the_answers_taken_add_up_the_rows_marked_and_keep_the_marks_still_waiting() {
        let mut ahead = MarksAhead {
            rows: 6,
            sent: vec![answered(2), waiting(), answered(3)],
            next: None,
            prepared: false,
            marked: 0,
        };
        assert_eq!(ahead.take_answers().unwrap(), 5);
        assert_eq!(ahead.sent.len(), 1, "the mark still waiting stays");
        assert_eq!(ahead.take_answers().unwrap(), 0);
        assert_eq!(ahead.marked, 5, "every answer taken counts, all told");
    }

    #[test]
    fn a_failed_mark_fails_the_wait_with_the_first_error() {
        let mut ahead = MarksAhead {
            rows: 6,
            sent: vec![answered(2), failed("first"), failed("second")],
            next: None,
            prepared: false,
            marked: 0,
        };
        let error = ahead.take_answers().unwrap_err();
        assert_eq!(error.to_string(), "first");
        assert!(ahead.sent.is_empty(), "every answer taken");
    }

    #[test]
    fn a_failed_read_ahead_fails_the_wait_and_a_read_batch_is_left_to_be_appended() {
        let mut ahead = MarksAhead {
            rows: 0,
            sent: vec![answered(1)],
            next: Some(Started::new(async {
                Err(StoreError::Sequence("read".into()))
            })),
            prepared: false,
            marked: 0,
        };
        assert_eq!(ahead.take_answers().unwrap_err().to_string(), "read");
        assert!(ahead.next.is_none());

        let mut ahead = MarksAhead {
            rows: 0,
            sent: vec![answered(1)],
            next: Some(Started::new(async { Ok(ReadRows::default()) })),
            prepared: false,
            marked: 0,
        };
        assert_eq!(ahead.take_answers().unwrap(), 1);
        let next = ahead.next.as_mut().expect("kept to be appended");
        assert!(matches!(next.take(), Some(Ok(_))));
    }

    #[test]
    fn a_wait_for_the_read_ahead_needs_its_answer_and_a_wait_for_all_every_answer() {
        let mut ahead = MarksAhead::default();
        assert!(poll(&mut ahead, Answers::All).is_ready(), "nothing sent");
        assert!(poll(&mut ahead, Answers::ReadAhead).is_ready(), "no read");

        ahead.sent.push(waiting());
        ahead.next = Some(Started::new(async { Ok(ReadRows::default()) }));
        assert!(poll(&mut ahead, Answers::ReadAhead).is_ready());
        assert!(poll(&mut ahead, Answers::All).is_pending(), "a mark waits");

        ahead.sent.clear();
        ahead.next = Some(waiting());
        assert!(ahead.reading());
        assert!(poll(&mut ahead, Answers::ReadAhead).is_pending());
        assert!(poll(&mut ahead, Answers::All).is_pending());
    }
}
