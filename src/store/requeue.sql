-- `outbox-relay requeue --id`: a parked row (not discarded, not published)
-- becomes pending again, its attempts back to 0 (its last_error stays). It
-- goes out next of its tenant's pending rows, after rows already published
-- since it was parked. $1 = id.
UPDATE {table}
SET parked_at = NULL, attempts = 0
WHERE id = $1 AND parked_at IS NOT NULL AND discarded_at IS NULL AND published_at IS NULL
RETURNING id, tenant_id
