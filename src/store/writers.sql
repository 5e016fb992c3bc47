-- Which transactions hold the writers' lock of each of these tenants (see
-- claim.sql), and where the id sequence stood just before: the scheduler's
-- check for tenants whose writers were in flight. Once every transaction
-- named here has ended, every id up to `position` of the tenant is committed
-- or gone. The position is read first (OFFSET 0 keeps each subquery a step
-- of its own, and the lateral one runs for the row of the first, after it);
-- pg_locks is read once for all tenants: it visits every lock partition of
-- the server, and lock requests wait meanwhile. Holders are told by
-- `virtualtransaction`, never by pid: a pooled backend's pid holds a busy
-- tenant's lock across back-to-back transactions, and a prepared transaction
-- has none. A writer still waiting for the lock has drawn no id yet: only
-- granted locks count.
-- $1 = '<schema>.<table>', $2 = the id sequence's oid, $3 = the tenants.
-- A first row with no tenant: every holder of any tenant's lock of the table
-- (by tenant hash), and the position. Then one row per tenant given, with
-- the holders of its lock (empty when none).
WITH held AS MATERIALIZED (
    SELECT p.position, h.objid, h.holder
    FROM (SELECT COALESCE(pg_sequence_last_value($2::bigint::oid::regclass), 0) AS position
          OFFSET 0) p
    LEFT JOIN LATERAL (
        SELECT l.objid::bigint AS objid, l.virtualtransaction AS holder
        FROM pg_locks l
        WHERE p.position IS NOT NULL
          AND l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid::bigint = (hashtext($1)::bigint & 4294967295)
        OFFSET 0
    ) h ON true
)
SELECT NULL::text AS tenant,
       ARRAY(SELECT h.holder FROM held h WHERE h.holder IS NOT NULL) AS holders,
       (SELECT max(h.position) FROM held h) AS position,
       0::bigint AS n
UNION ALL
SELECT t.tenant,
       ARRAY(SELECT h.holder FROM held h
             WHERE h.objid = (hashtext(t.tenant)::bigint & 4294967295)),
       NULL,
       t.n
FROM unnest($3::text[]) WITH ORDINALITY AS t(tenant, n)
ORDER BY n
