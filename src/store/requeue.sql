-- `outbox-relay requeue --id`: a parked row (not discarded, not published)
-- becomes pending again, its attempts back to 0 (its last_error stays). It
-- goes out next of its tenant's pending rows, after rows already published
-- since it was parked. $1 = id.
-- Each requeued tenant's relays are notified, as the table's trigger does for
-- an insert (a name of 8000 bytes or more as '', "poll now"), so the rows go
-- out at once rather than at the next poll; the notification is sent at
-- commit, and folded into one per tenant.
WITH requeued AS (
    UPDATE {table}
    SET parked_at = NULL, attempts = 0
    WHERE id = $1 AND parked_at IS NOT NULL AND discarded_at IS NULL AND published_at IS NULL
    RETURNING id, tenant_id
)
SELECT id, tenant_id,
       pg_notify({channel}, CASE WHEN octet_length(tenant_id) < 8000 THEN tenant_id ELSE '' END)
FROM requeued
