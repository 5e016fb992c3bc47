-- Mark the confirmed prefix of a batch. $1 = ids.
--
-- Idempotent without a `published_at IS NULL` condition: a row published
-- already keeps its time. The condition would match the partial index's
-- predicate, and with a generic plan (or fresh statistics) the planner could
-- then scan that whole index for each mark, its leading column being
-- tenant_id; without it, only the primary key can serve `id = ANY($1)`.
UPDATE {table}
SET published_at = COALESCE(published_at, now())
WHERE id = ANY($1)
