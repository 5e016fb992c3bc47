//! Rows the relay cannot turn into a message, whatever the table holds: each
//! is refused as `invalid` (with `attempts` and `last_error`) without being
//! sent, and without failing the read of its batch; other tenants go on.

use std::time::Duration;

use crate::support::{Broker, Outbox, by_tenant, config, eventually, start_relay};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_no_message_can_carry_are_refused_as_invalid_and_others_go_on() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    // A table made before the checks that keep such values out.
    outbox
        .execute(
            "DO $$ DECLARE c text; BEGIN
               FOR c IN SELECT conname FROM pg_constraint
                        WHERE conrelid = '{outbox}'::regclass AND contype = 'c' LOOP
                 EXECUTE format('ALTER TABLE {outbox} DROP CONSTRAINT %I', c);
               END LOOP;
             END $$;",
        )
        .await;
    let defects = [
        (
            "far",
            "occurred_at = '20000-01-01 00:00:00+00'",
            "occurred_at is infinite or outside the years 1-9999",
        ),
        (
            "inf",
            "occurred_at = 'infinity'",
            "occurred_at is infinite or outside the years 1-9999",
        ),
        (
            "kind",
            "kind = repeat('k', 300)",
            "kind is 300 bytes, over 255",
        ),
        (
            "subject",
            "subject_id = repeat('s', 2000000)",
            "subject_id is 2000000 bytes, over 524288",
        ),
    ];
    let mut blocked = Vec::new();
    for (tenant, change, _) in &defects {
        let id = outbox.insert(tenant, "k", "s", Some("{}"), None).await;
        outbox
            .execute(&format!("UPDATE {{outbox}} SET {change} WHERE id = {id}"))
            .await;
        blocked.push(id);
    }
    let fine = outbox.insert_many("fine", 20).await;
    let mut tenants: Vec<&str> = defects.iter().map(|(t, _, _)| *t).collect();
    tenants.push("fine");
    let relay = start_relay(config(&outbox, &broker, &tenants)).await;

    eventually(
        "the healthy tenant arrives",
        Duration::from_secs(20),
        || async { by_tenant(&broker.received()).get("fine") == Some(&fine) },
    )
    .await;
    for ((tenant, _, error), id) in defects.iter().zip(&blocked) {
        eventually(
            &format!("{tenant}'s row is refused"),
            Duration::from_secs(20),
            || async { outbox.row(*id).await.attempts >= 1 },
        )
        .await;
        let row = outbox.row(*id).await;
        let last_error = row.last_error.unwrap_or_default();
        assert!(
            last_error.starts_with("invalid: ") && last_error.contains(error),
            "{tenant}: {last_error}"
        );
        assert!(!row.published, "{tenant}: never marked");
    }
    let received = by_tenant(&broker.received());
    for (tenant, _, _) in &defects {
        assert!(!received.contains_key(*tenant), "{tenant}: nothing sent");
    }
    assert_eq!(relay.get("/readyz").await.0, 200);
    relay.stop().await;
}
