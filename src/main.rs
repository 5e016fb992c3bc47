//! The `outbox-relay` command: parse, load the configuration, start logging,
//! run until a signal, report how it ended.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{ArgGroup, Args, Parser, Subcommand};
use outbox_relay::config::{CONFIG_FILE_VAR, Config, Flags as KeyFlags, Loaded, Sources, Tenants};
use outbox_relay::{migrate, shutdown, store, telemetry, traces};
use tokio::runtime::Runtime;

/// The allocator. Publishing allocates a few dozen small objects per message
/// (lapin's promises and frames, the envelope's properties and headers), and
/// the system allocator spent about a third of the relay's instructions on
/// them (callgrind, one tenant drained). mimalloc's version 2 gives freed
/// memory back to the system within 10 ms (version 3 keeps it for a second,
/// which let the peak with the heaviest rows pass the manifests' limit).
/// Built with `no_thp`: it asks for no transparent huge pages, which the
/// kernel zeroed 2 MiB at a time each time a purged page was touched again
/// (a tenth of the relay's CPU in a drain by 3 relays; docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    flags: Options,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Relay until SIGTERM, SIGINT or SIGHUP (the default).
    Run,
    /// Apply the migrations and exit.
    Migrate {
        /// Print the migrations' SQL for the configured schema and table (a
        /// psql script) instead of applying them; connects to nothing.
        #[arg(long)]
        print: bool,
        /// The second step of the writer lock: move the table's writers to
        /// the shared lock, in which they never wait for each other. Refused
        /// while a relay older than this one reads the table.
        #[arg(long)]
        finish: bool,
        /// With --finish: take the step even beside older relays (a WARN
        /// names each one).
        #[arg(long, requires = "finish")]
        force: bool,
    },
    /// Print the effective configuration (secrets redacted) and exit.
    CheckConfig,
    /// Print each tenant's pending rows, lag and blocking row; exit 1 when any
    /// tenant is past max_lag_ms.
    Status {
        /// JSON for scripts instead of a table.
        #[arg(long)]
        json: bool,
        /// Each last_error whole, not cut to fit the table.
        #[arg(long)]
        wide: bool,
    },
    /// Make parked rows pending again: they go out next of their tenant's
    /// pending rows, after the rows published while they were parked. Exit 1
    /// when no parked row matched.
    #[command(group(ArgGroup::new("which").required(true).args(["id", "tenant"])))]
    Requeue {
        /// The parked row's id.
        #[arg(long, value_name = "N")]
        id: Option<i64>,
        /// Every parked row of this tenant.
        #[arg(long, value_name = "T")]
        tenant: Option<String>,
    },
    /// End a parked row without sending it: it stays in the table, marked
    /// discarded, never published; replay skips it. Exit 1 when no parked row
    /// matched.
    Discard {
        /// The parked row's id.
        #[arg(long, value_name = "N")]
        id: i64,
    },
    /// Send a tenant's published rows again, in order, with their original
    /// message_id and the header outbox-replay: true (consumers that
    /// deduplicate on message_id drop them). Exit 1 when no row matched or
    /// one was refused.
    Replay {
        /// The tenant whose rows are sent again.
        #[arg(long, value_name = "T")]
        tenant: String,
        /// The first id of the range.
        #[arg(long, value_name = "A")]
        from_id: i64,
        /// The last id of the range (default: the latest).
        #[arg(long, value_name = "B")]
        to_id: Option<i64>,
    },
    /// Print each message published to the exchange as it arrives (a
    /// temporary queue, deleted when tail stops).
    Tail {
        /// Which messages: a binding key of the exchange.
        #[arg(long, default_value = "#")]
        routing_key: String,
        /// One JSON object per message, the whole body included.
        #[arg(long)]
        json: bool,
    },
}

/// The configuration file, and one flag per configuration key.
#[derive(Debug, Args)]
struct Options {
    /// TOML configuration file [env: OUTBOX_CONFIG]
    #[arg(long, global = true, value_name = "PATH")]
    config: Option<PathBuf>,
    #[command(flatten)]
    keys: KeyFlags,
}

fn main() -> ExitCode {
    let mut cli = Cli::parse();
    if let Some(Command::Tail { .. }) = cli.command {
        // `tail --routing-key K` is a binding key, not the relay's template:
        // clap gives it to the global flag of the same name too, which would
        // check it as a template (`a{b}.#` is a fine binding key).
        cli.flags.keys.routing_key = None;
    }
    let (loaded, tracing_settings) = match load(&cli.flags) {
        Ok(loaded) => loaded,
        Err(error) => {
            eprintln!("outbox-relay: configuration error: {error}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let command = cli.command.unwrap_or(Command::Run);
    if let Command::CheckConfig = command {
        warn_unknown_env_on_stderr(&loaded);
        out(&(loaded.render() + &tracing_settings.render()));
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
    match command {
        Command::Migrate {
            print: true,
            finish,
            ..
        } => print_migration(&loaded, finish),
        Command::Tail { routing_key, json } => tail(&runtime, &loaded, &routing_key, json),
        Command::Status { json, wide } => {
            // stdout is the report: no log lines there.
            warn_unknown_env_on_stderr(&loaded);
            runtime.block_on(status(loaded.config, json, wide))
        }
        Command::Requeue { .. } | Command::Discard { .. } | Command::Replay { .. } => {
            // stdout is what changed: no log lines there.
            warn_unknown_env_on_stderr(&loaded);
            // A replay publishes: its rows get spans as the relay's do.
            let traced = matches!(command, Command::Replay { .. });
            let exporting = match install_traces(traced, &tracing_settings) {
                Ok(exporting) => exporting,
                Err(code) => return code,
            };
            let grace = loaded.config.shutdown_grace();
            let code = runtime.block_on(lifecycle(loaded.config, command));
            if let Some(exporting) = exporting {
                exporting.shutdown(grace);
            }
            code
        }
        command => run_logged(&runtime, loaded, command, &tracing_settings),
    }
}

/// The configuration, from its layers, and the tracing settings; an error
/// as it is shown.
fn load(flags: &Options) -> Result<(Loaded, traces::Settings), String> {
    let file = flags
        .config
        .clone()
        .or_else(|| std::env::var_os(CONFIG_FILE_VAR).map(PathBuf::from));
    let loaded = Sources::from_process(file, flags.keys.layer())
        .load()
        .map_err(|error| error.to_string())?;
    // Traces are configured by the standard OTEL_* variables alone.
    let tracing_settings = traces::Settings::from_env().map_err(|error| error.to_string())?;
    Ok((loaded, tracing_settings))
}

/// Writes a command's output to stdout. A reader that stopped reading (`|
/// head`) ends the output quietly, where `print!` would panic; another
/// failure to write is said on stderr.
fn out(text: &str) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    let written = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush());
    match written {
        Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => {
            eprintln!("outbox-relay: cannot write the output: {error}");
        }
        _ => {}
    }
}

/// `migrate --print`: the migration script (or, with `--finish`, the one
/// that finishes it), for the operator to run.
fn print_migration(loaded: &Loaded, finish: bool) -> ExitCode {
    // stdout is the script: no log lines there.
    warn_unknown_env_on_stderr(loaded);
    let (schema, table) = (&loaded.config.schema, &loaded.config.table);
    let script = if finish {
        migrate::finish_script(schema, table)
    } else {
        migrate::script(schema, table)
    };
    out(&script);
    ExitCode::SUCCESS
}

/// `tail`: the messages the relay publishes, until a signal.
fn tail(runtime: &Runtime, loaded: &Loaded, routing_key: &str, json: bool) -> ExitCode {
    // stdout is the messages: no log lines there.
    warn_unknown_env_on_stderr(loaded);
    let mut out = std::io::stdout();
    let result = runtime.block_on(outbox_relay::tail::run(
        &loaded.config,
        routing_key,
        json,
        &mut out,
        shutdown::signal(),
    ));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("outbox-relay: {error}");
            ExitCode::from(EXIT_FATAL)
        }
    }
}

/// The relay (or `migrate`), with logging on stdout, and traces exported
/// when configured (not for `migrate`): runs until a signal, gives the
/// exporter at most 1 s, within what is left of the grace period, and
/// reports how it ended.
fn run_logged(
    runtime: &Runtime,
    loaded: Loaded,
    command: Command,
    tracing_settings: &traces::Settings,
) -> ExitCode {
    let traced = !matches!(command, Command::Migrate { .. });
    let exporting = match install_traces(traced, tracing_settings) {
        Ok(exporting) => exporting,
        Err(code) => return code,
    };
    telemetry::init(loaded.config.log_format, &loaded.config.log);
    warn_unknown_env(&loaded);
    if let traces::Settings::On(export) = tracing_settings
        && exporting.is_some()
    {
        tracing::info!(
            endpoint = %outbox_relay::redact::redact_endpoint(&export.endpoint),
            sampler = %export.sampling,
            "exporting traces over OTLP/HTTP"
        );
    }
    let grace = loaded.config.shutdown_grace();
    let signalled = std::sync::Arc::new(std::sync::OnceLock::new());
    let result = runtime.block_on({
        let signalled = signalled.clone();
        async move {
            match command {
                Command::Migrate { finish, force, .. } => {
                    migrate_once(loaded.config, finish.then_some(force)).await
                }
                _ => outbox_relay::run(loaded.config, async move {
                    shutdown::signal().await;
                    let _ = signalled.set(std::time::Instant::now());
                })
                .await
                .map_err(anyhow::Error::from),
            }
        }
    });
    if let Some(exporting) = exporting {
        // What is left of the grace period, at most 1 s, on a thread of its own.
        let left = signalled.get().map_or(grace, |at: &std::time::Instant| {
            grace.saturating_sub(at.elapsed())
        });
        exporting.shutdown(left);
    }
    report_exit(result)
}

/// Starts exporting traces as `settings` say, for a command that publishes
/// (`traced`); the exit code when the exporter cannot be built. Called
/// before the runtime runs: the exporter's blocking client is not to be
/// made inside it.
fn install_traces(
    traced: bool,
    settings: &traces::Settings,
) -> Result<Option<traces::Exporting>, ExitCode> {
    if !traced {
        return Ok(None);
    }
    traces::install(settings).map_err(|error| {
        eprintln!("outbox-relay: configuration error: traces: {error}");
        ExitCode::from(EXIT_CONFIG)
    })
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

/// `migrate`: applies the migrations (with `finish`, the second step of the
/// writers' lock too, forced or not), then checks the table's columns (an
/// existing table keeps its own, which may be ones the relay cannot read):
/// an unfit one exits 2, as a configuration the relay cannot use.
async fn migrate_once(config: Config, finish: Option<bool>) -> anyhow::Result<()> {
    use anyhow::Context;
    let store = store::Store::new(&config)?;
    match finish {
        Some(force) => migrate::finish(&store, &config, force).await,
        None => migrate::run(&store, &config).await.map_err(Into::into),
    }
    .context("cannot apply the migrations")?;
    store
        .check_columns()
        .await
        .context("the migrations are applied, but the table cannot be relayed")?;
    Ok(())
}

/// `status`: exit 0 when every tenant is within max_lag_ms, 1 when one is
/// not (or the database cannot be asked); 2 when a column of the table is one
/// the relay cannot read (said on stderr after the report).
async fn status(config: Config, json: bool, wide: bool) -> ExitCode {
    let result = async {
        let store = store::Store::new(&config)?;
        let unfit = match store.check_columns().await {
            Ok(_) => None,
            Err(error @ store::StoreError::Columns(_)) => Some(error),
            Err(error) => return Err(error.into()),
        };
        // Discovered tenants: those with pending or parked rows.
        let names: Vec<String> = match &config.tenants {
            Tenants::Listed(names) => names.clone(),
            Tenants::Discovered => store.tenants_with_rows().await?,
        };
        let tenants = store.tenant_status(&names).await?;
        Ok::<_, anyhow::Error>((
            outbox_relay::status::Report::new(config.max_lag_ms, tenants),
            unfit,
        ))
    }
    .await;
    match result {
        Ok((report, unfit)) => {
            out(&if json {
                report.json() + "\n"
            } else {
                report.table(wide)
            });
            if let Some(error) = &unfit {
                eprintln!("outbox-relay: {error}");
            }
            if unfit.is_some() {
                ExitCode::from(EXIT_CONFIG)
            } else if report.lagging {
                ExitCode::from(EXIT_FATAL)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(error) => {
            eprintln!("outbox-relay: cannot read the outbox: {}", causes(&error));
            ExitCode::from(EXIT_FATAL)
        }
    }
}

/// `requeue`, `discard`, `replay`: print what changed and exit 0; exit 1
/// when nothing matched or the command failed; 2 on arguments that cannot be
/// used together.
async fn lifecycle(config: Config, command: Command) -> ExitCode {
    use outbox_relay::lifecycle;
    if let Command::Replay {
        from_id,
        to_id: Some(to_id),
        ..
    } = &command
        && to_id < from_id
    {
        eprintln!("outbox-relay: --to-id ({to_id}) is below --from-id ({from_id})");
        return ExitCode::from(EXIT_CONFIG);
    }
    let store = match store::Store::new(&config) {
        Ok(store) => store,
        Err(error) => {
            eprintln!("outbox-relay: {error}");
            return ExitCode::from(EXIT_FATAL);
        }
    };
    type Said = fn(&[store::Changed]) -> String;
    let (changed, what, said): (_, _, Said) = match command {
        Command::Requeue { id: Some(id), .. } => (
            store.requeue(id).await,
            format!("id {id}"),
            lifecycle::requeued_text,
        ),
        Command::Requeue {
            tenant: Some(tenant),
            ..
        } => (
            store.requeue_tenant(&tenant).await,
            format!("tenant {tenant:?}"),
            lifecycle::requeued_text,
        ),
        Command::Discard { id } => (
            store.discard(id).await,
            format!("id {id}"),
            lifecycle::discarded_text,
        ),
        Command::Replay {
            tenant,
            from_id,
            to_id,
        } => return replay(&config, &store, &tenant, from_id, to_id).await,
        _ => return ExitCode::from(EXIT_CONFIG),
    };
    match changed {
        Ok(rows) if rows.is_empty() => {
            eprintln!("outbox-relay: no parked row matched ({what}); nothing changed");
            ExitCode::from(EXIT_FATAL)
        }
        Ok(rows) => {
            out(&said(&rows));
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("outbox-relay: {error}");
            ExitCode::from(EXIT_FATAL)
        }
    }
}

/// `replay`: exit 0 once every row of the range was confirmed; 1 when none
/// matched, or one was refused (the error names it).
async fn replay(
    config: &Config,
    store: &store::Store,
    tenant: &str,
    from_id: i64,
    to_id: Option<i64>,
) -> ExitCode {
    use outbox_relay::lifecycle;
    let to = to_id.unwrap_or(i64::MAX);
    match lifecycle::replay(config, store, tenant, from_id, to).await {
        Ok(replayed) if replayed.count == 0 => {
            let to = to_id.map_or_else(|| "the latest".to_string(), |id| id.to_string());
            eprintln!(
                "outbox-relay: no published row of tenant {tenant:?} with id from {from_id} to {to}; nothing sent"
            );
            ExitCode::from(EXIT_FATAL)
        }
        Ok(replayed) => {
            out(&lifecycle::replayed_text(tenant, &replayed));
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("outbox-relay: {error}");
            ExitCode::from(EXIT_FATAL)
        }
    }
}

/// A failure is said once, on stderr, as a configuration error is: not also
/// as a log line (on a terminal the two showed the same text twice). A
/// table whose columns the relay cannot read exits 2, as bad configuration.
fn report_exit(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("outbox-relay: {}", causes(&error));
            let unfit = error.chain().any(|cause| {
                cause
                    .downcast_ref::<store::StoreError>()
                    .is_some_and(|e| e.drift().is_some())
            });
            ExitCode::from(if unfit { EXIT_CONFIG } else { EXIT_FATAL })
        }
    }
}

/// An error with its causes, down to the first of the relay's own errors:
/// those already say what caused them (the server's message and SQLSTATE,
/// the broker's reply), so the chain below them would only repeat it.
fn causes(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause.to_string());
        if cause.is::<store::StoreError>()
            || cause.is::<migrate::FinishError>()
            || cause.is::<outbox_relay::RunError>()
            || cause.is::<outbox_relay::relay::SetupError>()
            || cause.is::<outbox_relay::publisher::PublishError>()
        {
            break;
        }
    }
    text
}
