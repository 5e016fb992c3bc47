//! The test's own outbox table in the `test` database: made with the
//! relay's migrations, rows inserted, rows read back; its schema is dropped
//! when the `Outbox` goes out of scope.

use std::time::Duration;

use outbox_relay::config::Config;
use tokio_postgres::{Client, NoTls};

use super::fixture::OwnedSchema;
use super::unique;

pub const DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// The state of one outbox row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowState {
    pub published: bool,
    pub attempts: i32,
    pub last_error: Option<String>,
}

/// A private outbox table in the `test` database.
pub struct Outbox {
    pub schema: String,
    pub table: String,
    pub client: Client,
    /// Drops the schema when the outbox goes out of scope (none: another
    /// outbox over the same table owns it).
    _owned: Option<OwnedSchema>,
}

/// A query of the test's own, bounded: a test that hangs tells CI nothing,
/// one that fails names what did not answer.
async fn within<T>(what: &str, query: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), query)
        .await
        .unwrap_or_else(|_| panic!("the test's own query did not answer within 30 s: {what}"))
}

pub async fn pg_client() -> Client {
    pg_client_to(DATABASE_URL).await
}

/// A connection to the database at `url`, driven on the test's runtime.
pub async fn pg_client_to(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .expect("the test database is reachable");
    tokio::spawn(connection);
    client
}

impl Outbox {
    /// Creates the schema and table with the relay's own migrations.
    pub async fn create() -> Outbox {
        Outbox::create_in(DATABASE_URL, "t").await
    }

    /// As [`Outbox::create`], in the database at `database_url`, its schema
    /// named `prefix…`.
    pub async fn create_in(database_url: &str, prefix: &str) -> Outbox {
        let schema = unique(prefix);
        let table = "outbox_message".to_string();
        let mut config = Config::with_tenants(["migrate"]);
        config.database_url = database_url.parse().expect("database url");
        config.schema = schema.clone();
        config.table = table.clone();
        let store = outbox_relay::store::Store::new(&config).expect("store");
        outbox_relay::migrate::run(&store, &config)
            .await
            .expect("migrations apply");
        let client = pg_client_to(database_url).await;
        Outbox::adopt_in(database_url, schema, table, client)
    }

    /// A table the test made itself in `schema` of the `test` database:
    /// the schema is dropped with the outbox.
    pub fn adopt(schema: String, table: String, client: Client) -> Outbox {
        Outbox::adopt_in(DATABASE_URL, schema, table, client)
    }

    /// As [`Outbox::adopt`], in the database at `database_url`.
    pub fn adopt_in(database_url: &str, schema: String, table: String, client: Client) -> Outbox {
        Outbox {
            _owned: Some(OwnedSchema::new(database_url, &schema)),
            schema,
            table,
            client,
        }
    }

    /// The same table over `client`, a connection of its own; the schema
    /// stays `self`'s to drop.
    pub fn sharing(&self, client: Client) -> Outbox {
        Outbox {
            schema: self.schema.clone(),
            table: self.table.clone(),
            client,
            _owned: None,
        }
    }

    pub fn qualified(&self) -> String {
        format!("\"{}\".\"{}\"", self.schema, self.table)
    }

    /// Inserts one row and returns its id.
    pub async fn insert(
        &self,
        tenant: &str,
        kind: &str,
        subject: &str,
        payload: Option<&str>,
        headers: Option<serde_json::Value>,
    ) -> i64 {
        let sql = format!(
            "INSERT INTO {} (tenant_id, kind, subject_id, payload, headers) VALUES ($1, $2, $3, $4, $5) RETURNING id",
            self.qualified()
        );
        within(
            "insert",
            self.client
                .query_one(&sql, &[&tenant, &kind, &subject, &payload, &headers]),
        )
        .await
        .expect("insert")
        .get(0)
    }

    /// Inserts `n` rows for `tenant` in one statement; returns their ids in order.
    pub async fn insert_many(&self, tenant: &str, n: i64) -> Vec<i64> {
        let sql = format!(
            "INSERT INTO {} (tenant_id, kind, subject_id, payload)
             SELECT $1, 'thing.changed', 's-' || g, '{{\"n\":' || g || '}}' FROM generate_series(1, $2::bigint) g
             RETURNING id",
            self.qualified()
        );
        let mut ids: Vec<i64> = within("insert many", self.client.query(&sql, &[&tenant, &n]))
            .await
            .expect("insert many")
            .iter()
            .map(|r| r.get(0))
            .collect();
        ids.sort_unstable();
        ids
    }

    pub async fn execute(&self, sql: &str) {
        let sql = sql.replace("{outbox}", &self.qualified());
        within("a statement", self.client.batch_execute(&sql))
            .await
            .expect("statement");
    }

    pub async fn pending(&self, tenant: &str) -> i64 {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE tenant_id = $1 AND published_at IS NULL",
            self.qualified()
        );
        within("count pending", self.client.query_one(&sql, &[&tenant]))
            .await
            .expect("count")
            .get(0)
    }

    /// Pending rows of all of `tenants`.
    pub async fn pending_of(&self, tenants: &[&str]) -> i64 {
        let mut pending = 0;
        for tenant in tenants {
            pending += self.pending(tenant).await;
        }
        pending
    }

    pub async fn all_pending(&self) -> i64 {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE published_at IS NULL",
            self.qualified()
        );
        within("count all pending", self.client.query_one(&sql, &[]))
            .await
            .expect("count")
            .get(0)
    }

    /// The tenant's lowest pending row, if any.
    pub async fn first_pending(&self, tenant: &str) -> Option<RowState> {
        let sql = format!(
            "SELECT id FROM {} WHERE tenant_id = $1 AND published_at IS NULL ORDER BY id LIMIT 1",
            self.qualified()
        );
        let row = within("first pending", self.client.query_opt(&sql, &[&tenant]))
            .await
            .expect("first pending");
        match row {
            Some(row) => Some(self.row(row.get(0)).await),
            None => None,
        }
    }

    /// The refused publishes recorded over all of the tenant's rows.
    pub async fn attempts(&self, tenant: &str) -> i64 {
        let sql = format!(
            "SELECT COALESCE(sum(attempts), 0)::bigint FROM {} WHERE tenant_id = $1",
            self.qualified()
        );
        within("sum attempts", self.client.query_one(&sql, &[&tenant]))
            .await
            .expect("attempts")
            .get(0)
    }

    /// The tenant's rows that carry any blame: an attempt or a `last_error`.
    pub async fn blamed(&self, tenant: &str) -> i64 {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE tenant_id = $1 AND (attempts > 0 OR last_error IS NOT NULL)",
            self.qualified()
        );
        within("count blamed", self.client.query_one(&sql, &[&tenant]))
            .await
            .expect("blamed")
            .get(0)
    }

    pub async fn row(&self, id: i64) -> RowState {
        let sql = format!(
            "SELECT published_at IS NOT NULL, attempts, last_error FROM {} WHERE id = $1",
            self.qualified()
        );
        let row = within("read a row", self.client.query_one(&sql, &[&id]))
            .await
            .expect("row");
        RowState {
            published: row.get(0),
            attempts: row.get(1),
            last_error: row.get(2),
        }
    }

    /// Ids marked published.
    pub async fn published_ids(&self) -> Vec<i64> {
        let sql = format!(
            "SELECT id FROM {} WHERE published_at IS NOT NULL ORDER BY id",
            self.qualified()
        );
        within("published ids", self.client.query(&sql, &[]))
            .await
            .expect("ids")
            .iter()
            .map(|r| r.get(0))
            .collect()
    }
}
