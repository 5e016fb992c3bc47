-- Mark the confirmed prefix of a batch; the rows it left published. $1 = ids.
--
-- Idempotent without a `published_at IS NULL` condition: a row published
-- already keeps its time. The condition would match the partial index's
-- predicate, and with a generic plan (or fresh statistics) the planner could
-- then scan that whole index for each mark, its leading column being
-- tenant_id; without it, only the primary key can serve `id = ANY($1)`.
--
-- The count is of the rows as stored, after the table's BEFORE UPDATE
-- triggers: one that returns NULL leaves a row out, and one that keeps
-- `published_at` NULL (returning OLD, say) leaves it pending although the
-- update counts it. Fewer than named sends the settlement to see which of
-- its rows are still pending (still_pending.sql).
WITH marked AS (
    UPDATE {table}
    SET published_at = COALESCE(published_at, now())
    WHERE id = ANY($1)
    RETURNING published_at
)
SELECT count(*) FROM marked WHERE published_at IS NOT NULL
