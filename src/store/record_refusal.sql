-- Record why a row did not go out; it stays pending, or is parked. Only for a
-- refusal known to be the row's (Refusal::attributed): a failure it shared
-- with other rows is written on none of them. $1 = id, $2 = reason, $3 = 1
-- for the row's own refusal (nack, unroutable, too_large, invalid), 0 for a
-- timeout or a lost connection that met it alone (not the row's doing),
-- $4 = the attempts at which this refusal parks the row (park_after_attempts
-- for `too_large` and `invalid`; 0, never, for any other reason or when
-- parking is off). Returns the row's attempts and whether it is now parked.
-- Lines marked `lifecycle`/`legacy`: see pending_tenants.sql.
UPDATE {table}
SET attempts = attempts + $3, last_error = $2
  , parked_at = CASE WHEN $4::int > 0 AND attempts + $3 >= $4::int THEN now() END -- lifecycle
WHERE id = $1
RETURNING attempts,
          parked_at IS NOT NULL AS parked -- lifecycle
          false AS parked -- legacy
