-- What the relay needs of its table, for the check at start: the columns it
-- reads, the pending index (validity and predicate), the commit-order trigger
-- (state and arguments), a partition key that includes `id`.
-- $1: the table as '"schema"."table"'; $2: the pending index's name.
SELECT to_regclass($1) IS NOT NULL AS table_exists,
       ARRAY(SELECT a.attname::text FROM pg_attribute a
              WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped) AS columns,
       (SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         WHERE i.indrelid = to_regclass($1) AND c.relname = $2) AS index_valid,
       (SELECT pg_get_expr(i.indpred, i.indrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         WHERE i.indrelid = to_regclass($1) AND c.relname = $2) AS index_predicate,
       (SELECT t.tgenabled::text FROM pg_trigger t
         WHERE t.tgrelid = to_regclass($1) AND t.tgname = 'outbox_relay_commit_order') AS trigger_enabled,
       (SELECT t.tgargs FROM pg_trigger t
         WHERE t.tgrelid = to_regclass($1) AND t.tgname = 'outbox_relay_commit_order') AS trigger_args,
