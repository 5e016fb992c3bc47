//! A future started at once and finished later: [`Started`].
//!
//! Pipelining needs a request's first step to happen now (a statement sent
//! on a connection, a message's frames queued on a channel) while its answer
//! is waited for later, often by someone else. Polling the future once with
//! a waker that does nothing takes that first step; keeping it in
//! [`Started`] keeps its output until it is taken.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use futures_util::future::{BoxFuture, MaybeDone, maybe_done};

/// A future that took its first step when it was made and holds its output,
/// once done, until [`Started::take`].
///
/// Awaiting it (`(&mut started).await`) waits until it is done without
/// taking the output. A poll that leaves it pending registers the waker of
/// that poll: the last poll with a real waker is the one woken.
pub struct Started<T> {
    future: Pin<Box<MaybeDone<BoxFuture<'static, T>>>>,
}

impl<T> Started<T> {
    /// Polls `future` once, now, with a waker that does nothing.
    pub fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        let future: BoxFuture<'static, T> = Box::pin(future);
        let mut started = Self {
            future: Box::pin(maybe_done(future)),
        };
        started.poll_now();
        started
    }

    /// Polls it once more with a waker that does nothing (so whoever awaits
    /// it stays the one woken); whether it is done.
    pub fn poll_now(&mut self) -> bool {
        self.poll_done(&mut Context::from_waker(Waker::noop()))
            .is_ready()
    }

    /// Polls it with `cx`'s waker; ready once it is done.
    pub fn poll_done(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.future.as_mut().poll(cx)
    }

    /// Whether it is done (its output taken or not), without polling it.
    pub fn is_done(&self) -> bool {
        !matches!(self.future.as_ref().get_ref(), MaybeDone::Future(_))
    }

    /// Its output, if it is done and the output was not taken yet.
    pub fn output(&self) -> Option<&T> {
        match self.future.as_ref().get_ref() {
            MaybeDone::Done(output) => Some(output),
            _ => None,
        }
    }

    /// Takes its output, if it is done and the output was not taken yet.
    pub fn take(&mut self) -> Option<T> {
        self.future.as_mut().take_output()
    }
}

impl<T> Future for Started<T> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.get_mut().poll_done(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn its_first_step_happens_when_it_is_made() {
        let steps = Arc::new(AtomicUsize::new(0));
        let counted = steps.clone();
        let (_tx, rx) = tokio::sync::oneshot::channel::<()>();
        let started = Started::new(async move {
            counted.fetch_add(1, Ordering::SeqCst);
            let _ = rx.await;
        });
        assert_eq!(steps.load(Ordering::SeqCst), 1);
        assert!(!started.is_done());
    }

    #[test]
    fn a_future_ready_at_once_is_done_with_its_output_kept_until_taken() {
        let mut started = Started::new(async { 7 });
        assert!(started.is_done());
        assert_eq!(started.output(), Some(&7));
        assert_eq!(started.take(), Some(7));
        assert!(started.is_done(), "done stays done once taken");
        assert_eq!(started.take(), None);
    }

    #[test]
    fn poll_now_finishes_what_became_ready() {
        let (tx, rx) = tokio::sync::oneshot::channel::<u8>();
        let mut started = Started::new(rx);
        assert!(!started.poll_now());
        tx.send(3).unwrap();
        assert!(started.poll_now());
        assert_eq!(started.take(), Some(Ok(3)));
    }

    #[tokio::test]
    async fn awaiting_it_waits_for_its_answer_and_leaves_the_output() {
        let (tx, rx) = tokio::sync::oneshot::channel::<u8>();
        let mut started = Started::new(rx);
        let answer = tokio::spawn(async move { tx.send(9) });
        (&mut started).await;
        answer.await.unwrap().unwrap();
        assert_eq!(started.take(), Some(Ok(9)));
    }
}
