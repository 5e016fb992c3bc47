-- The tenant's oldest pending rows, in outbox order, if this transaction holds
-- the tenant (see claim.sql), as many as fit the sweep's share of the relay's
-- byte budget. $1 = tenant, $2 = batch size, $3 = max_payload_bytes, $4 = the
-- sweep's share of the budget, $5 = the longest subject_id or headers read,
-- $6 = the id the batch starts after (the lowest bigint for a claim's first
-- batch; the last id of the batch being published for the next one, read
-- ahead in the same transaction). No id past the claim's fence (see
-- claim.sql): a lower id of the tenant may still be committed above it.
--
-- `tenant_id` is bounded by a range rather than `=`, and the order is written as
-- (tenant_id, id): only the partial index (tenant_id, id) WHERE published_at IS
-- NULL AND parked_at IS NULL yields that order (the query repeats its
-- predicate, so the planner may use it), so the plan cannot fall back to walking the primary
-- key and filtering past millions of published rows, whatever the server's cost
-- settings or statistics. (With `=`, tenant_id is a constant to the planner and
-- the primary key's order is just as good to it.)
--
-- Nothing that could not be sent is read whole: a payload over $3, a kind over
-- 255 bytes or a subject_id or headers over $5 comes back as NULL beside its
-- length (`octet_length` of a stored text value does not even fetch it), and
-- the row is refused. An `occurred_at` no message can carry (infinite, or a
-- year outside 1-9999) comes back as NULL too. Each row's cost is what it
-- holds at most while in flight (the factors are explained in src/budget.rs:
-- its payload three times, its headers eighteen, its subject_id three; its
-- kind; 1 KiB) and is summed in outbox order, and the batch stops where the sum would
-- pass $4: the next row comes back without its payload and with `within`
-- false, to say that the batch was cut short by the budget (it is not part of
-- the batch, and the tenant is swept again at once). The first row
-- always belongs to the batch, and its payload comes back too unless the row
-- alone is over $4: then it is read on its own once the budget allows it
-- (read_payload.sql). The running sum follows the index's order, so the plan
-- sorts nothing, and it is summed in double precision (exact far beyond any
-- budget), which costs the server less than `numeric`.
-- The columns are selected uncast, so that the row description carries the
-- table's own types, which the relay checks on every read (store/columns.rs):
-- a cast such as `payload::text` would turn a `bytea` into hex text.
WITH batch AS (
    SELECT tenant_id, id, kind, subject_id, payload, headers,
           occurred_at,
           octet_length(kind) AS kind_bytes,
           octet_length(subject_id) AS subject_id_bytes,
           octet_length(payload::text) AS payload_bytes,
           octet_length(headers::text) AS headers_bytes
    FROM {table}
    WHERE current_setting('outbox_relay.claimed', true) = 'true'
      AND tenant_id >= $1 AND tenant_id <= $1 AND published_at IS NULL AND id > $6::bigint
      AND id <= current_setting('outbox_relay.fence')::bigint
      AND parked_at IS NULL -- lifecycle
    ORDER BY tenant_id, id
    LIMIT $2
), costed AS (
    SELECT *,
           1024
           + CASE WHEN kind_bytes <= 255 THEN kind_bytes ELSE 0 END
           + CASE WHEN subject_id_bytes <= $5::bigint THEN 3 * subject_id_bytes ELSE 0 END
           + CASE WHEN headers_bytes <= $5::bigint THEN 18 * headers_bytes::bigint ELSE 0 END
           + CASE WHEN payload_bytes <= $3::bigint THEN 3 * payload_bytes::bigint ELSE 0 END
           AS cost
    FROM batch
), running AS (
    SELECT *, sum(cost::float8) OVER w AS total, row_number() OVER w AS n
    FROM costed
    WINDOW w AS (ORDER BY tenant_id, id)
)
SELECT id,
       CASE WHEN kind_bytes <= 255 THEN kind END AS kind, kind_bytes,
       CASE WHEN subject_id_bytes <= $5::bigint THEN subject_id END AS subject_id, subject_id_bytes,
       CASE WHEN payload_bytes <= $3::bigint AND total <= $4::bigint THEN payload END AS payload,
       payload_bytes,
       CASE WHEN headers_bytes <= $5::bigint THEN headers END AS headers, headers_bytes,
       CASE WHEN occurred_at >= '0001-01-01 00:00:00+00'
             AND occurred_at < '10000-01-01 00:00:00+00' THEN occurred_at END AS occurred_at,
       cost::bigint AS cost,
       total <= $4::bigint AS within
FROM running
WHERE total - cost < $4::bigint OR n = 2
ORDER BY tenant_id, id
