//! The response body of a forwarded request: watched for its sandbox going away and for a
//! guest that stops sending, holding the request's slot until it ends.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::activity::Stamp;
use crate::limits::Slot;
use crate::{BoxError, ProxyBody};

/// A response body that ends with an error once its sandbox is gone or has moved (killed or
/// paused): a stream from a dead guest would otherwise wait for bytes that never come, and
/// the client (the SDK) learns the sandbox ended only when its own timeout fires.
///
/// It also ends with an error when the guest sends nothing for the idle-body timeout, and
/// holds the request's [`Slot`] until it is dropped.
pub(crate) struct Watched {
    inner: ProxyBody,
    gone: Option<tokio::sync::oneshot::Receiver<String>>,
    stamp: Arc<Stamp>,
    /// The idle-body timeout and the deadline it sets, pushed back by every frame.
    idle: Option<(Duration, std::pin::Pin<Box<tokio::time::Sleep>>)>,
    _slot: Option<Slot>,
    /// (sandbox, path, when the proxy got the request): logged at debug when the body ends.
    trace: Option<(String, String, std::time::Instant)>,
}

impl Watched {
    pub(crate) fn new(
        inner: ProxyBody,
        gone: Option<tokio::sync::oneshot::Receiver<String>>,
        stamp: Arc<Stamp>,
        idle: Duration,
        slot: Option<Slot>,
    ) -> Watched {
        Watched {
            inner,
            gone,
            stamp,
            idle: (!idle.is_zero()).then(|| (idle, Box::pin(tokio::time::sleep(idle)))),
            _slot: slot,
            trace: None,
        }
    }

    /// Logs the response's end (`proxied: end`, at debug) with its time since `started`.
    pub(crate) fn traced(
        mut self,
        sandbox: &str,
        path: String,
        started: std::time::Instant,
    ) -> Watched {
        if tracing::enabled!(tracing::Level::DEBUG) {
            self.trace = Some((sandbox.to_string(), path, started));
        }
        self
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        if let Some((sandbox, path, started)) = self.trace.take() {
            tracing::debug!(
                sandbox = %sandbox,
                path = %path,
                end_ms = started.elapsed().as_secs_f64() * 1e3,
                "proxied: end"
            );
        }
    }
}

impl http_body::Body for Watched {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        use std::future::Future;
        let this = self.get_mut();
        if let Some(gone) = this.gone.as_mut() {
            match std::pin::Pin::new(gone).poll(cx) {
                std::task::Poll::Ready(Ok(why)) => {
                    this.gone = None;
                    return std::task::Poll::Ready(Some(Err(why.into())));
                }
                std::task::Poll::Ready(Err(_)) => this.gone = None,
                std::task::Poll::Pending => {}
            }
        }
        let r = std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        match &r {
            std::task::Poll::Ready(Some(Ok(_))) => {
                this.stamp.touch();
                if let Some((limit, deadline)) = this.idle.as_mut() {
                    let next = tokio::time::Instant::now() + *limit;
                    deadline.as_mut().reset(next);
                }
            }
            std::task::Poll::Pending => {
                if let Some((limit, deadline)) = this.idle.as_mut() {
                    if deadline.as_mut().poll(cx).is_ready() {
                        let why = format!(
                            "the guest sent nothing for {} s (the proxy's idle-body timeout)",
                            limit.as_secs()
                        );
                        this.idle = None;
                        return std::task::Poll::Ready(Some(Err(why.into())));
                    }
                }
            }
            _ => {}
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
