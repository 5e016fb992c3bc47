//! Shutdown: a signal (SIGTERM, SIGINT or SIGHUP) and a cloneable trigger
//! that every long-running task selects on.

use tokio::sync::watch;

/// Resolves on SIGTERM or SIGINT, or SIGHUP (a closed terminal, a process
/// manager's "reload"): each stops the relay the same way, within its grace,
/// rather than SIGHUP's default of killing it mid-sweep.
pub async fn signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let wait = |kind: SignalKind, name: &'static str| {
            let listening = signal(kind);
            async move {
                match listening {
                    Ok(mut received) => {
                        received.recv().await;
                    }
                    Err(error) => {
                        tracing::warn!(%error, "cannot listen for {name}; it does not stop the relay");
                        std::future::pending::<()>().await;
                    }
                }
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            () = wait(SignalKind::terminate(), "SIGTERM") => {}
            () = wait(SignalKind::hangup(), "SIGHUP") => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// The sending side: fires once.
#[derive(Debug)]
pub struct Trigger(watch::Sender<bool>);

/// The receiving side: any number of clones, each resolves once fired.
#[derive(Debug, Clone)]
pub struct Shutdown(watch::Receiver<bool>);

/// A connected trigger and receiver.
pub fn channel() -> (Trigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (Trigger(tx), Shutdown(rx))
}

impl Trigger {
    pub fn fire(&self) {
        self.0.send_replace(true);
    }
}

impl Shutdown {
    /// Resolves once the trigger has fired (or was dropped).
    pub async fn fired(mut self) {
        let _ = self.0.wait_for(|fired| *fired).await;
    }

    pub fn is_fired(&self) -> bool {
        *self.0.borrow()
    }
}
