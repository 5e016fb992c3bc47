-- Whether any of these tenants (the twins of a tenant being claimed, see
-- store/twins.rs) has rows pending: the claim then chains no further batch,
-- so that the twin's sweep gets the claim after this transaction. Sent in the
-- claim's round trip, only for a tenant with a known twin. $1 = the twins.
SELECT EXISTS (
    SELECT 1 FROM {table} o
    WHERE o.tenant_id = ANY($1::text[]) AND o.published_at IS NULL
      AND o.parked_at IS NULL -- lifecycle
)
