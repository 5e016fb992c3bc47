//! [`Claim`]: a tenant held by this relay, one open transaction on one
//! pooled connection with the tenant's advisory lock, from the claim to its
//! settlement ([`Claim::settle`]), its rollback or its drop.

mod ahead;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use deadpool_postgres::Object;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use self::ahead::MarksAhead;
use super::columns::{self, Raw};
use super::query::{deadline, mark_ids, update_ids};
use super::read::{PayloadOf, RETAINED_READ_MAX, ReadRows, read_bytes};
use super::statements::{BEGIN, CLAIM, CLAIM_TURN, DEALLOCATE};
use super::twins::CLAIM_TURN_WAIT;
use super::{Store, StoreError};
use crate::domain::{BatchReport, Lease, OutboxRow, Payload};

/// How a claim ended: its batch, the row its refusal parked, if any, and
/// the confirmed rows its marks did not take on, if any.
#[derive(Debug)]
pub struct Settled {
    pub rows: Vec<OutboxRow>,
    pub parked: Option<Parked>,
    pub kept_pending: Option<KeptPending>,
}

/// Confirmed rows still pending after the commit that marked them: the table
/// kept the marks from taking (a `BEFORE UPDATE` trigger that returns NULL
/// or keeps `published_at` NULL, a row-level security policy that hides them
/// from the relay's role), so they would go out again at every sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeptPending {
    pub rows: i64,
    /// The lowest of them.
    pub first: i64,
}

/// A row parked as its sweep settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parked {
    pub id: i64,
    /// Its attempts, the refusal that parked it included.
    pub attempts: i32,
}

/// A tenant held by this relay: an open transaction with the advisory lock and
/// the batch it read.
pub struct Claim {
    /// Shared only with the marks sent ahead, which end before the claim does.
    conn: Option<Arc<Object>>,
    store: Store,
    tenant: Arc<str>,
    /// The claim's batches, in outbox order: the first read at the claim,
    /// then each read ahead and appended (see [`Claim::append_ahead`]).
    rows: Vec<OutboxRow>,
    /// Where the last batch starts among `rows`.
    batch_start: usize,
    /// More rows were pending than the byte budget let the last batch hold.
    cut_by_budget: bool,
    /// A writer of the tenant was in flight at the claim: the rows stop at
    /// the caller's safe bound, not at the sequence's position.
    writers: bool,
    /// Where the id sequence stood at the claim.
    position: i64,
    /// The most any one row read on the claim's connection brought.
    largest_read: usize,
    /// A tenant sharing the claim key (a twin, see `twins`) had rows
    /// pending at the claim: no further batch is chained.
    twin_pending: bool,
    ahead: Mutex<MarksAhead>,
}

impl Store {
    /// Opens a transaction, tries the tenant's advisory lock and reads its
    /// oldest pending rows, as many as fit `budget` bytes (at least one), all
    /// in one round trip. `Ok(None)`: another relay holds the tenant.
    ///
    /// The rows stop at the claim's fence (see `store/claim.sql`): where the
    /// id sequence stands when no writer of the tenant is in flight, else
    /// `safe`, a bound the caller found safe earlier (see
    /// [`Store::writers`]). [`Claim::writers`] says which.
    pub async fn claim(
        &self,
        tenant: &str,
        budget: usize,
        safe: i64,
    ) -> Result<Option<Claim>, StoreError> {
        let claimed = self
            .with_sequence(|sequence| self.claim_on_writable(tenant, budget, safe, sequence))
            .await;
        self.dropping_idle_if_read_only(claimed)
    }

    /// [`Store::claim`], found [`StoreError::ReadOnly`] on a server that
    /// takes no writes.
    async fn claim_on_writable(
        &self,
        tenant: &str,
        budget: usize,
        safe: i64,
        sequence: i64,
    ) -> Result<Option<Claim>, StoreError> {
        let mut claim = Claim {
            conn: Some(Arc::new(self.connection().await?)),
            store: self.clone(),
            tenant: tenant.into(),
            rows: Vec::new(),
            batch_start: 0,
            cut_by_budget: false,
            writers: false,
            position: 0,
            largest_read: 0,
            twin_pending: false,
            ahead: Mutex::new(MarksAhead::default()),
        };
        let client = claim.client();
        let twins = self.twins_of(tenant);
        let work = async {
            let lock_key: &str = &self.lock_key;
            let idle_ms: &str = &self.claim_idle_ms;
            let claim_params: [(&(dyn ToSql + Sync), Type); 5] = [
                (&lock_key, Type::TEXT),
                (&tenant, Type::TEXT),
                (&idle_ms, Type::TEXT),
                (&sequence, Type::INT8),
                (&safe, Type::INT8),
            ];
            // One round trip: the server runs them in order, in the
            // transaction BEGIN opens.
            let (begin, turn, taken, batch, twin_pending) = tokio::join!(
                client.batch_execute(BEGIN),
                self.wait_turn(client, tenant, !twins.is_empty()),
                client.query_typed_one(CLAIM, &claim_params),
                self.read_batch(client, false, tenant, i64::MIN, budget),
                self.twins_pending(client, &twins),
            );
            begin?;
            if let Err(error) = turn {
                // The twin's claim outlasted the wait: skipped, as when the
                // try fails (the statements after it failed with it).
                return match error.code() {
                    Some(code) if *code == SqlState::LOCK_NOT_AVAILABLE => Ok(None),
                    _ => Err(error.into()),
                };
            }
            let claimed = taken?;
            let (taken, read_only): (bool, bool) = (claimed.try_get(1)?, claimed.try_get(2)?);
            let fence = (claimed.try_get("writers")?, claimed.try_get("position")?);
            self.learn_hash(tenant, claimed.try_get("tenant_hash")?);
            Ok::<_, StoreError>(Some((taken, read_only, fence, batch?, twin_pending?)))
        };
        let Some((
            taken,
            read_only,
            (writers, position),
            ReadRows {
                rows,
                cut_by_budget,
                largest_read,
            },
            twin_pending,
        )) = deadline("the claim", work).await?
        else {
            claim.rollback().await?;
            return Ok(None);
        };
        if read_only {
            // Dropped: the connection is closed, not pooled.
            return Err(StoreError::ReadOnly);
        }
        if !taken {
            claim.rollback().await?;
            return Ok(None);
        }
        if sequence != 0 && position < self.highest_read.load(Ordering::Relaxed) {
            // The sequence stands below ids already read (a failover to a
            // standby that was behind, or set back): nothing goes out, and
            // the check says why (see `Store::check_sequence`).
            claim.rollback().await?;
            return self.check_sequence().await.map(|_| None);
        }
        claim.twin_pending = twin_pending;
        claim.rows = rows;
        claim.cut_by_budget = cut_by_budget;
        claim.writers = writers;
        claim.position = position;
        claim.largest_read = largest_read;
        Ok(Some(claim))
    }

    /// For a tenant with a known twin (`waits`), waits its turn for the
    /// claim key (see `claim_turn.sql`); nothing sent otherwise.
    async fn wait_turn(
        &self,
        client: &Object,
        tenant: &str,
        waits: bool,
    ) -> Result<(), tokio_postgres::Error> {
        if waits {
            let lock_key: &str = &self.lock_key;
            let turn_ms = CLAIM_TURN_WAIT.as_millis().to_string();
            let params: [(&(dyn ToSql + Sync), Type); 3] = [
                (&lock_key, Type::TEXT),
                (&tenant, Type::TEXT),
                (&turn_ms, Type::TEXT),
            ];
            client.query_typed(CLAIM_TURN, &params).await?;
        }
        Ok(())
    }

    /// Whether any of `twins` has rows pending; nothing sent for none.
    async fn twins_pending(&self, client: &Object, twins: &[Arc<str>]) -> Result<bool, StoreError> {
        if twins.is_empty() {
            return Ok(false);
        }
        let names: Vec<&str> = twins.iter().map(|twin| &**twin).collect();
        let row = client
            .query_typed_one(
                &self.statements().twins_pending,
                &[(&names, Type::TEXT_ARRAY)],
            )
            .await?;
        Ok(row.try_get(0)?)
    }

    /// Marks rows the broker confirmed whose claim ended without its commit
    /// (see `relay`'s settlement retry): one statement, a transaction of its
    /// own, on a pooled connection (never the claim's, which is gone); the
    /// rows it marked. Idempotent: a row marked already keeps its time.
    pub async fn mark_confirmed(&self, ids: &[i64]) -> Result<u64, StoreError> {
        let conn = self.connection().await?;
        let result = deadline(
            "marking confirmed rows again",
            mark_ids(&conn, self.statements(), false, ids),
        )
        .await;
        if result.is_err() {
            drop(Object::take(conn));
        }
        self.dropping_idle_if_read_only(result)
    }
}

impl Claim {
    /// Whether a writer of the tenant was in flight at the claim, so that
    /// rows above the caller's safe bound may wait (see [`Store::claim`]).
    pub fn writers(&self) -> bool {
        self.writers
    }

    /// Where the id sequence stood at the claim.
    pub fn position(&self) -> i64 {
        self.position
    }

    /// Whether a twin of the tenant had rows pending at the claim, so that
    /// the claim chains no further batch (see `twins`).
    pub fn twin_pending(&self) -> bool {
        self.twin_pending
    }

    fn client(&self) -> &Object {
        self.conn
            .as_ref()
            .expect("a claim holds its connection until it ends")
    }

    /// The claim's rows, all its batches, in outbox order.
    pub fn rows(&self) -> &[OutboxRow] {
        &self.rows
    }

    /// The claim's last batch.
    pub fn batch(&self) -> &[OutboxRow] {
        &self.rows[self.batch_start..]
    }

    /// Whether the last batch stopped at the byte budget with more rows
    /// pending behind it (so the tenant is swept again at once).
    pub fn cut_by_budget(&self) -> bool {
        self.cut_by_budget
    }

    /// What the last batch holds of the byte budget.
    pub fn cost(&self) -> usize {
        self.batch().iter().map(|row| row.cost).sum()
    }

    /// The first row's cost when it alone was over the sweep's share of the
    /// budget, so its payload was not read (see [`Claim::read_withheld`]).
    pub fn withheld(&self) -> Option<usize> {
        self.rows
            .first()
            .filter(|row| matches!(row.payload, Payload::OverBudget { .. }))
            .map(|row| row.cost)
    }

    /// Reads the payload the batch read withheld for the budget; the caller
    /// holds the budget for it by now.
    pub async fn read_withheld(&mut self) -> Result<(), StoreError> {
        let Some(row) = self.rows.first() else {
            return Ok(());
        };
        let id = row.id;
        let client = self.client();
        let sql = &self.store.statements().read_payload;
        let table = &self.store.statements().table;
        let row = deadline("reading a payload", async {
            let row = client.query_typed_one(sql, &[(&id, Type::INT8)]).await?;
            columns::check_row(table, &row)?;
            Ok(row)
        })
        .await?;
        self.rows[0].payload = match row.try_get::<_, Option<Raw>>(0)? {
            Some(_) => PayloadOf::body(row, 0),
            None => Payload::Tombstone,
        };
        self.largest_read = self.largest_read.max(read_bytes(&self.rows[0]));
        Ok(())
    }

    /// Ends the claim as its rows went: marks the confirmed prefix (what the
    /// marks sent ahead did not cover), undoes marks sent ahead past it,
    /// records a refusal known to be the row's (parking the row when the
    /// refusal is one that parks and its attempts reached
    /// `park_after_attempts`), and commits, in one round trip; gives the batch
    /// back. On any error the transaction is abandoned and nothing is marked.
    /// `report` covers the claim's rows from the first.
    pub async fn settle(mut self, report: &BatchReport) -> Result<Settled, StoreError> {
        self.marks_ahead_done().await?;
        let confirmed = report.confirmed();
        let ahead = self.ahead.get_mut().unwrap_or_else(|e| e.into_inner());
        let (published, unpublished) = ahead.settlement(&self.rows, confirmed);
        let prepared = ahead.prepared;
        // Only a refusal known to be the row's is written on it: a failure of
        // the channel or connection it shared with other tenants' rows blames
        // none of them (see `Refusal::attributed`).
        let refused = report
            .refusal
            .as_ref()
            .filter(|(_, refusal)| refusal.attributed)
            .and_then(|(at, refusal)| Some((self.rows.get(*at)?.id, refusal)));
        let client = self.client();
        let statements = self.store.statements();
        let parks_at = refused.map_or(0, |(_, refusal)| self.store.parks_at(refusal.reason));
        let work = async {
            let refused = async {
                match refused {
                    Some((id, refusal)) => {
                        // Why the row did not go out is always recorded; only
                        // the row's own refusals count as attempts.
                        let attempts = i32::from(refusal.reason.counts_as_attempt());
                        let last_error = refusal.last_error();
                        let params: [(&(dyn ToSql + Sync), Type); 4] = [
                            (&id, Type::INT8),
                            (&last_error, Type::TEXT),
                            (&attempts, Type::INT4),
                            (&parks_at, Type::INT4),
                        ];
                        let row = client
                            .query_typed_opt(&statements.record_refusal, &params)
                            .await?;
                        Ok::<_, StoreError>(match row {
                            Some(row) if row.try_get::<_, bool>(1)? => Some(Parked {
                                id,
                                attempts: row.try_get(0)?,
                            }),
                            _ => None,
                        })
                    }
                    None => Ok(None),
                }
            };
            let (marked, unmarked, recorded, deallocated, commit) = tokio::join!(
                mark_ids(client, statements, prepared, &published),
                update_ids(client, &statements.unmark_published, &unpublished),
                refused,
                deallocate(client, prepared),
                client.batch_execute("COMMIT")
            );
            // A failed statement turns the COMMIT into a rollback: report the
            // statement's error, not the commit's success. (The connection
            // then closes with the claim, and what it prepared with it.)
            let marked = marked?;
            unmarked?;
            let parked = recorded?;
            deallocated?;
            commit?;
            Ok((marked, parked))
        };
        let committed = deadline("the commit", work).await;
        let (marked, parked) = self.store.dropping_idle_if_read_only(committed)?;
        let kept_pending = self
            .kept_pending(marked, published.len(), confirmed)
            .await?;
        self.release();
        Ok(Settled {
            rows: std::mem::take(&mut self.rows),
            parked,
            kept_pending,
        })
    }

    /// After the commit, when the marks changed fewer rows than they named
    /// (`marked` by the settlement's own of its `named`, beside those sent
    /// ahead): which of the `confirmed` prefix are still pending. A row
    /// deleted meanwhile is not; one the table kept from the mark is. No
    /// round trip when every mark took.
    async fn kept_pending(
        &self,
        marked: u64,
        named: usize,
        confirmed: usize,
    ) -> Result<Option<KeptPending>, StoreError> {
        let (marked, named) = {
            let ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            (ahead.marked + marked, (ahead.rows + named) as u64)
        };
        if marked >= named {
            return Ok(None);
        }
        let ids: Vec<i64> = self.rows[..confirmed.min(self.rows.len())]
            .iter()
            .map(|row| row.id)
            .collect();
        let client = self.client();
        let sql = &self.store.statements().still_pending;
        let row = deadline("checking the marks", async {
            Ok(client
                .query_typed_one(sql, &[(&ids, Type::INT8_ARRAY)])
                .await?)
        })
        .await?;
        let rows: i64 = row.try_get(0)?;
        Ok(match row.try_get::<_, Option<i64>>(1)? {
            Some(first) if rows > 0 => Some(KeptPending { rows, first }),
            _ => None,
        })
    }

    /// Ends the transaction without changes.
    pub async fn rollback(mut self) -> Result<(), StoreError> {
        self.marks_ahead_done().await?;
        let prepared = self
            .ahead
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .prepared;
        let client = self.client();
        deadline("the rollback", async {
            let (deallocated, rollback) = tokio::join!(
                deallocate(client, prepared),
                client.batch_execute("ROLLBACK")
            );
            deallocated?;
            Ok(rollback?)
        })
        .await?;
        self.release();
        Ok(())
    }

    /// Hands a connection whose transaction ended cleanly back to the pool,
    /// unless it read a row larger than [`RETAINED_READ_MAX`]: its read
    /// buffer grew to hold that row and would stay that large in the pool,
    /// uncounted by the byte budget, so it is closed instead.
    fn release(&mut self) {
        let conn = self.conn.take();
        if self.largest_read > RETAINED_READ_MAX
            && let Some(conn) = conn.and_then(Arc::into_inner)
        {
            drop(Object::take(conn));
        }
    }
}

/// Drops the statements a claim `prepared` (see `Statements::prepare`), if it
/// did, in its transaction.
async fn deallocate(client: &Object, prepared: bool) -> Result<(), tokio_postgres::Error> {
    if prepared {
        client.batch_execute(DEALLOCATE).await?;
    }
    Ok(())
}

impl Lease for Claim {
    /// Whether the claim still holds: its connection (and with it the
    /// transaction and the advisory lock) is open.
    fn is_held(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| !c.is_closed())
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        // The marks and the read ahead share the connection; they go first.
        let ahead = self.ahead.get_mut().unwrap_or_else(|e| e.into_inner());
        ahead.sent.clear();
        ahead.next = None;
        if let Some(conn) = self.conn.take().and_then(Arc::into_inner) {
            // Still inside the transaction: close the connection, and with it
            // the transaction and the advisory lock.
            drop(Object::take(conn));
        }
    }
}
