//! Any value the table can hold is handled: infinite, ancient and future
//! `occurred_at` in served and unserved tenants leave the poll, the lag,
//! `status` and the metrics working for everyone; a writer's fast clock does
//! not hide a blocked tenant's lag; new tables keep such timestamps out; and
//! a `payload` column the relay cannot send is named once and stops it.

use std::time::Duration;

use serde_json::Value;

use crate::support::{
    Broker, DATABASE_URL, Outbox, by_tenant, config, eventually, metric, relay_command, relay_env,
    spawn_relay, start_relay,
};

/// The lag cap of the store's lag queries: 10,000 years, in milliseconds.
const LAG_CAP_MS: i64 = 315_576_000_000_000;

/// Runs the binary to completion with `env` and `args`: (code, stdout, stderr).
fn run(env: &[(String, String)], args: &[&str]) -> (Option<i32>, String, String) {
    let mut command = relay_command();
    command
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .args(args);
    let output = command.output().expect("the binary runs");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Inserts one row of `tenant` with `occurred_at` given as SQL; returns its id.
async fn insert_at(outbox: &Outbox, tenant: &str, occurred_at: &str) -> i64 {
    let sql = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload, occurred_at)
         VALUES ($1, 'thing.changed', 's', '{{}}', {occurred_at}) RETURNING id",
        outbox.qualified()
    );
    outbox
        .client
        .query_one(&sql, &[&tenant])
        .await
        .expect("insert")
        .get(0)
}

/// The tenant's entry in a `/healthz` or `status --json` document.
fn tenant<'a>(document: &'a Value, name: &str) -> &'a Value {
    document["tenants"]
        .as_array()
        .and_then(|ts| ts.iter().find(|t| t["tenant"] == name))
        .unwrap_or_else(|| panic!("no tenant {name} in {document}"))
}

/// Rows with `infinity`, `-infinity`, year-1 and future `occurred_at` beside
/// healthy tenants, in served and unserved tenants, in a table made before
/// the range check (the constraint dropped). Which of those rows go out is
/// not asserted here (the batch read decides); everything around them is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_occurred_at_in_any_tenant_leaves_poll_lag_status_and_metrics_working() {
    let outbox = Outbox::create().await;
    outbox
        .execute("ALTER TABLE {outbox} DROP CONSTRAINT occurred_at_in_range")
        .await;
    // `fast` is unbound: its row is refused (unroutable) and stays blocked.
    let broker = Broker::create(&["ok.#", "minus.#", "plus.#", "ancient.#"]).await;
    for (tenant, at) in [
        ("minus", "'-infinity'"),
        ("plus", "'infinity'"),
        ("ancient", "'0001-06-01 00:00:00+00'"),
        // A writer whose clock runs an hour fast.
        ("fast", "now() + interval '1 hour'"),
        ("u_minus", "'-infinity'"),
        ("u_plus", "'infinity'"),
        ("u_ancient", "'0001-06-01 00:00:00+00'"),
        ("u_future", "now() + interval '1 hour'"),
    ] {
        insert_at(&outbox, tenant, at).await;
    }
    // A healthy tenant, one of its rows a month old: a valid delay past the
    // delivery-delay histogram's range.
    let mut ok_ids = vec![insert_at(&outbox, "ok", "now() - interval '30 days'").await];
    for _ in 0..3 {
        ok_ids.push(insert_at(&outbox, "ok", "now()").await);
    }
    let served = ["ok", "minus", "plus", "ancient", "fast"];
    let mut config = config(&outbox, &broker, &served);
    config.max_lag_ms = 1_000;
    let relay = start_relay(config).await;

    eventually(
        "the healthy tenant's rows are received",
        Duration::from_secs(20),
        || async {
            by_tenant(&broker.received())
                .get("ok")
                .is_some_and(|ids| ids == &ok_ids)
        },
    )
    .await;
    eventually("/readyz answers 200", Duration::from_secs(15), || async {
        relay.get("/readyz").await.0 == 200
    })
    .await;

    // The fast clock's tenant: 0 by the database, yet its lag grows while
    // its row is blocked.
    eventually(
        "the fast-clock tenant's lag passes max_lag_ms on /healthz and the gauge",
        Duration::from_secs(20),
        || async {
            let (_, body) = relay.get("/healthz").await;
            let health: Value = serde_json::from_str(&body).unwrap();
            let gauge = metric(
                &relay.get("/metrics").await.1,
                "outbox_lag_seconds{tenant=\"fast\"}",
            );
            tenant(&health, "fast")["lag_ms"].as_i64().unwrap() > 1_500
                && gauge.is_some_and(|lag| lag > 1.5)
        },
    )
    .await;
    eventually(
        "the fast-clock tenant is blocked by its refused row",
        Duration::from_secs(20),
        || async {
            outbox
                .first_pending("fast")
                .await
                .is_some_and(|row| row.attempts > 0)
        },
    )
    .await;

    let (status, body) = relay.get("/healthz").await;
    assert_eq!(status, 503, "{body}");
    let health: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(health["status"], "lagging", "{body}");
    assert_eq!(health["error"], Value::Null, "{body}");
    assert_eq!(tenant(&health, "ok")["pending"], false, "{body}");
    assert_eq!(tenant(&health, "ok")["lag_ms"], 0, "{body}");
    assert_eq!(
        tenant(&health, "minus")["lag_ms"],
        LAG_CAP_MS,
        "-infinity is older than any row: {body}"
    );
    for name in served {
        let lag = tenant(&health, name)["lag_ms"].as_i64().unwrap();
        assert!((0..=LAG_CAP_MS).contains(&lag), "{name}: {body}");
    }

    let metrics = relay.get("/metrics").await.1;
    assert_eq!(metric(&metrics, "outbox_database_up"), Some(1.0));
    assert_eq!(
        metric(&metrics, "outbox_lag_seconds{tenant=\"minus\"}"),
        Some(LAG_CAP_MS as f64 / 1000.0)
    );
    assert_eq!(
        metric(&metrics, "outbox_lag_seconds{tenant=\"ok\"}"),
        Some(0.0)
    );
    let delay_sum = metric(&metrics, "outbox_delivery_delay_seconds_sum").unwrap();
    let delay_count = metric(&metrics, "outbox_delivery_delay_seconds_count").unwrap();
    assert!(delay_count >= 4.0, "{metrics}");
    // At most two rows older than a day went out (the month-old one, and the
    // year-1 one if the batch read let it): each counts as one day at most.
    assert!(
        delay_sum <= 2.0 * 86_400.0 + 60.0 * delay_count,
        "a row older than a day counts as one day at most: {metrics}"
    );

    // `status`, from the database alone: the -infinity tenant lags.
    let env = relay_env(&outbox, &broker, &served);
    let (code, stdout, stderr) = run(&env, &["status", "--json"]);
    assert_eq!(code, Some(1), "a tenant lags: {stdout}{stderr}");
    let report: Value = serde_json::from_str(&stdout).expect("only JSON on stdout");
    assert_eq!(tenant(&report, "minus")["lag_ms"], LAG_CAP_MS, "{stdout}");
    assert_eq!(tenant(&report, "minus")["lagging"], true, "{stdout}");
    assert_eq!(tenant(&report, "ok")["lagging"], false, "{stdout}");
    assert_eq!(tenant(&report, "fast")["lag_ms"], 0, "{stdout}");

    // The poll still works: a new row of the healthy tenant goes out.
    let late = insert_at(&outbox, "ok", "now()").await;
    eventually(
        "a row written later is received",
        Duration::from_secs(20),
        || async { broker.received().iter().any(|r| r.id == late) },
    )
    .await;
    assert_eq!(relay.get("/readyz").await.0, 200);
    relay.stop().await;
}

/// The migration's range check: new tables take only finite timestamps of
/// years 1 to 9999; an existing table is left as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_tables_keep_occurred_at_finite_and_in_years_1_to_9999() {
    let outbox = Outbox::create().await;
    for refused in [
        "'infinity'",
        "'-infinity'",
        "'0001-12-31 23:59:59+00 BC'",
        "'10000-01-01 00:00:00+00'",
    ] {
        let sql = format!(
            "INSERT INTO {} (tenant_id, kind, subject_id, occurred_at) VALUES ('a', 'k', 's', {refused})",
            outbox.qualified()
        );
        let error = outbox.client.execute(&sql, &[]).await.expect_err(refused);
        assert_eq!(
            error.code().map(|c| c.code()),
            Some("23514"),
            "{refused}: {error:?}"
        );
        assert!(
            format!("{error:?}").contains("occurred_at_in_range"),
            "{refused}: {error:?}"
        );
    }
    for accepted in [
        "'0001-01-01 00:00:00+00'",
        "'9999-12-31 23:59:59.999999+00'",
        "now()",
    ] {
        insert_at(&outbox, "a", accepted).await;
    }

    // An existing table (here: one without the check) is not altered by
    // migrating again.
    outbox
        .execute("ALTER TABLE {outbox} DROP CONSTRAINT occurred_at_in_range")
        .await;
    let mut config = outbox_relay::config::Config::with_tenants(["a"]);
    config.database_url = DATABASE_URL.parse().unwrap();
    config.schema = outbox.schema.clone();
    config.table = outbox.table.clone();
    let store = outbox_relay::store::Store::new(&config).unwrap();
    outbox_relay::migrate::run(&store, &config).await.unwrap();
    insert_at(&outbox, "a", "'infinity'").await;
}

/// A `bytea` payload would go out as hex text: the relay names the column
/// and its type once, sends nothing, keeps the database "up" (it answers),
/// and relays as soon as the column is fixed. `migrate` and `status` say so
/// and exit 2, as for a configuration the relay cannot use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfit_payload_column_is_named_once_and_nothing_is_sent_until_fixed() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    outbox
        .execute(
            "ALTER TABLE {outbox} ALTER COLUMN payload TYPE bytea USING convert_to(payload, 'UTF8')",
        )
        .await;
    outbox
        .execute(
            "INSERT INTO {outbox} (tenant_id, kind, subject_id, payload)
             VALUES ('a', 'thing.changed', 's', convert_to('{\"n\":1}', 'UTF8'))",
        )
        .await;
    let env = relay_env(&outbox, &broker, &["a"]);
    let (mut process, addr) = spawn_relay(&env).await;
    let error_lines = |output: &str| -> Vec<String> {
        output
            .lines()
            .filter(|line| line.contains("\"level\":\"ERROR\""))
            .map(String::from)
            .collect()
    };
    eventually(
        "the unfit column is reported",
        Duration::from_secs(20),
        || {
            let found = !error_lines(&process.output()).is_empty();
            async move { found }
        },
    )
    .await;
    // An observation window of some twenty polls (50 ms each): the report is
    // not repeated, and nothing is sent.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let output = process.output();
    let errors = error_lines(&output);
    assert_eq!(errors.len(), 1, "reported once:\n{output}");
    assert!(
        errors[0].contains("column \\\"payload\\\"") && errors[0].contains("is bytea"),
        "names the column and its type:\n{output}"
    );
    assert!(
        !output.contains("database unreachable"),
        "the database answered; it is not unreachable:\n{output}"
    );
    assert_eq!(broker.count(), 0, "nothing sent");
    assert_eq!(outbox.pending("a").await, 1);
    let (status, body) = crate::support::http_get(addr, "/readyz").await;
    assert!(body.contains("\"database\":true"), "{status} {body}");

    for command in ["migrate", "status"] {
        let (code, _, stderr) = run(&env, &[command]);
        assert_eq!(code, Some(2), "{command}: {stderr}");
        assert!(
            stderr.contains("column \"payload\"") && stderr.contains("is bytea"),
            "{command}: {stderr}"
        );
    }

    outbox
        .execute(
            "ALTER TABLE {outbox} ALTER COLUMN payload TYPE text USING convert_from(payload, 'UTF8')",
        )
        .await;
    eventually(
        "the row goes out once the column is text",
        Duration::from_secs(20),
        || async { broker.count() == 1 },
    )
    .await;
    assert_eq!(broker.received()[0].body, b"{\"n\":1}", "the text, not hex");
    process.signal("TERM");
    assert_eq!(process.wait(Duration::from_secs(20)).await, Some(0));
}

/// Tenants whose names are hostile to a statement they are written into
/// (quotes, backslashes, a would-be injection, an `E'` prefix, non-ASCII),
/// each with enough rows for several batches read ahead in one claim (the
/// claim's prepared read takes the tenant as a literal): every row goes out
/// once, in order, marked, and the table is intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_with_quotes_and_backslashes_in_their_names_drain_across_batches() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let tenants = [
        "o'brien",
        r"back\slash",
        r"\'); DROP TABLE t; --",
        "E'x''",
        "ünï 'q' \\",
    ];
    let mut committed = std::collections::BTreeMap::new();
    for tenant in tenants {
        committed.insert(tenant.to_string(), outbox.insert_many(tenant, 40).await);
    }
    let mut config = config(&outbox, &broker, &tenants);
    config.batch_size = 8;
    // A slot for every tenant: none waits, so each claim reads ahead.
    config.concurrency = tenants.len();
    config.pool_size = tenants.len() + 2;
    let relay = start_relay(config).await;
    let duplicates =
        crate::support::check_history(&outbox, &broker, &committed, Duration::from_secs(60)).await;
    assert_eq!(duplicates, 0, "no duplicates without a fault");
    let (_, metrics) = relay.get("/metrics").await;
    let failed: Vec<&str> = metrics
        .lines()
        .filter(|line| line.starts_with("outbox_sweeps_total{outcome=\"failed\""))
        .collect();
    assert!(failed.is_empty(), "no sweep failed: {failed:?}");
    let tables: i64 = outbox
        .client
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE schemaname = $1",
            &[&outbox.schema],
        )
        .await
        .expect("the schema's tables")
        .get(0);
    assert!(tables >= 1, "the outbox table is intact");
    relay.stop().await;
}
