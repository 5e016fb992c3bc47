-- Whether the server takes writes: sent beside the poll, so that a pool left
-- on a primary demoted in a failover (reads still work there) notices it.
SELECT NOT current_setting('transaction_read_only')::boolean
