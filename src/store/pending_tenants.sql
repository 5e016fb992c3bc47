-- The tenants that have pending rows, each with its lowest pending id and the
-- age of that row by the database's clock. A loose index scan over the partial
-- index: each step finds the next tenant's lowest pending id, which is also its
-- oldest row in outbox order, so one probe per tenant gives both. Its cost
-- grows with the number of tenants that have work, not with the number
-- configured, so an idle relay pays one cheap statement per poll.
--
-- The age is a difference of epochs in double precision, never of timestamps
-- (`infinity` cannot be subtracted), clamped to 0 … 10,000 years in seconds:
-- `-infinity` is older than any finite row, `infinity` and the future are 0
-- (and so is a NULL, which the contract's table does not allow).
-- The same expression is in tenant_lag.sql and tenant_status.sql.
--
-- The same statement names the replicas of this table (the members): the
-- application_name of each one's LISTEN connection (wakeup = notify) or of
-- its pool's sessions (wakeup = poll),
-- `outbox-relay:<channel hash>:<tenants hash>:<instance id>:u<level>`,
-- matched by $1, in this database (notifications do not cross databases).
-- Every role may read other sessions' application_name (pg_stat_activity's
-- own function, read directly: the view joins pg_database by a scan). These
-- rows have no tenant_id (which the table never has NULL). One statement per
-- poll either way.
--
-- And whether the server takes writes (a last row with only `writable`): a
-- pool left on a primary demoted in a failover (reads still work there)
-- notices it, in the poll's own statement, so an idle relay sends one
-- statement (one transaction) per poll.
--
-- And each tenant's count of parked rows (not discarded), for
-- `outbox_parked_rows`: rows with a tenant_id, no id and a `parked` count,
-- read from the small partial index of parked rows (the parked ones only).
-- Under cost settings that make a sequential page 10,000 times cheaper than
-- a random one, the planner may scan a small table instead; a large one
-- (over about 20,000 pages) is read through the index even then.
--
-- Paged: at most $4 tenants, from the first tenant after $2 (or from $2 on,
-- with $3), in the order of the index (the column's collation). The
-- recursion stops at the limit, so a poll's cost is bounded however many
-- tenants are pending; the next poll goes on after the page's last tenant.
--
-- A line marked `lifecycle` is left out, here and in every statement, when
-- the table has no `parked_at` and `discarded_at` yet (migration 0003 not
-- applied); a line marked `legacy` is there only then.
WITH RECURSIVE pending(tenant_id, id, occurred_at) AS (
    (SELECT tenant_id, id, occurred_at FROM {table}
     WHERE published_at IS NULL
       AND parked_at IS NULL -- lifecycle
       AND tenant_id >= $2 AND (tenant_id > $2 OR $3)
     ORDER BY tenant_id, id LIMIT 1)
    UNION ALL
    SELECT next.tenant_id, next.id, next.occurred_at
    FROM pending p
    CROSS JOIN LATERAL (
        SELECT o.tenant_id, o.id, o.occurred_at FROM {table} o
        WHERE o.published_at IS NULL AND o.tenant_id > p.tenant_id
          AND o.parked_at IS NULL -- lifecycle
        ORDER BY o.tenant_id, o.id LIMIT 1
    ) next
)
(SELECT tenant_id,
        id,
        (GREATEST(LEAST(COALESCE(date_part('epoch', clock_timestamp()) - date_part('epoch', occurred_at), 0),
                        315576000000), 0) * 1000)::bigint AS lag_ms,
        NULL::text AS listener,
        NULL::bigint AS parked,
        NULL::boolean AS writable
 FROM pending
 LIMIT $4)
UNION ALL -- lifecycle (parked count)
SELECT tenant_id, NULL, NULL, NULL, count(*), NULL -- lifecycle (parked count)
FROM {table} -- lifecycle (parked count)
WHERE parked_at IS NOT NULL AND discarded_at IS NULL -- lifecycle (parked count)
GROUP BY tenant_id -- lifecycle (parked count)
UNION ALL
SELECT NULL, NULL, NULL, session.application_name, NULL, NULL
FROM pg_stat_get_activity(NULL) session
WHERE session.application_name LIKE $1
  AND session.datid = (SELECT datid FROM pg_stat_get_activity(pg_backend_pid()))
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NOT current_setting('transaction_read_only')::boolean
