-- Claim a tenant for this transaction: the same advisory-lock keys as the seed
-- relay, so mixed fleets take turns too. $1 = '<schema>.<table>', $2 = tenant.
-- The outcome is also kept in a transaction-local setting, so the batch read
-- sent in the same round trip returns nothing when the lock was not taken.
SELECT set_config('idle_in_transaction_session_timeout', '0', true),
       set_config('outbox_relay.claimed',
                  pg_try_advisory_xact_lock(hashtext($1), hashtext($2))::text,
                  true)::boolean
