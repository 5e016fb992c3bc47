-- Claim a tenant for this transaction: the same advisory-lock keys as the seed
-- relay, so mixed fleets take turns too. $1 = '<schema>.<table>', $2 = tenant,
-- $3 = how long the transaction may sit idle between statements, in ms: a
-- relay cut off from the server mid-sweep (a partition, a stalled path) loses
-- its claim within it, and another replica takes the tenant.
-- The outcome is also kept in a transaction-local setting, so the batch read
-- sent in the same round trip returns nothing when the lock was not taken.
-- The last column tells a server that takes no writes (a standby, or a
-- primary demoted in a failover): no place to sweep.
SELECT set_config('idle_in_transaction_session_timeout', $3, true),
       set_config('outbox_relay.claimed',
                  pg_try_advisory_xact_lock(hashtext($1), hashtext($2))::text,
                  true)::boolean,
       current_setting('transaction_read_only')::boolean
