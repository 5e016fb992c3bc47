//! The relay-wide budget of row bytes read and in flight
//! (`max_bytes_in_flight`). A sweep reserves its share before it reads a
//! batch, keeps what the batch costs until the batch is settled, and gives
//! the rest back at once; a row larger than a share waits until the budget
//! has room for it alone. However large or many the rows, the relay holds no
//! more than the budget of them (see `domain::OutboxRow::cost`).
//!
//! A row costs what it holds at most, all at once, from its read to its
//! confirm (`read_batch.sql` sums it; measured with the default allocator):
//!
//! - its payload [`PAYLOAD_COPIES`] times: the database connection's read
//!   buffer it is left in (which grows by doubling, so up to twice the
//!   row), and the AMQP client's body frames;
//! - its `headers` [`HEADERS_COPIES`] times their JSON text: as read, the
//!   relay's copy, and the AMQP client's header table until it is written
//!   (a table of small keys takes 9 to 16 times its JSON);
//! - its `subject_id` [`SUBJECT_COPIES`] times: as read, the relay's copy,
//!   and the message's `outbox-subject-id` header;
//! - its `kind`, and [`ROW_OVERHEAD`] for the rest.
//!
//! A connection whose read buffer grew past a large row is closed when its
//! claim ends, not pooled (`store`), so no buffer outlives its rows.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The unit the budget is counted in: a permit is this many bytes.
const UNIT: usize = 1024;

/// Copies of a payload held at once (see the module's header).
pub const PAYLOAD_COPIES: usize = 3;
/// Bytes held per byte of a row's `headers` JSON (see the module's header).
pub const HEADERS_COPIES: usize = 18;
/// Copies of a `subject_id` held at once.
pub const SUBJECT_COPIES: usize = 3;
/// What every row costs besides its fields.
pub const ROW_OVERHEAD: usize = UNIT;

/// What besides its payload one row may cost at most: a `subject_id` and
/// `headers` as long as the batch read takes them (`store::FIELD_LIMIT`,
/// 512 KiB each), a `kind` of 255 bytes, and the per-row overhead.
pub const ROW_FIELDS_MAX: usize =
    (SUBJECT_COPIES + HEADERS_COPIES) * (512 << 10) + 255 + ROW_OVERHEAD;

/// The least `max_bytes_in_flight` for a `max_payload_bytes`: one row of
/// the largest payload always fits.
pub fn least_for(max_payload_bytes: usize) -> usize {
    max_payload_bytes
        .saturating_mul(PAYLOAD_COPIES)
        .saturating_add(ROW_FIELDS_MAX)
}

/// The relay's byte budget, shared by its sweeps.
#[derive(Debug, Clone)]
pub struct ByteBudget {
    permits: Arc<Semaphore>,
    units: usize,
}

/// Bytes of the budget held by one sweep; given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    permit: OwnedSemaphorePermit,
}

impl ByteBudget {
    pub fn new(bytes: usize) -> ByteBudget {
        let units = units(bytes).clamp(1, Semaphore::MAX_PERMITS);
        ByteBudget {
            permits: Arc::new(Semaphore::new(units)),
            units,
        }
    }

    /// Waits until `bytes` (at most the whole budget) are free and holds them.
    pub async fn reserve(&self, bytes: usize) -> Reservation {
        let wanted = units(bytes).clamp(1, self.units);
        let wanted = u32::try_from(wanted).unwrap_or(u32::MAX);
        let permit = self
            .permits
            .clone()
            .acquire_many_owned(wanted)
            .await
            .expect("the budget's semaphore is never closed");
        Reservation { permit }
    }

    /// Holds `bytes` (at most the whole budget) if they are free now. Never
    /// ahead of a sweep that waits: the semaphore hands freed bytes to its
    /// waiters first.
    pub fn try_reserve(&self, bytes: usize) -> Option<Reservation> {
        let wanted = units(bytes).clamp(1, self.units);
        let wanted = u32::try_from(wanted).unwrap_or(u32::MAX);
        let permit = self.permits.clone().try_acquire_many_owned(wanted).ok()?;
        Some(Reservation { permit })
    }

    /// Bytes free now.
    pub fn available(&self) -> usize {
        self.permits.available_permits().saturating_mul(UNIT)
    }
}

impl Reservation {
    pub fn bytes(&self) -> usize {
        self.permit.num_permits().saturating_mul(UNIT)
    }

    /// Holds what `other` holds too, until this one is dropped.
    pub fn absorb(&mut self, other: Reservation) {
        self.permit.merge(other.permit);
    }

    /// Gives back all but `bytes` (rounded up to the unit).
    pub fn keep(&mut self, bytes: usize) {
        let keep = units(bytes).max(1);
        let surplus = self.permit.num_permits().saturating_sub(keep);
        if surplus > 0 {
            drop(self.permit.split(surplus));
        }
    }
}

fn units(bytes: usize) -> usize {
    bytes.div_ceil(UNIT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_reservation_holds_its_bytes_until_dropped_and_gives_back_the_rest() {
        let budget = ByteBudget::new(64 * UNIT);
        let mut first = budget.reserve(40 * UNIT).await;
        assert_eq!(budget.available(), 24 * UNIT);
        first.keep(10 * UNIT + 1);
        assert_eq!(first.bytes(), 11 * UNIT, "rounded up to the unit");
        assert_eq!(budget.available(), 53 * UNIT);
        drop(first);
        assert_eq!(budget.available(), 64 * UNIT);
    }

    #[tokio::test]
    async fn a_reservation_larger_than_the_budget_takes_the_whole_budget() {
        let budget = ByteBudget::new(8 * UNIT);
        let all = budget.reserve(100 * UNIT).await;
        assert_eq!(all.bytes(), 8 * UNIT);
        assert_eq!(budget.available(), 0);
    }

    #[tokio::test]
    async fn a_reservation_waits_until_the_budget_has_room() {
        let budget = ByteBudget::new(8 * UNIT);
        let held = budget.reserve(6 * UNIT).await;
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.reserve(4 * UNIT).await.bytes() }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "2 KiB free, 4 KiB wanted");
        drop(held);
        assert_eq!(waiting.await.unwrap(), 4 * UNIT);
    }

    #[tokio::test]
    async fn trying_takes_what_is_free_and_never_passes_a_waiting_sweep() {
        let budget = ByteBudget::new(8 * UNIT);
        let held = budget.try_reserve(6 * UNIT).expect("free");
        assert!(budget.try_reserve(4 * UNIT).is_none(), "2 KiB free");
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.reserve(8 * UNIT).await.bytes() }
        });
        tokio::task::yield_now().await;
        assert!(
            budget.try_reserve(UNIT).is_none(),
            "the free 2 KiB are the waiting sweep's"
        );
        drop(held);
        assert_eq!(waiting.await.unwrap(), 8 * UNIT);
    }

    #[test]
    fn the_least_budget_holds_one_row_of_the_largest_payload() {
        assert_eq!(least_for(16 << 20), (48 << 20) + ROW_FIELDS_MAX);
        assert!(
            least_for(16 << 20) <= 64 << 20,
            "the default budget holds a row of the default max_payload_bytes"
        );
        assert_eq!(least_for(usize::MAX), usize::MAX);
    }
}
