-- Whether any writer of each of these tenants is in flight, and where the id
-- sequence stood just before: the scheduler's cheap check for deferred
-- tenants, between its reads of pg_locks (writers.sql). As the claim does
-- (claim.sql): the position first (a subquery of its own, OFFSET 0, which
-- the lateral one follows), then per tenant a session-level try of the
-- writers' key, given back at once. A free tenant's ids up to the position
-- are committed or gone. $1 = '<schema>.<table>', $2 = the id sequence's oid,
-- $3 = the tenants. One row per tenant, in the order given.
SELECT t.tenant,
       CASE WHEN pg_try_advisory_lock(t.writer_key)
            THEN pg_advisory_unlock(t.writer_key)
            ELSE false END AS free,
       p.position
FROM (SELECT COALESCE(pg_sequence_last_value($2::bigint::oid::regclass), 0) AS position
      OFFSET 0) p
CROSS JOIN LATERAL (
    SELECT u.tenant, u.n,
           (hashtext($1)::bigint << 32) | (hashtext(u.tenant)::bigint & 4294967295) AS writer_key
    FROM unnest($3::text[]) WITH ORDINALITY AS u(tenant, n)
    WHERE p.position IS NOT NULL
    OFFSET 0
) t
ORDER BY t.n
