//! The Prometheus metrics of `docs/design.md`, on a registry of the relay's own.
//! Labels are bounded: tenants come from configuration (or, with `tenants =
//! "*"`, the first `max_tenants` tenants found have a label of their own and
//! the others share [`OVERFLOW`]), reasons and outcomes are fixed sets.
//!
//! A series exists once it carries information, so that 10,000 tenants cost
//! only what they use: a tenant's `outbox_published_total`, `outbox_sweeps_total`
//! (per outcome) and `outbox_lag_seconds` from its first sweep or the first
//! poll that finds it pending; `outbox_publish_failures_total` (per reason)
//! and `outbox_tenant_backoff_seconds` from its first failure (the back-off
//! is 0 again afterwards, not removed). Every metric's `# HELP` and `# TYPE`
//! are written from the start, series or not. A scrape is written family by
//! family as text (the series by tenant straight from their numbers), then
//! gzip-compressed when the client accepts it; the HTTP server does both off
//! the sweeping thread.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus::core::Collector;
use prometheus::proto::MetricFamily;
use prometheus::{
    Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::domain::{FailureReason, Outcome};

mod tenant_family;

use tenant_family::TenantFamily;

/// The longest delivery delay observed as it is: a longer one (a row whose
/// `occurred_at` is years old, e.g. year 1) counts as this, so that one row
/// cannot dominate `outbox_delivery_delay_seconds_sum` for ever. A row from
/// the future (a writer's fast clock) counts as 0.
pub const DELIVERY_DELAY_MAX: Duration = Duration::from_secs(24 * 60 * 60);

/// The `tenant` label of the tenants past `max_tenants` (with `tenants =
/// "*"`): their series are added up under it (their lag is the longest of
/// theirs, their back-off the last one set).
pub const OVERFLOW: &str = "~overflow";

/// Which tenants have series of their own.
#[derive(Debug, Default)]
struct Labels {
    /// `max_tenants`, when tenants are discovered; none: every tenant.
    cap: Option<usize>,
    own: HashSet<String>,
    /// Warned that tenants went past the cap.
    warned: bool,
}

/// The relay's metrics.
#[derive(Clone)]
pub struct Metrics {
    /// Every registered metric, in the order a scrape writes them.
    families: Arc<Vec<Arc<dyn Collector>>>,
    labels: Arc<Mutex<Labels>>,
    published: Arc<TenantFamily>,
    publish_failures: Arc<TenantFamily>,
    sweeps: Arc<TenantFamily>,
    sweep_duration: HistogramVec,
    delivery_delay: Histogram,
    /// Written by the scheduler's poll alone.
    lag: Arc<TenantFamily>,
    tenant_backoff: Arc<TenantFamily>,
    writer_wait: Arc<TenantFamily>,
    /// Written by the scheduler's poll alone.
    parked: Arc<TenantFamily>,
    amqp_connected: IntGauge,
    amqp_blocked: IntGauge,
    amqp_endpoint: IntGaugeVec,
    database_up: IntGauge,
    max_lag: Gauge,
    wakeups: IntCounter,
    wakeup_connected: IntGauge,
    retention_deleted: IntCounter,
    settlement_retries: IntCounterVec,
    resent_rows: IntCounter,
}

impl Metrics {
    /// Metrics where every tenant has series of its own (configured tenants).
    pub fn new() -> Metrics {
        Metrics::with_cap(None)
    }

    /// Metrics where the first `max_tenants` tenants have series of their
    /// own and the others share [`OVERFLOW`] (discovered tenants).
    pub fn with_max_tenants(max_tenants: usize) -> Metrics {
        Metrics::with_cap(Some(max_tenants))
    }

    fn with_cap(cap: Option<usize>) -> Metrics {
        let TenantFamilies {
            published,
            publish_failures,
            sweeps,
            lag,
            writer_wait,
            tenant_backoff,
            parked,
        } = TenantFamilies::new();
        let Connections {
            amqp_connected,
            amqp_blocked,
            amqp_endpoint,
            database_up,
            wakeup_connected,
        } = Connections::new();
        let RelayFamilies {
            delivery_delay,
            max_lag,
            wakeups,
            retention_deleted,
            settlement_retries,
            resent_rows,
        } = RelayFamilies::new();
        let sweep_duration = sweep_duration();
        let families: Vec<Arc<dyn Collector>> = vec![
            published.clone() as Arc<dyn Collector>,
            publish_failures.clone(),
            sweeps.clone(),
            Arc::new(sweep_duration.clone()),
            Arc::new(delivery_delay.clone()),
            lag.clone(),
            tenant_backoff.clone(),
            writer_wait.clone(),
            parked.clone(),
            Arc::new(amqp_connected.clone()),
            Arc::new(amqp_blocked.clone()),
            Arc::new(amqp_endpoint.clone()),
            Arc::new(database_up.clone()),
            Arc::new(max_lag.clone()),
            Arc::new(wakeups.clone()),
            Arc::new(wakeup_connected.clone()),
            Arc::new(retention_deleted.clone()),
            Arc::new(settlement_retries.clone()),
            Arc::new(resent_rows.clone()),
            Arc::new(crate::traces::spans_dropped().clone()),
            Arc::new(build_info()),
        ];
        register(&families);
        for outcome in Outcome::ALL {
            sweep_duration.with_label_values(&[outcome.as_str()]);
        }
        Metrics {
            families: Arc::new(families),
            labels: Arc::new(Mutex::new(Labels {
                cap,
                ..Labels::default()
            })),
            published,
            publish_failures,
            sweeps,
            sweep_duration,
            delivery_delay,
            lag,
            tenant_backoff,
            writer_wait,
            parked,
            amqp_connected,
            amqp_blocked,
            amqp_endpoint,
            database_up,
            max_lag,
            wakeups,
            wakeup_connected,
            retention_deleted,
            settlement_retries,
            resent_rows,
        }
    }

    /// Everything, in the Prometheus text format. Takes milliseconds with
    /// 10,000 tenants: the HTTP server calls it off the sweeping thread.
    pub fn render(&self) -> String {
        let mut text = String::new();
        self.write(&mut text);
        text
    }

    /// Each tenant's parked rows as the poll counted them. A tenant the poll
    /// did not name has none: its series, once shown, goes back to 0. Past
    /// `max_tenants` the counts add up under the overflow label.
    pub fn set_parked(&self, counts: &[(String, i64)]) {
        let mut totals: HashMap<&str, i64> = HashMap::new();
        for (tenant, count) in counts {
            *totals.entry(self.label(tenant)).or_default() += count;
        }
        self.parked
            .zero_unless(|tenant| totals.contains_key(tenant));
        for (tenant, count) in totals {
            self.parked.set(tenant, count as f64);
        }
    }

    /// Everything, in the Prometheus text format, gzip-compressed (the text
    /// is written whole first: one pass of the compressor over it is much
    /// cheaper than thousands of small writes into it).
    pub fn render_gzip(&self) -> Vec<u8> {
        let text = self.render();
        let mut gzip = flate2::write::GzEncoder::new(
            Vec::with_capacity(text.len() / 8),
            flate2::Compression::fast(),
        );
        gzip.write_all(text.as_bytes())
            .expect("compressing into memory cannot fail");
        gzip.finish().expect("compressing into memory cannot fail")
    }

    /// Writes every metric, one family at a time; one without series yet
    /// gets its `# HELP` and `# TYPE` alone. The tenant families write
    /// their text themselves (see [`TenantFamily::write_text`]).
    fn write(&self, out: &mut String) {
        let encoder = TextEncoder::new();
        for collector in self.families.iter() {
            if let Some(family) = self.tenant_family(collector) {
                family.write_text(out);
                continue;
            }
            for family in collector.collect() {
                if family.get_metric().is_empty() {
                    write_header(out, &family);
                } else {
                    encoder
                        .encode_utf8(std::slice::from_ref(&family), out)
                        .expect("the registered metrics are valid");
                }
            }
        }
    }

    /// `collector` as one of the families of series by tenant, if it is one.
    fn tenant_family(&self, collector: &Arc<dyn Collector>) -> Option<&TenantFamily> {
        [
            &self.published,
            &self.publish_failures,
            &self.sweeps,
            &self.lag,
            &self.tenant_backoff,
            &self.parked,
        ]
        .into_iter()
        .find(|family| std::ptr::addr_eq(Arc::as_ptr(family), Arc::as_ptr(collector)))
        .map(|family| &**family)
    }

    /// The `tenant` label of `tenant`: its own, or [`OVERFLOW`] past
    /// `max_tenants` (warned about once).
    fn label<'a>(&self, tenant: &'a str) -> &'a str {
        let mut labels = self.labels.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(cap) = labels.cap else {
            return tenant;
        };
        if labels.own.contains(tenant) {
            return tenant;
        }
        if labels.own.len() < cap {
            labels.own.insert(tenant.to_string());
            return tenant;
        }
        if !std::mem::replace(&mut labels.warned, true) {
            tracing::warn!(
                max_tenants = cap,
                "more tenants than max_tenants: they are relayed all the same, their series added up under tenant=\"{OVERFLOW}\""
            );
        }
        OVERFLOW
    }

    /// A sweep of `tenant` ended.
    pub fn sweep_finished(&self, tenant: &str, outcome: Outcome, took: Duration) {
        let tenant = self.label(tenant);
        if outcome == Outcome::Published || outcome == Outcome::Idle {
            // Its published count shows from its first sweep, at 0 if need be.
            self.published.touch(tenant, "");
        }
        self.sweeps.add(tenant, outcome.as_str(), 1.0);
        self.sweep_duration
            .with_label_values(&[outcome.as_str()])
            .observe(took.as_secs_f64());
    }

    /// `rows` of `tenant` were confirmed and marked published.
    pub fn count_published(&self, tenant: &str, rows: usize) {
        self.published.add(self.label(tenant), "", rows as f64);
    }

    /// One row's broker confirm time minus its `occurred_at` (0 when that is
    /// in the future), clamped to [`DELIVERY_DELAY_MAX`].
    pub fn delivered_after(&self, delay: Duration) {
        self.delivery_delay
            .observe(delay.min(DELIVERY_DELAY_MAX).as_secs_f64());
    }

    pub fn failure(&self, tenant: &str, reason: FailureReason) {
        self.publish_failures
            .add(self.label(tenant), reason.as_str(), 1.0);
    }

    /// How long `tenant`'s oldest pending row has waited, from the poll (see
    /// `lag`). The poll is this gauge's one writer.
    pub fn set_lag(&self, tenant: &str, lag_ms: i64) {
        self.set_lags([(tenant, lag_ms)]);
    }

    /// The lags one poll found, for the tenants it found pending and those
    /// it found emptied (0): no other tenant's gauge changed. Tenants under
    /// [`OVERFLOW`] show the longest of their lags.
    pub fn set_lags<'a>(&self, lags: impl IntoIterator<Item = (&'a str, i64)>) {
        let mut overflow: Option<i64> = None;
        for (tenant, lag_ms) in lags {
            let label = self.label(tenant);
            if label == OVERFLOW && tenant != OVERFLOW {
                overflow = Some(overflow.unwrap_or(0).max(lag_ms));
            } else {
                self.lag.set(label, lag_ms as f64 / 1000.0);
            }
        }
        if let Some(lag_ms) = overflow {
            self.lag.set(OVERFLOW, lag_ms as f64 / 1000.0);
        }
    }

    /// The back-off now in force for `tenant` (zero when none). Its series
    /// exists from its first back-off.
    pub fn set_backoff(&self, tenant: &str, delay: Duration) {
        let tenant = self.label(tenant);
        if delay.is_zero() && !self.tenant_backoff.contains(tenant) {
            return;
        }
        self.tenant_backoff.set(tenant, delay.as_secs_f64());
    }

    /// How long `tenant`'s rows have waited for its writers in flight (zero
    /// when none). Its series exists from its first wait.
    pub fn set_writer_wait(&self, tenant: &str, waited: Duration) {
        let tenant = self.label(tenant);
        if waited.is_zero() && !self.writer_wait.contains(tenant) {
            return;
        }
        self.writer_wait.set(tenant, waited.as_secs_f64());
    }

    pub fn set_amqp_connected(&self, connected: bool) {
        self.amqp_connected.set(i64::from(connected));
    }

    pub fn set_amqp_blocked(&self, blocked: bool) {
        self.amqp_blocked.set(i64::from(blocked));
    }

    /// The broker endpoints configured, `host:port` each, the one connected
    /// to (by index) at 1 and every other at 0; a series per endpoint, so
    /// the labels are bounded by configuration.
    pub fn set_amqp_endpoint(&self, endpoints: &[String], in_use: Option<usize>) {
        for (index, endpoint) in endpoints.iter().enumerate() {
            if Some(index) != in_use {
                self.amqp_endpoint.with_label_values(&[endpoint]).set(0);
            }
        }
        if let Some(endpoint) = in_use.and_then(|index| endpoints.get(index)) {
            self.amqp_endpoint.with_label_values(&[endpoint]).set(1);
        }
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

/// The families with a series per tenant.
struct TenantFamilies {
    published: Arc<TenantFamily>,
    publish_failures: Arc<TenantFamily>,
    sweeps: Arc<TenantFamily>,
    lag: Arc<TenantFamily>,
    writer_wait: Arc<TenantFamily>,
    tenant_backoff: Arc<TenantFamily>,
    parked: Arc<TenantFamily>,
}

impl TenantFamilies {
    fn new() -> TenantFamilies {
        let published = Arc::new(TenantFamily::counter(
            "outbox_published_total",
            "Rows published and confirmed by the broker.",
            None,
        ));
        let publish_failures = Arc::new(TenantFamily::counter(
            "outbox_publish_failures_total",
            "Publishes refused or failed, by reason.",
            Some("reason"),
        ));
        let sweeps = Arc::new(TenantFamily::counter(
            "outbox_sweeps_total",
            "Sweeps of a tenant, by outcome.",
            Some("outcome"),
        ));
        let lag = Arc::new(TenantFamily::gauge(
            "outbox_lag_seconds",
            "How long the tenant's oldest pending row has waited: its age by the database's clock, or how long the relay has seen it waiting, whichever is longer.",
        ));
        let writer_wait = Arc::new(TenantFamily::gauge(
            "outbox_writer_wait_seconds",
            "How long a tenant's rows have waited for writers in flight (transactions, prepared ones included, that took an id of the tenant and have not ended): 0 when none is waited for.",
        ));
        let tenant_backoff = Arc::new(TenantFamily::gauge(
            "outbox_tenant_backoff_seconds",
            "Current back-off of the tenant after failed sweeps; 0 when not backing off.",
        ));
        let parked = Arc::new(TenantFamily::gauge(
            "outbox_parked_rows",
            "Rows of the tenant parked (refused for their own sake park_after_attempts times) and not yet requeued or discarded, as the database counts them.",
        ));
        TenantFamilies {
            published,
            publish_failures,
            sweeps,
            lag,
            writer_wait,
            tenant_backoff,
            parked,
        }
    }
}

/// Whether the relay's connections are up, and to which broker endpoint.
struct Connections {
    amqp_connected: IntGauge,
    amqp_blocked: IntGauge,
    amqp_endpoint: IntGaugeVec,
    database_up: IntGauge,
    wakeup_connected: IntGauge,
}

impl Connections {
    fn new() -> Connections {
        let amqp_connected = IntGauge::new(
            "outbox_amqp_connected",
            "Whether the broker connection is up (1) or not (0).",
        )
        .expect("valid metric");
        let amqp_blocked = IntGauge::new(
            "outbox_amqp_blocked",
            "Whether the broker blocks the relay's connection (connection.blocked, a resource alarm): 1 while it does; nothing is published meanwhile.",
        )
        .expect("valid metric");
        let amqp_endpoint = IntGaugeVec::new(
            Opts::new(
                "outbox_amqp_endpoint",
                "The broker endpoint (host:port) the relay is connected to: 1 for the one in use, 0 for the others configured.",
            ),
            &["endpoint"],
        )
        .expect("valid metric");
        let database_up = IntGauge::new(
            "outbox_database_up",
            "Whether the last poll reached the database (1) or not (0); a poll the server answered with an error reached it.",
        )
        .expect("valid metric");
        let wakeup_connected = IntGauge::new(
            "outbox_wakeup_connected",
            "Whether the wake-up connection is LISTENing (1) or not (0); always 0 with wakeup = poll.",
        )
        .expect("valid metric");
        Connections {
            amqp_connected,
            amqp_blocked,
            amqp_endpoint,
            database_up,
            wakeup_connected,
        }
    }
}

/// The relay-wide families: delivery delay, the lag budget,
/// wake-ups, retention, settlement retries.
struct RelayFamilies {
    delivery_delay: Histogram,
    max_lag: Gauge,
    wakeups: IntCounter,
    retention_deleted: IntCounter,
    settlement_retries: IntCounterVec,
    resent_rows: IntCounter,
}

impl RelayFamilies {
    fn new() -> RelayFamilies {
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
        RelayFamilies {
            delivery_delay,
            max_lag,
            wakeups,
            retention_deleted,
            settlement_retries,
            resent_rows,
        }
    }
}

/// The duration of sweeps, by outcome.
fn sweep_duration() -> HistogramVec {
    HistogramVec::new(
        HistogramOpts::new(
            "outbox_sweep_duration_seconds",
            "Duration of one sweep of one tenant.",
        )
        .buckets(vec![
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        ]),
        &["outcome"],
    )
    .expect("valid metric")
}

/// The relay's version, as a series always 1.
fn build_info() -> IntGaugeVec {
    let build_info = IntGaugeVec::new(
        Opts::new("outbox_build_info", "The relay's version; always 1."),
        &["version"],
    )
    .expect("valid metric");
    build_info
        .with_label_values(&[env!("CARGO_PKG_VERSION")])
        .set(1);
    build_info
}

/// Registers every family on a registry of its own, kept only to refuse a
/// name given twice.
fn register(families: &[Arc<dyn Collector>]) {
    let registry = Registry::new();
    for collector in families {
        registry
            .register(Box::new(Shared(collector.clone())))
            .expect("metric names are unique");
    }
}

/// A collector both in the registry (which checks that names are unique)
/// and in [`Metrics::write`]'s list.
struct Shared(Arc<dyn Collector>);

impl Collector for Shared {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.0.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.0.collect()
    }
}

/// A family's `# HELP` and `# TYPE` lines, for one without series yet.
fn write_header(out: &mut String, family: &MetricFamily) {
    let kind = format!("{:?}", family.get_field_type()).to_lowercase();
    let help = family.help().replace('\\', "\\\\").replace('\n', "\\n");
    let _ = writeln!(out, "# HELP {} {help}", family.name());
    let _ = writeln!(out, "# TYPE {} {kind}", family.name());
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_of_the_design_is_described_from_the_start() {
        let text = Metrics::new().render();
        for name in [
            "# TYPE outbox_published_total counter",
            "# TYPE outbox_publish_failures_total counter",
            "# TYPE outbox_sweeps_total counter",
            "# TYPE outbox_sweep_duration_seconds histogram",
            "# TYPE outbox_lag_seconds gauge",
            "# TYPE outbox_tenant_backoff_seconds gauge",
            "# HELP outbox_lag_seconds How long",
            "outbox_sweep_duration_seconds_bucket{outcome=\"idle\",le=\"0.001\"} 0",
            "outbox_delivery_delay_seconds_count 0",
            "outbox_wakeups_total 0",
            "outbox_wakeup_connected 0",
            "outbox_retention_deleted_total 0",
            "outbox_settlement_retries_total{outcome=\"gave_up\"} 0",
            "outbox_resent_rows_total 0",
            "outbox_trace_spans_dropped_total 0",
            "outbox_amqp_connected 0",
            "outbox_amqp_blocked 0",
            "outbox_database_up 0",
            "outbox_max_lag_seconds 0",
            "outbox_build_info{version=\"",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
        assert!(!text.contains("tenant="), "no tenant series yet:\n{text}");
    }

    #[test]
    fn a_tenants_series_appear_when_they_carry_information() {
        let metrics = Metrics::new();
        metrics.sweep_finished("a", Outcome::Idle, Duration::from_millis(1));
        metrics.set_backoff("a", Duration::ZERO);
        let text = metrics.render();
        assert!(
            text.contains("outbox_published_total{tenant=\"a\"} 0"),
            "{text}"
        );
        assert!(text.contains("outbox_sweeps_total{outcome=\"idle\",tenant=\"a\"} 1"));
        assert!(!text.contains("outbox_sweeps_total{outcome=\"failed\""));
        assert!(!text.contains("outbox_publish_failures_total{"), "{text}");
        assert!(!text.contains("outbox_tenant_backoff_seconds{"), "{text}");
        metrics.failure("a", FailureReason::Nack);
        metrics.set_backoff("a", Duration::from_millis(400));
        metrics.set_backoff("a", Duration::ZERO);
        let text = metrics.render();
        assert!(text.contains("outbox_publish_failures_total{reason=\"nack\",tenant=\"a\"} 1"));
        assert!(
            text.contains("outbox_tenant_backoff_seconds{tenant=\"a\"} 0"),
            "back to 0, kept: {text}"
        );
    }

    #[test]
    fn tenants_past_max_tenants_share_the_overflow_label() {
        let metrics = Metrics::with_max_tenants(2);
        for tenant in ["a", "b", "c", "d"] {
            metrics.count_published(tenant, 1);
        }
        metrics.set_lags([("a", 1_000), ("c", 5_000), ("d", 7_000)]);
        let text = metrics.render();
        assert!(
            text.contains("outbox_published_total{tenant=\"a\"} 1"),
            "{text}"
        );
        assert!(text.contains("outbox_published_total{tenant=\"b\"} 1"));
        assert!(text.contains(&format!(
            "outbox_published_total{{tenant=\"{OVERFLOW}\"}} 2"
        )));
        assert!(!text.contains("tenant=\"c\""));
        assert!(text.contains(&format!("outbox_lag_seconds{{tenant=\"{OVERFLOW}\"}} 7")));
        assert!(text.contains("outbox_lag_seconds{tenant=\"a\"} 1"));
    }

    #[test]
    fn gzip_carries_the_same_text() {
        let metrics = Metrics::new();
        metrics.count_published("a", 3);
        let mut text = String::new();
        std::io::Read::read_to_string(
            &mut flate2::read::GzDecoder::new(metrics.render_gzip().as_slice()),
            &mut text,
        )
        .unwrap();
        assert_eq!(text, metrics.render());
    }

    #[test]
    fn parked_rows_follow_the_poll_and_go_back_to_zero() {
        let metrics = Metrics::with_max_tenants(1);
        metrics.set_parked(&[
            ("a".to_string(), 2),
            ("b".to_string(), 3),
            ("c".to_string(), 4),
        ]);
        let text = metrics.render();
        assert_eq!(value(&text, "outbox_parked_rows{tenant=\"a\"}"), 2.0);
        assert_eq!(
            value(
                &text,
                &format!("outbox_parked_rows{{tenant=\"{OVERFLOW}\"}}")
            ),
            7.0
        );
        metrics.set_parked(&[("c".to_string(), 1)]);
        let text = metrics.render();
        assert_eq!(value(&text, "outbox_parked_rows{tenant=\"a\"}"), 0.0);
        assert_eq!(
            value(
                &text,
                &format!("outbox_parked_rows{{tenant=\"{OVERFLOW}\"}}")
            ),
            1.0
        );
    }

    #[test]
    fn the_endpoint_gauge_names_the_one_in_use() {
        let metrics = Metrics::new();
        let endpoints = ["mq-0:5672".to_string(), "mq-1:5672".to_string()];
        metrics.set_amqp_endpoint(&endpoints, None);
        let text = metrics.render();
        assert_eq!(
            value(&text, "outbox_amqp_endpoint{endpoint=\"mq-0:5672\"}"),
            0.0
        );
        metrics.set_amqp_endpoint(&endpoints, Some(1));
        let text = metrics.render();
        assert_eq!(
            value(&text, "outbox_amqp_endpoint{endpoint=\"mq-0:5672\"}"),
            0.0
        );
        assert_eq!(
            value(&text, "outbox_amqp_endpoint{endpoint=\"mq-1:5672\"}"),
            1.0
        );
        metrics.set_amqp_endpoint(&endpoints, Some(0));
        let text = metrics.render();
        assert_eq!(
            value(&text, "outbox_amqp_endpoint{endpoint=\"mq-0:5672\"}"),
            1.0
        );
        assert_eq!(
            value(&text, "outbox_amqp_endpoint{endpoint=\"mq-1:5672\"}"),
            0.0
        );
    }

    #[test]
    fn one_ancient_row_cannot_poison_the_delivery_delay() {
        let metrics = Metrics::new();
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
