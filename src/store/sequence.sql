-- The outbox table's id sequence, for commit order (see claim.sql): its name
-- and the settings a safe bound needs. The relay reads the sequence's position
-- and takes every id at or below it as drawn; that holds only with `CACHE 1`
-- (with a cache, one draw shows the end of the session's cached range to every
-- other session), a positive increment and no cycle. Beside them, whether this
-- role may read the position, and the position (0 when no id is drawn since
-- it was created or restarted; NULL when not readable). No row: its id
-- column draws from no sequence (a missing table fails, SQLSTATE 42P01).
-- $1 = '"schema"."table"'. Once the table is known, the check also reads the
-- table's highest id beside it (`Statements::sequence_highest`).
SELECT s.seqrelid::regclass::text AS sequence,
       s.seqrelid::bigint AS sequence_oid,
       s.seqcache AS cache,
       s.seqincrement AS increment,
       s.seqcycle AS cycles,
       has_sequence_privilege(s.seqrelid, 'SELECT') AS readable,
       CASE WHEN has_sequence_privilege(s.seqrelid, 'SELECT')
            THEN COALESCE(pg_sequence_last_value(s.seqrelid), 0) END AS position
FROM pg_sequence s
WHERE s.seqrelid = to_regclass(pg_get_serial_sequence($1, 'id'))
