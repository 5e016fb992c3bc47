-- `wakeup = sequence`, between moves: where the id sequence stands (0 when
-- the table has none), alone. Far cheaper for the server to plan than
-- watch.sql, which is sent instead once the position has moved, or when the
-- last read saw it move. $1 = the id sequence's oid.
SELECT CASE WHEN $1::bigint = 0 THEN 0
            ELSE COALESCE(pg_sequence_last_value($1::bigint::oid::regclass), 0) END
