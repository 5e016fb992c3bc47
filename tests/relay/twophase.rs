//! Two-phase commit writers, on a private cluster with
//! `max_prepared_transactions` > 0 (the machine's server has 0), started once
//! per test run like the TLS and failover clusters: with the one documented
//! setting for their role (`outbox_relay.notify = off`) they prepare and
//! commit through the trigger; a prepared transaction left open holds its
//! tenant's later rows back (shown by `outbox_writer_wait_seconds`), and
//! once committed everything arrives in id order.

use std::sync::OnceLock;
use std::time::Duration;

use outbox_relay::config::Config;
use outbox_relay::store::Store;
use tokio_postgres::{Client, NoTls};

use crate::support::{
    Broker, Outbox, PrivateServer, by_tenant, config, eventually, metric, private_cluster,
    start_relay, unique,
};

/// The private cluster, with a database `test` and a role `preparer` that
/// may insert into any outbox table the tests make and notifies never.
pub(crate) struct Cluster {
    port: u16,
    _server: PrivateServer,
}

pub(crate) fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let server = private_cluster(
            "two-phase cluster",
            "outbox-relay-twophase-",
            &["max_prepared_transactions=10", "max_connections=40"],
        );
        server.psql(
            "test",
            "CREATE ROLE preparer LOGIN; ALTER ROLE preparer SET outbox_relay.notify = off",
        );
        Cluster {
            port: server.port,
            _server: server,
        }
    })
}

/// Only one test at a time uses the cluster: one restarts it.
pub(crate) static CLUSTER_IN_USE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

impl Cluster {
    pub(crate) fn url(&self, user: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/test", self.port)
    }

    pub(crate) async fn client(&self, user: &str) -> Client {
        let (client, connection) = tokio_postgres::connect(&self.url(user), NoTls)
            .await
            .expect("the two-phase cluster is reachable");
        tokio::spawn(connection);
        client
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_transactions_commit_through_the_trigger_and_hold_back_only_later_rows() {
    let cluster = tokio::task::spawn_blocking(cluster).await.expect("cluster");
    let schema = unique("twophase");
    let mut migrate = Config::with_tenants(["migrate"]);
    migrate.database_url = cluster.url("postgres").parse().expect("url");
    migrate.schema = schema.clone();
    outbox_relay::migrate::run(&Store::new(&migrate).expect("store"), &migrate)
        .await
        .expect("migrations apply");
    let outbox = Outbox::adopt_in(
        &cluster.url("postgres"),
        schema.clone(),
        "outbox_message".into(),
        cluster.client("postgres").await,
    );
    outbox
        .client
        .batch_execute(&format!(
            "GRANT USAGE ON SCHEMA \"{schema}\" TO preparer; GRANT INSERT, SELECT ON {} TO preparer",
            outbox.qualified()
        ))
        .await
        .expect("grants");
    let broker = Broker::create(&["#"]).await;
    let mut relayed = config(&outbox, &broker, &["a", "b"]);
    relayed.database_url = cluster.url("postgres").parse().expect("url");
    relayed.listen_database_url = relayed.database_url.clone();
    let relay = start_relay(relayed).await;
    let insert = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ($1, 'k', $2, '{{}}') RETURNING id",
        outbox.qualified()
    );
    // The relay waits for notifications (the table is quiet): a writer
    // without the setting notifies, and cannot prepare.
    let plain = cluster.client("postgres").await;
    eventually(
        "the relay holds the wake-up lock",
        Duration::from_secs(10),
        || async {
            plain
                .query_one(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 \
                     AND classid::bigint = (hashtext('outbox-relay wakeup')::bigint & 4294967295)",
                    &[],
                )
                .await
                .expect("pg_locks")
                .get::<_, i64>(0)
                == 1
        },
    )
    .await;
    plain.batch_execute("BEGIN").await.unwrap();
    plain.query_one(&insert, &[&"b", &"plain"]).await.unwrap();
    let refused = plain
        .batch_execute("PREPARE TRANSACTION 'notified'")
        .await
        .expect_err("a transaction that notified cannot be prepared");
    assert!(
        refused.to_string().contains("NOTIFY") || format!("{refused:?}").contains("NOTIFY"),
        "{refused:?}"
    );
    plain.batch_execute("ROLLBACK").await.ok();

    // With `outbox_relay.notify = off` for their role, writers prepare.
    let preparer = cluster.client("preparer").await;
    preparer.batch_execute("BEGIN").await.unwrap();
    let prepared: i64 = preparer
        .query_one(&insert, &[&"a", &"prepared"])
        .await
        .unwrap()
        .get(0);
    preparer
        .batch_execute("PREPARE TRANSACTION 'outbox_twophase'")
        .await
        .expect("a writer with outbox_relay.notify = off prepares");
    // A later row of the same tenant, and one of another tenant.
    let later: i64 = outbox
        .client
        .query_one(&insert, &[&"a", &"later"])
        .await
        .unwrap()
        .get(0);
    let other: i64 = outbox
        .client
        .query_one(&insert, &[&"b", &"other"])
        .await
        .unwrap()
        .get(0);
    assert!(prepared < later);
    eventually(
        "the other tenant goes on",
        Duration::from_secs(20),
        || async { outbox.row(other).await.published },
    )
    .await;
    eventually(
        "the tenant's wait for the prepared transaction shows",
        Duration::from_secs(20),
        || async {
            let (_, text) = relay.get("/metrics").await;
            metric(&text, "outbox_writer_wait_seconds{tenant=\"a\"}").is_some_and(|s| s > 0.0)
        },
    )
    .await;
    assert!(
        !outbox.row(later).await.published,
        "the later row waits for the prepared transaction's lower id"
    );
    outbox
        .client
        .batch_execute("COMMIT PREPARED 'outbox_twophase'")
        .await
        .expect("commit prepared");
    eventually(
        "both rows of the tenant arrive",
        Duration::from_secs(20),
        || async { outbox.all_pending().await == 0 && broker.count() >= 3 },
    )
    .await;
    let received = by_tenant(&broker.received());
    assert_eq!(received["a"], [prepared, later], "in id order");
    assert_eq!(received["b"], [other]);
    eventually("the wait is over", Duration::from_secs(20), || async {
        let (_, text) = relay.get("/metrics").await;
        metric(&text, "outbox_writer_wait_seconds{tenant=\"a\"}") == Some(0.0)
    })
    .await;
    relay.stop().await;
}
