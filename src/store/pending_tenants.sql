-- The tenants that have pending rows, with the age of each one's oldest pending
-- row by the database's clock. A loose index scan over the partial index: its
-- cost grows with the number of tenants that have work, not with the number
-- configured, so an idle relay pays one cheap statement per poll.
WITH RECURSIVE pending(tenant_id) AS (
    (SELECT tenant_id FROM {table}
     WHERE published_at IS NULL
     ORDER BY tenant_id LIMIT 1)
    UNION ALL
    SELECT (SELECT o.tenant_id FROM {table} o
            WHERE o.published_at IS NULL AND o.tenant_id > p.tenant_id
            ORDER BY o.tenant_id LIMIT 1)
    FROM pending p
    WHERE p.tenant_id IS NOT NULL
)
SELECT p.tenant_id,
       GREATEST((EXTRACT(EPOCH FROM (clock_timestamp() - oldest.occurred_at)) * 1000)::bigint, 0) AS lag_ms
FROM pending p
CROSS JOIN LATERAL (
    SELECT o.occurred_at FROM {table} o
    WHERE o.tenant_id >= p.tenant_id AND o.tenant_id <= p.tenant_id AND o.published_at IS NULL
    ORDER BY o.tenant_id, o.id LIMIT 1
) oldest
WHERE p.tenant_id IS NOT NULL
