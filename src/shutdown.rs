//! Shutdown: a signal (SIGTERM or SIGINT) and a cloneable trigger that every
//! long-running task selects on.

use tokio::sync::watch;

/// Resolves on SIGTERM or SIGINT.
pub async fn signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM; only SIGINT stops the relay");
                let _ = ctrl_c.await;
            }
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
