//! Schema drift: the table's columns change under a running relay. Every
//! read checks the types its row description carries: a column the relay
//! cannot read stops the table's reads with one ERROR (again only after it
//! was fixed and broken again), nothing is published or refused meanwhile,
//! `/healthz` turns 503 past the lag, and reading resumes once it is fixed.
//! A `timestamp` (without time zone) `occurred_at` is read as UTC, and
//! `json`/`jsonb` payloads go out as their text, whether the table was made
//! so or altered to it while the relay runs.

use std::time::Duration;

use lapin::types::AMQPValue;
use serde_json::json;

use crate::support::{
    Broker, Outbox, config, eventually, http_get, lines_at, pg_client, relay_command, relay_env,
    set_env, spawn_relay, start_relay, unique,
};

/// Inserts one row of `tenant` whose payload is `payload` (SQL); its id.
async fn insert(outbox: &Outbox, tenant: &str, payload: &str) -> i64 {
    outbox
        .client
        .query_one(
            &format!(
                "INSERT INTO {} (tenant_id, kind, subject_id, payload)
                 VALUES ($1, 'thing.changed', 's', {payload}) RETURNING id",
                outbox.qualified()
            ),
            &[&tenant],
        )
        .await
        .expect("insert")
        .get(0)
}

/// Rows of the table with attempts or a last_error: blamed for something.
async fn blamed(outbox: &Outbox) -> i64 {
    outbox
        .client
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE attempts > 0 OR last_error IS NOT NULL",
                outbox.qualified()
            ),
            &[],
        )
        .await
        .expect("count")
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_altered_to_bytea_under_the_relay_stops_reading_with_one_error_until_fixed() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let mut env = relay_env(&outbox, &broker, &["a", "b"]);
    set_env(&mut env, "OUTBOX_MAX_LAG_MS", "1000");
    let (mut process, addr) = spawn_relay(&env).await;
    insert(&outbox, "a", "'{\"n\":1}'").await;
    eventually(
        "the first row goes out",
        Duration::from_secs(20),
        || async { broker.count() == 1 },
    )
    .await;

    for round in 1..=2 {
        outbox
            .execute(
                "ALTER TABLE {outbox} ALTER COLUMN payload TYPE bytea \
                 USING convert_to(payload, 'UTF8')",
            )
            .await;
        for tenant in ["a", "b"] {
            outbox
                .execute(&format!(
                    "INSERT INTO {{outbox}} (tenant_id, kind, subject_id, payload)
                     VALUES ('{tenant}', 'thing.changed', 's', convert_to('{{\"round\":{round}}}', 'UTF8'))"
                ))
                .await;
        }
        eventually(
            "the unfit column is reported",
            Duration::from_secs(20),
            || {
                let errors = lines_at(&process.output(), "ERROR").len();
                async move { errors == round }
            },
        )
        .await;
        // The rows wait past max_lag_ms: /healthz says so.
        eventually(
            "/healthz turns 503 past the lag",
            Duration::from_secs(20),
            || async {
                let (code, body) = http_get(addr, "/healthz").await;
                code == 503 && body.contains("\"status\":\"lagging\"")
            },
        )
        .await;
        let output = process.output();
        let errors = lines_at(&output, "ERROR");
        assert_eq!(errors.len(), round, "said once per change:\n{output}");
        let said = errors[round - 1];
        for named in [
            "column \\\"payload\\\"",
            "is bytea",
            "ALTER COLUMN payload TYPE text USING convert_from(payload, 'UTF8')",
        ] {
            assert!(said.contains(named), "{named}: {said}");
        }
        assert!(
            !output.contains("database unreachable") && !output.contains("sweep failed"),
            "no outage, no tenant's failure:\n{output}"
        );
        assert_eq!(
            broker.count(),
            1 + 2 * (round - 1),
            "nothing sent meanwhile"
        );
        assert_eq!(blamed(&outbox).await, 0, "nothing refused row by row");
        let (_, ready) = http_get(addr, "/readyz").await;
        assert!(ready.contains("\"database\":true"), "{ready}");

        outbox
            .execute(
                "ALTER TABLE {outbox} ALTER COLUMN payload TYPE text \
                 USING convert_from(payload, 'UTF8')",
            )
            .await;
        eventually(
            "the rows go out once the column is text",
            Duration::from_secs(20),
            || async { broker.count() == 1 + 2 * round },
        )
        .await;
        let received = broker.received();
        for message in &received[received.len() - 2..] {
            assert_eq!(
                message.body,
                format!("{{\"round\":{round}}}").as_bytes(),
                "the text, not hex"
            );
        }
        assert_eq!(lines_at(&process.output(), "ERROR").len(), round);
    }
    let output = process.output();
    assert_eq!(
        output.matches("columns fit again; reading resumes").count(),
        2,
        "{output}"
    );
    assert_eq!(blamed(&outbox).await, 0);
    process.signal("TERM");
    assert_eq!(process.wait(Duration::from_secs(20)).await, Some(0));
}

/// A column altered to a type of the application's own (here an enum): the
/// driver knows it only by a lookup of its own, which a large read can hold
/// up; either way the relay names the column and its type, sends nothing,
/// and goes on once the column is text again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_altered_to_a_type_of_the_applications_own_is_named_and_held() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let env = relay_env(&outbox, &broker, &["a"]);
    let (mut process, _addr) = spawn_relay(&env).await;
    insert(&outbox, "a", "'{}'").await;
    eventually(
        "the first row goes out",
        Duration::from_secs(20),
        || async { broker.count() == 1 },
    )
    .await;
    let mood = format!("\"{}\".mood", outbox.schema);
    outbox
        .execute(&format!(
            "CREATE TYPE {mood} AS ENUM ('calm', 'restless');
             ALTER TABLE {{outbox}} ALTER COLUMN payload TYPE {mood} USING 'calm';
             INSERT INTO {{outbox}} (tenant_id, kind, subject_id, payload)
             SELECT 'a', 'thing.changed', 's-' || g, 'restless' FROM generate_series(1, 2000) g"
        ))
        .await;
    // A read held up by the lookup ends at the store's 10 s deadline.
    eventually(
        "the unfit column is reported",
        Duration::from_secs(40),
        || {
            let errors = lines_at(&process.output(), "ERROR").len();
            async move { errors == 1 }
        },
    )
    .await;
    let output = process.output();
    let said = lines_at(&output, "ERROR")[0];
    assert!(
        said.contains("column \\\"payload\\\"") && said.contains("is mood"),
        "{said}"
    );
    assert_eq!(broker.count(), 1, "nothing sent");
    assert_eq!(blamed(&outbox).await, 0, "nothing refused row by row");
    outbox
        .execute("ALTER TABLE {outbox} ALTER COLUMN payload TYPE text USING payload::text")
        .await;
    eventually(
        "the rows go out once the column is text",
        Duration::from_secs(60),
        || async { outbox.pending("a").await == 0 && broker.count() >= 2 },
    )
    .await;
    assert_eq!(broker.received()[1].body, b"restless");
    assert_eq!(lines_at(&process.output(), "ERROR").len(), 1);
    process.signal("TERM");
    assert_eq!(process.wait(Duration::from_secs(20)).await, Some(0));
}

/// A column dropped under the relay makes the read fail (SQLSTATE 42703):
/// the sweeps already under way fail, no other starts until the next poll
/// has checked the columns, which names the missing one once; reading
/// resumes once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_dropped_under_the_relay_is_named_once_and_reading_resumes_when_it_is_back() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let tenants: Vec<String> = (0..20).map(|i| format!("t{i}")).collect();
    let names: Vec<&str> = tenants.iter().map(String::as_str).collect();
    let env = relay_env(&outbox, &broker, &names);
    let (mut process, _addr) = spawn_relay(&env).await;
    outbox
        .execute(
            "ALTER TABLE {outbox} DROP COLUMN headers;
             INSERT INTO {outbox} (tenant_id, kind, subject_id, payload)
             SELECT 't' || g, 'thing.changed', 's', '{}' FROM generate_series(0, 19) g",
        )
        .await;
    eventually(
        "the missing column is reported",
        Duration::from_secs(20),
        || {
            let errors = lines_at(&process.output(), "ERROR").len();
            async move { errors == 1 }
        },
    )
    .await;
    let output = process.output();
    assert!(
        lines_at(&output, "ERROR")[0].contains("has no column \\\"headers\\\""),
        "{output}"
    );
    let failed = output.matches("sweep failed").count();
    assert!(
        failed <= 4,
        "only the sweeps under way (concurrency 4) failed, not every tenant's: {failed}\n{output}"
    );
    assert_eq!(broker.count(), 0);
    assert_eq!(blamed(&outbox).await, 0);
    outbox
        .execute("ALTER TABLE {outbox} ADD COLUMN headers jsonb")
        .await;
    eventually(
        "every row goes out once the column is back",
        Duration::from_secs(40),
        || async { broker.count() == 20 },
    )
    .await;
    assert_eq!(lines_at(&process.output(), "ERROR").len(), 1);
    process.signal("TERM");
    assert_eq!(process.wait(Duration::from_secs(20)).await, Some(0));
}

/// A column the relay only writes, dropped under it (`last_error`): the
/// refusal it cannot record fails its sweep, and the poll's check that
/// follows names the column once, with the `ADD COLUMN` that fixes it (no
/// refusal was recorded, and without the check none ever would be, nor the
/// row parked). Once the column is back, the row is blamed as it should be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_written_column_dropped_under_the_relay_is_named_once() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let mut env = relay_env(&outbox, &broker, &["w"]);
    set_env(&mut env, "OUTBOX_MAX_BACKOFF_MS", "200");
    let (mut process, _addr) = spawn_relay(&env).await;
    outbox
        .execute("ALTER TABLE {outbox} DROP COLUMN last_error")
        .await;
    let bad = outbox
        .insert("w", "thing.changed", "s", Some("{}"), Some(json!([1])))
        .await;
    eventually(
        "the missing column is named",
        Duration::from_secs(20),
        || {
            let errors = process.said("ERROR", "has no column");
            async move { errors == 1 }
        },
    )
    .await;
    let output = process.output();
    assert!(
        lines_at(&output, "ERROR")[0]
            .contains("has no column \\\"last_error\\\"; the relay writes it. Fix: ALTER TABLE"),
        "{output}"
    );
    assert!(output.contains("ADD COLUMN last_error text"), "{output}");
    outbox
        .execute("ALTER TABLE {outbox} ADD COLUMN last_error text")
        .await;
    eventually(
        "the refusal is recorded once the column is back",
        Duration::from_secs(20),
        || async { outbox.row(bad).await.attempts >= 1 },
    )
    .await;
    assert_eq!(
        outbox.row(bad).await.last_error.as_deref(),
        Some("invalid: headers must be a JSON object, found an array")
    );
    assert_eq!(process.said("ERROR", "has no column"), 1, "said once");
    assert_eq!(broker.count(), 0);
    process.signal("TERM");
    assert_eq!(process.wait(Duration::from_secs(20)).await, Some(0));
}

/// The table dropped and made again under a running relay (by `migrate`
/// here; an application's migration could do the same): while it is gone
/// the poll names it, and once it is back its rows go out with no sweep
/// failing on the id sequence of the table that was dropped (SQLSTATE
/// XX000): the claim and the wake-up read the new table's sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_dropped_and_made_again_under_the_relay_is_read_with_its_new_sequence() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let env = relay_env(&outbox, &broker, &["a"]);
    let (mut process, _addr) = spawn_relay(&env).await;
    outbox.insert_many("a", 1).await;
    eventually(
        "the first row goes out",
        Duration::from_secs(20),
        || async { broker.count() == 1 },
    )
    .await;
    outbox.execute("DROP TABLE {outbox}").await;
    process.until_said("ERROR", "does not exist", 1).await;
    let migrated = relay_command()
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .arg("migrate")
        .output()
        .expect("the binary runs");
    assert_eq!(migrated.status.code(), Some(0), "{migrated:?}");
    outbox.insert_many("a", 2).await;
    eventually(
        "the new table's rows go out",
        Duration::from_secs(20),
        || async { broker.count() == 3 },
    )
    .await;
    let output = process.output();
    assert_eq!(process.said("WARN", "sweep failed"), 0, "{output}");
    assert!(!output.contains("XX000"), "{output}");
    process.signal("TERM");
    assert_eq!(process.wait(Duration::from_secs(20)).await, Some(0));
}

/// The `outbox-occurred-at` header and the `timestamp` property of `message`.
fn occurred_at(message: &crate::support::Received) -> (String, u64) {
    let header = match message.header("outbox-occurred-at") {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        other => panic!("no outbox-occurred-at: {other:?}"),
    };
    let timestamp = message.properties.timestamp().expect("a timestamp");
    (header, timestamp)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn occurred_at_and_payload_altered_to_timestamp_and_json_under_the_relay_keep_going() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let relay = start_relay(config(&outbox, &broker, &["a"])).await;
    outbox
        .execute(
            "INSERT INTO {outbox} (tenant_id, kind, subject_id, payload, occurred_at)
             VALUES ('a', 'thing.changed', 's', '{\"n\": 1}', '2001-02-03 04:05:06+00')",
        )
        .await;
    eventually(
        "the first row goes out",
        Duration::from_secs(20),
        || async { broker.count() == 1 },
    )
    .await;
    outbox
        .execute(
            "ALTER TABLE {outbox} ALTER COLUMN occurred_at TYPE timestamp \
             USING occurred_at AT TIME ZONE 'UTC', \
             ALTER COLUMN occurred_at SET DEFAULT now() AT TIME ZONE 'UTC', \
             ALTER COLUMN payload TYPE json USING payload::json",
        )
        .await;
    // Spaces kept: a json payload goes out as the application wrote it.
    outbox
        .execute(
            "INSERT INTO {outbox} (tenant_id, kind, subject_id, payload, occurred_at)
             VALUES ('a', 'thing.changed', 's', '{\"n\":  2,\"m\" : [1]}', '2002-03-04 05:06:07')",
        )
        .await;
    eventually(
        "the row after the change goes out",
        Duration::from_secs(20),
        || async { broker.count() == 2 },
    )
    .await;
    let received = broker.received();
    assert_eq!(received[0].body, b"{\"n\": 1}");
    assert_eq!(received[1].body, b"{\"n\":  2,\"m\" : [1]}");
    assert_eq!(
        occurred_at(&received[0]),
        ("2001-02-03T04:05:06Z".to_string(), 981_173_106)
    );
    assert_eq!(
        occurred_at(&received[1]),
        ("2002-03-04T05:06:07Z".to_string(), 1_015_218_367),
        "a timestamp without time zone is taken as UTC"
    );
    // Marked once confirmed: a row may arrive before its mark commits.
    eventually("both rows marked", Duration::from_secs(10), || async {
        outbox.pending("a").await == 0
    })
    .await;
    assert_eq!(blamed(&outbox).await, 0);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_made_with_a_timestamp_occurred_at_and_a_jsonb_domain_payload_is_relayed_as_utc() {
    // A table of the seed relay's kind, made by hand: no columns of parking,
    // occurred_at without time zone (written in UTC), payload a domain over a
    // domain over jsonb.
    let client = pg_client().await;
    let schema = unique("ts");
    client
        .batch_execute(&format!(
            "CREATE SCHEMA \"{schema}\";
             CREATE DOMAIN \"{schema}\".document AS jsonb;
             CREATE DOMAIN \"{schema}\".event AS \"{schema}\".document;
             CREATE TABLE \"{schema}\".outbox_message (
                 id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
                 tenant_id TEXT NOT NULL, kind TEXT NOT NULL, subject_id TEXT NOT NULL,
                 payload \"{schema}\".event, headers JSONB,
                 occurred_at TIMESTAMP NOT NULL DEFAULT (now() AT TIME ZONE 'UTC'),
                 published_at TIMESTAMPTZ, attempts INTEGER NOT NULL DEFAULT 0, last_error TEXT);
             CREATE INDEX ON \"{schema}\".outbox_message (tenant_id, id) WHERE published_at IS NULL;"
        ))
        .await
        .expect("a table with a timestamp occurred_at");
    let outbox = Outbox::adopt(schema, "outbox_message".into(), client);
    let broker = Broker::create(&["#"]).await;
    outbox
        .execute(
            "INSERT INTO {outbox} (tenant_id, kind, subject_id, payload, occurred_at) VALUES
             ('a', 'thing.changed', 's', '{\"b\": 2, \"a\": [1]}', '2003-04-05 06:07:08.5'),
             ('later', 'thing.changed', 's', NULL, (now() AT TIME ZONE 'UTC') - interval '1 hour')",
        )
        .await;
    let env = relay_env(&outbox, &broker, &["a", "later"]);

    // `status` reads the lag of a timestamp as UTC, as the relay does.
    let output = relay_command()
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .args(["status", "--json"])
        .output()
        .expect("status runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "lagging: {stdout}");
    let status: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    let later = status["tenants"]
        .as_array()
        .and_then(|ts| ts.iter().find(|t| t["tenant"] == "later"))
        .unwrap_or_else(|| panic!("{stdout}"));
    let lag = later["lag_ms"].as_i64().expect("lag_ms");
    assert!(
        (3_600_000..3_660_000).contains(&lag),
        "an hour, not shifted by a zone: {lag}"
    );

    let relay = start_relay(config(&outbox, &broker, &["a", "later"])).await;
    // Marked once confirmed: the consumer may see a row before its mark
    // commits.
    eventually(
        "both rows go out and are marked",
        Duration::from_secs(20),
        || async {
            broker.count() == 2 && outbox.pending("a").await + outbox.pending("later").await == 0
        },
    )
    .await;
    let received = broker.received();
    let a = received
        .iter()
        .find(|m| m.tenant() == "a")
        .expect("a's row");
    assert_eq!(a.body, b"{\"a\": [1], \"b\": 2}", "jsonb's text");
    assert_eq!(
        occurred_at(a),
        ("2003-04-05T06:07:08.5Z".to_string(), 1_049_522_828)
    );
    assert_eq!(blamed(&outbox).await, 0);
    let (_, health) = http_get(relay.addr, "/healthz").await;
    assert!(health.contains("\"status\":\"ok\""), "{health}");
    relay.stop().await;
}

/// A `tenant_id` no read fails on, yet that the relay cannot keep tenants
/// apart with: `char(n)` (the poll finds the padded name, which no read
/// matches) or a case-insensitive collation (`Mix` and `mix` one tenant to
/// the table, two to the relay, each publishing the other's rows). Either
/// is named with its fix by one ERROR, nothing is sent meanwhile, and the
/// rows go out once it is fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_id_that_cannot_keep_tenants_apart_is_named_and_held() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let collation = format!("\"{}\".ci", outbox.schema);
    outbox
        .execute(&format!(
            "CREATE COLLATION {collation} (provider = icu, locale = 'und-u-ks-level2', deterministic = false)"
        ))
        .await;
    let unfit = [
        (
            "ALTER TABLE {outbox} ALTER COLUMN tenant_id TYPE char(12)",
            "is bpchar",
        ),
        (
            &*format!(
                "ALTER TABLE {{outbox}} ALTER COLUMN tenant_id TYPE text COLLATE {collation}"
            ),
            "nondeterministic collation",
        ),
    ];
    let mut sent = 0;
    for (alter, found) in unfit {
        outbox.execute(alter).await;
        // A session of its own: the outbox trigger's plan, cached by a
        // session that wrote under the column's earlier type, would not fit.
        let writer = pg_client().await;
        for tenant in ["Mix", "mix"] {
            let sql = format!(
                "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ($1, 'k', 's', '{{}}')",
                outbox.qualified()
            );
            writer.execute(&sql, &[&tenant]).await.expect("insert");
        }
        let mut env = relay_env(&outbox, &broker, &["*"]);
        set_env(&mut env, "OUTBOX_TENANTS", "*");
        let (mut process, _addr) = spawn_relay(&env).await;
        eventually(
            "the unfit column is reported",
            Duration::from_secs(20),
            || {
                let errors = lines_at(&process.output(), "ERROR").len();
                async move { errors == 1 }
            },
        )
        .await;
        let output = process.output();
        let said = lines_at(&output, "ERROR")[0];
        assert!(
            said.contains("column \\\"tenant_id\\\"")
                && said.contains(found)
                && said.contains("ALTER COLUMN tenant_id TYPE text COLLATE \\\"default\\\""),
            "{said}"
        );
        assert_eq!(broker.count(), sent, "nothing sent");
        outbox
            .execute("ALTER TABLE {outbox} ALTER COLUMN tenant_id TYPE text COLLATE \"default\"")
            .await;
        sent += 2;
        eventually(
            "the rows go out once the column is fixed",
            Duration::from_secs(30),
            || async { outbox.all_pending().await == 0 && broker.count() >= sent },
        )
        .await;
        process.signal("TERM");
        assert_eq!(process.wait(Duration::from_secs(20)).await, Some(0));
        assert_eq!(broker.count(), sent, "each row once, under its own tenant");
    }
    assert_eq!(blamed(&outbox).await, 0, "nothing refused row by row");
}
