-- What the relay's role may do, for the check at start (see grants.rs): USAGE
-- on the schema, SELECT, UPDATE and DELETE on the table (NULL when the schema
-- or the table does not exist: the table's own check says so), and whether
-- autovacuum runs for the table (the server's setting and the table's
-- autovacuum_enabled). Looked up by name in the catalogs, which every role may
-- read: to_regclass() fails without USAGE on the schema.
-- $1: the schema's name; $2: the table's name.
-- SELECT and UPDATE count as granted on the table when granted on each column
-- the relay reads or sets (a least-privilege role may have them per column).
SELECT has_schema_privilege(n.oid, 'USAGE') AS schema_usage,
       (SELECT bool_and(has_column_privilege(c.oid, a.attnum, 'SELECT'))
          FROM pg_attribute a
         WHERE a.attrelid = c.oid AND NOT a.attisdropped
           AND a.attname IN ('id', 'tenant_id', 'kind', 'subject_id', 'payload', 'headers',
                             'occurred_at', 'published_at', 'attempts', 'last_error',
                             'parked_at', 'discarded_at')) AS table_select,
       (SELECT bool_and(has_column_privilege(c.oid, a.attnum, 'UPDATE'))
          FROM pg_attribute a
         WHERE a.attrelid = c.oid AND NOT a.attisdropped
           AND a.attname IN ('published_at', 'attempts', 'last_error', 'parked_at')) AS table_update,
       has_table_privilege(c.oid, 'DELETE') AS table_delete,
       current_setting('autovacuum')::bool AS autovacuum,
       COALESCE((SELECT bool_and(split_part(o, '=', 2)::bool) FROM unnest(c.reloptions) o
                  WHERE o LIKE 'autovacuum\_enabled=%'), true) AS table_autovacuum
FROM (SELECT 1) one
LEFT JOIN pg_namespace n ON n.nspname = $1
LEFT JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = $2
