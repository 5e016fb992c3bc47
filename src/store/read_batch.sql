-- The tenant's oldest pending rows, in outbox order. $1 = tenant, $2 = batch size.
SELECT id, kind, subject_id, payload::text, headers::jsonb, occurred_at
FROM {table}
WHERE tenant_id = $1 AND published_at IS NULL
ORDER BY id
LIMIT $2
