-- What `outbox-relay migrate` applied: one row per outbox table (of this
-- schema) and migration version. A migration recorded here is not run again.
CREATE TABLE IF NOT EXISTS outbox_relay_migrations (
    table_name text        NOT NULL,
    version    integer     NOT NULL,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (table_name, version)
);
