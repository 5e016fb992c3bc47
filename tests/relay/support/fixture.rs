//! Cleanup when a test's resources go out of scope, also when the test
//! panics: its schema dropped, its exchange and queues deleted (a relay
//! process is killed by its own `Drop`, in `process`).
//!
//! `Drop` cannot await, and a test's runtime may have one thread, which is
//! the thread that drops: the cleanup therefore runs on a thread of its own
//! with a small runtime and fresh connections, and the test waits for it at
//! most [`DEADLINE`]. A cleanup that fails or is late is reported on stderr,
//! never as a panic that would hide the test's own (or abort the process).

use std::future::Future;
use std::sync::mpsc;
use std::time::Duration;

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::{Channel, Connection, ConnectionProperties};
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio_postgres::NoTls;
use tokio_postgres::error::SqlState;

/// How long a test waits for its cleanup before it goes on without it.
const DEADLINE: Duration = Duration::from_secs(15);

/// How long the cleanup's `DROP SCHEMA` waits for a lock before it ends the
/// sessions that hold one in the schema (the test's own, left behind: an
/// in-process relay frozen with its runtime, a transaction never ended).
const LOCK_TIMEOUT: &str = "2s";

/// A schema the test owns: dropped, with everything in it, when this goes
/// out of scope.
pub struct OwnedSchema {
    database_url: String,
    schema: String,
}

impl OwnedSchema {
    pub fn new(database_url: &str, schema: &str) -> OwnedSchema {
        OwnedSchema {
            database_url: database_url.to_string(),
            schema: schema.to_string(),
        }
    }
}

impl Drop for OwnedSchema {
    fn drop(&mut self) {
        let (url, schema) = (self.database_url.clone(), self.schema.clone());
        run_at_drop(&format!("schema {schema}"), drop_schema(url, schema));
    }
}

async fn drop_schema(url: String, schema: String) -> Result<(), String> {
    let (client, connection) = tokio_postgres::connect(&url, NoTls)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    let set = format!("SET lock_timeout = '{LOCK_TIMEOUT}'");
    client
        .batch_execute(&set)
        .await
        .map_err(|e| e.to_string())?;
    let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
    loop {
        match client.batch_execute(&drop).await {
            Ok(()) => return Ok(()),
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                client
                    .execute(
                        "SELECT pg_terminate_backend(l.pid) FROM pg_locks l
                         JOIN pg_class c ON c.oid = l.relation
                         JOIN pg_namespace n ON n.oid = c.relnamespace
                         WHERE n.nspname = $1 AND l.pid <> pg_backend_pid()",
                        &[&schema],
                    )
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// A role the test created (with a unique name): its sessions ended, what
/// it owns and its grants dropped, and itself, when this goes out of scope.
pub struct OwnedRole {
    database_url: String,
    role: String,
}

impl OwnedRole {
    pub fn new(database_url: &str, role: &str) -> OwnedRole {
        OwnedRole {
            database_url: database_url.to_string(),
            role: role.to_string(),
        }
    }
}

impl Drop for OwnedRole {
    fn drop(&mut self) {
        let (url, role) = (self.database_url.clone(), self.role.clone());
        run_at_drop(&format!("role {role}"), async move {
            let (client, connection) = tokio_postgres::connect(&url, NoTls)
                .await
                .map_err(|e| e.to_string())?;
            tokio::spawn(connection);
            client
                .execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1",
                    &[&role],
                )
                .await
                .map_err(|e| e.to_string())?;
            let role = role.replace('"', "\"\"");
            client
                .batch_execute(&format!(
                    "DROP OWNED BY \"{role}\"; DROP ROLE IF EXISTS \"{role}\""
                ))
                .await
                .map_err(|e| e.to_string())
        });
    }
}

/// Deletes `queues` and then `exchange` on the broker at `url`; a failed
/// delete (which closes its channel) does not stop the others.
pub fn delete_on_broker(url: &str, exchange: &str, queues: Vec<String>) {
    let (url, exchange) = (url.to_string(), exchange.to_string());
    run_at_drop(&format!("exchange {exchange}"), async move {
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .map_err(|e| e.to_string())?;
        let mut failures = Vec::new();
        for queue in &queues {
            let channel = channel(&connection).await?;
            if let Err(e) = channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await
            {
                failures.push(format!("queue {queue}: {e}"));
            }
        }
        let channel = channel(&connection).await?;
        if let Err(e) = channel
            .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await
        {
            failures.push(format!("exchange {exchange}: {e}"));
        }
        let _ = connection.close(200, "cleaned up".into()).await;
        if failures.is_empty() {
            Ok(())
        } else {
            Err(failures.join("; "))
        }
    });
}

async fn channel(connection: &Connection) -> Result<Channel, String> {
    connection.create_channel().await.map_err(|e| e.to_string())
}

/// Runs `cleanup` on a thread of its own and waits for it, at most
/// [`DEADLINE`]: on a multi-threaded runtime the wait hands this worker's
/// tasks to another thread first (unless unwinding, where the test's body
/// is being torn down anyway).
fn run_at_drop<F>(what: &str, cleanup: F)
where
    F: Future<Output = Result<(), String>> + Send + 'static,
{
    let (done, finished) = mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("test-cleanup".into())
        .spawn(move || {
            let outcome = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime.block_on(async {
                    tokio::time::timeout(DEADLINE, cleanup)
                        .await
                        .unwrap_or_else(|_| Err(format!("not done within {DEADLINE:?}")))
                }),
                Err(e) => Err(e.to_string()),
            };
            let _ = done.send(outcome);
        });
    if let Err(e) = spawned {
        eprintln!("cleanup of {what} did not start: {e}");
        return;
    }
    let wait = || finished.recv_timeout(DEADLINE + Duration::from_secs(1));
    let multi_threaded = Handle::try_current()
        .is_ok_and(|handle| handle.runtime_flavor() == RuntimeFlavor::MultiThread);
    let outcome = if multi_threaded && !std::thread::panicking() {
        tokio::task::block_in_place(wait)
    } else {
        wait()
    };
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => eprintln!("cleanup of {what} failed: {e}"),
        Err(_) => eprintln!("cleanup of {what} did not finish within {DEADLINE:?}"),
    }
}
