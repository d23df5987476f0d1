//! One server's part of one job, the daemon's entry being [`run_job`]: check the assignment,
//! open the dataset, hold the job in its options (`ParallelOptions { job, machine }`, as
//! `grandis train` does), partition (deterministically, so every server of the job
//! arrives at the same partition and plans), fetch the checkpoint a retry resumes from
//! ([`checkpoint`]), connect the data plane ([`plane`]), run this server's ranks through
//! `grandis_parallel::server::train_server`, and report ([`report`]); the leader uploads each
//! checkpoint it writes to the coordinator, which keeps it for retries.
//! Every wait is bounded: the connection set-up by `connect_timeout_ms`, a dead peer by the
//! QUIC idle timeout (`peer_timeout_ms`), a stuck receive by `recv_timeout_ms`, and a cancel
//! by the [`Cancellable`] transport wrapper, which wakes blocked receives within
//! [`CANCEL_POLL`].

mod cancel;
mod checkpoint;
mod plane;
mod report;

use std::net::{SocketAddr, UdpSocket};
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use grandis_fabric::Topology;
use grandis_models::ModelConfig;
use grandis_parallel::{Machine, ParallelOptions, PartitionedGraph};
use grandis_trainer::TrainOptions;
use grandis_wire::{Assignment, EpochProgress, JobEvent, JobId, JobSpec, LinkBytes, RunSummary};

pub use cancel::{Cancellable, CANCEL_POLL};

use crate::config::DaemonConfig;
use crate::metrics::{Finished, Metrics};
use grandis_client::{CallError, Client};

/// What the job thread needs from the daemon.
pub struct JobContext {
    pub config: Arc<DaemonConfig>,
    pub client: Client,
    pub daemon_id: u64,
    pub metrics: Arc<Metrics>,
    /// The data-plane UDP port, held between jobs so nothing else takes it.
    pub reserved: Arc<Mutex<Option<UdpSocket>>>,
    /// The address the data plane binds (the reserved socket's).
    pub data_addr: SocketAddr,
    /// Set by the heartbeat loop when the coordinator cancels the job (or on shutdown).
    pub cancel: Arc<AtomicBool>,
    /// Last epoch completed, for heartbeats.
    pub epoch: Arc<AtomicU32>,
    /// A run's `finished` report the coordinator did not take (down, or restarted and no
    /// longer knowing this daemon): the heartbeat loop sends it again once registered.
    pub unreported: Arc<Unreported>,
}

/// A `finished` report not delivered yet: (job, attempt, event).
#[derive(Default)]
pub struct Unreported(Mutex<Option<(JobId, u32, JobEvent)>>);

impl Unreported {
    fn keep(&self, job: JobId, attempt: u32, event: JobEvent) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some((job, attempt, event));
    }

    /// Sends the kept report as daemon `daemon_id` (the current registration); it is kept
    /// only while the coordinator cannot be reached (a refusal is final: logged).
    pub fn send(&self, client: &Client, daemon_id: u64) {
        let lock = || self.0.lock().unwrap_or_else(|e| e.into_inner());
        // Taken out for the call, so a job's reporter keeping a report never waits on it.
        let Some((job, attempt, event)) = lock().take() else {
            return;
        };
        match client.event(daemon_id, job, attempt, event.clone()) {
            Ok(()) => tracing::info!(
                job,
                attempt,
                "the coordinator took the run's finished report"
            ),
            Err(CallError::Status { status, body, .. }) => tracing::warn!(
                job,
                attempt,
                "the run's finished report was refused ({status} {}): {}",
                body.code,
                body.error
            ),
            Err(e) => {
                tracing::debug!(job, "the run's finished report not delivered yet: {e}");
                // Kept for the next try, unless a newer run's report came meanwhile.
                lock().get_or_insert((job, attempt, event));
            }
        }
    }
}

/// How this server's part ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed,
    Cancelled,
}

impl Outcome {
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Failed => "failed",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// What the job thread hands the reporter thread, which sends it to the coordinator in order.
enum Outbound {
    Event(JobEvent),
    /// The leader wrote a checkpoint: upload the newest one in [`checkpoint::Latest`].
    Checkpoint,
}

/// Runs the job and reports its events (started, progress on server 0, finished or failed).
pub fn run_job(ctx: JobContext, a: Assignment) -> Outcome {
    let job = a.job_id;
    let label = ctx.config.label.clone();
    let (tx, rx) = mpsc::channel::<Outbound>();
    let latest = Arc::new(checkpoint::Latest::default());
    // Events go out in order from one thread, so a slow coordinator never stalls training.
    let reporter = {
        let client = ctx.client.clone();
        let daemon_id = ctx.daemon_id;
        let latest = latest.clone();
        let attempt = a.attempt;
        let unreported = ctx.unreported.clone();
        std::thread::Builder::new()
            .name(format!("grandis-report-{job}"))
            .spawn(move || {
                for out in rx {
                    match out {
                        Outbound::Event(ev) => {
                            let finished = matches!(ev, JobEvent::Finished { .. });
                            if !post_event(&client, daemon_id, job, attempt, ev.clone()) && finished
                            {
                                // The run's result must not be lost with a restarted
                                // coordinator: sent again once registered anew.
                                unreported.keep(job, attempt, ev);
                            }
                        }
                        Outbound::Checkpoint => {
                            checkpoint::upload(&client, daemon_id, job, attempt, &latest)
                        }
                    }
                }
            })
    };
    let events = Events { tx, latest };
    events.send(JobEvent::Started);
    tracing::info!(
        job,
        attempt = a.attempt,
        server_index = a.server_index,
        servers = a.servers.len(),
        resume_epoch = ?a.resume_epoch,
        "job started"
    );
    let start = Instant::now();
    // Whatever ends the job here, a panic included, must reach the coordinator: a job whose
    // daemon never says it ended stays `running` and blocks the queue behind it.
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| execute(&ctx, &a, &events)))
        .unwrap_or_else(|panic| {
            Err(anyhow::anyhow!(
                "internal error (a bug: please report it): {}",
                grandis_telemetry::panic::message(panic.as_ref())
            ))
        });
    let outcome = match result {
        Ok(summary) => {
            tracing::info!(
                job,
                seconds = start.elapsed().as_secs_f64(),
                "job finished on this server"
            );
            events.send(JobEvent::Finished {
                summary: Box::new(summary),
            });
            Outcome::Succeeded
        }
        Err(e) if ctx.cancel.load(Ordering::SeqCst) => {
            tracing::info!(job, "job cancelled: {e:#}");
            Outcome::Cancelled
        }
        Err(e) => {
            let reason = format!("{e:#}");
            let retryable = is_retryable(&e);
            tracing::error!(job, server = %label, retryable, "job failed: {reason}");
            events.send(JobEvent::Failed { reason, retryable });
            Outcome::Failed
        }
    };
    drop(events);
    if let Ok(h) = reporter {
        let _ = h.join();
    }
    // The upload is done (the reporter has ended): older copies can go.
    checkpoint::prune(&ctx.config, ctx.config.keep_checkpoints);
    // The run's buffers are freed; an idle daemon should not hold their pages.
    grandis_engine::cpu::release_freed_memory();
    ctx.metrics.outcome(outcome.name());
    // Hold the data-plane port again for the next job.
    let mut slot = ctx.reserved.lock().unwrap_or_else(|e| e.into_inner());
    if slot.is_none() {
        match UdpSocket::bind(ctx.data_addr) {
            Ok(s) => *slot = Some(s),
            Err(e) => tracing::warn!(
                "cannot reserve the data-plane port {} again: {e} (the next job binds it anew)",
                ctx.data_addr
            ),
        }
    }
    outcome
}

/// The job thread's side of the reporter.
struct Events {
    tx: mpsc::Sender<Outbound>,
    latest: Arc<checkpoint::Latest>,
}

impl Events {
    fn send(&self, ev: JobEvent) {
        // The reporter lives until `Events` is dropped, so this only fails if it panicked.
        let _ = self.tx.send(Outbound::Event(ev));
    }

    /// Hands the checkpoint just written after `epoch` to the reporter.
    fn checkpoint(&self, epoch: u32, path: &std::path::Path) {
        match std::fs::read(path) {
            Ok(bytes) => {
                self.latest.put(epoch, bytes);
                let _ = self.tx.send(Outbound::Checkpoint);
            }
            Err(e) => tracing::warn!(
                epoch,
                "cannot read the checkpoint {} to upload it: {e}",
                path.display()
            ),
        }
    }
}

/// Whether a failure is about the cluster rather than the job: a peer server went away or
/// fell silent, or the servers could not connect. A retry on healthy servers may succeed;
/// anything else (a bad dataset, a bug) would fail the same way again.
fn is_retryable(e: &anyhow::Error) -> bool {
    use grandis_fabric::FabricError;
    use grandis_quic::QuicError;
    e.chain().any(|c| {
        c.downcast_ref::<FabricError>().is_some_and(|f| {
            matches!(
                f,
                FabricError::PeerGone { .. } | FabricError::Timeout { .. }
            )
        }) || c
            .downcast_ref::<QuicError>()
            .is_some_and(|q| matches!(q, QuicError::Connect { .. } | QuicError::NotConnected(_)))
            || c.downcast_ref::<checkpoint::Unreachable>().is_some()
    })
}

/// Posts one event of run `attempt` (see [`deliver`]); whether the coordinator took it.
pub(crate) fn post_event(
    client: &Client,
    daemon_id: u64,
    job: JobId,
    attempt: u32,
    ev: JobEvent,
) -> bool {
    deliver(job, "job event", || {
        client.event(daemon_id, job, attempt, ev.clone())
    })
}

/// Makes one call to the coordinator for job `job`, retrying a few times on transport errors
/// (the coordinator may be restarting). A refusal (an error status, e.g. the job already
/// ended) is final: logged, and the job goes on. `what` names the call in the logs. Returns
/// whether the coordinator took it.
pub(crate) fn deliver(
    job: JobId,
    what: &str,
    mut call: impl FnMut() -> Result<(), CallError>,
) -> bool {
    for attempt in 0..5 {
        match call() {
            Ok(()) => return true,
            Err(CallError::Status { status, body, .. }) => {
                tracing::warn!(
                    job,
                    "{what} refused ({status} {}): {}",
                    body.code,
                    body.error
                );
                return false;
            }
            Err(e) => {
                tracing::warn!(job, attempt, "{what} not delivered: {e}");
                std::thread::sleep(Duration::from_millis(200 << attempt));
            }
        }
    }
    false
}

/// The per-device budget of a job. `auto` decides between FLX and CoB from it, so every
/// server must reach the same decision: only the job's own `device_memory` is used (the
/// servers' local budgets may differ, and different decisions would deadlock the job).
/// Other modes take the job's value, else the daemon's `device_memory`, else available
/// memory / devices (only FLX's k depends on it; set it in the job on mixed servers).
pub fn device_memory(
    spec: &JobSpec,
    daemon_budget: Option<u64>,
    compute: &grandis_parallel::Compute,
    devices: usize,
) -> anyhow::Result<u64> {
    match (spec.mode, spec.device_memory, daemon_budget) {
        (_, Some(b), _) => Ok(b),
        (grandis_wire::Mode::Auto, None, _) => bail!(
            "mode auto needs device_memory in the job: every server must make the same \
             FLX-or-CoB decision, so it is taken from the job, not from each server's memory \
             (`grandis cluster up` fills it in with available memory / ranks)"
        ),
        (_, None, Some(b)) => Ok(b),
        // This server's ranks: host memory / ranks on the CPU, the GPU's free memory / the
        // ranks sharing it on CUDA.
        (_, None, None) => Ok(grandis_parallel::default_budget(compute, 1, devices)?.0),
    }
}

fn execute(ctx: &JobContext, a: &Assignment, events: &Events) -> anyhow::Result<RunSummary> {
    let cfg = &ctx.config;
    let spec = &a.spec;
    spec.validate()
        .context("the assigned job spec is invalid")?;
    if !spec.mode.is_distributed() {
        bail!(
            "mode single: one process on one device; run it with `grandis train --mode single` \
             (the daemons run {})",
            grandis_wire::Mode::DISTRIBUTED_NAMES
        );
    }
    let (s, g) = (a.servers.len(), spec.devices as usize);
    let me = a.server_index as usize;
    if s != spec.servers as usize || me >= s {
        bail!(
            "assignment lists {s} servers for a job of {} (this is index {me})",
            spec.servers
        );
    }
    if a.servers[me].label != cfg.label {
        bail!(
            "assignment names server {me} {:?}, this daemon is {:?}",
            a.servers[me].label,
            cfg.label
        );
    }
    if g > cfg.devices {
        bail!(
            "the job needs {g} devices per server, this server has {}",
            cfg.devices
        );
    }

    // The dataset: the whole graph is mapped (the plans are global), but only the rows this
    // server's plans touch are ever read from the feature file.
    let dir = PathBuf::from(&spec.dataset);
    if !dir.exists() {
        bail!("dataset {}: not found on this server", dir.display());
    }
    // Trained on only once its bytes are verified: the checksums are read once per file
    // version and remembered in the work dir (a flipped byte in the features trained to
    // success when only the structure was checked).
    let record = cfg.work_dir.join("verified-datasets.json");
    let started = std::time::Instant::now();
    let (dataset, verification) = grandis_store::Dataset::open(&dir)
        .and_then(|d| d.verify_once(&record).map(|v| (d, v)))
        .with_context(|| format!("opening dataset {}", dir.display()))?;
    if verification == grandis_store::Verification::Verified {
        tracing::info!(
            dataset = %dir.display(),
            seconds = started.elapsed().as_secs_f64(),
            "dataset verified (checksums of every file; remembered for this version)"
        );
    }
    let view = dataset.view();
    let compute = cfg.compute()?;
    // The job as this server runs it: with the budget resolved.
    let job = JobSpec {
        device_memory: Some(device_memory(spec, cfg.device_memory, &compute, g)?),
        ..spec.clone()
    };
    // A partition directory's id maps are verified like the dataset, once per version.
    if let Some(dir) = &job.partition_dir {
        grandis_partition::PartitionBook::open(dir)
            .and_then(|book| book.verify_once(&record))
            .with_context(|| format!("opening partition dir {dir}"))?;
    }
    let part = PartitionedGraph::for_job(&dataset, &job).context("the job's partition")?;
    check_cancel(ctx)?;
    let config = ModelConfig::for_job(&job, &view);
    let opts = TrainOptions::for_job(&job);
    // Every server keeps the job's checkpoint at `work_dir/jobs/ID/LABEL.checkpoint...`
    // (the label: daemons of a test cluster share a work_dir); the leader writes it, and a
    // retry starts from the coordinator's copy on every server (or from scratch, with no
    // local leftovers).
    let checkpoint_path = cfg
        .work_dir
        .join("jobs")
        .join(a.job_id.to_string())
        .join(format!("{}.checkpoint.safetensors", cfg.label));
    checkpoint::prepare(ctx, a, &checkpoint_path)?;
    let mut popts = ParallelOptions {
        job: job.clone(),
        machine: Machine {
            compute,
            threads_per_rank: cfg.threads.map(|t| (t / g).max(1)),
            checkpoint: grandis_trainer::CheckpointOptions {
                // A job that predicts keeps its final model too: a retry after a failure in the
                // inference resumes from it and predicts without training again.
                path: (job.checkpoint_every.is_some()
                    || a.resume_epoch.is_some()
                    || job.predict.is_some())
                .then(|| checkpoint_path.clone()),
                every: job.checkpoint_every.map(|n| n as usize),
                resume: a.resume_epoch.is_some(),
            },
            ..Machine::default()
        },
    };
    tracing::info!(
        mode = %popts.job.mode,
        sampling = ?popts.job.sampling,
        batch_size = ?popts.batch_size(),
        device_memory = ?popts.job.device_memory,
        "job options"
    );
    check_cancel(ctx)?;

    let topology = Topology {
        servers: s,
        devices: g,
    };
    let (node, mut endpoints) = plane::connect(ctx, a, topology)?;
    // The rates the performance model needs, over this job's own transport and devices; every
    // server of the job measures at the same time (the probe is collective).
    let rates = grandis_parallel::measure::server_rates(
        &popts.machine.compute,
        popts.rank_threads(g),
        &mut endpoints,
        job.hidden as usize,
    )
    .context("measuring this server's compute and links")?;
    tracing::info!(
        gemm_gflops = rates.compute.gemm_flops_per_s / 1e9,
        aggregation_g_edge_cols = rates.compute.aggregation_edge_cols_per_s / 1e9,
        intra = ?rates.intra,
        inter = ?rates.inter,
        seconds = rates.seconds,
        "measured this server"
    );
    events.send(JobEvent::Measured {
        rates: rates.clone(),
    });
    // `auto` plans with them (every server's, gathered at the first server), and with the
    // cores the ranks share: servers whose data planes are all on loopback are processes of
    // this one machine (`grandis cluster up`).
    popts.machine.measured = Some(rates.clone());
    popts.machine.servers_share_machine = a.servers.iter().all(|s| {
        s.data_addr
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|addr| addr.ip().is_loopback())
    });
    let labels = Metrics::labels(a.job_id, &cfg.label);
    let leader = me == 0;
    let report = grandis_parallel::server::train_server(
        view,
        &part,
        config,
        &opts,
        &popts,
        endpoints,
        &mut |e| {
            ctx.epoch.store(e.epoch as u32, Ordering::SeqCst);
            ctx.metrics.epoch(
                &labels,
                e.epoch,
                e.seconds,
                e.loss,
                [e.train_acc, e.val_acc],
            );
            if leader && popts.machine.checkpoint.due(e.epoch, opts.epochs) {
                // Global rank 0 (this server's first) wrote it before reporting the epoch.
                if let Some(path) = &popts.machine.checkpoint.path {
                    events.checkpoint(e.epoch as u32, path);
                }
            }
            if leader {
                events.send(JobEvent::Progress {
                    progress: EpochProgress {
                        epoch: e.epoch as u32,
                        loss: e.loss,
                        train_acc: e.train_acc,
                        val_acc: e.val_acc,
                        seconds: e.seconds,
                        // Cluster-wide bytes are only known at the end (each server counts its
                        // own ranks); see the summary and the daemons' metrics.
                        bytes: LinkBytes::default(),
                    },
                });
            }
        },
    );
    // The transports are gone with the workers: let the writers drain, then close.
    let wire = node.shutdown(Duration::from_secs(5));
    let report = report?;
    let device = popts.machine.compute.name();
    let summary = report::server_summary(ctx, a, &job, &report, wire, device, rates);
    report::write(cfg, a.job_id, &summary)?;
    let peak_device = report
        .execution
        .memory
        .iter()
        .map(|m| m.measured_peak_bytes)
        .max()
        .unwrap_or(0);
    ctx.metrics.finished(
        &labels,
        &Finished {
            counters: &report.counters,
            test_acc: report.train.test_acc,
            all_reduce_seconds: report.execution.time_split.all_reduce_s,
            peak_rss: grandis_telemetry::peak_rss_bytes(),
            peak_device,
            preload_hops: report.execution.preload_hops,
            sampled_edges: report.execution.sampled_edges,
            predicted_epoch_seconds: report.execution.plan.as_ref().map(|p| p.prediction.epoch_s),
            wire_sent: wire.bytes_sent,
            wire_received: wire.bytes_received,
        },
    );
    Ok(summary)
}

fn check_cancel(ctx: &JobContext) -> anyhow::Result<()> {
    if ctx.cancel.load(Ordering::SeqCst) {
        bail!("job cancelled");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use grandis_parallel::Compute;
    use grandis_wire::Mode;

    #[test]
    fn auto_takes_its_budget_from_the_job_only() {
        let spec = JobSpec {
            dataset: "d".into(),
            mode: Mode::Auto,
            ..JobSpec::default()
        };
        let e = device_memory(&spec, Some(1 << 30), &Compute::Cpu, 2)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("mode auto needs device_memory"), "{e}");
        let spec = JobSpec {
            device_memory: Some(5 << 20),
            ..spec
        };
        assert_eq!(
            device_memory(&spec, Some(1 << 30), &Compute::Cpu, 2).unwrap(),
            5 << 20
        );
        let spec = JobSpec {
            mode: Mode::Flx,
            device_memory: None,
            ..spec
        };
        assert_eq!(
            device_memory(&spec, Some(1 << 30), &Compute::Cpu, 2).unwrap(),
            1 << 30
        );
    }
}
