//! Traces: one OpenTelemetry PRODUCER span per row the relay publishes,
//! exported over OTLP/HTTP when the standard `OTEL_*` variables name an
//! endpoint (see `settings`); with none, nothing is built and publishing
//! pays one relaxed load per row.
//!
//! A row's span is a child of the row's own valid `traceparent` (and
//! `tracestate`), or the root of a new trace; it runs from the publish to
//! the broker's confirm, and a refused row's span ends with status ERROR and
//! the refusal's reason. When the span is sampled, the message carries it
//! as its `traceparent` (the row's `tracestate` is kept), so that a consumer
//! continuing the header is the relay's child; an unsampled row keeps its
//! own. A span holds no payload and no header value but the trace context.
//! Nothing else of the relay's is a span: not a poll, not a sweep, not the
//! exporter's own HTTP calls.
//!
//! The spans are the relay's own, not an SDK's: the sampling decision (the
//! OpenTelemetry samplers', see `settings`) and the ids are made as the
//! row's message is built, and a sampled span is written as its OTLP bytes
//! from the start (see `otlp`), so nothing is copied, grouped or encoded
//! again later. Exporting never holds up relaying (see `export`): finished
//! spans queue, bounded, for the export thread; what cannot be exported is
//! dropped and counted in `outbox_trace_spans_dropped_total`.

mod export;
mod ids;
mod otlp;
mod parent;
mod sender;
mod settings;

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use opentelemetry::trace::TraceState;
use prometheus::IntCounter;

pub use parent::TraceParent;
pub use settings::{Export, Sampling, Settings, SettingsError};

/// The instrumentation scope the spans are exported under.
const SCOPE: &str = "outbox-relay";

/// What a relay whose tracing is on needs per row (set once, by
/// [`install`]).
#[derive(Debug)]
struct Tracer {
    sampling: Sampling,
    queue: Arc<export::Queue>,
}

static TRACER: OnceLock<Tracer> = OnceLock::new();

/// `outbox_trace_spans_dropped_total`: one counter for the process, as the
/// tracer is; every relay's `/metrics` shows it.
static SPANS_DROPPED: LazyLock<IntCounter> = LazyLock::new(|| {
    IntCounter::new(
        "outbox_trace_spans_dropped_total",
        "Spans that never reached the OTLP endpoint: the export queue was full (OTEL_BSP_MAX_QUEUE_SIZE), their export failed or timed out, or the endpoint rejected them.",
    )
    .expect("valid metric")
});

/// The process's dropped-spans counter (for the metrics registry).
pub fn spans_dropped() -> &'static IntCounter {
    &SPANS_DROPPED
}

/// Why tracing could not start.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("cannot build the OTLP exporter: {0}")]
    Exporter(#[from] sender::BuildError),
    #[error("tracing is already installed in this process")]
    Twice,
}

/// The most the exporter gets at shutdown for everything, the export under
/// way included: a collector that never answers holds up no exit.
pub const SHUTDOWN_EXPORT_MAX: Duration = Duration::from_secs(1);

/// Tracing that runs: [`Exporting::shutdown`] flushes it at the end.
#[derive(Debug)]
pub struct Exporting {
    exporter: export::Exporter,
}

/// Starts exporting as `settings` say: `None` when tracing is off. Call it
/// outside the Tokio runtime (the exporter's blocking client has its own).
pub fn install(settings: &Settings) -> Result<Option<Exporting>, InstallError> {
    let Settings::On(export) = settings else {
        return Ok(None);
    };
    let exporter = export::start(export, spans_dropped().clone())?;
    let tracer = Tracer {
        sampling: export.sampling.clone(),
        queue: exporter.queue.clone(),
    };
    TRACER.set(tracer).map_err(|_| InstallError::Twice)?;
    Ok(Some(Exporting { exporter }))
}

impl Exporting {
    /// Exports what is queued and stops, within `within` or
    /// [`SHUTDOWN_EXPORT_MAX`], whichever is less (the export runs on its
    /// own thread, never the runtime's); what is left then, the export
    /// under way included, is abandoned and counted as dropped.
    pub fn shutdown(self, within: Duration) {
        self.exporter.shutdown(within.min(SHUTDOWN_EXPORT_MAX));
    }
}

/// Whether rows get spans (tracing was installed).
pub fn enabled() -> bool {
    TRACER.get().is_some()
}

/// The start of a publish span's name.
const PUBLISH: &str = "publish ";

/// What every span to one exchange shares.
#[derive(Debug, Clone, Copy)]
struct Named {
    /// `publish <exchange>`.
    name: &'static str,
    /// The attributes that never change for the exchange, as OTLP bytes.
    constant: &'static [u8],
}

/// The span name and constant attributes of `exchange`, made once per
/// exchange and kept for the process (a relay publishes to one). The
/// thread's last answer is kept beside them, so a row's span looks up no
/// map.
fn named(exchange: &str) -> Named {
    thread_local! {
        static LAST: std::cell::Cell<Option<Named>> = const { std::cell::Cell::new(None) };
    }
    if let Some(named) = LAST.get()
        && &named.name[PUBLISH.len()..] == exchange
    {
        return named;
    }
    static NAMES: LazyLock<Mutex<HashMap<String, Named>>> = LazyLock::new(Mutex::default);
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    let named = *names.entry(exchange.to_owned()).or_insert_with(|| Named {
        name: Box::leak(format!("{PUBLISH}{exchange}").into_boxed_str()),
        constant: Box::leak(
            otlp::constant(&[
                ("messaging.system", "rabbitmq"),
                ("messaging.operation.type", "send"),
                ("messaging.operation.name", "publish"),
                ("messaging.destination.name", exchange),
            ])
            .into_boxed_slice(),
        ),
    });
    LAST.set(Some(named));
    named
}

/// What a row's span says of it.
#[derive(Debug, Clone, Copy)]
pub struct Publish<'a> {
    /// The exchange (`""` is named `amq.default`).
    pub exchange: &'a str,
    pub routing_key: &'a str,
    pub message_id: &'a str,
    pub tenant: &'a str,
    pub kind: &'a str,
    /// The row's age at publish, since `occurred_at`.
    pub delay_ms: i64,
}

/// The span of one row being published, from the publish to its confirm:
/// always a sampled one (a row that is not sampled has none). Dropped
/// without an end, it ends then, its status unset.
#[derive(Debug)]
pub struct PublishSpan {
    /// Its OTLP fields so far; `None` once it ended.
    record: Option<Vec<u8>>,
    trace_id: u128,
    span_id: u64,
    /// The row's valid `tracestate`, carried on ("" for none).
    trace_state: String,
    /// Its parent is the row's `traceparent`.
    remote_parent: bool,
}

impl PublishSpan {
    /// Starts the span of a row, child of its trace context (its
    /// `traceparent` and `tracestate` header values, if it had any); `None`
    /// when tracing is off or the row is not sampled.
    pub fn start(
        publish: Publish<'_>,
        traceparent: Option<&str>,
        tracestate: Option<&str>,
    ) -> Option<PublishSpan> {
        let tracer = TRACER.get()?;
        let parent = traceparent.and_then(TraceParent::parse);
        let trace_id = parent.map_or_else(ids::trace_id, |parent| parent.trace_id);
        if !tracer
            .sampling
            .samples(parent.map(|parent| parent.sampled), trace_id)
        {
            return None;
        }
        let trace_state = match (parent, tracestate) {
            (Some(_), Some(state)) => state
                .parse::<TraceState>()
                .map(|state| state.header())
                .unwrap_or_default(),
            _ => String::new(),
        };
        let span_id = ids::span_id();
        let exchange = if publish.exchange.is_empty() {
            "amq.default"
        } else {
            publish.exchange
        };
        let named = named(exchange);
        let variable = publish.routing_key.len()
            + publish.message_id.len()
            + publish.tenant.len()
            + publish.kind.len();
        let mut record = Vec::with_capacity(
            160 + named.name.len() + named.constant.len() + trace_state.len() + variable + 128,
        );
        otlp::open(
            &mut record,
            &otlp::Opening {
                trace_id,
                span_id,
                trace_state: &trace_state,
                parent_span_id: parent.map(|parent| parent.span_id),
                name: named.name,
                start: SystemTime::now(),
            },
        );
        record.extend_from_slice(named.constant);
        for (key, value) in [
            (
                "messaging.rabbitmq.destination.routing_key",
                publish.routing_key,
            ),
            ("messaging.message.id", publish.message_id),
            ("outbox.tenant_id", publish.tenant),
            ("outbox.kind", publish.kind),
        ] {
            otlp::attribute_str(&mut record, 9, key, value);
        }
        otlp::attribute_i64(&mut record, "outbox.delay_ms", publish.delay_ms);
        Some(PublishSpan {
            record: Some(record),
            trace_id,
            span_id,
            trace_state,
            remote_parent: parent.is_some(),
        })
    }

    /// The `traceparent` and `tracestate` the message carries instead of
    /// the row's: the span's own.
    pub fn headers(&self) -> (String, String) {
        let traceparent = TraceParent {
            trace_id: self.trace_id,
            span_id: self.span_id,
            sampled: true,
        };
        (traceparent.header(), self.trace_state.clone())
    }

    /// The ids a log line under this span carries: trace id and span id, in
    /// lower-case hex as the exporter writes them.
    pub fn ids(&self) -> (String, String) {
        (
            format!("{:032x}", self.trace_id),
            format!("{:016x}", self.span_id),
        )
    }

    /// The broker confirmed the row at `at`.
    pub fn confirmed(mut self, at: SystemTime) {
        self.end(at, None);
    }

    /// The row was not published: `reason` (e.g. `unroutable`) and its
    /// detail, which holds no payload nor header value.
    pub fn refused(mut self, reason: &str, detail: &str) {
        self.end(SystemTime::now(), Some(&format!("{reason}: {detail}")));
    }

    /// Writes the span's last fields and queues it for export.
    fn end(&mut self, at: SystemTime, error: Option<&str>) {
        let Some(mut record) = self.record.take() else {
            return;
        };
        otlp::close(&mut record, at, error, self.remote_parent);
        if let Some(tracer) = TRACER.get() {
            tracer.queue.push(&record);
        }
    }
}

impl Drop for PublishSpan {
    fn drop(&mut self) {
        self.end(SystemTime::now(), None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_span_name_is_made_once_per_exchange() {
        let orders = named("orders");
        assert_eq!(orders.name, "publish orders");
        assert!(std::ptr::eq(orders.name, named("orders").name));
        assert_eq!(named("audit").name, "publish audit");
        assert!(std::ptr::eq(orders.name, named("orders").name));
        assert!(std::ptr::eq(orders.constant, named("orders").constant));
        assert_eq!(named("order").name, "publish order");
        assert_eq!(named("").name, "publish ");
        assert_ne!(named("audit").constant, orders.constant);
    }
}
