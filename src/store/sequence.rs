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
    pub all: Vec<Holder>,
    /// For each tenant asked about, in order: the transactions holding its
    /// writers' lock.
    pub tenants: Vec<Vec<Holder>>,
    /// When the server started (`pg_postmaster_start_time()`): holders and
    /// positions found belong to this instance of it.
    pub started: String,
}

/// A transaction holding a writers' lock, as `pg_locks` names it: its
/// `virtualtransaction`, and its xid once it has one. A prepared transaction
/// keeps its xid across a restart or a failover, not its virtual one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    vxid: String,
    xid: Option<i64>,
}

impl Holder {
    /// `<virtualtransaction>[ <xid>]`, as `store/writers.sql` names it.
    fn parse(named: &str) -> Holder {
        match named.split_once(' ') {
            Some((vxid, xid)) => Holder {
                vxid: vxid.into(),
                xid: xid.parse().ok(),
            },
            None => Holder {
                vxid: named.into(),
                xid: None,
            },
        }
    }

    /// Whether this is the transaction `recorded` names: by its xid where
    /// that has one, else by its virtual one.
    pub fn is(&self, recorded: &Holder) -> bool {
        match recorded.xid {
            Some(xid) => self.xid == Some(xid),
            None => self.vxid == recorded.vxid,
        }
    }
}

/// What a read of the id sequence found (see `store/sequence.sql`).
struct SequenceFound {
    name: String,
    oid: i64,
    cache: i64,
    increment: i64,
    cycles: bool,
    readable: bool,
    /// `None` when this role may not read it.
    position: Option<i64>,
    /// The table's highest id, when read (and the table has rows).
    highest: Option<i64>,
}

/// What the checks of the id sequence have seen of its position.
#[derive(Debug, Default)]
pub(super) struct PositionSeen {
    /// The highest id it had given, as the checks saw it: a position, or
    /// the table's highest id.
    given: Option<i64>,
    /// Whether the last check found it behind an id it had already given.
    behind: bool,
}

/// How a check found the id sequence's position changed (see
/// [`PositionSeen::note`]).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum PositionChange {
    /// It stands below `given`, an id it had already given (the position at
    /// an earlier check, or the table's highest id).
    Behind { given: i64 },
    /// It stands past every id it had given again.
    Caught,
}

impl PositionSeen {
    /// Notes a check's `position`, beside the table's `highest` id when it
    /// was read: the change to say, if any. A sequence only ascends, so a
    /// position below one seen before, or below an id of the table, was set
    /// back (or the id was not drawn from it); it has caught up once it
    /// stands at or past the highest id it had given, whatever the table
    /// holds now (a truncated table's ids were sent all the same).
    pub(super) fn note(&mut self, position: i64, highest: Option<i64>) -> Option<PositionChange> {
        let given = self.given.into_iter().chain(highest).max();
        self.given = given.max(Some(position));
        let behind = given.is_some_and(|given| position < given);
        match (std::mem::replace(&mut self.behind, behind), behind) {
            (false, true) => given.map(|given| PositionChange::Behind { given }),
            (true, false) => Some(PositionChange::Caught),
            _ => None,
        }
    }
}

impl Store {
    /// The id sequence's oid (0: none), checked first if no check has said.
    pub(super) async fn sequence(&self) -> Result<i64, StoreError> {
        match self.sequence.load(Ordering::Relaxed) {
            SEQUENCE_UNKNOWN => self.check_sequence().await,
            known => Ok(known),
        }
    }

    /// Runs `read` with the id sequence's oid (see [`Store::sequence`]).
    /// When the server no longer knows that oid (SQLSTATE XX000, "could not
    /// open relation with OID": the table was dropped, or replaced, under
    /// the relay), checks the sequence again and, if it finds another one,
    /// runs `read` once more with it. With the table gone, the check fails
    /// naming it, and that is the error.
    pub(super) async fn with_sequence<T, Read>(
        &self,
        read: impl Fn(i64) -> Read,
    ) -> Result<T, StoreError>
    where
        Read: Future<Output = Result<T, StoreError>>,
    {
        let sequence = self.sequence().await?;
        match read(sequence).await {
            Err(error) if error.is_internal() => match self.check_sequence().await? {
                found if found != sequence => read(found).await,
                _ => Err(error),
            },
            done => done,
        }
    }

    /// Checks the id sequence the fences read (see `store/sequence.sql`):
    /// `CACHE 1`, a positive increment, no cycle, and readable by this role.
    /// Returns its oid, 0 when the id column draws from no sequence, in
    /// which case no fence holds rows back; a missing table is the server's
    /// error (SQLSTATE 42P01), naming it. An unfit sequence is
    /// [`StoreError::Sequence`], and nothing may be relayed in order.
    ///
    /// It also notes where the sequence stands (see [`PositionSeen`]): a
    /// position below an id it had already given is said once, at WARN.
    pub async fn check_sequence(&self) -> Result<i64, StoreError> {
        let table = &self.statements().table;
        let known = self.sequence.load(Ordering::Relaxed) > 0;
        let mut found = self.read_sequence(known).await?;
        if !known && found.is_some() {
            // The table exists: read again with its highest id beside (at
            // start, and once the table appears).
            found = self.read_sequence(true).await?;
        }
        let Some(SequenceFound {
            name,
            oid,
            cache,
            increment,
            cycles,
            readable,
            position,
            highest,
        }) = found
        else {
            self.sequence.store(0, Ordering::Relaxed);
            return Ok(0);
        };
        let read = self.highest_read.load(Ordering::Relaxed);
        if let Some(position) = position {
            self.note_position(&name, table, position, highest, read);
        }
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
        if position.is_some_and(|position| position < read) {
            return Err(StoreError::Sequence(format!(
                "the id sequence {name} of {table} stands below id {read}, which this relay has \
                 already read and sent as message_id (a failover to a standby that was behind, \
                 or the sequence set back): the rows it numbers next reuse ids already sent, \
                 which consumers that deduplicate on message_id would drop, so nothing more is \
                 relayed from the table until it passes {read}; fix: SELECT setval('{name}', \
                 GREATEST({read}, (SELECT max(id) FROM {table})))"
            )));
        }
        Ok(oid)
    }

    /// Reads the id sequence's settings and position (see
    /// `store/sequence.sql`), and the table's highest id `with_highest`
    /// (the table must exist); `None` when the table or its sequence does
    /// not.
    async fn read_sequence(&self, with_highest: bool) -> Result<Option<SequenceFound>, StoreError> {
        let statements = self.statements();
        let sql = match with_highest {
            true => &statements.sequence_highest,
            false => SEQUENCE,
        };
        let found = self
            .query_all(
                "the id sequence check",
                sql,
                &[(&statements.table, Type::TEXT)],
                |row| {
                    Ok(SequenceFound {
                        name: row.try_get("sequence")?,
                        oid: row.try_get("sequence_oid")?,
                        cache: row.try_get("cache")?,
                        increment: row.try_get("increment")?,
                        cycles: row.try_get("cycles")?,
                        readable: row.try_get("readable")?,
                        position: row.try_get("position")?,
                        highest: match with_highest {
                            true => row.try_get("highest")?,
                            false => None,
                        },
                    })
                },
            )
            .await?;
        Ok(found.into_iter().next())
    }

    /// Notes where the id sequence `name` of `table` stands, and says once
    /// when it falls behind an id it had already given (unless below `read`,
    /// an id the relay read: the check's ERROR says that), and once when it
    /// has passed them again.
    fn note_position(
        &self,
        name: &str,
        table: &str,
        position: i64,
        highest: Option<i64>,
        read: i64,
    ) {
        let change = self
            .sequence_seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .note(position, highest);
        match change {
            Some(PositionChange::Behind { given }) if position >= read => tracing::warn!(
                sequence = name,
                position,
                given,
                "the id sequence {name} of {table} stands at {position}, below id {given} that it \
                 had already given (set back by setval, ALTER SEQUENCE … RESTART or TRUNCATE … \
                 RESTART IDENTITY, or rows inserted with explicit ids): the rows it numbers next \
                 reuse ids already sent as message_id, which consumers that deduplicate on it may \
                 drop, and pending rows with ids above {position} wait until it passes them (commit \
                 order); fix: SELECT setval('{name}', GREATEST({given}, (SELECT max(id) FROM \
                 {table})))"
            ),
            Some(PositionChange::Caught) => tracing::info!(
                sequence = name,
                position,
                "the id sequence {name} of {table} stands past every id it had given again"
            ),
            Some(PositionChange::Behind { .. }) | None => {}
        }
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
        self.with_sequence(|sequence| self.watch_from(sequence, watched, moved, since, span))
            .await
    }

    /// [`Store::watch`] with the sequence's oid.
    async fn watch_from(
        &self,
        sequence: i64,
        watched: i64,
        moved: bool,
        since: i64,
        span: i64,
    ) -> Result<Watched, StoreError> {
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
        self.with_sequence(|sequence| self.writers_free_from(sequence, tenants))
            .await
    }

    /// [`Store::writers_free`] with the sequence's oid.
    async fn writers_free_from(
        &self,
        sequence: i64,
        tenants: &[&str],
    ) -> Result<(i64, Vec<bool>), StoreError> {
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
        self.with_sequence(|sequence| self.writers_from(sequence, tenants))
            .await
    }

    /// [`Store::writers`] with the sequence's oid.
    async fn writers_from(&self, sequence: i64, tenants: &[&str]) -> Result<Writers, StoreError> {
        if sequence == 0 {
            return Ok(Writers {
                position: i64::MAX,
                tenants: vec![Vec::new(); tenants.len()],
                ..Writers::default()
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
                    let holders = row.try_get::<_, Vec<String>>("holders")?;
                    Ok((
                        row.try_get::<_, Option<String>>("tenant")?.is_none(),
                        holders.iter().map(|named| Holder::parse(named)).collect(),
                        row.try_get::<_, Option<i64>>("position")?,
                        row.try_get::<_, Option<String>>("started")?,
                    ))
                },
            )
            .await?;
        let mut writers = Writers::default();
        for (overall, holders, position, started) in rows {
            if overall {
                writers.all = holders;
                writers.position = position.unwrap_or_default();
                writers.started = started.unwrap_or_default();
            } else {
                writers.tenants.push(holders);
            }
        }
        Ok(writers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_behind_an_id_already_given_is_said_once_and_its_end_once() {
        let mut seen = PositionSeen::default();
        assert_eq!(
            seen.note(10, None),
            None,
            "the first check: nothing to compare"
        );
        assert_eq!(
            seen.note(15, Some(15)),
            None,
            "ascending, past the table's ids"
        );
        assert_eq!(
            seen.note(3, Some(15)),
            Some(PositionChange::Behind { given: 15 }),
            "set back"
        );
        assert_eq!(seen.note(4, Some(15)), None, "still behind: said already");
        assert_eq!(seen.note(16, Some(16)), Some(PositionChange::Caught));
        assert_eq!(seen.note(17, None), None);
    }

    #[test]
    fn a_set_back_is_seen_on_an_emptied_table_and_an_explicit_id_at_the_first_check() {
        let mut seen = PositionSeen::default();
        seen.note(500, Some(500));
        assert_eq!(
            seen.note(0, None),
            Some(PositionChange::Behind { given: 500 }),
            "TRUNCATE … RESTART IDENTITY: nothing in the table, the last position says"
        );
        let mut seen = PositionSeen::default();
        assert_eq!(
            seen.note(20, Some(1_000)),
            Some(PositionChange::Behind { given: 1_000 }),
            "a row inserted with an id the sequence never gave"
        );
    }

    #[test]
    fn a_holder_is_known_by_its_xid_once_it_has_one() {
        let before_xid = Holder::parse("7/20");
        let with_xid = Holder::parse("7/20 882");
        let prepared = Holder::parse("-1/882 882");
        let recovered = Holder::parse("-1/5 882");
        assert!(
            with_xid.is(&before_xid),
            "the same transaction, its xid now drawn"
        );
        assert!(
            prepared.is(&with_xid),
            "prepared: another vxid, the same xid"
        );
        assert!(recovered.is(&with_xid), "recovered at start-up");
        assert!(
            !Holder::parse("7/20 900").is(&with_xid),
            "after a restart, another transaction under that vxid"
        );
        assert!(!Holder::parse("8/3").is(&before_xid));
    }

    #[test]
    fn it_has_caught_up_only_past_the_highest_id_it_had_given() {
        let mut seen = PositionSeen::default();
        seen.note(602, Some(602));
        assert_eq!(
            seen.note(20, Some(20)),
            Some(PositionChange::Behind { given: 602 }),
            "TRUNCATE … RESTART IDENTITY, rows written again"
        );
        assert_eq!(
            seen.note(380, Some(380)),
            None,
            "still below 602, though past the table's ids"
        );
        assert_eq!(seen.note(601, Some(601)), None);
        assert_eq!(seen.note(602, Some(602)), Some(PositionChange::Caught));
    }
}
