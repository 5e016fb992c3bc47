-- Writers that never wait for each other, step 1 of 2 (see docs/operations.md,
-- "Upgrading commit order"): a new trigger function, with the table's writers
-- left on the exclusive per-tenant lock that older relays rely on.
--
-- The function takes the writer's per-(table, tenant) advisory lock before it
-- draws the row's id, in one of two modes named by the trigger's fourth
-- argument:
--
--   exclusive  the lock of 0002: a tenant's writers draw their ids one
--              transaction at a time, in commit order, and every insert
--              notifies the relay's channel. What older relays (and mixed
--              fleets) need. This migration installs it.
--   shared     a shared lock: writers never wait for each other. The relay
--              learns a safe bound instead (it reads the id sequence's
--              position, then which transactions hold the tenant's lock, and
--              publishes up to that position once they have ended). An insert
--              notifies only while some relay waits for a notification (it
--              holds the wake-up lock), so a busy table takes no database-wide
--              NOTIFY lock at every commit, and a prepared transaction can be
--              prepared (with `outbox_relay.notify = off` for its role).
--              `outbox-relay migrate --finish` switches to it, once no older
--              relay reads the table; a table that `migrate` creates gets it
--              at once.
--
-- Lock, then draw: the identity default is evaluated before BEFORE triggers,
-- so the function draws the id itself, after the lock, overwriting any id the
-- application supplied (ids advance by two per row). The key is one bigint
-- (the table's hash in the high half, the tenant's in the low half): a key
-- space apart from the relay's claim, which takes two int4 keys. The wake-up
-- lock is two int4 keys (hashtext('outbox-relay wakeup'), the table's hash).
--
-- Settings the function reads (unset means on); set them per database, role,
-- session or transaction without changing code:
--   outbox_relay.notify = off        never notify (two-phase commit writers: a
--                                    transaction that notified cannot be
--                                    prepared); the relay's poll finds the rows
--   outbox_relay.commit_order = off  no lock (only for a bulk load that holds
--                                    other writers out itself: LOCK TABLE …
--                                    IN EXCLUSIVE MODE)
--
-- SECURITY DEFINER, so that a role that may only INSERT into the table can
-- write through it (the sequence is used with the owner's rights). Every name
-- and operator is schema-qualified instead of a `SET search_path` clause,
-- which would cost every insert a configuration change.
CREATE OR REPLACE FUNCTION outbox_relay_insert() RETURNS trigger
    LANGUAGE plpgsql
    SECURITY DEFINER
AS $outbox_relay$
DECLARE
    writer_key pg_catalog.int8;
BEGIN
    -- TG_ARGV: [0] the lock keys' table part, [1] the id sequence, [2] the
    -- channel, [3] 'shared' or 'exclusive'.
    IF COALESCE(pg_catalog.current_setting('outbox_relay.commit_order', true), '')
           OPERATOR(pg_catalog.<>) 'off' THEN
        writer_key := (pg_catalog.hashtext(TG_ARGV[0])::pg_catalog.int8 OPERATOR(pg_catalog.<<) 32)
                      OPERATOR(pg_catalog.|)
                      (pg_catalog.hashtext(NEW.tenant_id)::pg_catalog.int8
                       OPERATOR(pg_catalog.&) 4294967295::pg_catalog.int8);
        IF TG_ARGV[3] OPERATOR(pg_catalog.=) 'shared' THEN
            PERFORM pg_catalog.pg_advisory_xact_lock_shared(writer_key);
        ELSE
            PERFORM pg_catalog.pg_advisory_xact_lock(writer_key);
        END IF;
    END IF;
    NEW.id := pg_catalog.nextval(TG_ARGV[1]::pg_catalog.regclass);
    IF COALESCE(pg_catalog.current_setting('outbox_relay.notify', true), '')
           OPERATOR(pg_catalog.<>) 'off'
       AND (TG_ARGV[3] OPERATOR(pg_catalog.<>) 'shared'
            -- A relay waits (holds the wake-up lock): the shared try fails.
            OR NOT CASE WHEN pg_catalog.pg_try_advisory_lock_shared(
                                 pg_catalog.hashtext('outbox-relay wakeup'),
                                 pg_catalog.hashtext(TG_ARGV[0]))
                        THEN pg_catalog.pg_advisory_unlock_shared(
                                 pg_catalog.hashtext('outbox-relay wakeup'),
                                 pg_catalog.hashtext(TG_ARGV[0]))
                        ELSE false END) THEN
        PERFORM pg_catalog.pg_notify(TG_ARGV[2],
            CASE WHEN pg_catalog.octet_length(NEW.tenant_id) OPERATOR(pg_catalog.<) 8000
                 THEN NEW.tenant_id ELSE '' END);
    END IF;
    RETURN NEW;
END
$outbox_relay$;

-- The trigger, re-created on the new function in the exclusive mode. DROP and
-- CREATE TRIGGER wait for the writers in flight and hold new ones meanwhile:
-- `migrate` runs this with a short lock_timeout and tries again.
-- The names as this transaction's settings: none is written inside a
-- dollar-quoted body (a name may hold its delimiter). The schema is the
-- migration's search_path.
SET LOCAL outbox_relay.migrate_table = {table_literal};
SET LOCAL outbox_relay.migrate_channel = {channel_literal};
SET LOCAL outbox_relay.migrate_mode = {writer_mode_literal};
DO $outbox_relay$
DECLARE
    schema_name text := current_schema();
    table_name text := current_setting('outbox_relay.migrate_table');
    id_sequence text := pg_get_serial_sequence(format('%I.%I', schema_name, table_name), 'id');
BEGIN
    IF id_sequence IS NULL THEN
        RAISE EXCEPTION 'the id column of %.% draws from no sequence', schema_name, table_name
            USING HINT = 'declare it GENERATED BY DEFAULT AS IDENTITY (or bigserial)';
    END IF;
    EXECUTE format('DROP TRIGGER IF EXISTS outbox_relay_commit_order ON %I.%I',
                   schema_name, table_name);
    EXECUTE format('CREATE TRIGGER outbox_relay_commit_order BEFORE INSERT ON %I.%I '
                   'FOR EACH ROW EXECUTE FUNCTION %I.outbox_relay_insert(%L, %L, %L, %L)',
                   schema_name, table_name, schema_name,
                   schema_name || '.' || table_name, id_sequence,
                   current_setting('outbox_relay.migrate_channel'), current_setting('outbox_relay.migrate_mode'));
END
$outbox_relay$;
