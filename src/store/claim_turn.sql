-- A tenant with a known twin (another name with the same hashtext, so the
-- same claim key: see store/twins.rs) waits its turn for the claim instead of
-- trying it. PostgreSQL grants a lock to the requests waiting for it before
-- a later one (a later try fails while one waits), so after each transaction
-- of one twin the other's sweep, if it waits, gets the claim before the
-- first claims again, whichever relay sweeps either. The wait is bounded by
-- $3 ms (lock_timeout, put back once the lock is held): past it the
-- statement fails with SQLSTATE 55P03 and the sweep is skipped, as when the
-- try fails. claim.sql's try then finds the lock held by this transaction.
-- $1 = '<schema>.<table>', $2 = tenant, $3 = the bound in ms.
SELECT set_config('lock_timeout', w.previous, true)
FROM (SELECT s.previous, pg_advisory_xact_lock(hashtext($1), hashtext($2))
      FROM (SELECT current_setting('lock_timeout') AS previous,
                   set_config('lock_timeout', $3, true)
            OFFSET 0) s
      OFFSET 0) w
