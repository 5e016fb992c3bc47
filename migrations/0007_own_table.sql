-- Each trigger function of this schema acts only for its own table: the table
-- its trigger fires on, or that table's partition root. The sequence it draws
-- from, the writers' lock key (hashtext('<schema>.<table>') of the root's
-- names) and the channel it notifies are that table's, whatever the trigger's
-- arguments say: the functions are SECURITY DEFINER, and a role that put one
-- on a table of its own naming another table's sequence drew from it with the
-- owner's rights. The trigger keeps its name and its four arguments (older
-- relays check them); only the fourth, the writers' mode, is read.
--
-- The tables the functions serve are written into their bodies (one case
-- each: the lock key, the id sequence, the channel), so that an insert pays
-- no catalog lookup: every table whose trigger `outbox_relay_commit_order`
-- calls a function of this schema, each time a migration runs. Any other
-- table (a partition, a table renamed or set up since) is looked up at each
-- insert, its partition root's names first; such a table whose channel is
-- longer than 63 bytes is not notified (the relay's poll finds its rows) until
-- `migrate` runs for it.
--
-- EXECUTE is revoked from PUBLIC and granted to each such table's owner:
-- PostgreSQL checks it when a trigger is created (also the copy it makes on a
-- new or attached partition), not when a trigger fires. 0002's function is
-- dropped once no trigger calls it; while another table's trigger still does,
-- it stays, with the same body (three arguments: the exclusive mode).
--
-- Function bodies are replaced in place: no lock on any table. No configured
-- name is written here; the schema is the migration's search_path.
DO $outbox_relay$
DECLARE
    body text := $body$
DECLARE
    id_sequence pg_catalog.regclass;
    channel pg_catalog.text;
    key_hash pg_catalog.int4;
    table_key pg_catalog.text;
    root pg_catalog.oid;
    shared pg_catalog.bool := COALESCE(TG_ARGV[3] OPERATOR(pg_catalog.=) 'shared', false);
    writer_key pg_catalog.int8;
BEGIN
    -- TG_ARGV [0] the lock key, [1] the id sequence, [2] the channel: ignored;
    -- [3] 'shared' or 'exclusive' (absent on 0002's triggers: exclusive).
    -- Every operator schema-qualified (a CASE's `=` would not be).
    IF false THEN
{by_oid}    ELSE
        -- A partition (it acts for its root), a table restored under
        -- another oid, or one set up since: by its root's names.
        SELECT n.nspname OPERATOR(pg_catalog.||) '.' OPERATOR(pg_catalog.||) c.relname, c.oid
          INTO table_key, root
          FROM pg_catalog.pg_class c
          JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
         WHERE c.oid OPERATOR(pg_catalog.=)
               COALESCE(pg_catalog.pg_partition_root(TG_RELID), TG_RELID);
        IF false THEN
{by_name}        ELSE
            -- Its own sequence, looked up; its channel if short.
            id_sequence := pg_catalog.pg_get_serial_sequence(
                               root::pg_catalog.regclass::pg_catalog.text, 'id');
            IF id_sequence IS NULL THEN
                RAISE EXCEPTION 'the id column of % draws from no sequence', table_key;
            END IF;
            IF pg_catalog.octet_length(table_key) OPERATOR(pg_catalog.<=) 56 THEN
                channel := 'outbox.' OPERATOR(pg_catalog.||) table_key;
            END IF;
            key_hash := pg_catalog.hashtext(table_key);
        END IF;
    END IF;
    IF COALESCE(pg_catalog.current_setting('outbox_relay.commit_order', true), '')
           OPERATOR(pg_catalog.<>) 'off' THEN
        writer_key := (key_hash::pg_catalog.int8 OPERATOR(pg_catalog.<<) 32)
                      OPERATOR(pg_catalog.|)
                      (pg_catalog.hashtext(NEW.tenant_id)::pg_catalog.int8
                       OPERATOR(pg_catalog.&) 4294967295::pg_catalog.int8);
        IF shared THEN
            PERFORM pg_catalog.pg_advisory_xact_lock_shared(writer_key);
        ELSE
            PERFORM pg_catalog.pg_advisory_xact_lock(writer_key);
        END IF;
    END IF;
    NEW.id := pg_catalog.nextval(id_sequence);
    IF channel IS NOT NULL
       AND COALESCE(pg_catalog.current_setting('outbox_relay.notify', true), '')
           OPERATOR(pg_catalog.<>) 'off'
       AND (NOT shared
            -- A relay waits (holds the wake-up lock): the shared try fails.
            OR NOT CASE WHEN pg_catalog.pg_try_advisory_lock_shared(
                                 pg_catalog.hashtext('outbox-relay wakeup'), key_hash)
                        THEN pg_catalog.pg_advisory_unlock_shared(
                                 pg_catalog.hashtext('outbox-relay wakeup'), key_hash)
                        ELSE false END) THEN
        PERFORM pg_catalog.pg_notify(channel,
            CASE WHEN pg_catalog.octet_length(NEW.tenant_id) OPERATOR(pg_catalog.<) 8000
                 THEN NEW.tenant_id ELSE '' END);
    END IF;
    RETURN NEW;
END
$body$;
    schema_name text := pg_catalog.current_schema();
    functions pg_catalog.oid[] := ARRAY(
        SELECT p.oid FROM pg_catalog.pg_proc p
         WHERE p.pronamespace OPERATOR(pg_catalog.=) pg_catalog.to_regnamespace(schema_name)
           AND p.proname IN ('outbox_relay_insert', 'outbox_relay_before_insert')
           AND p.pronargs OPERATOR(pg_catalog.=) 0);
    by_oid text := '';
    by_name text := '';
    assign text;
    owners text[] := '{}';
    served record;
    table_key text;
    channel text;
    hash numeric;
    fn text;
    owner_name text;
BEGIN
    -- Every table the functions serve: not a partition (it acts for its
    -- root), not a session's temporary table.
    FOR served IN
        SELECT DISTINCT c.oid, n.nspname, c.relname, pg_catalog.pg_get_userbyid(c.relowner) AS owner,
               pg_catalog.pg_get_serial_sequence(pg_catalog.format('%I.%I', n.nspname, c.relname), 'id')
                   AS id_sequence
          FROM pg_catalog.pg_trigger t
          JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
          JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
         WHERE t.tgfoid = ANY (functions) AND t.tgname = 'outbox_relay_commit_order'
           AND NOT c.relispartition AND c.relpersistence <> 't'
         ORDER BY 2, 3
    LOOP
        owners := owners || served.owner::text;
        CONTINUE WHEN served.id_sequence IS NULL;
        table_key := served.nspname || '.' || served.relname;
        channel := 'outbox.' || table_key;
        IF octet_length(channel) > 63 THEN
            -- As the relay names it: 'outbox.' and the 64-bit FNV-1a hash of
            -- the key's bytes, in hex.
            hash := 14695981039346656037;
            FOR i IN 0 .. octet_length(table_key) - 1 LOOP
                hash := hash - mod(hash, 256)
                        + (mod(hash, 256)::int # get_byte(convert_to(table_key, 'UTF8'), i));
                hash := mod(hash * 1099511628211, 18446744073709551616);
            END LOOP;
            IF hash >= 9223372036854775808 THEN
                hash := hash - 18446744073709551616;
            END IF;
            channel := 'outbox.' || lpad(to_hex(hash::bigint), 16, '0');
        END IF;
        -- Constants only: the hash of a literal is computed once per session.
        assign := format('id_sequence := %L::pg_catalog.regclass; channel := %L; '
                         'key_hash := pg_catalog.hashtext(%L);',
                         served.id_sequence, channel, table_key);
        by_oid := by_oid || format(E'    ELSIF TG_RELID OPERATOR(pg_catalog.=) %s::pg_catalog.oid THEN\n        %s\n',
                                   served.oid, assign);
        by_name := by_name || format(E'        ELSIF table_key OPERATOR(pg_catalog.=) %L::pg_catalog.text THEN\n            %s\n',
                                     table_key, assign);
    END LOOP;
    IF to_regprocedure(format('%I.outbox_relay_before_insert()', schema_name)) IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t
                        WHERE t.tgfoid = to_regprocedure(
                                  format('%I.outbox_relay_before_insert()', schema_name))) THEN
        EXECUTE format('DROP FUNCTION %I.outbox_relay_before_insert()', schema_name);
    END IF;
    FOR fn IN
        SELECT format('%I.%I()', schema_name, p.proname) FROM pg_catalog.pg_proc p
         WHERE p.oid = ANY (functions) AND pg_catalog.to_regprocedure(
                   format('%I.%I()', schema_name, p.proname)) IS NOT NULL
    LOOP
        EXECUTE format('CREATE OR REPLACE FUNCTION %s RETURNS trigger LANGUAGE plpgsql '
                       'SECURITY DEFINER AS %L', fn,
                       -- One pass: a name holding a placeholder's text stays as it is.
                       split_part(body, '{by_oid}', 1) || by_oid
                       || split_part(split_part(body, '{by_oid}', 2), '{by_name}', 1) || by_name
                       || split_part(body, '{by_name}', 2));
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', fn);
        FOR owner_name IN SELECT DISTINCT o FROM unnest(owners) o LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', fn, owner_name);
        END LOOP;
    END LOOP;
END
$outbox_relay$;
