-- Of rows the relay marked published in a transaction that committed, those
-- still pending: the mark left fewer rows published than it named, and a
-- row it skipped may have been deleted meanwhile (nothing to resend) or kept
-- from the mark by the table (a BEFORE UPDATE trigger returning NULL or
-- keeping published_at NULL, a row-level security policy). Run only then.
-- $1 = ids.
SELECT count(*) AS pending, min(id) AS first
FROM {table}
WHERE id = ANY($1) AND published_at IS NULL
