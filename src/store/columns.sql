-- The outbox table's columns that the relay reads, each with its type (a
-- domain resolved to its base type, as a read's row description shows it):
-- held against what the relay reads by the same check as every read's row
-- description (columns.rs). No row: the table does not exist (yet). A single
-- row with a NULL column: the table has none of them.
-- Beside each, whether the table has the columns of parking (`parked_at` and
-- `discarded_at`, migration 0003): the store's statements depend on them.
-- $1 = '"schema"."table"'.
SELECT a.attname::text AS column_name,
       base.oid AS type_oid,
       base.typname::text AS type_name,
       n.nspname::text AS type_schema,
       (SELECT count(*) = 2 FROM pg_attribute l
         WHERE l.attrelid = r.relid AND l.attname IN ('parked_at', 'discarded_at')
           AND l.attnum > 0 AND NOT l.attisdropped) AS parking
FROM (SELECT to_regclass($1) AS relid) r
LEFT JOIN pg_attribute a
       ON a.attrelid = r.relid
      AND a.attname IN ('id', 'kind', 'subject_id', 'payload', 'headers', 'occurred_at')
      AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_type base ON base.oid = COALESCE(NULLIF(t.typbasetype, 0), t.oid)
LEFT JOIN pg_namespace n ON n.oid = base.typnamespace
WHERE r.relid IS NOT NULL
