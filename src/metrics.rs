//! The Prometheus metrics of `docs/design.md`, on a registry of the relay's own.
//! Labels are bounded: tenants come from configuration, reasons and outcomes
//! are fixed sets. Every tenant's series exist from the start, at zero, so
//! alerts and dashboards see a flat line rather than nothing.

use std::time::Duration;

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::domain::{FailureReason, Outcome};

/// The longest delivery delay observed as it is: a longer one (a row whose
/// `occurred_at` is years old, e.g. year 1) counts as this, so that one row
/// cannot dominate `outbox_delivery_delay_seconds_sum` for ever. A row from
/// the future (a writer's fast clock) counts as 0.
pub const DELIVERY_DELAY_MAX: Duration = Duration::from_secs(24 * 60 * 60);

/// The relay's metrics.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    published: IntCounterVec,
    publish_failures: IntCounterVec,
    sweeps: IntCounterVec,
    sweep_duration: HistogramVec,
    delivery_delay: Histogram,
    /// Written by the scheduler's poll alone.
    lag: GaugeVec,
    tenant_backoff: GaugeVec,
    amqp_connected: IntGauge,
    database_up: IntGauge,
    max_lag: Gauge,
    wakeups: IntCounter,
    wakeup_connected: IntGauge,
    retention_deleted: IntCounter,
    settlement_retries: IntCounterVec,
    resent_rows: IntCounter,
}

impl Metrics {
    pub fn new(tenants: &[String]) -> Metrics {
        let registry = Registry::new();
        let published = IntCounterVec::new(
            Opts::new(
                "outbox_published_total",
                "Rows published and confirmed by the broker.",
            ),
            &["tenant"],
        )
        .expect("valid metric");
        let publish_failures = IntCounterVec::new(
            Opts::new(
                "outbox_publish_failures_total",
                "Publishes refused or failed, by reason.",
            ),
            &["tenant", "reason"],
        )
        .expect("valid metric");
        let sweeps = IntCounterVec::new(
            Opts::new("outbox_sweeps_total", "Sweeps of a tenant, by outcome."),
            &["tenant", "outcome"],
        )
        .expect("valid metric");
        let sweep_duration = HistogramVec::new(
            HistogramOpts::new(
                "outbox_sweep_duration_seconds",
                "Duration of one sweep of one tenant.",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ]),
            &["outcome"],
        )
        .expect("valid metric");
        let delivery_delay = Histogram::with_opts(
            HistogramOpts::new(
                "outbox_delivery_delay_seconds",
                "Broker confirm time minus the row's occurred_at.",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                300.0,
            ]),
        )
        .expect("valid metric");
        let lag = GaugeVec::new(
            Opts::new(
                "outbox_lag_seconds",
                "How long the tenant's oldest pending row has waited: its age by the database's clock, or how long the relay has seen it waiting, whichever is longer.",
            ),
            &["tenant"],
        )
        .expect("valid metric");
        let tenant_backoff = GaugeVec::new(
            Opts::new(
                "outbox_tenant_backoff_seconds",
                "Current back-off of the tenant after failed sweeps; 0 when not backing off.",
            ),
            &["tenant"],
        )
        .expect("valid metric");
        let amqp_connected = IntGauge::new(
            "outbox_amqp_connected",
            "Whether the broker connection is up (1) or not (0).",
        )
        .expect("valid metric");
        let database_up = IntGauge::new(
            "outbox_database_up",
            "Whether the last poll reached the database (1) or not (0); a poll the server answered with an error reached it.",
        )
        .expect("valid metric");
        let max_lag = Gauge::new(
            "outbox_max_lag_seconds",
            "The relay's max_lag_ms, in seconds: the lag budget /healthz, alerts and dashboards compare outbox_lag_seconds with.",
        )
        .expect("valid metric");
        let wakeups = IntCounter::new(
            "outbox_wakeups_total",
            "Notifications that started a sweep (or a follow-up of the running one).",
        )
        .expect("valid metric");
        let wakeup_connected = IntGauge::new(
            "outbox_wakeup_connected",
            "Whether the wake-up connection is LISTENing (1) or not (0); always 0 with wakeup = poll.",
        )
        .expect("valid metric");
        let retention_deleted = IntCounter::new(
            "outbox_retention_deleted_total",
            "Published (or discarded) rows deleted by retention (retention_ms).",
        )
        .expect("valid metric");
        let settlement_retries = IntCounterVec::new(
            Opts::new(
                "outbox_settlement_retries_total",
                "Settlements that failed after the broker confirmed and were retried in a new transaction, by outcome (marked, gave_up).",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        let resent_rows = IntCounter::new(
            "outbox_resent_rows_total",
            "Rows the broker confirmed whose marks were lost (settlement and its retries failed): they stay pending and go out again.",
        )
        .expect("valid metric");
        for outcome in ["marked", "gave_up"] {
            settlement_retries.with_label_values(&[outcome]);
        }
        let build_info = IntGaugeVec::new(
            Opts::new("outbox_build_info", "The relay's version; always 1."),
            &["version"],
        )
        .expect("valid metric");
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);

        for collector in [
            Box::new(published.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(publish_failures.clone()),
            Box::new(sweeps.clone()),
            Box::new(sweep_duration.clone()),
            Box::new(delivery_delay.clone()),
            Box::new(lag.clone()),
            Box::new(tenant_backoff.clone()),
            Box::new(amqp_connected.clone()),
            Box::new(database_up.clone()),
            Box::new(max_lag.clone()),
            Box::new(wakeups.clone()),
            Box::new(wakeup_connected.clone()),
            Box::new(retention_deleted.clone()),
            Box::new(settlement_retries.clone()),
            Box::new(resent_rows.clone()),
            Box::new(build_info),
        ] {
            registry
                .register(collector)
                .expect("metric names are unique");
        }

        for tenant in tenants {
            let tenant = tenant.as_str();
            published.with_label_values(&[tenant]);
            for reason in FailureReason::ALL {
                publish_failures.with_label_values(&[tenant, reason.as_str()]);
            }
            for outcome in Outcome::ALL {
                sweeps.with_label_values(&[tenant, outcome.as_str()]);
            }
            lag.with_label_values(&[tenant]).set(0.0);
            tenant_backoff.with_label_values(&[tenant]).set(0.0);
        }
        for outcome in Outcome::ALL {
            sweep_duration.with_label_values(&[outcome.as_str()]);
        }

        Metrics {
            registry,
            published,
            publish_failures,
            sweeps,
            sweep_duration,
            delivery_delay,
            lag,
            tenant_backoff,
            amqp_connected,
            database_up,
            max_lag,
            wakeups,
            wakeup_connected,
            retention_deleted,
            settlement_retries,
            resent_rows,
        }
    }

    /// Everything, in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buffer)
            .expect("text encoding into memory cannot fail");
        String::from_utf8(buffer).expect("the text format is UTF-8")
    }

    /// A sweep of `tenant` ended.
    pub fn sweep_finished(&self, tenant: &str, outcome: Outcome, took: Duration) {
        self.sweeps
            .with_label_values(&[tenant, outcome.as_str()])
            .inc();
        self.sweep_duration
            .with_label_values(&[outcome.as_str()])
            .observe(took.as_secs_f64());
    }

    /// `rows` of `tenant` were confirmed and marked published.
    pub fn count_published(&self, tenant: &str, rows: usize) {
        self.published
            .with_label_values(&[tenant])
            .inc_by(rows as u64);
    }

    /// One row's broker confirm time minus its `occurred_at` (0 when that is
    /// in the future), clamped to [`DELIVERY_DELAY_MAX`].
    pub fn delivered_after(&self, delay: Duration) {
        self.delivery_delay
            .observe(delay.min(DELIVERY_DELAY_MAX).as_secs_f64());
    }

    pub fn failure(&self, tenant: &str, reason: FailureReason) {
        self.publish_failures
            .with_label_values(&[tenant, reason.as_str()])
            .inc();
    }

    /// How long `tenant`'s oldest pending row has waited, from the poll (see
    /// `lag`). The poll is this gauge's one writer.
    pub fn set_lag(&self, tenant: &str, lag_ms: i64) {
        self.lag
            .with_label_values(&[tenant])
            .set(lag_ms as f64 / 1000.0);
    }

    /// The back-off now in force for `tenant` (zero when none).
    pub fn set_backoff(&self, tenant: &str, delay: Duration) {
        self.tenant_backoff
            .with_label_values(&[tenant])
            .set(delay.as_secs_f64());
    }

    pub fn set_amqp_connected(&self, connected: bool) {
        self.amqp_connected.set(i64::from(connected));
    }

    /// The lag budget (`max_lag_ms`), for alerts and dashboards.
    pub fn set_max_lag(&self, max_lag: Duration) {
        self.max_lag.set(max_lag.as_secs_f64());
    }

    pub fn set_database_up(&self, up: bool) {
        self.database_up.set(i64::from(up));
    }

    /// A notification started a sweep (or flagged a follow-up one).
    pub fn count_wakeup(&self) {
        self.wakeups.inc();
    }

    pub fn set_wakeup_connected(&self, listening: bool) {
        self.wakeup_connected.set(i64::from(listening));
    }

    /// Retention deleted `rows`.
    pub fn count_retention_deleted(&self, rows: u64) {
        self.retention_deleted.inc_by(rows);
    }

    /// A settlement that failed after the broker confirmed was retried:
    /// `marked` its rows, or gave up, leaving `resent` rows pending.
    pub fn settlement_retried(&self, marked: bool, resent: usize) {
        let outcome = if marked { "marked" } else { "gave_up" };
        self.settlement_retries.with_label_values(&[outcome]).inc();
        self.resent_rows.inc_by(resent as u64);
    }

    /// Whether the last poll reached the database (answered, even with an
    /// error).
    pub fn database_is_up(&self) -> bool {
        self.database_up.get() == 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_of_the_design_is_exposed_from_the_start() {
        let text = Metrics::new(&["a".to_string()]).render();
        for name in [
            "outbox_published_total{tenant=\"a\"} 0",
            "outbox_publish_failures_total{reason=\"too_large\",tenant=\"a\"} 0",
            "outbox_sweeps_total{outcome=\"skipped\",tenant=\"a\"} 0",
            "outbox_sweep_duration_seconds_bucket{outcome=\"idle\",le=\"0.001\"} 0",
            "outbox_delivery_delay_seconds_count 0",
            "outbox_lag_seconds{tenant=\"a\"} 0",
            "outbox_wakeups_total 0",
            "outbox_wakeup_connected 0",
            "outbox_retention_deleted_total 0",
            "outbox_settlement_retries_total{outcome=\"gave_up\"} 0",
            "outbox_resent_rows_total 0",
            "outbox_tenant_backoff_seconds{tenant=\"a\"} 0",
            "outbox_amqp_connected 0",
            "outbox_database_up 0",
            "outbox_max_lag_seconds 0",
            "outbox_build_info{version=\"",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }

    #[test]
    fn one_ancient_row_cannot_poison_the_delivery_delay() {
        let metrics = Metrics::new(&[]);
        // A year-1 row, as it was measured: 64 billion seconds.
        metrics.delivered_after(Duration::from_secs(64_000_000_000));
        metrics.delivered_after(Duration::from_millis(250));
        let text = metrics.render();
        let sum = value(&text, "outbox_delivery_delay_seconds_sum");
        assert_eq!(sum, 86_400.25, "{text}");
        assert_eq!(
            value(&text, "outbox_delivery_delay_seconds_count"),
            2.0,
            "both rows are counted"
        );
        assert_eq!(
            value(&text, "outbox_delivery_delay_seconds_bucket{le=\"300\"}"),
            1.0,
            "the ancient row is in +Inf only"
        );
    }

    fn value(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    }
}
