//! Settlement that survives a database blip, and the `message_id` template.

use std::time::Duration;

use lapin::types::AMQPValue;
use outbox_relay::template::MessageIdTemplate;

use crate::support::{
    Broker, Outbox, config, eventually, http_get, lines_at, metric, pg_client, relay_env, set_env,
    spawn_relay, start_relay,
};

/// The broker confirmed a whole batch, then the sweep's backend is
/// terminated before its marks commit: the relay marks the confirmed rows
/// again on a new connection, so the consumer gets each row once, not the
/// batch twice. The marks are held back deterministically: the test holds
/// the rows' locks until it has terminated the backend waiting on them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settlement_retried_across_a_terminated_backend() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let ids = outbox.insert_many("a", 50).await;
    let holder = pg_client().await;
    holder.batch_execute("BEGIN").await.unwrap();
    holder
        .query(
            &format!(
                "SELECT id FROM {} WHERE tenant_id = 'a' FOR UPDATE",
                outbox.qualified()
            ),
            &[],
        )
        .await
        .expect("lock the rows");

    let mut config = config(&outbox, &broker, &["a"]);
    config.batch_size = 100;
    let relay = start_relay(config).await;
    eventually(
        "the broker confirmed the batch",
        Duration::from_secs(20),
        || async { broker.count() == ids.len() },
    )
    .await;
    let admin = pg_client().await;
    let marks = format!("%{}%SET published_at = COALESCE%", outbox.schema);
    eventually(
        "the sweep's backend, waiting to mark, is terminated",
        Duration::from_secs(10),
        || async {
            let rows = admin
                .query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE wait_event_type = 'Lock' AND query LIKE $1 AND pid <> pg_backend_pid()",
                    &[&marks],
                )
                .await
                .unwrap();
            rows.iter().any(|row| row.get::<_, bool>(0))
        },
    )
    .await;
    holder.batch_execute("ROLLBACK").await.unwrap();

    eventually(
        "the confirmed rows are marked",
        Duration::from_secs(20),
        || async { outbox.pending("a").await == 0 },
    )
    .await;
    // Rows are sent only while pending: nothing more can arrive.
    let received: Vec<i64> = broker.received().iter().map(|m| m.id).collect();
    assert_eq!(
        received, ids,
        "each row once, in order: the batch was not sent again"
    );
    let metrics = relay.get("/metrics").await.1;
    assert_eq!(
        metric(
            &metrics,
            "outbox_settlement_retries_total{outcome=\"marked\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(metric(&metrics, "outbox_resent_rows_total"), Some(0.0));
    assert_eq!(
        metric(&metrics, "outbox_published_total{tenant=\"a\"}"),
        Some(ids.len() as f64)
    );
    relay.stop().await;
}

/// The `message_id` property is the rendered template; the `outbox-id`
/// header stays the row's numeric id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_id_is_the_rendered_template() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let ids = outbox.insert_many("a", 3).await;
    let mut config = config(&outbox, &broker, &["a"]);
    config.message_id = MessageIdTemplate::parse("{schema}.{table}:{id}").unwrap();
    let relay = start_relay(config).await;
    eventually("the rows arrive", Duration::from_secs(20), || async {
        broker.count() == ids.len()
    })
    .await;
    for (message, id) in broker.received().iter().zip(&ids) {
        assert_eq!(
            message.properties.message_id().as_ref().map(|m| m.as_str()),
            Some(format!("{}.outbox_message:{id}", outbox.schema).as_str())
        );
        assert_eq!(
            message.header("outbox-id"),
            Some(&AMQPValue::LongLongInt(*id))
        );
    }
    relay.stop().await;
}

/// A `BEFORE UPDATE` trigger that returns NULL for one tenant's rows, and
/// one that returns OLD for another's (the update then counts the row, with
/// `published_at` still NULL), keep the relay's marks from taking: the broker
/// confirms the rows, the commit succeeds, and the rows stay pending. The
/// relay says so in an ERROR naming the tenant and the cause, and backs the
/// tenant off rather than sending its batch again at every poll; the other
/// tenant is not held up. Once the trigger is gone, the rows are marked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marks_the_table_keeps_from_taking_are_reported_and_backed_off() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let function = format!("\"{}\".keep_pending", outbox.schema);
    outbox
        .execute(&format!(
            "CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.tenant_id = 'kept' THEN RETURN NULL; END IF;
                 IF NEW.tenant_id = 'old' THEN RETURN OLD; END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER keep_pending BEFORE UPDATE ON {{outbox}}
                 FOR EACH ROW EXECUTE FUNCTION {function}()"
        ))
        .await;
    let kept = [
        ("kept", outbox.insert_many("kept", 5).await),
        ("old", outbox.insert_many("old", 5).await),
    ];
    let other = outbox.insert_many("other", 5).await;
    let mut env = relay_env(&outbox, &broker, &["kept", "old", "other"]);
    set_env(&mut env, "OUTBOX_MAX_BACKOFF_MS", "2000");
    let (mut process, addr) = spawn_relay(&env).await;

    for (tenant, ids) in &kept {
        let named = format!("\"tenant\":\"{tenant}\"");
        process.until_said("ERROR", &named, 1).await;
        let output = process.output();
        let said = lines_at(&output, "ERROR")
            .into_iter()
            .find(|line| line.contains(&named))
            .expect("said");
        assert!(
            said.contains(&format!("\"row\":{}", ids[0]))
                && said.contains("stayed pending")
                && said.contains("BEFORE UPDATE trigger"),
            "{said}"
        );
    }
    eventually(
        "the other tenant is published",
        Duration::from_secs(20),
        || async { outbox.pending("other").await == 0 },
    )
    .await;
    let metrics = http_get(addr, "/metrics").await.1;
    for (tenant, ids) in &kept {
        let backoff = metric(
            &metrics,
            &format!("outbox_tenant_backoff_seconds{{tenant=\"{tenant}\"}}"),
        );
        assert!(
            backoff.is_some_and(|b| b > 0.0),
            "{tenant} backed off: {metrics}"
        );
        assert_eq!(outbox.pending(tenant).await, ids.len() as i64);
    }

    outbox
        .execute("DROP TRIGGER keep_pending ON {outbox}")
        .await;
    eventually(
        "the rows are marked once the trigger is gone",
        Duration::from_secs(20),
        || async { outbox.pending_of(&["kept", "old"]).await == 0 },
    )
    .await;
    process.signal("TERM");
    assert_eq!(process.wait(Duration::from_secs(20)).await, Some(0));
    let received = broker.received();
    let of = |tenant: &str| -> Vec<i64> {
        received
            .iter()
            .filter(|m| m.tenant() == tenant)
            .map(|m| m.id)
            .collect()
    };
    assert_eq!(of("other"), other, "the other tenant's rows once, in order");
    for (tenant, ids) in &kept {
        let sent = of(tenant);
        assert!(
            sent.chunks(ids.len()).all(|run| run == ids.as_slice()),
            "{tenant}'s rows, whole and in order each time: {sent:?}"
        );
    }
}
