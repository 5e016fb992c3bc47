//! The id sequence, which the claim's fence reads to keep each tenant's rows
//! in commit order: its check, the watch of its position, and the checks of
//! the writers in flight.

use std::sync::atomic::Ordering;

use tokio_postgres::types::Type;

use super::statements::{POSITION, SEQUENCE, WRITERS, WRITERS_FREE};
use super::{Store, StoreError};

/// Not checked yet (see [`Store::check_sequence`]).
pub(super) const SEQUENCE_UNKNOWN: i64 = -1;

/// What a read of the id sequence found (see [`Store::watch`]).
#[derive(Debug, Default)]
pub struct Watched {
    pub position: i64,
    /// The tenants with rows pending, when the position moved (or had moved
    /// at the read before).
    pub tenants: Option<Vec<String>>,
}

/// What the writers' check found (see `store/writers.sql`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Writers {
    /// Where the id sequence stood just before the locks were read.
    pub position: i64,
    /// Every transaction holding a writers' lock of the table, any tenant.
    pub all: Vec<String>,
    /// For each tenant asked about, in order: the transactions holding its
    /// writers' lock.
    pub tenants: Vec<Vec<String>>,
}

impl Store {
    /// The id sequence's oid (0: none), checked first if no check has said.
    pub(super) async fn sequence(&self) -> Result<i64, StoreError> {
        match self.sequence.load(Ordering::Relaxed) {
            SEQUENCE_UNKNOWN => self.check_sequence().await,
            known => Ok(known),
        }
    }

    /// Checks the id sequence the fences read (see `store/sequence.sql`):
    /// `CACHE 1`, a positive increment, no cycle, and readable by this role.
    /// Returns its oid, 0 when the table (or its id column's sequence) does
    /// not exist, in which case no fence holds rows back; an unfit sequence
    /// is [`StoreError::Sequence`], and nothing may be relayed in order.
    pub async fn check_sequence(&self) -> Result<i64, StoreError> {
        let table = &self.statements().table;
        let found = self
            .query_all(
                "the id sequence check",
                SEQUENCE,
                &[(table, Type::TEXT)],
                |row| {
                    Ok((
                        row.try_get::<_, String>("sequence")?,
                        row.try_get::<_, i64>("sequence_oid")?,
                        row.try_get::<_, i64>("cache")?,
                        row.try_get::<_, i64>("increment")?,
                        row.try_get::<_, bool>("cycles")?,
                        row.try_get::<_, bool>("readable")?,
                    ))
                },
            )
            .await?;
        let Some((name, oid, cache, increment, cycles, readable)) = found.into_iter().next() else {
            self.sequence.store(0, Ordering::Relaxed);
            return Ok(0);
        };
        let unfit = if cache != 1 {
            Some(format!(
                "has CACHE {cache}: a draw shows the end of its session's cached range to every other session; fix: ALTER SEQUENCE {name} CACHE 1"
            ))
        } else if increment <= 0 {
            Some(format!(
                "has INCREMENT {increment}: ids must ascend; fix: ALTER SEQUENCE {name} INCREMENT 1"
            ))
        } else if cycles {
            Some(format!(
                "CYCLEs: an id may come round again; fix: ALTER SEQUENCE {name} NO CYCLE"
            ))
        } else if !readable {
            Some(format!(
                "cannot be read by this role; fix: GRANT SELECT ON SEQUENCE {name} TO <the relay's role>"
            ))
        } else {
            None
        };
        if let Some(unfit) = unfit {
            self.sequence.store(SEQUENCE_UNKNOWN, Ordering::Relaxed);
            return Err(StoreError::Sequence(format!(
                "the id sequence {name} of {table} {unfit}; the relay reads its position to keep each tenant's rows in commit order, so nothing is relayed until it is fixed"
            )));
        }
        self.sequence.store(oid, Ordering::Relaxed);
        Ok(oid)
    }

    /// Where the id sequence stands (0 when the table has none), and, when
    /// it moved since `watched` (or `moved` says the last read saw it move),
    /// the tenants with rows pending among the ids after `since`, the last
    /// `span` at most: the wake-up watches the sequence while rows flow
    /// (`wakeup = sequence`, see `store/watch.sql`).
    pub async fn watch(
        &self,
        watched: i64,
        moved: bool,
        since: i64,
        span: i64,
    ) -> Result<Watched, StoreError> {
        let sequence = self.sequence().await?;
        if !moved {
            // Most reads find the sequence where it stood: the position
            // alone says so, and the server plans no read of the table.
            let found = self
                .query_all(
                    "the id sequence's position",
                    POSITION,
                    &[(&sequence, Type::INT8)],
                    |row| row.try_get::<_, i64>(0),
                )
                .await?;
            let position = found.into_iter().next().unwrap_or_default();
            if position == watched {
                return Ok(Watched {
                    position,
                    tenants: None,
                });
            }
        }
        let found = self
            .query_all(
                "the id sequence's watch",
                &self.statements().watch,
                &[
                    (&sequence, Type::INT8),
                    (&watched, Type::INT8),
                    (&moved, Type::BOOL),
                    (&since, Type::INT8),
                    (&span, Type::INT8),
                ],
                |row| {
                    Ok(Watched {
                        position: row.try_get(0)?,
                        tenants: row.try_get::<_, Option<Vec<String>>>(1)?,
                    })
                },
            )
            .await?;
        Ok(found.into_iter().next().unwrap_or_default())
    }

    /// Whether each of `tenants` has no writer in flight, and where the id
    /// sequence stood just before (see `store/writers_free.sql`): a free
    /// tenant's ids up to it are committed or gone. Cheaper than
    /// [`Store::writers`] (no read of `pg_locks`), but it never clears a
    /// tenant that always has some writer in flight.
    pub async fn writers_free(&self, tenants: &[&str]) -> Result<(i64, Vec<bool>), StoreError> {
        let sequence = self.sequence().await?;
        if sequence == 0 {
            return Ok((i64::MAX, vec![true; tenants.len()]));
        }
        let lock_key: &str = &self.lock_key;
        let rows = self
            .query_all(
                "the writers' free check",
                WRITERS_FREE,
                &[
                    (&lock_key, Type::TEXT),
                    (&sequence, Type::INT8),
                    (&tenants, Type::TEXT_ARRAY),
                ],
                |row| {
                    Ok((
                        row.try_get::<_, bool>("free")?,
                        row.try_get::<_, i64>("position")?,
                    ))
                },
            )
            .await?;
        let position = rows.first().map_or(0, |(_, position)| *position);
        Ok((position, rows.into_iter().map(|(free, _)| free).collect()))
    }

    /// Which transactions hold the writers' lock of each of `tenants` (and of
    /// any tenant), and where the id sequence stood just before: one
    /// statement (see `store/writers.sql`). Once every transaction named for
    /// a tenant has ended, its ids up to the position are committed or gone.
    pub async fn writers(&self, tenants: &[&str]) -> Result<Writers, StoreError> {
        let sequence = self.sequence().await?;
        if sequence == 0 {
            return Ok(Writers {
                position: i64::MAX,
                all: Vec::new(),
                tenants: vec![Vec::new(); tenants.len()],
            });
        }
        let lock_key: &str = &self.lock_key;
        let rows = self
            .query_all(
                "the writers check",
                WRITERS,
                &[
                    (&lock_key, Type::TEXT),
                    (&sequence, Type::INT8),
                    (&tenants, Type::TEXT_ARRAY),
                ],
                |row| {
                    Ok((
                        row.try_get::<_, Option<String>>("tenant")?.is_none(),
                        row.try_get::<_, Vec<String>>("holders")?,
                        row.try_get::<_, Option<i64>>("position")?,
                    ))
                },
            )
            .await?;
        let mut writers = Writers::default();
        for (overall, holders, position) in rows {
            if overall {
                writers.all = holders;
                writers.position = position.unwrap_or_default();
            } else {
                writers.tenants.push(holders);
            }
        }
        Ok(writers)
    }
}
