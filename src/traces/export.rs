//! The way out for spans: a finished span is already its OTLP bytes (see
//! `otlp`); the sweeping thread appends them to a bounded queue, and the
//! export thread, of its own, takes what is queued every
//! `OTEL_BSP_SCHEDULE_DELAY` (or as soon as a batch's worth is there) and
//! POSTs it (see `sender`). Encoding and HTTP never run on the relay's
//! runtime thread.
//!
//! What never reaches the collector is counted in
//! `outbox_trace_spans_dropped_total`: a span that finds the queue holding
//! `OTEL_BSP_MAX_QUEUE_SIZE` spans already, every span of an export that
//! failed (unreachable, slow or black-hole endpoint) or that the endpoint
//! answers it rejected, and what is still queued or in an export under way
//! when shutdown's time is up: that export is abandoned, not waited for.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use prometheus::IntCounter;

use super::otlp::{self, Rejected};
use super::sender::{BuildError, OtlpHttp};
use super::settings::{Export, MAX_EXPORT_BATCH};
use crate::redact::redact_urls_in;

/// Finished spans waiting for the export thread.
#[derive(Debug)]
pub struct Queue {
    pending: Mutex<Pending>,
    /// Signalled when a batch's worth is queued, and at shutdown.
    ready: Condvar,
    capacity: usize,
    batch: usize,
    dropped: IntCounter,
}

#[derive(Debug, Default)]
struct Pending {
    /// The spans, each a `ScopeSpans.spans` field (see `otlp::push_span`).
    spans: Vec<u8>,
    count: usize,
    /// Spans taken by an export still under way.
    exporting: usize,
    closing: bool,
    /// Shutdown's time ran out: what was left is counted already.
    abandoned: bool,
}

impl Queue {
    fn new(capacity: usize, dropped: IntCounter) -> Queue {
        Queue {
            pending: Mutex::default(),
            ready: Condvar::new(),
            capacity,
            batch: MAX_EXPORT_BATCH.min(capacity),
            dropped,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a finished span, or drops it (counted) when the queue is full.
    pub fn push(&self, span: &[u8]) {
        let mut pending = self.lock();
        if pending.count >= self.capacity {
            drop(pending);
            self.dropped.inc();
            return;
        }
        otlp::push_span(&mut pending.spans, span);
        pending.count += 1;
        if pending.count == self.batch {
            self.ready.notify_one();
        }
    }

    /// Waits until a batch's worth is queued, `delay` has passed, or
    /// shutdown began; then takes what is queued (the spans, how many, and
    /// whether this is the last take), leaving `spare` (emptied, its
    /// capacity kept) to queue the next ones in.
    fn take(&self, delay: Duration, mut spare: Vec<u8>) -> (Vec<u8>, usize, bool) {
        let deadline = Instant::now() + delay;
        let mut pending = self.lock();
        while pending.count < self.batch && !pending.closing {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            pending = self
                .ready
                .wait_timeout(pending, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let count = std::mem::take(&mut pending.count);
        pending.exporting = count;
        spare.clear();
        let spans = std::mem::replace(&mut pending.spans, spare);
        (spans, count, pending.closing)
    }

    /// The export under way ended; whether its outcome still counts (it
    /// does not once shutdown abandoned it).
    fn exported(&self) -> bool {
        let mut pending = self.lock();
        pending.exporting = 0;
        !pending.abandoned
    }

    /// Gives up what is queued and the export under way; how many spans.
    fn abandon(&self) -> usize {
        let mut pending = self.lock();
        pending.abandoned = true;
        pending.spans.clear();
        std::mem::take(&mut pending.count) + std::mem::take(&mut pending.exporting)
    }

    fn close(&self) {
        self.lock().closing = true;
        self.ready.notify_one();
    }

    /// Spans not yet exported: queued, or in an export under way.
    #[cfg(test)]
    fn left(&self) -> usize {
        let pending = self.lock();
        pending.count + pending.exporting
    }
}

/// The export thread and its queue.
#[derive(Debug)]
pub struct Exporter {
    pub queue: Arc<Queue>,
    /// Told when the export thread has ended.
    ended: std::sync::mpsc::Receiver<()>,
}

/// Starts exporting as `export` says: the queue spans go to, and the
/// thread that sends them. Called outside any Tokio runtime (the blocking
/// client owns one of its own).
pub fn start(export: &Export, dropped: IntCounter) -> Result<Exporter, BuildError> {
    let sender = OtlpHttp::new(export)?;
    let queue = Arc::new(Queue::new(export.max_queue_size, dropped.clone()));
    let resource = otlp::resource(&export.service_name, &export.resource);
    let scope = otlp::scope(super::SCOPE, env!("CARGO_PKG_VERSION"));
    let losses = Losses {
        dropped,
        failures: Mutex::new(Failures::default()),
    };
    let (done, ended) = std::sync::mpsc::channel();
    let delay = export.schedule_delay;
    let exporting = queue.clone();
    std::thread::Builder::new()
        .name("otel-export".into())
        .spawn(move || {
            let mut spare = Vec::new();
            loop {
                let (spans, count, last) = exporting.take(delay, spare);
                spare = spans;
                if count > 0 {
                    let body = otlp::export_request(&resource, &scope, &spare);
                    let sent = sender.post(body);
                    if exporting.exported() {
                        match sent {
                            Ok(None) => {}
                            Ok(Some(rejected)) => losses.rejected(&rejected),
                            Err(error) => losses.failed(count, &error),
                        }
                    }
                }
                if last {
                    break;
                }
            }
            let _ = done.send(());
        })
        .map_err(BuildError::Thread)?;
    Ok(Exporter { queue, ended })
}

impl Exporter {
    /// Exports what is queued and stops, within `within`; then what is left,
    /// queued or in an export under way, is abandoned: counted as dropped,
    /// and said.
    pub fn shutdown(self, within: Duration) {
        self.queue.close();
        if self.ended.recv_timeout(within).is_err() {
            let dropped = self.queue.abandon();
            self.queue.dropped.inc_by(dropped as u64);
            tracing::warn!(
                dropped,
                within_ms = within.as_millis() as u64,
                "the trace endpoint did not take the last spans in time; they are dropped (rows are published as before)"
            );
        }
    }
}

/// How often, at most, a failing export is logged.
const FAILURE_LOG_EVERY: Duration = Duration::from_secs(60);

/// Spans that never reached the collector, counted and said in the log
/// (the first failure, then at most once every [`FAILURE_LOG_EVERY`] while
/// they go on).
#[derive(Debug)]
struct Losses {
    dropped: IntCounter,
    failures: Mutex<Failures>,
}

impl Losses {
    /// An export of `spans` failed with `error`.
    fn failed(&self, spans: usize, error: &str) {
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
    fn rejected(&self, rejected: &Rejected) {
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

    fn counter() -> IntCounter {
        IntCounter::new("dropped", "test").unwrap()
    }

    #[test]
    fn the_queue_holds_its_capacity_and_counts_what_it_drops() {
        let dropped = counter();
        let queue = Queue::new(3, dropped.clone());
        for span in [b"a", b"b", b"c", b"d", b"e"] {
            queue.push(span);
        }
        assert_eq!(dropped.get(), 2);
        assert_eq!(queue.left(), 3);
        // A full batch (the capacity, here) is taken at once.
        let (spans, count, last) = queue.take(Duration::from_secs(60), Vec::new());
        assert_eq!((count, last), (3, false));
        assert_eq!(spans, b"\x12\x01a\x12\x01b\x12\x01c");
        assert_eq!(queue.left(), 3, "in the export under way");
        assert!(queue.exported(), "its outcome counts");
        queue.push(b"f");
        assert_eq!(queue.left(), 1);
    }

    #[test]
    fn an_abandoned_export_is_counted_once_with_what_is_queued() {
        let queue = Queue::new(100, counter());
        queue.push(b"a");
        queue.push(b"b");
        let (_, count, _) = queue.take(Duration::ZERO, Vec::new());
        queue.push(b"c");
        assert_eq!((count, queue.abandon()), (2, 3));
        assert_eq!(queue.left(), 0);
        assert!(!queue.exported(), "its late outcome is not counted again");
    }

    #[test]
    fn a_take_waits_for_the_delay_then_for_shutdown_no_more() {
        let queue = Queue::new(100, counter());
        queue.push(b"a");
        let (spans, count, last) = queue.take(Duration::from_millis(20), Vec::new());
        assert_eq!((spans.len(), count, last), (3, 1, false));
        queue.close();
        let started = Instant::now();
        let (_, count, last) = queue.take(Duration::from_secs(60), spans);
        assert_eq!((count, last), (0, true));
        assert!(started.elapsed() < Duration::from_secs(30));
    }
}
