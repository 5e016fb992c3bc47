-- The tenant's oldest pending rows, in outbox order, if this transaction holds
-- the tenant (see claim.sql). $1 = tenant, $2 = batch size.
--
-- `tenant_id` is bounded by a range rather than `=`, and the order is written as
-- (tenant_id, id): only the partial index (tenant_id, id) WHERE published_at IS
-- NULL yields that order, so the plan cannot fall back to walking the primary
-- key and filtering past millions of published rows, whatever the server's cost
-- settings or statistics. (With `=`, tenant_id is a constant to the planner and
-- the primary key's order is just as good to it.)
SELECT id, kind, subject_id, payload::text, headers::jsonb, occurred_at
FROM {table}
WHERE current_setting('outbox_relay.claimed', true) = 'true'
  AND tenant_id >= $1 AND tenant_id <= $1 AND published_at IS NULL
ORDER BY tenant_id, id
LIMIT $2
