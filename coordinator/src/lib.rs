//! The grandis coordinator: the one service users and daemons talk to. Users submit training
//! jobs over a JSON REST API (`/v1/jobs`, bearer-token auth) and follow them by polling or by
//! server-sent events; daemons (one or more per server, grouped by label) register, heartbeat
//! and report job events over the daemon protocol of `grandis-wire`. The coordinator elects
//! one head per label with leases and terms, assigns queued jobs FIFO to free servers, fails a
//! job naming the server whose head stops heartbeating, keeps jobs in a redb file across
//! restarts, and exports Prometheus/OpenMetrics metrics. The rules are in [`state`]; the HTTP
//! surface in [`api`]; the REST API is documented in `docs/openapi.yaml`.
//!
//! Start it with [`serve`] (until Ctrl-C/SIGTERM), [`spawn`] (returns a handle to stop it) or
//! [`run_blocking`] (builds its own runtime and binds `listen`).

pub mod api;
pub mod config;
pub mod error;
pub mod http;
pub mod identity;
pub mod metrics;
pub mod state;
pub mod store;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;

pub use config::{print_config, CoordinatorConfig};

use crate::api::AppState;
use crate::state::{Core, Limits, Timing};
use crate::store::Store;

/// A running coordinator.
pub struct CoordinatorHandle {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl CoordinatorHandle {
    /// The address it listens on (useful after binding port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting requests, ends event streams, waits for in-flight requests and closes
    /// the database (so the same file can be opened again at once).
    pub async fn shutdown(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        self.wait().await
    }

    /// Waits until the coordinator stops by itself (it only does on errors).
    pub async fn wait(self) -> anyhow::Result<()> {
        self.task.await.context("coordinator task panicked")?
    }

    /// Serves until `shutdown` resolves (or the coordinator fails), then stops it.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let mut task = self.task;
        tokio::select! {
            res = &mut task => return res.context("coordinator task panicked")?,
            _ = shutdown => {}
        }
        tracing::info!("shutting down");
        let _ = self.stop.send(true);
        task.await.context("coordinator task panicked")?
    }

    /// Serves until Ctrl-C or SIGTERM.
    pub async fn run_until_signal(self) -> anyhow::Result<()> {
        self.run_until(shutdown_signal()).await
    }
}

/// Opens the database and starts serving on `listener` in the background.
pub async fn spawn(
    config: CoordinatorConfig,
    listener: TcpListener,
) -> anyhow::Result<CoordinatorHandle> {
    config.validate()?;
    let addr = listener.local_addr()?;
    let (stop, stop_rx) = watch::channel(false);
    let state = build_state(&config, stop_rx.clone())?;
    let task = tokio::spawn(run(state, listener, config.http_limits(), stop_rx));
    tracing::info!(%addr, db = %config.db_path.display(), "coordinator listening");
    Ok(CoordinatorHandle { addr, stop, task })
}

/// Serves until `shutdown` resolves.
pub async fn serve_with_shutdown(
    config: CoordinatorConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    spawn(config, listener).await?.run_until(shutdown).await
}

/// Serves until Ctrl-C or SIGTERM.
pub async fn serve(config: CoordinatorConfig, listener: TcpListener) -> anyhow::Result<()> {
    spawn(config, listener).await?.run_until_signal().await
}

/// Builds a runtime, binds `config.listen` and serves until Ctrl-C or SIGTERM (for the CLI).
pub fn run_blocking(config: CoordinatorConfig) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = TcpListener::bind(&config.listen)
            .await
            .with_context(|| format!("listen: cannot bind {}", config.listen))?;
        serve(config, listener).await
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

fn build_state(
    config: &CoordinatorConfig,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<Arc<AppState>> {
    let store = Store::open(&config.db_path)?;
    let timing = Timing {
        heartbeat_interval: config.heartbeat_interval(),
        lease: config.lease(),
        down_timeout: config.down_timeout(),
        forget_after: config.forget_after(),
    };
    // Capacity only matters for slow SSE clients; they recover from lag by re-reading state.
    let (updates, _) = broadcast::channel(1024);
    let limits = Limits {
        keep_finished_checkpoints: config.keep_finished_checkpoints,
        max_restart_retries: config.max_restart_retries,
    };
    let core = Core::open(store, timing, limits, updates.clone())?;
    let user_token = config.token.clone().expect("validated");
    let daemon_ca = match &config.daemon_ca {
        Some(path) => Some(grandis_quic::ClusterCa::load(path).context("daemon_ca")?),
        None => {
            tracing::warn!(
                "daemon_ca is not set: a daemon's label is taken on trust from any holder of \
                 the daemon token (set it to the cluster CA, `ca.pem`, to verify daemons by \
                 their node certificates)"
            );
            None
        }
    };
    Ok(Arc::new(AppState {
        core: Mutex::new(core),
        updates,
        shutdown,
        daemon_token: config.daemon_token.clone().unwrap_or(user_token.clone()),
        user_token,
        sse_keepalive: Duration::from_millis(config.sse_keepalive_ms),
        max_checkpoint_bytes: config.max_checkpoint_bytes as usize,
        daemon_ca,
        daemon_auth: Mutex::new(Default::default()),
    }))
}

async fn run(
    state: Arc<AppState>,
    listener: TcpListener,
    limits: http::Limits,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    // The periodic tick applies the time-driven rules (leases, down marks, failing jobs of
    // silent servers) even when no request arrives; a quarter interval bounds the extra delay.
    let tick_every = (state.core().timing.heartbeat_interval / 4)
        .clamp(Duration::from_millis(5), Duration::from_millis(250));
    let ticker = {
        let state = state.clone();
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let mut interval = tokio::time::interval(tick_every);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = interval.tick() => state.core().tick(Instant::now()),
                    _ = stop.changed() => break,
                }
            }
        })
    };
    let app = api::router(state.clone());
    let result = http::serve(listener, app, limits, stop)
        .await
        .context("serving HTTP");
    let _ = ticker.await;
    state.core().close();
    tracing::info!("coordinator stopped");
    result
}
