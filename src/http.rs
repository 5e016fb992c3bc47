//! The operator's endpoints on `http_addr`: `/healthz` (lag, from the
//! database), `/livez` (the scheduler turns), `/readyz` (database and broker
//! connected) and `/metrics`. Liveness, readiness and lag are three different
//! questions: a lagging relay is neither dead nor unready.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;

use crate::relay::Relay;

/// The scheduler turns at least once per poll interval; a heartbeat older than
/// this many intervals (plus a margin for a slow machine) means it is stuck.
const LIVENESS_POLLS: u32 = 5;
const LIVENESS_MARGIN: Duration = Duration::from_secs(30);

/// The router, for `axum::serve` or an in-process test.
pub fn router(relay: Arc<Relay>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(relay)
}

#[derive(Debug, Serialize)]
struct Health {
    status: &'static str,
    max_lag_ms: u64,
    tenants: Vec<TenantHealth>,
    error: Option<String>,
}

#[derive(Debug, Serialize)]
struct TenantHealth {
    tenant: String,
    lag_ms: i64,
    pending: bool,
}

/// Each configured tenant's lag, as the gauge reports it: the database's
/// measure of its oldest pending row, or how long the poll has seen that row
/// waiting, whichever is longer (see `lag`).
async fn healthz(State(relay): State<Arc<Relay>>) -> Response {
    let max_lag_ms = relay.config.max_lag_ms;
    match relay.store.tenant_lag(&relay.config.tenants).await {
        Ok(lags) => {
            let now = tokio::time::Instant::now();
            let lags: Vec<TenantHealth> = lags
                .into_iter()
                .map(|t| TenantHealth {
                    lag_ms: relay.lag.lag_ms(&t.tenant, t.oldest_id, t.lag_ms, now),
                    pending: t.oldest_id.is_some(),
                    tenant: t.tenant,
                })
                .collect();
            let lagging = lags
                .iter()
                .any(|t| u64::try_from(t.lag_ms).unwrap_or(0) > max_lag_ms);
            let body = Health {
                status: if lagging { "lagging" } else { "ok" },
                max_lag_ms,
                tenants: lags,
                error: None,
            };
            let code = if lagging {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::OK
            };
            (code, Json(body)).into_response()
        }
        Err(error) => {
            let body = Health {
                status: "error",
                max_lag_ms,
                tenants: Vec::new(),
                error: Some(error.to_string()),
            };
            (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
        }
    }
}

async fn livez(State(relay): State<Arc<Relay>>) -> Response {
    let limit = relay.config.poll_interval() * LIVENESS_POLLS + LIVENESS_MARGIN;
    let age = relay.heartbeat_age();
    if age <= limit {
        (StatusCode::OK, "alive\n").into_response()
    } else {
        let text = format!("scheduler stuck: last turn {} ms ago\n", age.as_millis());
        (StatusCode::SERVICE_UNAVAILABLE, text).into_response()
    }
}

#[derive(Debug, Serialize)]
struct Readiness {
    ready: bool,
    database: bool,
    broker: bool,
}

async fn readyz(State(relay): State<Arc<Relay>>) -> Response {
    let database = relay.metrics.database_is_up();
    let broker = relay.publisher.is_ready();
    let ready = database && broker;
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        code,
        Json(Readiness {
            ready,
            database,
            broker,
        }),
    )
        .into_response()
}

async fn metrics(State(relay): State<Arc<Relay>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        relay.metrics.render(),
    )
        .into_response()
}
