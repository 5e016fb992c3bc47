//! Logging: JSON or text lines on stdout, filtered by `log`.
//!
//! The AMQP client's own events below ERROR are dropped whatever the filter
//! says: it logs a returned message whole, payload included, at WARN, and
//! frames at TRACE. The relay logs every failure itself, without payloads.
//! The database pool's own lines are off unless the filter names them.
//!
//! A JSON line written under a row's `publish` span (see `traces`) carries
//! the span's `trace_id` and `span_id` as fields of its own, so a log search
//! and a trace search find each other.

use std::io::IsTerminal;

use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::filter::{EnvFilter, filter_fn};
use tracing_subscriber::fmt::format::{
    Format, FormatEvent, FormatFields, Json, JsonFields, Writer,
};
use tracing_subscriber::fmt::{FmtContext, FormattedFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, fmt};

use crate::config::LogFormat;

/// Targets whose events may carry message bodies.
const PAYLOAD_BEARING_TARGETS: [&str; 2] = ["lapin", "amq_protocol"];

/// Libraries whose events are off unless the filter names them: the AMQP
/// client's, and the database pool's (`deadpool.postgres`), whose
/// `Connection could not be recycled` after a database restart only says
/// that a closed connection was replaced: the relay logs a connection that
/// fails it in its own words.
const QUIET_TARGETS: [&str; 3] = ["lapin", "amq_protocol", "deadpool"];

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

/// The directives added to the `log` filter `spec`: the [`QUIET_TARGETS`]'
/// own events are off unless the filter names their target. The relay says
/// what befalls the broker connection in its own words (a lost connection
/// is one WARN with its reason and the reconnect); lapin would add its own
/// ERROR lines, a debug dump of the closing frame among them, for every
/// reconnect the relay rides through. `lapin=error` (or `deadpool=warn`) in
/// the filter brings them back.
fn library_directives(spec: &str) -> Vec<String> {
    QUIET_TARGETS
        .iter()
        .filter(|target| !spec.contains(*target))
        .map(|target| format!("{target}=off"))
        .collect()
}

/// Installs the global subscriber. A second call (tests) is a no-op.
pub fn init(format: LogFormat, spec: &str) {
    let mut filter = EnvFilter::builder()
        .parse(spec)
        .unwrap_or_else(|_| EnvFilter::new("info"));
    for directive in library_directives(spec) {
        if let Ok(directive) = directive.parse() {
            filter = filter.add_directive(directive);
        }
    }
    let json = match format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => !std::io::stdout().is_terminal(),
    };
    let layer = if json {
        let format = fmt::format()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .with_target(false);
        fmt::layer()
            .fmt_fields(JsonFields::new())
            .event_format(WithTraceIds(format))
            .boxed()
    } else {
        fmt::layer().with_target(false).boxed()
    };
    let _ = tracing_subscriber::registry()
        .with(layer.with_filter(filter).with_filter(filter_fn(allowed)))
        .try_init();
}

/// The name of the span a row's log lines are written under (`traces`).
const PUBLISH_SPAN: &str = "publish";

/// JSON lines; one written under a row's `publish` span starts with that
/// span's fields (`trace_id`, `span_id`).
struct WithTraceIds(Format<Json>);

impl<S, N> FormatEvent<S, N> for WithTraceIds
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let ids = ctx.event_scope().and_then(|scope| {
            scope
                .into_iter()
                .find(|span| {
                    span.name() == PUBLISH_SPAN
                        && span.metadata().target().starts_with("outbox_relay")
                })
                .and_then(|span| {
                    let extensions = span.extensions();
                    let fields = extensions.get::<FormattedFields<N>>()?;
                    let inner = fields.fields.trim().strip_prefix('{')?.strip_suffix('}')?;
                    (!inner.is_empty()).then(|| inner.to_string())
                })
        });
        let Some(ids) = ids else {
            return self.0.format_event(ctx, writer, event);
        };
        let mut line = String::new();
        self.0.format_event(ctx, Writer::new(&mut line), event)?;
        match line.strip_prefix('{') {
            Some(rest) => write!(writer, "{{{ids},{rest}"),
            None => writer.write_str(&line),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_amqp_clients_events_are_off_unless_the_filter_names_them() {
        assert_eq!(
            library_directives("info"),
            ["lapin=off", "amq_protocol=off", "deadpool=off"]
        );
        assert_eq!(
            library_directives("info,lapin=error"),
            ["amq_protocol=off", "deadpool=off"]
        );
        assert!(library_directives("warn,lapin=error,amq_protocol=error,deadpool=warn").is_empty());
    }
}
