//! Traces: the relay binary (the `OTEL_*` variables are the process's own)
//! exporting to an OTLP/HTTP receiver the test runs, decoded with
//! `opentelemetry-proto`; the spans checked against the rows' `traceparent`,
//! the consumed messages' headers and the relay's JSON log lines; a
//! black-hole endpoint that never answers.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use lapin::types::AMQPValue;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use prost::Message as _;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{
    Broker, Outbox, Received, eventually, http_get, lines_at, metric, relay_command, relay_env,
    set_env, spawn_relay,
};

/// A row's own trace context: a writer's span, sampled.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

/// An exported span with its resource's `service.name`.
#[derive(Debug, Clone)]
struct Exported {
    service: Option<String>,
    span: Span,
}

/// An OTLP/HTTP receiver on 127.0.0.1: every span it was sent.
struct Receiver {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<Exported>>>,
}

impl Receiver {
    async fn start() -> Receiver {
        let spans: Arc<Mutex<Vec<Exported>>> = Arc::default();
        let router = axum::Router::new()
            .route("/v1/traces", post(receive))
            .with_state(spans.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the receiver");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Receiver { addr, spans }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn spans(&self) -> Vec<Exported> {
        self.spans.lock().unwrap().clone()
    }

    /// The spans of the row whose `message_id` is `id`.
    fn of_row(&self, id: i64) -> Vec<Exported> {
        self.spans()
            .into_iter()
            .filter(|e| attribute(&e.span, "messaging.message.id") == Some(id.to_string()))
            .collect()
    }
}

async fn receive(State(spans): State<Arc<Mutex<Vec<Exported>>>>, body: Bytes) -> Vec<u8> {
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf request");
    let mut spans = spans.lock().unwrap();
    for resource_spans in request.resource_spans {
        let service = resource_spans.resource.as_ref().and_then(|resource| {
            resource
                .attributes
                .iter()
                .find(|kv| kv.key == "service.name")
                .and_then(value_text)
        });
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                spans.push(Exported {
                    service: service.clone(),
                    span,
                });
            }
        }
    }
    // An empty ExportTraceServiceResponse.
    Vec::new()
}

/// Accepts connections and never answers: an endpoint that holds every
/// export until the client gives up.
async fn black_hole() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the black hole");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    addr
}

fn value_text(kv: &KeyValue) -> Option<String> {
    match kv.value.as_ref()?.value.as_ref()? {
        Value::StringValue(s) => Some(s.clone()),
        Value::IntValue(n) => Some(n.to_string()),
        Value::BoolValue(b) => Some(b.to_string()),
        Value::DoubleValue(d) => Some(d.to_string()),
        _ => None,
    }
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(value_text)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text_header(message: &Received, name: &str) -> Option<String> {
    match message.header(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        other => panic!("header {name} is not a string: {other:?}"),
    }
}

/// The relay's environment for this test's table, exchange and receiver;
/// spans are exported every 100 ms.
fn traced_env(outbox: &Outbox, broker: &Broker, endpoint: &str) -> Vec<(String, String)> {
    let mut env = relay_env(outbox, broker, &["a"]);
    set_env(&mut env, "OTEL_EXPORTER_OTLP_ENDPOINT", endpoint);
    set_env(&mut env, "OTEL_BSP_SCHEDULE_DELAY", "100");
    env
}

#[tokio::test]
async fn a_rows_span_is_a_producer_child_of_its_traceparent_and_the_message_names_it() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["a.#"]).await;
    let receiver = Receiver::start().await;
    let traceparent = format!("00-{TRACE_ID}-{PARENT_ID}-01");
    let unsampled = format!("00-{TRACE_ID}-{PARENT_ID}-00");
    let child = outbox
        .insert(
            "a",
            "order.created",
            "o-1",
            Some("{\"secret\":\"payload\"}"),
            Some(json!({"traceparent": traceparent, "tracestate": "vendor=x", "note": "kept"})),
        )
        .await;
    let root = outbox
        .insert("a", "order.paid", "o-1", Some("{}"), None)
        .await;
    let not_sampled = outbox
        .insert(
            "a",
            "order.paid",
            "o-2",
            Some("{}"),
            Some(json!({"traceparent": unsampled})),
        )
        .await;
    let last = outbox
        .insert("a", "order.shipped", "o-1", Some("{}"), None)
        .await;

    let (_relay, _addr) = spawn_relay(&traced_env(&outbox, &broker, &receiver.endpoint())).await;
    eventually("4 messages consumed", Duration::from_secs(20), || {
        let n = broker.count();
        async move { n == 4 }
    })
    .await;
    eventually(
        "the last row's span exported",
        Duration::from_secs(20),
        || {
            let found = !receiver.of_row(last).is_empty();
            async move { found }
        },
    )
    .await;

    let messages = broker.received();
    let message = |id: i64| messages.iter().find(|m| m.id == id).expect("consumed");

    // The child of the row's traceparent.
    let spans = receiver.of_row(child);
    assert_eq!(spans.len(), 1, "one span per published row: {spans:?}");
    let Exported { service, span } = &spans[0];
    assert_eq!(service.as_deref(), Some("outbox-relay"));
    assert_eq!(span.name, format!("publish {}", broker.exchange));
    assert_eq!(span.kind, SpanKind::Producer as i32);
    assert_eq!(hex(&span.trace_id), TRACE_ID);
    assert_eq!(hex(&span.parent_span_id), PARENT_ID);
    assert_ne!(hex(&span.span_id), PARENT_ID);
    assert_eq!(span.trace_state, "vendor=x");
    let mut keys: Vec<&str> = span.attributes.iter().map(|kv| kv.key.as_str()).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "messaging.destination.name",
            "messaging.message.id",
            "messaging.operation.name",
            "messaging.operation.type",
            "messaging.rabbitmq.destination.routing_key",
            "messaging.system",
            "outbox.delay_ms",
            "outbox.kind",
            "outbox.tenant_id",
        ],
        "exactly these attributes: no payload, no header value"
    );
    let expect = |key: &str, value: &str| {
        assert_eq!(attribute(span, key).as_deref(), Some(value), "{key}");
    };
    expect("messaging.system", "rabbitmq");
    expect("messaging.operation.type", "send");
    expect("messaging.operation.name", "publish");
    expect("messaging.destination.name", &broker.exchange);
    expect(
        "messaging.rabbitmq.destination.routing_key",
        "a.order.created",
    );
    expect("messaging.message.id", &child.to_string());
    expect("outbox.tenant_id", "a");
    expect("outbox.kind", "order.created");
    let delay: i64 = attribute(span, "outbox.delay_ms").unwrap().parse().unwrap();
    assert!((0..60_000).contains(&delay), "outbox.delay_ms = {delay}");
    assert!(span.end_time_unix_nano >= span.start_time_unix_nano);
    assert_ne!(
        span.status.as_ref().map(|s| s.code),
        Some(StatusCode::Error as i32)
    );
    // The message names the relay's span; the row's other headers pass.
    let sent = message(child);
    assert_eq!(
        text_header(sent, "traceparent"),
        Some(format!("00-{TRACE_ID}-{}-01", hex(&span.span_id)))
    );
    assert_eq!(text_header(sent, "tracestate").as_deref(), Some("vendor=x"));
    assert_eq!(text_header(sent, "note").as_deref(), Some("kept"));

    // A row without a trace context: the root of a new trace.
    let spans = receiver.of_row(root);
    assert_eq!(spans.len(), 1);
    let span = &spans[0].span;
    assert!(span.parent_span_id.is_empty(), "a root span");
    assert_ne!(hex(&span.trace_id), TRACE_ID);
    assert_eq!(
        text_header(message(root), "traceparent"),
        Some(format!(
            "00-{}-{}-01",
            hex(&span.trace_id),
            hex(&span.span_id)
        ))
    );

    // Not sampled (the parent's decision): no span, and the row's own header.
    assert!(receiver.of_row(not_sampled).is_empty());
    assert_eq!(
        text_header(message(not_sampled), "traceparent"),
        Some(unsampled)
    );
}

#[tokio::test]
async fn a_refused_rows_span_is_an_error_and_its_log_line_names_the_span() {
    let outbox = Outbox::create().await;
    // Nothing is bound for `a.lost`: the broker returns it (unroutable).
    let broker = Broker::create(&["a.ok"]).await;
    let receiver = Receiver::start().await;
    let lost = outbox.insert("a", "lost", "s-1", Some("{}"), None).await;

    let (relay, _addr) = spawn_relay(&traced_env(&outbox, &broker, &receiver.endpoint())).await;
    eventually(
        "the refused row's span exported",
        Duration::from_secs(20),
        || {
            let found = receiver
                .of_row(lost)
                .iter()
                .any(|e| e.span.status.as_ref().map(|s| s.code) == Some(StatusCode::Error as i32));
            async move { found }
        },
    )
    .await;
    let spans = receiver.of_row(lost);
    let refused = &spans[0].span;
    let status = refused.status.as_ref().expect("a status");
    assert_eq!(status.code, StatusCode::Error as i32);
    assert!(
        status.message.starts_with("unroutable: "),
        "the refusal's reason: {:?}",
        status.message
    );
    assert_eq!(refused.kind, SpanKind::Producer as i32);
    assert_eq!(outbox.pending("a").await, 1, "the row stays pending");

    // The relay's JSON line about the refusal carries the span's ids.
    let mut joined = None;
    eventually(
        "a log line under a publish span",
        Duration::from_secs(10),
        || {
            joined = relay.output().lines().find_map(|line| {
                let entry: serde_json::Value = serde_json::from_str(line).ok()?;
                (entry["message"] == "publish refused" && entry["row"] == lost).then_some(entry)
            });
            let found = joined.is_some();
            async move { found }
        },
    )
    .await;
    let line = joined.unwrap();
    assert_eq!(line["reason"], "unroutable");
    let (trace_id, span_id) = (
        line["trace_id"].as_str().expect("trace_id"),
        line["span_id"].as_str().expect("span_id"),
    );
    assert!(
        spans
            .iter()
            .any(|e| hex(&e.span.trace_id) == trace_id && hex(&e.span.span_id) == span_id),
        "the line's trace_id {trace_id} and span_id {span_id} name an exported span of the row"
    );
}

#[tokio::test]
async fn a_replayed_row_has_its_publish_span_and_the_message_names_it() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["a.#"]).await;
    let receiver = Receiver::start().await;
    let traceparent = format!("00-{TRACE_ID}-{PARENT_ID}-01");
    let child = outbox
        .insert(
            "a",
            "order.created",
            "o-1",
            Some("{}"),
            Some(json!({"traceparent": traceparent})),
        )
        .await;
    let root = outbox
        .insert("a", "order.paid", "o-1", Some("{}"), None)
        .await;
    // Published once by a relay that does not trace.
    let (relay, _addr) = spawn_relay(&relay_env(&outbox, &broker, &["a"])).await;
    eventually("both rows published", Duration::from_secs(20), || async {
        outbox.published_ids().await.len() == 2
    })
    .await;
    drop(relay);

    let mut command = relay_command();
    command.envs(traced_env(&outbox, &broker, &receiver.endpoint()));
    command.args(["replay", "--tenant", "a", "--from-id", &child.to_string()]);
    // Off the test's runtime thread: the receiver runs on it.
    let output = tokio::task::spawn_blocking(move || command.output().expect("replay runs"))
        .await
        .expect("joined");
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    eventually("4 messages consumed", Duration::from_secs(20), || {
        let n = broker.count();
        async move { n == 4 }
    })
    .await;
    // The replay flushed its spans as it ended.
    let replayed: Vec<Received> = broker
        .received()
        .into_iter()
        .filter(|m| m.header("outbox-replay") == Some(&AMQPValue::Boolean(true)))
        .collect();
    assert_eq!(replayed.len(), 2);
    for (id, parent) in [(child, Some(PARENT_ID)), (root, None)] {
        let spans = receiver.of_row(id);
        assert_eq!(
            spans.len(),
            1,
            "row {id}: one span, the replay's: {spans:?}"
        );
        let span = &spans[0].span;
        assert_eq!(span.kind, SpanKind::Producer as i32);
        assert_eq!(span.name, format!("publish {}", broker.exchange));
        assert_eq!(
            attribute(span, "messaging.message.id"),
            Some(id.to_string())
        );
        match parent {
            Some(parent) => {
                assert_eq!(hex(&span.trace_id), TRACE_ID);
                assert_eq!(hex(&span.parent_span_id), parent);
            }
            None => assert!(span.parent_span_id.is_empty(), "a root span"),
        }
        let message = replayed.iter().find(|m| m.id == id).expect("replayed");
        assert_eq!(
            text_header(message, "traceparent"),
            Some(format!(
                "00-{}-{}-01",
                hex(&span.trace_id),
                hex(&span.span_id)
            ))
        );
    }
}

#[tokio::test]
async fn a_black_hole_endpoint_drops_spans_counted_and_holds_up_no_row() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["a.#"]).await;
    let hole = black_hole().await;
    let rows = 300;
    outbox.insert_many("a", rows).await;

    let mut env = traced_env(&outbox, &broker, &format!("http://{hole}"));
    set_env(&mut env, "OTEL_BSP_MAX_QUEUE_SIZE", "16");
    set_env(&mut env, "OTEL_EXPORTER_OTLP_TIMEOUT", "30000");
    set_env(&mut env, "OUTBOX_SHUTDOWN_GRACE_MS", "2000");
    let (mut relay, addr) = spawn_relay(&env).await;
    // As fast as without tracing: the export waits on no row.
    // (The queue holds 16 spans and the export in progress 16 more: the
    // rest of the 300 are dropped, and counted.)
    eventually("every row published", Duration::from_secs(20), || {
        let n = broker.count();
        async move { n == rows as usize }
    })
    .await;
    eventually("every row marked", Duration::from_secs(10), || async {
        outbox.pending("a").await == 0
    })
    .await;
    eventually(
        "dropped spans counted",
        Duration::from_secs(10),
        || async move {
            let (_, body) = http_get(addr, "/metrics").await;
            metric(&body, "outbox_trace_spans_dropped_total").unwrap_or(0.0) >= (rows - 32) as f64
        },
    )
    .await;

    // The shutdown flush gives up with the grace period (2 s), not with the
    // exporter's 30 s timeout.
    relay.signal("TERM");
    let started = std::time::Instant::now();
    assert_eq!(relay.wait(Duration::from_secs(10)).await, Some(0));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stopped in {:?}",
        started.elapsed()
    );
}

/// An endpoint that refuses connections: every export fails at once; the
/// relay says so in its log (once, not per export, and without the
/// endpoint's password), counts the spans, and publishes every row.
#[tokio::test]
async fn a_refusing_endpoint_is_logged_once_without_its_password_and_holds_up_no_row() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["a.#"]).await;
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("address")
    };
    let rows = 50;
    outbox.insert_many("a", rows).await;
    let mut env = traced_env(&outbox, &broker, &format!("http://otel:s3cret@{closed}"));
    set_env(&mut env, "OTEL_BSP_SCHEDULE_DELAY", "50");
    let (relay, addr) = spawn_relay(&env).await;
    eventually(
        "every row published and marked",
        Duration::from_secs(20),
        || async { broker.count() == rows as usize && outbox.pending("a").await == 0 },
    )
    .await;
    eventually(
        "the failed exports counted",
        Duration::from_secs(10),
        || async move {
            let (_, body) = http_get(addr, "/metrics").await;
            metric(&body, "outbox_trace_spans_dropped_total").unwrap_or(0.0) >= rows as f64
        },
    )
    .await;
    let failures: Vec<serde_json::Value> = relay
        .output()
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|entry| {
            entry["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("span export failed"))
        })
        .collect();
    assert_eq!(
        failures.len(),
        1,
        "one line for the first failure: {failures:?}"
    );
    assert_eq!(failures[0]["level"], "WARN");
    assert!(failures[0]["dropped"].as_u64().is_some_and(|n| n > 0));
    assert!(
        !relay.output().contains("s3cret"),
        "the endpoint's password is never printed"
    );
}

/// What the flaky collector of the next test saw: requests, and the
/// message ids of the spans it took.
#[derive(Default)]
struct Flaky {
    requests: std::sync::atomic::AtomicUsize,
    taken: Mutex<Vec<String>>,
}

/// Answers its first request 503, then takes every request but says it
/// rejected one span of each (`partial_success`).
async fn flaky(State(flaky): State<Arc<Flaky>>, body: Bytes) -> axum::response::Response {
    use axum::response::IntoResponse;
    use opentelemetry_proto::tonic::collector::trace::v1::{
        ExportTracePartialSuccess, ExportTraceServiceResponse,
    };
    let n = flaky
        .requests
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    if n == 0 {
        return axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf request");
    let mut taken = flaky.taken.lock().unwrap();
    for resource_spans in request.resource_spans {
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                taken.extend(attribute(&span, "messaging.message.id"));
            }
        }
    }
    ExportTraceServiceResponse {
        partial_success: Some(ExportTracePartialSuccess {
            rejected_spans: 1,
            error_message: "too old".into(),
        }),
    }
    .encode_to_vec()
    .into_response()
}

#[tokio::test]
async fn an_export_answered_503_is_sent_again_and_rejected_spans_are_counted() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["a.#"]).await;
    let state: Arc<Flaky> = Arc::default();
    let router = axum::Router::new()
        .route("/v1/traces", post(flaky))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the collector");
    let collector = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let ids = outbox.insert_many("a", 5).await;
    let (relay, addr) = spawn_relay(&traced_env(
        &outbox,
        &broker,
        &format!("http://{collector}"),
    ))
    .await;
    eventually(
        "every row's span taken, the first export's after its 503",
        Duration::from_secs(20),
        || {
            let taken = state.taken.lock().unwrap().clone();
            let all = ids.iter().all(|id| taken.contains(&id.to_string()));
            async move { all }
        },
    )
    .await;
    assert!(state.requests.load(std::sync::atomic::Ordering::SeqCst) >= 2);
    let (_, body) = http_get(addr, "/metrics").await;
    let dropped = metric(&body, "outbox_trace_spans_dropped_total").unwrap_or(0.0);
    assert!(dropped >= 1.0, "the rejected span is counted: {dropped}");
    eventually("the rejection logged", Duration::from_secs(10), || {
        let logged = relay.output().lines().any(|line| {
            serde_json::from_str::<serde_json::Value>(line).is_ok_and(|entry| {
                entry["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("the trace endpoint rejected spans"))
                    && entry["error"] == "too old"
            })
        });
        async move { logged }
    })
    .await;
    eventually("the rows go out as ever", Duration::from_secs(10), || {
        let n = broker.count();
        async move { n == 5 }
    })
    .await;
}

#[tokio::test]
async fn check_config_shows_where_spans_go_and_no_header_value() {
    let output = relay_command()
        .arg("check-config")
        .env("OUTBOX_TENANTS", "a")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
        .env(
            "OTEL_EXPORTER_OTLP_HEADERS",
            "authorization=Bearer%20s3cr3t",
        )
        .output()
        .expect("runs");
    assert!(output.status.success());
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        text.contains("traces: on, OTLP http/protobuf to http://collector:4318/v1/traces"),
        "{text}"
    );
    assert!(text.contains("authorization (values not shown)"), "{text}");
    assert!(!text.contains("s3cr3t"), "{text}");

    let output = relay_command()
        .arg("check-config")
        .env("OUTBOX_TENANTS", "a")
        .output()
        .expect("runs");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("traces: off"), "{text}");
}

#[tokio::test]
async fn an_otel_value_the_relay_cannot_honour_exits_2_naming_the_variable() {
    for (variable, value) in [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector:4318"),
        ("OTEL_TRACES_SAMPLER", "xray"),
    ] {
        let output = relay_command()
            .arg("check-config")
            .env("OUTBOX_TENANTS", "a")
            .env(variable, value)
            .output()
            .expect("runs");
        assert_eq!(output.status.code(), Some(2), "{variable}={value}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(&format!("{variable} (environment)")),
            "{variable}: {stderr}"
        );
    }
}

/// A TCP listener that counts the connections it accepts and holds them:
/// with `trickle`, it answers each one byte every 500 ms (a byte-by-byte
/// collector), else never (a black hole).
async fn counting_listener(trickle: bool) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the listener");
    let addr = listener.local_addr().expect("addr");
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n";
                for byte in answer.iter().filter(|_| trickle) {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    if stream.write_all(&[*byte]).await.is_err() {
                        return;
                    }
                }
                let mut sink = Vec::new();
                let _ = stream.read_to_end(&mut sink).await;
            });
        }
    });
    (addr, accepted)
}

/// What the redirecting endpoint of the next test saw.
#[derive(Default)]
struct Redirecting {
    /// Requests to `/v1/traces` carrying the configured `x-api-key`.
    keyed: AtomicUsize,
    /// Requests to `/moved`, its same-origin `Location`.
    moved: AtomicUsize,
    /// Where its first answer points: another listener.
    other: Mutex<String>,
}

/// Answers its first export 307 to another origin, every later one 308 to
/// a path of its own.
async fn redirecting(
    State(state): State<Arc<Redirecting>>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let n = state.keyed.load(Ordering::SeqCst);
    if headers.get("x-api-key").is_some_and(|v| v == "k3y") {
        state.keyed.fetch_add(1, Ordering::SeqCst);
    }
    let (status, location) = if n == 0 {
        let other = state.other.lock().unwrap().clone();
        (axum::http::StatusCode::TEMPORARY_REDIRECT, other)
    } else {
        let location = "/moved?token=t0k".to_string();
        (axum::http::StatusCode::PERMANENT_REDIRECT, location)
    };
    (status, [(axum::http::header::LOCATION, location)]).into_response()
}

/// An endpoint that redirects: every export is a failure, counted and
/// logged once with the status and the `Location` (no user info, no query),
/// and never followed, to another origin or to its own: the other listener
/// gets no connection, the same-origin path no request, and the
/// `x-api-key` goes nowhere but the endpoint.
#[tokio::test]
async fn a_redirect_is_a_failed_export_never_followed() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["a.#"]).await;
    let (other, other_accepted) = counting_listener(false).await;
    let state = Arc::new(Redirecting {
        other: Mutex::new(format!("http://otel:s3cret@{other}/v1/traces?token=t0k")),
        ..Redirecting::default()
    });
    let router = axum::Router::new()
        .route("/v1/traces", post(redirecting))
        .route(
            "/moved",
            post(|State(state): State<Arc<Redirecting>>| async move {
                state.moved.fetch_add(1, Ordering::SeqCst);
            }),
        )
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the endpoint");
    let endpoint = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let mut env = traced_env(&outbox, &broker, &format!("http://{endpoint}"));
    set_env(&mut env, "OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=k3y");
    let (relay, addr) = spawn_relay(&env).await;
    for round in 1..=2 {
        outbox.insert_many("a", 5).await;
        eventually("an export per round", Duration::from_secs(20), || {
            let keyed = state.keyed.load(Ordering::SeqCst);
            async move { keyed >= round }
        })
        .await;
    }
    eventually("the rows go out as ever", Duration::from_secs(10), || {
        let n = broker.count();
        async move { n == 10 }
    })
    .await;
    eventually("the spans counted", Duration::from_secs(10), || async {
        let (_, body) = http_get(addr, "/metrics").await;
        metric(&body, "outbox_trace_spans_dropped_total").unwrap_or(0.0) >= 10.0
    })
    .await;
    assert_eq!(other_accepted.load(Ordering::SeqCst), 0, "another origin");
    assert_eq!(state.moved.load(Ordering::SeqCst), 0, "the same origin");
    let output = relay.output();
    let failures: Vec<&str> = output
        .lines()
        .filter(|line| line.contains("span export failed"))
        .collect();
    assert_eq!(failures.len(), 1, "at most a line a minute: {failures:?}");
    let expected =
        format!("status 307: redirects are not followed (Location: http://{other}/v1/traces)");
    assert!(failures[0].contains(&expected), "{}", failures[0]);
    for secret in ["s3cret", "t0k", "k3y"] {
        assert!(!output.contains(secret), "{secret} printed:\n{output}");
    }
}

/// Shutdown waits on no collector: with an export in flight to one that
/// accepts and never answers, or answers a byte every 500 ms, and the
/// default 20 s grace and a 30 s export timeout, SIGTERM exits 0 within
/// 2 s, and the abandoned spans are said.
#[tokio::test]
async fn sigterm_exits_within_2_s_whatever_the_collector_does() {
    for trickle in [false, true] {
        let outbox = Outbox::create().await;
        let broker = Broker::create(&["a.#"]).await;
        let (collector, accepted) = counting_listener(trickle).await;
        outbox.insert_many("a", 20).await;
        let mut env = traced_env(&outbox, &broker, &format!("http://{collector}"));
        set_env(&mut env, "OTEL_EXPORTER_OTLP_TIMEOUT", "30000");
        let (mut relay, _) = spawn_relay(&env).await;
        eventually(
            "every row published and marked",
            Duration::from_secs(20),
            || async { broker.count() == 20 && outbox.pending("a").await == 0 },
        )
        .await;
        eventually("an export in flight", Duration::from_secs(10), || {
            let n = accepted.load(Ordering::SeqCst);
            async move { n >= 1 }
        })
        .await;
        relay.signal("TERM");
        let signalled = std::time::Instant::now();
        assert_eq!(relay.wait(Duration::from_secs(30)).await, Some(0));
        let took = signalled.elapsed();
        eprintln!("collector trickle={trickle}: exited {took:?} after SIGTERM");
        assert!(
            took < Duration::from_secs(2),
            "trickle {trickle}: exited {took:?} after SIGTERM"
        );
        // Every row's span: in the abandoned export, or queued behind it.
        let output = relay.output();
        let abandoned: Vec<serde_json::Value> = lines_at(&output, "WARN")
            .into_iter()
            .filter(|line| line.contains("did not take the last spans in time"))
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect();
        assert_eq!(abandoned.len(), 1, "{output}");
        assert_eq!(abandoned[0]["dropped"], 20, "{output}");
    }
}
