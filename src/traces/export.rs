//! The way out for spans: the SDK's batch processor, on a thread of its
//! own, hands batches to the OTLP/HTTP exporter (`sender`) and its blocking
//! client; the relay's runtime thread only queues a finished span. What
//! never reached the collector is counted in
//! `outbox_trace_spans_dropped_total` (the SDK keeps its own count private):
//! a thin wrapper of the processor drops a span, and counts it, when the
//! queue holds `OTEL_BSP_MAX_QUEUE_SIZE` spans already (so the SDK's own
//! queue, of the same size, never drops one uncounted), and the exporter
//! counts every span of a batch that failed (unreachable, slow or
//! black-hole endpoint) or that the endpoint rejected ([`Losses`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, Span, SpanData,
    SpanProcessor,
};
use prometheus::IntCounter;

use super::otlp::Rejected;
use super::sender::{BuildError, OtlpHttp};
use super::settings::{Export, MAX_EXPORT_BATCH, Sampling};
use crate::redact::redact_urls_in;

/// Spans finished and not yet handed to the exporter: the queue's length,
/// or a little more (the batch being gathered), never less.
#[derive(Debug, Default)]
pub struct Queue {
    queued: AtomicUsize,
}

impl Queue {
    /// Spans that were waiting when exporting stopped.
    pub fn left(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }
}

/// The provider for `export`: a bounded queue, a batch processor thread,
/// the OTLP/HTTP exporter. Built outside any Tokio runtime (the blocking
/// client owns one of its own).
pub fn provider(
    export: &Export,
    dropped: IntCounter,
) -> Result<(SdkTracerProvider, Arc<Queue>), BuildError> {
    let queue = Arc::new(Queue::default());
    let losses = Losses {
        queue: queue.clone(),
        dropped: dropped.clone(),
        failures: Mutex::new(Failures::default()),
    };
    let exporter = OtlpHttp::new(export, losses)?;
    let batches = BatchConfigBuilder::default()
        .with_max_queue_size(export.max_queue_size)
        .with_max_export_batch_size(MAX_EXPORT_BATCH.min(export.max_queue_size))
        .with_scheduled_delay(export.schedule_delay)
        .build();
    let processor = BoundedProcessor {
        inner: BatchSpanProcessor::builder(exporter)
            .with_batch_config(batches)
            .build(),
        queue: queue.clone(),
        capacity: export.max_queue_size,
        dropped,
    };
    let resource = Resource::builder_empty()
        .with_service_name(export.service_name.clone())
        .with_attributes(
            export
                .resource
                .iter()
                .map(|(key, value)| KeyValue::new(key.clone(), value.clone())),
        )
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(sampler(&export.sampling))
        .with_resource(resource)
        .build();
    Ok((provider, queue))
}

fn sampler(sampling: &Sampling) -> Sampler {
    match sampling {
        Sampling::AlwaysOn => Sampler::AlwaysOn,
        Sampling::AlwaysOff => Sampler::AlwaysOff,
        Sampling::Ratio(ratio) => Sampler::TraceIdRatioBased(*ratio),
        Sampling::ParentBased(root) => Sampler::ParentBased(Box::new(sampler(root))),
    }
}

/// The batch processor, behind a count that bounds its queue.
#[derive(Debug)]
struct BoundedProcessor {
    inner: BatchSpanProcessor,
    queue: Arc<Queue>,
    capacity: usize,
    dropped: IntCounter,
}

impl SpanProcessor for BoundedProcessor {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.queue.queued.fetch_add(1, Ordering::Relaxed) >= self.capacity {
            self.queue.queued.fetch_sub(1, Ordering::Relaxed);
            self.dropped.inc();
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// How often, at most, a failing export is logged.
const FAILURE_LOG_EVERY: Duration = Duration::from_secs(60);

/// What the exporter tells of the spans it was handed: taken off the
/// queue, and those that never reached the collector, counted and said in
/// the log (the first failure, then at most once every
/// [`FAILURE_LOG_EVERY`] while they go on).
#[derive(Debug)]
pub struct Losses {
    queue: Arc<Queue>,
    dropped: IntCounter,
    failures: Mutex<Failures>,
}

impl Losses {
    /// `spans` left the queue for an export.
    pub fn taken(&self, spans: usize) {
        self.queue.queued.fetch_sub(spans, Ordering::Relaxed);
    }

    /// An export of `spans` failed with `error`.
    pub fn failed(&self, spans: usize, error: &str) {
        self.dropped.inc_by(spans as u64);
        if let Some(dropped) = self.due(spans) {
            // The error may quote the endpoint: without its password.
            tracing::warn!(
                dropped,
                error = %redact_urls_in(error),
                "span export failed; the spans are dropped (rows are published as before)"
            );
        }
    }

    /// The endpoint took an export but rejected some of its spans.
    pub fn rejected(&self, rejected: &Rejected) {
        self.dropped.inc_by(rejected.spans);
        let spans = usize::try_from(rejected.spans).unwrap_or(usize::MAX);
        if let Some(dropped) = self.due(spans) {
            let message: String = rejected.message.chars().take(200).collect();
            tracing::warn!(
                dropped,
                error = %redact_urls_in(&message),
                "the trace endpoint rejected spans; they are dropped (rows are published as before)"
            );
        }
    }

    fn due(&self, spans: usize) -> Option<usize> {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .failed(spans, Instant::now())
    }
}

/// Failed exports since the last one logged.
#[derive(Debug, Default)]
struct Failures {
    logged_at: Option<Instant>,
    spans: usize,
}

impl Failures {
    /// Counts a failed export of `spans`; the spans to report, when a line
    /// is due.
    fn failed(&mut self, spans: usize, now: Instant) -> Option<usize> {
        self.spans += spans;
        let due = self
            .logged_at
            .is_none_or(|at| now.duration_since(at) >= FAILURE_LOG_EVERY);
        if !due {
            return None;
        }
        self.logged_at = Some(now);
        Some(std::mem::take(&mut self.spans))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_export_is_logged_first_then_once_a_minute_with_what_it_dropped() {
        let mut failures = Failures::default();
        let start = Instant::now();
        assert_eq!(failures.failed(512, start), Some(512));
        assert_eq!(failures.failed(512, start + Duration::from_secs(5)), None);
        assert_eq!(failures.failed(100, start + Duration::from_secs(59)), None);
        assert_eq!(
            failures.failed(1, start + Duration::from_secs(60)),
            Some(613)
        );
        assert_eq!(failures.failed(1, start + Duration::from_secs(61)), None);
    }
}
