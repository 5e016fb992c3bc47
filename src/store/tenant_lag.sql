-- Each configured tenant's lowest pending id and lag: the age of that row by
-- the database's clock, 0 when nothing is pending. One statement for all
-- tenants, one index probe each (written as in read_batch.sql, so the probe is
-- always the partial index). The age is computed as in pending_tenants.sql:
-- epochs in double precision, clamped to 0 … 10,000 years, so any
-- `occurred_at` (infinite, ancient, future) gives a lag; 0 when nothing is
-- pending (GREATEST and LEAST skip NULLs, hence the COALESCE inside). $1 = tenants.
SELECT t.tenant_id,
       oldest.id,
       (GREATEST(LEAST(COALESCE(date_part('epoch', clock_timestamp()) - date_part('epoch', oldest.occurred_at), 0),
                                315576000000), 0) * 1000)::bigint AS lag_ms
FROM unnest($1::text[]) WITH ORDINALITY AS t(tenant_id, n)
LEFT JOIN LATERAL (
    SELECT o.id, o.occurred_at FROM {table} o
    WHERE o.tenant_id >= t.tenant_id AND o.tenant_id <= t.tenant_id AND o.published_at IS NULL
      AND o.parked_at IS NULL -- lifecycle
    ORDER BY o.tenant_id, o.id LIMIT 1
) oldest ON true
ORDER BY t.n
