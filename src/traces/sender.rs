//! The OTLP/HTTP sender: each batch's request (see `otlp`) is POSTed to the
//! endpoint by a blocking client, on the export thread (see `export`), never
//! the relay's runtime.
//!
//! A batch is tried again, as the OTLP specification recommends, when the
//! endpoint could not be reached or answered 429, 502, 503 or 504: at most
//! [`RETRIES`] more times, after 100 ms, then twice as long each time (up to
//! 1.6 s, or what its `Retry-After` asks), with up to 100 ms of jitter, and
//! never past the export timeout counted from the first try. Spans the
//! endpoint answers that it rejected (`partial_success`) are reported too.
//!
//! A redirect (any 3xx) is a failed export, never followed: a client that
//! followed it would send the batch, and the `OTEL_EXPORTER_OTLP_HEADERS`
//! values (an API key), wherever the `Location` pointed.

use std::hash::{BuildHasher, RandomState};
use std::io::Read;
use std::time::{Duration, Instant};

use reqwest::blocking::Client;
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, LOCATION, RETRY_AFTER};

use super::otlp::{self, Rejected};
use super::settings::Export;

/// Tries after the first, for a batch the endpoint may take later.
const RETRIES: u32 = 3;
const FIRST_DELAY: Duration = Duration::from_millis(100);
const MAX_DELAY: Duration = Duration::from_millis(1600);
const MAX_JITTER_MS: u64 = 100;
/// The most of an answer read: an endpoint's answer is a few bytes.
const MAX_ANSWER: u64 = 64 * 1024;

/// Why the exporter could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("header {0:?} cannot be sent")]
    Header(String),
    #[error("the endpoint is not a URL: {0}")]
    Endpoint(String),
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("cannot start the export thread: {0}")]
    Thread(std::io::Error),
}

/// Sends batches of spans to one OTLP/HTTP endpoint.
#[derive(Debug)]
pub struct OtlpHttp {
    client: Client,
    endpoint: reqwest::Url,
    headers: HeaderMap,
    timeout: Duration,
}

impl OtlpHttp {
    /// Built outside any Tokio runtime: the blocking client owns one.
    pub fn new(export: &Export) -> Result<OtlpHttp, BuildError> {
        let mut headers = HeaderMap::new();
        for (name, value) in &export.headers {
            let header = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| BuildError::Header(name.clone()))?;
            let mut value =
                HeaderValue::from_str(value).map_err(|_| BuildError::Header(name.clone()))?;
            value.set_sensitive(true);
            headers.insert(header, value);
        }
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/x-protobuf"),
        );
        let endpoint = reqwest::Url::parse(&export.endpoint)
            .map_err(|error| BuildError::Endpoint(error.to_string()))?;
        let client = Client::builder()
            .timeout(export.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(1)
            .build()?;
        Ok(OtlpHttp {
            client,
            endpoint,
            headers,
            timeout: export.timeout,
        })
    }

    /// POSTs `body`, trying again as the module says; what the endpoint
    /// rejected of it, if anything.
    pub fn post(&self, body: Vec<u8>) -> Result<Option<Rejected>, String> {
        let body = bytes::Bytes::from(body);
        let deadline = Instant::now() + self.timeout;
        let mut delay = FIRST_DELAY;
        let mut tries = 0;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "HTTP export timed out after {} ms",
                    self.timeout.as_millis()
                ));
            }
            let failure = match self.try_once(body.clone(), left) {
                Ok(rejected) => return Ok(rejected),
                Err(failure) => failure,
            };
            tries += 1;
            let wait = match failure.retry_after(delay) {
                Some(wait) if tries <= RETRIES => wait + jitter(),
                _ => return Err(failure.message),
            };
            if Instant::now() + wait >= deadline {
                return Err(failure.message);
            }
            std::thread::sleep(wait);
            delay = (delay * 2).min(MAX_DELAY);
        }
    }

    fn try_once(&self, body: bytes::Bytes, left: Duration) -> Result<Option<Rejected>, Failure> {
        let response = self
            .client
            .post(self.endpoint.clone())
            .headers(self.headers.clone())
            .timeout(left)
            .body(body)
            .send()
            .map_err(|error| Failure {
                status: None,
                retry_after: None,
                // The URL without the query, which may hold a token.
                message: format!("HTTP export failed: {}", error.without_url()),
            })?;
        let status = response.status();
        if !status.is_success() {
            let retry_after = response
                .headers()
                .get(RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs);
            let mut message = format!("HTTP export failed with status {}", status.as_u16());
            if status.is_redirection() {
                let location = response
                    .headers()
                    .get(LOCATION)
                    .and_then(|v| v.to_str().ok());
                message += &format!(
                    ": redirects are not followed (Location: {}); set the endpoint itself",
                    shown_location(&self.endpoint, location)
                );
            }
            return Err(Failure {
                status: Some(status.as_u16()),
                retry_after,
                message,
            });
        }
        let mut answer = Vec::new();
        let _ = response.take(MAX_ANSWER).read_to_end(&mut answer);
        Ok(otlp::rejected(&answer))
    }
}

/// The most of a redirect's `Location` shown.
const MAX_LOCATION_SHOWN: usize = 200;

/// A redirect's `Location`, resolved against the endpoint, without its user
/// info, query and fragment (which may hold credentials), and cut at
/// [`MAX_LOCATION_SHOWN`] characters.
fn shown_location(endpoint: &reqwest::Url, location: Option<&str>) -> String {
    let Some(mut url) = location.and_then(|l| endpoint.join(l).ok()) else {
        return "none".to_string();
    };
    let _ = url.set_username("");
    let _ = url.set_password(None);
    url.set_query(None);
    url.set_fragment(None);
    url.as_str().chars().take(MAX_LOCATION_SHOWN).collect()
}

/// One failed try.
#[derive(Debug)]
struct Failure {
    /// `None`: no answer (the endpoint could not be reached, or timed out).
    status: Option<u16>,
    retry_after: Option<Duration>,
    message: String,
}

impl Failure {
    /// How long to wait before the next try, when one may help: `None` for
    /// an answer that will not change (400, 401, 404…).
    fn retry_after(&self, delay: Duration) -> Option<Duration> {
        match self.status {
            None | Some(502 | 504) => Some(delay),
            Some(429 | 503) => Some(self.retry_after.map_or(delay, |asked| asked.max(delay))),
            Some(_) => None,
        }
    }
}

/// Up to [`MAX_JITTER_MS`], so that replicas do not retry in step.
fn jitter() -> Duration {
    Duration::from_millis(RandomState::new().hash_one(Instant::now()) % (MAX_JITTER_MS + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(status: Option<u16>, retry_after: Option<u64>) -> Failure {
        Failure {
            status,
            retry_after: retry_after.map(Duration::from_secs),
            message: String::new(),
        }
    }

    #[test]
    fn only_what_may_pass_later_is_tried_again() {
        let delay = Duration::from_millis(200);
        assert_eq!(failure(None, None).retry_after(delay), Some(delay));
        assert_eq!(failure(Some(502), None).retry_after(delay), Some(delay));
        assert_eq!(failure(Some(504), None).retry_after(delay), Some(delay));
        assert_eq!(failure(Some(503), None).retry_after(delay), Some(delay));
        assert_eq!(
            failure(Some(429), Some(2)).retry_after(delay),
            Some(Duration::from_secs(2))
        );
        for status in [300, 301, 302, 303, 307, 308, 400, 401, 403, 404, 413, 500] {
            assert_eq!(failure(Some(status), None).retry_after(delay), None);
        }
    }

    #[test]
    fn a_redirects_location_is_shown_without_user_info_query_or_fragment() {
        let endpoint = reqwest::Url::parse("http://collector:4318/v1/traces?k=1").unwrap();
        let shown = |location| shown_location(&endpoint, location);
        assert_eq!(
            shown(Some("https://u:pa55@other:443/v1/traces?token=t0k#f")),
            "https://other/v1/traces"
        );
        assert_eq!(
            shown(Some("/elsewhere?token=t0k")),
            "http://collector:4318/elsewhere"
        );
        assert_eq!(shown(None), "none");
        let long = format!("/{}", "p".repeat(1000));
        assert_eq!(shown(Some(&long)).len(), MAX_LOCATION_SHOWN);
    }

    #[test]
    fn jitter_stays_within_its_bound() {
        for _ in 0..100 {
            assert!(jitter() <= Duration::from_millis(MAX_JITTER_MS));
        }
    }
}
