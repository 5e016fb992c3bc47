//! The deployment files agree with the relay: `deploy/` (Kubernetes manifests,
//! Prometheus rules, Grafana dashboard, compose), `docs/runbook.md` and the
//! Dockerfile. None of these tests needs PostgreSQL or RabbitMQ: the relay's
//! HTTP router is served in-process over a configuration whose database and
//! broker are never contacted, and configurations go through the relay's own
//! loader.
//!
//! Two files are left in `target/` for `.ci/run`'s promtool steps:
//! `metrics-sample.txt` (`promtool check metrics`) and
//! `dashboard-expressions.rules.yaml` (the dashboard's queries as recording
//! rules, for `promtool check rules`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::config::{Config, KEYS, Sources};
use outbox_relay::domain::{FailureReason, Outcome};
use outbox_relay::metrics::Metrics;
use outbox_relay::relay::Relay;
use serde::Deserialize;
use serde_yaml::Value;

use crate::support::http_get;

/// Every route of `src/http.rs`.
const ROUTES: &[&str] = &["/livez", "/readyz", "/healthz", "/metrics"];

const RULES: &str = "deploy/prometheus/outbox-relay-rules.yaml";
const RULE_TESTS: &str = "deploy/prometheus/outbox-relay-rules.test.yaml";
const DASHBOARD: &str = "deploy/grafana/outbox-relay.json";
const SIDECAR: &str = "deploy/kubernetes/sidecar.yaml";
const STANDALONE: &str = "deploy/kubernetes/standalone.yaml";
const PODMONITOR: &str = "deploy/kubernetes/podmonitor.yaml";
const MANIFESTS: &[&str] = &[SIDECAR, STANDALONE];
const COMPOSE: &str = "deploy/compose.yaml";
const RUNBOOK: &str = "docs/runbook.md";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo().join(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// Every YAML document of a file (`---`-separated), empty ones left out.
fn yaml_documents(path: &str) -> Vec<Value> {
    let text = read(path);
    serde_yaml::Deserializer::from_str(&text)
        .map(|document| {
            Value::deserialize(document).unwrap_or_else(|e| panic!("{path} is not valid YAML: {e}"))
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn yaml(path: &str) -> Value {
    let mut documents = yaml_documents(path);
    assert_eq!(documents.len(), 1, "{path}: one YAML document expected");
    documents.remove(0)
}

fn str_at<'a>(value: &'a Value, key: &str) -> Option<&'a str> {
    value.get(key).and_then(Value::as_str)
}

fn seq<'a>(value: &'a Value, key: &str) -> &'a [Value] {
    value
        .get(key)
        .and_then(Value::as_sequence)
        .map_or(&[], |s| s.as_slice())
}

fn kind<'a>(documents: &'a [Value], kind: &str) -> Vec<&'a Value> {
    documents
        .iter()
        .filter(|d| str_at(d, "kind") == Some(kind))
        .collect()
}

fn one<'a>(documents: &'a [Value], kind_name: &str, path: &str) -> &'a Value {
    let found = kind(documents, kind_name);
    assert_eq!(found.len(), 1, "{path}: exactly one {kind_name} expected");
    found[0]
}

/// Identifiers `outbox_[a-z_]+` (not inside a longer identifier), with the
/// histogram suffixes `_bucket`, `_sum` and `_count` stripped.
fn metric_names(text: &str) -> BTreeSet<String> {
    let bytes = text.as_bytes();
    let mut names = BTreeSet::new();
    let mut from = 0;
    while let Some(found) = text[from..].find("outbox_") {
        let start = from + found;
        let inside_word = start > 0 && {
            let c = bytes[start - 1];
            c.is_ascii_alphanumeric() || c == b'_'
        };
        let mut end = start + "outbox_".len();
        while end < bytes.len() && (bytes[end].is_ascii_lowercase() || bytes[end] == b'_') {
            end += 1;
        }
        if !inside_word {
            let name = &text[start..end];
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .unwrap_or(name);
            names.insert(base.to_string());
        }
        from = end;
    }
    names
}

/// The relay's HTTP router, served on a free port of 127.0.0.1 in this
/// process. Nothing is connected: the database and the broker point at a
/// closed port, and neither the scheduler nor the broker supervisor runs.
async fn serve_router() -> std::net::SocketAddr {
    let mut config = Config::with_tenants(["a"]);
    config.database_url = "postgres://postgres@127.0.0.1:9/none".parse().unwrap();
    config.amqp_url = "amqp://guest:guest@127.0.0.1:9/%2f".parse().unwrap();
    let relay = Arc::new(Relay::from_config(Arc::new(config)).expect("relay builds"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(listener, outbox_relay::http::router(relay))
            .await
            .expect("serve");
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_in_the_rules_and_the_dashboard_is_one_the_relay_exposes() {
    let addr = serve_router().await;
    let (status, scraped) = http_get(addr, "/metrics").await;
    assert_eq!(status, 200, "/metrics answers 200");
    // The endpoint gauge's series come from the configured endpoints, as
    // the relay sets them when it is built.
    let rendered = {
        let metrics = Metrics::new();
        metrics.set_amqp_endpoint(&["127.0.0.1:9".to_string()], None);
        metrics.render()
    };

    for path in [RULES, DASHBOARD] {
        let names = metric_names(&read(path));
        assert!(names.len() >= 5, "{path}: too few metrics found: {names:?}");
        for name in &names {
            let type_line = format!("# TYPE {name} ");
            assert!(
                scraped.contains(&type_line) && rendered.contains(&type_line),
                "{path} uses {name}, which the relay does not expose; /metrics:\n{scraped}"
            );
        }
    }
    // The other way round: the dashboard shows every metric of docs/design.md.
    let exposed: BTreeSet<String> = scraped
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    let dashboard = metric_names(&read(DASHBOARD));
    let missing: Vec<_> = exposed.difference(&dashboard).collect();
    assert!(missing.is_empty(), "not on the dashboard: {missing:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_probe_points_at_a_route_the_relay_serves() {
    let addr = serve_router().await;
    for route in ROUTES {
        let (status, _) = http_get(addr, route).await;
        assert_ne!(status, 404, "the relay serves {route}");
    }
    let (status, _) = http_get(addr, "/nope").await;
    assert_eq!(
        status, 404,
        "an unknown path is 404 (the check above means something)"
    );

    for path in MANIFESTS {
        let documents = yaml_documents(path);
        let (_, relay) = relay_container(&documents, path);
        for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
            let Some(spec) = relay.get(probe) else {
                continue;
            };
            let get = spec
                .get("httpGet")
                .unwrap_or_else(|| panic!("{path}: {probe} is an httpGet probe"));
            let probe_path = str_at(get, "path").expect("probe path");
            assert!(
                ROUTES.contains(&probe_path),
                "{path}: {probe} path {probe_path} is not a route of the relay"
            );
            assert_ne!(
                probe_path, "/healthz",
                "{path}: lag (/healthz) is no probe of a sidecar"
            );
            let (status, _) = http_get(addr, probe_path).await;
            assert_ne!(status, 404, "{path}: {probe} path {probe_path} is served");
            let port = get.get("port").expect("probe port");
            let ports = seq(relay, "ports");
            assert!(
                ports.iter().any(|p| {
                    p.get("name") == Some(port) || p.get("containerPort") == Some(port)
                }),
                "{path}: {probe} port {port:?} is not a port of the relay container"
            );
        }
        let probe_path = |probe: &str| {
            relay
                .get(probe)
                .and_then(|p| p.get("httpGet"))
                .and_then(|g| str_at(g, "path"))
                .unwrap_or_else(|| panic!("{path}: the relay has a {probe}"))
        };
        assert_eq!(probe_path("livenessProbe"), "/livez", "{path}: liveness");
        if *path == STANDALONE {
            assert_eq!(probe_path("readinessProbe"), "/readyz", "{path}: readiness");
        }
    }
}

/// Every Kubernetes object (a document with `apiVersion` and `kind`) of every
/// YAML file under `deploy/`, with its file's path.
fn kubernetes_objects() -> Vec<(String, Value)> {
    fn walk(dir: &Path, found: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{dir:?}: {e}")) {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                walk(&path, found);
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                let relative = path.strip_prefix(repo()).expect("under the repository");
                found.push(relative.to_string_lossy().into_owned());
            }
        }
    }
    let mut files = Vec::new();
    walk(&repo().join("deploy"), &mut files);
    files
        .into_iter()
        .flat_map(|path| {
            yaml_documents(&path)
                .into_iter()
                .filter(|d| str_at(d, "apiVersion").is_some() && str_at(d, "kind").is_some())
                .map(move |d| (path.clone(), d))
        })
        .collect()
}

/// The pod spec of an object that makes pods: a workload's template, a
/// CronJob's job's template, or a Pod itself.
fn pod_spec(object: &Value) -> Option<&Value> {
    let spec = object.get("spec")?;
    if str_at(object, "kind") == Some("Pod") {
        return Some(spec);
    }
    let spec = spec
        .get("jobTemplate")
        .and_then(|j| j.get("spec"))
        .unwrap_or(spec);
    spec.get("template")?.get("spec")
}

/// A relay that shares its pod with the application: a native sidecar (an
/// init container with `restartPolicy: Always`, whose readiness counts
/// toward the pod's) or one of several `containers`. Its readiness probe on
/// `/readyz` (database and broker) or `/healthz` (lag) would take the
/// application out of its Services during the very outage the outbox rides
/// out; its start-up and liveness probes are on `/livez`.
#[test]
fn a_relay_beside_the_application_is_never_probed_for_readiness_on_its_connections() {
    let mut beside = BTreeSet::new();
    for (path, object) in kubernetes_objects() {
        let Some(pod) = pod_spec(&object) else {
            continue;
        };
        let containers = seq(pod, "containers");
        let sidecars = seq(pod, "initContainers")
            .iter()
            .filter(|c| str_at(c, "restartPolicy") == Some("Always"));
        let shared = containers
            .iter()
            .filter(|_| containers.len() > 1)
            .chain(sidecars)
            .filter(|c| str_at(c, "image").is_some_and(|i| i.contains("outbox-relay")));
        for relay in shared {
            beside.insert(path.clone());
            let probe_path = |probe: &str| {
                relay
                    .get(probe)
                    .and_then(|p| p.get("httpGet"))
                    .and_then(|g| str_at(g, "path"))
            };
            if let Some(readiness) = probe_path("readinessProbe") {
                assert!(
                    !["/readyz", "/healthz"].contains(&readiness),
                    "{path}: a relay beside the application has a readiness probe on {readiness}"
                );
            }
            for probe in ["startupProbe", "livenessProbe"] {
                assert_eq!(probe_path(probe), Some("/livez"), "{path}: {probe}");
            }
        }
    }
    assert!(beside.contains(SIDECAR), "the sidecar is found: {beside:?}");
    assert!(!beside.contains(STANDALONE), "{beside:?}");
}

/// The pod spec of the file's one Deployment and its relay container.
fn relay_container<'a>(documents: &'a [Value], path: &str) -> (&'a Value, &'a Value) {
    let deployment = one(documents, "Deployment", path);
    let pod = deployment
        .get("spec")
        .and_then(|s| s.get("template"))
        .and_then(|t| t.get("spec"))
        .unwrap_or_else(|| panic!("{path}: Deployment has spec.template.spec"));
    let relays: Vec<&Value> = seq(pod, "initContainers")
        .iter()
        .chain(seq(pod, "containers"))
        .filter(|c| str_at(c, "name") == Some("outbox-relay"))
        .collect();
    assert_eq!(relays.len(), 1, "{path}: one container named outbox-relay");
    (pod, relays[0])
}

/// The relay configuration file of the manifest's ConfigMap, the path it is
/// mounted at, and the `--config` argument, which must be that path.
fn configmap_file(documents: &[Value], path: &str) -> String {
    let (pod, relay) = relay_container(documents, path);
    let args: Vec<&str> = seq(relay, "args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let config_arg = args
        .iter()
        .position(|a| *a == "--config")
        .and_then(|i| args.get(i + 1))
        .unwrap_or_else(|| panic!("{path}: the relay is started with --config PATH"));
    let mount = seq(relay, "volumeMounts")
        .iter()
        .find(|m| config_arg.starts_with(str_at(m, "mountPath").unwrap_or("\0")))
        .unwrap_or_else(|| panic!("{path}: {config_arg} is on a mounted volume"));
    let volume = seq(pod, "volumes")
        .iter()
        .find(|v| v.get("name") == mount.get("name"))
        .expect("the mount's volume");
    let configmap_name = volume
        .get("configMap")
        .and_then(|c| str_at(c, "name"))
        .expect("the volume is a ConfigMap");
    let configmap = kind(documents, "ConfigMap")
        .into_iter()
        .find(|c| c.get("metadata").and_then(|m| str_at(m, "name")) == Some(configmap_name))
        .unwrap_or_else(|| panic!("{path}: ConfigMap {configmap_name} is in the file"));
    let file_name = Path::new(config_arg)
        .strip_prefix(str_at(mount, "mountPath").unwrap())
        .expect("under the mount")
        .to_str()
        .unwrap();
    configmap
        .get("data")
        .and_then(|d| str_at(d, file_name))
        .unwrap_or_else(|| panic!("{path}: ConfigMap {configmap_name} has key {file_name}"))
        .to_string()
}

/// The Secret's values, by key (`stringData`).
fn secret_values(documents: &[Value], name: &str, path: &str) -> BTreeMap<String, String> {
    let secret = kind(documents, "Secret")
        .into_iter()
        .find(|s| s.get("metadata").and_then(|m| str_at(m, "name")) == Some(name))
        .unwrap_or_else(|| panic!("{path}: Secret {name} is in the file"));
    let data = secret
        .get("stringData")
        .and_then(Value::as_mapping)
        .expect("stringData");
    data.iter()
        .map(|(k, v)| {
            (
                k.as_str().unwrap().to_string(),
                v.as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The relay container's environment, secretKeyRef values read from the file's Secret.
fn relay_env(documents: &[Value], path: &str) -> Vec<(String, String)> {
    let (_, relay) = relay_container(documents, path);
    seq(relay, "env")
        .iter()
        .map(|e| {
            let name = str_at(e, "name").expect("env name").to_string();
            let value = match (str_at(e, "value"), e.get("valueFrom")) {
                (Some(v), _) => v.to_string(),
                (None, Some(from)) => {
                    let key_ref = from
                        .get("secretKeyRef")
                        .unwrap_or_else(|| panic!("{path}: {name} comes from a Secret"));
                    let secret = str_at(key_ref, "name").expect("secret name");
                    let key = str_at(key_ref, "key").expect("secret key");
                    secret_values(documents, secret, path)
                        .remove(key)
                        .unwrap_or_else(|| panic!("{path}: Secret {secret} has key {key}"))
                }
                (None, None) => String::new(),
            };
            (name, value)
        })
        .collect()
}

fn load(file: Option<&str>, env: Vec<(String, String)>) -> Config {
    let temp = tempfile::NamedTempFile::new().expect("temp file");
    if let Some(text) = file {
        std::fs::write(temp.path(), text).expect("write");
    }
    Sources {
        file: file.map(|_| temp.path().to_path_buf()),
        env,
        flags: Default::default(),
    }
    .load()
    .unwrap_or_else(|e| panic!("the relay refuses this configuration: {e}"))
    .config
}

#[test]
fn the_manifests_configuration_is_accepted_by_the_relay_and_fits_the_pod() {
    for path in MANIFESTS {
        let documents = yaml_documents(path);
        let file = configmap_file(&documents, path);
        for secret_key in ["database_url", "amqp_url"] {
            assert!(
                !file.lines().any(|l| l.trim_start().starts_with(secret_key)),
                "{path}: {secret_key} belongs in the Secret, not the ConfigMap"
            );
        }
        let env = relay_env(&documents, path);
        let names: BTreeSet<&str> = env.iter().map(|(n, _)| n.as_str()).collect();
        assert!(
            names.contains("OUTBOX_DATABASE_URL") && names.contains("OUTBOX_AMQP_URL"),
            "{path}: the URLs come from the Secret"
        );

        let from_file = load(Some(&file), Vec::new());
        assert!(!from_file.tenants.listed().is_empty());
        let config = load(Some(&file), env);

        let (pod, relay) = relay_container(&documents, path);
        let grace_s = pod
            .get("terminationGracePeriodSeconds")
            .and_then(Value::as_u64)
            .unwrap_or_else(|| panic!("{path}: terminationGracePeriodSeconds is set"));
        assert!(
            grace_s * 1000 > config.shutdown_grace_ms,
            "{path}: terminationGracePeriodSeconds {grace_s} s must be longer than shutdown_grace_ms {}",
            config.shutdown_grace_ms
        );
        let port = config.http_addr.port();
        assert!(
            seq(relay, "ports")
                .iter()
                .any(|p| p.get("containerPort").and_then(Value::as_u64) == Some(port.into())),
            "{path}: the container port is http_addr's port {port}"
        );
        assert!(
            config.http_addr.ip().is_unspecified(),
            "{path}: http_addr must listen beyond loopback for the kubelet's probes"
        );
        let limit = relay
            .get("resources")
            .and_then(|r| r.get("limits"))
            .and_then(|l| str_at(l, "memory"))
            .and_then(|m| m.strip_suffix("Mi"))
            .and_then(|m| m.parse::<usize>().ok())
            .unwrap_or_else(|| panic!("{path}: a memory limit in Mi"));
        assert!(
            config.max_bytes_in_flight + RELAY_BASELINE_BYTES <= limit << 20,
            "{path}: max_bytes_in_flight {} and the relay's own {} MiB must fit the {limit} Mi limit",
            config.max_bytes_in_flight,
            RELAY_BASELINE_BYTES >> 20
        );
    }
}

/// What the relay holds besides the rows its byte budget covers: about 25 MiB
/// idle with 1,000 tenants (`cargo bench`, `idle`), with room for the
/// allocator and the AMQP client's buffers. The benchmark's `memory` scenario
/// measured at most 80 MiB in all with the default 64 MiB budget.
const RELAY_BASELINE_BYTES: usize = 40 << 20;

#[test]
fn the_manifests_are_restricted_sized_and_replicated() {
    for path in MANIFESTS {
        let documents = yaml_documents(path);
        let (pod, relay) = relay_container(&documents, path);
        let security = relay.get("securityContext").expect("securityContext");
        let field = |name: &str| security.get(name).cloned().unwrap_or(Value::Null);
        assert_eq!(field("runAsNonRoot"), Value::Bool(true), "{path}");
        assert_eq!(field("runAsUser").as_u64(), Some(65532), "{path}");
        assert_eq!(field("runAsGroup").as_u64(), Some(65532), "{path}");
        assert_eq!(
            field("allowPrivilegeEscalation"),
            Value::Bool(false),
            "{path}"
        );
        assert_eq!(field("readOnlyRootFilesystem"), Value::Bool(true), "{path}");
        let dropped: Vec<&str> = security
            .get("capabilities")
            .map(|c| seq(c, "drop"))
            .unwrap_or(&[])
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(dropped, ["ALL"], "{path}: all capabilities dropped");
        let seccomp = |v: Option<&Value>| {
            v.and_then(|s| s.get("seccompProfile"))
                .and_then(|p| str_at(p, "type"))
                .map(str::to_string)
        };
        assert_eq!(
            seccomp(Some(security)).or_else(|| seccomp(pod.get("securityContext"))),
            Some("RuntimeDefault".to_string()),
            "{path}: seccomp RuntimeDefault"
        );

        let resources = relay.get("resources").expect("resources");
        for (section, key) in [
            ("requests", "cpu"),
            ("requests", "memory"),
            ("limits", "cpu"),
            ("limits", "memory"),
        ] {
            assert!(
                resources.get(section).and_then(|s| s.get(key)).is_some(),
                "{path}: resources.{section}.{key}"
            );
        }

        let deployment = one(&documents, "Deployment", path);
        let replicas = deployment
            .get("spec")
            .and_then(|s| s.get("replicas"))
            .and_then(Value::as_u64)
            .unwrap_or(1);
        assert!(replicas >= 2, "{path}: several replicas");
    }

    // The sidecar is a native one.
    let documents = yaml_documents(SIDECAR);
    let (pod, _) = relay_container(&documents, SIDECAR);
    let sidecar = seq(pod, "initContainers")
        .iter()
        .find(|c| str_at(c, "name") == Some("outbox-relay"))
        .expect("the relay is an init container");
    assert_eq!(str_at(sidecar, "restartPolicy"), Some("Always"));
    assert!(
        !seq(pod, "containers").is_empty(),
        "the application container"
    );

    // Both variants share the same ConfigMap and Secret.
    let standalone = yaml_documents(STANDALONE);
    for kind_name in ["ConfigMap", "Secret"] {
        assert_eq!(
            one(&documents, kind_name, SIDECAR),
            one(&standalone, kind_name, STANDALONE),
            "the {kind_name} of sidecar.yaml and standalone.yaml differ"
        );
    }
    let service = one(&standalone, "Service", STANDALONE);
    let service_ports = seq(service.get("spec").expect("spec"), "ports");
    assert!(
        service_ports
            .iter()
            .any(|p| p.get("port").and_then(Value::as_u64) == Some(9780)),
        "the Service exposes 9780"
    );
}

#[test]
fn the_standalone_variant_survives_a_node_a_zone_and_a_drain() {
    let documents = yaml_documents(STANDALONE);
    let (pod, _) = relay_container(&documents, STANDALONE);
    let deployment = one(&documents, "Deployment", STANDALONE);
    let pod_labels = deployment
        .get("spec")
        .and_then(|s| s.get("template"))
        .and_then(|t| t.get("metadata"))
        .and_then(|m| m.get("labels"))
        .expect("the pod template's labels");
    let selects_the_pods = |selector: Option<&Value>| {
        let wanted = selector
            .and_then(|s| s.get("matchLabels"))
            .and_then(Value::as_mapping)
            .filter(|wanted| !wanted.is_empty());
        wanted.is_some_and(|wanted| {
            wanted
                .iter()
                .all(|(key, value)| pod_labels.get(key) == Some(value))
        })
    };

    let spread: Vec<&str> = seq(pod, "topologySpreadConstraints")
        .iter()
        .filter(|c| selects_the_pods(c.get("labelSelector")))
        .filter_map(|c| str_at(c, "topologyKey"))
        .collect();
    for key in ["kubernetes.io/hostname", "topology.kubernetes.io/zone"] {
        assert!(
            spread.contains(&key),
            "{STANDALONE}: replicas spread over {key}: {spread:?}"
        );
    }

    let budget = one(&documents, "PodDisruptionBudget", STANDALONE);
    assert_eq!(str_at(budget, "apiVersion"), Some("policy/v1"));
    let spec = budget.get("spec").expect("spec");
    assert!(
        selects_the_pods(spec.get("selector")),
        "{STANDALONE}: the budget selects the relay's pods"
    );
    let replicas = deployment
        .get("spec")
        .and_then(|s| s.get("replicas"))
        .and_then(Value::as_u64)
        .unwrap_or(1);
    let available_during_a_drain = match (
        spec.get("maxUnavailable").and_then(Value::as_u64),
        spec.get("minAvailable").and_then(Value::as_u64),
    ) {
        (Some(unavailable), None) => replicas.saturating_sub(unavailable),
        (None, Some(available)) => available,
        other => {
            panic!("{STANDALONE}: one of maxUnavailable or minAvailable, as a number: {other:?}")
        }
    };
    assert!(
        (1..replicas).contains(&available_during_a_drain),
        "{STANDALONE}: a drain keeps a relay running ({available_during_a_drain} of {replicas}) and can proceed"
    );

    // The Secret's broker URL lists a cluster's nodes, all over TLS.
    let env = relay_env(&documents, STANDALONE);
    let config = load(Some(&configmap_file(&documents, STANDALONE)), env);
    let endpoints = &config.amqp_url.endpoints;
    assert!(
        endpoints.len() >= 2,
        "{STANDALONE}: several broker endpoints in the Secret"
    );
    assert!(
        endpoints.iter().all(|e| e.tls.is_some()),
        "{STANDALONE}: every endpoint over TLS"
    );
}

#[test]
fn the_podmonitor_selects_both_variants_by_port_name() {
    let monitor = yaml(PODMONITOR);
    assert_eq!(
        str_at(&monitor, "apiVersion"),
        Some("monitoring.coreos.com/v1")
    );
    assert_eq!(str_at(&monitor, "kind"), Some("PodMonitor"));
    let spec = monitor.get("spec").expect("spec");
    let selector = spec
        .get("selector")
        .and_then(|s| s.get("matchLabels"))
        .and_then(Value::as_mapping)
        .expect("selector.matchLabels");
    let endpoints = seq(spec, "podMetricsEndpoints");
    assert!(!endpoints.is_empty());
    for path in MANIFESTS {
        let documents = yaml_documents(path);
        let deployment = one(&documents, "Deployment", path);
        let labels = deployment
            .get("spec")
            .and_then(|s| s.get("template"))
            .and_then(|t| t.get("metadata"))
            .and_then(|m| m.get("labels"))
            .and_then(Value::as_mapping)
            .expect("pod labels");
        for (key, value) in selector {
            assert_eq!(labels.get(key), Some(value), "{path}: pod label {key:?}");
        }
        let (_, relay) = relay_container(&documents, path);
        for endpoint in endpoints {
            assert_eq!(str_at(endpoint, "path"), Some("/metrics"));
            let port = endpoint.get("port").expect("port name");
            assert!(
                seq(relay, "ports")
                    .iter()
                    .any(|p| p.get("name") == Some(port)),
                "{path}: the relay has a port named {port:?}"
            );
        }
    }
}

#[test]
fn every_alert_has_a_runbook_section_and_the_rules_parse() {
    let rules = yaml(RULES);
    let runbook = read(RUNBOOK);
    let headings: BTreeSet<String> = runbook
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(|h| h.trim().to_lowercase())
        .collect();
    let mut alerts = Vec::new();
    for group in seq(&rules, "groups") {
        for rule in seq(group, "rules") {
            let expr = str_at(rule, "expr").expect("every rule has an expr");
            assert!(!expr.trim().is_empty());
            let Some(alert) = str_at(rule, "alert") else {
                continue;
            };
            alerts.push(alert.to_string());
            let annotations = rule.get("annotations").expect("annotations");
            for key in ["summary", "description", "runbook_url"] {
                assert!(
                    str_at(annotations, key).is_some_and(|v| !v.trim().is_empty()),
                    "{alert}: annotation {key}"
                );
            }
            let anchor = alert.to_lowercase();
            let url = str_at(annotations, "runbook_url").unwrap();
            assert!(
                url.ends_with(&format!("{RUNBOOK}#{anchor}")),
                "{alert}: runbook_url {url} points at {RUNBOOK}#{anchor}"
            );
            assert!(
                headings.contains(&anchor),
                "{RUNBOOK} has a section `## {alert}`"
            );
        }
    }
    for required in [
        "OutboxTenantLagging",
        "OutboxTenantBackingOff",
        "OutboxPublishFailures",
        "OutboxBrokerDisconnected",
        "OutboxDatabaseDown",
        "OutboxNoRelayForTenant",
    ] {
        assert!(alerts.iter().any(|a| a == required), "alert {required}");
    }
    // The rules' unit tests parse too (promtool runs them in .ci/run).
    let tests = yaml(RULE_TESTS);
    assert!(!seq(&tests, "tests").is_empty());
}

#[test]
fn the_dashboard_parses_and_its_queries_are_left_for_promtool() {
    let text = read(DASHBOARD);
    let dashboard: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"));
    assert!(dashboard["schemaVersion"].as_u64().unwrap_or(0) >= 36);
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("template variables");
    let variable = |name: &str| {
        variables
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("variable {name}"))
    };
    assert_eq!(variable("datasource")["type"], "datasource");
    assert_eq!(variable("datasource")["query"], "prometheus");
    assert_eq!(
        variable("tenant")["definition"],
        "label_values(outbox_lag_seconds, tenant)"
    );

    let mut expressions = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        if panel["type"] == "row" {
            continue;
        }
        let title = panel["title"].as_str().unwrap_or("?");
        assert_eq!(
            panel["datasource"]["uid"], "${datasource}",
            "panel {title} uses the datasource variable"
        );
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {title} has queries");
        for target in targets {
            expressions.push(target["expr"].as_str().expect("expr").to_string());
        }
    }

    // Each query as a recording rule, the dashboard variables given a value,
    // for `promtool check rules` in .ci/run.
    let mut rules = String::from(
        "# Written by tests/relay/deploy.rs: the dashboard's queries, for promtool.\ngroups:\n  - name: dashboard\n    rules:\n",
    );
    for (i, expr) in expressions.iter().enumerate() {
        let expr = expr
            .replace("$__rate_interval", "5m")
            .replace("$tenant", ".*");
        assert!(!expr.contains('$'), "an unknown variable in {expr}");
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n",
            serde_json::to_string(&expr).unwrap()
        ));
    }
    let parsed: Value = serde_yaml::from_str(&rules).expect("generated rules parse");
    assert_eq!(
        seq(&seq(&parsed, "groups")[0], "rules").len(),
        expressions.len()
    );
    write_target("dashboard-expressions.rules.yaml", &rules);
}

fn write_target(name: &str, text: &str) {
    let dir = repo().join("target");
    std::fs::create_dir_all(&dir).expect("target/");
    std::fs::write(dir.join(name), text).unwrap_or_else(|e| panic!("write target/{name}: {e}"));
}

#[test]
fn a_metrics_sample_is_left_for_promtool() {
    let metrics = Metrics::new();
    metrics.count_published("acme", 42);
    metrics.failure("globex", FailureReason::Unroutable);
    metrics.failure("globex", FailureReason::Timeout);
    for outcome in Outcome::ALL {
        metrics.sweep_finished("acme", outcome, Duration::from_millis(12));
    }
    metrics.delivered_after(Duration::from_millis(300));
    metrics.delivered_after(Duration::from_secs(4));
    metrics.set_lag("globex", 75_500);
    metrics.set_backoff("globex", Duration::from_millis(1_600));
    metrics.set_amqp_connected(true);
    metrics.set_amqp_endpoint(
        &[
            "rabbitmq-server-0.rabbitmq-nodes:5671".to_string(),
            "rabbitmq-server-1.rabbitmq-nodes:5671".to_string(),
        ],
        Some(1),
    );
    metrics.set_database_up(true);
    let text = metrics.render();
    for line in [
        "# HELP ",
        "# TYPE ",
        "outbox_lag_seconds{tenant=\"globex\"} 75.5",
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
    write_target("metrics-sample.txt", &text);
}

#[test]
fn the_compose_file_builds_the_relay_and_waits_for_healthy_services() {
    let compose = yaml(COMPOSE);
    let services = compose.get("services").expect("services");
    let relay = services.get("relay").expect("service relay");
    let build = relay.get("build").expect("relay is built");
    let context = repo()
        .join("deploy")
        .join(str_at(build, "context").expect("build.context"));
    let dockerfile = str_at(build, "dockerfile").unwrap_or("Dockerfile");
    assert!(
        context.join(dockerfile).is_file(),
        "{COMPOSE}: {dockerfile} exists in build context {}",
        context.display()
    );
    assert!(
        context.join("Cargo.toml").is_file(),
        "the context is the repository"
    );

    for (name, condition) in relay
        .get("depends_on")
        .and_then(Value::as_mapping)
        .expect("depends_on with conditions")
    {
        let name = name.as_str().unwrap();
        let condition = str_at(condition, "condition").expect("a condition");
        let service = services
            .get(name)
            .unwrap_or_else(|| panic!("{COMPOSE}: service {name}"));
        if condition == "service_healthy" {
            assert!(
                service.get("healthcheck").is_some(),
                "{name} has a healthcheck"
            );
        }
    }
    for service in ["postgres", "rabbitmq"] {
        let condition = relay
            .get("depends_on")
            .and_then(|d| d.get(service))
            .and_then(|c| str_at(c, "condition"));
        assert_eq!(
            condition,
            Some("service_healthy"),
            "relay waits for {service}"
        );
    }

    let env: Vec<(String, String)> = relay
        .get("environment")
        .and_then(Value::as_mapping)
        .expect("environment as a mapping")
        .iter()
        .map(|(k, v)| {
            let value = match v {
                Value::String(s) => s.clone(),
                other => serde_yaml::to_string(other).unwrap().trim().to_string(),
            };
            (k.as_str().unwrap().to_string(), value)
        })
        .collect();
    let known: BTreeSet<String> = KEYS
        .iter()
        .map(|k| format!("OUTBOX_{}", k.to_uppercase()))
        .collect();
    for (name, _) in &env {
        assert!(
            known.contains(name),
            "{COMPOSE}: {name} names no configuration key"
        );
    }
    let config = load(None, env);
    assert_eq!(config.tenants, ["demo"]);
    assert!(config.migrate);
    for (url, service) in [
        (config.database_url.to_string(), "postgres"),
        (config.amqp_url.to_string(), "rabbitmq"),
    ] {
        assert!(
            url.contains(&format!("@{service}:")),
            "{url} points at the {service} service"
        );
    }
}

#[test]
fn every_path_the_dockerfile_copies_is_in_the_build_context() {
    let dockerfile = read("Dockerfile");
    let ignored: Vec<String> = read(".dockerignore")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    let is_ignored = |source: &str| {
        ignored.iter().any(|pattern| {
            let pattern = pattern.trim_end_matches('/');
            if let Some(suffix) = pattern.strip_prefix('*') {
                !source.contains('/') && source.ends_with(suffix)
            } else {
                source == pattern || source.starts_with(&format!("{pattern}/"))
            }
        })
    };

    let mut copied = 0;
    for line in dockerfile.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("COPY ") else {
            continue;
        };
        let words: Vec<&str> = rest.split_whitespace().collect();
        if words.iter().any(|w| w.starts_with("--from")) {
            continue;
        }
        let paths: Vec<&str> = words.into_iter().filter(|w| !w.starts_with("--")).collect();
        assert!(paths.len() >= 2, "COPY source… destination: {line}");
        for source in &paths[..paths.len() - 1] {
            let source = source.trim_end_matches('/');
            assert!(
                repo().join(source).exists(),
                "the Dockerfile copies {source}, which is not in the repository"
            );
            assert!(
                !is_ignored(source),
                "the Dockerfile copies {source}, which .dockerignore leaves out"
            );
            copied += 1;
        }
    }
    assert!(
        copied >= 4,
        "Cargo.toml, Cargo.lock, src, migrations, config"
    );

    // The builder's Rust is at least the crate's rust-version.
    let rust_version = read("Cargo.toml")
        .lines()
        .find_map(|l| l.strip_prefix("rust-version"))
        .and_then(|l| l.split('"').nth(1))
        .expect("rust-version in Cargo.toml")
        .to_string();
    let builder = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("FROM rust:"))
        .expect("a rust: builder image");
    let version_of = |s: &str| -> Vec<u32> {
        s.split(|c: char| !c.is_ascii_digit() && c != '.')
            .next()
            .unwrap_or("")
            .split('.')
            .map(|n| n.parse().expect("a version number"))
            .collect()
    };
    assert!(
        version_of(builder) >= version_of(&rust_version),
        "the builder's Rust ({builder}) is older than rust-version {rust_version}"
    );
    for required in ["USER 65532", "EXPOSE 9780", "ENTRYPOINT"] {
        assert!(
            dockerfile.contains(required),
            "the Dockerfile has {required}"
        );
    }
}

/// The dependency layer builds from Cargo.toml and Cargo.lock alone; Cargo
/// refuses a manifest whose declared benches, tests or examples have no
/// source file. Runs the Dockerfile's stub step in a directory holding only
/// those two files, then asks Cargo for a binary that does not exist: it
/// answers "no bin target named" only once it has parsed the manifest.
#[test]
fn the_dockerfile_dependency_layer_accepts_the_manifest() {
    let dockerfile = read("Dockerfile");
    let mut script = String::new();
    let mut inside = false;
    for line in dockerfile.lines() {
        if line.starts_with("RUN mkdir -p src") {
            inside = true;
        }
        if inside {
            script.push_str(line.trim_end().trim_end_matches('\\'));
            script.push(' ');
            if !line.trim_end().ends_with('\\') {
                break;
            }
        }
    }
    let script = script
        .trim_start_matches("RUN ")
        .split("&& cargo build")
        .next()
        .expect("the stub step comes before cargo build")
        .trim()
        .to_string();
    assert!(script.contains("src/main.rs"), "the stub step: {script}");

    let dir = tempfile::tempdir().expect("temp dir");
    for file in ["Cargo.toml", "Cargo.lock"] {
        std::fs::copy(repo().join(file), dir.path().join(file)).expect("copy");
    }
    let status = std::process::Command::new("sh")
        .args(["-ec", &script])
        .current_dir(dir.path())
        .status()
        .expect("sh runs");
    assert!(status.success(), "the stub step fails: {script}");

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = std::process::Command::new(cargo)
        .args(["build", "--locked", "--offline", "--bin", "no-such-binary"])
        .current_dir(dir.path())
        .env("CARGO_TARGET_DIR", dir.path().join("target"))
        .output()
        .expect("cargo runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("no bin target named"),
        "the Dockerfile's dependency build would fail on Cargo.toml:\n{stderr}"
    );
}

#[test]
fn metric_names_are_found_whole_and_without_histogram_suffixes() {
    let names = metric_names(
        "sum(rate(outbox_delivery_delay_seconds_bucket[5m])) + x_outbox_no + outbox_lag_seconds{tenant=\"a\"}",
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["outbox_delivery_delay_seconds", "outbox_lag_seconds"]
    );
}
