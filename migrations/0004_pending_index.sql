-- outbox-relay: no-transaction
-- The pending index without parked rows, built beside the old one and put in
-- its place under the same name, without blocking writers; and a small index
-- of the parked rows, for the poll's count of them (`outbox_parked_rows`).
-- A partitioned table cannot build an index CONCURRENTLY (PostgreSQL 15):
-- `migrate` and the printed script build it there without the keyword,
-- which holds writers out of the table while the index is built.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_message_pending_unparked
    ON outbox_message (tenant_id, id) WHERE published_at IS NULL AND parked_at IS NULL;
DROP INDEX CONCURRENTLY IF EXISTS outbox_message_pending;
ALTER INDEX outbox_message_pending_unparked RENAME TO outbox_message_pending;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_message_parked
    ON outbox_message (tenant_id) WHERE parked_at IS NOT NULL AND discarded_at IS NULL;
