-- `outbox-relay requeue --tenant`: every parked row of the tenant (not
-- discarded) becomes pending again, as requeue.sql does for one. Found through
-- the index of parked rows. $1 = tenant.
-- Each requeued tenant's relays are notified, as the table's trigger does for
-- an insert (a name of 8000 bytes or more as '', "poll now"), so the rows go
-- out at once rather than at the next poll; the notification is sent at
-- commit, and folded into one per tenant.
WITH requeued AS (
    UPDATE {table}
    SET parked_at = NULL, attempts = 0
    WHERE tenant_id = $1 AND parked_at IS NOT NULL AND discarded_at IS NULL AND published_at IS NULL
    RETURNING id, tenant_id
)
SELECT id, tenant_id,
       pg_notify({channel}, CASE WHEN octet_length(tenant_id) < 8000 THEN tenant_id ELSE '' END)
FROM requeued
