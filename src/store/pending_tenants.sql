-- The tenants that have pending rows, with the age of each one's oldest pending
-- row by the database's clock. A loose index scan over the partial index: each
-- step finds the next tenant's lowest pending id, which is also its oldest row
-- in outbox order, so one probe per tenant gives both. Its cost grows with the
-- number of tenants that have work, not with the number configured, so an idle
-- relay pays one cheap statement per poll.
WITH RECURSIVE pending(tenant_id, occurred_at) AS (
    (SELECT tenant_id, occurred_at FROM {table}
     WHERE published_at IS NULL
     ORDER BY tenant_id, id LIMIT 1)
    UNION ALL
    SELECT next.tenant_id, next.occurred_at
    FROM pending p
    CROSS JOIN LATERAL (
        SELECT o.tenant_id, o.occurred_at FROM {table} o
        WHERE o.published_at IS NULL AND o.tenant_id > p.tenant_id
        ORDER BY o.tenant_id, o.id LIMIT 1
    ) next
)
SELECT tenant_id,
       GREATEST((EXTRACT(EPOCH FROM (clock_timestamp() - occurred_at)) * 1000)::bigint, 0) AS lag_ms
FROM pending
