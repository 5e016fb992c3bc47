-- `outbox-relay requeue --tenant`: every parked row of the tenant (not
-- discarded) becomes pending again, as requeue.sql does for one. Found through
-- the index of parked rows. $1 = tenant.
UPDATE {table}
SET parked_at = NULL, attempts = 0
WHERE tenant_id = $1 AND parked_at IS NOT NULL AND discarded_at IS NULL AND published_at IS NULL
RETURNING id, tenant_id
