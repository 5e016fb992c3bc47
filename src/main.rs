//! The `outbox-relay` command: parse, load the configuration, start logging,
//! run until a signal, report how it ended.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use figment::value::{Dict, Value};
use outbox_relay::config::{CONFIG_FILE_VAR, Config, Loaded, Sources};
use outbox_relay::{migrate, shutdown, store, telemetry};

/// Exit code for a configuration that cannot be used.
const EXIT_CONFIG: u8 = 2;
/// Exit code for anything else fatal.
const EXIT_FATAL: u8 = 1;

/// Relays committed outbox rows from PostgreSQL to RabbitMQ, per tenant, in
/// order, at least once.
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    flags: Flags,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Relay until SIGTERM or SIGINT (the default).
    Run,
    /// Apply the migrations and exit.
    Migrate,
    /// Print the effective configuration (secrets redacted) and exit.
    CheckConfig,
    /// Print each tenant's pending rows, lag and blocking row; exit 1 when any
    /// tenant is past max_lag_ms.
    Status {
        /// JSON for scripts instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// One flag per configuration key; each overrides file and environment.
#[derive(Debug, Args)]
struct Flags {
    /// TOML configuration file [env: OUTBOX_CONFIG]
    #[arg(long, global = true, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Tenants to relay, comma-separated
    #[arg(long, global = true, value_delimiter = ',', value_name = "NAMES")]
    tenants: Option<Vec<String>>,
    /// Poll interval when idle, ms (1..=60000)
    #[arg(long, global = true, value_name = "MS")]
    poll_ms: Option<i64>,
    /// Lag past which /healthz answers 503, ms
    #[arg(long, global = true, value_name = "MS")]
    max_lag_ms: Option<i64>,
    /// Longest per-tenant back-off, ms
    #[arg(long, global = true, value_name = "MS")]
    max_backoff_ms: Option<i64>,
    /// Rows per sweep (1..=10000)
    #[arg(long, global = true, value_name = "N")]
    batch_size: Option<i64>,
    /// Unconfirmed messages at most (1..=batch_size)
    #[arg(long, global = true, value_name = "N")]
    max_in_flight: Option<i64>,
    /// Tenants swept at once (1..=1024)
    #[arg(long, global = true, value_name = "N")]
    concurrency: Option<i64>,
    /// PostgreSQL URL [env: OUTBOX_DATABASE_URL, DATABASE_URL]
    #[arg(long, global = true, value_name = "URL")]
    database_url: Option<String>,
    /// Database connections (> concurrency)
    #[arg(long, global = true, value_name = "N")]
    pool_size: Option<i64>,
    /// Schema of the outbox table
    #[arg(long, global = true)]
    schema: Option<String>,
    /// Name of the outbox table
    #[arg(long, global = true)]
    table: Option<String>,
    /// RabbitMQ URL [env: OUTBOX_AMQP_URL, AMQP_URL]
    #[arg(long, global = true, value_name = "URL")]
    amqp_url: Option<String>,
    /// Exchange to publish to
    #[arg(long, global = true)]
    exchange: Option<String>,
    /// Exchange type: direct, fanout, topic, headers or x-…
    #[arg(long, global = true, value_name = "TYPE")]
    exchange_type: Option<String>,
    /// Declare the exchange (durable) on connect
    #[arg(long, global = true, value_name = "BOOL")]
    declare_exchange: Option<bool>,
    /// Routing key template: {tenant}, {kind}, {subject}
    #[arg(long, global = true, value_name = "TEMPLATE")]
    routing_key: Option<String>,
    /// content_type of every message
    #[arg(long, global = true)]
    content_type: Option<String>,
    /// A confirm not seen in this long is a refusal, ms
    #[arg(long, global = true, value_name = "MS")]
    confirm_timeout_ms: Option<i64>,
    /// Larger payloads are refused as too_large
    #[arg(long, global = true, value_name = "BYTES")]
    max_payload_bytes: Option<i64>,
    /// Address of the HTTP endpoints
    #[arg(long, global = true, value_name = "ADDR")]
    http_addr: Option<String>,
    /// How long running sweeps may finish after SIGTERM, ms
    #[arg(long, global = true, value_name = "MS")]
    shutdown_grace_ms: Option<i64>,
    /// Apply migrations at start
    #[arg(long, global = true, value_name = "BOOL")]
    migrate: Option<bool>,
    /// json, text or auto
    #[arg(long, global = true, value_name = "FORMAT")]
    log_format: Option<String>,
    /// Tracing filter [env: OUTBOX_LOG, RUST_LOG]
    #[arg(long, global = true, value_name = "FILTER")]
    log: Option<String>,
}

impl Flags {
    /// The flags that were given, as a figment layer.
    fn layer(&self) -> Dict {
        let mut dict = Dict::new();
        let mut put = |key: &str, value: Option<Value>| {
            if let Some(value) = value {
                dict.insert(key.into(), value);
            }
        };
        let text = |v: &Option<String>| v.clone().map(Value::from);
        let int = |v: &Option<i64>| v.map(Value::from);
        put("tenants", self.tenants.clone().map(Value::from));
        put("poll_ms", int(&self.poll_ms));
        put("max_lag_ms", int(&self.max_lag_ms));
        put("max_backoff_ms", int(&self.max_backoff_ms));
        put("batch_size", int(&self.batch_size));
        put("max_in_flight", int(&self.max_in_flight));
        put("concurrency", int(&self.concurrency));
        put("database_url", text(&self.database_url));
        put("pool_size", int(&self.pool_size));
        put("schema", text(&self.schema));
        put("table", text(&self.table));
        put("amqp_url", text(&self.amqp_url));
        put("exchange", text(&self.exchange));
        put("exchange_type", text(&self.exchange_type));
        put("declare_exchange", self.declare_exchange.map(Value::from));
        put("routing_key", text(&self.routing_key));
        put("content_type", text(&self.content_type));
        put("confirm_timeout_ms", int(&self.confirm_timeout_ms));
        put("max_payload_bytes", int(&self.max_payload_bytes));
        put("http_addr", text(&self.http_addr));
        put("shutdown_grace_ms", int(&self.shutdown_grace_ms));
        put("migrate", self.migrate.map(Value::from));
        put("log_format", text(&self.log_format));
        put("log", text(&self.log));
        dict
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let file = cli
        .flags
        .config
        .clone()
        .or_else(|| std::env::var_os(CONFIG_FILE_VAR).map(PathBuf::from));
    let loaded = match Sources::from_process(file, cli.flags.layer()).load() {
        Ok(loaded) => loaded,
        Err(error) => {
            eprintln!("outbox-relay: configuration error: {error}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let command = cli.command.unwrap_or(Command::Run);
    if let Command::CheckConfig = command {
        warn_unknown_env_on_stderr(&loaded);
        print!("{}", loaded.render());
        return ExitCode::SUCCESS;
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("outbox-relay: cannot start the async runtime: {error}");
            return ExitCode::from(EXIT_FATAL);
        }
    };
    if let Command::Status { json } = command {
        // stdout is the report: no log lines there.
        warn_unknown_env_on_stderr(&loaded);
        return runtime.block_on(status(loaded.config, json));
    }
    telemetry::init(loaded.config.log_format, &loaded.config.log);
    warn_unknown_env(&loaded);
    let result = runtime.block_on(async move {
        match command {
            Command::Migrate => migrate_once(loaded.config).await,
            _ => outbox_relay::run(loaded.config, shutdown::signal())
                .await
                .map_err(anyhow::Error::from),
        }
    });
    report_exit(result)
}

/// For commands whose stdout is their output (`check-config`, `status`).
fn warn_unknown_env_on_stderr(loaded: &Loaded) {
    for name in &loaded.unknown_env {
        eprintln!("outbox-relay: warning: ignoring {name}: it names no configuration key");
    }
}

fn warn_unknown_env(loaded: &Loaded) {
    if !loaded.unknown_env.is_empty() {
        tracing::warn!(
            variables = ?loaded.unknown_env,
            "ignoring OUTBOX_* environment variables that name no configuration key"
        );
    }
}

async fn migrate_once(config: Config) -> anyhow::Result<()> {
    use anyhow::Context;
    let store = store::Store::new(&config).map_err(anyhow::Error::msg)?;
    migrate::run(&store, &config)
        .await
        .context("cannot apply the migrations")?;
    Ok(())
}

/// `status`: exit 0 when every tenant is within max_lag_ms, 1 when one is
/// not (or the database cannot be asked).
async fn status(config: Config, json: bool) -> ExitCode {
    let result = async {
        let store = store::Store::new(&config).map_err(anyhow::Error::msg)?;
        let tenants = store.tenant_status(&config.tenants).await?;
        Ok::<_, anyhow::Error>(outbox_relay::status::Report::new(
            config.max_lag_ms,
            tenants,
        ))
    }
    .await;
    match result {
        Ok(report) => {
            print!(
                "{}",
                if json {
                    report.json() + "\n"
                } else {
                    report.table()
                }
            );
            if report.lagging {
                ExitCode::from(EXIT_FATAL)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(error) => {
            eprintln!("outbox-relay: cannot read the outbox: {error:#}");
            ExitCode::from(EXIT_FATAL)
        }
    }
}

fn report_exit(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(error = format!("{error:#}"), "outbox-relay failed");
            eprintln!("outbox-relay: {error:#}");
            ExitCode::from(EXIT_FATAL)
        }
    }
}
