-- Which of these tenant names share a hashtext value (twins: one claim key
-- and one writers' lock, see claim.sql), each group once: the relay's check
-- of its configured tenants at start, one statement whatever their number.
-- $1 = the tenants.
SELECT hashtext(t) AS hash, array_agg(DISTINCT t ORDER BY t) AS tenants
FROM unnest($1::text[]) AS t
GROUP BY 1
HAVING count(DISTINCT t) > 1
