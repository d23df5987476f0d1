//! The coordinator's HTTP/1.1 listener, built to survive clients that never finish: a cap on
//! open connections, a deadline for each request head (which also bounds how long a kept-alive
//! connection may sit between requests), and an idle timeout on any connection that moves no
//! byte either way. When the cap is reached, the oldest connection that has not sent a single
//! request yet is closed to admit the new one, so a flood of half-open connections cannot lock
//! out real clients (and `/healthz`); connections inside a request, or streaming events, are
//! never evicted. axum's own `serve` has none of these limits (hyper without a timer has no
//! header timeout at all), hence this loop.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};

/// What a listener tolerates from its clients.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections open at once; past it, the oldest never-used one is closed, or else the
    /// new one is refused.
    pub max_connections: usize,
    /// Time from the start of waiting for a request until its head has fully arrived.
    pub header_read_timeout: Duration,
    /// A connection that moves no byte in either direction for this long is closed. Must
    /// exceed the event streams' keep-alive interval.
    pub idle_timeout: Duration,
}

/// How long shutdown waits for open requests before dropping them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// One open connection, as the admission policy sees it.
struct Conn {
    /// Set when its first request arrived; such a connection is never evicted.
    used: AtomicBool,
    evict: Notify,
}

/// Open connections by accept order (oldest first).
#[derive(Default)]
struct Registry {
    conns: Mutex<BTreeMap<u64, Arc<Conn>>>,
    next: AtomicU64,
    /// Connections refused or evicted, for a rate-limited warning.
    turned_away: AtomicU64,
}

impl Registry {
    /// Registers a new connection, evicting the oldest unused one when at the cap; `None` when
    /// every open connection is in use (the new one is refused).
    fn admit(&self, cap: usize) -> Option<(u64, Arc<Conn>)> {
        let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        if conns.len() >= cap {
            let victim = conns
                .iter()
                .find(|(_, c)| !c.used.load(Ordering::Acquire))
                .map(|(&id, _)| id);
            let victim = victim.and_then(|id| conns.remove(&id));
            self.turned_away.fetch_add(1, Ordering::Relaxed);
            victim?.evict.notify_one();
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            used: AtomicBool::new(false),
            evict: Notify::new(),
        });
        conns.insert(id, conn.clone());
        Some((id, conn))
    }

    fn remove(&self, id: u64) {
        self.conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }

    fn open(&self) -> usize {
        self.conns.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// Serves `app` on `listener` until `stop` turns true, then lets open requests finish (up to
/// [`SHUTDOWN_GRACE`]).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let registry = Arc::new(Registry::default());
    let mut tasks = JoinSet::new();
    let mut warned_at: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|s| *s) => break,
        };
        // Reap finished connection tasks so the set does not grow without bound.
        while tasks.try_join_next().is_some() {}
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors (or a connection reset before accept): back off a
                // little instead of spinning, and keep serving the connections we have.
                tracing::warn!("accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some((id, conn)) = registry.admit(limits.max_connections) else {
            drop(stream);
            continue;
        };
        if registry.turned_away.load(Ordering::Relaxed) > 0
            && warned_at.is_none_or(|t| t.elapsed() > Duration::from_secs(10))
        {
            warned_at = Some(Instant::now());
            tracing::warn!(
                open = registry.open(),
                cap = limits.max_connections,
                turned_away = registry.turned_away.swap(0, Ordering::Relaxed),
                "connection cap reached: closed idle connections that never sent a request \
                 (or refused new ones while every open connection was in use)"
            );
        }
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let registry = registry.clone();
        let mut stop = stop.clone();
        tasks.spawn(async move {
            let used = conn.clone();
            let service = tower::service_fn(move |req| {
                used.used.store(true, Ordering::Release);
                let mut app = app.clone();
                async move { tower::Service::call(&mut app, req).await }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout);
            let io = TokioIo::new(IdleIo::new(stream, limits.idle_timeout));
            let served = builder.serve_connection(io, TowerToHyperService::new(service));
            tokio::pin!(served);
            let result = tokio::select! {
                r = served.as_mut() => Some(r),
                _ = conn.evict.notified() => Some(Ok(())),
                _ = stop.wait_for(|s| *s) => None,
            };
            // Outside the select: `wait_for`'s guard must not live across this await.
            let result = match result {
                Some(r) => r,
                None => {
                    served.as_mut().graceful_shutdown();
                    served.await
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, "connection ended: {e}");
            }
            registry.remove(id);
        });
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, async {
        while tasks.join_next().await.is_some() {}
    })
    .await
    .is_err()
    {
        tracing::warn!(
            "{} connections still open after {SHUTDOWN_GRACE:?}; closing them",
            tasks.len()
        );
        tasks.abort_all();
    }
    Ok(())
}

/// A TCP stream that fails with `TimedOut` once no byte has moved either way for `idle`.
struct IdleIo {
    inner: TcpStream,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl IdleIo {
    fn new(inner: TcpStream, idle: Duration) -> IdleIo {
        IdleIo {
            inner,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
        }
    }

    fn moved(&mut self) {
        let next = Instant::now() + self.idle;
        self.deadline.as_mut().reset(next);
    }

    /// Called when the inner stream is pending: an error once the deadline has passed.
    fn check_idle(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Error> {
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no bytes moved for {:?}", self.idle),
            )),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for IdleIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.moved();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => this.check_idle(cx).map(Err),
        }
    }
}

impl AsyncWrite for IdleIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_write(cx, data) {
            Poll::Ready(Ok(n)) => {
                this.moved();
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            // A client that stops reading its response times out too.
            Poll::Pending => this.check_idle(cx).map(Err),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_evicts_the_oldest_unused_connection_and_never_a_used_one() {
        let r = Registry::default();
        let (a, ca) = r.admit(2).unwrap();
        let (_b, cb) = r.admit(2).unwrap();
        ca.used.store(true, Ordering::Release);
        // At the cap: b (unused) goes, a (in use) stays.
        let (c, cc) = r.admit(2).unwrap();
        assert_eq!(r.open(), 2);
        assert!(r.conns.lock().unwrap().contains_key(&a));
        assert!(r.conns.lock().unwrap().contains_key(&c));
        drop(cb);
        // Every open connection in use: the new one is refused.
        cc.used.store(true, Ordering::Release);
        assert!(r.admit(2).is_none());
        r.remove(a);
        assert!(r.admit(2).is_some());
    }
}
