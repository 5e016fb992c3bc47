//! Connections: each host of the target tried in turn, TLS, the server's
//! keepalives set once per session, and the pool that opens them.

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime, Timeouts};
use futures_util::future::BoxFuture;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{Client, Connection, Socket};

use super::{StoreError, describe};
use crate::config::{Config, DatabaseTarget};

/// Deadline for opening a connection (TCP, TLS, authentication).
pub const CONNECT_TIMEOUT: Duration = crate::config::DATABASE_CONNECT_TIMEOUT;

/// How long a caller waits for a free pooled connection.
pub const POOL_WAIT_TIMEOUT: Duration = Duration::from_secs(5);

/// The connector the pool hands tokio-postgres: the target's TLS client
/// configuration, or, for a plain target (`sslmode=disable`, never asked to
/// use it), one that trusts nothing.
pub(crate) fn tls_connector(
    tls: Option<&rustls::ClientConfig>,
) -> tokio_postgres_rustls::MakeRustlsConnect {
    let config = match tls {
        Some(config) => config.clone(),
        None => rustls::ClientConfig::builder()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth(),
    };
    tokio_postgres_rustls::MakeRustlsConnect::new(config)
}

/// The TLS stream of a database connection (plain when `sslmode` asks for
/// none).
pub(crate) type TlsStream =
    <tokio_postgres_rustls::MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream;

/// Connects to the first host of `target` that takes the connection (and,
/// with `target_session_attrs=read-write`, takes writes), trying them in
/// turn, each within its own connect timeout, so that a host that never
/// answers (a blackholed address, a stalled path) does not spend the others'
/// time. The last host has the rest of the caller's deadline; the error is
/// the last host's.
pub(crate) async fn connect(
    target: &DatabaseTarget,
) -> Result<(Client, Connection<Socket, TlsStream>), tokio_postgres::Error> {
    let tls = tls_connector(target.tls.as_deref());
    let hosts = target.hosts();
    let (last, earlier) = hosts
        .split_last()
        .expect("a database target names at least one host");
    for host in earlier {
        match tokio::time::timeout(target.connect_timeout(), host.connect(tls.clone())).await {
            Ok(Ok(connected)) => return Ok(connected),
            Ok(Err(error)) => {
                tracing::debug!(error = %describe(&error), "database host not taken; trying the next");
            }
            Err(_) => tracing::debug!(
                timeout = ?target.connect_timeout(),
                "database host did not answer in time; trying the next"
            ),
        }
    }
    last.connect(tls).await
}

/// The server's side of a connection's TCP keepalives, as the client's (see
/// `config::KEEPALIVE_IDLE`): a relay that vanishes without closing its
/// connections (a partition) is noticed by the server within about 30 s,
/// not the kernel's two hours. Session settings, set once per connection;
/// through PgBouncer they land on its server connection, where they are as
/// good.
pub(crate) fn session_keepalives() -> String {
    use crate::config::{KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_RETRIES};
    format!(
        "SET tcp_keepalives_idle = {}; SET tcp_keepalives_interval = {}; \
         SET tcp_keepalives_count = {KEEPALIVE_RETRIES}",
        KEEPALIVE_IDLE.as_secs(),
        KEEPALIVE_INTERVAL.as_secs()
    )
}

/// How the pool opens a connection: [`connect`], then the server's
/// keepalives.
struct HostByHost {
    target: DatabaseTarget,
    keepalives: String,
}

impl deadpool_postgres::Connect for HostByHost {
    fn connect(
        &self,
        _: &tokio_postgres::Config,
    ) -> BoxFuture<'_, Result<(Client, tokio::task::JoinHandle<()>), tokio_postgres::Error>> {
        Box::pin(async move {
            let (client, connection) = connect(&self.target).await?;
            let task = tokio::spawn(async move {
                if let Err(error) = connection.await {
                    tracing::debug!(error = %describe(&error), "database connection ended");
                }
            });
            client.batch_execute(&self.keepalives).await?;
            Ok((client, task))
        })
    }
}

/// The pool of connections to the configured target, each session named
/// `application_name` when given; no connection is opened until one is
/// needed.
pub(super) fn pool(config: &Config, application_name: Option<&str>) -> Result<Pool, StoreError> {
    let mut target = config.database_url.clone();
    if let Some(name) = application_name {
        target.set_application_name(name);
    }
    // Every host's connect timeout, and the keepalives' round trip.
    let create = target.connect_deadline().saturating_add(CONNECT_TIMEOUT);
    let manager = Manager::from_connect(
        target.config.clone(),
        HostByHost {
            target,
            keepalives: session_keepalives(),
        },
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(config.pool_size)
        .timeouts(Timeouts {
            wait: Some(POOL_WAIT_TIMEOUT),
            create: Some(create),
            recycle: Some(CONNECT_TIMEOUT),
        })
        .runtime(Runtime::Tokio1)
        .build()
        .map_err(StoreError::Build)
}
