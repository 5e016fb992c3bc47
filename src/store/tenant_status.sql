-- Each configured tenant as an operator sees it: pending rows, lag, and its
-- lowest pending row (the one that blocks it when it is refused), with its
-- attempts and last_error, and its parked rows (not discarded). For
-- `outbox-relay status`. The lag is computed as in pending_tenants.sql
-- (epochs in double precision, clamped to 0 … 10,000 years), so any
-- `occurred_at` gives one. A parked row is neither pending nor blocking.
-- Lines marked `lifecycle`/`legacy`: see pending_tenants.sql. $1 = tenants.
SELECT t.tenant_id,
       (SELECT count(*) FROM {table} c
        WHERE c.tenant_id >= t.tenant_id AND c.tenant_id <= t.tenant_id AND c.published_at IS NULL
          AND c.parked_at IS NULL -- lifecycle
       ) AS pending,
       (GREATEST(LEAST(COALESCE(date_part('epoch', clock_timestamp()) - date_part('epoch', oldest.occurred_at), 0),
                                315576000000), 0) * 1000)::bigint AS lag_ms,
       oldest.id,
       oldest.attempts,
       oldest.last_error,
       (SELECT count(*) FROM {table} p -- lifecycle
        WHERE p.tenant_id = t.tenant_id AND p.parked_at IS NOT NULL AND p.discarded_at IS NULL -- lifecycle
       ) AS parked -- lifecycle
       0::bigint AS parked -- legacy
FROM unnest($1::text[]) WITH ORDINALITY AS t(tenant_id, n)
LEFT JOIN LATERAL (
    SELECT o.id, o.attempts, o.last_error, o.occurred_at FROM {table} o
    WHERE o.tenant_id >= t.tenant_id AND o.tenant_id <= t.tenant_id AND o.published_at IS NULL
      AND o.parked_at IS NULL -- lifecycle
    ORDER BY o.tenant_id, o.id LIMIT 1
) oldest ON true
ORDER BY t.n
