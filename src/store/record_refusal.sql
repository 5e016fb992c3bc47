-- Record why a row did not go out; it stays pending. $1 = id, $2 = reason,
-- $3 = 1 for a refused publish, 0 for a lost connection (not the row's fault).
UPDATE {table}
SET attempts = attempts + $3, last_error = $2
WHERE id = $1
