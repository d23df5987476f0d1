//! `grandis`: one binary for every role. Each subcommand lives in its own module and only
//! parses arguments, calls into the library crates, and prints; no algorithm lives here.

mod analyze;
mod bench;
mod certs;
mod cluster;
mod coordinator;
mod daemon;
mod data;
mod device;
mod job_args;
mod output;
mod partition;
mod plan;
mod predict;
mod submit;
mod train;
mod train_parallel;

use clap::{Parser, Subcommand};

/// grandis: distributed GNN training for clusters of multi-GPU servers (GraNNDIS design).
///
/// Typical flow: import or synthesize a dataset (`grandis data`), split it over servers and
/// devices (`grandis partition`), train (`grandis train`), predict (`grandis predict`).
/// Every command accepts `--help`. Logging follows `RUST_LOG` (default: info).
#[derive(Parser)]
#[command(name = "grandis", version, propagate_version = true)]
struct Cli {
    /// Only print warnings and errors.
    #[arg(long, short, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Import, generate, inspect and verify datasets.
    #[command(subcommand)]
    Data(data::DataCommand),
    /// Split a dataset over servers and devices (two-level partitioning).
    Partition(partition::PartitionArgs),
    /// Train a model on a dataset.
    Train(Box<train::TrainArgs>),
    /// Predict every candidate plan of a job (mode, k, sampler, co-batch size) from its exact
    /// counts and measured rates, and say which one it would run.
    Plan(Box<plan::PlanArgs>),
    /// Write predictions (and embeddings) of a trained checkpoint as .npy, layer by layer, so
    /// graphs larger than memory work too.
    Predict(predict::PredictArgs),
    /// Benchmarks, reported as ratios against a baseline run in the same invocation.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Analyses of a trained model (sampling error against full batch).
    #[command(subcommand)]
    Analyze(analyze::AnalyzeCommand),
    /// Run a local cluster (coordinator + one daemon process per server) for one job.
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// Run the coordinator: the REST API jobs are submitted to and daemons report to.
    Coordinator(coordinator::CoordinatorArgs),
    /// Run the per-server daemon (one per server, e.g. under systemd).
    Daemon(daemon::DaemonArgs),
    /// Submit a job to a coordinator and optionally follow its progress.
    Submit(Box<submit::SubmitArgs>),
    /// Cancel a job that has not ended (its servers stop their share within a heartbeat).
    Cancel(submit::CancelArgs),
    /// Certificates of the data plane's mutual TLS.
    #[command(subcommand)]
    Certs(certs::CertsCommand),
}

fn main() {
    let cli = Cli::parse();
    let default_level = if cli.quiet { "warn" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour only on a terminal: `cluster up > file` and journald get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    let result = match cli.command {
        Command::Data(cmd) => data::run(cmd),
        Command::Partition(args) => partition::run(args),
        Command::Train(args) => train::run(*args),
        Command::Plan(args) => plan::run(*args),
        Command::Predict(args) => predict::run(args),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Analyze(cmd) => analyze::run(cmd),
        Command::Cluster(cmd) => cluster::run(cmd),
        Command::Coordinator(args) => coordinator::run(args),
        Command::Daemon(args) => daemon::run(args),
        Command::Submit(args) => submit::run(*args),
        Command::Cancel(args) => submit::cancel(args),
        Command::Certs(cmd) => certs::run(cmd),
    };
    if let Err(err) = result {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
