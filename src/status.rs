//! `outbox-relay status`: each tenant's pending and parked rows, lag and blocking row,
//! or the writers in flight it waits for, as a table for people or JSON for
//! scripts. Exit 1 when any tenant is past `max_lag_ms`, so a cron job or a CI
//! step can use it as a check.

use serde::Serialize;

use crate::printable::fit;
use crate::store::{TenantStatus, Writer};

/// The widest `last_error` shown in the table (JSON has it whole).
const ERROR_WIDTH: usize = 72;
/// A tenant name's width in the table (`--wide`: whole).
const TENANT_WIDTH: usize = 48;

/// What `status` reports.
#[derive(Debug, Serialize)]
pub struct Report {
    pub max_lag_ms: u64,
    pub lagging: bool,
    pub tenants: Vec<Line>,
}

/// One tenant.
#[derive(Debug, Serialize)]
pub struct Line {
    #[serde(flatten)]
    pub status: TenantStatus,
    pub lagging: bool,
    /// Its pending rows wait for writers in flight (`status.writers`), not
    /// for a row of its own: the blocking row is left empty.
    pub waits_for_writers: bool,
}

impl Line {
    /// A tenant with rows pending whose oldest was never tried, while a
    /// transaction holds its writers' lock, waits for that writer (the
    /// relay publishes nothing above an id a writer in flight may still
    /// commit): its writers are named and its blocking row left empty.
    /// Otherwise its blocking row is its own, and no writer is named.
    fn new(mut status: TenantStatus, max_lag_ms: u64) -> Line {
        let untried = status.attempts == Some(0) && status.last_error.is_none();
        let waits_for_writers = status.pending > 0 && untried && !status.writers.is_empty();
        if waits_for_writers {
            (status.oldest_id, status.attempts) = (None, None);
        } else {
            status.writers.clear();
        }
        Line {
            lagging: u64::try_from(status.lag_ms).unwrap_or(0) > max_lag_ms,
            status,
            waits_for_writers,
        }
    }
}

impl Report {
    pub fn new(max_lag_ms: u64, tenants: Vec<TenantStatus>) -> Report {
        let tenants: Vec<Line> = tenants
            .into_iter()
            .map(|status| Line::new(status, max_lag_ms))
            .collect();
        Report {
            max_lag_ms,
            lagging: tenants.iter().any(|t| t.lagging),
            tenants,
        }
    }

    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report serialises")
    }

    /// An aligned table, one tenant a line, lagging tenants marked.
    /// `wide`: each `last_error` whole (on its line), not cut to fit.
    pub fn table(&self, wide: bool) -> String {
        let width = if wide { usize::MAX } else { ERROR_WIDTH };
        let tenant_width = if wide { usize::MAX } else { TENANT_WIDTH };
        let header = [
            "TENANT",
            "PENDING",
            "PARKED",
            "LAG",
            "BLOCKING ROW",
            "ATTEMPTS",
            "LAST ERROR",
        ];
        let mut rows: Vec<[String; 7]> = vec![header.map(String::from)];
        for line in &self.tenants {
            let s = &line.status;
            let lag = if s.pending == 0 {
                "-".to_string()
            } else {
                format!(
                    "{}{}",
                    human_ms(s.lag_ms),
                    if line.lagging { " !" } else { "" }
                )
            };
            rows.push([
                fit(&s.tenant, tenant_width),
                s.pending.to_string(),
                s.parked.to_string(),
                lag,
                s.oldest_id.map_or_else(|| "-".into(), |id| id.to_string()),
                s.attempts.map_or_else(|| "-".into(), |a| a.to_string()),
                match &s.last_error {
                    _ if line.waits_for_writers => "waits for writers in flight (below)".into(),
                    Some(e) => fit(e, width),
                    None => "-".into(),
                },
            ]);
        }
        let widths: Vec<usize> = (0..7)
            .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
            .collect();
        let mut out = String::new();
        for row in rows {
            let cells: Vec<String> = row
                .iter()
                .enumerate()
                .map(|(c, cell)| {
                    if c == 6 {
                        cell.clone()
                    } else {
                        format!("{cell:<w$}", w = widths[c])
                    }
                })
                .collect();
            out.push_str(cells.join("  ").trim_end());
            out.push('\n');
        }
        for line in self.tenants.iter().filter(|t| t.waits_for_writers) {
            out.push_str(&writers_in_flight(&line.status, tenant_width));
        }
        let lagging = self.tenants.iter().filter(|t| t.lagging).count();
        if lagging > 0 {
            out.push_str(&format!(
                "{lagging} tenant(s) past max_lag_ms ({} ms), marked !\n",
                self.max_lag_ms
            ));
        }
        let parked: i64 = self.tenants.iter().map(|t| t.status.parked).sum();
        if parked > 0 {
            out.push_str(&format!(
                "{parked} parked row(s): out of their tenants' order until `outbox-relay requeue` or `discard`\n"
            ));
        }
        out
    }
}

/// The writers in flight a tenant waits for, one a line: a session by its
/// pid and how long its transaction has been open, a prepared transaction
/// by its gid and when it was prepared; a tenant with twins says that the
/// writer may be a twin's.
fn writers_in_flight(status: &TenantStatus, width: usize) -> String {
    let tenant = fit(&status.tenant, width);
    let mut out = format!("{tenant} waits for writers in flight:\n");
    let whose = match status.twins.as_slice() {
        [] => String::new(),
        twins => {
            let twins: Vec<String> = twins.iter().map(|t| fit(t, width)).collect();
            format!(
                " (a writer of {tenant} or of its colliding tenant {}: one writers' lock)",
                twins.join(", ")
            )
        }
    };
    for writer in &status.writers {
        out.push_str(&format!("  {}{whose}\n", describe(writer)));
    }
    out
}

/// A writer in flight in words.
fn describe(writer: &Writer) -> String {
    let open = match (&writer.xact_start, writer.open_ms) {
        (Some(at), Some(ms)) => format!("transaction open for {} (since {at})", human_ms(ms)),
        // Idle with a session-level lock, or another role's session.
        _ => {
            "no transaction start shown (a session-level lock, or a session this role may not see)"
                .to_string()
        }
    };
    match (
        &writer.gid,
        &writer.prepared,
        writer.prepared_ms,
        writer.pid,
    ) {
        (Some(gid), Some(at), Some(ms), _) => format!(
            "prepared transaction '{}', prepared {} ago ({at})",
            fit(gid, usize::MAX),
            human_ms(ms)
        ),
        (Some(gid), ..) => format!("prepared transaction '{}'", fit(gid, usize::MAX)),
        (None, _, _, Some(pid)) => format!("pid {pid}, {open}"),
        (None, _, _, None) => "a transaction with neither a pid nor a gid".to_string(),
    }
}

fn human_ms(ms: i64) -> String {
    match ms {
        ms if ms < 1_000 => format!("{ms}ms"),
        ms if ms < 60_000 => format!("{:.1}s", ms as f64 / 1_000.0),
        ms if ms < 3_600_000 => format!("{}m{:02}s", ms / 60_000, (ms % 60_000) / 1_000),
        ms => format!("{}h{:02}m", ms / 3_600_000, (ms % 3_600_000) / 60_000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(
        tenant: &str,
        pending: i64,
        lag_ms: i64,
        blocking: Option<(i64, i32, &str)>,
    ) -> TenantStatus {
        TenantStatus {
            tenant: tenant.into(),
            pending,
            lag_ms,
            oldest_id: blocking.map(|b| b.0),
            attempts: blocking.map(|b| b.1),
            last_error: blocking.and_then(|b| (!b.2.is_empty()).then(|| b.2.to_string())),
            parked: 0,
            twins: Vec::new(),
            writers: Vec::new(),
        }
    }

    #[test]
    fn a_long_or_unprintable_tenant_name_is_cut_to_one_line_unless_wide() {
        let long = format!("t\u{1b}[2J{}", "x".repeat(9_000));
        let report = Report::new(60_000, vec![status(&long, 1, 10, None)]);
        let table = report.table(false);
        let line = table.lines().nth(1).expect("the tenant's line");
        assert!(line.starts_with("t [2Jxxx"), "{line}");
        assert!(line.chars().count() < 120, "{line}");
        assert!(!table.contains('\u{1b}'));
        let wide = report.table(true);
        assert!(wide.contains(&"x".repeat(9_000)) && !wide.contains('\u{1b}'));
    }

    #[test]
    fn marks_tenants_past_the_budget() {
        let report = Report::new(
            60_000,
            vec![
                status("acme", 0, 0, None),
                status(
                    "globex",
                    12,
                    125_000,
                    Some((41, 3, "unroutable: returned by the broker: 312 NO_ROUTE")),
                ),
                status("initech", 2, 300, Some((7, 0, ""))),
            ],
        );
        assert!(report.lagging);
        let table = report.table(false);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines[0],
            "TENANT   PENDING  PARKED  LAG      BLOCKING ROW  ATTEMPTS  LAST ERROR"
        );
        assert_eq!(
            lines[1],
            "acme     0        0       -        -             -         -"
        );
        assert_eq!(
            lines[2],
            "globex   12       0       2m05s !  41            3         unroutable: returned by the broker: 312 NO_ROUTE"
        );
        assert_eq!(
            lines[3],
            "initech  2        0       300ms    7             0         -"
        );
        assert_eq!(lines[4], "1 tenant(s) past max_lag_ms (60000 ms), marked !");
    }

    #[test]
    fn json_carries_every_field() {
        let report = Report::new(
            1_000,
            vec![status(
                "a",
                1,
                5,
                Some((9, 1, "nack: the broker nacked the message")),
            )],
        );
        let value: serde_json::Value = serde_json::from_str(&report.json()).unwrap();
        assert_eq!(value["lagging"], false);
        assert_eq!(value["max_lag_ms"], 1000);
        let t = &value["tenants"][0];
        assert_eq!(t["tenant"], "a");
        assert_eq!(t["pending"], 1);
        assert_eq!(t["lag_ms"], 5);
        assert_eq!(t["oldest_id"], 9);
        assert_eq!(t["attempts"], 1);
        assert_eq!(t["last_error"], "nack: the broker nacked the message");
        assert_eq!(t["lagging"], false);
        assert_eq!(t["parked"], 0);
    }

    #[test]
    fn parked_rows_are_counted_and_said() {
        let mut parked = status("a", 0, 0, None);
        parked.parked = 2;
        let report = Report::new(1_000, vec![parked]);
        let table = report.table(false);
        assert_eq!(
            table.lines().nth(1),
            Some("a       0        2       -    -             -         -")
        );
        assert!(table.contains("2 parked row(s)"), "{table}");
        let value: serde_json::Value = serde_json::from_str(&report.json()).unwrap();
        assert_eq!(value["tenants"][0]["parked"], 2);
        assert!(!report.lagging, "parked rows are not lag");
    }

    #[test]
    fn long_errors_are_shortened_in_the_table_only() {
        let long = "other: ".to_string() + &"x".repeat(200);
        let report = Report::new(1, vec![status("a", 1, 0, Some((1, 1, &long)))]);
        let row = report.table(false).lines().nth(1).unwrap().to_string();
        assert!(row.ends_with('…') && row.chars().count() < 140, "{row}");
        let wide = report.table(true).lines().nth(1).unwrap().to_string();
        assert!(wide.ends_with(&long), "--wide shows it whole: {wide}");
        assert!(report.json().contains(&long));
    }

    #[test]
    fn a_tenant_held_by_writers_in_flight_names_them_and_shows_no_blocking_row() {
        let mut held = status("b", 2, 31_000, Some((9, 0, "")));
        held.twins = vec!["a".into()];
        held.writers = vec![
            Writer {
                pid: Some(4711),
                xact_start: Some("2026-12-06T10:00:00Z".into()),
                open_ms: Some(31_200),
                gid: None,
                prepared: None,
                prepared_ms: None,
            },
            Writer {
                pid: None,
                xact_start: None,
                open_ms: None,
                gid: Some("order-7".into()),
                prepared: Some("2026-12-06T10:00:01Z".into()),
                prepared_ms: Some(30_000),
            },
        ];
        // A refused oldest row is the tenant's own blocker, writers or not.
        let mut refused = status("c", 1, 10, Some((5, 2, "nack: the broker nacked")));
        refused.writers = held.writers.clone();
        let report = Report::new(60_000, vec![held, refused]);
        let table = report.table(false);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines[1],
            "b       2        0       31.0s  -             -         waits for writers in flight (below)"
        );
        assert!(lines[2].starts_with("c       1        0       10ms   5             2"));
        assert_eq!(lines[3], "b waits for writers in flight:");
        assert_eq!(
            lines[4],
            "  pid 4711, transaction open for 31.2s (since 2026-12-06T10:00:00Z) \
             (a writer of b or of its colliding tenant a: one writers' lock)"
        );
        assert!(
            lines[5].starts_with(
                "  prepared transaction 'order-7', prepared 30.0s ago (2026-12-06T10:00:01Z) (a writer of b"
            ),
            "{table}"
        );
        let value: serde_json::Value = serde_json::from_str(&report.json()).unwrap();
        let b = &value["tenants"][0];
        assert_eq!(b["waits_for_writers"], true);
        assert!(b["oldest_id"].is_null() && b["attempts"].is_null() && b["last_error"].is_null());
        assert_eq!(b["twins"][0], "a");
        assert_eq!(b["writers"][0]["pid"], 4711);
        assert_eq!(b["writers"][0]["open_ms"], 31_200);
        assert_eq!(b["writers"][1]["gid"], "order-7");
        assert_eq!(b["writers"][1]["prepared"], "2026-12-06T10:00:01Z");
        let c = &value["tenants"][1];
        assert_eq!(c["waits_for_writers"], false);
        assert_eq!(c["oldest_id"], 5);
        assert_eq!(c["writers"].as_array().map(Vec::len), Some(0));
    }

    #[test]
    fn human_durations() {
        assert_eq!(human_ms(999), "999ms");
        assert_eq!(human_ms(1_500), "1.5s");
        assert_eq!(human_ms(61_000), "1m01s");
        assert_eq!(human_ms(7_260_000), "2h01m");
    }
}
