//! The grandis daemon: one per server (`grandis daemon --config daemon.toml`, typically under
//! systemd). It registers with the coordinator under its server label, heartbeats at the
//! interval the coordinator gives, and — while it is the label's elected head and a job is
//! assigned — runs the server's part of the job on a job thread ([`job`]): it loads the
//! dataset, partitions it deterministically (every server of the job computes the same
//! partition and plans, so nothing is shipped before training), binds its QUIC node (mutual
//! TLS with the cluster CA, `grandis-quic`), connects to the job's other servers, and trains
//! its G device ranks with `grandis_parallel::server`; the leader (server index 0) reports
//! per-epoch progress, every server reports finished (with its measured traffic) or failed
//! (with the reason). Assignments repeat in every heartbeat reply until the job ends, so a
//! job this daemon already runs or finished is a no-op; a coordinator that forgot the daemon
//! (restart: 404 `unknown_daemon`) gets a new registration; a cancel wakes the job's blocked
//! receives at once. Metrics are served in the Prometheus text format ([`metrics`]).
//! Configuration: TOML + `GRANDIS_DAEMON_*` environment ([`config`]).

pub mod config;
pub mod job;
pub mod metrics;

use std::collections::HashSet;
use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use grandis_wire::{
    DaemonJob, DaemonState, DeviceInfo, HeartbeatRequest, JobEvent, JobId, RegisterRequest,
    RegisterResponse, PROTOCOL_VERSION,
};
use serde::Serialize;

pub use config::{print_config, DaemonConfig};

use crate::job::{JobContext, Outcome};
use crate::metrics::Metrics;
use grandis_client::{CallError, Client};

/// What `ready_file` holds once the daemon registered.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Ready {
    pub daemon_id: u64,
    pub label: String,
    /// The data-plane address other daemons dial.
    pub data_addr: String,
    /// The metrics endpoint, when enabled.
    pub metrics_addr: Option<String>,
    pub pid: u32,
}

struct Running {
    job_id: JobId,
    attempt: u32,
    cancel: Arc<AtomicBool>,
    epoch: Arc<AtomicU32>,
    handle: JoinHandle<Outcome>,
}

impl Running {
    /// Waits for the job's thread to end (its events delivered or given up) and logs how it
    /// ended; the run, for the runs this daemon has finished.
    fn end(self) -> (JobId, u32) {
        let outcome = self.handle.join().unwrap_or(Outcome::Failed);
        tracing::info!(
            job = self.job_id,
            outcome = outcome.name(),
            "job ended on this server"
        );
        (self.job_id, self.attempt)
    }
}

/// Host memory from /proc/meminfo (`MemTotal`), 0 when unknown.
fn host_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// Runs the daemon until `stop` is set (the CLI sets it on Ctrl-C/SIGTERM). Errors only for
/// problems that retrying cannot fix (bad configuration, refused registration, ports in use).
pub fn run(config: DaemonConfig, stop: Arc<AtomicBool>) -> anyhow::Result<()> {
    config.validate()?;
    grandis_quic::install_crypto_provider();
    // Fail at start-up, not at the first job, when the certificate is unusable. It also
    // proves this daemon's label to the coordinator at every registration.
    let identity =
        grandis_quic::NodeIdentity::load(&config.cert_dir, &config.label).with_context(|| {
            format!(
                "cert_dir: loading this node's certificate {:?} from {}",
                config.label,
                config.cert_dir.display()
            )
        })?;
    let listen = config.data_listen_addr()?;
    let socket = UdpSocket::bind(listen)
        .with_context(|| format!("data_listen: cannot bind UDP {listen}"))?;
    let data_addr = socket.local_addr()?;
    let advertise = match &config.data_advertise {
        Some(a) => a.clone(),
        None if data_addr.ip().is_unspecified() => bail!(
            "data_advertise: must be set when data_listen ({listen}) is an unspecified address \
             (the other daemons need an address to dial)"
        ),
        None => data_addr.to_string(),
    };
    let reserved = Arc::new(Mutex::new(Some(socket)));
    let metrics = Arc::new(Metrics::new());
    let metrics_addr = match &config.metrics_listen {
        Some(m) => Some(metrics::serve(config::resolve(m)?, metrics.clone())?),
        None => None,
    };
    // The client before registration; each registration gives the one that carries its
    // session (when the coordinator verifies identities).
    let unregistered = Client::new(&config.coordinator, config.token(), config.http_timeout());
    let prove = |challenge: &str| {
        identity
            .prove_registration(challenge)
            .map_err(|e| format!("proving this daemon's label: {e}"))
    };
    let config = Arc::new(config);
    let devices = (0..config.devices)
        .map(|i| DeviceInfo {
            name: format!("cpu-{i}"),
            memory_bytes: config.device_memory.unwrap_or(0),
        })
        .collect();
    let register = RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        label: config.label.clone(),
        devices,
        memory_bytes: config.memory_bytes.unwrap_or_else(host_memory),
        data_addr: advertise.clone(),
        daemon_version: env!("CARGO_PKG_VERSION").to_string(),
        proof: None,
    };
    let Some(mut reg) = register_until(&unregistered, &register, &prove, &stop)? else {
        return Ok(());
    };
    let mut client = unregistered.with_session(reg.daemon_id, reg.session.as_deref());
    if let Some(path) = &config.ready_file {
        let ready = Ready {
            daemon_id: reg.daemon_id,
            label: config.label.clone(),
            data_addr: advertise.clone(),
            metrics_addr: metrics_addr.map(|a| a.to_string()),
            pid: std::process::id(),
        };
        let text = serde_json::to_string(&ready)?;
        grandis_store::write_file_atomic(path, text.as_bytes())
            .with_context(|| format!("ready_file: writing {}", path.display()))?;
    }

    let unreported = Arc::new(job::Unreported::default());
    let mut current: Option<Running> = None;
    // Runs this daemon has finished: a retry of a job is a new (job, attempt).
    let mut done: HashSet<(JobId, u32)> = HashSet::new();
    let mut last_error: Option<Instant> = None;
    while !stop.load(Ordering::SeqCst) {
        let tick = Instant::now();
        if current.as_ref().is_some_and(|r| r.handle.is_finished()) {
            let r = current.take().expect("checked");
            done.insert(r.end());
        }
        let hb = HeartbeatRequest {
            protocol_version: PROTOCOL_VERSION,
            daemon_id: reg.daemon_id,
            state: if current.is_some() {
                DaemonState::Running
            } else {
                DaemonState::Idle
            },
            job: current.as_ref().map(|r| DaemonJob {
                job_id: r.job_id,
                attempt: r.attempt,
                epoch: r.epoch.load(Ordering::SeqCst),
            }),
        };
        match client.heartbeat(&hb) {
            Ok(resp) => {
                last_error = None;
                unreported.send(&client, reg.daemon_id);
                if let Some(r) = &current {
                    if resp.cancel.contains(&r.job_id) && !r.cancel.swap(true, Ordering::SeqCst) {
                        tracing::warn!(job = r.job_id, "the coordinator cancelled the job");
                    }
                }
                if let Some(a) = resp.assignment {
                    let ours = current.as_ref().map(|r| (r.job_id, r.attempt));
                    let run = (a.job_id, a.attempt);
                    if ours.is_none() && !done.contains(&run) {
                        let cancel = Arc::new(AtomicBool::new(false));
                        let epoch = Arc::new(AtomicU32::new(0));
                        let ctx = JobContext {
                            config: config.clone(),
                            client: client.clone(),
                            daemon_id: reg.daemon_id,
                            metrics: metrics.clone(),
                            reserved: reserved.clone(),
                            data_addr,
                            cancel: cancel.clone(),
                            epoch: epoch.clone(),
                            unreported: unreported.clone(),
                        };
                        let (job_id, attempt) = run;
                        let handle = std::thread::Builder::new()
                            .name(format!("grandis-job-{job_id}"))
                            .spawn(move || job::run_job(ctx, a))
                            .context("starting a job thread")?;
                        current = Some(Running {
                            job_id,
                            attempt,
                            cancel,
                            epoch,
                            handle,
                        });
                    } else if ours.is_some_and(|r| r != run) {
                        tracing::warn!(
                            job = a.job_id,
                            attempt = a.attempt,
                            running = ?ours,
                            "assigned another job while one runs; ignoring it"
                        );
                    }
                }
            }
            Err(e) if e.is_unknown_daemon() => {
                tracing::warn!(
                    "the coordinator does not know this daemon (restarted?); registering again"
                );
                // Its jobs did not survive the restart ("coordinator restarted"). The job's
                // thread ends first (a cancelled run stops; a finished one's reporter stops
                // retrying its report and keeps it as unreported), so that a finished run's
                // report is kept before the next heartbeat can assign the job's next run.
                if let Some(r) = current.take() {
                    r.cancel.store(true, Ordering::SeqCst);
                    done.insert(r.end());
                }
                match register_until(&unregistered, &register, &prove, &stop)? {
                    Some(r) => reg = r,
                    None => break,
                }
                client = unregistered.with_session(reg.daemon_id, reg.session.as_deref());
                // Before the first heartbeat, which may assign the job's next run: a run
                // that finished while the coordinator was down still counts.
                unreported.send(&client, reg.daemon_id);
                continue;
            }
            Err(CallError::Status { status, body, .. }) if status == 401 || status == 400 => {
                bail!(
                    "the coordinator refused the heartbeat ({status} {}): {}",
                    body.code,
                    body.error
                );
            }
            Err(e) => {
                // Log the first failure and then every 10 s, not every interval.
                if last_error.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    tracing::warn!("heartbeat failed: {e}");
                    last_error = Some(Instant::now());
                }
            }
        }
        let interval = Duration::from_millis(reg.heartbeat_interval_ms.max(10));
        sleep_until(tick + interval, &stop);
    }
    tracing::info!("daemon stopping");
    if let Some(r) = current.take() {
        if !r.handle.is_finished() && !r.cancel.load(Ordering::SeqCst) {
            // Say why the job ends before its data plane closes: the peers, seeing their
            // connections drop, would otherwise report first, and the job's failure would
            // name a healthy server.
            job::post_event(
                &client,
                reg.daemon_id,
                r.job_id,
                r.attempt,
                JobEvent::Failed {
                    reason: "its daemon was stopped (SIGTERM or Ctrl-C) while running the job"
                        .into(),
                    // The server goes away, not the job's fault: it may run again elsewhere
                    // or once this server is back.
                    retryable: true,
                },
            );
        }
        r.cancel.store(true, Ordering::SeqCst);
        let _ = r.handle.join();
    }
    Ok(())
}

fn sleep_until(deadline: Instant, stop: &AtomicBool) {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stop.load(Ordering::SeqCst) {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(50)));
    }
}

/// Registers, retrying (with backoff up to 2 s) while the coordinator is unreachable or
/// restarting; `None` when `stop` was set first. A refusal (4xx) is an error.
fn register_until(
    client: &Client,
    req: &RegisterRequest,
    prove: grandis_client::Prove<'_>,
    stop: &AtomicBool,
) -> anyhow::Result<Option<RegisterResponse>> {
    let mut delay = Duration::from_millis(50);
    let mut logged = false;
    while !stop.load(Ordering::SeqCst) {
        match client.register(req, Some(prove)) {
            Ok(r) => {
                tracing::info!(
                    daemon = r.daemon_id,
                    label = %req.label,
                    data_addr = %req.data_addr,
                    "registered with the coordinator (heartbeat every {} ms)",
                    r.heartbeat_interval_ms
                );
                return Ok(Some(r));
            }
            Err(CallError::Status { status, body, .. }) if (400..500).contains(&status) => {
                bail!(
                    "the coordinator refused the registration ({status} {}): {}",
                    body.code,
                    body.error
                );
            }
            Err(e) => {
                if !logged {
                    tracing::warn!("cannot register yet: {e}; retrying");
                    logged = true;
                }
                sleep_until(Instant::now() + delay, stop);
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
    Ok(None)
}
