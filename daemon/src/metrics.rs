//! Prometheus metrics of one daemon (OpenMetrics text at `GET /metrics`): per job and server,
//! the epoch, epoch seconds, loss and accuracies (updated every epoch); bytes and receive-wait
//! seconds per link class, layer and phase, all-reduce seconds, peak memory, preloaded hops
//! and the bytes the QUIC data plane really moved (set when the server's part of the job
//! ends); and per daemon, jobs by outcome.
//!
//! Per-job series carry the job id as `grandis_job`, not `job`, as the coordinator's do:
//! Prometheus attaches its own `job` label (the scrape job) to every series it stores and would
//! rename an exported `job` to `exported_job`, so the exposition uses the name the alert rules
//! and dashboard select on, with no relabelling in the scrape config.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use grandis_fabric::Counters;
use prometheus_client::encoding::{EncodeLabelSet, LabelSetEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Content type of the metrics page.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type FGauge = Gauge<f64, AtomicU64>;

/// The label naming the job of a per-job series (see the module docs for why not `job`).
const JOB_LABEL: &str = "grandis_job";

/// The labels every per-job series starts with: the job and this daemon's server.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct JobLabels {
    pub job: String,
    pub server: String,
}

// Written by hand rather than derived, because the derive would name the label after the field.
impl EncodeLabelSet for JobLabels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        [
            (JOB_LABEL, self.job.as_str()),
            ("server", self.server.as_str()),
        ]
        .encode(encoder)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SplitLabels {
    #[prometheus(flatten)]
    job: JobLabels,
    split: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LinkLabels {
    #[prometheus(flatten)]
    job: JobLabels,
    class: String,
    layer: String,
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    #[prometheus(flatten)]
    job: JobLabels,
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
}

/// All metrics of a daemon.
pub struct Metrics {
    registry: Mutex<Registry>,
    epoch: Family<JobLabels, FGauge>,
    epoch_seconds: Family<JobLabels, FGauge>,
    loss: Family<JobLabels, FGauge>,
    accuracy: Family<SplitLabels, FGauge>,
    link_bytes: Family<LinkLabels, FGauge>,
    link_wait_seconds: Family<LinkLabels, FGauge>,
    all_reduce_seconds: Family<JobLabels, FGauge>,
    peak_memory: Family<KindLabels, FGauge>,
    preload_hops: Family<JobLabels, FGauge>,
    predicted_epoch_seconds: Family<JobLabels, FGauge>,
    sampled_edges: Family<JobLabels, FGauge>,
    wire_bytes: Family<KindLabels, FGauge>,
    jobs: Family<OutcomeLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut r = Registry::with_prefix("grandis");
        let m = Metrics {
            registry: Mutex::new(Registry::default()),
            epoch: Family::default(),
            epoch_seconds: Family::default(),
            loss: Family::default(),
            accuracy: Family::default(),
            link_bytes: Family::default(),
            link_wait_seconds: Family::default(),
            all_reduce_seconds: Family::default(),
            peak_memory: Family::default(),
            preload_hops: Family::default(),
            predicted_epoch_seconds: Family::default(),
            sampled_edges: Family::default(),
            wire_bytes: Family::default(),
            jobs: Family::default(),
        };
        r.register(
            "job_epoch",
            "Last epoch completed by the job",
            m.epoch.clone(),
        );
        r.register(
            "job_epoch_seconds",
            "Wall seconds of the last training step",
            m.epoch_seconds.clone(),
        );
        r.register(
            "job_loss",
            "Training loss of the last epoch (cluster-wide)",
            m.loss.clone(),
        );
        r.register(
            "job_accuracy",
            "Accuracy by split (train/val: last epoch; test: at the end)",
            m.accuracy.clone(),
        );
        r.register(
            "job_link_bytes",
            "Payload bytes sent by this server's ranks over the job, by link class, layer and phase",
            m.link_bytes.clone(),
        );
        r.register(
            "job_link_wait_seconds",
            "Seconds this server's ranks waited on receives over the job, by link class, layer and phase",
            m.link_wait_seconds.clone(),
        );
        r.register(
            "job_all_reduce_seconds",
            "Mean seconds per epoch in the weight-gradient all-reduce",
            m.all_reduce_seconds.clone(),
        );
        r.register(
            "job_peak_memory_bytes",
            "Peak memory: process RSS, and the largest device worker's metered buffers",
            m.peak_memory.clone(),
        );
        r.register(
            "job_preload_hops",
            "Hops k preloaded per server (0 = FB_base)",
            m.preload_hops.clone(),
        );
        r.register(
            "job_predicted_epoch_seconds",
            "Epoch seconds the planner predicted for the plan mode auto chose (compare \
             job_epoch_seconds)",
            m.predicted_epoch_seconds.clone(),
        );
        r.register(
            "job_sampled_edges",
            "Edges of the one-hop graphs the job's ranks hold per epoch, summed over steps \
             (cluster-wide; the exact graph's when not sampling)",
            m.sampled_edges.clone(),
        );
        r.register(
            "job_wire_bytes",
            "Bytes the QUIC data plane wrote and read (payload and framing)",
            m.wire_bytes.clone(),
        );
        r.register(
            "daemon_jobs",
            "Jobs this daemon's server took part in, by outcome",
            m.jobs.clone(),
        );
        *m.registry.lock().unwrap_or_else(|e| e.into_inner()) = r;
        m
    }

    pub fn labels(job: u64, server: &str) -> JobLabels {
        JobLabels {
            job: job.to_string(),
            server: server.to_string(),
        }
    }

    /// One epoch done.
    pub fn epoch(&self, l: &JobLabels, epoch: usize, seconds: f64, loss: f64, acc: [f64; 2]) {
        self.epoch.get_or_create(l).set(epoch as f64);
        self.epoch_seconds.get_or_create(l).set(seconds);
        self.loss.get_or_create(l).set(loss);
        for (split, a) in ["train", "val"].into_iter().zip(acc) {
            self.accuracy.get_or_create(&split_labels(l, split)).set(a);
        }
    }

    /// The server's part of the job ended: traffic, time and memory figures.
    pub fn finished(&self, l: &JobLabels, f: &Finished<'_>) {
        self.accuracy
            .get_or_create(&split_labels(l, "test"))
            .set(f.test_acc);
        for e in f.counters.epochs.iter() {
            for r in &e.links {
                let key = LinkLabels {
                    job: l.clone(),
                    class: serde_name(&r.class),
                    layer: r.layer.to_string(),
                    phase: serde_name(&r.phase),
                };
                self.link_bytes
                    .get_or_create(&key)
                    .inc_by(r.bytes_sent as f64);
                self.link_wait_seconds
                    .get_or_create(&key)
                    .inc_by(r.wait_seconds);
            }
        }
        self.all_reduce_seconds
            .get_or_create(l)
            .set(f.all_reduce_seconds);
        for (kind, v) in [("rss", f.peak_rss), ("device_max", f.peak_device)] {
            self.peak_memory
                .get_or_create(&kind_labels(l, kind))
                .set(v as f64);
        }
        self.preload_hops
            .get_or_create(l)
            .set(f.preload_hops as f64);
        self.sampled_edges
            .get_or_create(l)
            .set(f.sampled_edges as f64);
        if let Some(s) = f.predicted_epoch_seconds {
            self.predicted_epoch_seconds.get_or_create(l).set(s);
        }
        for (kind, v) in [("sent", f.wire_sent), ("received", f.wire_received)] {
            self.wire_bytes
                .get_or_create(&kind_labels(l, kind))
                .set(v as f64);
        }
    }

    /// Counts a job outcome (`succeeded`, `failed`, `cancelled`).
    pub fn outcome(&self, outcome: &str) {
        self.jobs
            .get_or_create(&OutcomeLabels {
                outcome: outcome.into(),
            })
            .inc();
    }

    /// The OpenMetrics text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &reg) {
            tracing::error!("encoding metrics: {e}");
        }
        out
    }
}

/// What [`Metrics::finished`] records.
pub struct Finished<'a> {
    pub counters: &'a Counters,
    pub test_acc: f64,
    pub all_reduce_seconds: f64,
    pub peak_rss: u64,
    pub peak_device: u64,
    pub preload_hops: usize,
    pub sampled_edges: u64,
    /// mode auto: the chosen plan's predicted epoch seconds.
    pub predicted_epoch_seconds: Option<f64>,
    pub wire_sent: u64,
    pub wire_received: u64,
}

fn split_labels(l: &JobLabels, split: &str) -> SplitLabels {
    SplitLabels {
        job: l.clone(),
        split: split.into(),
    }
}

fn kind_labels(l: &JobLabels, kind: &str) -> KindLabels {
    KindLabels {
        job: l.clone(),
        kind: kind.into(),
    }
}

/// The serde name of a unit enum value (`inter_server`, `forward`).
fn serde_name(v: &impl serde::Serialize) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        other => format!("{other:?}"),
    }
}

/// Scrapes answered at once; a connection past it is closed unanswered (the scraper retries).
const MAX_SCRAPES: usize = 16;
/// A client must send its whole request head within this time of connecting.
const REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// Bound on the request head (a scrape's is a few hundred bytes).
const MAX_HEAD: usize = 16 * 1024;

/// Serves `GET /metrics` (and `GET /healthz`) on `addr`; returns the bound address. A
/// deliberately tiny HTTP/1.1 responder: one request per connection, each on its own thread
/// with a deadline for the whole request head and at most [`MAX_SCRAPES`] at once, so a slow
/// or silent client can neither hold up other scrapers nor the daemon.
pub fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> anyhow::Result<SocketAddr> {
    let listener =
        TcpListener::bind(addr).with_context(|| format!("metrics_listen: cannot bind {addr}"))?;
    let bound = listener.local_addr()?;
    let open = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("grandis-metrics".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let s = match conn {
                    Ok(s) => s,
                    Err(e) => {
                        // Out of descriptors, typically: do not spin.
                        tracing::debug!("metrics accept: {e}");
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    }
                };
                if open.fetch_add(1, Ordering::AcqRel) >= MAX_SCRAPES {
                    open.fetch_sub(1, Ordering::AcqRel);
                    tracing::debug!("metrics: {MAX_SCRAPES} scrapes in flight; closing one more");
                    continue;
                }
                let (metrics, open) = (metrics.clone(), open.clone());
                let spawned = std::thread::Builder::new()
                    .name("grandis-scrape".into())
                    .spawn(move || {
                        if let Err(e) = answer(s, &metrics) {
                            tracing::debug!("metrics request: {e}");
                        }
                        open.fetch_sub(1, Ordering::AcqRel);
                    });
                if let Err(e) = spawned {
                    tracing::warn!("metrics: cannot start a thread: {e}");
                }
            }
        })
        .context("starting the metrics thread")?;
    tracing::info!(addr = %bound, "metrics at http://{bound}/metrics");
    Ok(bound)
}

fn answer(mut s: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    let deadline = Instant::now() + REQUEST_DEADLINE;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < MAX_HEAD {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no request head within {REQUEST_DEADLINE:?}"),
            ));
        }
        s.set_read_timeout(Some(left))?;
        let n = s.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let line = String::from_utf8_lossy(&buf);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, ctype, body) = match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => ("200 OK", CONTENT_TYPE, metrics.render()),
        ("GET", "/healthz") => ("200 OK", "text/plain", "ok\n".to_string()),
        ("GET", p) => ("404 Not Found", "text/plain", format!("no page {p}\n")),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "only GET\n".to_string(),
        ),
    };
    write!(
        s,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    s.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoch_metrics_render_and_are_served() {
        let m = Arc::new(Metrics::new());
        let l = Metrics::labels(7, "node-a");
        m.epoch(&l, 3, 0.25, 1.5, [0.5, 0.25]);
        m.outcome("succeeded");
        let text = m.render();
        assert!(
            text.contains("grandis_job_loss{grandis_job=\"7\",server=\"node-a\"} 1.5"),
            "{text}"
        );
        assert!(
            text.contains(
                "grandis_job_accuracy{grandis_job=\"7\",server=\"node-a\",split=\"val\"} 0.25"
            ),
            "{text}"
        );
        assert!(
            text.contains("grandis_daemon_jobs_total{outcome=\"succeeded\"} 1"),
            "{text}"
        );
        let addr = serve("127.0.0.1:0".parse().unwrap(), m).unwrap();
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut reply = String::new();
        s.read_to_string(&mut reply).unwrap();
        assert!(reply.starts_with("HTTP/1.1 200 OK"), "{reply}");
        assert!(reply.contains("grandis_job_epoch{"), "{reply}");
    }

    fn scrape(addr: SocketAddr) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut reply = String::new();
        s.read_to_string(&mut reply).unwrap();
        reply
    }

    #[test]
    fn silent_and_slow_clients_do_not_hold_up_scrapes() {
        let addr = serve("127.0.0.1:0".parse().unwrap(), Arc::new(Metrics::new())).unwrap();
        // More silent connections than the cap, and one trickling its head.
        let silent: Vec<_> = (0..3 * MAX_SCRAPES)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let mut slow = TcpStream::connect(addr).unwrap();
        slow.write_all(b"GET /met").unwrap();
        // Once the deadline has closed them, scrapes are answered at once.
        std::thread::sleep(REQUEST_DEADLINE + Duration::from_millis(300));
        let started = Instant::now();
        assert!(scrape(addr).starts_with("HTTP/1.1 200 OK"));
        assert!(started.elapsed() < Duration::from_secs(1));
        // The slow one was cut at the deadline.
        let mut rest = Vec::new();
        slow.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        assert_eq!(
            slow.read_to_end(&mut rest).map(|_| rest.len()).unwrap_or(0),
            0
        );
        drop(silent);
    }

    /// Every per-job family, including those with extra labels after the job's, names the job
    /// `grandis_job` first and never exports `job` (which Prometheus would rename).
    #[test]
    fn per_job_series_label_the_job_grandis_job() {
        use grandis_fabric::{EpochCounters, LinkClass, LinkRecord, Phase};
        let m = Metrics::new();
        let l = Metrics::labels(7, "node-a");
        m.epoch(&l, 1, 0.5, 2.0, [0.5, 0.25]);
        let counters = Counters {
            epochs: vec![EpochCounters {
                epoch: 1,
                links: vec![LinkRecord {
                    class: LinkClass::InterServer,
                    layer: 0,
                    phase: Phase::Forward,
                    bytes_sent: 64,
                    bytes_received: 64,
                    messages_sent: 1,
                    messages_received: 1,
                    wait_seconds: 0.125,
                }],
                ..EpochCounters::default()
            }],
        };
        m.finished(
            &l,
            &Finished {
                counters: &counters,
                test_acc: 0.75,
                all_reduce_seconds: 0.5,
                peak_rss: 4096,
                peak_device: 1024,
                preload_hops: 1,
                sampled_edges: 10,
                predicted_epoch_seconds: Some(0.25),
                wire_sent: 100,
                wire_received: 90,
            },
        );
        let text = m.render();
        let series: Vec<&str> = text
            .lines()
            .filter(|line| line.starts_with("grandis_job_"))
            .collect();
        // Sixteen series: three accuracy splits, two memory and two wire kinds, one link key,
        // one of each other family.
        assert_eq!(series.len(), 16, "{text}");
        for line in series {
            assert!(
                line.contains("{grandis_job=\"7\",server=\"node-a\""),
                "{line}"
            );
            assert!(!line.contains("{job=") && !line.contains(",job="), "{line}");
        }
        assert!(
            text.contains(
                "grandis_job_link_bytes{grandis_job=\"7\",server=\"node-a\",\
                 class=\"inter_server\",layer=\"0\",phase=\"forward\"} 64.0"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "grandis_job_predicted_epoch_seconds{grandis_job=\"7\",server=\"node-a\"} 0.25"
            ),
            "{text}"
        );
    }
}
