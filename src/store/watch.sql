-- `wakeup = sequence`, while rows flow: where the id sequence stands, and,
-- when it moved since the last read ($2) or moved at that read ($3: a row's
-- commit follows its draw), the tenants with rows pending among the newest
-- ids: after $4 (where the sequence stood about WATCH_WINDOW ago) and, at
-- most, the last $5 ids drawn.
-- The scheduler readies them as a notification would. A wake-up hint only:
-- the claim's fence (claim.sql) decides what is published, and the poll
-- finds what a hint missed (a row committed long after its draw, whose
-- tenant wrote nothing since). The read walks the primary key over that
-- range alone (the id range is bounded, whatever the plan), so its cost
-- follows the rate of inserts, not the table or its backlog.
-- $1 = the id sequence's oid (0: the table has none).
SELECT s.position,
       CASE WHEN s.position <> $2 OR $3
            THEN ARRAY(SELECT DISTINCT tenant_id FROM {table}
                       WHERE id > GREATEST($4::bigint, s.position - $5::bigint)
                         AND id <= s.position
                         AND published_at IS NULL
                         AND parked_at IS NULL -- lifecycle
                      ) END AS tenants
FROM (SELECT CASE WHEN $1::bigint = 0 THEN 0
                  ELSE COALESCE(pg_sequence_last_value($1::bigint::oid::regclass), 0) END AS position
      OFFSET 0) s
