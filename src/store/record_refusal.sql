-- Record why a row did not go out; it stays pending. Only for a refusal known
-- to be the row's (Refusal::attributed): a failure it shared with other rows
-- is written on none of them. $1 = id, $2 = reason, $3 = 1 for the row's own
-- refusal (nack, unroutable, too_large, invalid), 0 for a timeout or a lost
-- connection that met it alone (not the row's doing).
UPDATE {table}
SET attempts = attempts + $3, last_error = $2
WHERE id = $1
