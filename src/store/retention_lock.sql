-- Retention's turn: one relay at a time deletes, each batch in a transaction
-- that holds this lock. Its key space is the two-int4 one of the claim
-- (claim.sql), with a fixed first key (`retention::LOCK_CLASS`) where the
-- claim has hashtext('<schema>.<table>'), and the table's hash where the
-- claim has the tenant's: it never meets the claim unless a table's name
-- hashes to that constant, nor the trigger's single bigint key.
-- $1 = the class, $2 = '<schema>.<table>'.
SELECT set_config('statement_timeout', '10s', true),
       set_config('lock_timeout', '2s', true),
       pg_try_advisory_xact_lock($1, hashtext($2))
