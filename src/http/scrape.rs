//! `/metrics`: scrapes take turns, and share renders, which run off the
//! sweeping thread.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use axum::Extension;
use axum::extract::{ConnectInfo, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};

use super::Endpoints;
use crate::metrics::Metrics;

/// The metrics, gzip-compressed when the client accepts it (Prometheus
/// does): 10,000 tenants' series are megabytes as text.
pub(super) async fn metrics(
    State(Endpoints { relay, renders, .. }): State<Endpoints>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    headers: axum::http::HeaderMap,
) -> Response {
    let content_type = (
        header::CONTENT_TYPE,
        "text/plain; version=0.0.4; charset=utf-8",
    );
    let gzip = accepts_gzip(&headers);
    // Served in process (a test's router), there is no peer: all one.
    let peer = peer.map_or(
        IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        |Extension(ConnectInfo(peer))| peer.ip(),
    );
    renders.turn(peer).await;
    let Some(body) = renders.body(&relay.metrics, gzip).await else {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            "the metrics could not be rendered\n",
        )
            .into_response();
    };
    if gzip {
        ([content_type, (header::CONTENT_ENCODING, "gzip")], body).into_response()
    } else {
        ([content_type], body).into_response()
    }
}

/// The longest a render's body answers the scrapes that come after it:
/// well within the contract's 1 s.
pub const SCRAPE_REUSE_MAX: Duration = Duration::from_millis(250);

/// A render's body answers the scrapes within this many times its own
/// duration of its start (at most [`SCRAPE_REUSE_MAX`]): scrapers back to
/// back then spend at most about a tenth of a core rendering, and a small
/// relay's body (well under a millisecond to render) is reused for a few
/// milliseconds at most.
const SCRAPE_REUSE_RENDERS: u32 = 10;

/// One round of rendering: when it started, and the body with how long it
/// took (none if the render failed).
type Render = (
    tokio::time::Instant,
    Shared<BoxFuture<'static, Option<(Bytes, Duration)>>>,
);

/// The `/metrics` renders, off the sweeping thread and coalesced. With
/// 10,000 tenants a render is milliseconds of CPU and a megabyte of text:
/// it runs on a blocking thread (the relay sweeps on one thread, which a
/// render must not hold), one at a time per encoding; a scrape that arrives
/// while one runs shares it, and so does one that arrives shortly after
/// (see [`SCRAPE_REUSE_RENDERS`]). A body is never older than its scrape by
/// more than [`SCRAPE_REUSE_MAX`] plus one render, and however many
/// scrapers ask, the relay renders at most two bodies (text and gzip) at a
/// time.
#[derive(Default)]
pub(super) struct Renders {
    text: Mutex<Option<Render>>,
    gzip: Mutex<Option<Render>>,
    /// When each peer's next scrape may be answered (see [`SCRAPE_EVERY`]).
    next: Mutex<HashMap<IpAddr, tokio::time::Instant>>,
}

/// Each peer address's scrapes are answered at most this often: one that
/// comes sooner waits its turn. A body served from a render that was shared
/// costs little, but scrapers back to back would ask for thousands a second,
/// and on a small machine that CPU is taken from delivery. A Prometheus
/// scrapes every few seconds and never notices. The turns are per peer, so
/// that a client flooding `/metrics` (hundreds of connections asking
/// without pause) queues behind itself, never in front of another address's
/// scrape.
pub const SCRAPE_EVERY: Duration = Duration::from_millis(50);

/// Past this many peers remembered, those whose turn has come are
/// forgotten (the connection cap bounds the rest).
const PEERS_KEPT: usize = 64;

impl Renders {
    /// Waits for this scrape's turn among `peer`'s (see [`SCRAPE_EVERY`]).
    async fn turn(&self, peer: IpAddr) {
        let at = {
            let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
            let now = tokio::time::Instant::now();
            if next.len() >= PEERS_KEPT {
                next.retain(|_, at| *at > now);
            }
            let at = next.get(&peer).map_or(now, |next| (*next).max(now));
            next.insert(peer, at + SCRAPE_EVERY);
            at
        };
        tokio::time::sleep_until(at).await;
    }

    async fn body(&self, metrics: &Metrics, gzip: bool) -> Option<Bytes> {
        let current = if gzip { &self.gzip } else { &self.text };
        let round = {
            let mut current = current.lock().unwrap_or_else(PoisonError::into_inner);
            match current.as_ref() {
                Some((started, round)) if Renders::shared(*started, round.peek()) => round.clone(),
                _ => {
                    let metrics = metrics.clone();
                    let task = tokio::task::spawn_blocking(move || {
                        let started = std::time::Instant::now();
                        let body = if gzip {
                            Bytes::from(metrics.render_gzip())
                        } else {
                            Bytes::from(metrics.render())
                        };
                        (body, started.elapsed())
                    });
                    let round = async move {
                        task.await
                            .inspect_err(|error| {
                                tracing::error!(%error, "rendering the metrics failed");
                            })
                            .ok()
                    }
                    .boxed()
                    .shared();
                    *current = Some((tokio::time::Instant::now(), round.clone()));
                    round
                }
            }
        };
        round.await.map(|(body, _)| body)
    }

    /// Whether a scrape now shares the round that started at `started`:
    /// it is still running, or ended and is recent for what it cost.
    fn shared(started: tokio::time::Instant, ended: Option<&Option<(Bytes, Duration)>>) -> bool {
        match ended {
            None => true,
            Some(Some((_, took))) => {
                started.elapsed()
                    <= took
                        .saturating_mul(SCRAPE_REUSE_RENDERS)
                        .min(SCRAPE_REUSE_MAX)
            }
            Some(None) => false,
        }
    }
}

/// Whether `Accept-Encoding` lists gzip (and does not refuse it with q=0).
fn accepts_gzip(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|item| {
            let mut parts = item.split(';').map(str::trim);
            let coding = parts.next().unwrap_or("");
            let refused = parts.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.parse::<f32>().ok())
                    .is_some_and(|q| q == 0.0)
            });
            (coding.eq_ignore_ascii_case("gzip") || coding == "*") && !refused
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_render_is_shared_while_it_runs_and_briefly_after_for_what_it_cost() {
        let ago = |ms: u64| {
            tokio::time::Instant::now()
                .checked_sub(Duration::from_millis(ms))
                .unwrap()
        };
        let body = |ms: u64| Some((Bytes::new(), Duration::from_millis(ms)));
        assert!(Renders::shared(ago(0), None), "running: shared");
        assert!(
            Renders::shared(ago(15), Some(&body(2))),
            "within 10 renders"
        );
        assert!(!Renders::shared(ago(15), Some(&body(1))), "past 10 renders");
        assert!(
            !Renders::shared(ago(0), Some(&None)),
            "a failed render is not"
        );
        assert!(
            !Renders::shared(ago(251), Some(&body(1_000))),
            "never past SCRAPE_REUSE_MAX"
        );
    }

    #[tokio::test]
    async fn scrapes_take_turns_at_most_one_per_scrape_every() {
        let renders = Renders::default();
        let started = tokio::time::Instant::now();
        let mut answered = Vec::new();
        let one = IpAddr::from([10, 0, 0, 1]);
        for _ in 0..4 {
            renders.turn(one).await;
            answered.push(started.elapsed());
        }
        // A timer never fires early: the k-th turn comes k × SCRAPE_EVERY
        // or more after the first was asked for.
        for (k, answered_after) in answered.iter().enumerate() {
            assert!(*answered_after >= SCRAPE_EVERY * k as u32, "{answered:?}");
        }
        // After a pause the next one has its turn at once: it waits for no
        // sleep (the turn is now or already past).
        tokio::time::sleep(SCRAPE_EVERY * 2).await;
        let next = renders.next.lock().unwrap().get(&one).copied();
        assert!(next.is_some_and(|next| next <= tokio::time::Instant::now()));
    }

    #[tokio::test]
    async fn a_peer_flooding_scrapes_queues_behind_itself_only() {
        let renders = Renders::default();
        let (flood, other) = (IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2]));
        // 100 turns taken by one peer: its next is 5 s away.
        for _ in 0..100 {
            let _ = renders.turn(flood).now_or_never();
        }
        let started = tokio::time::Instant::now();
        renders.turn(other).await;
        assert!(
            started.elapsed() < SCRAPE_EVERY,
            "another peer's scrape has its turn at once: {:?}",
            started.elapsed()
        );
    }

    #[test]
    fn gzip_is_used_when_the_client_accepts_it() {
        let headers = |value: &str| {
            let mut map = axum::http::HeaderMap::new();
            map.insert(header::ACCEPT_ENCODING, value.parse().unwrap());
            map
        };
        assert!(accepts_gzip(&headers("gzip")));
        assert!(accepts_gzip(&headers("deflate, GZIP;q=0.5")));
        assert!(accepts_gzip(&headers("*")));
        assert!(!accepts_gzip(&headers("gzip;q=0")));
        assert!(!accepts_gzip(&headers("identity")));
        assert!(!accepts_gzip(&axum::http::HeaderMap::new()));
    }
}
