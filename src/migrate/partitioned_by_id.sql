       -- Whether the table ($1) is partitioned, at any level, by a key that
       -- includes `id` (a column of the key, or in an expression of it): the
       -- trigger draws the id after PostgreSQL routed the row by its default.
       EXISTS (SELECT 1 FROM pg_partition_tree(to_regclass($1)) t
                 JOIN pg_partitioned_table p ON p.partrelid = t.relid
                 JOIN pg_attribute a ON a.attrelid = p.partrelid AND a.attname = 'id'
                WHERE a.attnum = ANY (p.partattrs::int2[])
                   OR pg_get_expr(p.partexprs, p.partrelid) ~ '\mid\M') AS partitioned_by_id
