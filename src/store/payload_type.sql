-- The type of the outbox table's `payload` column, a domain resolved to its
-- base type: the relay reads `payload::text`, which only `text`, `varchar`,
-- `json` and `jsonb` turn into the application's own encoding (`bytea` would
-- go out as hex). No row: the table does not exist (yet). A row with NULLs:
-- the table has no `payload` column. $1 = '"schema"."table"'.
-- Beside it, whether the table has the columns of parking (`parked_at` and
-- `discarded_at`, migration 0003): the store's statements depend on them.
SELECT format_type(a.atttypid, a.atttypmod) AS declared,
       format_type(COALESCE(NULLIF(t.typbasetype, 0), a.atttypid), NULL) AS base,
       (SELECT count(*) = 2 FROM pg_attribute l
         WHERE l.attrelid = r.relid AND l.attname IN ('parked_at', 'discarded_at')
           AND l.attnum > 0 AND NOT l.attisdropped) AS parking
FROM (SELECT to_regclass($1) AS relid) r
LEFT JOIN pg_attribute a
       ON a.attrelid = r.relid AND a.attname = 'payload' AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_type t ON t.oid = a.atttypid
WHERE r.relid IS NOT NULL
