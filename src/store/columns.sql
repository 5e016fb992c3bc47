-- The outbox table's columns that the relay reads (and those it only writes,
-- whose presence alone is checked), each with its type as a
-- read's row description shows it: a domain resolved to its base type (the
-- reads select these columns through a CASE, which resolves it, through
-- domains over domains too), but for `id`, which they select as it is.
-- Held against what the relay reads by the same check as every read's row
-- description (columns.rs). No row: the table does not exist (yet). A single
-- row with a NULL column: the table has none of them.
-- Beside each, whether the table has the columns of parking (`parked_at` and
-- `discarded_at`, migration 0003): the store's statements depend on them;
-- and whether the column's collation is deterministic (a case-insensitive
-- `tenant_id` would make several tenants of one).
-- $1 = '"schema"."table"'.
WITH RECURSIVE r AS (
    SELECT to_regclass($1) AS relid
), resolved (name, type, base, collid) AS (
    SELECT a.attname::text, a.atttypid, t.typbasetype, a.attcollation
    FROM r
    JOIN pg_attribute a
      ON a.attrelid = r.relid
     AND a.attname IN ('id', 'tenant_id', 'kind', 'subject_id', 'payload', 'headers', 'occurred_at',
                       'published_at', 'attempts', 'last_error')
     AND a.attnum > 0 AND NOT a.attisdropped
    JOIN pg_type t ON t.oid = a.atttypid
    UNION ALL
    SELECT d.name, d.base, t.typbasetype, d.collid
    FROM resolved d JOIN pg_type t ON t.oid = d.base
    WHERE d.base <> 0 AND d.name <> 'id'
)
SELECT d.name AS column_name,
       t.oid AS type_oid,
       t.typname::text AS type_name,
       n.nspname::text AS type_schema,
       (SELECT count(*) = 2 FROM pg_attribute l
         WHERE l.attrelid = r.relid AND l.attname IN ('parked_at', 'discarded_at')
           AND l.attnum > 0 AND NOT l.attisdropped) AS parking,
       coalesce((SELECT c.collisdeterministic FROM pg_collation c
                  WHERE c.oid = d.collid), true) AS deterministic
FROM r
LEFT JOIN resolved d ON d.base = 0 OR d.name = 'id'
LEFT JOIN pg_type t ON t.oid = d.type
LEFT JOIN pg_namespace n ON n.oid = t.typnamespace
WHERE r.relid IS NOT NULL
