//! TLS to both services, each with a private CA the tests make with the
//! machine's `openssl`: a second PostgreSQL cluster with `ssl = on` (only
//! `hostssl` lines in its pg_hba.conf, `cert` authentication for the role
//! `certuser`), started once per test run from the machine's binaries; and,
//! for RabbitMQ, a TLS-terminating proxy each test owns, in front of the
//! machine's broker (which is not reconfigured).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use outbox_relay::config::Config;
use outbox_relay::publisher::Publisher;
use outbox_relay::store::Store;
use tokio::net::TcpListener;
use tokio_postgres::NoTls;
use tokio_rustls::rustls;

use crate::support::{
    self, Broker, Outbox, PrivateServer, eventually, http_get, initdb, relay_command, relay_env,
    set_env, spawn_relay, start_relay, unique,
};

/// The private CA (and an unrelated one), with certificates it signed.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl runs");
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Makes a CA (`<name>.pem`, `<name>.key`).
fn make_ca(dir: &Path, name: &str) {
    let (pem, key) = (format!("{name}.pem"), format!("{name}.key"));
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &pem,
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
        ],
    );
}

/// Makes `<name>.pem`/`<name>.key` signed by `ca`, with extensions `ext`.
fn make_cert(dir: &Path, ca: &str, name: &str, subject: &str, ext: &str) {
    let (pem, key, csr, extfile) = (
        format!("{name}.pem"),
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.ext"),
    );
    std::fs::write(dir.join(&extfile), ext).expect("extension file");
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            subject,
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "2",
            "-extfile",
            &extfile,
        ],
    );
}

/// Made once per test run: the server certificate is for `localhost` only,
/// so `127.0.0.1` is a wrong host name.
fn pki() -> &'static Pki {
    static PKI: OnceLock<Pki> = OnceLock::new();
    PKI.get_or_init(|| {
        let dir = std::env::temp_dir().join(unique("outbox-relay-tls"));
        std::fs::create_dir_all(&dir).expect("pki dir");
        make_ca(&dir, "ca");
        make_ca(&dir, "other-ca");
        make_cert(
            &dir,
            "ca",
            "server",
            "/CN=localhost",
            "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost\n",
        );
        make_cert(
            &dir,
            "ca",
            "client",
            "/CN=certuser",
            "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n",
        );
        Pki { dir }
    })
}

/// The TLS cluster (see [`PrivateServer`]): its port and its Unix socket
/// directory (plain, for the tests' own set-up and checks).
struct Cluster {
    port: u16,
    socket_dir: String,
    _server: PrivateServer,
}

fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let pki = pki();
        let base = pki.dir.join("pg");
        std::fs::create_dir_all(&base).expect("cluster dir");
        let status = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&pki.dir)
            .status()
            .expect("chown");
        assert!(status.success());
        let data = base.join("data").display().to_string();
        let socket_dir = base.display().to_string();
        initdb(&data);
        std::fs::write(
            format!("{data}/pg_hba.conf"),
            "local all all trust\n\
             hostssl all certuser 127.0.0.1/32 cert\n\
             hostssl all all 127.0.0.1/32 trust\n",
        )
        .expect("pg_hba.conf");
        let pki_dir = pki.dir.display().to_string();
        let settings: Vec<String> = [
            "ssl=on".to_string(),
            format!("ssl_cert_file={pki_dir}/server.pem"),
            format!("ssl_key_file={pki_dir}/server.key"),
            format!("ssl_ca_file={pki_dir}/ca.pem"),
            "max_connections=50".to_string(),
        ]
        .into_iter()
        .flat_map(|setting| ["-c".to_string(), setting])
        .collect();
        let server = PrivateServer::start("TLS cluster", &data, &socket_dir, &pki_dir, &settings);
        server.psql("postgres", "CREATE ROLE certuser LOGIN SUPERUSER");
        Cluster {
            port: server.port,
            socket_dir,
            _server: server,
        }
    })
}

impl Cluster {
    /// A plain connection string over the Unix socket, as `postgres`.
    fn local_url(&self) -> String {
        format!(
            "host={} port={} user=postgres dbname=postgres",
            self.socket_dir, self.port
        )
    }

    /// A TLS connection string to `host` with `params` added.
    fn url(&self, host: &str, user: &str, params: &str) -> String {
        format!("postgres://{user}@{host}:{}/postgres?{params}", self.port)
    }
}

/// A private outbox table in the TLS cluster, made over the Unix socket.
async fn tls_outbox() -> Outbox {
    let cluster = tokio::task::spawn_blocking(cluster).await.expect("cluster");
    let schema = unique("tls");
    let table = "outbox_message".to_string();
    let mut config = Config::with_tenants(["migrate"]);
    config.database_url = cluster.local_url().parse().expect("local url");
    config.schema = schema.clone();
    config.table = table.clone();
    let store = Store::new(&config).expect("store");
    outbox_relay::migrate::run(&store, &config)
        .await
        .expect("migrations apply");
    let (client, connection) = tokio_postgres::connect(&cluster.local_url(), NoTls)
        .await
        .expect("the TLS cluster's socket");
    tokio::spawn(connection);
    Outbox::adopt_in(&cluster.local_url(), schema, table, client)
}

/// A TLS-terminating proxy to the machine's broker.
struct TlsProxy {
    addr: SocketAddr,
    handshakes: Arc<AtomicUsize>,
    refused: Arc<AtomicUsize>,
    acceptor: tokio::task::JoinHandle<()>,
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

fn pem_certs(path: &str) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_file_iter(path)
        .expect("certificate file")
        .map(|c| c.expect("certificate"))
        .collect()
}

impl TlsProxy {
    /// Serves the `localhost` certificate; with `require_client_cert`,
    /// requires a client certificate the private CA signed.
    async fn start(require_client_cert: bool) -> TlsProxy {
        use rustls::pki_types::pem::PemObject;
        let pki = pki();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("versions");
        let builder = if require_client_cert {
            let mut roots = rustls::RootCertStore::empty();
            for cert in pem_certs(&pki.path("ca.pem")) {
                roots.add(cert).expect("CA");
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .expect("client verifier");
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let key = rustls::pki_types::PrivateKeyDer::from_pem_file(pki.path("server.key"))
            .expect("server key");
        let config = builder
            .with_single_cert(pem_certs(&pki.path("server.pem")), key)
            .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let handshakes = Arc::new(AtomicUsize::new(0));
        let refused = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn({
            let (handshakes, refused) = (handshakes.clone(), refused.clone());
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    let (acceptor, handshakes, refused) =
                        (acceptor.clone(), handshakes.clone(), refused.clone());
                    tokio::spawn(async move {
                        let Ok(Ok(mut tls)) =
                            tokio::time::timeout(Duration::from_secs(5), acceptor.accept(client))
                                .await
                        else {
                            refused.fetch_add(1, Ordering::SeqCst);
                            return;
                        };
                        handshakes.fetch_add(1, Ordering::SeqCst);
                        let Ok(mut broker) = tokio::net::TcpStream::connect("127.0.0.1:5672").await
                        else {
                            return;
                        };
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut broker).await;
                    });
                }
            }
        });
        TlsProxy {
            addr,
            handshakes,
            refused,
            acceptor: task,
        }
    }

    fn url(&self, host: &str, params: &str) -> String {
        format!(
            "amqps://guest:guest@{host}:{}/%2f?{params}",
            self.addr.port()
        )
    }

    fn handshakes(&self) -> usize {
        self.handshakes.load(Ordering::SeqCst)
    }

    fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }
}

/// What opening one database connection with `url` gives: `Ok` or the error
/// text, within the connect deadline.
async fn database_connects(url: &str) -> Result<(), String> {
    let mut config = Config::with_tenants(["tls"]);
    config.database_url = url.parse().map_err(|e: String| e)?;
    let store = Store::new(&config).expect("store");
    let started = tokio::time::Instant::now();
    let result = store.connection().await;
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "a TLS connection attempt took {:?}",
        started.elapsed()
    );
    let connection = result.map_err(|e| format!("{e}"))?;
    connection
        .simple_query("SELECT 1")
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// A publisher supervised until dropped.
struct Supervised {
    publisher: Publisher,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Supervised {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A publisher on `amqp_url` is refused by `proxy` (twice: it retries) and
/// never ready.
async fn refused_by(proxy: &TlsProxy, amqp_url: &str, what: &str) {
    let before = proxy.refused();
    let publisher = supervise(amqp_url);
    eventually(
        &format!("{what} is refused twice"),
        Duration::from_secs(10),
        || async { proxy.refused() >= before + 2 },
    )
    .await;
    assert!(!publisher.publisher.is_ready(), "{what}");
}

/// A publisher on `amqp_url` connects.
async fn accepted(amqp_url: &str, what: &str) {
    let publisher = supervise(amqp_url);
    eventually(what, Duration::from_secs(10), || async {
        publisher.publisher.is_ready()
    })
    .await;
}

fn supervise(amqp_url: &str) -> Supervised {
    let mut config = Config::with_tenants(["tls"]);
    config.amqp_url = amqp_url.parse().expect("amqps url");
    let publisher = Publisher::new(&config).expect("publisher");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(publisher.clone().supervise(async move {
        let _ = stopped.await;
    }));
    Supervised {
        publisher,
        stop: Some(stop),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_are_relayed_over_tls_to_both_services_with_client_certificates() {
    let pki = pki();
    let outbox = tls_outbox().await;
    let cluster = cluster();
    let broker = Broker::create(&["#"]).await;
    let proxy = TlsProxy::start(true).await;
    let mut config = support::config(&outbox, &broker, &["acme"]);
    config.database_url = cluster
        .url(
            "localhost",
            "certuser",
            &format!(
                "sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
                pki.path("ca.pem"),
                pki.path("client.pem"),
                pki.path("client.key")
            ),
        )
        .parse()
        .expect("database url");
    config.amqp_url = proxy
        .url(
            "localhost",
            &format!(
                "cacertfile={}&certfile={}&keyfile={}",
                pki.path("ca.pem"),
                pki.path("client.pem"),
                pki.path("client.key")
            ),
        )
        .parse()
        .expect("amqps url");
    let ids = outbox.insert_many("acme", 20).await;
    let relay = start_relay(config).await;
    eventually(
        "all rows arrive over TLS",
        Duration::from_secs(20),
        || async { broker.count() >= ids.len() },
    )
    .await;
    eventually("all rows are marked", Duration::from_secs(10), || async {
        outbox.pending("acme").await == 0
    })
    .await;
    let received: Vec<i64> = broker.received().iter().map(|r| r.id).collect();
    assert_eq!(received, ids);
    let (status, body) = relay.get("/readyz").await;
    assert_eq!(status, 200, "{body}");
    assert!(proxy.handshakes() >= 1);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_is_refused_at_once_with_a_clear_error_and_the_relay_is_not_ready() {
    let pki = pki();
    let outbox = tls_outbox().await;
    let cluster = cluster();
    let broker = Broker::create(&["#"]).await;
    let proxy = TlsProxy::start(false).await;
    outbox.insert_many("acme", 3).await;
    let mut env = relay_env(&outbox, &broker, &["acme"]);
    set_env(
        &mut env,
        "OUTBOX_DATABASE_URL",
        cluster.url(
            "localhost",
            "postgres",
            &format!(
                "sslmode=verify-full&sslrootcert={}",
                pki.path("other-ca.pem")
            ),
        ),
    );
    set_env(
        &mut env,
        "OUTBOX_AMQP_URL",
        proxy.url(
            "localhost",
            &format!("cacertfile={}", pki.path("other-ca.pem")),
        ),
    );
    // The private CA as the system's roots: refused all the same, because
    // sslrootcert and cacertfile replace the system's roots.
    set_env(&mut env, "SSL_CERT_FILE", pki.path("ca.pem"));
    let (mut process, addr) = spawn_relay(&env).await;
    eventually(
        "both refusals are logged, naming the certificate",
        Duration::from_secs(10),
        || {
            let output = process.output();
            let refused = |service: &str| {
                output.lines().any(|line| {
                    line.contains(service)
                        && line.contains("invalid peer certificate: UnknownIssuer")
                })
            };
            let both = refused("broker") && refused("database");
            async move { both }
        },
    )
    .await;
    let (status, body) = http_get(addr, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains(r#""database":false"#) && body.contains(r#""broker":false"#),
        "{body}"
    );
    assert!(proxy.refused() >= 1, "the proxy saw the handshake fail");
    assert_eq!(broker.count(), 0);
    assert_eq!(outbox.pending("acme").await, 3);
    process.signal("TERM");
    assert_eq!(
        process.wait(Duration::from_secs(20)).await,
        Some(0),
        "{}",
        process.output()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_checks_the_host_name_and_verify_ca_does_not() {
    let pki = pki();
    let cluster = tokio::task::spawn_blocking(cluster).await.expect("cluster");
    let root = format!("sslrootcert={}", pki.path("ca.pem"));
    // The certificate is for localhost only: 127.0.0.1 is the wrong name.
    for mode in ["verify-full", "require"] {
        let error = database_connects(&cluster.url(
            "127.0.0.1",
            "postgres",
            &format!("sslmode={mode}&{root}"),
        ))
        .await
        .expect_err("a certificate for another name is refused");
        assert!(error.contains("not valid for name"), "{mode}: {error}");
    }
    database_connects(&cluster.url(
        "127.0.0.1",
        "postgres",
        &format!("sslmode=verify-ca&{root}"),
    ))
    .await
    .expect("verify-ca checks the chain only");
    database_connects(&cluster.url(
        "localhost",
        "postgres",
        &format!("sslmode=verify-full&{root}"),
    ))
    .await
    .expect("the right name and CA");
    let error = database_connects(&cluster.url(
        "127.0.0.1",
        "postgres",
        &format!("sslmode=verify-ca&sslrootcert={}", pki.path("other-ca.pem")),
    ))
    .await
    .expect_err("verify-ca still checks the chain");
    assert!(error.contains("UnknownIssuer"), "{error}");

    let proxy = TlsProxy::start(false).await;
    let ca = format!("cacertfile={}", pki.path("ca.pem"));
    refused_by(&proxy, &proxy.url("127.0.0.1", &ca), "the wrong name").await;
    for params in [
        "server_name_indication=disable",
        "server_name_indication=localhost",
    ] {
        accepted(&proxy.url("127.0.0.1", &format!("{ca}&{params}")), params).await;
    }
    accepted(&proxy.url("localhost", &ca), "the right name").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_the_server_requires_is_presented_and_its_absence_refused() {
    let pki = pki();
    let cluster = tokio::task::spawn_blocking(cluster).await.expect("cluster");
    let root = format!("sslmode=verify-full&sslrootcert={}", pki.path("ca.pem"));
    let client = format!(
        "sslcert={}&sslkey={}",
        pki.path("client.pem"),
        pki.path("client.key")
    );
    database_connects(&cluster.url("localhost", "certuser", &format!("{root}&{client}")))
        .await
        .expect("certuser with its certificate");
    let error = database_connects(&cluster.url("localhost", "certuser", &root))
        .await
        .expect_err("certuser without a certificate");
    assert!(error.contains("certificate"), "{error}");

    let proxy = TlsProxy::start(true).await;
    let ca = format!("cacertfile={}", pki.path("ca.pem"));
    refused_by(
        &proxy,
        &proxy.url("localhost", &ca),
        "a client without a certificate",
    )
    .await;
    let with = format!(
        "{ca}&certfile={}&keyfile={}",
        pki.path("client.pem"),
        pki.path("client.key")
    );
    accepted(
        &proxy.url("localhost", &with),
        "a client with its certificate",
    )
    .await;
}

#[test]
fn tls_settings_that_cannot_hold_exit_2_naming_the_key_and_parameter() {
    let pki = pki();
    for (key, url, says) in [
        (
            "OUTBOX_DATABASE_URL",
            "postgres://u:hunter2@db/x?sslmode=prefer".to_string(),
            "sslmode=prefer would connect without TLS",
        ),
        (
            "OUTBOX_DATABASE_URL",
            format!(
                "postgres://u:hunter2@db/x?sslmode=verify-ca&sslrootcert={}&sslcert={}&sslkey={}",
                pki.path("ca.pem"),
                pki.path("client.pem"),
                pki.path("missing.key")
            ),
            "sslkey",
        ),
        (
            "OUTBOX_AMQP_URL",
            format!(
                "amqps://u:hunter2@mq/%2f?cacertfile={}",
                pki.path("missing.pem")
            ),
            "cacertfile",
        ),
    ] {
        let output = relay_command()
            .arg("check-config")
            .env("OUTBOX_TENANTS", "a")
            .env(key, &url)
            .output()
            .expect("the relay binary runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{url}: {stderr}");
        let name = key.trim_start_matches("OUTBOX_").to_ascii_lowercase();
        assert!(stderr.contains(&format!("{name} = ")), "{stderr}");
        assert!(stderr.contains(says), "{stderr}");
        assert!(!stderr.contains("hunter2"), "{stderr}");
    }
}
