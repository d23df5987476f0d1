//! One server's part of one job: load the dataset, partition it (deterministically, so every
//! server of the job arrives at the same partition and plans), bind the QUIC node, connect to
//! the job's other servers, run this server's device workers through
//! `grandis_parallel::server`, and report. Every wait here is bounded: the connection set-up
//! by `connect_timeout_ms`, a dead peer by the QUIC idle timeout (`peer_timeout_ms`), a stuck
//! receive by `recv_timeout_ms`, and a cancel by the [`Cancellable`] transport wrapper, which
//! wakes blocked receives within [`CANCEL_POLL`].

use std::net::{SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use grandis_fabric::{
    Direction, Endpoint, Envelope, LinkClass, Topology, Transport, TransportError,
};
use grandis_models::{ModelConfig, ModelKind};
use grandis_parallel::{Mode, ParallelOptions, ParallelReport, PartitionedGraph};
use grandis_quic::{NodeConfig, NodeIdentity, QuicNode, WireStats};
use grandis_trainer::TrainOptions;
use grandis_wire::{Assignment, EpochProgress, JobEvent, JobId, JobSpec, LinkBytes, Sampling};
use serde_json::{json, Map, Value};

use crate::client::Client;
use crate::config::DaemonConfig;
use crate::metrics::{Finished, Metrics};

/// How often a blocked receive checks whether the job was cancelled.
pub const CANCEL_POLL: Duration = Duration::from_millis(100);

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

/// Runs the job and reports its events (started, progress on server 0, finished or failed).
pub fn run_job(ctx: JobContext, a: Assignment) -> Outcome {
    let job = a.job_id;
    let label = ctx.config.label.clone();
    let (tx, rx) = mpsc::channel::<JobEvent>();
    // Events go out in order from one thread, so a slow coordinator never stalls training.
    let reporter = {
        let client = ctx.client.clone();
        let daemon_id = ctx.daemon_id;
        std::thread::Builder::new()
            .name(format!("grandis-report-{job}"))
            .spawn(move || {
                for ev in rx {
                    post_event(&client, daemon_id, job, ev);
                }
            })
    };
    let _ = tx.send(JobEvent::Started);
    tracing::info!(
        job,
        server_index = a.server_index,
        servers = a.servers.len(),
        "job started"
    );
    let start = Instant::now();
    let result = execute(&ctx, &a, &tx);
    let outcome = match result {
        Ok(summary) => {
            tracing::info!(
                job,
                seconds = start.elapsed().as_secs_f64(),
                "job finished on this server"
            );
            let _ = tx.send(JobEvent::Finished { summary });
            Outcome::Succeeded
        }
        Err(e) if ctx.cancel.load(Ordering::SeqCst) => {
            tracing::info!(job, "job cancelled: {e:#}");
            Outcome::Cancelled
        }
        Err(e) => {
            let reason = format!("{e:#}");
            tracing::error!(job, server = %label, "job failed: {reason}");
            let _ = tx.send(JobEvent::Failed { reason });
            Outcome::Failed
        }
    };
    drop(tx);
    if let Ok(h) = reporter {
        let _ = h.join();
    }
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

/// Posts one event, retrying a few times on transport errors (the coordinator may be
/// restarting). A 4xx is final (e.g. the job already ended): log and move on.
fn post_event(client: &Client, daemon_id: u64, job: JobId, ev: JobEvent) {
    for attempt in 0..5 {
        match client.event(daemon_id, job, ev.clone()) {
            Ok(()) => return,
            Err(crate::client::CallError::Status { status, body }) => {
                tracing::warn!(
                    job,
                    "job event refused ({status} {}): {}",
                    body.code,
                    body.error
                );
                return;
            }
            Err(e) => {
                tracing::warn!(job, attempt, "job event not delivered: {e}");
                std::thread::sleep(Duration::from_millis(200 << attempt));
            }
        }
    }
}

/// The parallel mode a job spec runs in on the daemons; None = `auto` (decided per job by
/// [`parallel_options`]).
pub fn parallel_mode(spec: &JobSpec) -> anyhow::Result<Option<Mode>> {
    Ok(Some(match spec.mode {
        grandis_wire::Mode::Fb => Mode::Fb,
        grandis_wire::Mode::Flx => Mode::Flx,
        grandis_wire::Mode::Cob => Mode::Cob,
        grandis_wire::Mode::Mb => Mode::Mb,
        grandis_wire::Mode::Auto => return Ok(None),
        grandis_wire::Mode::Single => bail!(
            "mode single: one process on one device; run it with `grandis train --mode single` \
             (the daemons run fb, flx, cob, mb and auto)"
        ),
    }))
}

/// Batch size of cob/mb jobs without `batch_size` (the default the job spec documents).
pub const DEFAULT_BATCH_SIZE: u32 = 1024;

/// The job spec as the flags of `grandis train` (`grandis_parallel::cli::ParallelArgs`), so
/// the daemons and the in-process trainer share ONE mapping from flags to
/// `ParallelOptions` (`ParallelArgs::options`) and one partitioner call
/// (`ParallelArgs::partitioned`): a cluster job equals `grandis train` with the same values.
/// `device_memory` is the per-device budget already resolved for this job.
pub fn parallel_args(
    spec: &JobSpec,
    device_memory: Option<u64>,
) -> anyhow::Result<grandis_parallel::cli::ParallelArgs> {
    let mut a = grandis_parallel::cli::ParallelArgs {
        servers: spec.servers as usize,
        devices: spec.devices as usize,
        partition: spec.partition.name().to_string(),
        // Seed 0, as `grandis train` partitions by default: same partition, same losses.
        partition_seed: 0,
        partition_dir: None,
        preload_hops: spec.preload_hops.map(|k| k as usize),
        device_memory,
        // The links are real here; emulation flags are ignored by `train_server`.
        inter_bandwidth: None,
        intra_bandwidth: None,
        inter_latency_ms: 0.0,
        intra_latency_ms: 0.0,
        sampling: spec.sampling.method().to_string(),
        eas_hops: 1,
        eas_fanout: 15,
        // The paper's priority, `grandis train`'s default (the spec has no field for it).
        eas_priority: "degree".into(),
        fanouts: None,
        saint_walk_length: 2,
        resample_every: spec.resample_every,
        cobatch_size: None,
        batch_size: None,
        cuda_devices: None,
    };
    match &spec.sampling {
        Sampling::None => {}
        Sampling::Eas { hops, fanout } => {
            a.eas_hops = *hops as usize;
            a.eas_fanout = *fanout as usize;
        }
        Sampling::Fanout { fanouts } => {
            // One value means the same fanout at every layer (the spec's convention); the
            // sampler wants one per layer.
            let per_layer: Vec<u32> = if fanouts.len() == 1 {
                vec![fanouts[0]; spec.layers as usize]
            } else {
                fanouts.clone()
            };
            a.fanouts = Some(
                per_layer
                    .iter()
                    .map(|f| f.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
            );
        }
        Sampling::Saint { walk_length, .. } => a.saint_walk_length = *walk_length as usize,
    }
    let batch = match (&spec.sampling, spec.batch_size) {
        // GraphSAINT's budget per server is the co-batch size; `grandis train` draws
        // budget / (walk_length + 1) roots, so the spec's roots give the budget when no
        // batch size is set, and must agree with it when one is.
        (Sampling::Saint { roots, walk_length }, b) => {
            let from_roots = roots.saturating_mul(walk_length + 1);
            match b {
                None => Some(from_roots),
                Some(b) if (b / (walk_length + 1)).max(1) == *roots => Some(b),
                Some(b) => bail!(
                    "sampling.roots {roots} disagrees with batch_size {b}: GraphSAINT draws \
                     batch_size / (walk_length + 1) = {} roots per server; drop one of them",
                    (b / (walk_length + 1)).max(1)
                ),
            }
        }
        (_, b) => b,
    };
    match spec.mode {
        grandis_wire::Mode::Cob => {
            a.cobatch_size = Some(batch.unwrap_or(DEFAULT_BATCH_SIZE) as usize)
        }
        grandis_wire::Mode::Mb => a.batch_size = Some(batch.unwrap_or(DEFAULT_BATCH_SIZE) as usize),
        // auto: absent = the largest co-batch that fits, if it comes to CoB.
        grandis_wire::Mode::Auto => a.cobatch_size = batch.map(|b| b as usize),
        _ => {}
    }
    Ok(a)
}

/// The per-device budget of a job. `auto` decides between FLX and CoB from it, so every
/// server must reach the same decision: only the job's own `device_memory` is used (the
/// servers' local budgets may differ, and different decisions would deadlock the job).
/// Other modes take the job's value, else the daemon's `device_memory`, else available
/// memory / devices (only FLX's k depends on it; set it in the job on mixed servers).
pub fn device_memory(
    spec: &JobSpec,
    daemon_budget: Option<u64>,
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
        (_, None, None) => grandis_parallel::default_device_memory(devices),
    }
}

/// The options every server of the job trains with (a pure function of the job, the
/// dataset and the partition, so every server builds the same plans: the samplers are
/// seeded with the job's seed). For `auto`, also the decision, for the summary.
pub fn parallel_options(
    spec: &JobSpec,
    args: &grandis_parallel::cli::ParallelArgs,
    view: &grandis_store::DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
) -> anyhow::Result<(ParallelOptions, Option<String>)> {
    Ok(match parallel_mode(spec)? {
        Some(mode) => (args.options(mode, None)?, None),
        None => {
            let base = args.options(Mode::Cob, None)?;
            let (p, d) = grandis_parallel::cli::decide_auto(view, part, config, &base, spec.seed)?;
            tracing::info!("{d}");
            (p, Some(d.to_string()))
        }
    })
}

/// The model of a job spec for a dataset with `in_dim` features and `classes` classes.
pub fn model_config(spec: &JobSpec, in_dim: usize, classes: usize) -> ModelConfig {
    ModelConfig {
        kind: match spec.model {
            grandis_wire::Model::Sage => ModelKind::Sage,
            grandis_wire::Model::Gcn => ModelKind::Gcn,
            grandis_wire::Model::Ressage => ModelKind::ResSage,
        },
        layers: spec.layers as usize,
        in_dim,
        hidden: spec.hidden as usize,
        classes,
        dropout: spec.dropout as f32,
        layer_norm: false,
        seed: spec.seed,
    }
}

/// The optimiser options of a job spec (as `grandis train` builds them from the same values).
pub fn train_options(spec: &JobSpec) -> TrainOptions {
    TrainOptions {
        epochs: spec.epochs as usize,
        lr: spec.lr as f32,
        weight_decay: spec.weight_decay as f32,
        adamw: false,
        grad_clip: None,
        seed: spec.seed,
    }
}

fn execute(
    ctx: &JobContext,
    a: &Assignment,
    events: &mpsc::Sender<JobEvent>,
) -> anyhow::Result<Map<String, Value>> {
    let cfg = &ctx.config;
    let spec = &a.spec;
    spec.validate()
        .context("the assigned job spec is invalid")?;
    parallel_mode(spec)?;
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
    let dataset = grandis_store::Dataset::open(&dir)
        .with_context(|| format!("opening dataset {}", dir.display()))?;
    let view = dataset.view();
    let budget = device_memory(spec, cfg.device_memory, g)?;
    let pargs = parallel_args(spec, Some(budget))?;
    let part = pargs
        .partitioned(&dataset)
        .context("partitioning the dataset")?;
    check_cancel(ctx)?;
    let config = model_config(spec, view.feature_dim, view.num_classes);
    let opts = train_options(spec);
    let (mut popts, auto) = parallel_options(spec, &pargs, &view, &part, &config)?;
    popts.threads_per_rank = cfg.threads.map(|t| (t / g).max(1));
    tracing::info!(
        mode = popts.mode.name(),
        sampling = ?popts.sampling,
        batch_size = ?popts.batch_size,
        device_memory = budget,
        "job options"
    );
    check_cancel(ctx)?;

    // The data plane.
    let identity = NodeIdentity::load(&cfg.cert_dir, &cfg.label).with_context(|| {
        format!(
            "loading this node's certificate from {}",
            cfg.cert_dir.display()
        )
    })?;
    let roster: Vec<String> = a.servers.iter().map(|x| x.label.clone()).collect();
    let addrs = a
        .servers
        .iter()
        .map(|x| {
            crate::config::resolve(&x.data_addr)
                .with_context(|| format!("data address of server '{}'", x.label))
        })
        .collect::<anyhow::Result<Vec<SocketAddr>>>()?;
    let topology = Topology {
        servers: s,
        devices: g,
    };
    let mut node_cfg = NodeConfig::new(topology, roster, me, ctx.data_addr, identity);
    node_cfg.idle_timeout = cfg.peer_timeout();
    node_cfg.keep_alive = (cfg.peer_timeout() / 4).max(Duration::from_millis(5));
    node_cfg.handshake_timeout = cfg.connect_timeout().min(Duration::from_secs(10));
    // Release the reserved port just before the node binds it.
    drop(
        ctx.reserved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(),
    );
    let node = QuicNode::bind(node_cfg).context("starting the data plane")?;
    let transports = node.take_transports()?;
    node.establish(&addrs, cfg.connect_timeout())
        .context("connecting to the job's other servers")?;
    check_cancel(ctx)?;
    tracing::info!(servers = s, "data plane connected");
    let endpoints = transports
        .into_iter()
        .map(|t| {
            let rank = t.rank();
            let t = Cancellable {
                inner: t,
                cancel: ctx.cancel.clone(),
            };
            Endpoint::with_transport(topology, rank, Box::new(t), cfg.recv_timeout())
        })
        .collect::<Result<Vec<_>, _>>()?;

    let labels = Metrics::labels(a.job_id, &cfg.label);
    let leader = me == 0;
    let report = grandis_parallel::server::train_server(
        view,
        &part,
        config.clone(),
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
            if leader {
                let _ = events.send(JobEvent::Progress {
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
    let summary = summary(ctx, a, &report, &popts, auto, &wire);
    write_report(cfg, a.job_id, &summary)?;
    let peak_device = report
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
            all_reduce_seconds: report.time.all_reduce_s,
            peak_rss: grandis_telemetry::peak_rss_bytes(),
            peak_device,
            preload_hops: report.preload_hops,
            sampled_edges: report.sampled_edges,
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

/// This server's summary: cluster-wide losses and accuracies, this server's measured traffic
/// (fabric counters and QUIC wire statistics) and the plan's cluster-wide prediction.
fn summary(
    ctx: &JobContext,
    a: &Assignment,
    r: &ParallelReport,
    popts: &ParallelOptions,
    auto: Option<String>,
    wire: &WireStats,
) -> Map<String, Value> {
    let c = &r.counters;
    let tr = &r.train;
    let inter_sent = c.bytes(LinkClass::InterServer, Direction::Sent);
    let inter_received = c.bytes(LinkClass::InterServer, Direction::Received);
    let v = json!({
        "server": ctx.config.label,
        "server_index": a.server_index,
        "servers": a.servers.iter().map(|s| s.label.clone()).collect::<Vec<_>>(),
        "mode": r.mode,
        "devices": r.devices,
        "partition": r.partition,
        "preload_hops": r.preload_hops,
        "preload_reason": r.k_reason,
        "replicated_vertices": r.replicated_vertices,
        "losses": tr.epochs.iter().map(|e| e.loss).collect::<Vec<_>>(),
        "epoch_seconds": tr.epochs.iter().map(|e| e.seconds).collect::<Vec<_>>(),
        "final_loss": tr.final_loss,
        "train_acc": tr.train_acc,
        "val_acc": tr.val_acc,
        "test_acc": tr.test_acc,
        "median_epoch_s": tr.median_epoch_s,
        "num_parameters": tr.num_parameters,
        "threads_per_rank": r.threads_per_rank,
        "time_split": r.time,
        // This server's ranks only (sum over servers for the cluster).
        "halo_bytes_per_epoch": r.halo_bytes_per_epoch,
        "all_reduce_bytes_per_epoch": r.all_reduce_bytes_per_epoch,
        // Replicated vertices' features this server's ranks fetched from other servers.
        "fetch_bytes_per_epoch": r.fetch_bytes_per_epoch,
        "setup_fetch_bytes": r.setup_fetch_bytes,
        "inter_server_payload_sent": inter_sent,
        "inter_server_payload_received": inter_received,
        // The whole cluster, from the plan.
        "predicted_halo_bytes_per_epoch": r.predicted_halo_bytes_per_epoch,
        "wire": wire,
        "peak_rss_bytes": grandis_telemetry::peak_rss_bytes(),
        "memory": r.memory,
    });
    // A second object: one json! invocation of every key exceeds the macro recursion limit.
    // Sampling counters are cluster-wide (every server builds every rank's plans).
    let extra = json!({
        "sampling": r.sampling,
        "sampling_options": popts.sampling,
        "batch_size": r.batch_size,
        "resample_every": popts.resample_every,
        "iterations_per_epoch": r.iterations_per_epoch,
        "targets_per_epoch": r.targets_per_epoch,
        "sampled_edges": r.sampled_edges,
        "computed_vertices_per_layer": r.computed_vertices_per_layer,
        "aggregated_edges_per_layer": r.aggregated_edges_per_layer,
        "beta": r.beta,
        "auto": auto,
    });
    match (v, extra) {
        (Value::Object(mut m), Value::Object(e)) => {
            m.extend(e);
            m
        }
        _ => Map::new(),
    }
}

fn write_report(
    cfg: &DaemonConfig,
    job: JobId,
    summary: &Map<String, Value>,
) -> anyhow::Result<()> {
    let dir = cfg.work_dir.join("jobs").join(job.to_string());
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("work_dir: cannot create {}", dir.display()))?;
    let path = dir.join(format!("{}.json", cfg.label));
    let text = serde_json::to_string_pretty(summary)?;
    grandis_store::write_file_atomic(&path, text.as_bytes())
        .with_context(|| format!("writing the job report {}", path.display()))?;
    Ok(())
}

/// A transport whose receives give up soon after the job is cancelled (they wait in slices of
/// [`CANCEL_POLL`]), so a cancelled job never waits out a full receive timeout.
pub struct Cancellable<T> {
    pub inner: T,
    pub cancel: Arc<AtomicBool>,
}

impl<T: Transport> Transport for Cancellable<T> {
    fn send(&mut self, to: usize, envelope: Envelope) -> Result<(), TransportError> {
        if self.cancel.load(Ordering::SeqCst) {
            return Err(TransportError::Failed("job cancelled".into()));
        }
        self.inner.send(to, envelope)
    }

    fn recv(&mut self, from: usize, timeout: Duration) -> Result<Envelope, TransportError> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.cancel.load(Ordering::SeqCst) {
                return Err(TransportError::Failed("job cancelled".into()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TransportError::Timeout);
            }
            match self.inner.recv(from, left.min(CANCEL_POLL)) {
                Err(TransportError::Timeout) => continue,
                other => return other,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use grandis_fabric::{ChannelTransport, Header, Op, Payload, Tag};

    #[test]
    fn cancel_wakes_a_blocked_receive() {
        let topo = Topology {
            servers: 1,
            devices: 2,
        };
        let mut ts = ChannelTransport::mesh(topo, None);
        let other = ts.pop().unwrap();
        let cancel = Arc::new(AtomicBool::new(false));
        let mut t = Cancellable {
            inner: ts.pop().unwrap(),
            cancel: cancel.clone(),
        };
        let c2 = cancel.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            c2.store(true, Ordering::SeqCst);
        });
        let start = Instant::now();
        let err = t.recv(1, Duration::from_secs(60)).unwrap_err();
        assert_eq!(err, TransportError::Failed("job cancelled".into()));
        assert!(start.elapsed() < Duration::from_secs(30));
        h.join().unwrap();
        drop(other);
        // Messages still arrive when not cancelled, across poll slices.
        let mut ts = ChannelTransport::mesh(topo, None);
        let mut b = ts.pop().unwrap();
        let mut a = Cancellable {
            inner: ts.pop().unwrap(),
            cancel: Arc::new(AtomicBool::new(false)),
        };
        let env = Envelope {
            header: Header {
                tag: Tag::other(1, 0),
                op: Op::PointToPoint,
            },
            payload: Payload::F32(vec![1.0]),
        };
        let e2 = env.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(CANCEL_POLL * 3);
            b.send(0, e2).unwrap();
            b
        });
        assert_eq!(a.recv(1, Duration::from_secs(60)).unwrap(), env);
        drop(h.join().unwrap());
    }

    #[test]
    fn every_mode_maps_and_single_is_refused() {
        let spec = |mode| JobSpec {
            dataset: "d".into(),
            mode,
            ..JobSpec::default()
        };
        let e = parallel_mode(&spec(grandis_wire::Mode::Single))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("mode single"), "{e}");
        assert_eq!(
            parallel_mode(&spec(grandis_wire::Mode::Auto)).unwrap(),
            None
        );
        for (w, m) in [
            (grandis_wire::Mode::Fb, Mode::Fb),
            (grandis_wire::Mode::Flx, Mode::Flx),
            (grandis_wire::Mode::Cob, Mode::Cob),
            (grandis_wire::Mode::Mb, Mode::Mb),
        ] {
            assert_eq!(parallel_mode(&spec(w)).unwrap(), Some(m));
        }
    }

    #[test]
    fn specs_map_to_the_options_of_grandis_train() {
        use grandis_parallel::Sampling as P;
        let base = JobSpec {
            dataset: "d".into(),
            layers: 3,
            seed: 7,
            ..JobSpec::default()
        };
        // FLX-EAS with resampling.
        let spec = JobSpec {
            mode: grandis_wire::Mode::Flx,
            sampling: Sampling::Eas { hops: 2, fanout: 4 },
            resample_every: Some(3),
            ..base.clone()
        };
        let o = parallel_args(&spec, Some(1 << 20))
            .unwrap()
            .options(Mode::Flx, None)
            .unwrap();
        assert_eq!(
            o.sampling,
            P::Eas {
                hops: 2,
                fanout: 4,
                priority: grandis_parallel::Priority::Degree
            }
        );
        assert_eq!(
            (o.resample_every, o.device_memory, o.batch_size),
            (Some(3), Some(1 << 20), None)
        );
        // CoB with one fanout for every layer and a co-batch size.
        let spec = JobSpec {
            mode: grandis_wire::Mode::Cob,
            sampling: Sampling::Fanout { fanouts: vec![5] },
            batch_size: Some(64),
            ..base.clone()
        };
        let o = parallel_args(&spec, None)
            .unwrap()
            .options(Mode::Cob, None)
            .unwrap();
        assert_eq!(
            o.sampling,
            P::Fanout {
                fanouts: vec![5, 5, 5]
            }
        );
        assert_eq!(o.batch_size, Some(64));
        // MB without a batch size takes the spec's documented default.
        let spec = JobSpec {
            mode: grandis_wire::Mode::Mb,
            ..base.clone()
        };
        let o = parallel_args(&spec, None)
            .unwrap()
            .options(Mode::Mb, None)
            .unwrap();
        assert_eq!(o.batch_size, Some(DEFAULT_BATCH_SIZE as usize));
        // SAINT: the roots give the budget; a disagreeing batch size is named.
        let saint = Sampling::Saint {
            roots: 10,
            walk_length: 2,
        };
        let spec = JobSpec {
            mode: grandis_wire::Mode::Cob,
            sampling: saint.clone(),
            ..base.clone()
        };
        let o = parallel_args(&spec, None)
            .unwrap()
            .options(Mode::Cob, None)
            .unwrap();
        assert_eq!(o.batch_size, Some(30));
        assert_eq!(
            o.sampling,
            P::Saint {
                walk_length: Some(2)
            }
        );
        let spec = JobSpec {
            batch_size: Some(90),
            ..spec
        };
        let e = parallel_args(&spec, None).unwrap_err().to_string();
        assert!(
            e.contains("sampling.roots 10 disagrees with batch_size 90"),
            "{e}"
        );
    }

    #[test]
    fn auto_takes_its_budget_from_the_job_only() {
        let spec = JobSpec {
            dataset: "d".into(),
            mode: grandis_wire::Mode::Auto,
            ..JobSpec::default()
        };
        let e = device_memory(&spec, Some(1 << 30), 2)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("mode auto needs device_memory"), "{e}");
        let spec = JobSpec {
            device_memory: Some(5 << 20),
            ..spec
        };
        assert_eq!(device_memory(&spec, Some(1 << 30), 2).unwrap(), 5 << 20);
        let spec = JobSpec {
            mode: grandis_wire::Mode::Flx,
            device_memory: None,
            ..spec
        };
        assert_eq!(device_memory(&spec, Some(1 << 30), 2).unwrap(), 1 << 30);
    }
}
