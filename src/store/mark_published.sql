-- Mark the confirmed prefix of a batch. $1 = ids.
UPDATE {table}
SET published_at = now()
WHERE id = ANY($1) AND published_at IS NULL
