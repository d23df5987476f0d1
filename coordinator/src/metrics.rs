//! `GET /metrics`: OpenMetrics text rendered from the coordinator state at scrape time.
//!
//! The registry is rebuilt on every scrape instead of being updated in place: every value is
//! a function of the state (queue, jobs, heartbeat ages), so rebuilding cannot drift from it,
//! and series of forgotten daemons or old jobs disappear without bookkeeping.
//!
//! Per-job series carry the job id as `grandis_job`, not `job`: Prometheus attaches its own
//! `job` label (the scrape job) to every series it stores and would rename an exported `job` to
//! `exported_job`, so the exposition uses the name the alert rules and dashboard select on.

use std::sync::atomic::AtomicU64;
use std::time::Instant;

use grandis_wire::JobState;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::state::Core;

pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Finished jobs whose last figures are still exported (besides every active job).
const RECENT_FINISHED: usize = 20;

/// The label naming the job of a per-job series (see the module docs for why not `job`).
const JOB_LABEL: &str = "grandis_job";

type Labels = Vec<(String, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

pub fn render(core: &Core, now: Instant) -> String {
    let mut reg = Registry::with_prefix("grandis");

    let queue_depth = Gauge::<i64>::default();
    queue_depth.set(core.queue.len() as i64);
    reg.register("queue_depth", "Jobs waiting in the queue", queue_depth);

    let jobs = Family::<Labels, Gauge<i64>>::default();
    for name in JobState::NAMES {
        let n = core
            .jobs
            .values()
            .filter(|r| r.state.name() == name)
            .count();
        jobs.get_or_create(&vec![("state".into(), name.into())])
            .set(n as i64);
    }
    reg.register("jobs", "Jobs by state", jobs);

    // Counted from the records (kept across restarts), so it only grows.
    let retries = Counter::<u64>::default();
    retries.inc_by(core.jobs.values().map(|r| r.retries.len() as u64).sum());
    reg.register(
        "job_retries",
        "Times jobs went back to the queue after losing a server or the coordinator",
        retries,
    );

    let elections = Counter::<u64>::default();
    elections.inc_by(core.elections);
    reg.register(
        "elections",
        "Heads elected since the coordinator started",
        elections,
    );

    let hb_age = Family::<Labels, FloatGauge>::default();
    let up = Family::<Labels, Gauge<i64>>::default();
    for d in core.daemons.values() {
        let labels = vec![
            ("daemon".to_string(), d.id.to_string()),
            ("label".to_string(), d.label.clone()),
        ];
        hb_age
            .get_or_create(&labels)
            .set(now.saturating_duration_since(d.last_seen).as_secs_f64());
        up.get_or_create(&labels).set(d.up as i64);
    }
    reg.register(
        "daemon_heartbeat_age_seconds",
        "Seconds since each daemon's last heartbeat",
        hb_age,
    );
    reg.register("daemon_up", "1 while the daemon is up", up);

    let terms = Family::<Labels, Gauge<i64>>::default();
    for (name, lab) in &core.labels {
        terms
            .get_or_create(&vec![("label".into(), name.clone())])
            .set(lab.term as i64);
    }
    reg.register("server_term", "Election term of each server label", terms);

    // What each server measured when its last job started (the performance model's rates).
    let gemm = Family::<Labels, FloatGauge>::default();
    let aggregation = Family::<Labels, FloatGauge>::default();
    let bandwidth = Family::<Labels, FloatGauge>::default();
    let latency = Family::<Labels, FloatGauge>::default();
    for (name, rates) in core
        .labels
        .iter()
        .filter_map(|(n, l)| l.rates.as_ref().map(|r| (n, r)))
    {
        let server = vec![("label".to_string(), name.clone())];
        gemm.get_or_create(&server)
            .set(rates.compute.gemm_flops_per_s);
        aggregation
            .get_or_create(&server)
            .set(rates.compute.aggregation_edge_cols_per_s);
        for (class, link) in [("intra_server", rates.intra), ("inter_server", rates.inter)] {
            if let Some(link) = link {
                let mut l = server.clone();
                l.push(("link_class".into(), class.into()));
                bandwidth.get_or_create(&l).set(link.bandwidth_bytes_per_s);
                latency.get_or_create(&l).set(link.latency_s);
            }
        }
    }
    reg.register(
        "server_gemm_flops",
        "Dense matrix flops per second of one device, measured when the server's last job started",
        gemm,
    );
    reg.register(
        "server_aggregation_edge_columns",
        "Aggregated edges x columns per second of one device, measured likewise",
        aggregation,
    );
    reg.register(
        "server_link_bandwidth_bytes",
        "Payload bytes per second of the server's links by class, measured likewise",
        bandwidth,
    );
    reg.register(
        "server_link_latency_seconds",
        "One-way time of a small message on the server's links by class, measured likewise",
        latency,
    );

    let epoch = Family::<Labels, Gauge<i64>>::default();
    let epoch_seconds = Family::<Labels, FloatGauge>::default();
    let loss = Family::<Labels, FloatGauge>::default();
    let train_acc = Family::<Labels, FloatGauge>::default();
    let val_acc = Family::<Labels, FloatGauge>::default();
    let link_bytes = Family::<Labels, FloatGauge>::default();
    let finished: Vec<_> = core
        .jobs
        .values()
        .rev()
        .filter(|r| r.state.is_terminal())
        .take(RECENT_FINISHED)
        .map(|r| r.id)
        .collect();
    for rec in core
        .jobs
        .values()
        .filter(|r| r.state.is_active() || finished.contains(&r.id))
    {
        let Some(last) = rec.history.last() else {
            continue;
        };
        let job = vec![(JOB_LABEL.to_string(), rec.id.to_string())];
        epoch.get_or_create(&job).set(last.epoch as i64);
        epoch_seconds.get_or_create(&job).set(last.seconds);
        loss.get_or_create(&job).set(last.loss);
        train_acc.get_or_create(&job).set(last.train_acc);
        val_acc.get_or_create(&job).set(last.val_acc);
        let (mut intra, mut inter) = (0u64, 0u64);
        for p in &rec.history {
            intra = intra.saturating_add(p.bytes.intra_server);
            inter = inter.saturating_add(p.bytes.inter_server);
        }
        for (class, bytes) in [("intra_server", intra), ("inter_server", inter)] {
            let mut l = job.clone();
            l.push(("link_class".into(), class.into()));
            link_bytes.get_or_create(&l).set(bytes as f64);
        }
    }
    reg.register("job_epoch", "Last epoch reported by each job", epoch);
    reg.register(
        "job_epoch_seconds",
        "Duration of each job's last reported epoch",
        epoch_seconds,
    );
    reg.register("job_loss", "Training loss of each job's last epoch", loss);
    reg.register(
        "job_train_accuracy",
        "Training accuracy of each job's last epoch",
        train_acc,
    );
    reg.register(
        "job_val_accuracy",
        "Validation accuracy of each job's last epoch",
        val_acc,
    );
    reg.register(
        "job_link_bytes",
        "Bytes moved by each job so far, per link class",
        link_bytes,
    );

    let mut out = String::new();
    encode(&mut out, &reg).expect("writing to a String cannot fail");
    out
}
