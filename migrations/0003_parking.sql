-- Parking (see `park_after_attempts`): a row refused for its own sake
-- (`too_large`, `invalid`) that reached its attempts is parked, stays in the
-- table with its `last_error`, and no longer holds up its tenant.
-- `outbox-relay discard` ends a parked row unsent: `discarded_at` records
-- when (the row keeps `parked_at`; it is never pending, never published, and
-- `replay` skips it). Nullable columns without a default: adding them
-- rewrites nothing, whatever the table's size.
ALTER TABLE outbox_message
    ADD COLUMN IF NOT EXISTS parked_at    TIMESTAMPTZ,
    ADD COLUMN IF NOT EXISTS discarded_at TIMESTAMPTZ;
