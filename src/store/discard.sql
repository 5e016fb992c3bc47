-- `outbox-relay discard --id`: ends a parked row without sending it. It
-- stays in the table with its parked_at and last_error, and discarded_at says
-- when it was ended: never pending again, never published, skipped by
-- `replay`, and no longer counted in `outbox_parked_rows`. $1 = id.
UPDATE {table}
SET discarded_at = now()
WHERE id = $1 AND parked_at IS NOT NULL AND discarded_at IS NULL AND published_at IS NULL
RETURNING id, tenant_id
