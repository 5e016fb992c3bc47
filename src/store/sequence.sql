-- The outbox table's id sequence, for commit order (see claim.sql): its name
-- and the settings a safe bound needs. The relay reads the sequence's position
-- and takes every id at or below it as drawn; that holds only with `CACHE 1`
-- (with a cache, one draw shows the end of the session's cached range to every
-- other session), a positive increment and no cycle. Beside them, whether this
-- role may read the position. No row: the table does not exist (yet), or its
-- id column draws from no sequence. $1 = '"schema"."table"'.
SELECT s.seqrelid::regclass::text AS sequence,
       s.seqrelid::bigint AS sequence_oid,
       s.seqcache AS cache,
       s.seqincrement AS increment,
       s.seqcycle AS cycles,
       has_sequence_privilege(s.seqrelid, 'SELECT') AS readable
FROM pg_sequence s
WHERE s.seqrelid = to_regclass(pg_get_serial_sequence($1, 'id'))
