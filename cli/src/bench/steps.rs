//! `grandis bench steps`: the host side of mini-batch (mb) and co-batch (cob) steps, stage by
//! stage (sampling, plan building, feature gathering), with one thread and with all of them
//! on one step, and with several threads as a run's producers use them (each building whole
//! steps: what the ranks can be fed per second); with `--baseline dgl`, DGL's CPU `NeighborSampler.sample_blocks` and `x[input_nodes]` on
//! the same graph, batch size and fanouts in the same invocation, and the ratios to it.

use std::path::PathBuf;

use anyhow::{bail, Context};
use grandis_models::ModelConfig;
use grandis_parallel::step_bench::{time_producers, time_steps, StepBenchOptions, StepTiming};
use grandis_parallel::{Mode, PartitionedGraph};
use grandis_partition::PartitionMethod;
use grandis_synth::SynthConfig;
use grandis_telemetry::median;

#[derive(clap::Args)]
pub struct BenchStepsArgs {
    /// A dataset directory to run on instead of the synthetic graph (--vertices,
    /// --avg-degree, --features, --classes and --train-fraction are then unused).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Synthetic graph: vertices (default: products-like, 2.4M vertices, ~118M edges).
    #[arg(long, default_value_t = 2_400_000)]
    pub vertices: u64,
    #[arg(long, default_value_t = 50.0)]
    pub avg_degree: f64,
    #[arg(long, default_value_t = 100)]
    pub features: usize,
    #[arg(long, default_value_t = 47)]
    pub classes: usize,
    /// Fraction of the synthetic graph's vertices that train (the batches draw from them).
    #[arg(long, default_value_t = 0.01)]
    pub train_fraction: f64,
    /// Fanouts per hop from the targets (hop 1 first); also the number of layers.
    #[arg(long, default_value = "15,10,5")]
    pub fanouts: String,
    /// Targets per mini-batch (mb, per device) and per co-batch (cob, per server).
    #[arg(long, default_value_t = 1024)]
    pub batch_size: usize,
    /// Steps built per configuration (the first iterations of epoch 0); figures are medians.
    #[arg(long, default_value_t = 8)]
    pub steps: usize,
    /// Comma-separated modes: mb, cob.
    #[arg(long, default_value = "mb,cob")]
    pub modes: String,
    /// Comma-separated thread counts (default: 1 and every core).
    #[arg(long)]
    pub threads: Option<String>,
    #[arg(long, default_value_t = 1)]
    pub servers: usize,
    #[arg(long, default_value_t = 1)]
    pub devices: usize,
    /// Partition method (for --servers x --devices above 1 x 1).
    #[arg(long, default_value = "random")]
    pub partition: String,
    /// `dgl`: DGL 2.1's CPU sampler and gather on the same graph (scripts/bench_dgl_steps.py,
    /// run with --python; needs torch and dgl there).
    #[arg(long)]
    pub baseline: Option<String>,
    /// The Python that runs the baseline.
    #[arg(long, default_value = "python3")]
    pub python: String,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print one JSON object as the last stdout line.
    #[arg(long)]
    pub json: bool,
}

/// Medians of one configuration's steps, in milliseconds.
#[derive(serde::Serialize)]
struct Row {
    system: String,
    mode: String,
    threads: usize,
    /// "step": every thread works on one step at a time (medians per step); "producers":
    /// each thread builds whole steps, as a run's producers do (wall time over the steps
    /// built, per step: the rate the ranks are fed at; no per-stage split of sampling and
    /// plans).
    across: &'static str,
    sample_ms: f64,
    plan_ms: f64,
    /// Sampling and plans (DGL: `sample_blocks`, which does both).
    sample_plan_ms: f64,
    gather_ms: f64,
    sampled_edges: f64,
    input_rows: f64,
}

fn parse_list<T: std::str::FromStr>(flag: &str, s: &str) -> anyhow::Result<Vec<T>> {
    s.split(',')
        .map(|p| {
            p.trim()
                .parse::<T>()
                .map_err(|_| anyhow::anyhow!("{flag} {s}: {p:?} is not a valid entry"))
        })
        .collect()
}

pub fn run(args: BenchStepsArgs) -> anyhow::Result<()> {
    let fanouts: Vec<u32> = parse_list("--fanouts", &args.fanouts)?;
    if fanouts.is_empty() || fanouts.contains(&0) {
        bail!(
            "--fanouts {}: give one positive fanout per layer",
            args.fanouts
        );
    }
    let modes: Vec<(Mode, &str)> = args
        .modes
        .split(',')
        .map(|m| match m.trim() {
            "mb" => Ok((Mode::Mb, "mb")),
            "cob" => Ok((Mode::Cob, "cob")),
            other => bail!("--modes {}: {other:?} is not mb or cob", args.modes),
        })
        .collect::<anyhow::Result<_>>()?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads: Vec<usize> = match &args.threads {
        Some(t) => parse_list("--threads", t)?,
        None if cores > 1 => vec![1, cores],
        None => vec![1],
    };
    if threads.contains(&0) {
        bail!("--threads: a thread count must be at least 1");
    }
    let baseline = match args.baseline.as_deref() {
        None => false,
        Some("dgl") => true,
        Some(other) => bail!("--baseline {other}: the only baseline is dgl"),
    };
    if args.steps == 0 || args.batch_size == 0 {
        bail!("--steps and --batch-size must be at least 1");
    }

    let t = std::time::Instant::now();
    let (dataset, symmetric) = super::graph::dataset_or_synthetic(
        args.data.as_deref(),
        &SynthConfig {
            name: "bench-steps".into(),
            nodes: args.vertices,
            avg_degree: args.avg_degree,
            features: args.features,
            classes: args.classes,
            seed: args.seed,
            train_fraction: args.train_fraction,
            val_fraction: 0.02,
            test_fraction: Some(0.02),
            ..SynthConfig::default()
        },
    )?;
    let view = dataset.view();
    eprintln!(
        "graph: {} vertices, {} edges, {} training vertices, in {:.1}s",
        view.num_vertices(),
        view.graph.num_edges(),
        view.train.len(),
        t.elapsed().as_secs_f64()
    );
    let method: PartitionMethod = args.partition.parse()?;
    let part = PartitionedGraph::partition(
        &view,
        symmetric,
        args.servers,
        args.devices,
        method,
        args.seed,
    )?;
    let config = ModelConfig::for_shape(
        &grandis_wire::JobSpec {
            layers: fanouts.len() as u32,
            hidden: 64,
            seed: args.seed,
            ..grandis_wire::JobSpec::default()
        },
        view.feature_dim,
        view.num_classes,
    );

    let mut rows: Vec<Row> = Vec::new();
    for &(mode, name) in &modes {
        for &n in &threads {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .context("building the thread pool")?;
            let opts = StepBenchOptions {
                mode,
                batch_size: args.batch_size,
                fanouts: fanouts.clone(),
                steps: args.steps,
                seed: args.seed,
            };
            let steps = pool.install(|| time_steps(&view, &part, &config, &opts))?;
            let row = grandis_row(name, n, &steps);
            eprintln!(
                "grandis {name} x{n}: sample {:.1} ms, plans {:.1} ms, gather {:.1} ms ({} steps)",
                row.sample_ms,
                row.plan_ms,
                row.gather_ms,
                steps.len()
            );
            rows.push(row);
            if n > 1 {
                let t = pool.install(|| time_producers(&view, &part, &config, &opts, n))?;
                let built = t.sampled_edges.len();
                let per_step = |s: f64| s * 1e3 / built.max(1) as f64;
                let med = |v: &[u64]| median(&v.iter().map(|&x| x as f64).collect::<Vec<_>>());
                let (sampled_edges, input_rows) = (med(&t.sampled_edges), med(&t.input_rows));
                let row = Row {
                    system: "grandis".into(),
                    mode: name.into(),
                    threads: n,
                    across: "producers",
                    sample_ms: f64::NAN,
                    plan_ms: f64::NAN,
                    sample_plan_ms: per_step(t.sample_plan_s),
                    gather_ms: per_step(t.gather_s),
                    sampled_edges,
                    input_rows,
                };
                eprintln!(
                    "grandis {name} x{n} producers: sample + plans {:.1} ms, gather {:.1} ms per step ({} steps)",
                    row.sample_plan_ms, row.gather_ms, built
                );
                rows.push(row);
            }
        }
    }
    let mut versions = serde_json::Value::Null;
    if baseline {
        let dir = tempfile::tempdir().context("creating a scratch folder for the baseline")?;
        export_for_dgl(&view, dir.path())?;
        for &n in &threads {
            let (row, v) = run_dgl(&args, dir.path(), n)?;
            eprintln!(
                "dgl x{n}: sample_blocks {:.1} ms, gather {:.1} ms",
                row.sample_plan_ms, row.gather_ms
            );
            versions = v;
            rows.push(row);
        }
    }
    print_table(&rows, &args, view.num_vertices(), view.graph.num_edges());
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "vertices": view.num_vertices(),
                "edges": view.graph.num_edges(),
                "fanouts": fanouts,
                "batch_size": args.batch_size,
                "steps": args.steps,
                "rows": rows,
                "baseline_versions": versions,
            })
        );
    }
    Ok(())
}

fn grandis_row(mode: &str, threads: usize, steps: &[StepTiming]) -> Row {
    let ms =
        |f: fn(&StepTiming) -> f64| median(&steps.iter().map(|s| f(s) * 1e3).collect::<Vec<_>>());
    Row {
        system: "grandis".into(),
        mode: mode.into(),
        threads,
        across: "step",
        sample_ms: ms(|s| s.sample_s),
        plan_ms: ms(|s| s.plan_s),
        sample_plan_ms: ms(|s| s.sample_s + s.plan_s),
        gather_ms: ms(|s| s.gather_s),
        sampled_edges: median(
            &steps
                .iter()
                .map(|s| s.sampled_edges as f64)
                .collect::<Vec<_>>(),
        ),
        input_rows: median(
            &steps
                .iter()
                .map(|s| s.input_rows as f64)
                .collect::<Vec<_>>(),
        ),
    }
}

/// The graph as DGL reads it (see scripts/bench_dgl_steps.py): CSC indptr/indices (our
/// in-neighbour CSR), features and training ids, in original ids.
fn export_for_dgl(
    view: &grandis_store::DatasetView<'_>,
    dir: &std::path::Path,
) -> anyhow::Result<()> {
    let g = view.graph;
    let offsets: Vec<i64> = g.offsets.iter().map(|&o| o as i64).collect();
    grandis_npy::write_npy(dir.join("indptr.npy"), &[offsets.len() as u64], &offsets)?;
    drop(offsets);
    let indices: Vec<i64> = g.indices.iter().map(|&u| u as i64).collect();
    grandis_npy::write_npy(dir.join("indices.npy"), &[indices.len() as u64], &indices)?;
    drop(indices);
    grandis_npy::write_npy(
        dir.join("x.npy"),
        &[view.num_vertices() as u64, view.feature_dim as u64],
        view.features,
    )?;
    let train: Vec<i64> = view.train.iter().map(|&v| v as i64).collect();
    grandis_npy::write_npy(dir.join("train_idx.npy"), &[train.len() as u64], &train)?;
    Ok(())
}

fn run_dgl(
    args: &BenchStepsArgs,
    dir: &std::path::Path,
    threads: usize,
) -> anyhow::Result<(Row, serde_json::Value)> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/bench_dgl_steps.py");
    let out = std::process::Command::new(&args.python)
        .arg(script)
        .arg("--dir")
        .arg(dir)
        .args(["--fanouts", &args.fanouts])
        .args(["--batch-size", &args.batch_size.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .args(["--threads", &threads.to_string()])
        .args(["--seed", &args.seed.to_string()])
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("running {} {script}", args.python))?;
    if !out.status.success() {
        bail!(
            "the DGL baseline failed ({}); it needs torch and dgl in {} (DGL 2.1: torch==2.2.1 \
             dgl==2.1.0 \"numpy<2\" torchdata==0.7.1 pyyaml pandas pydantic)",
            out.status,
            args.python
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(last)
        .with_context(|| format!("reading the DGL baseline's line {last:?}"))?;
    let steps = v["steps"]
        .as_array()
        .context("the DGL baseline printed no steps")?;
    let col = |k: &str, scale: f64| -> Vec<f64> {
        steps
            .iter()
            .filter_map(|s| s[k].as_f64())
            .map(|x| x * scale)
            .collect()
    };
    let sample = median(&col("sample_blocks_s", 1e3));
    Ok((
        Row {
            system: "dgl".into(),
            mode: "sample_blocks".into(),
            threads,
            across: "step",
            sample_ms: f64::NAN,
            plan_ms: f64::NAN,
            sample_plan_ms: sample,
            gather_ms: median(&col("gather_s", 1e3)),
            sampled_edges: median(&col("sampled_edges", 1.0)),
            input_rows: median(&col("input_rows", 1.0)),
        },
        v["versions"].clone(),
    ))
}

fn print_table(rows: &[Row], args: &BenchStepsArgs, vertices: usize, edges: usize) {
    println!(
        "steps of {} targets, fanouts {}, on {vertices} vertices / {edges} edges (medians of {} \
         steps, milliseconds per step)",
        args.batch_size, args.fanouts, args.steps
    );
    println!(
        "{:<8} {:<14} {:>7} {:>10} {:>9} {:>9} {:>12} {:>9} {:>10} {:>10} {:>12} {:>10}",
        "system",
        "mode",
        "threads",
        "across",
        "sample",
        "plans",
        "sample+plan",
        "gather",
        "vs dgl s+p",
        "vs dgl gth",
        "edges",
        "inputs"
    );
    for r in rows {
        let dgl = rows
            .iter()
            .find(|d| d.system == "dgl" && d.threads == r.threads);
        let ratio = |a: f64, b: Option<f64>| match b {
            Some(b) if b > 0.0 => format!("{:.2}x", a / b),
            _ => "-".into(),
        };
        let opt = |x: f64| {
            if x.is_nan() {
                "-".to_string()
            } else {
                format!("{x:.1}")
            }
        };
        println!(
            "{:<8} {:<14} {:>7} {:>10} {:>9} {:>9} {:>12.1} {:>9.1} {:>10} {:>10} {:>12.0} {:>10.0}",
            r.system,
            r.mode,
            r.threads,
            r.across,
            opt(r.sample_ms),
            opt(r.plan_ms),
            r.sample_plan_ms,
            r.gather_ms,
            ratio(r.sample_plan_ms, dgl.map(|d| d.sample_plan_ms)),
            ratio(r.gather_ms, dgl.map(|d| d.gather_ms)),
            r.sampled_edges,
            r.input_rows
        );
    }
}
