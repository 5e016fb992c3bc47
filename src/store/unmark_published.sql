-- Undo marks made ahead of the commit (see Claim::mark_ahead) for rows that,
-- once the whole batch was settled, turned out not to be in its confirmed
-- prefix (a refusal reported late). Same transaction: the marks were never
-- visible. $1 = ids.
UPDATE {table}
SET published_at = NULL
WHERE id = ANY($1)
