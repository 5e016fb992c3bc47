-- Which lifecycle columns the outbox table has, so that retention's DELETE
-- (retention_delete.sql) is written for the table as it is: `parked_at`
-- (a parked row is never deleted) and `discarded_at` (a discarded row is
-- deleted once discarded longer ago than retention_ms). No row: the table
-- does not exist (yet). $1 = '"schema"."table"'.
SELECT EXISTS (SELECT 1 FROM pg_attribute a
               WHERE a.attrelid = r.relid AND a.attname = 'parked_at'
                 AND a.attnum > 0 AND NOT a.attisdropped) AS parked_at,
       EXISTS (SELECT 1 FROM pg_attribute a
               WHERE a.attrelid = r.relid AND a.attname = 'discarded_at'
                 AND a.attnum > 0 AND NOT a.attisdropped) AS discarded_at
FROM (SELECT to_regclass($1) AS relid) r
WHERE r.relid IS NOT NULL
