-- The payload of one row of the claimed batch that was over the sweep's share
-- of the byte budget (see read_batch.sql), read once the budget allows it.
-- $1 = id.
SELECT payload FROM {table} WHERE id = $1
