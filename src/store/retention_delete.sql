-- One batch of retention: the next $2 rows of the table in primary-key order
-- after id $1, of which those that ended (published, or discarded) longer
-- ago than $3 ms are deleted. A pending or parked row is never deleted.
-- `{ended_o}` / `{ended_t}` stand for when a row ended, as the table's
-- columns allow (see retention.rs): `published_at` (NULL while pending);
-- NULL while `parked_at` is set; `discarded_at` first where that column
-- exists.
--
-- The walk needs no index but the primary key, so no write pays for it: a
-- round starts at the lowest id, and rows leave the table in about id
-- order, so each round looks at what it deletes, the old rows still
-- pending or parked, and one batch more. The ended time is checked again
-- on the row being deleted (`t`), so a row changed since it was looked at
-- is judged as it is now.
--
-- Returns how many rows were looked at, the last id looked at (the next
-- batch starts after it), how many were deleted, and how many had ended too
-- recently to go (a batch with only those ends the round).
WITH scanned AS (
    SELECT o.id, {ended_o} AS ended_at FROM {table} o
    WHERE o.id > $1::bigint
    ORDER BY o.id
    LIMIT $2::bigint
), deleted AS (
    DELETE FROM {table} t
    USING scanned s
    WHERE t.id = s.id
      AND {ended_t} < now() - $3::bigint * interval '1 millisecond'
    RETURNING t.id
)
SELECT (SELECT count(*) FROM scanned) AS scanned,
       (SELECT max(id) FROM scanned) AS last_id,
       (SELECT count(*) FROM deleted) AS deleted,
       (SELECT count(*) FROM scanned
        WHERE ended_at >= now() - $3::bigint * interval '1 millisecond') AS recent
