//! The standard `OTEL_*` variables, read and checked once, before anything
//! is built: with no endpoint there is no exporter at all (the SDK alone
//! would send to `localhost:4318`), and a value the relay cannot honour
//! stops it (exit 2) naming the variable. Header values are kept for the
//! exporter only: they are never printed, not even in an error.

use std::fmt;
use std::time::Duration;

use percent_encoding::percent_decode_str;

use crate::redact::redact_endpoint;

pub const ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
pub const TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
pub const PROTOCOL: &str = "OTEL_EXPORTER_OTLP_PROTOCOL";
pub const TRACES_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL";
pub const HEADERS: &str = "OTEL_EXPORTER_OTLP_HEADERS";
pub const TRACES_HEADERS: &str = "OTEL_EXPORTER_OTLP_TRACES_HEADERS";
pub const TIMEOUT: &str = "OTEL_EXPORTER_OTLP_TIMEOUT";
pub const TRACES_TIMEOUT: &str = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT";
pub const SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
pub const RESOURCE_ATTRIBUTES: &str = "OTEL_RESOURCE_ATTRIBUTES";
pub const SAMPLER: &str = "OTEL_TRACES_SAMPLER";
pub const SAMPLER_ARG: &str = "OTEL_TRACES_SAMPLER_ARG";
pub const SCHEDULE_DELAY: &str = "OTEL_BSP_SCHEDULE_DELAY";
pub const MAX_QUEUE_SIZE: &str = "OTEL_BSP_MAX_QUEUE_SIZE";
pub const SDK_DISABLED: &str = "OTEL_SDK_DISABLED";
pub const TRACES_EXPORTER: &str = "OTEL_TRACES_EXPORTER";

/// The only protocol the relay speaks.
pub const HTTP_PROTOBUF: &str = "http/protobuf";
/// The path added to `OTEL_EXPORTER_OTLP_ENDPOINT` (the signal's own
/// variable is used as it is).
const TRACES_PATH: &str = "v1/traces";
/// The service name when neither `OTEL_SERVICE_NAME` nor a `service.name`
/// resource attribute says one.
pub const DEFAULT_SERVICE_NAME: &str = "outbox-relay";
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_SCHEDULE_DELAY: Duration = Duration::from_secs(5);
const DEFAULT_MAX_QUEUE_SIZE: usize = 2048;
/// Spans per export request (the SDK's default, capped by the queue).
pub const MAX_EXPORT_BATCH: usize = 512;

/// A variable whose value the relay cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{variable} (environment): {problem}")]
pub struct SettingsError {
    pub variable: &'static str,
    /// What is wrong and what is allowed; never a header's value.
    pub problem: String,
}

fn error(variable: &'static str, problem: impl Into<String>) -> SettingsError {
    SettingsError {
        variable,
        problem: problem.into(),
    }
}

/// Which spans are recorded and exported (`OTEL_TRACES_SAMPLER[_ARG]`).
#[derive(Debug, Clone, PartialEq)]
pub enum Sampling {
    AlwaysOn,
    AlwaysOff,
    /// This share of trace ids, 0 to 1.
    Ratio(f64),
    /// The parent's decision when the row has a trace context, this otherwise.
    ParentBased(Box<Sampling>),
}

impl Sampling {
    /// Whether a span of `trace_id` is recorded and exported, as the
    /// OpenTelemetry samplers of these names decide: a parent-based one
    /// follows the parent's sampled flag when there is a parent (remote, the
    /// row's `traceparent`); a ratio keeps the trace ids whose lower 63 bits
    /// fall under `ratio × 2^63`, so that every service of a trace decides
    /// alike.
    pub fn samples(&self, parent_sampled: Option<bool>, trace_id: u128) -> bool {
        match self {
            Sampling::AlwaysOn => true,
            Sampling::AlwaysOff => false,
            Sampling::Ratio(ratio) => {
                if *ratio >= 1.0 {
                    return true;
                }
                let bound = (ratio.max(0.0) * (1u64 << 63) as f64) as u64;
                ((trace_id as u64) >> 1) < bound
            }
            Sampling::ParentBased(root) => match parent_sampled {
                Some(sampled) => sampled,
                None => root.samples(None, trace_id),
            },
        }
    }
}

impl fmt::Display for Sampling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Sampling::AlwaysOn => f.write_str("always_on"),
            Sampling::AlwaysOff => f.write_str("always_off"),
            Sampling::Ratio(ratio) => write!(f, "traceidratio {ratio}"),
            Sampling::ParentBased(root) => write!(f, "parentbased_{root}"),
        }
    }
}

/// Where and how spans are exported: there is an endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Export {
    /// The full URL spans are POSTed to.
    pub endpoint: String,
    /// The variable it came from.
    pub endpoint_from: &'static str,
    /// Extra request headers (names and values: values never printed).
    pub headers: Vec<(String, String)>,
    pub timeout: Duration,
    pub service_name: String,
    /// `OTEL_RESOURCE_ATTRIBUTES`, `service.name` left out (see `service_name`).
    pub resource: Vec<(String, String)>,
    pub sampling: Sampling,
    pub schedule_delay: Duration,
    pub max_queue_size: usize,
}

/// Whether traces are exported, from the process environment.
#[derive(Debug, Clone, PartialEq)]
pub enum Settings {
    /// Tracing is off: nothing is built, nothing costs. Says why.
    Off(&'static str),
    On(Export),
}

impl Settings {
    /// Reads the process environment.
    pub fn from_env() -> Result<Settings, SettingsError> {
        Settings::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads the variables through `get` (an empty value counts as unset).
    /// Every variable set is checked, whether tracing is on or not.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Settings, SettingsError> {
        let get = |name: &str| {
            get(name)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let disabled = match get(SDK_DISABLED).map(|v| v.to_ascii_lowercase()).as_deref() {
            None | Some("false") => false,
            Some("true") => true,
            Some(_) => return Err(error(SDK_DISABLED, "must be true or false")),
        };
        let exporter_none = match get(TRACES_EXPORTER)
            .map(|v| v.to_ascii_lowercase())
            .as_deref()
        {
            None | Some("otlp") => false,
            Some("none") => true,
            Some(other) => {
                return Err(error(
                    TRACES_EXPORTER,
                    format!("is {other:?}: only otlp (the default) and none are supported"),
                ));
            }
        };
        for variable in [PROTOCOL, TRACES_PROTOCOL] {
            if let Some(protocol) = get(variable)
                && protocol != HTTP_PROTOBUF
            {
                return Err(error(
                    variable,
                    format!("is {protocol:?}: only {HTTP_PROTOBUF} is supported"),
                ));
            }
        }
        let endpoint = match (get(TRACES_ENDPOINT), get(ENDPOINT)) {
            (Some(url), _) => Some((check_endpoint(TRACES_ENDPOINT, &url)?, TRACES_ENDPOINT)),
            (None, Some(base)) => Some((traces_url(&check_endpoint(ENDPOINT, &base)?), ENDPOINT)),
            (None, None) => None,
        };
        let (headers, timeout) = request_settings(&get)?;
        let mut resource = match get(RESOURCE_ATTRIBUTES) {
            Some(text) => parse_pairs(RESOURCE_ATTRIBUTES, &text, Pair::Attribute)?,
            None => Vec::new(),
        };
        let named = resource
            .iter()
            .rev()
            .find(|(key, _)| key == "service.name")
            .map(|(_, value)| value.clone());
        resource.retain(|(key, _)| key != "service.name");
        let service_name = get(SERVICE_NAME)
            .or(named)
            .unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_string());
        let sampling = sampling(get(SAMPLER).as_deref(), get(SAMPLER_ARG).as_deref())?;
        let schedule_delay = match get(SCHEDULE_DELAY) {
            Some(text) => Duration::from_millis(positive(SCHEDULE_DELAY, &text)?),
            None => DEFAULT_SCHEDULE_DELAY,
        };
        let max_queue_size = match get(MAX_QUEUE_SIZE) {
            Some(text) => usize::try_from(positive(MAX_QUEUE_SIZE, &text)?)
                .map_err(|_| error(MAX_QUEUE_SIZE, "is too large"))?,
            None => DEFAULT_MAX_QUEUE_SIZE,
        };
        if disabled {
            return Ok(Settings::Off("OTEL_SDK_DISABLED=true"));
        }
        if exporter_none {
            return Ok(Settings::Off("OTEL_TRACES_EXPORTER=none"));
        }
        let Some((endpoint, endpoint_from)) = endpoint else {
            return Ok(Settings::Off(
                "neither OTEL_EXPORTER_OTLP_ENDPOINT nor OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set",
            ));
        };
        Ok(Settings::On(Export {
            endpoint,
            endpoint_from,
            headers,
            timeout,
            service_name,
            resource,
            sampling,
            schedule_delay,
            max_queue_size,
        }))
    }

    /// What `check-config` shows: on or off (and why), where spans go, the
    /// names of the extra headers (never their values).
    pub fn render(&self) -> String {
        match self {
            Settings::Off(why) => format!("# traces: off ({why})\n"),
            Settings::On(export) => {
                let names: Vec<&str> = export.headers.iter().map(|(n, _)| n.as_str()).collect();
                format!(
                    "# traces: on, OTLP http/protobuf to {}  # {}\n\
                     #   headers: {}; timeout {} ms; service.name {:?}; sampler {}; \
                     batch every {} ms, queue of {} spans\n",
                    redact_endpoint(&export.endpoint),
                    export.endpoint_from,
                    if names.is_empty() {
                        "none".to_string()
                    } else {
                        format!("{} (values not shown)", names.join(", "))
                    },
                    export.timeout.as_millis(),
                    export.service_name,
                    export.sampling,
                    export.schedule_delay.as_millis(),
                    export.max_queue_size,
                )
            }
        }
    }
}

/// The export request's extra headers and timeout. The signal's own
/// variable wins over the generic one, as for the endpoint; both are
/// checked when set.
fn request_settings(
    get: &impl Fn(&str) -> Option<String>,
) -> Result<(Vec<(String, String)>, Duration), SettingsError> {
    let mut headers = Vec::new();
    for variable in [HEADERS, TRACES_HEADERS] {
        if let Some(text) = get(variable) {
            headers = parse_pairs(variable, &text, Pair::Header)?;
        }
    }
    let mut timeout = DEFAULT_TIMEOUT;
    for variable in [TIMEOUT, TRACES_TIMEOUT] {
        if let Some(text) = get(variable) {
            timeout = Duration::from_millis(positive(variable, &text)?);
        }
    }
    Ok((headers, timeout))
}

/// An endpoint URL the exporter can reach: `http://` only (the relay's HTTP
/// client carries no TLS; send to a collector beside it).
fn check_endpoint(variable: &'static str, url: &str) -> Result<String, SettingsError> {
    let parsed = url::Url::parse(url).map_err(|e| {
        error(
            variable,
            format!("is not a URL ({e}): expected http://host:port"),
        )
    })?;
    match parsed.scheme() {
        "http" if parsed.host_str().is_some() => Ok(url.to_string()),
        "https" => Err(error(
            variable,
            format!(
                "{}: https is not supported; export over http to a collector beside the relay",
                redact_endpoint(url)
            ),
        )),
        _ => Err(error(
            variable,
            format!("{}: expected http://host:port", redact_endpoint(url)),
        )),
    }
}

/// The generic endpoint `base` (checked) with the traces path added to its
/// path, before any query: `http://h:4318/x?token=t` sends to
/// `http://h:4318/x/v1/traces?token=t`.
fn traces_url(base: &str) -> String {
    let mut url = url::Url::parse(base).expect("a checked endpoint parses");
    let path = format!("{}/{TRACES_PATH}", url.path().trim_end_matches('/'));
    url.set_path(&path);
    url.to_string()
}

fn positive(variable: &'static str, text: &str) -> Result<u64, SettingsError> {
    match text.parse::<u64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(error(
            variable,
            format!("is {text:?}: expected a whole number of milliseconds (or items) above 0"),
        )),
    }
}

/// What a list of `key=value` pairs holds.
#[derive(Clone, Copy, PartialEq)]
enum Pair {
    /// Values are secrets: never quoted.
    Header,
    Attribute,
}

/// `key1=value1,key2=value2`, values percent-decoded (the W3C Baggage form
/// the specification names).
fn parse_pairs(
    variable: &'static str,
    text: &str,
    pair: Pair,
) -> Result<Vec<(String, String)>, SettingsError> {
    let mut pairs = Vec::new();
    for (n, item) in text.split(',').enumerate() {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        let Some((key, value)) = item.split_once('=') else {
            return Err(error(
                variable,
                format!("entry {} has no '=': expected key=value,key=value", n + 1),
            ));
        };
        let key = key.trim();
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(error(
                variable,
                format!("entry {} has a key that is not a token", n + 1),
            ));
        }
        let value = percent_decode_str(value.trim())
            .decode_utf8()
            .map_err(|_| {
                error(
                    variable,
                    format!("the value of {key} is not UTF-8 once percent-decoded"),
                )
            })?
            .into_owned();
        if pair == Pair::Header && reqwest::header::HeaderName::from_bytes(key.as_bytes()).is_err()
        {
            return Err(error(
                variable,
                format!("entry {} has a key that is not an HTTP header name", n + 1),
            ));
        }
        if pair == Pair::Header && value.bytes().any(|b| b.is_ascii_control()) {
            return Err(error(
                variable,
                format!("the value of {key} holds a control character"),
            ));
        }
        pairs.push((key.to_string(), value));
    }
    Ok(pairs)
}

fn sampling(name: Option<&str>, arg: Option<&str>) -> Result<Sampling, SettingsError> {
    let ratio = || -> Result<f64, SettingsError> {
        match arg {
            None => Ok(1.0),
            Some(text) => match text.parse::<f64>() {
                Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
                _ => Err(error(
                    SAMPLER_ARG,
                    format!("is {text:?}: expected a ratio from 0 to 1"),
                )),
            },
        }
    };
    let parent_based = |root| Sampling::ParentBased(Box::new(root));
    Ok(match name.unwrap_or("parentbased_always_on") {
        "always_on" => Sampling::AlwaysOn,
        "always_off" => Sampling::AlwaysOff,
        "traceidratio" => Sampling::Ratio(ratio()?),
        "parentbased_always_on" => parent_based(Sampling::AlwaysOn),
        "parentbased_always_off" => parent_based(Sampling::AlwaysOff),
        "parentbased_traceidratio" => parent_based(Sampling::Ratio(ratio()?)),
        other => {
            return Err(error(
                SAMPLER,
                format!(
                    "is {other:?}: expected always_on, always_off, traceidratio, \
                     parentbased_always_on (the default), parentbased_always_off or \
                     parentbased_traceidratio"
                ),
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn read(vars: &[(&str, &str)]) -> Result<Settings, SettingsError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Settings::from_vars(|name| vars.get(name).cloned())
    }

    fn on(vars: &[(&str, &str)]) -> Export {
        match read(vars) {
            Ok(Settings::On(export)) => export,
            other => panic!("expected tracing on, got {other:?}"),
        }
    }

    #[test]
    fn no_endpoint_is_off_whatever_else_is_set() {
        assert!(matches!(read(&[]), Ok(Settings::Off(_))));
        assert!(matches!(
            read(&[(SERVICE_NAME, "x"), (SAMPLER, "always_on")]),
            Ok(Settings::Off(_))
        ));
        assert!(matches!(read(&[(ENDPOINT, "  ")]), Ok(Settings::Off(_))));
    }

    #[test]
    fn disabled_and_none_turn_it_off() {
        let endpoint = (ENDPOINT, "http://collector:4318");
        assert_eq!(
            read(&[endpoint, (SDK_DISABLED, "true")]),
            Ok(Settings::Off("OTEL_SDK_DISABLED=true"))
        );
        assert_eq!(
            read(&[endpoint, (TRACES_EXPORTER, "none")]),
            Ok(Settings::Off("OTEL_TRACES_EXPORTER=none"))
        );
        assert!(matches!(
            read(&[endpoint, (SDK_DISABLED, "false")]),
            Ok(Settings::On(_))
        ));
    }

    #[test]
    fn the_generic_endpoint_gets_the_traces_path_the_signals_own_does_not() {
        assert_eq!(
            on(&[(ENDPOINT, "http://collector:4318/")]).endpoint,
            "http://collector:4318/v1/traces"
        );
        let export = on(&[
            (ENDPOINT, "http://collector:4318"),
            (TRACES_ENDPOINT, "http://other:9000/custom"),
        ]);
        assert_eq!(export.endpoint, "http://other:9000/custom");
        assert_eq!(export.endpoint_from, TRACES_ENDPOINT);
        assert_eq!(
            on(&[(ENDPOINT, "http://collector:4318/base?token=t&x")]).endpoint,
            "http://collector:4318/base/v1/traces?token=t&x",
            "the path goes before the query"
        );
    }

    #[test]
    fn defaults() {
        let export = on(&[(ENDPOINT, "http://collector:4318")]);
        assert_eq!(export.timeout, Duration::from_secs(10));
        assert_eq!(export.service_name, "outbox-relay");
        assert_eq!(
            export.sampling,
            Sampling::ParentBased(Box::new(Sampling::AlwaysOn))
        );
        assert_eq!(export.schedule_delay, Duration::from_secs(5));
        assert_eq!(export.max_queue_size, 2048);
        assert!(export.headers.is_empty());
    }

    #[test]
    fn bad_values_name_their_variable() {
        let endpoint = (ENDPOINT, "http://collector:4318");
        for (vars, variable) in [
            (vec![endpoint, (PROTOCOL, "grpc")], PROTOCOL),
            (
                vec![endpoint, (TRACES_PROTOCOL, "http/json")],
                TRACES_PROTOCOL,
            ),
            (vec![(ENDPOINT, "https://collector:4318")], ENDPOINT),
            (vec![(TRACES_ENDPOINT, "collector:4318")], TRACES_ENDPOINT),
            (vec![endpoint, (TIMEOUT, "10s")], TIMEOUT),
            (vec![endpoint, (SAMPLER, "xray")], SAMPLER),
            (
                vec![endpoint, (SAMPLER, "traceidratio"), (SAMPLER_ARG, "2")],
                SAMPLER_ARG,
            ),
            (vec![endpoint, (MAX_QUEUE_SIZE, "0")], MAX_QUEUE_SIZE),
            (vec![endpoint, (SCHEDULE_DELAY, "-1")], SCHEDULE_DELAY),
            (vec![endpoint, (SDK_DISABLED, "yes")], SDK_DISABLED),
            (vec![endpoint, (TRACES_EXPORTER, "zipkin")], TRACES_EXPORTER),
            (vec![endpoint, (HEADERS, "authorization")], HEADERS),
            (vec![endpoint, (TRACES_HEADERS, "x(y)=1")], TRACES_HEADERS),
            (vec![endpoint, (TRACES_TIMEOUT, "0")], TRACES_TIMEOUT),
            (
                vec![endpoint, (RESOURCE_ATTRIBUTES, "a=1,b")],
                RESOURCE_ATTRIBUTES,
            ),
            // Checked even with tracing off.
            (vec![(PROTOCOL, "grpc")], PROTOCOL),
        ] {
            let got = read(&vars).expect_err("refused");
            assert_eq!(got.variable, variable, "{vars:?}: {got}");
            assert!(got.to_string().starts_with(variable), "{got}");
        }
    }

    #[test]
    fn header_values_are_decoded_and_never_in_errors_or_the_rendering() {
        let export = on(&[
            (ENDPOINT, "http://collector:4318"),
            (HEADERS, "authorization=Basic%20c2VjcmV0, x-tenant = ops"),
        ]);
        assert_eq!(
            export.headers,
            vec![
                ("authorization".to_string(), "Basic c2VjcmV0".to_string()),
                ("x-tenant".to_string(), "ops".to_string()),
            ]
        );
        let shown = Settings::On(export).render();
        assert!(
            shown.contains("authorization, x-tenant (values not shown)"),
            "{shown}"
        );
        assert!(
            !shown.contains("c2VjcmV0") && !shown.contains("ops\""),
            "{shown}"
        );
        let bad = read(&[
            (ENDPOINT, "http://collector:4318"),
            (HEADERS, "authorization=secret%0A"),
        ])
        .expect_err("refused");
        assert!(!bad.to_string().contains("secret"), "{bad}");
        let own = on(&[
            (ENDPOINT, "http://collector:4318"),
            (HEADERS, "authorization=generic"),
            (TRACES_HEADERS, "x-traces=1"),
            (TIMEOUT, "1000"),
            (TRACES_TIMEOUT, "2500"),
        ]);
        assert_eq!(own.headers, vec![("x-traces".to_string(), "1".to_string())]);
        assert_eq!(own.timeout, Duration::from_millis(2500));
    }

    #[test]
    fn service_name_variable_wins_over_the_resource_attribute() {
        let endpoint = (ENDPOINT, "http://collector:4318");
        let export = on(&[
            endpoint,
            (
                RESOURCE_ATTRIBUTES,
                "service.name=billing-relay,deployment.environment=prod",
            ),
        ]);
        assert_eq!(export.service_name, "billing-relay");
        assert_eq!(
            export.resource,
            vec![("deployment.environment".to_string(), "prod".to_string())]
        );
        let export = on(&[
            endpoint,
            (SERVICE_NAME, "relay-b"),
            (RESOURCE_ATTRIBUTES, "service.name=billing-relay"),
        ]);
        assert_eq!(export.service_name, "relay-b");
    }

    #[test]
    fn sampling_decides_as_the_samplers_of_those_names() {
        let low = 0x0123_u128; // lower 64 bits small: under any ratio above 0
        let high = u128::from(u64::MAX); // lower 64 bits all ones: over any ratio under 1
        let on = Sampling::AlwaysOn;
        let off = Sampling::AlwaysOff;
        assert!(on.samples(None, high) && on.samples(Some(false), high));
        assert!(!off.samples(None, low) && !off.samples(Some(true), low));
        let half = Sampling::Ratio(0.5);
        assert!(half.samples(None, low));
        assert!(!half.samples(None, high));
        assert!(half.samples(Some(false), low), "a ratio ignores the parent");
        assert!(!Sampling::Ratio(0.0).samples(None, low));
        assert!(Sampling::Ratio(1.0).samples(None, high));
        let parent_based = Sampling::ParentBased(Box::new(Sampling::AlwaysOff));
        assert!(parent_based.samples(Some(true), high));
        assert!(!parent_based.samples(Some(false), low));
        assert!(!parent_based.samples(None, low));
        let default = Sampling::ParentBased(Box::new(Sampling::AlwaysOn));
        assert!(default.samples(None, high));
        assert!(!default.samples(Some(false), low));
        // The upper 64 bits play no part: the SDK reads the lower 8 bytes.
        assert_eq!(
            half.samples(None, (7_u128 << 64) | 5),
            half.samples(None, 5)
        );
    }

    #[test]
    fn samplers() {
        let endpoint = (ENDPOINT, "http://collector:4318");
        assert_eq!(
            on(&[
                endpoint,
                (SAMPLER, "parentbased_traceidratio"),
                (SAMPLER_ARG, "0.25")
            ])
            .sampling,
            Sampling::ParentBased(Box::new(Sampling::Ratio(0.25)))
        );
        assert_eq!(
            on(&[endpoint, (SAMPLER, "always_off")]).sampling,
            Sampling::AlwaysOff
        );
    }

    #[test]
    fn a_password_in_the_endpoint_is_not_shown() {
        let export = on(&[(ENDPOINT, "http://user:hunter2@collector:4318")]);
        let shown = Settings::On(export).render();
        assert!(!shown.contains("hunter2"), "{shown}");
        for url in [
            "https://user:hunter2@collector:4318",
            "user:hunter2@collector:4318",
            "ftp://user:hunter2@collector",
        ] {
            let error = read(&[(ENDPOINT, url)]).expect_err("refused");
            assert!(!error.to_string().contains("hunter2"), "{error}");
        }
    }

    #[test]
    fn a_query_in_the_endpoint_is_shown_without_its_values() {
        let export = on(&[(ENDPOINT, "http://collector:4318/x?token=hunter2")]);
        let shown = Settings::On(export).render();
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("/x/v1/traces?token=***"), "{shown}");
    }
}
