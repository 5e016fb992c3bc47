-- Each configured tenant as an operator sees it: pending rows, lag, and its
-- lowest pending row (the one that blocks it when it is refused), with its
-- attempts and last_error. For `outbox-relay status`. The lag is computed as
-- in pending_tenants.sql (epochs in double precision, clamped to 0 … 10,000
-- years), so any `occurred_at` gives one. $1 = tenants.
SELECT t.tenant_id,
       (SELECT count(*) FROM {table} c
        WHERE c.tenant_id >= t.tenant_id AND c.tenant_id <= t.tenant_id AND c.published_at IS NULL) AS pending,
       (GREATEST(LEAST(COALESCE(date_part('epoch', clock_timestamp()) - date_part('epoch', oldest.occurred_at), 0),
                                315576000000), 0) * 1000)::bigint AS lag_ms,
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
