-- Each configured tenant as an operator sees it: pending rows, lag, and its
-- lowest pending row (the one that blocks it when it is refused), with its
-- attempts and last_error. For `outbox-relay status`. $1 = tenants.
SELECT t.tenant_id,
       (SELECT count(*) FROM {table} c
        WHERE c.tenant_id >= t.tenant_id AND c.tenant_id <= t.tenant_id AND c.published_at IS NULL) AS pending,
       GREATEST(COALESCE((EXTRACT(EPOCH FROM (clock_timestamp() - oldest.occurred_at)) * 1000)::bigint, 0), 0) AS lag_ms,
       oldest.id,
       oldest.attempts,
       oldest.last_error
FROM unnest($1::text[]) WITH ORDINALITY AS t(tenant_id, n)
LEFT JOIN LATERAL (
    SELECT o.id, o.attempts, o.last_error, o.occurred_at FROM {table} o
    WHERE o.tenant_id >= t.tenant_id AND o.tenant_id <= t.tenant_id AND o.published_at IS NULL
    ORDER BY o.tenant_id, o.id LIMIT 1
) oldest ON true
ORDER BY t.n
