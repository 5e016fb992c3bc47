-- Record why a row was refused; it stays pending. $1 = id, $2 = reason.
UPDATE {table}
SET attempts = attempts + 1, last_error = $2
WHERE id = $1
