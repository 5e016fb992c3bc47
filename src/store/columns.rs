//! What the relay needs of the outbox table's columns, and how it reads each
//! one. The reads select the columns uncast (a cast such as `payload::text`
//! would hide a `bytea`), so each read's row description carries the
//! table's own types; [`check`] holds them against what the relay reads,
//! on every read and on the catalog's view of the table alike, and the
//! readers here decode exactly what [`check`] lets through.

use std::error::Error;

use time::{OffsetDateTime, PrimitiveDateTime};
use tokio_postgres::types::{FromSql, Type};

/// A column the relay reads: its name, whether a type will do, what would,
/// and how to make it so.
struct Needed {
    name: &'static str,
    accepts: fn(&Type) -> bool,
    wants: &'static str,
    /// The `ALTER TABLE … ALTER COLUMN` clause after `TYPE`.
    fix: &'static str,
}

const NEEDED: [Needed; 7] = [
    Needed {
        name: "id",
        accepts: <i64 as FromSql>::accepts,
        wants: "bigint",
        fix: "bigint",
    },
    // Not `char(n)`: the poll would find the padded name, which no read
    // (comparing as text) matches. Not a nondeterministic collation either
    // (the catalog check's own test).
    Needed {
        name: "tenant_id",
        accepts: |ty| *ty == Type::TEXT || *ty == Type::VARCHAR,
        wants: "text or varchar, with a deterministic collation",
        fix: "text COLLATE \"default\"",
    },
    Needed {
        name: "kind",
        accepts: <String as FromSql>::accepts,
        wants: "text or varchar",
        fix: "text",
    },
    Needed {
        name: "subject_id",
        accepts: <String as FromSql>::accepts,
        wants: "text or varchar",
        fix: "text",
    },
    Needed {
        name: "payload",
        accepts: <Raw as FromSql>::accepts,
        wants: "text, varchar, json or jsonb, sent as that text",
        fix: "text USING convert_from(payload, 'UTF8')",
    },
    Needed {
        name: "headers",
        accepts: <serde_json::Value as FromSql>::accepts,
        wants: "jsonb or json",
        fix: "jsonb USING headers::jsonb",
    },
    Needed {
        name: "occurred_at",
        accepts: <OccurredAt as FromSql>::accepts,
        wants: "timestamptz (or timestamp, taken as UTC)",
        fix: "timestamptz USING occurred_at::timestamptz",
    },
];

/// A column of the outbox table whose type (or absence) the relay cannot
/// read as the application wrote it. Its text names the table, the column,
/// the type found and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct Drift {
    /// `"schema"."table"`.
    pub table: String,
    pub column: &'static str,
    /// The column's type; `None` when the table has no such column.
    pub found: Option<String>,
}

impl Drift {
    fn describe(&self) -> String {
        let Some(needed) = NEEDED.iter().find(|n| n.name == self.column) else {
            return format!(
                "column \"{}\" of {} cannot be read",
                self.column, self.table
            );
        };
        let table = &self.table;
        let column = needed.name;
        match &self.found {
            None => format!(
                "{table} has no column \"{column}\"; the relay reads it as {wants}. Fix: ALTER \
                 TABLE {table} ADD COLUMN {column} (as in `outbox-relay migrate --print`). \
                 Nothing of the table is read until then",
                wants = needed.wants,
            ),
            Some(found) => format!(
                "column \"{column}\" of {table} is {found}; the relay reads it as {wants}. Fix: \
                 ALTER TABLE {table} ALTER COLUMN {column} TYPE {fix}. Nothing of the table is \
                 read until then",
                wants = needed.wants,
                fix = if column == "payload" && found != "bytea" {
                    "text USING payload::text"
                } else {
                    needed.fix
                },
            ),
        }
    }
}

/// Holds the columns of a read's row description (or of the catalog)
/// against what the relay reads. Columns the relay does not read are
/// ignored; with `whole`, a needed column that is absent is a drift too
/// (a read names only the columns it reads).
pub fn check<'a>(
    table: &str,
    columns: impl IntoIterator<Item = (&'a str, &'a Type)>,
    whole: bool,
) -> Result<(), Drift> {
    let mut seen = [false; NEEDED.len()];
    for (name, ty) in columns {
        let Some(at) = NEEDED.iter().position(|n| n.name == name) else {
            continue;
        };
        seen[at] = true;
        // Only built-in types: the driver looks up any other one with a
        // query of its own behind the read's rows, which a large read holds
        // up (the read times out); such a column is named by the check of
        // the catalog that follows a failed read.
        let built_in = Type::from_oid(ty.oid()).is_some();
        if !built_in || !(NEEDED[at].accepts)(ty) {
            return Err(Drift {
                table: table.to_string(),
                column: NEEDED[at].name,
                found: Some(ty.name().to_string()),
            });
        }
    }
    match NEEDED.iter().zip(seen).find(|(_, seen)| whole && !seen) {
        Some((needed, _)) => Err(Drift {
            table: table.to_string(),
            column: needed.name,
            found: None,
        }),
        None => Ok(()),
    }
}

/// Checks a read's row description (see [`check`]).
pub fn check_row(table: &str, row: &tokio_postgres::Row) -> Result<(), Drift> {
    check(
        table,
        row.columns().iter().map(|c| (c.name(), c.type_())),
        false,
    )
}

/// A payload (or headers) as the application wrote it, borrowed from the
/// row: the text of a `text`, `varchar`, `json` or `jsonb` column, as
/// `payload::text` would give it (`jsonb` comes as a version byte and its
/// text).
pub struct Raw<'a>(pub &'a [u8]);

impl<'a> FromSql<'a> for Raw<'a> {
    fn from_sql(ty: &Type, raw: &'a [u8]) -> Result<Raw<'a>, Box<dyn Error + Sync + Send>> {
        let Checked(text) = Checked::from_sql(ty, raw)?;
        std::str::from_utf8(text)?;
        Ok(Raw(text))
    }

    fn accepts(ty: &Type) -> bool {
        Checked::accepts(ty)
    }
}

/// A value read as [`Raw`] once already, read again without checking its
/// UTF-8 a second time (the message body of `read::PayloadOf`, which may be
/// megabytes).
pub struct Checked<'a>(pub &'a [u8]);

impl<'a> FromSql<'a> for Checked<'a> {
    fn from_sql(ty: &Type, raw: &'a [u8]) -> Result<Checked<'a>, Box<dyn Error + Sync + Send>> {
        if *ty != Type::JSONB {
            return Ok(Checked(raw));
        }
        match raw.split_first() {
            Some((1, text)) => Ok(Checked(text)),
            _ => Err("unsupported jsonb encoding version".into()),
        }
    }

    fn accepts(ty: &Type) -> bool {
        matches!(*ty, Type::TEXT | Type::VARCHAR | Type::JSON | Type::JSONB)
    }
}

/// `occurred_at`: a `timestamptz`, or a `timestamp` (without time zone)
/// taken as UTC, as the lag queries take it (`date_part('epoch', …)`).
pub struct OccurredAt(pub OffsetDateTime);

impl<'a> FromSql<'a> for OccurredAt {
    fn from_sql(ty: &Type, raw: &'a [u8]) -> Result<OccurredAt, Box<dyn Error + Sync + Send>> {
        if *ty == Type::TIMESTAMP {
            Ok(OccurredAt(
                PrimitiveDateTime::from_sql(ty, raw)?.assume_utc(),
            ))
        } else {
            Ok(OccurredAt(OffsetDateTime::from_sql(ty, raw)?))
        }
    }

    fn accepts(ty: &Type) -> bool {
        matches!(*ty, Type::TIMESTAMPTZ | Type::TIMESTAMP)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\"public\".\"outbox_message\"";

    fn shipped() -> Vec<(&'static str, Type)> {
        vec![
            ("id", Type::INT8),
            ("tenant_id", Type::TEXT),
            ("kind", Type::TEXT),
            ("subject_id", Type::TEXT),
            ("payload", Type::TEXT),
            ("headers", Type::JSONB),
            ("occurred_at", Type::TIMESTAMPTZ),
        ]
    }

    fn with(column: &str, ty: Type) -> Vec<(&'static str, Type)> {
        let mut columns = shipped();
        for (name, t) in &mut columns {
            if *name == column {
                *t = ty.clone();
            }
        }
        columns
    }

    fn checked(columns: &[(&'static str, Type)], whole: bool) -> Result<(), Drift> {
        check(TABLE, columns.iter().map(|(n, t)| (*n, t)), whole)
    }

    #[test]
    fn the_shipped_table_and_its_documented_variants_fit() {
        assert_eq!(checked(&shipped(), true), Ok(()));
        for ty in [Type::VARCHAR, Type::JSON, Type::JSONB] {
            assert_eq!(checked(&with("payload", ty), true), Ok(()));
        }
        assert_eq!(checked(&with("occurred_at", Type::TIMESTAMP), true), Ok(()));
        assert_eq!(checked(&with("headers", Type::JSON), true), Ok(()));
        assert_eq!(checked(&with("kind", Type::VARCHAR), true), Ok(()));
        assert_eq!(checked(&with("tenant_id", Type::VARCHAR), true), Ok(()));
    }

    #[test]
    fn a_padded_tenant_id_is_unfit() {
        let drift = checked(&with("tenant_id", Type::BPCHAR), true).unwrap_err();
        assert_eq!(
            (drift.column, drift.found.as_deref()),
            ("tenant_id", Some("bpchar"))
        );
        assert!(
            drift
                .to_string()
                .contains("ALTER COLUMN tenant_id TYPE text COLLATE \"default\""),
            "{drift}"
        );
    }

    #[test]
    fn an_unfit_column_is_named_with_its_type_and_the_fix() {
        let drift = checked(&with("payload", Type::BYTEA), true).unwrap_err();
        assert_eq!(
            (drift.column, drift.found.as_deref()),
            ("payload", Some("bytea"))
        );
        let text = drift.to_string();
        assert!(text.contains("column \"payload\" of \"public\".\"outbox_message\" is bytea"));
        assert!(
            text.contains(
                "ALTER TABLE \"public\".\"outbox_message\" ALTER COLUMN payload TYPE text"
            )
        );
        for (column, ty) in [
            ("id", Type::INT4),
            ("occurred_at", Type::DATE),
            ("occurred_at", Type::TEXT),
            ("headers", Type::TEXT),
            ("payload", Type::INT4),
            ("payload", Type::XML),
            ("kind", Type::INT4),
            (
                "kind",
                Type::new(
                    "citext".into(),
                    50_000,
                    tokio_postgres::types::Kind::Simple,
                    "public".into(),
                ),
            ),
        ] {
            let drift = checked(&with(column, ty.clone()), false).unwrap_err();
            assert_eq!(drift.column, column);
            assert_eq!(drift.found.as_deref(), Some(ty.name()));
        }
    }

    #[test]
    fn a_missing_column_counts_only_when_the_whole_table_is_checked() {
        let mut columns = shipped();
        columns.retain(|(name, _)| *name != "headers");
        assert_eq!(checked(&columns, false), Ok(()));
        let drift = checked(&columns, true).unwrap_err();
        assert_eq!((drift.column, drift.found.as_deref()), ("headers", None));
        assert!(drift.to_string().contains("has no column \"headers\""));
        // Columns the relay does not read are no concern of the check.
        columns.push(("payload_bytes", Type::INT4));
        assert_eq!(checked(&columns, false), Ok(()));
    }

    #[test]
    fn bodies_are_the_columns_text() {
        let body = |ty: Type, raw: &[u8]| Raw::from_sql(&ty, raw).map(|b| b.0.to_vec());
        assert_eq!(body(Type::TEXT, b"{\"a\":1}").unwrap(), &b"{\"a\":1}"[..]);
        assert_eq!(body(Type::JSON, b"{\"a\": 1}").unwrap(), &b"{\"a\": 1}"[..]);
        assert_eq!(
            body(Type::JSONB, b"\x01{\"a\": 1}").unwrap(),
            &b"{\"a\": 1}"[..]
        );
        assert!(body(Type::JSONB, b"\x02{}").is_err());
        assert!(body(Type::TEXT, b"\xff").is_err());
    }

    #[test]
    fn a_timestamp_without_zone_is_taken_as_utc() {
        // 2000-01-01 00:00:01 in PostgreSQL's binary form (µs since 2000).
        let raw = 1_000_000i64.to_be_bytes();
        let plain = OccurredAt::from_sql(&Type::TIMESTAMP, &raw).unwrap().0;
        let zoned = OccurredAt::from_sql(&Type::TIMESTAMPTZ, &raw).unwrap().0;
        assert_eq!(plain, zoned);
        assert_eq!(plain.unix_timestamp(), 946_684_801);
    }
}
