//! The read of a batch: the tenant's oldest pending rows as many as fit the
//! byte budget, each decoded as it arrives, its payload left in the row's
//! buffer.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use deadpool_postgres::Object;
use futures_util::TryStreamExt;
use time::OffsetDateTime;
use tokio_postgres::types::{ToSql, Type};

use super::columns::{self, Checked, OccurredAt, Raw};
use super::statements::execute_read;
use super::{Store, StoreError};
use crate::domain::{OutboxRow, Payload};

/// The longest `subject_id` or `headers` (as JSON text) the batch read
/// returns: no AMQP frame of RabbitMQ's default `frame_max` (128 KiB) takes
/// more, so a longer one is refused without being read. It bounds what one
/// row can cost besides its payload (see `budget::ROW_FIELDS_MAX`).
pub const FIELD_LIMIT: i64 = 512 << 10;
const _: () = assert!(
    FIELD_LIMIT == 512 << 10,
    "budget::ROW_FIELDS_MAX counts on it"
);

/// The bound parameters of a statement that takes none.
const NO_PARAMETERS: [(&(dyn ToSql + Sync), Type); 0] = [];

/// A read whose rows were larger than this leaves its connection's read
/// buffer grown to hold them; such a connection is closed when its claim
/// ends rather than kept in the pool with that buffer (see
/// [`Claim::release`](super::Claim::release)).
pub(super) const RETAINED_READ_MAX: usize = 1 << 20;

/// The payload of a row read, left where the server's answer put it: the
/// message body shares the row's buffer instead of copying it, and the
/// buffer goes with the last holder of the body.
pub(super) struct PayloadOf {
    row: tokio_postgres::Row,
    column: usize,
}

impl PayloadOf {
    /// The message body of `row`'s `column`, sharing the row's buffer; the
    /// caller has read the column as [`Raw`] (its UTF-8 checked).
    pub(super) fn body(row: tokio_postgres::Row, column: usize) -> Payload {
        Payload::Body(Bytes::from_owner(PayloadOf { row, column }))
    }
}

impl AsRef<[u8]> for PayloadOf {
    fn as_ref(&self) -> &[u8] {
        // Built only once the value was read as `Raw` (its UTF-8 checked).
        match self.row.try_get::<_, Option<Checked>>(self.column) {
            Ok(Some(Checked(bytes))) => bytes,
            _ => &[],
        }
    }
}

/// The columns of `read_batch.sql` and `replay_batch.sql`, by position: a
/// row's values are read by index, as a lookup by name compares every
/// column's name for each value of each row.
mod column {
    pub const ID: usize = 0;
    pub const KIND: usize = 1;
    pub const SUBJECT_ID: usize = 3;
    pub const PAYLOAD: usize = 5;
    pub const PAYLOAD_BYTES: usize = 6;
    pub const HEADERS: usize = 7;
    pub const HEADERS_BYTES: usize = 8;
    pub const OCCURRED_AT: usize = 9;
    pub const COST: usize = 10;
    pub const WITHIN: usize = 11;
    /// Every column's name, in order.
    pub const NAMES: [&str; 12] = [
        "id",
        "kind",
        "kind_bytes",
        "subject_id",
        "subject_id_bytes",
        "payload",
        "payload_bytes",
        "headers",
        "headers_bytes",
        "occurred_at",
        "cost",
        "within",
    ];
}

/// Whether a read's columns are those [`column`] names, in its order (every
/// row of a read has the same description, so its first row is asked).
pub(super) fn in_column_order(row: &tokio_postgres::Row) -> bool {
    let names = row.columns().iter().map(|c| c.name());
    names.eq(column::NAMES.iter().copied())
}

/// Reads one row of `read_batch.sql` (whose columns [`columns::check_row`]
/// found fit, in [`column`]'s order). A value that cannot be read, or was
/// left in the database for its size, makes that row defective (refused as
/// `invalid` or `too_large`), never the batch.
pub(super) fn decode(
    row: tokio_postgres::Row,
    max_payload_bytes: i64,
) -> Result<OutboxRow, tokio_postgres::Error> {
    let id: i64 = row.try_get(column::ID)?;
    let cost: i64 = row.try_get(column::COST)?;
    let mut defects = Vec::new();
    let mut text = |index: usize, what: &str, limit: i64| -> String {
        match row.try_get::<_, Option<String>>(index) {
            Ok(Some(value)) => value,
            Ok(None) => {
                // Left out for its length (the column after it), or NULL in
                // a table whose column allows it (the contract's does not).
                match row.try_get::<_, Option<i32>>(index + 1).ok().flatten() {
                    Some(bytes) => defects.push(format!("{what} is {bytes} bytes, over {limit}")),
                    None => defects.push(format!(
                        "{what} is NULL: the column allows it, the contract's table does not"
                    )),
                }
                String::new()
            }
            Err(error) => {
                defects.push(format!("{what} cannot be read: {error}"));
                String::new()
            }
        }
    };
    let kind = text(column::KIND, "kind", 255);
    let subject_id = text(column::SUBJECT_ID, "subject_id", FIELD_LIMIT);
    let payload_bytes: Option<i32> = row.try_get(column::PAYLOAD_BYTES)?;
    // The body itself is attached last, sharing the row (see `PayloadOf`).
    let payload = match row.try_get::<_, Option<Raw>>(column::PAYLOAD) {
        Ok(Some(_)) => None,
        Ok(None) => Some(unread_payload(payload_bytes, max_payload_bytes)),
        Err(error) => {
            defects.push(format!("payload cannot be read: {error}"));
            Some(Payload::Tombstone)
        }
    };
    let headers_bytes: Option<i32> = row.try_get(column::HEADERS_BYTES)?;
    let headers = match row.try_get::<_, Option<Raw>>(column::HEADERS) {
        Ok(None) if headers_bytes.is_some() => {
            defects.push(format!(
                "headers are {} bytes of JSON, over {FIELD_LIMIT}",
                headers_bytes.unwrap_or_default()
            ));
            None
        }
        Ok(headers) => headers.map(|Raw(json)| Bytes::copy_from_slice(json)),
        Err(error) => {
            defects.push(format!("headers cannot be read: {error}"));
            None
        }
    };
    let occurred_at = match row.try_get::<_, Option<OccurredAt>>(column::OCCURRED_AT) {
        Ok(Some(at)) => at.0,
        Ok(None) => {
            defects.push(
                "occurred_at is infinite or outside the years 1-9999, which no message can carry"
                    .into(),
            );
            OffsetDateTime::UNIX_EPOCH
        }
        Err(error) => {
            defects.push(format!("occurred_at cannot be read: {error}"));
            OffsetDateTime::UNIX_EPOCH
        }
    };
    let payload = match payload {
        Some(payload) => payload,
        None => PayloadOf::body(row, column::PAYLOAD),
    };
    Ok(OutboxRow {
        id,
        kind,
        subject_id,
        payload,
        headers,
        occurred_at,
        defect: (!defects.is_empty()).then(|| defects.join("; ")),
        cost: usize::try_from(cost).unwrap_or(usize::MAX),
    })
}

/// The payload of a row whose `payload` came back NULL, by its length
/// (`payload_bytes`): without one, the payload is NULL (a tombstone); over
/// `max_payload_bytes`, it is too large to send; else it was left for the
/// byte budget, to be read alone once the budget allows.
fn unread_payload(bytes: Option<i32>, max_payload_bytes: i64) -> Payload {
    match bytes {
        None => Payload::Tombstone,
        Some(bytes) if i64::from(bytes) > max_payload_bytes => Payload::TooLarge {
            bytes: u64::try_from(bytes).unwrap_or_default(),
        },
        Some(bytes) => Payload::OverBudget {
            bytes: u64::try_from(bytes).unwrap_or_default(),
        },
    }
}

/// What the server sent of `row` that the relay may hold: its payload and
/// headers (see [`RETAINED_READ_MAX`]).
pub(super) fn read_bytes(row: &OutboxRow) -> usize {
    let payload = match &row.payload {
        Payload::Body(body) => body.len(),
        _ => 0,
    };
    payload + row.headers.as_ref().map_or(0, Bytes::len)
}

/// The rows of one read: a claim's batch.
#[derive(Default)]
pub(super) struct ReadRows {
    pub(super) rows: Vec<OutboxRow>,
    /// More rows were pending than the byte budget let the batch hold.
    pub(super) cut_by_budget: bool,
    /// The most any one row brought (see [`RETAINED_READ_MAX`]).
    pub(super) largest_read: usize,
}

impl ReadRows {
    /// Whether the next row read joins the batch: the first always does (a
    /// batch holds at least one row); a later one only `within` the budget.
    /// One past it is not part of the batch, only a sign that more rows are
    /// pending behind it.
    fn admits(&mut self, within: bool) -> bool {
        if self.rows.is_empty() || within {
            return true;
        }
        self.cut_by_budget = true;
        false
    }

    /// Adds a row the batch admitted.
    fn push(&mut self, row: OutboxRow) {
        self.largest_read = self.largest_read.max(read_bytes(&row));
        self.rows.push(row);
    }

    /// Whether these rows, read ahead, can be the claim's next batch: they
    /// are some, and the first one's payload was read (a first row too large
    /// for the read's share is read by a sweep of its own).
    pub(super) fn can_follow(&self) -> bool {
        self.rows
            .first()
            .is_some_and(|row| !matches!(row.payload, Payload::OverBudget { .. }))
    }
}

impl Store {
    /// The tenant's oldest pending rows after id `after`, as many as fit
    /// `budget` bytes (at least one), decoded one at a time as they arrive
    /// (each payload stays in its row's buffer, see `PayloadOf`). Read in
    /// the claim's transaction, which alone lets the statement return rows.
    /// `prepared`: run the read the claim prepared (see
    /// `Statements::prepare`), not `read_batch.sql` itself.
    pub(super) async fn read_batch(
        &self,
        client: &Object,
        prepared: bool,
        tenant: &str,
        after: i64,
        budget: usize,
    ) -> Result<ReadRows, StoreError> {
        let budget = i64::try_from(budget).unwrap_or(i64::MAX);
        // `read_batch.sql`'s $2 to $6.
        let numbers = [
            self.batch_size,
            self.max_payload_bytes,
            budget,
            FIELD_LIMIT,
            after,
        ];
        let rows = if prepared {
            let sql = execute_read(tenant, numbers);
            client.query_typed_raw(&sql, NO_PARAMETERS).await?
        } else {
            let [n2, n3, n4, n5, n6] = &numbers;
            let params: [(&(dyn ToSql + Sync), Type); 6] = [
                (&tenant, Type::TEXT),
                (n2, Type::INT8),
                (n3, Type::INT8),
                (n4, Type::INT8),
                (n5, Type::INT8),
                (n6, Type::INT8),
            ];
            client
                .query_typed_raw(&self.statements().read_batch, params)
                .await?
        };
        let mut rows = std::pin::pin!(rows);
        let mut batch = ReadRows::default();
        let mut checked = false;
        while let Some(row) = rows.try_next().await? {
            // Every row of a read has the same description: the first one
            // tells whether the table's columns still fit.
            if !checked {
                columns::check_row(&self.statements().table, &row)?;
                debug_assert!(in_column_order(&row), "read_batch.sql's columns");
                checked = true;
            }
            // `within` is never NULL (see `read_batch.sql`).
            if !batch.admits(row.try_get(column::WITHIN)?) {
                continue;
            }
            batch.push(decode(row, self.max_payload_bytes)?);
        }
        if let Some(highest) = batch.rows.iter().map(|row| row.id).max() {
            self.highest_read.fetch_max(highest, Ordering::Relaxed);
        }
        Ok(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, payload: Payload, headers: Option<&str>) -> OutboxRow {
        OutboxRow {
            id,
            kind: "k".into(),
            subject_id: "s".into(),
            payload,
            headers: headers.map(|json| Bytes::copy_from_slice(json.as_bytes())),
            occurred_at: OffsetDateTime::UNIX_EPOCH,
            defect: None,
            cost: 0,
        }
    }

    fn body(bytes: usize) -> Payload {
        Payload::Body(Bytes::from(vec![b'x'; bytes]))
    }

    #[test]
    fn the_first_row_always_joins_the_batch_and_one_past_the_budget_cuts_it() {
        let mut batch = ReadRows::default();
        assert!(batch.admits(false), "the first row, even over the budget");
        batch.push(row(1, body(3), None));
        assert!(batch.admits(true));
        batch.push(row(2, body(3), None));
        assert!(!batch.cut_by_budget);
        assert!(!batch.admits(false), "past the budget");
        assert!(batch.cut_by_budget, "more rows pending behind the batch");
        assert_eq!(batch.rows.len(), 2);
    }

    #[test]
    fn a_batch_keeps_the_largest_payload_and_headers_it_read() {
        let mut batch = ReadRows::default();
        batch.push(row(1, body(10), Some("{}")));
        batch.push(row(2, body(4), None));
        batch.push(row(3, Payload::TooLarge { bytes: 1 << 30 }, None));
        assert_eq!(batch.largest_read, 12);
        assert_eq!(
            read_bytes(&row(4, Payload::Tombstone, Some("{\"a\":1}"))),
            7
        );
    }

    #[test]
    fn rows_read_ahead_follow_on_unless_none_or_the_first_one_waits_for_the_budget() {
        let batch = |rows| ReadRows {
            rows,
            ..ReadRows::default()
        };
        assert!(!batch(Vec::new()).can_follow());
        assert!(batch(vec![row(1, body(1), None)]).can_follow());
        assert!(batch(vec![row(1, Payload::Tombstone, None)]).can_follow());
        let withheld = row(1, Payload::OverBudget { bytes: 9 }, None);
        assert!(!batch(vec![withheld, row(2, body(1), None)]).can_follow());
        let later = row(2, Payload::OverBudget { bytes: 9 }, None);
        assert!(batch(vec![row(1, body(1), None), later]).can_follow());
    }

    #[test]
    fn a_payload_left_unread_is_a_tombstone_too_large_or_over_the_budget() {
        assert_eq!(unread_payload(None, 100), Payload::Tombstone);
        assert_eq!(
            unread_payload(Some(101), 100),
            Payload::TooLarge { bytes: 101 }
        );
        assert_eq!(
            unread_payload(Some(100), 100),
            Payload::OverBudget { bytes: 100 }
        );
        assert_eq!(
            unread_payload(Some(0), 100),
            Payload::OverBudget { bytes: 0 }
        );
    }

    #[test]
    fn the_column_names_are_the_positions_read() {
        assert_eq!(column::NAMES[column::ID], "id");
        assert_eq!(column::NAMES[column::KIND], "kind");
        assert_eq!(column::NAMES[column::SUBJECT_ID], "subject_id");
        assert_eq!(column::NAMES[column::PAYLOAD], "payload");
        assert_eq!(column::NAMES[column::PAYLOAD_BYTES], "payload_bytes");
        assert_eq!(column::NAMES[column::HEADERS], "headers");
        assert_eq!(column::NAMES[column::HEADERS_BYTES], "headers_bytes");
        assert_eq!(column::NAMES[column::OCCURRED_AT], "occurred_at");
        assert_eq!(column::NAMES[column::COST], "cost");
        assert_eq!(column::NAMES[column::WITHIN], "within");
    }
}
