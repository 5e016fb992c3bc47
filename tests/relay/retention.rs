//! Retention (`retention_ms`) and the outbox partitioned by time: only rows
//! published (by `published_at`) longer ago than `retention_ms` are deleted,
//! while relaying goes on; a partitioned table is relayed, in order, and
//! cleaned the same way.

use std::time::Duration;

use crate::support::{
    Broker, DATABASE_URL, Outbox, OwnedRole, by_tenant, config, eventually, metric, relay_env,
    set_env, spawn_relay, start_relay, unique,
};

/// Rows left in the table.
async fn rows(outbox: &Outbox) -> i64 {
    outbox
        .client
        .query_one(&format!("SELECT count(*) FROM {}", outbox.qualified()), &[])
        .await
        .expect("count rows")
        .get(0)
}

/// Inserts `n` rows of `tenant` and marks them published `ago`.
async fn published_ago(outbox: &Outbox, tenant: &str, n: i64, ago: &str) -> Vec<i64> {
    let ids = outbox.insert_many(tenant, n).await;
    outbox
        .client
        .execute(
            &format!(
                "UPDATE {} SET published_at = now() - $2::text::interval WHERE id = ANY($1)",
                outbox.qualified()
            ),
            &[&ids, &ago],
        )
        .await
        .expect("mark published");
    ids
}

/// Old published rows go, in batches (more than one per round here), and
/// nothing else: not a pending row however old its `occurred_at`, not a row
/// published recently (whatever its `occurred_at`), not the rows published
/// while retention runs. The counter adds up what went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_only_rows_published_long_ago_while_relaying_continues() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let mut old = published_ago(&outbox, "a", 2_500, "1 hour").await;
    // Pending for ever (a tenant this relay does not serve), old by occurred_at.
    let stuck = outbox.insert_many("stuck", 10).await;
    outbox
        .execute("UPDATE {outbox} SET occurred_at = now() - interval '2 hours' WHERE tenant_id = 'stuck'")
        .await;
    old.extend(published_ago(&outbox, "a", 2_500, "1 hour").await);
    // Published in the future (a clock ahead): younger than any cutoff.
    let recent = published_ago(&outbox, "a", 5, "-1 hour").await;
    // Pending with an old occurred_at: published by the relay now, so kept.
    let late = outbox.insert_many("a", 5).await;
    outbox
        .execute("UPDATE {outbox} SET occurred_at = now() - interval '2 hours' WHERE published_at IS NULL AND tenant_id = 'a'")
        .await;

    let mut config = config(&outbox, &broker, &["a"]);
    config.retention_ms = 30_000;
    let relay = start_relay(config).await;
    // Relaying goes on while retention deletes.
    let mut live = Vec::new();
    for _ in 0..10 {
        live.extend(outbox.insert_many("a", 10).await);
    }
    let kept = (stuck.len() + recent.len() + late.len() + live.len()) as i64;
    eventually(
        "the old published rows are deleted",
        Duration::from_secs(30),
        || async { rows(&outbox).await == kept },
    )
    .await;
    eventually(
        "the counter has every deleted row",
        Duration::from_secs(10),
        || async {
            metric(
                &relay.get("/metrics").await.1,
                "outbox_retention_deleted_total",
            ) == Some(old.len() as f64)
        },
    )
    .await;
    eventually(
        "the rows written meanwhile went out",
        Duration::from_secs(20),
        || async { outbox.pending("a").await == 0 },
    )
    .await;
    let left: Vec<i64> = outbox
        .client
        .query(
            &format!("SELECT id FROM {} ORDER BY id", outbox.qualified()),
            &[],
        )
        .await
        .expect("ids")
        .iter()
        .map(|row| row.get(0))
        .collect();
    let mut expected: Vec<i64> = [stuck.clone(), recent, late.clone(), live.clone()].concat();
    expected.sort_unstable();
    assert_eq!(left, expected, "exactly the old published rows went");
    assert_eq!(outbox.pending("stuck").await, stuck.len() as i64);
    let received = by_tenant(&broker.received());
    let sent: Vec<i64> = [late, live].concat();
    assert_eq!(
        received.get("a"),
        Some(&sent),
        "the consumer got the rest, in order"
    );
    relay.stop().await;
}

/// The outbox partitioned by time, made with the runbook's SQL (and
/// `migrate`, which keeps the table and adds the trigger): the relay
/// relays it in order, and retention cleans it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_partitioned_by_time_is_relayed_in_order_and_cleaned() {
    let schema = unique("p");
    let admin = crate::support::pg_client().await;
    admin
        .batch_execute(&partitioned_table_sql(&schema))
        .await
        .expect("the runbook's SQL creates the partitioned table");
    let mut migrate = outbox_relay::config::Config::with_tenants(["migrate"]);
    migrate.database_url = crate::support::DATABASE_URL.parse().unwrap();
    migrate.schema = schema.clone();
    let store = outbox_relay::store::Store::new(&migrate).expect("store");
    outbox_relay::migrate::run(&store, &migrate)
        .await
        .expect("migrate keeps the partitioned table and adds the trigger");
    let outbox = Outbox::adopt(schema, "outbox_message".into(), admin);
    let broker = Broker::create(&["#"]).await;
    // Rows in last month's partition, published long ago; pending rows in
    // this month's and last month's, interleaved.
    let insert = |tenant: &'static str, n: i64, last_month: bool, published: bool| {
        let sql = format!(
            "INSERT INTO {} (tenant_id, kind, subject_id, payload, occurred_at, published_at)
             SELECT $1, 'thing.changed', 's-' || g, '{{}}',
                    CASE WHEN $3 THEN date_trunc('month', now()) - interval '1 day' ELSE now() END,
                    CASE WHEN $4 THEN now() - interval '40 days' END
             FROM generate_series(1, $2::bigint) g RETURNING id",
            outbox.qualified()
        );
        let client = &outbox.client;
        async move {
            let rows = client
                .query(&sql, &[&tenant, &n, &last_month, &published])
                .await
                .expect("insert into the partitioned table");
            rows.iter()
                .map(|row| row.get::<_, i64>(0))
                .collect::<Vec<i64>>()
        }
    };
    let old = insert("a", 300, true, true).await;
    let mut pending = Vec::new();
    for last_month in [true, false, true] {
        for tenant in ["a", "b"] {
            pending.extend(insert(tenant, 50, last_month, false).await);
        }
    }
    let previous: i64 = outbox
        .client
        .query_one(
            &format!(
                "SELECT count(*) FROM \"{}\".outbox_message_previous WHERE published_at IS NULL",
                outbox.schema
            ),
            &[],
        )
        .await
        .expect("count last month's partition")
        .get(0);
    assert_eq!(previous, 200, "pending rows in last month's partition");

    let mut config = config(&outbox, &broker, &["a", "b"]);
    config.retention_ms = 60_000;
    config.batch_size = 50;
    let relay = start_relay(config).await;
    eventually(
        "every pending row went out",
        Duration::from_secs(30),
        || async { outbox.pending_of(&["a", "b"]).await == 0 },
    )
    .await;
    eventually(
        "the old rows are deleted",
        Duration::from_secs(30),
        || async { rows(&outbox).await == pending.len() as i64 },
    )
    .await;
    let received = by_tenant(&broker.received());
    for tenant in ["a", "b"] {
        let ids = &received[tenant];
        assert_eq!(ids.len(), 150, "{tenant}: each row once");
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{tenant}: in id order");
    }
    assert!(!received.values().flatten().any(|id| old.contains(id)));
    relay.stop().await;
}

/// The runbook's SQL for an outbox partitioned by month, with this month's
/// and last month's partitions, in `schema`.
fn partitioned_table_sql(schema: &str) -> String {
    let runbook = include_str!("../../docs/runbook.md");
    let start = runbook
        .find("-- outbox partitioned by time: begin")
        .expect("the runbook has the partitioned table's SQL");
    let end = runbook[start..]
        .find("-- outbox partitioned by time: end")
        .expect("the SQL ends")
        + start;
    format!(
        "CREATE SCHEMA {schema};\nSET search_path TO {schema};\n{}\n\
         CREATE TABLE outbox_message_previous PARTITION OF outbox_message
             FOR VALUES FROM (date_trunc('month', now()) - interval '1 month') TO (date_trunc('month', now()));
         CREATE TABLE outbox_message_current PARTITION OF outbox_message
             FOR VALUES FROM (date_trunc('month', now())) TO (date_trunc('month', now()) + interval '1 month');
         RESET search_path;",
        &runbook[start..end],
        schema = format!("\"{schema}\"")
    )
}

/// One relay at a time: while another session holds retention's advisory
/// lock for the table, a relay deletes nothing (for three rounds); once it
/// is released, the old rows go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_waits_its_turn_on_the_advisory_lock() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let old = published_ago(&outbox, "a", 100, "1 hour").await;
    let holder = crate::support::pg_client().await;
    let key = format!("{}.{}", outbox.schema, outbox.table);
    holder
        .execute(
            "SELECT pg_advisory_lock($1, hashtext($2))",
            &[&outbox_relay::retention::LOCK_CLASS, &key],
        )
        .await
        .expect("take retention's lock");
    let mut config = config(&outbox, &broker, &["a"]);
    config.retention_ms = 2_000; // a round every second
    let relay = start_relay(config).await;
    // Absence can only be watched for a while: three rounds.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        rows(&outbox).await,
        old.len() as i64,
        "nothing deleted while held"
    );
    assert_eq!(
        metric(
            &relay.get("/metrics").await.1,
            "outbox_retention_deleted_total"
        ),
        Some(0.0)
    );
    holder
        .execute(
            "SELECT pg_advisory_unlock($1, hashtext($2))",
            &[&outbox_relay::retention::LOCK_CLASS, &key],
        )
        .await
        .expect("release retention's lock");
    eventually(
        "the old rows are deleted once the lock is free",
        Duration::from_secs(10),
        || async { rows(&outbox).await == 0 },
    )
    .await;
    relay.stop().await;
}

/// A relay whose role has the runbook's grants but `DELETE`, with retention
/// on: one ERROR at start names the privilege, the table, retention and the
/// `GRANT`; the relay keeps relaying, and its refused rounds say nothing
/// more. Granted, retention deletes; revoked again, the first refused round
/// says the same ERROR once more, and only once. With autovacuum off (for
/// the server, as on this machine, or for the table) one WARN says the space
/// of deleted rows is never reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_delete_retention_says_the_grant_once_and_relaying_goes_on() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let role = unique("relay_grants");
    let _owned = OwnedRole::new(DATABASE_URL, &role);
    outbox
        .execute(&format!(
            "CREATE ROLE \"{role}\" LOGIN; \
             GRANT USAGE ON SCHEMA \"{schema}\" TO \"{role}\"; \
             GRANT SELECT, UPDATE ON {{outbox}} TO \"{role}\"; \
             GRANT SELECT ON SEQUENCE \"{schema}\".\"{table}_id_seq\" TO \"{role}\"; \
             ALTER TABLE {{outbox}} SET (autovacuum_enabled = false)",
            schema = outbox.schema,
            table = outbox.table,
        ))
        .await;
    let old = published_ago(&outbox, "a", 10, "1 hour").await;
    let mut env = relay_env(&outbox, &broker, &["a"]);
    set_env(
        &mut env,
        "OUTBOX_DATABASE_URL",
        format!("postgres://{role}@127.0.0.1:5432/test"),
    );
    set_env(&mut env, "OUTBOX_RETENTION_MS", "2000"); // a round every second
    let (relay, _) = spawn_relay(&env).await;
    let fix = format!("fix: GRANT DELETE ON TABLE {}", outbox.qualified());
    let fix = fix.replace('"', "\\\"");
    relay.until_said("ERROR", &fix, 1).await;
    let server_autovacuum: String = outbox
        .client
        .query_one("SHOW autovacuum", &[])
        .await
        .expect("SHOW autovacuum")
        .get(0);
    let place = if server_autovacuum == "off" {
        "autovacuum is off for the server"
    } else {
        "autovacuum is off for the table"
    };
    relay.until_said("WARN", place, 1).await;

    let ids = outbox.insert_many("a", 3).await;
    eventually("rows are relayed", Duration::from_secs(10), || async {
        broker.count() >= ids.len()
    })
    .await;
    // Absence can only be watched for a while: three rounds.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(relay.said("ERROR", &fix), 1, "{}", relay.output());
    assert_eq!(relay.said("WARN", "retention round failed"), 0);
    assert_eq!(relay.said("WARN", "never reused"), 1);
    assert_eq!(rows(&outbox).await, old.len() as i64 + 3, "nothing deleted");

    let grant = format!("GRANT DELETE ON {{outbox}} TO \"{role}\"");
    outbox.execute(&grant).await;
    let old_left = || async {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE id = ANY($1)",
            outbox.qualified()
        );
        let left: i64 = outbox.client.query_one(&sql, &[&old]).await.unwrap().get(0);
        left
    };
    eventually(
        "the old rows are deleted once granted",
        Duration::from_secs(10),
        || async { old_left().await == 0 },
    )
    .await;
    outbox
        .execute(&format!("REVOKE DELETE ON {{outbox}} FROM \"{role}\""))
        .await;
    relay.until_said("ERROR", &fix, 2).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(relay.said("ERROR", &fix), 2, "once per refusal");
    assert_eq!(relay.said("WARN", "retention round failed"), 0);
}

/// The check at start asks for what the configuration needs: with
/// retention off, a role with `SELECT` on the table alone is told of
/// `USAGE` on the schema and `UPDATE` on the table (relaying needs both),
/// and not of `DELETE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_at_start_names_each_grant_the_configuration_needs() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let role = unique("relay_grants");
    let _owned = OwnedRole::new(DATABASE_URL, &role);
    outbox
        .execute(&format!(
            "CREATE ROLE \"{role}\" LOGIN; GRANT SELECT ON {{outbox}} TO \"{role}\"",
        ))
        .await;
    let mut env = relay_env(&outbox, &broker, &["a"]);
    set_env(
        &mut env,
        "OUTBOX_DATABASE_URL",
        format!("postgres://{role}@127.0.0.1:5432/test"),
    );
    set_env(&mut env, "OUTBOX_RETENTION_MS", "0");
    let (relay, _) = spawn_relay(&env).await;
    let fix = format!("fix: GRANT UPDATE ON TABLE {}", outbox.qualified());
    relay
        .until_said("ERROR", &fix.replace('"', "\\\""), 1)
        .await;
    let usage = format!("fix: GRANT USAGE ON SCHEMA \\\"{}\\\"", outbox.schema);
    relay.until_said("ERROR", &usage, 1).await;
    let output = relay.output();
    assert!(output.contains("lacks UPDATE on TABLE"), "{output}");
    assert_eq!(relay.said("ERROR", "lacks SELECT"), 0, "{output}");
    assert!(output.contains("which relaying"), "{output}");
    assert_eq!(relay.said("ERROR", "DELETE"), 0, "{output}");
    assert_eq!(relay.said("WARN", "never reused"), 0, "retention is off");
}

/// A least-privilege role granted `SELECT` and `UPDATE` column by column,
/// on the columns the relay reads and sets, relays; the check at start names
/// no grant for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_given_per_column_count_as_the_tables() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let role = unique("relay_columns");
    let _owned = OwnedRole::new(DATABASE_URL, &role);
    outbox
        .execute(&format!(
            "CREATE ROLE \"{role}\" LOGIN; \
             GRANT USAGE ON SCHEMA \"{schema}\" TO \"{role}\"; \
             GRANT SELECT (id, tenant_id, kind, subject_id, payload, headers, occurred_at, \
                           published_at, attempts, last_error, parked_at, discarded_at), \
                   UPDATE (published_at, attempts, last_error, parked_at), DELETE \
                ON {{outbox}} TO \"{role}\"; \
             GRANT SELECT ON SEQUENCE \"{schema}\".\"{table}_id_seq\" TO \"{role}\"; \
             ALTER TABLE {{outbox}} SET (autovacuum_enabled = false)",
            schema = outbox.schema,
            table = outbox.table,
        ))
        .await;
    let mut env = relay_env(&outbox, &broker, &["a"]);
    set_env(
        &mut env,
        "OUTBOX_DATABASE_URL",
        format!("postgres://{role}@127.0.0.1:5432/test"),
    );
    set_env(&mut env, "OUTBOX_RETENTION_MS", "2000");
    let (relay, _) = spawn_relay(&env).await;
    let ids = outbox.insert_many("a", 3).await;
    eventually("rows are relayed", Duration::from_secs(10), || async {
        broker.count() >= ids.len()
    })
    .await;
    // The same check's last line: its ERRORs, if any, come before it.
    relay.until_said("WARN", "never reused", 1).await;
    assert_eq!(relay.said("ERROR", "lacks"), 0, "{}", relay.output());
}
