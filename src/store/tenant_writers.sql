-- Who holds each of these tenants' writers' lock (see claim.sql), for
-- `outbox-relay status`: a tenant whose rows wait for writers in flight is
-- shown with them. pg_locks is read once. A holder's advisory row carries no
-- transaction id: its xid is among the `transactionid` locks of the same
-- virtualtransaction (with those of its subtransactions), and a prepared
-- transaction is the row of pg_prepared_xacts with that xid (its pid is NULL; the runbook's query
-- joins the same way). `twins`: the other tenants given whose names share the
-- tenant's hashtext, and so its writers' lock: the holder may be a writer of
-- theirs. $1 = '<schema>.<table>', $2 = the tenants. One row per tenant and
-- holder (the holder's columns NULL when there is none), by the tenant's
-- place in $2 (from 1).
WITH locks AS MATERIALIZED (
    SELECT l.locktype, l.virtualtransaction, l.pid, l.objid, l.transactionid
    FROM pg_locks l
    WHERE l.granted
      AND (l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock'
           OR l.locktype = 'advisory' AND l.objsubid = 1
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::bigint = (hashtext($1)::bigint & 4294967295))
),
tenants AS (
    SELECT u.tenant, u.n, hashtext(u.tenant) AS hash
    FROM unnest($2::text[]) WITH ORDINALITY AS u(tenant, n)
)
SELECT t.n,
       ARRAY(SELECT o.tenant FROM tenants o
             WHERE o.hash = t.hash AND o.tenant <> t.tenant ORDER BY o.n) AS twins,
       w.virtualtransaction IS NOT NULL AS held,
       w.pid,
       to_char(a.xact_start AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"') AS xact_start,
       (date_part('epoch', clock_timestamp() - a.xact_start) * 1000)::bigint AS open_ms,
       p.gid,
       to_char(p.prepared AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"') AS prepared,
       (date_part('epoch', clock_timestamp() - p.prepared) * 1000)::bigint AS prepared_ms
FROM tenants t
LEFT JOIN locks w
       ON w.locktype = 'advisory' AND w.objid::bigint = (t.hash::bigint & 4294967295)
LEFT JOIN pg_prepared_xacts p
       ON p.transaction IN (SELECT x.transactionid FROM locks x
                            WHERE x.locktype = 'transactionid'
                              AND x.virtualtransaction = w.virtualtransaction)
LEFT JOIN pg_stat_activity a ON a.pid = w.pid
ORDER BY t.n, p.prepared, a.xact_start
