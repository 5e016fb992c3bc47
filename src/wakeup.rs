//! The wake-up (`wakeup = notify`): a connection of its own, never from the
//! pool, LISTENs on the channel the outbox table's trigger notifies with the
//! tenant of each transaction that inserted rows, so the scheduler sweeps that
//! tenant at once instead of at the next poll.
//!
//! A notification is a hint, never the only way a row is found: it can be
//! lost with its connection, switched off by a writer
//! (`outbox_relay.notify = off`) or never sent (a table without the trigger).
//! The poll finds every such row within `poll_ms`. So the connection is
//! watched, not trusted: keepalives notice a half-open path; a lost
//! connection sets `outbox_wakeup_connected` to 0, warns once, reconnects
//! with back-off and, once LISTENing again, asks for a poll at once (rows
//! committed meanwhile notified no one). It does not touch readiness.
//!
//! With `target_session_attrs=read-write` (several hosts, a failover), the
//! connection also checks, once per poll interval (at least a second apart),
//! that its server still takes writes: a primary demoted in a failover may
//! stay up and keep the LISTEN, but no writer notifies there any more. When
//! it does not, the connection is dropped and made again, to the new
//! primary.
//!
//! With several replicas, each LISTEN connection is named
//! `outbox-relay:<channel hash>:<tenants hash>:<instance id>:u<level>` (the
//! level: the newest migration the relay knows); the poll reads
//! back the names of the replicas of the same table and the same `tenants`
//! (see `store/pending_tenants.sql`), and a notified tenant is swept at once
//! only by its owner among them (rendezvous hashing), so the other replicas'
//! claims are not spent on it. A relay configured for other tenants is no
//! member: it could own a tenant it does not relay. A relay that starts
//! LISTENing notifies the channel with an empty payload ("poll now"), so the
//! others see it at once. With `wakeup = poll` there is no LISTEN connection:
//! the relay's pool sessions carry the same name (see `Relay::from_config`),
//! so the poll still finds the members and each replica sweeps from it the
//! tenants it owns.
//!
//! Before it takes the wake-up lock or LISTENs, each new connection checks
//! that it keeps its session between transactions (see `session`). Through
//! a pool that lends a server connection per transaction it does neither:
//! it warns once, closes, and the scheduler watches the id sequence whether
//! rows flow or not (see [`Wakeups::pooled`]).

mod session;

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::future::poll_fn;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_postgres::{AsyncMessage, Client, Connection};

use crate::backoff::Backoff;
use crate::config::{Config, DatabaseTarget, Tenants};
use crate::metrics::Metrics;
use crate::migrate::{fnv1a, quote_literal, wakeup_channel};
use crate::shutdown::Shutdown;
use crate::sql::relays_prefix;
use crate::store::{QUERY_TIMEOUT, TlsStream, connect, describe, quote_ident, session_keepalives};

/// The first reconnect comes this soon after a loss (a restarted server or a
/// terminated backend is usually back at once) ...
const RECONNECT_FIRST: Duration = Duration::from_millis(100);
/// ... and later ones at most this far apart.
const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// The wake-ups waiting for the scheduler: tenants this relay relays, by
/// name, and whether a poll is asked for. A flood coalesces: each tenant
/// waits once however many notifications name it, so what waits is bounded
/// by the tenants that write (the configured ones, or with `tenants = "*"`
/// those that wrote since the scheduler last took them).
pub struct Wakeups {
    tenants: Tenants,
    /// Configured tenants, for a quick refusal of others' notifications.
    listed: HashSet<String>,
    waiting: Mutex<Waiting>,
    signal: tokio::sync::Notify,
    /// The application_name of this relay's LISTEN connection.
    application_name: String,
    /// What the LISTEN connection of every replica of this table and these
    /// tenants is named before its instance id.
    members_prefix: String,
    /// This relay's instance id, random per process (16 hex digits), and its
    /// upgrade level (`:u<level>`).
    instance: String,
    /// Whether the relay asks writers for notifications: it holds the
    /// wake-up lock while this is true (see `migrations/0005_writer_lock.sql`).
    want_notify: tokio::sync::watch::Sender<bool>,
    /// The wake-up connection does not keep its session (a pool in
    /// transaction mode): no LISTEN, no wake-up lock.
    pooled: AtomicBool,
}

#[derive(Default)]
struct Waiting {
    tenants: Vec<String>,
    queued: HashSet<String>,
    poll: bool,
    held: bool,
}

/// What the scheduler takes at once: the notified tenants, whether to poll
/// now, and whether the wake-up lock was just taken (writers notify from now
/// on; those in flight before may not).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Woken {
    pub tenants: Vec<String>,
    pub poll: bool,
    pub held: bool,
}

impl Wakeups {
    pub fn new(config: &Config) -> Wakeups {
        // Discovering relays are members of one set, told from any list.
        let tenants_hash = match &config.tenants {
            Tenants::Listed(names) => tenants_hash(names),
            Tenants::Discovered => tenants_hash(&["*".to_string()]),
        };
        let members_prefix = format!(
            "{}{tenants_hash:08x}:",
            relays_prefix(&config.schema, &config.table)
        );
        // The upgrade level ends the name: an upgrade step that older relays
        // cannot follow sees them (see `migrate::older_relays`).
        let instance = format!("{:016x}:u{}", random_u64(), crate::migrate::LEVEL);
        Wakeups {
            listed: config.tenants.listed().iter().cloned().collect(),
            tenants: config.tenants.clone(),
            waiting: Mutex::new(Waiting::default()),
            signal: tokio::sync::Notify::new(),
            application_name: format!("{members_prefix}{instance}"),
            members_prefix,
            instance,
            want_notify: tokio::sync::watch::Sender::new(config.wakeup.listens()),
            pooled: AtomicBool::new(false),
        }
    }

    /// Asks writers for notifications (`true`: the LISTEN connection takes
    /// the wake-up lock) or not (`false`: it gives it back).
    pub fn want_notifications(&self, want: bool) {
        self.want_notify.send_if_modified(|wanted| {
            let changed = *wanted != want;
            *wanted = want;
            changed
        });
    }

    /// Whether the wake-up connection was found not to keep its session: no
    /// notification comes, so the scheduler watches the id sequence for
    /// good, idle or not.
    pub fn pooled(&self) -> bool {
        self.pooled.load(Ordering::Relaxed)
    }

    /// The wake-up connection does not keep its session: from now on the
    /// scheduler watches the id sequence (it looks at once).
    fn fall_back(&self) {
        self.pooled.store(true, Ordering::Relaxed);
        self.poll_now();
    }

    /// The LISTEN connection took the wake-up lock.
    fn now_held(&self) {
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        waiting.held = true;
        // Rows committed since the last poll notified no one.
        waiting.poll = true;
        drop(waiting);
        self.signal.notify_one();
    }

    /// A notification's payload: a tenant this relay relays waits for the
    /// scheduler; '' (a name too long for a payload) asks for a poll; any
    /// other tenant is not this relay's.
    pub fn notified(&self, payload: &str) {
        if payload.is_empty() {
            return self.poll_now();
        }
        if !self.tenants.discovers() && !self.listed.contains(payload) {
            return;
        }
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        if !waiting.queued.contains(payload) {
            waiting.queued.insert(payload.to_string());
            waiting.tenants.push(payload.to_string());
        }
        drop(waiting);
        self.signal.notify_one();
    }

    /// Asks the scheduler for a poll now.
    pub fn poll_now(&self) {
        self.waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .poll = true;
        self.signal.notify_one();
    }

    /// Takes every waiting wake-up.
    pub fn take(&self) -> Woken {
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        let tenants = std::mem::take(&mut waiting.tenants);
        waiting.queued.clear();
        Woken {
            tenants,
            poll: std::mem::take(&mut waiting.poll),
            held: std::mem::take(&mut waiting.held),
        }
    }

    /// Resolves when there is something to take (at once if something
    /// arrived since the last wait).
    pub async fn arrived(&self) {
        self.signal.notified().await;
    }

    /// The `LIKE` pattern of the replicas' LISTEN connections' names.
    pub fn members_pattern(&self) -> String {
        format!("{}%", self.members_prefix)
    }

    /// The instance id of a LISTEN connection's name found by the poll.
    pub fn member_of<'a>(&self, application_name: &'a str) -> Option<&'a str> {
        application_name.strip_prefix(&self.members_prefix)
    }

    /// Whether this relay is the successor of `tenant`'s owner among
    /// `members` (see [`first_two`]): the one to take it when its owner
    /// leaves it waiting.
    pub fn succeeds(&self, tenant: &str, members: &[String]) -> bool {
        first_two(tenant, members).1 == Some(&self.instance)
    }

    /// Whether this relay is among `members` (as the last poll saw them).
    pub fn is_member(&self, members: &[String]) -> bool {
        members.contains(&self.instance)
    }

    /// The name this relay's sessions carry to be seen as a member: its
    /// LISTEN connection's (`wakeup = notify`), or its pool's
    /// (`wakeup = poll`).
    pub fn application_name(&self) -> &str {
        &self.application_name
    }

    /// Whether this relay sweeps a notified `tenant` at once: it is the
    /// tenant's owner among `members` (the replicas LISTENing on this
    /// channel, as the last poll saw them), or it does not know who else
    /// listens (alone, or no poll has seen its connection yet). The others
    /// leave the tenant to the owner, and to the poll.
    pub fn sweeps_at_once(&self, tenant: &str, members: &[String]) -> bool {
        !members.contains(&self.instance) || owner(tenant, members) == Some(&self.instance)
    }
}

/// The member that owns `tenant`: the highest hash of (tenant, member), so
/// every replica that sees the same members picks the same owner, and a
/// member leaving moves only its own tenants.
pub fn owner<'a>(tenant: &str, members: &'a [String]) -> Option<&'a String> {
    first_two(tenant, members).0
}

/// The owner of `tenant` and its successor: the member with the second
/// highest hash, the one that would own it were the owner gone. A busy or
/// silent owner's tenants so go to a different successor each, spread over
/// the other members, not all to whichever has nothing to do.
fn first_two<'a>(tenant: &str, members: &'a [String]) -> (Option<&'a String>, Option<&'a String>) {
    let mut first: Option<(u64, &String)> = None;
    let mut second: Option<(u64, &String)> = None;
    for member in members {
        let mut key = Vec::with_capacity(tenant.len() + member.len() + 1);
        key.extend_from_slice(member.as_bytes());
        key.push(0);
        key.extend_from_slice(tenant.as_bytes());
        let hash = mix(fnv1a(&key));
        if first.is_none_or(|(top, _)| hash > top) {
            second = first;
            first = Some((hash, member));
        } else if second.is_none_or(|(next, _)| hash > next) {
            second = Some((hash, member));
        }
    }
    (first.map(|(_, m)| m), second.map(|(_, m)| m))
}

/// 32 bits that tell one set of tenants from another, in any order.
fn tenants_hash(tenants: &[String]) -> u32 {
    let mut sorted: Vec<&str> = tenants.iter().map(String::as_str).collect();
    sorted.sort_unstable();
    let hash = mix(fnv1a(sorted.join("\0").as_bytes()));
    u32::try_from(hash >> 32).unwrap_or_default()
}

/// A finaliser (splitmix64's) that spreads FNV-1a's close values.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A random number (every `RandomState` is freshly keyed).
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

/// Why the LISTEN connection ended.
#[derive(Debug, thiserror::Error)]
enum Lost {
    #[error("{}", describe(.0))]
    Database(#[from] tokio_postgres::Error),
    #[error("the server closed the connection")]
    Closed,
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("the server takes no writes any more (a primary demoted in a failover)")]
    ReadOnly,
    #[error("the connection does not keep its session between transactions")]
    Pooled,
}

/// The writable check comes at most this often.
const WRITABLE_CHECK_MIN: Duration = Duration::from_secs(1);

/// The LISTEN connection's history, across sessions.
#[derive(Default)]
struct Outage {
    /// Connection attempts failed or sessions lost since it last LISTENed.
    failures: u32,
    /// This outage was warned about.
    warned: bool,
}

/// Keeps a LISTEN connection open until `stop` fires, reconnecting with
/// back-off whenever it is lost.
pub async fn run(config: Arc<Config>, wakeups: Arc<Wakeups>, metrics: Metrics, stop: Shutdown) {
    let channel = wakeup_channel(&config.schema, &config.table);
    let wakeup_key = format!("{}.{}", config.schema, config.table);
    let target = listen_target(&config.listen_database_url, &wakeups.application_name);
    let check_every = config.poll_interval().max(WRITABLE_CHECK_MIN);
    let backoff = Backoff::new(RECONNECT_FIRST, RECONNECT_MAX);
    let mut outage = Outage::default();
    loop {
        let session = listen(
            &target,
            (&channel, &wakeup_key),
            &wakeups,
            &metrics,
            &mut outage,
            check_every,
        );
        let error = tokio::select! {
            Err(error) = session => error,
            () = stop.clone().fired() => break,
        };
        metrics.set_wakeup_connected(false);
        if let Lost::Pooled = error {
            tracing::warn!(
                url = %config.listen_database_url,
                "the wake-up connection does not keep its session between transactions \
                 (a pool in transaction mode, such as PgBouncer's): the relay neither LISTENs \
                 nor takes the wake-up lock there, and reads the id sequence every 5 ms even \
                 while idle (about 200 statements a second, where an idle relay sends one per \
                 poll_ms); fix: set listen_database_url to a direct or session-pooled connection"
            );
            wakeups.fall_back();
            stop.clone().fired().await;
            break;
        }
        if !std::mem::replace(&mut outage.warned, true) {
            tracing::warn!(
                %error,
                url = %config.listen_database_url,
                "wake-up connection down; new rows wait for the poll (poll_ms) until it is back"
            );
        }
        let delay = backoff.delay(outage.failures);
        outage.failures = outage.failures.saturating_add(1);
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = stop.clone().fired() => break,
        }
    }
    metrics.set_wakeup_connected(false);
}

/// `listen_database_url` with the LISTEN connection's own name.
fn listen_target(target: &DatabaseTarget, application_name: &str) -> DatabaseTarget {
    let mut target = target.clone();
    target.set_application_name(application_name);
    target
}

/// One LISTEN session: connect, check that the connection keeps its session
/// (else [`Lost::Pooled`]), LISTEN, ask for a poll, then hand every
/// notification to `wakeups` until the connection is lost (or, when only a
/// writable server will do, its server takes no writes any more: checked
/// every `check_every`). Ends `outage` once LISTENing. Meanwhile it holds the
/// wake-up lock while the relay asks for notifications (see
/// [`Wakeups::want_notifications`]): a writer whose try of it fails
/// notifies. Only one session holds it; another relay that wants it takes it
/// when the holder gives it back (the holder then notifies ''), and tries
/// again every `check_every` × 10.
async fn listen(
    target: &DatabaseTarget,
    (channel, wakeup_key): (&str, &str),
    wakeups: &Wakeups,
    metrics: &Metrics,
    outage: &mut Outage,
    check_every: Duration,
) -> Result<Infallible, Lost> {
    let (client, mut connection) = within(target.connect_deadline(), async {
        Ok(connect(target).await?)
    })
    .await?;
    let kept = session::keeps_session(target, &client, &mut connection, wakeups);
    if !within(QUERY_TIMEOUT, kept).await? {
        return Err(Lost::Pooled);
    }
    within(
        QUERY_TIMEOUT,
        start_listening(&client, &mut connection, channel, wakeups),
    )
    .await?;
    metrics.set_wakeup_connected(true);
    if std::mem::take(outage).warned {
        tracing::info!(channel, "wake-up connection LISTENing again");
    } else {
        tracing::info!(channel, "wake-up connection LISTENing");
    }
    // Rows committed while no one listened notified no one.
    wakeups.poll_now();
    let key = quote_literal(wakeup_key);
    let take =
        format!("SELECT pg_try_advisory_lock(hashtext('outbox-relay wakeup'), hashtext({key}))");
    let give_back = format!(
        "SELECT pg_advisory_unlock(hashtext('outbox-relay wakeup'), hashtext({key})); NOTIFY {}, ''",
        quote_ident(channel)
    );
    let mut want = wakeups.want_notify.subscribe();
    let mut holding = false;
    let mut checks = tokio::time::interval(check_every);
    checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    checks.tick().await;
    let mut ticks: u32 = 0;
    let mut retry = true;
    loop {
        let wanted = *want.borrow_and_update();
        if wanted && !holding && retry {
            let answer = within(
                QUERY_TIMEOUT,
                simple_while_listening(&client, &mut connection, wakeups, &take),
            )
            .await?;
            holding = first_value(&answer).as_deref() == Some("t");
            retry = false;
            if holding {
                wakeups.now_held();
            }
        } else if !wanted && holding {
            within(
                QUERY_TIMEOUT,
                simple_while_listening(&client, &mut connection, wakeups, &give_back),
            )
            .await?;
            holding = false;
        }
        tokio::select! {
            driven = next_notification(&mut connection, wakeups) => {
                // Another relay gave the lock back ('' asks for a poll).
                if driven? {
                    retry = true;
                }
            }
            changed = want.changed() => {
                if changed.is_ok() {
                    retry = true;
                }
            }
            _ = checks.tick() => {
                ticks = ticks.wrapping_add(1);
                if ticks.is_multiple_of(10) {
                    retry = true;
                }
                if target.wants_writable() {
                    let writable = still_writable(&client, &mut connection, wakeups);
                    if !within(QUERY_TIMEOUT, writable).await? {
                        return Err(Lost::ReadOnly);
                    }
                }
            }
        }
    }
}

/// The first value of a simple query's answer.
fn first_value(answer: &[tokio_postgres::SimpleQueryMessage]) -> Option<String> {
    answer.iter().find_map(|message| match message {
        tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_string),
        _ => None,
    })
}

/// Runs `sql` on the LISTEN connection, driving it (and handing on
/// notifications) until the server has answered.
async fn simple_while_listening(
    client: &Client,
    connection: &mut Connection<tokio_postgres::Socket, TlsStream>,
    wakeups: &Wakeups,
    sql: &str,
) -> Result<Vec<tokio_postgres::SimpleQueryMessage>, Lost> {
    let answered = client.simple_query(sql);
    tokio::pin!(answered);
    loop {
        tokio::select! {
            answered = &mut answered => return Ok(answered?),
            driven = next_notification(connection, wakeups) => { driven?; }
        }
    }
}

/// Whether the server still takes writes; drives the connection (and hands
/// on notifications) until it has answered.
async fn still_writable(
    client: &Client,
    connection: &mut Connection<tokio_postgres::Socket, TlsStream>,
    wakeups: &Wakeups,
) -> Result<bool, Lost> {
    let answered = client.simple_query("SHOW transaction_read_only");
    tokio::pin!(answered);
    loop {
        tokio::select! {
            answered = &mut answered => {
                let read_only = answered?.into_iter().find_map(|message| match message {
                    tokio_postgres::SimpleQueryMessage::Row(row) => {
                        row.get(0).map(|value| value == "on")
                    }
                    _ => None,
                });
                return Ok(read_only == Some(false));
            }
            driven = next_notification(connection, wakeups) => { driven?; }
        }
    }
}

/// Sends LISTEN, and a notification with an empty payload that has every
/// relay on the channel poll at once, so each sees this relay's connection
/// among the members now rather than at its next poll; drives the connection
/// until the server has answered both.
async fn start_listening<S, T>(
    client: &Client,
    connection: &mut Connection<S, T>,
    channel: &str,
    wakeups: &Wakeups,
) -> Result<(), Lost>
where
    S: AsyncRead + AsyncWrite + Unpin,
    T: AsyncRead + AsyncWrite + Unpin,
{
    let channel = quote_ident(channel);
    let statement = format!(
        "{}; LISTEN {channel}; NOTIFY {channel}, ''",
        session_keepalives()
    );
    let answered = client.batch_execute(&statement);
    tokio::pin!(answered);
    loop {
        tokio::select! {
            answered = &mut answered => return Ok(answered?),
            driven = next_notification(connection, wakeups) => { driven?; }
        }
    }
}

/// Drives the connection until its next message; a notification goes to
/// `wakeups`. Returns whether it was one that asks for a poll ('').
async fn next_notification<S, T>(
    connection: &mut Connection<S, T>,
    wakeups: &Wakeups,
) -> Result<bool, Lost>
where
    S: AsyncRead + AsyncWrite + Unpin,
    T: AsyncRead + AsyncWrite + Unpin,
{
    match poll_fn(|cx| connection.poll_message(cx)).await {
        Some(Ok(AsyncMessage::Notification(notification))) => {
            wakeups.notified(notification.payload());
            Ok(notification.payload().is_empty())
        }
        Some(Ok(_notice)) => Ok(false),
        Some(Err(error)) => Err(error.into()),
        None => Err(Lost::Closed),
    }
}

async fn within<T>(
    limit: Duration,
    work: impl Future<Output = Result<T, Lost>>,
) -> Result<T, Lost> {
    tokio::time::timeout(limit, work)
        .await
        .unwrap_or(Err(Lost::Timeout(limit)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wakeups(tenants: &[&str]) -> Wakeups {
        Wakeups::new(&Config::with_tenants(tenants.iter().copied()))
    }

    #[test]
    fn a_flood_of_notifications_coalesces_per_tenant() {
        let w = wakeups(&["a", "b", "c"]);
        for _ in 0..1000 {
            w.notified("c");
            w.notified("a");
            w.notified("not-ours");
        }
        assert_eq!(
            w.take(),
            Woken {
                tenants: vec!["c".to_string(), "a".to_string()],
                poll: false,
                held: false,
            }
        );
        assert_eq!(w.take(), Woken::default(), "taken once");
        w.notified("a");
        assert_eq!(w.take().tenants, ["a"], "waits again once taken");
    }

    #[test]
    fn a_discovering_relay_takes_any_tenant() {
        let w = Wakeups::new(&Config::with_tenants(["*"]));
        w.notified("new");
        w.notified("new");
        w.notified("other");
        assert_eq!(w.take().tenants, ["new", "other"]);
        assert!(
            Wakeups::new(&Config::with_tenants(["*"]))
                .member_of(&w.application_name)
                .is_some(),
            "discovering replicas are members of one set"
        );
    }

    #[test]
    fn an_empty_payload_asks_for_a_poll() {
        let w = wakeups(&["a"]);
        w.notified("");
        assert_eq!(
            w.take(),
            Woken {
                tenants: vec![],
                poll: true,
                held: false,
            }
        );
    }

    #[test]
    fn the_listen_connection_names_its_channel_and_instance() {
        let w = wakeups(&["a"]);
        assert!(w.application_name.len() <= 63, "fits NAMEDATALEN");
        assert!(
            w.application_name
                .starts_with(&crate::sql::relays_prefix("public", "outbox_message")),
            "{}",
            w.application_name
        );
        assert!(
            w.application_name
                .ends_with(&format!(":u{}", crate::migrate::LEVEL)),
            "the upgrade level ends the name: {}",
            w.application_name
        );
        assert_eq!(w.member_of(&w.application_name), Some(w.instance.as_str()));
        assert!(w.members_pattern().starts_with("outbox-relay:"));
        let other = Wakeups::new(&{
            let mut c = Config::with_tenants(["a"]);
            c.table = "other".into();
            c
        });
        assert_eq!(
            other.member_of(&w.application_name),
            None,
            "another table's listeners are not members"
        );
        assert_eq!(
            wakeups(&["a", "b"]).member_of(&w.application_name),
            None,
            "nor are relays of other tenants"
        );
        assert!(
            wakeups(&["b", "a"])
                .member_of(&wakeups(&["a", "b"]).application_name)
                .is_some(),
            "the same tenants in another order are the same set"
        );
        assert_ne!(w.instance, wakeups(&["a"]).instance, "random per instance");
    }

    #[test]
    fn one_owner_per_tenant_and_tenants_spread_over_members() {
        let members: Vec<String> = (0..3).map(|i| format!("{i:016x}")).collect();
        let mut owned = std::collections::HashMap::<&String, usize>::new();
        for t in 0..3000 {
            let tenant = format!("tenant-{t}");
            let first = owner(&tenant, &members).unwrap();
            let mut reversed = members.clone();
            reversed.reverse();
            assert_eq!(
                owner(&tenant, &reversed),
                Some(first),
                "order does not matter"
            );
            *owned.entry(first).or_default() += 1;
        }
        for member in &members {
            let n = owned[member];
            assert!((800..1200).contains(&n), "{member} owns {n} of 3000");
        }
        assert_eq!(owner("t", &[]), None);
    }

    #[test]
    fn an_owners_tenants_have_successors_spread_over_the_others() {
        let replicas: Vec<Wakeups> = (0..4).map(|_| wakeups(&["a"])).collect();
        let members: Vec<String> = replicas.iter().map(|r| r.instance.clone()).collect();
        let mut succeeded = vec![0; 4];
        for t in 0..4000 {
            let tenant = format!("tenant-{t}");
            let owner = owner(&tenant, &members).unwrap();
            let successors: Vec<usize> = (0..4)
                .filter(|&r| replicas[r].succeeds(&tenant, &members))
                .collect();
            assert_eq!(successors.len(), 1, "one successor");
            assert_ne!(&members[successors[0]], owner, "not the owner");
            succeeded[successors[0]] += 1;
        }
        for n in succeeded {
            assert!((800..1200).contains(&n), "{n} of 4000");
        }
        assert!(
            !replicas[0].succeeds("t", &members[..1]),
            "alone: no successor"
        );
    }

    #[test]
    fn a_notified_tenant_is_swept_at_once_by_its_owner_alone() {
        let replicas = [wakeups(&["a"]), wakeups(&["a"]), wakeups(&["a"])];
        let members: Vec<String> = replicas.iter().map(|r| r.instance.clone()).collect();
        for t in 0..50 {
            let tenant = format!("t{t}");
            let sweeping = replicas
                .iter()
                .filter(|r| r.sweeps_at_once(&tenant, &members))
                .count();
            assert_eq!(sweeping, 1, "{tenant}");
        }
        // Alone, or before a poll saw its connection, a replica sweeps.
        assert!(replicas[0].sweeps_at_once("a", &[]));
        assert!(replicas[0].sweeps_at_once("a", &members[1..]));
    }
}
