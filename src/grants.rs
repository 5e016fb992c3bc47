//! The grants the configuration needs, checked once at start in one
//! statement (`store/grants.sql`): `USAGE` on the schema, `SELECT` and
//! `UPDATE` on the table for relaying (or on each column the relay reads or
//! sets), `DELETE` for retention when
//! `retention_ms` > 0. Each missing grant is one ERROR naming the privilege,
//! the object, the feature that needs it and the `GRANT` that fixes it. None
//! is fatal: the relay keeps relaying, and only the feature that needs the
//! grant does nothing (retention's rounds say it once more only after one
//! succeeded; see `retention`). The role's `SELECT` on the id sequence is
//! checked with the sequence's other settings (`store/sequence.sql`).
//!
//! With retention on, the same statement tells whether autovacuum runs for
//! the table: without it the space of deleted rows is never reused.

use std::fmt;

use tokio_postgres::types::Type;

use crate::config::Config;
use crate::sql::{qualified_table, quote_ident};
use crate::store::{QUERY_TIMEOUT, Store, StoreError, within};

const GRANTS: &str = include_str!("store/grants.sql");

/// A grant the relay's role lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingGrant {
    privilege: &'static str,
    /// `SCHEMA "s"` or `TABLE "s"."t"`, as `GRANT … ON` takes it.
    object: String,
    /// What needs it, and what its absence costs.
    feature: &'static str,
    cost: &'static str,
    /// The role, quoted, as `GRANT … TO` takes it.
    role: String,
}

impl MissingGrant {
    /// `DELETE` on the table, which retention needs.
    pub fn delete(config: &Config) -> MissingGrant {
        MissingGrant::new(config, "DELETE", false)
    }

    /// Whether retention needs it (and relaying does not).
    pub fn for_retention(&self) -> bool {
        self.privilege == "DELETE"
    }

    fn new(config: &Config, privilege: &'static str, on_schema: bool) -> MissingGrant {
        let object = if on_schema {
            format!("SCHEMA {}", quote_ident(&config.schema))
        } else {
            format!("TABLE {}", qualified_table(&config.schema, &config.table))
        };
        let (feature, cost) = match privilege {
            "DELETE" => (
                "retention (retention_ms > 0)",
                "retention deletes nothing, and the table grows",
            ),
            _ => (
                "relaying (the poll, the claim, the read, the marks)",
                "no row is relayed",
            ),
        };
        let role = config
            .database_url
            .config
            .get_user()
            .map_or_else(|| "<the relay's role>".to_string(), quote_ident);
        MissingGrant {
            privilege,
            object,
            feature,
            cost,
            role,
        }
    }
}

impl fmt::Display for MissingGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let MissingGrant {
            privilege,
            object,
            feature,
            cost,
            role,
        } = self;
        write!(
            f,
            "the relay's role lacks {privilege} on {object}, which {feature} needs: {cost}; \
             fix: GRANT {privilege} ON {object} TO {role}"
        )
    }
}

/// What the check at start found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Grants {
    pub missing: Vec<MissingGrant>,
    /// With retention on, where autovacuum is off: `"the server"` or `"the
    /// table"`.
    pub autovacuum_off: Option<&'static str>,
}

/// Checks the grants `config` needs, and autovacuum for retention, in one
/// statement.
pub async fn check(store: &Store, config: &Config) -> Result<Grants, StoreError> {
    let conn = store.connection().await?;
    let (schema, table): (&str, &str) = (&config.schema, &config.table);
    let row = within("the grants check", QUERY_TIMEOUT, async {
        let params = [(&schema as _, Type::TEXT), (&table as _, Type::TEXT)];
        Ok(conn.query_typed_one(GRANTS, &params).await?)
    })
    .await?;
    let retention = config.retention_ms > 0;
    let needed = [
        ("schema_usage", "USAGE", true, true),
        ("table_select", "SELECT", false, true),
        ("table_update", "UPDATE", false, true),
        ("table_delete", "DELETE", false, retention),
    ];
    let mut grants = Grants::default();
    for (column, privilege, on_schema, wanted) in needed {
        if wanted && row.try_get::<_, Option<bool>>(column)? == Some(false) {
            grants
                .missing
                .push(MissingGrant::new(config, privilege, on_schema));
        }
    }
    if retention {
        grants.autovacuum_off = if !row.try_get::<_, bool>("autovacuum")? {
            Some("the server")
        } else if !row.try_get::<_, bool>("table_autovacuum")? {
            Some("the table")
        } else {
            None
        };
    }
    Ok(grants)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_grant_names_the_privilege_the_object_the_feature_and_the_fix() {
        let mut config = Config::with_tenants(["a"]);
        config.schema = "app".into();
        config.table = "outbox".into();
        config.database_url = "postgres://relay@db/app".parse().unwrap();
        let text = MissingGrant::delete(&config).to_string();
        assert!(
            text.contains("DELETE on TABLE \"app\".\"outbox\""),
            "{text}"
        );
        assert!(text.contains("retention"), "{text}");
        assert!(
            text.ends_with("fix: GRANT DELETE ON TABLE \"app\".\"outbox\" TO \"relay\""),
            "{text}"
        );
        let usage = MissingGrant::new(&config, "USAGE", true).to_string();
        assert!(
            usage.contains("GRANT USAGE ON SCHEMA \"app\" TO \"relay\""),
            "{usage}"
        );
    }
}
