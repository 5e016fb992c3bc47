-- Claim a tenant for this transaction: the same advisory-lock keys as the seed
-- relay, so mixed fleets take turns too. $1 = '<schema>.<table>', $2 = tenant.
SELECT set_config('idle_in_transaction_session_timeout', '0', true),
       pg_try_advisory_xact_lock(hashtext($1), hashtext($2))
