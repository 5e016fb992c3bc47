-- Each configured tenant's lag: the age of its lowest pending id by the
-- database's clock, 0 when nothing is pending. One statement for all tenants,
-- one index probe each (written as in read_batch.sql, so the probe is always
-- the partial index). $1 = tenants.
SELECT t.tenant_id,
       oldest.occurred_at IS NOT NULL AS pending,
       GREATEST(COALESCE((EXTRACT(EPOCH FROM (clock_timestamp() - oldest.occurred_at)) * 1000)::bigint, 0), 0) AS lag_ms
FROM unnest($1::text[]) WITH ORDINALITY AS t(tenant_id, n)
LEFT JOIN LATERAL (
    SELECT o.occurred_at FROM {table} o
    WHERE o.tenant_id >= t.tenant_id AND o.tenant_id <= t.tenant_id AND o.published_at IS NULL
    ORDER BY o.tenant_id, o.id LIMIT 1
) oldest ON true
ORDER BY t.n
