-- Which transactions hold the writers' lock of each of these tenants (see
-- claim.sql), and where the id sequence stood just before: the scheduler's
-- check for tenants whose writers were in flight. Once every transaction
-- named here has ended, every id up to `position` of the tenant is committed
-- or gone. The position is read first (OFFSET 0 keeps each subquery a step
-- of its own, and the lateral one runs for the row of the first, after it);
-- pg_locks is read once for all tenants, in one pass: it visits every lock
-- partition of the server, and lock requests wait meanwhile. A holder is
-- named `<virtualtransaction>` or, once it has an xid, `<virtualtransaction>
-- <xid>`: its xid is the granted ExclusiveLock on a transactionid of the same
-- virtualtransaction (the lowest: a subtransaction's comes after its
-- parent's), the advisory row carrying none. The xid is what a prepared
-- transaction keeps across a restart or a failover (it is
-- pg_prepared_xacts.transaction), when its virtualtransaction changes; never
-- the pid: a pooled backend's pid holds a busy tenant's lock across
-- back-to-back transactions, and a prepared transaction has none. A writer
-- still waiting for the lock has drawn no id yet: only granted locks count.
-- Beside them, the server's start time: holders belong to one instance.
-- $1 = '<schema>.<table>', $2 = the id sequence's oid, $3 = the tenants.
-- A first row with no tenant: every holder of any tenant's lock of the table
-- (by tenant hash), the position and the start time. Then one row per tenant
-- given, with the holders of its lock (empty when none).
WITH held AS MATERIALIZED (
    SELECT p.position, h.objid, h.holder
    FROM (SELECT COALESCE(pg_sequence_last_value($2::bigint::oid::regclass), 0) AS position
          OFFSET 0) p
    LEFT JOIN LATERAL (
        SELECT u.objid, v.holder
        FROM (SELECT l.virtualtransaction
                     || COALESCE(' ' || min(l.transactionid::text::bigint)
                                 FILTER (WHERE l.locktype = 'transactionid'), '') AS holder,
                     array_agg(l.objid::bigint) FILTER (WHERE l.locktype = 'advisory') AS objids
              FROM pg_locks l
              WHERE p.position IS NOT NULL AND l.granted
                AND ((l.locktype = 'advisory' AND l.objsubid = 1
                      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                      AND l.classid::bigint = (hashtext($1)::bigint & 4294967295))
                     OR (l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock'))
              GROUP BY l.virtualtransaction
              HAVING bool_or(l.locktype = 'advisory')
              OFFSET 0) v
        CROSS JOIN LATERAL unnest(v.objids) AS u(objid)
    ) h ON true
)
SELECT NULL::text AS tenant,
       ARRAY(SELECT DISTINCT h.holder FROM held h WHERE h.holder IS NOT NULL) AS holders,
       (SELECT max(h.position) FROM held h) AS position,
       pg_postmaster_start_time()::text AS started,
       0::bigint AS n
UNION ALL
SELECT t.tenant,
       ARRAY(SELECT h.holder FROM held h
             WHERE h.objid = (hashtext(t.tenant)::bigint & 4294967295)),
       NULL,
       NULL,
       t.n
FROM unnest($3::text[]) WITH ORDINALITY AS t(tenant, n)
ORDER BY n
