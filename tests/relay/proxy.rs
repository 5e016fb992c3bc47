//! A TCP proxy owned by a test, between the relay and the broker or the
//! database. It passes bytes, delays them, stalls (keeps the connection open
//! and drops every byte: a half-open path), resets every connection (RST),
//! refuses new ones (both at once are the node behind it dying), or cuts the
//! path as a network partition does (at once, or when given bytes go by).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy does with bytes and connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pass,
    /// Each chunk waits this long before it is forwarded.
    Delay(Duration),
    /// Connections stay open; nothing is forwarded either way.
    Stall,
    /// Connections stay open; bytes are held back either way, and forwarded
    /// once the mode changes (a path that pauses, losing nothing).
    Hold,
    /// New connections are reset at once (the upstream looks down).
    Refuse,
    /// Like `Stall`, and a side that closes is not closed on the other
    /// either: a network partition carries no FIN or RST.
    Partition,
    /// Passes bytes until a chunk holding these bytes goes by (either way),
    /// then partitions every connection (that chunk is dropped too).
    PartitionOn(&'static [u8]),
}

struct Shared {
    mode: watch::Sender<Mode>,
    connections: Mutex<Vec<JoinHandle<()>>>,
    accepted: Mutex<usize>,
}

pub struct Proxy {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: JoinHandle<()>,
}

impl Proxy {
    /// A proxy to `upstream`, listening on a free loopback port.
    pub async fn start(upstream: SocketAddr, mode: Mode) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let (mode, _) = watch::channel(mode);
        let shared = Arc::new(Shared {
            mode,
            connections: Mutex::new(Vec::new()),
            accepted: Mutex::new(0),
        });
        let acceptor = tokio::spawn({
            let shared = shared.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    *shared.accepted.lock().unwrap() += 1;
                    let _ = client.set_zero_linger();
                    if *shared.mode.borrow() == Mode::Refuse {
                        drop(client);
                        continue;
                    }
                    let task = tokio::spawn(relay_connection(client, upstream, shared.clone()));
                    let mut connections = shared.connections.lock().unwrap();
                    connections.retain(|t| !t.is_finished());
                    connections.push(task);
                }
            }
        });
        Proxy {
            addr,
            shared,
            acceptor,
        }
    }

    pub fn set(&self, mode: Mode) {
        self.shared.mode.send_replace(mode);
    }

    /// Resets every open connection (the peers see ECONNRESET).
    pub fn reset(&self) {
        for task in self.shared.connections.lock().unwrap().drain(..) {
            task.abort();
        }
    }

    /// The node behind it dies: every open connection is reset and new
    /// ones are refused.
    pub fn kill(&self) {
        self.set(Mode::Refuse);
        self.reset();
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        *self.shared.accepted.lock().unwrap()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.acceptor.abort();
        self.reset();
    }
}

async fn relay_connection(client: TcpStream, upstream: SocketAddr, shared: Arc<Shared>) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = server.set_zero_linger();
    let _ = server.set_nodelay(true);
    let _ = client.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pump(client_read, server_write, &shared);
    let down = pump(server_read, client_write, &shared);
    // Either direction ending ends both; dropping the halves resets the sockets.
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    shared: &Shared,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => {
                if *shared.mode.borrow() == Mode::Partition {
                    // The other side never hears of it.
                    std::future::pending::<()>().await;
                }
                return;
            }
            Ok(n) => n,
        };
        let current = *shared.mode.borrow();
        match current {
            Mode::Pass => {}
            Mode::Delay(delay) => tokio::time::sleep(delay).await,
            Mode::Stall | Mode::Partition => continue,
            Mode::Hold => {
                let mut mode = shared.mode.subscribe();
                if mode.wait_for(|mode| *mode != Mode::Hold).await.is_err() {
                    return;
                }
            }
            Mode::Refuse => return,
            Mode::PartitionOn(bytes) => {
                if buffer[..n]
                    .windows(bytes.len())
                    .any(|window| window == bytes)
                {
                    shared.mode.send_replace(Mode::Partition);
                    continue;
                }
            }
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}
