//! Logging: JSON or text lines on stdout, filtered by `log`.
//!
//! The AMQP client's own events below ERROR are dropped whatever the filter
//! says: it logs a returned message whole, payload included, at WARN, and
//! frames at TRACE. The relay logs every failure itself, without payloads.

use std::io::IsTerminal;

use tracing::{Level, Metadata};
use tracing_subscriber::filter::{EnvFilter, filter_fn};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, fmt};

use crate::config::LogFormat;

/// Targets whose events may carry message bodies.
const PAYLOAD_BEARING_TARGETS: [&str; 2] = ["lapin", "amq_protocol"];

/// Whether an event may be written at all.
pub fn allowed(metadata: &Metadata<'_>) -> bool {
    let target = metadata.target();
    let payload_bearing = PAYLOAD_BEARING_TARGETS.iter().any(|t| {
        target == *t
            || target
                .strip_prefix(t)
                .is_some_and(|rest| rest.starts_with("::"))
    });
    !payload_bearing || *metadata.level() == Level::ERROR
}

/// Installs the global subscriber. A second call (tests) is a no-op.
pub fn init(format: LogFormat, filter: &str) {
    let filter = EnvFilter::builder()
        .parse(filter)
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let json = match format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => !std::io::stdout().is_terminal(),
    };
    let layer = if json {
        fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .with_target(false)
            .boxed()
    } else {
        fmt::layer().with_target(false).boxed()
    };
    let _ = tracing_subscriber::registry()
        .with(layer.with_filter(filter).with_filter(filter_fn(allowed)))
        .try_init();
}
