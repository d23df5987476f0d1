//! `grandis bench ...`: each benchmark runs its baseline in the same invocation and reports
//! ratios against it, so results are comparable across machines.

mod graph;
mod link;
mod modes;
mod partition;
mod plan;
mod steps;
mod techniques;
mod train;
mod typed;

use anyhow::{bail, Context};
use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Partition one synthetic graph with every method; ratios against random.
    Partition(partition::BenchPartitionArgs),
    /// Full-batch training epoch time and memory on a synthetic graph; with `--task link`,
    /// link prediction on `--data` over seeds against PyG's protocol; with `--model rgcn`,
    /// `heterosage` or `rgat`, a typed graph over seeds against PyG's same model.
    Train(train::BenchTrainArgs),
    /// FB_base vs FLX (k = 1..L) epoch time split and traffic; speedups against FB_base.
    Modes(modes::BenchModesArgs),
    /// The planner's predicted epoch time of every candidate against the measured one, over
    /// several emulated inter-server bandwidths; whether its choice is the fastest.
    Plan(plan::BenchPlanArgs),
    /// SANCUS staleness, DGS remote-feature sampling and cluster batches against the exact
    /// runs they change, over seeds: inter-server bytes, epoch time, test accuracy and seconds
    /// to a validation accuracy, as ratios against the exact row.
    Techniques(techniques::BenchTechniquesArgs),
    /// The host side of mb and cob steps (sampling, plans, feature gathers) per step, with one
    /// thread and with all; `--baseline dgl` times DGL's CPU sampler and gather alongside.
    Steps(steps::BenchStepsArgs),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Partition(args) => partition::run(args),
        BenchCommand::Train(args) => train::run(args),
        BenchCommand::Modes(args) => modes::run(args),
        BenchCommand::Plan(args) => plan::run(args),
        BenchCommand::Techniques(args) => techniques::run(args),
        BenchCommand::Steps(args) => steps::run(args),
    }
}

/// The flags every PyG baseline script of `bench train` takes: the graph's directory, the
/// model and its training (`--model`, `--layers`, `--hidden`, `--dropout`, `--lr`,
/// `--epochs`, `--threads`, `--seed`).
pub(super) fn baseline_flags(
    args: &train::BenchTrainArgs,
    dir: &std::path::Path,
    seed: u64,
) -> Vec<String> {
    let pairs = [
        ("--dir", dir.display().to_string()),
        ("--model", args.model.to_string()),
        ("--layers", args.layers.to_string()),
        ("--hidden", args.hidden.to_string()),
        ("--dropout", args.dropout.to_string()),
        ("--lr", args.lr.to_string()),
        ("--epochs", args.epochs.to_string()),
        ("--threads", args.threads.to_string()),
        ("--seed", seed.to_string()),
    ];
    pairs
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_string(), value])
        .collect()
}

/// A baseline's result: `python script args...` run with its stderr shown, and the JSON
/// object its last stdout line holds (one with an `error` key is an error).
pub(super) struct Baseline(serde_json::Value);

impl Baseline {
    pub fn run(python: &str, script: &std::path::Path, args: &[String]) -> anyhow::Result<Self> {
        let out = std::process::Command::new(python)
            .arg(script)
            .args(args)
            .stderr(std::process::Stdio::inherit())
            .output()
            .with_context(|| format!("running {python} {}", script.display()))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let last = text
            .lines()
            .last()
            .context("the PyG baseline printed nothing")?;
        let v: serde_json::Value = serde_json::from_str(last)
            .with_context(|| format!("the PyG baseline's last line is not JSON: {last}"))?;
        if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
            bail!("the PyG baseline failed: {e}");
        }
        Ok(Baseline(v))
    }

    /// The number under `key`.
    pub fn num(&self, key: &str) -> anyhow::Result<f64> {
        self.0
            .get(key)
            .and_then(|x| x.as_f64())
            .with_context(|| format!("the PyG baseline's JSON has no {key}: {}", self.0))
    }

    pub fn get(&self, key: &str) -> Option<&serde_json::Value> {
        self.0.get(key)
    }
}

/// One seed's scores of a system in `bench train`'s seed-by-seed comparisons.
pub(super) trait SeedRun {
    /// What the scores are ("test", "test AUC").
    const METRIC: &'static str;
    /// Test score, validation score, median epoch seconds.
    fn scores(&self) -> [f64; 3];
}

/// The flags of a seed-by-seed comparison that nothing else checks: at least one seed, a
/// baseline that exists.
pub(super) fn check_seed_args(args: &train::BenchTrainArgs) -> anyhow::Result<()> {
    if args.seeds == 0 {
        bail!("--seeds must be at least 1");
    }
    if let Some(b) = args.baseline.as_deref().filter(|b| *b != "pyg") {
        bail!("unknown --baseline '{b}' (expected pyg)");
    }
    Ok(())
}

/// For each of `args.seeds` seeds from `args.seed`: prepares what both systems share (a
/// split of the edges, say), runs grandis on it, then the baseline when there is one, saying
/// each run's scores as it ends. Returns (grandis' runs, the baseline's runs).
pub(super) fn over_seeds<P, R: SeedRun>(
    args: &train::BenchTrainArgs,
    mut prepare: impl FnMut(u64) -> anyhow::Result<P>,
    mut ours: impl FnMut(&P, u64) -> anyhow::Result<R>,
    mut theirs: impl FnMut(&P, u64) -> anyhow::Result<R>,
) -> anyhow::Result<(Vec<R>, Vec<R>)> {
    let (mut our_runs, mut their_runs) = (Vec::new(), Vec::new());
    for seed in args.seed..args.seed + args.seeds as u64 {
        let shared = prepare(seed)?;
        let say = |system: &str, run: &R| {
            let [test, val, epoch] = run.scores();
            eprintln!(
                "seed {seed}: {system:<7} {} {test:.4} (val {val:.4}), median epoch {epoch:.4}s",
                R::METRIC
            );
        };
        let run = ours(&shared, seed)?;
        say("grandis", &run);
        our_runs.push(run);
        if args.baseline.is_some() {
            let run = theirs(&shared, seed)?;
            say("PyG", &run);
            their_runs.push(run);
        }
    }
    Ok((our_runs, their_runs))
}

/// The mean of `f` over `runs` (0 for none).
pub(super) fn mean<R>(runs: &[R], f: impl Fn(&R) -> f64) -> f64 {
    runs.iter().map(f).sum::<f64>() / runs.len().max(1) as f64
}

/// The training of one seed in a seed-by-seed comparison: one warm-up epoch, then the
/// `args.epochs` timed ones (as the baselines count them), Adam at `args.lr` without weight
/// decay, evaluated at the end.
pub(super) fn seed_train_options(
    args: &train::BenchTrainArgs,
    seed: u64,
    objective: grandis_trainer::Objective,
    embedding_dim: usize,
) -> grandis_trainer::TrainOptions {
    grandis_trainer::TrainOptions {
        objective,
        epochs: args.epochs + 1,
        lr: args.lr,
        weight_decay: 0.0,
        adamw: false,
        grad_clip: None,
        seed,
        eval: grandis_trainer::EvalSchedule::End,
        embedding_dim,
    }
}
