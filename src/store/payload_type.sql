-- The type of the outbox table's `payload` column, a domain resolved to its
-- base type: the relay reads `payload::text`, which only `text`, `varchar`,
-- `json` and `jsonb` turn into the application's own encoding (`bytea` would
-- go out as hex). No row: the table does not exist (yet). A row with NULLs:
-- the table has no `payload` column. $1 = '"schema"."table"'.
SELECT format_type(a.atttypid, a.atttypmod) AS declared,
       format_type(COALESCE(NULLIF(t.typbasetype, 0), a.atttypid), NULL) AS base
FROM (SELECT to_regclass($1) AS relid) r
LEFT JOIN pg_attribute a
       ON a.attrelid = r.relid AND a.attname = 'payload' AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_type t ON t.oid = a.atttypid
WHERE r.relid IS NOT NULL
