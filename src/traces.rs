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
//! Exporting never holds up relaying (see `export`): spans queue, bounded,
//! for the batch processor's thread; what cannot be exported is dropped and
//! counted in `outbox_trace_spans_dropped_total`.

mod export;
mod otlp;
mod parent;
mod sender;
mod settings;

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState,
    Tracer, TracerProvider,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use prometheus::IntCounter;

pub use parent::TraceParent;
pub use settings::{Export, Sampling, Settings, SettingsError};

/// The tracer of a relay whose tracing is on (set once, by [`install`]).
static TRACER: OnceLock<SdkTracer> = OnceLock::new();

/// `outbox_trace_spans_dropped_total`: one counter for the process, as the
/// tracer is; every relay's `/metrics` shows it.
static SPANS_DROPPED: LazyLock<IntCounter> = LazyLock::new(|| {
    IntCounter::new(
        "outbox_trace_spans_dropped_total",
        "Spans that never reached the OTLP endpoint: the export queue was full (OTEL_BSP_MAX_QUEUE_SIZE), or their export failed or timed out.",
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

/// Tracing that runs: [`Exporting::shutdown`] flushes it at the end.
#[derive(Debug)]
pub struct Exporting {
    provider: SdkTracerProvider,
    queue: Arc<export::Queue>,
}

/// Starts exporting as `settings` say: `None` when tracing is off. Call it
/// outside the Tokio runtime (the exporter's blocking client has its own).
pub fn install(settings: &Settings) -> Result<Option<Exporting>, InstallError> {
    let Settings::On(export) = settings else {
        return Ok(None);
    };
    let (provider, queue) = export::provider(export, spans_dropped().clone())?;
    TRACER
        .set(provider.tracer("outbox-relay"))
        .map_err(|_| InstallError::Twice)?;
    Ok(Some(Exporting { provider, queue }))
}

impl Exporting {
    /// Exports what is queued and stops, within `within`, on a thread of its
    /// own (never the runtime's); what is left then is counted as dropped.
    pub fn shutdown(self, within: Duration) {
        let Exporting { provider, queue } = self;
        let (done, finished) = std::sync::mpsc::channel();
        let flush = std::thread::Builder::new()
            .name("otel-shutdown".into())
            .spawn(move || {
                let _ = provider.shutdown_with_timeout(within);
                let _ = done.send(());
            });
        if flush.is_ok() {
            let _ = finished.recv_timeout(within + Duration::from_millis(100));
        }
        spans_dropped().inc_by(queue.left() as u64);
    }
}

/// The start of a publish span's name.
const PUBLISH: &str = "publish ";

/// `publish <exchange>`, made once per exchange and kept for the process: a
/// span's name and attributes are either `'static` or allocated for each
/// span, and a relay publishes to one exchange. The thread's last answer is
/// kept beside it, so a row's span looks up no map.
fn publish_name(exchange: &str) -> &'static str {
    thread_local! {
        static LAST: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
    }
    if let Some(name) = LAST.get()
        && &name[PUBLISH.len()..] == exchange
    {
        return name;
    }
    static NAMES: LazyLock<Mutex<HashMap<String, &'static str>>> = LazyLock::new(Mutex::default);
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    let name = match names.get(exchange) {
        Some(name) => name,
        None => {
            let name: &'static str = Box::leak(format!("{PUBLISH}{exchange}").into_boxed_str());
            names.insert(exchange.to_owned(), name);
            name
        }
    };
    LAST.set(Some(name));
    name
}

/// Whether rows get spans (tracing was installed).
pub fn enabled() -> bool {
    TRACER.get().is_some()
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

/// The span of one row being published, from the publish to its confirm.
#[derive(Debug)]
pub struct PublishSpan {
    span: opentelemetry_sdk::trace::Span,
}

impl PublishSpan {
    /// Starts the span of a row, child of its trace context (its
    /// `traceparent` and `tracestate` header values, if it had any); `None`
    /// when tracing is off.
    pub fn start(
        publish: Publish<'_>,
        traceparent: Option<&str>,
        tracestate: Option<&str>,
    ) -> Option<PublishSpan> {
        let tracer = TRACER.get()?;
        let parent = match traceparent.and_then(TraceParent::parse) {
            Some(parent) => {
                let state = tracestate
                    .and_then(|s| s.parse::<TraceState>().ok())
                    .unwrap_or_default();
                let flags = if parent.sampled {
                    TraceFlags::SAMPLED
                } else {
                    TraceFlags::default()
                };
                Context::new().with_remote_span_context(SpanContext::new(
                    TraceId::from(parent.trace_id),
                    SpanId::from_bytes(parent.span_id.to_be_bytes()),
                    flags,
                    true,
                    state,
                ))
            }
            None => Context::new(),
        };
        let exchange = if publish.exchange.is_empty() {
            "amq.default"
        } else {
            publish.exchange
        };
        let name = publish_name(exchange);
        let span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Producer)
            .with_attributes([
                KeyValue::new("messaging.system", "rabbitmq"),
                KeyValue::new("messaging.operation.type", "send"),
                KeyValue::new("messaging.operation.name", "publish"),
                KeyValue::new("messaging.destination.name", &name[PUBLISH.len()..]),
                KeyValue::new(
                    "messaging.rabbitmq.destination.routing_key",
                    publish.routing_key.to_string(),
                ),
                KeyValue::new("messaging.message.id", publish.message_id.to_string()),
                KeyValue::new("outbox.tenant_id", publish.tenant.to_string()),
                KeyValue::new("outbox.kind", publish.kind.to_string()),
                KeyValue::new("outbox.delay_ms", publish.delay_ms),
            ])
            .start_with_context(tracer, &parent);
        Some(PublishSpan { span })
    }

    fn context(&self) -> &SpanContext {
        opentelemetry::trace::Span::span_context(&self.span)
    }

    /// The `traceparent` and `tracestate` the message carries instead of
    /// the row's: the span's own, when it is sampled; `None` otherwise (the
    /// row's own headers stay).
    pub fn headers(&self) -> Option<(String, String)> {
        let context = self.context();
        if !context.is_sampled() {
            return None;
        }
        let traceparent = TraceParent {
            trace_id: u128::from_be_bytes(context.trace_id().to_bytes()),
            span_id: u64::from_be_bytes(context.span_id().to_bytes()),
            sampled: true,
        };
        Some((traceparent.header(), context.trace_state().header()))
    }

    /// The ids a log line under this span carries: trace id and span id, in
    /// hex as the exporter writes them. `None` when the span is not sampled.
    pub fn ids(&self) -> Option<(String, String)> {
        let context = self.context();
        context.is_sampled().then(|| {
            (
                context.trace_id().to_string(),
                context.span_id().to_string(),
            )
        })
    }

    /// The broker confirmed the row at `at`.
    pub fn confirmed(mut self, at: SystemTime) {
        opentelemetry::trace::Span::end_with_timestamp(&mut self.span, at);
    }

    /// The row was not published: `reason` (e.g. `unroutable`) and its
    /// detail, which holds no payload nor header value.
    pub fn refused(mut self, reason: &str, detail: &str) {
        opentelemetry::trace::Span::set_status(
            &mut self.span,
            Status::error(Cow::Owned(format!("{reason}: {detail}"))),
        );
        opentelemetry::trace::Span::end(&mut self.span);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_span_name_is_made_once_per_exchange() {
        let orders = publish_name("orders");
        assert_eq!(orders, "publish orders");
        assert!(std::ptr::eq(orders, publish_name("orders")));
        assert_eq!(publish_name("audit"), "publish audit");
        assert!(std::ptr::eq(orders, publish_name("orders")));
        assert_eq!(publish_name("order"), "publish order");
        assert_eq!(publish_name(""), "publish ");
        assert_eq!(&orders[PUBLISH.len()..], "orders");
    }
}
