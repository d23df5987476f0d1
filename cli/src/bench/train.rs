//! `grandis bench train`: full-batch GraphSAGE epoch time and peak memory on a synthetic
//! graph, with the epoch split into aggregation, GEMM and the rest, the aggregation compared
//! with a memory-bandwidth bound measured in the same run, and (with `--baseline pyg`)
//! PyTorch Geometric on the same graph run in the same invocation.

use anyhow::{bail, Context};
use grandis_models::{Model, ModelConfig, ModelKind};
use grandis_store::{CsrGraph, EdgeOptions, InMemoryDataset, SelfLoops, Split};
use grandis_trainer::{Prepared, TrainOptions};
use rayon::prelude::*;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct BenchTrainArgs {
    #[arg(long, default_value_t = 200_000)]
    pub vertices: usize,
    /// Directed edges drawn (duplicates are removed, so slightly fewer remain).
    #[arg(long, default_value_t = 4_000_000)]
    pub edges: usize,
    #[arg(long, default_value_t = 128)]
    pub features: usize,
    #[arg(long, default_value_t = 16)]
    pub classes: usize,
    #[arg(long, default_value_t = 3)]
    pub layers: usize,
    #[arg(long, default_value_t = 64)]
    pub hidden: usize,
    #[arg(long, default_value_t = 0.5)]
    pub dropout: f32,
    /// Timed epochs (after one warm-up epoch).
    #[arg(long, default_value_t = 5)]
    pub epochs: usize,
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also run a baseline in this invocation: `pyg` (scripts/bench_pyg.py).
    #[arg(long)]
    pub baseline: Option<String>,
    /// Python interpreter for the baseline.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// The baseline script.
    #[arg(long, default_value = "scripts/bench_pyg.py")]
    pub pyg_script: PathBuf,
    /// Print one JSON object as the last stdout line.
    #[arg(long)]
    pub json: bool,
}

/// Uniform random directed graph with features that carry a weak class signal.
fn synthetic(args: &BenchTrainArgs) -> anyhow::Result<InMemoryDataset> {
    let n = args.vertices;
    if n == 0 || n > u32::MAX as usize - 1 {
        bail!("--vertices must be in 1..{}", u32::MAX - 1);
    }
    let seed = args.seed;
    let hash = |i: u64| grandis_engine::backend::mix64(seed.wrapping_mul(0x9E37_79B9) ^ i);
    let pairs: Vec<(u32, u32)> = (0..args.edges as u64)
        .into_par_iter()
        .map(|e| {
            let h = hash(e);
            (
                ((h >> 32) % n as u64) as u32,
                ((h & 0xffff_ffff) % n as u64) as u32,
            )
        })
        .collect();
    let graph = CsrGraph::from_edges(
        n as u64,
        pairs,
        EdgeOptions {
            symmetrize: false,
            self_loops: SelfLoops::Keep,
        },
    )
    .context("building the synthetic graph")?;
    let labels: Vec<i32> = (0..n as u64)
        .map(|v| (hash(v ^ 0xABCD_0000_0000) % args.classes as u64) as i32)
        .collect();
    let f = args.features;
    let features: Vec<f32> = (0..(n * f) as u64)
        .into_par_iter()
        .map(|i| {
            let (v, j) = ((i / f as u64) as usize, (i % f as u64) as usize);
            let noise = (hash(i ^ 0x5555_0000_0000_0000) >> 40) as f32 / 16_777_216.0 - 0.5;
            noise
                + if j % args.classes == labels[v] as usize {
                    0.3
                } else {
                    0.0
                }
        })
        .collect();
    let train: Vec<u32> = (0..n as u32).filter(|v| v % 10 == 0).collect();
    Ok(InMemoryDataset {
        name: "bench-synthetic".into(),
        graph,
        features,
        feature_dim: f,
        labels,
        num_classes: args.classes,
        split: Split {
            train,
            val: vec![],
            test: vec![],
        },
    })
}

/// STREAM-like triad `a = b + s * c` on arrays far larger than the caches, in the backend's
/// pool; returns bytes per second (three arrays moved per pass).
fn triad_bandwidth(b: &grandis_engine::CpuBackend) -> f64 {
    let n = 32 << 20; // 128 MiB per array
    let bb = vec![1.0f32; n];
    let c = vec![2.0f32; n];
    let mut a = vec![0.0f32; n];
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        b.install(|| {
            a.par_chunks_mut(1 << 16)
                .zip(bb.par_chunks(1 << 16))
                .zip(c.par_chunks(1 << 16))
                .for_each(|((a, b), c)| {
                    for i in 0..a.len() {
                        a[i] = b[i] + 3.0 * c[i];
                    }
                })
        });
        best = best.min(start.elapsed().as_secs_f64());
    }
    std::hint::black_box(&a);
    (3 * n * 4) as f64 / best
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    let m = xs.len() / 2;
    if xs.len() % 2 == 1 {
        xs[m]
    } else {
        0.5 * (xs[m - 1] + xs[m])
    }
}

#[derive(serde::Serialize, Default, Clone)]
struct Split3 {
    /// Seconds per backend operation inside "other" (the rest is model-side allocation).
    other_ops: Vec<(String, f64)>,
    epoch_s: f64,
    aggregate_s: f64,
    gemm_s: f64,
    other_s: f64,
    aggregate_bytes: u64,
}

fn run_pyg(args: &BenchTrainArgs, ds: &InMemoryDataset) -> anyhow::Result<serde_json::Value> {
    let probe = std::process::Command::new(&args.python)
        .args(["-c", "import torch, torch_geometric"])
        .output()
        .with_context(|| format!("running {}", args.python))?;
    if !probe.status.success() {
        bail!(
            "{} cannot import torch and torch_geometric: {}",
            args.python,
            String::from_utf8_lossy(&probe.stderr).trim()
        );
    }
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let g = &ds.graph;
    let n = ds.labels.len();
    let mut edge_index = Vec::with_capacity(2 * g.indices.len());
    edge_index.extend(g.indices.iter().map(|&u| u as i64));
    for v in 0..n {
        let deg = (g.offsets[v + 1] - g.offsets[v]) as usize;
        edge_index.extend(std::iter::repeat_n(v as i64, deg));
    }
    let e = g.indices.len() as u64;
    let p = |name: &str| dir.path().join(name);
    grandis_npy::write_npy(p("edge_index.npy"), &[2, e], &edge_index)?;
    drop(edge_index);
    grandis_npy::write_npy(
        p("features.npy"),
        &[n as u64, ds.feature_dim as u64],
        &ds.features,
    )?;
    let labels: Vec<i64> = ds.labels.iter().map(|&l| l as i64).collect();
    grandis_npy::write_npy(p("labels.npy"), &[n as u64], &labels)?;
    let train: Vec<i64> = ds.split.train.iter().map(|&v| v as i64).collect();
    grandis_npy::write_npy(p("train.npy"), &[train.len() as u64], &train)?;
    tracing::info!("running the PyG baseline ({})", args.pyg_script.display());
    let out = std::process::Command::new(&args.python)
        .arg(&args.pyg_script)
        .arg("--dir")
        .arg(dir.path())
        .args([
            "--layers",
            &args.layers.to_string(),
            "--hidden",
            &args.hidden.to_string(),
            "--dropout",
            &args.dropout.to_string(),
            "--epochs",
            &args.epochs.to_string(),
            "--threads",
            &args.threads.to_string(),
        ])
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", args.pyg_script.display()))?;
    if !out.status.success() {
        bail!("{} failed ({})", args.pyg_script.display(), out.status);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout
        .lines()
        .last()
        .context("the PyG baseline printed nothing")?;
    serde_json::from_str(last)
        .with_context(|| format!("the PyG baseline's last line is not JSON: {last}"))
}

pub fn run(args: BenchTrainArgs) -> anyhow::Result<()> {
    if let Some(b) = &args.baseline {
        if b != "pyg" {
            bail!("unknown --baseline '{b}' (expected pyg)");
        }
    }
    // Other processes on the machine distort every timing here; the load average is reported
    // with the results so readers can judge them.
    let loadavg = std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    let start = Instant::now();
    let ds = synthetic(&args)?;
    tracing::info!(
        "synthetic graph: {} vertices, {} edges, {} features ({:.1}s)",
        ds.labels.len(),
        ds.graph.indices.len(),
        ds.feature_dim,
        start.elapsed().as_secs_f64()
    );
    grandis_telemetry::reset_peak_rss();
    let rss_before = grandis_telemetry::current_rss_bytes();
    let view = ds.view();
    let prepared = Prepared::new(view, ModelKind::Sage, Some(args.threads))?;
    let b = &prepared.backend;
    let bandwidth = triad_bandwidth(b);
    let cfg = ModelConfig {
        kind: ModelKind::Sage,
        layers: args.layers,
        in_dim: ds.feature_dim,
        hidden: args.hidden,
        classes: ds.num_classes,
        dropout: args.dropout,
        layer_norm: false,
        seed: args.seed,
    };
    let mut model = Model::new(b, cfg)?;
    let opts = TrainOptions {
        epochs: args.epochs + 1,
        lr: 0.01,
        weight_decay: 0.0,
        adamw: false,
        grad_clip: None,
        seed: args.seed,
    };
    let mut splits = Vec::new();
    let mut progress = grandis_telemetry::Progress::new("bench train", Some(opts.epochs as u64));
    for epoch in 1..=opts.epochs {
        b.reset_op_times();
        let t = Instant::now();
        let loss = prepared.train_step(&mut model, &opts, epoch)?;
        let epoch_s = t.elapsed().as_secs_f64();
        let ops = b.op_times();
        let others = b.other_op_times();
        progress.println(format!(
            "epoch {epoch}: loss {loss:.4}, {epoch_s:.3}s (aggregation {:.3}s, gemm {:.3}s)",
            ops.aggregate_s, ops.gemm_s
        ));
        progress.inc(1);
        tracing::debug!("other ops: {others:?}");
        if epoch > 1 {
            splits.push(Split3 {
                epoch_s,
                aggregate_s: ops.aggregate_s,
                gemm_s: ops.gemm_s,
                other_s: epoch_s - ops.aggregate_s - ops.gemm_s,
                aggregate_bytes: ops.aggregate_bytes,
                other_ops: others.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            });
        }
    }
    progress.finish();
    let peak = grandis_telemetry::peak_rss_bytes();
    // The epoch with the median time, so its split adds up.
    splits.sort_by(|a, b| a.epoch_s.total_cmp(&b.epoch_s));
    let med = splits[splits.len() / 2].clone();
    let mut times: Vec<f64> = splits.iter().map(|s| s.epoch_s).collect();
    let median_epoch_s = median(&mut times);
    // The fastest epoch is the least disturbed by other processes on a shared machine.
    let min_epoch_s = times[0];
    let agg_bound_s = med.aggregate_bytes as f64 / bandwidth;
    println!(
        "grandis: {} vertices, {} edges, {}-layer SAGE hidden {}, {} threads (load average at start: {loadavg})",
        ds.labels.len(),
        ds.graph.indices.len(),
        args.layers,
        args.hidden,
        args.threads
    );
    println!(
        "  median epoch {:.3}s = aggregation {:.3}s + gemm {:.3}s + rest {:.3}s",
        median_epoch_s, med.aggregate_s, med.gemm_s, med.other_s
    );
    let listed: Vec<String> = med
        .other_ops
        .iter()
        .take(6)
        .map(|(k, v)| format!("{k} {v:.3}s"))
        .collect();
    println!(
        "  rest: {} (untimed: allocation and bookkeeping {:.3}s)",
        listed.join(", "),
        med.other_s - med.other_ops.iter().map(|(_, v)| v).sum::<f64>()
    );
    println!(
        "  aggregation moved {:.2} GB; triad bandwidth {:.2} GB/s -> bound {:.3}s ({:.0}% of bound achieved)",
        med.aggregate_bytes as f64 / 1e9,
        bandwidth / 1e9,
        agg_bound_s,
        100.0 * agg_bound_s / med.aggregate_s
    );
    println!(
        "  peak RSS {:.1} MiB (dataset resident before training: {:.1} MiB)",
        peak as f64 / (1 << 20) as f64,
        rss_before as f64 / (1 << 20) as f64
    );
    let mut pyg = serde_json::Value::Null;
    if args.baseline.is_some() {
        pyg = run_pyg(&args, &ds)?;
        let pyg_min = pyg
            .get("epoch_seconds")
            .and_then(|v| v.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_f64())
                    .fold(f64::INFINITY, f64::min)
            });
        if let Some(pmin) = pyg_min {
            println!(
                "fastest epochs: grandis {min_epoch_s:.3}s, PyG {pmin:.3}s -> {:.1}x",
                pmin / min_epoch_s
            );
        }
        if let Some(t) = pyg.get("median_epoch_s").and_then(|v| v.as_f64()) {
            let rss = pyg
                .get("peak_rss_bytes")
                .and_then(|v| v.as_f64())
                .unwrap_or(f64::NAN);
            println!(
                "PyG: median epoch {t:.3}s, peak RSS {:.1} MiB -> grandis is {:.1}x faster, uses {:.2}x the memory",
                rss / (1 << 20) as f64,
                t / median_epoch_s,
                peak as f64 / rss
            );
        }
    }
    if args.json {
        let json = serde_json::json!({
            "vertices": ds.labels.len(),
            "edges": ds.graph.indices.len(),
            "features": ds.feature_dim,
            "classes": ds.num_classes,
            "layers": args.layers,
            "hidden": args.hidden,
            "threads": args.threads,
            "median_epoch_s": median_epoch_s,
            "min_epoch_s": min_epoch_s,
            "median_split": med,
            "triad_bandwidth_bytes_per_s": bandwidth,
            "aggregation_bound_s": agg_bound_s,
            "peak_rss_bytes": peak,
            "load_average_at_start": loadavg,
            "pyg": pyg,
        });
        println!("{json}");
    }
    Ok(())
}
