-- For `outbox-relay replay`: the tenant's published rows with $6 < id <= $7,
-- in id order, as many as fit $4 bytes (at least one), read and costed as
-- read_batch.sql reads a batch (the same columns, so the same decoding and
-- the same envelope). A discarded row was never published: it is not read.
-- Served by the primary key (a range of ids, filtered by tenant). $1 = tenant,
-- $2 = rows at most, $3 = max_payload_bytes, $4 = byte budget, $5 = the
-- longest subject_id or headers read, $6 = the id the page starts after,
-- $7 = the last id of the range.
-- The columns are selected uncast, so that the row description carries the
-- table's own types, which the relay checks on every read (store/columns.rs):
-- a cast such as `payload::text` would turn a `bytea` into hex text.
WITH page AS (
    SELECT tenant_id, id, kind, subject_id, payload, headers,
           occurred_at,
           octet_length(kind) AS kind_bytes,
           octet_length(subject_id) AS subject_id_bytes,
           octet_length(payload::text) AS payload_bytes,
           octet_length(headers::text) AS headers_bytes
    FROM {table}
    WHERE id > $6::bigint AND id <= $7::bigint AND tenant_id = $1 AND published_at IS NOT NULL
      AND discarded_at IS NULL -- lifecycle
    ORDER BY id
    LIMIT $2
), costed AS (
    SELECT *,
           1024
           + CASE WHEN kind_bytes <= 255 THEN kind_bytes ELSE 0 END
           + CASE WHEN subject_id_bytes <= $5::bigint THEN 3 * subject_id_bytes ELSE 0 END
           + CASE WHEN headers_bytes <= $5::bigint THEN 18 * headers_bytes::bigint ELSE 0 END
           + CASE WHEN payload_bytes <= $3::bigint THEN 3 * payload_bytes::bigint ELSE 0 END
           AS cost
    FROM page
), running AS (
    SELECT *, sum(cost::float8) OVER w AS total, row_number() OVER w AS n
    FROM costed
    WINDOW w AS (ORDER BY id)
)
SELECT id,
       CASE WHEN kind_bytes <= 255 THEN kind END AS kind, kind_bytes,
       CASE WHEN subject_id_bytes <= $5::bigint THEN subject_id END AS subject_id, subject_id_bytes,
       CASE WHEN payload_bytes <= $3::bigint THEN payload END AS payload,
       payload_bytes,
       CASE WHEN headers_bytes <= $5::bigint THEN headers END AS headers, headers_bytes,
       CASE WHEN occurred_at >= '0001-01-01 00:00:00+00'
             AND occurred_at < '10000-01-01 00:00:00+00' THEN occurred_at END AS occurred_at,
       cost::bigint AS cost,
       true AS within
FROM running
WHERE total - cost < $4::bigint OR n = 1
ORDER BY id
