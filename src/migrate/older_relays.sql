-- The relays of the table older than this build: sessions of this database
-- (but this one) whose name starts with the members' prefix of the table
-- (`outbox-relay:<channel hash>:`) and ends with no upgrade level
-- (`:u<N>`), or a lower one. client_addr and backend_start read NULL for
-- another role's session without pg_read_all_stats.
-- $1 = the prefix; $2 = this build's level.
SELECT pid,
       host(client_addr) AS client_addr,
       date_trunc('second', backend_start)::text AS backend_start,
       application_name
FROM pg_stat_activity
WHERE datname = current_database()
  AND pid <> pg_backend_pid()
  AND starts_with(application_name, $1)
  AND COALESCE(substring(application_name FROM ':u([0-9]{1,9})$')::int, 0) < $2
ORDER BY backend_start, pid
