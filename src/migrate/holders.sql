-- Who holds the outbox table (or one of its partitions) in a mode that a
-- migration's DDL waits for: each other transaction with a granted lock on
-- it, oldest first. A prepared transaction has no pid in pg_locks (and
-- pg_blocking_pids() reports it as 0): it is named by its gid, found through
-- its xid, the `transactionid` lock of the same virtual transaction.
-- $1 = '"schema"."table"'; $2 = the modes the DDL does not wait for.
SELECT l.mode,
       l.pid,
       p.gid,
       date_trunc('second', COALESCE(p.prepared, a.xact_start))::text AS since
FROM pg_locks l
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
LEFT JOIN pg_locks x
       ON l.pid IS NULL AND x.locktype = 'transactionid'
      AND x.virtualtransaction = l.virtualtransaction
LEFT JOIN pg_prepared_xacts p ON p.transaction = x.transactionid
WHERE l.locktype = 'relation' AND l.granted
  AND (l.relation = to_regclass($1)
       OR l.relation IN (SELECT relid FROM pg_partition_tree(to_regclass($1))))
  AND l.pid IS DISTINCT FROM pg_backend_pid()
  AND NOT l.mode = ANY($2)
ORDER BY COALESCE(p.prepared, a.xact_start) NULLS LAST
LIMIT 5
