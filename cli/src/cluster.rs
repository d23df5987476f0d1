//! `grandis cluster up`: a whole cluster on this machine for trying grandis out and for
//! end-to-end tests: certificates, a coordinator and one daemon PROCESS per server on
//! 127.0.0.1 (ports chosen at run time), one job submitted and followed, a summary printed,
//! and everything shut down again — also on failure and on Ctrl-C. The child processes are
//! this same executable (`grandis coordinator` / `grandis daemon`); each also exits by itself
//! when this process disappears (it watches its parent), so no orphans are left behind.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};

use grandis_client::JobFormat;
use grandis_coordinator::CoordinatorConfig;
use grandis_daemon::DaemonConfig;
use grandis_launch::{stop_all, Proc};
use grandis_wire::{JobSpec, Mode, RunSummary};

use crate::job_args::{validate_as_flags, JobArgs};
use crate::submit::{client, progress_line, require_success};

#[derive(Subcommand)]
pub enum ClusterCommand {
    /// Start a coordinator and S daemons on this machine, run one job, print its summary and
    /// shut everything down (or, with --serve, keep them up for jobs submitted over REST).
    ///
    /// Each server is a separate `grandis daemon` process with its own certificate (from a
    /// fresh cluster CA), talking QUIC over loopback; the coordinator is a `grandis
    /// coordinator` process. Without --dataset a small synthetic graph is generated. Logs of
    /// the processes go to <work dir>/logs (kept with --keep-work-dir or --work-dir).
    Up(Box<UpArgs>),
}

#[derive(Args)]
pub struct UpArgs {
    /// Dataset directory (default: a synthetic graph of --synthetic-vertices vertices).
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Vertices of the default synthetic dataset.
    #[arg(long, default_value_t = 3000)]
    pub synthetic_vertices: u64,
    /// The job: the flags of `grandis train` (--mode defaults to flx here; auto's default
    /// --device-memory is available memory / (servers x devices), as `grandis train`'s).
    #[command(flatten)]
    pub job: JobArgs,
    /// Heartbeat interval of the daemons in ms (the lease is 5 intervals, the down timeout 10).
    #[arg(long, default_value_t = 200)]
    pub heartbeat_ms: u64,
    /// Compute threads per daemon (default: cores / servers).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where every daemon's device workers compute (the daemons' `device` and
    /// `cuda_devices` keys).
    #[command(flatten)]
    pub device: crate::device::DeviceArgs,
    /// Use (and keep) this work directory instead of a temporary one.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Keep the temporary work directory (certificates, logs, job reports).
    #[arg(long)]
    pub keep_work_dir: bool,
    /// Give up if the job has not ended after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
    /// Print one JSON object (the cluster-wide run summary, QUIC totals and every server's
    /// report) as the last stdout line.
    #[arg(long, conflicts_with = "serve")]
    pub json: bool,
    /// Run no job: keep the cluster up and serve jobs over REST (`grandis submit`, the Python
    /// `Client`, curl) until Ctrl-C or SIGTERM. The job flags then only shape the cluster
    /// (--servers, --devices); the default synthetic dataset is at <work dir>/dataset.
    #[arg(long)]
    pub serve: bool,
    /// Port of the coordinator's REST API on 127.0.0.1 (default: a free one).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// The coordinator's API token (default: a fresh one, printed). The daemons use it too.
    #[arg(long, env = "GRANDIS_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// What `cluster up --json` prints: the cluster-wide [`RunSummary`] and what only a whole
/// cluster measures.
#[derive(serde::Serialize)]
struct ClusterReport {
    job_id: u64,
    #[serde(flatten)]
    summary: RunSummary,
    /// Bytes the servers' QUIC nodes wrote, payload and all, and the fabric's own count of
    /// the inter-server payload they sent (equal to the payload).
    quic_payload_bytes_sent: u64,
    quic_bytes_sent: u64,
    fabric_inter_server_bytes_sent: u64,
    wall_seconds: f64,
    /// The kept work directory (None when it was temporary).
    work_dir: Option<String>,
    /// Every server's own report, in server-index order.
    reports: Vec<RunSummary>,
}

/// The child processes, stopped together (SIGTERM, then SIGKILL after a grace period) on drop,
/// and the temporary work directory they use, removed after them (None when kept).
struct Children(Vec<Proc>, Option<tempfile::TempDir>);

impl Children {
    fn check_alive(&mut self) -> anyhow::Result<()> {
        self.0.iter_mut().try_for_each(Proc::check_alive)
    }

    fn shutdown(&mut self) {
        stop_all(&mut self.0, Duration::from_secs(5));
        self.0.clear();
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        self.shutdown();
    }
}

pub fn run(cmd: ClusterCommand) -> anyhow::Result<()> {
    match cmd {
        ClusterCommand::Up(args) => up(*args),
    }
}

/// A started local cluster: its processes (stopped on drop, before the temporary work
/// directory is removed) and what a client needs to reach it.
struct Launched {
    children: Children,
    work: PathBuf,
    logs: PathBuf,
    url: String,
    token: String,
    dataset: PathBuf,
    labels: Vec<String>,
}

fn up(args: UpArgs) -> anyhow::Result<()> {
    // The job is checked before anything starts (the dataset path is filled in later).
    let mut spec = args.job.spec(String::new(), Mode::Flx)?;
    if spec.mode == Mode::Single {
        bail!("--mode single runs in one process: use `grandis train --mode single`");
    }
    let compute = args.device.compute()?;
    if compute.is_cuda() && !grandis_parallel::CUDA_BUILT {
        bail!(
            "--device {}: {}",
            args.device.device,
            grandis_parallel::NOT_BUILT_WITH_CUDA
        );
    }
    crate::job_args::fill_auto_budget(&mut spec, &compute)?;
    spec.name = Some(format!("cluster-up-{}", spec.mode));
    validate_as_flags(&JobSpec {
        dataset: "-".into(),
        ..spec.clone()
    })?;
    if args.heartbeat_ms < 10 {
        bail!("--heartbeat-ms must be at least 10");
    }
    if args.token.as_deref().is_some_and(str::is_empty) {
        bail!("--token must not be empty");
    }
    let started = Instant::now();
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
            .map_err(|e| anyhow::anyhow!("cannot install the Ctrl-C handler: {e}"))?;
    }
    let cluster = launch(&args, spec.servers, spec.devices, started)?;
    if args.serve {
        serve(cluster, &interrupted)
    } else {
        run_job(&args, cluster, spec, &interrupted, started)
    }
}

/// Work directory, certificates, dataset, the coordinator and the daemons, up and registered.
fn launch(args: &UpArgs, servers: u32, devices: u32, started: Instant) -> anyhow::Result<Launched> {
    let (temp, work): (Option<tempfile::TempDir>, PathBuf) = match &args.work_dir {
        Some(d) => {
            std::fs::create_dir_all(d)
                .with_context(|| format!("--work-dir: cannot create {}", d.display()))?;
            (None, std::fs::canonicalize(d)?)
        }
        None => {
            let t = tempfile::Builder::new()
                .prefix("grandis-cluster-")
                .tempdir()
                .context("creating a temporary work directory")?;
            let p = t.path().to_path_buf();
            if args.keep_work_dir {
                (None, t.keep())
            } else {
                (Some(t), p)
            }
        }
    };
    let logs = work.join("logs");
    std::fs::create_dir_all(&logs)?;
    eprintln!("work directory {}", work.display());

    // Certificates: one CA, one node per server (label = node name).
    let labels: Vec<String> = (0..servers).map(|i| format!("server-{i}")).collect();
    let certs = work.join("certs");
    grandis_quic::init_cluster_with(
        &certs,
        &labels,
        &grandis_quic::InitOptions {
            include_localhost: true,
            validity_days: 2,
            overwrite: true,
        },
    )?;

    // Dataset.
    let dataset = match &args.dataset {
        Some(d) => std::fs::canonicalize(d)
            .with_context(|| format!("--dataset {}: not found", d.display()))?,
        None => {
            let dir = work.join("dataset");
            let cfg = grandis_synth::SynthConfig {
                name: "synthetic".into(),
                nodes: args.synthetic_vertices,
                ..Default::default()
            };
            grandis_synth::generate(&cfg, &dir, true)
                .context("generating the default synthetic dataset")?;
            eprintln!(
                "synthetic dataset: {} vertices, {} features, {} classes",
                cfg.nodes, cfg.features, cfg.classes
            );
            dir
        }
    };

    let exe = std::env::current_exe().context("locating the grandis executable")?;
    let mut children = Children(Vec::new(), temp);
    let token = args.token.clone().unwrap_or_else(|| {
        format!(
            "cluster-up-{}-{}",
            std::process::id(),
            started.elapsed().as_nanos()
        )
    });
    let hb = args.heartbeat_ms;
    let coordinator = CoordinatorConfig {
        listen: format!("127.0.0.1:{}", args.port),
        db_path: work.join("coordinator.redb"),
        token: Some(token.clone()),
        // The daemons prove their labels with the certificates made above.
        daemon_ca: Some(certs.join(grandis_quic::certs::CA_CERT_FILE)),
        heartbeat_interval_ms: hb,
        lease_ms: hb * 5,
        down_timeout_ms: hb * 10,
        sse_keepalive_ms: 1000,
        ..CoordinatorConfig::default()
    };
    let (proc, url) = grandis_launch::start_coordinator(
        &exe,
        &coordinator,
        &work,
        &logs.join("coordinator.log"),
    )?;
    children.0.push(proc);
    eprintln!("coordinator at {url}");

    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = args.threads.unwrap_or((cores / servers as usize).max(1));
    let configs: Vec<DaemonConfig> = labels
        .iter()
        .map(|label| DaemonConfig {
            coordinator: url.clone(),
            token: Some(token.clone()),
            label: label.clone(),
            devices: devices as usize,
            device: args.device.device.name(),
            cuda_devices: args.device.cuda_devices.clone(),
            threads: Some(threads),
            data_listen: "127.0.0.1:0".into(),
            cert_dir: certs.clone(),
            work_dir: work.clone(),
            metrics_listen: Some("127.0.0.1:0".into()),
            ready_file: Some(work.join(format!("{label}.ready.json"))),
            connect_timeout_ms: 20_000,
            peer_timeout_ms: (hb * 10).max(2000),
            ..DaemonConfig::default()
        })
        .collect();
    let first_daemon = children.0.len();
    for cfg in &configs {
        let log = logs.join(format!("{}.log", cfg.label));
        children
            .0
            .push(grandis_launch::start_daemon(&exe, cfg, &work, &log)?);
    }
    for (i, cfg) in configs.iter().enumerate() {
        let r = grandis_launch::wait_ready(&mut children.0[first_daemon + i], cfg)?;
        eprintln!(
            "daemon {}: data plane {}, metrics http://{}/metrics",
            cfg.label,
            r.data_addr,
            r.metrics_addr.as_deref().unwrap_or("-")
        );
    }

    Ok(Launched {
        children,
        work,
        logs,
        url,
        token,
        dataset,
        labels,
    })
}

/// `--serve`: the cluster stays up for jobs over REST until Ctrl-C or SIGTERM, or until one
/// of its processes dies (an error naming it).
fn serve(mut cluster: Launched, interrupted: &AtomicBool) -> anyhow::Result<()> {
    eprintln!(
        "serving: coordinator {url}, token {token}\n  dataset {dataset}\n  \
         e.g. grandis submit --coordinator {url} --token {token} --dataset {dataset} --follow\n  \
         Ctrl-C stops the cluster",
        url = cluster.url,
        token = cluster.token,
        dataset = cluster.dataset.display()
    );
    while !interrupted.load(Ordering::SeqCst) {
        if let Err(e) = cluster.children.check_alive() {
            return Err(e.context(format!("see the logs in {}", cluster.logs.display())));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("stopping the cluster");
    cluster.children.shutdown();
    Ok(())
}

/// One job on the cluster, followed to its end; its summary printed.
fn run_job(
    args: &UpArgs,
    cluster: Launched,
    mut spec: JobSpec,
    interrupted: &AtomicBool,
    started: Instant,
) -> anyhow::Result<()> {
    let Launched {
        mut children,
        work,
        logs,
        url,
        token,
        dataset,
        labels,
    } = cluster;
    let (servers, devices) = (spec.servers, spec.devices);
    let hb = args.heartbeat_ms;
    spec.dataset = dataset.display().to_string();
    if let Some(dir) = &spec.partition_dir {
        // The daemons run elsewhere (their own working directories): give them the full path.
        spec.partition_dir = Some(
            std::fs::canonicalize(dir)
                .with_context(|| format!("--partition-dir {dir}: not found"))?
                .display()
                .to_string(),
        );
    }
    let api = client(&url, &token);
    let job = api.submit(&serde_json::to_string(&spec)?, JobFormat::Json)?;
    eprintln!(
        "submitted job {}: {} on {servers} servers x {devices} devices",
        job.id, spec.mode
    );

    // Follow on a helper thread so this one can watch for Ctrl-C, dead children and the
    // overall timeout.
    let (tx, rx) = mpsc::channel();
    let follower = {
        let id = job.id;
        std::thread::spawn(move || {
            let r = api.follow(id, &mut |p| println!("{}", progress_line(p)), &mut |s| {
                eprintln!("{}", crate::submit::state_line(id, s))
            });
            let _ = tx.send(r);
        })
    };
    let deadline = Instant::now() + Duration::from_secs(args.timeout_s);
    let end = loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(r) => break r?,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the progress stream ended"),
        }
        if interrupted.load(Ordering::SeqCst) {
            eprintln!("interrupted; stopping the cluster");
            children.shutdown();
            std::process::exit(130);
        }
        if Instant::now() > deadline {
            bail!(
                "job {} did not end within --timeout-s {}",
                job.id,
                args.timeout_s
            );
        }
        if let Err(e) = children.check_alive() {
            // The coordinator fails the job within the lease; give it that long to say why.
            if let Ok(Ok(end)) = rx.recv_timeout(Duration::from_millis(hb * 20)) {
                require_success(&end)?;
            }
            return Err(e.context(format!("see the logs in {}", logs.display())));
        }
    };
    let _ = follower.join();
    require_success(&end).map_err(|e| e.context(format!("logs in {}", logs.display())))?;

    // Per-server reports written by the daemons.
    let mut reports = Vec::new();
    for label in &labels {
        let p = work
            .join("jobs")
            .join(end.id.to_string())
            .join(format!("{label}.json"));
        let text = std::fs::read_to_string(&p)
            .with_context(|| format!("reading the job report {}", p.display()))?;
        let report: RunSummary = serde_json::from_str(&text)
            .with_context(|| format!("malformed job report {}", p.display()))?;
        reports.push(report);
    }
    children.shutdown();
    let summary = RunSummary::of_cluster(&reports).context("no server reported")?;
    let traffic = |f: fn(&grandis_wire::ServerTraffic) -> u64| -> u64 {
        reports
            .iter()
            .filter_map(|r| r.server.as_ref())
            .map(f)
            .sum()
    };
    let out = ClusterReport {
        job_id: end.id,
        quic_payload_bytes_sent: traffic(|t| t.wire.payload_bytes_sent),
        quic_bytes_sent: traffic(|t| t.wire.bytes_sent),
        fabric_inter_server_bytes_sent: traffic(|t| t.inter_server_payload_sent),
        wall_seconds: started.elapsed().as_secs_f64(),
        work_dir: children.1.is_none().then(|| work.display().to_string()),
        summary,
        reports,
    };
    let line = format!(
        "{}  QUIC bytes {} (payload {}, fabric-counted {})  wall {:.1}s",
        out.summary.line(),
        out.quic_bytes_sent,
        out.quic_payload_bytes_sent,
        out.fabric_inter_server_bytes_sent,
        out.wall_seconds
    );
    if args.json {
        eprintln!("{line}");
        println!("{}", serde_json::to_string(&out)?);
    } else {
        println!("{line}");
    }
    Ok(())
}
