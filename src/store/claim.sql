-- Claim a tenant for this transaction: the same advisory-lock keys as the seed
-- relay, so mixed fleets take turns too. $1 = '<schema>.<table>', $2 = tenant,
-- $3 = how long the transaction may sit idle between statements, in ms: a
-- relay cut off from the server mid-sweep (a partition, a stalled path) loses
-- its claim within it, and another replica takes the tenant.
-- The outcome is also kept in a transaction-local setting, so the batch read
-- sent in the same round trip returns nothing when the lock was not taken.
-- The third column tells a server that takes no writes (a standby, or a
-- primary demoted in a failover): no place to sweep.
--
-- The fence (commit order). A writer takes its tenant's lock (shared or
-- exclusive, see migrations/0005_writer_lock.sql) before it draws its id. So
-- once the id sequence stands at P, every id at or below P was drawn by a
-- transaction that holds that lock until it ends. The innermost subquery
-- reads P first (OFFSET 0 keeps it a step of its own, run before the outer
-- one); then a session-level try of the writers' key, given back at once,
-- tells whether any writer of the tenant is in flight. None: every id up to
-- P of the tenant is committed or gone, and the fence is P. Some: the fence
-- is $5, the bound the scheduler last found safe (all writers in flight at
-- its check have ended since). The fence goes into a transaction-local
-- setting that the batch read (a statement of its own, whose snapshot is
-- taken after this one ended) bounds its ids by. A try that succeeds holds
-- the writers' key for the few microseconds until it is given back; the
-- transaction-level lock a writer waits for is never held by the relay.
-- $4 = the id sequence's oid (0 when the table has none: no fence, as with
-- no trigger), $5 = the scheduler's safe bound. The last columns: whether a
-- writer was in flight, P, and the tenant's hash, by which the relay finds
-- tenants that share the claim key (store/twins.rs).
SELECT set_config('idle_in_transaction_session_timeout', $3, true),
       set_config('outbox_relay.claimed', taken::text, true)::boolean,
       current_setting('transaction_read_only')::boolean,
       set_config('outbox_relay.fence',
                  (CASE WHEN NOT free THEN $5::bigint
                        WHEN $4::bigint = 0 THEN 9223372036854775807
                        ELSE position END)::text,
                  true)::bigint AS fence,
       NOT free AS writers,
       position,
       hashtext($2) AS tenant_hash
FROM (SELECT position,
             pg_try_advisory_xact_lock(hashtext($1), hashtext($2)) AS taken,
             CASE WHEN pg_try_advisory_lock(writer_key)
                  THEN pg_advisory_unlock(writer_key)
                  ELSE false END AS free
      FROM (SELECT CASE WHEN $4::bigint = 0 THEN 0
                        ELSE COALESCE(pg_sequence_last_value($4::bigint::oid::regclass), 0) END AS position,
                   (hashtext($1)::bigint << 32) | (hashtext($2)::bigint & 4294967295) AS writer_key
            OFFSET 0) p
      OFFSET 0) c
