//! `grandis bench train`: full-batch GraphSAGE epoch time and peak memory on a synthetic
//! graph, on the CPU or a CUDA device (`--device`), with the epoch split into aggregation,
//! GEMM and the rest, the aggregation compared with a memory-bandwidth bound measured in the
//! same run (a STREAM triad on the CPU, a device-to-device copy on a GPU), seconds of training
//! to a validation accuracy (`--target-acc`), and (with `--baseline pyg`) PyTorch Geometric on
//! the same graph and device in the same invocation, with a CSR `adj_t` and with `edge_index`.

use anyhow::{bail, Context};
use grandis_engine::OpProfile;
use grandis_models::{Model, ModelConfig, ModelKind};
use grandis_store::{EdgeOptions, InMemoryDataset, SelfLoops, Split};
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
    /// Model of both systems: sage (SAGEConv) or gat (GATConv, --heads heads per hidden layer,
    /// one averaged head in the last); rgcn (RGCNConv), heterosage (to_hetero of SAGEConv) or
    /// rgat (to_hetero of GATConv without self-loops) train on a typed graph of --vertices
    /// (`data synth --hetero`'s), over --seeds seeds, against scripts/bench_pyg_hetero.py.
    #[arg(long, default_value_t = ModelKind::Sage)]
    pub model: ModelKind,
    /// gat, rgat: attention heads of each hidden layer (they split --hidden).
    #[arg(long, default_value_t = grandis_wire::defaults::HEADS as usize)]
    pub heads: usize,
    #[arg(long, default_value_t = 0.5)]
    pub dropout: f32,
    /// Fraction of edges whose two ends share a class (the rest join uniform random vertices).
    /// 0 gives a graph whose neighbourhoods carry no class signal; real graphs such as
    /// ogbn-products are homophilous (about 0.8), which is what lets GNNs learn fast on them.
    #[arg(long, default_value_t = 0.0)]
    pub homophily: f64,
    /// Timed epochs (after one warm-up epoch).
    #[arg(long, default_value_t = 5)]
    pub epochs: usize,
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where grandis (and the baseline) train: cpu or cuda:N (cuda: ordinal 0; a build with
    /// `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: grandis_parallel::Compute,
    /// Report the training seconds (evaluation excluded) until the validation accuracy first
    /// reaches this fraction; evaluates after every epoch.
    #[arg(long)]
    pub target_acc: Option<f64>,
    /// Adjacency inputs of the PyG baseline, each run in turn: csr (`adj_t`, PyG's fastest
    /// path) and/or edge_index.
    #[arg(long, value_delimiter = ',', default_value = "csr,edge_index")]
    pub pyg_adj: Vec<String>,
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
    /// node (the synthetic graph above) or link: link prediction on --data, each of --seeds
    /// seeds splitting its edges anew (5% validation, 10% test, as PyG's link_pred.py),
    /// against scripts/bench_pyg_link.py with --baseline pyg.
    #[arg(long, default_value_t = grandis_wire::Task::Node)]
    pub task: grandis_wire::Task,
    /// --task link: the dataset (without a link split).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// --task link and typed models: seeds, from --seed on (each a split, weights and
    /// negatives; a typed model's weights and dropout).
    #[arg(long, default_value_t = 5)]
    pub seeds: usize,
    /// --task link: embedding width (the last layer's outputs).
    #[arg(long, default_value_t = 64)]
    pub out_dim: usize,
    /// --task link: negatives per training edge each epoch.
    #[arg(long, default_value_t = 1)]
    pub negatives: u32,
    /// Adam's learning rate (--task link and typed models).
    #[arg(long, default_value_t = 0.01)]
    pub lr: f32,
    /// --task link: learnable node embedding columns after the features (PyG: a
    /// `torch.nn.Embedding` trained with `SparseAdam`); 0 = none.
    #[arg(long, default_value_t = 0)]
    pub embedding_dim: usize,
    /// --task link: the decoder, dot or mlp (PyG: the same MLP on the Hadamard product).
    #[arg(long, default_value_t = grandis_wire::LinkDecoder::Dot)]
    pub decoder: grandis_wire::LinkDecoder,
}

/// Random directed graph with features that carry a weak class signal: uniform, or with
/// `--homophily` of its edges inside a class.
fn synthetic(args: &BenchTrainArgs) -> anyhow::Result<InMemoryDataset> {
    let n = args.vertices;
    if n == 0 || n > u32::MAX as usize - 1 {
        bail!("--vertices must be in 1..{}", u32::MAX - 1);
    }
    if !(0.0..=1.0).contains(&args.homophily) {
        bail!(
            "--homophily must be a fraction in 0..1, got {}",
            args.homophily
        );
    }
    let seed = args.seed;
    let hash = |i: u64| grandis_engine::mix64(seed.wrapping_mul(0x9E37_79B9) ^ i);
    let labels: Vec<i32> = (0..n as u64)
        .map(|v| (hash(v ^ 0xABCD_0000_0000) % args.classes as u64) as i32)
        .collect();
    let mut members = vec![Vec::new(); args.classes];
    if args.homophily > 0.0 {
        for (v, &c) in labels.iter().enumerate() {
            members[c as usize].push(v as u32);
        }
    }
    // An edge is in-class when its hash's top 24 bits fall under the homophily fraction.
    let in_class_below = (args.homophily * (1u64 << 24) as f64) as u64;
    let pairs: Vec<(u32, u32)> = (0..args.edges as u64)
        .into_par_iter()
        .map(|e| {
            let h = hash(e);
            let u = ((h >> 32) % n as u64) as u32;
            if (hash(e ^ 0x7777_0000_0000_0000) >> 40) < in_class_below {
                let class = &members[labels[u as usize] as usize];
                (u, class[((h & 0xffff_ffff) % class.len() as u64) as usize])
            } else {
                (u, ((h & 0xffff_ffff) % n as u64) as u32)
            }
        })
        .collect();
    let graph = grandis_store::graph_from_edges(
        n as u64,
        pairs,
        EdgeOptions {
            symmetrize: false,
            self_loops: SelfLoops::Keep,
        },
    )
    .context("building the synthetic graph")?;
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
    let every_tenth = |r: u32| (0..n as u32).filter(|v| v % 10 == r).collect::<Vec<u32>>();
    Ok(InMemoryDataset {
        name: "bench-synthetic".into(),
        graph,
        features,
        feature_dim: f,
        labels,
        num_classes: args.classes,
        split: Split {
            train: every_tenth(0),
            val: every_tenth(1),
            test: every_tenth(2),
        },
        types: None,
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

/// Exports `ds` in the PyG layout once, then runs the PyG script per `--pyg-adj`.
fn run_pyg(args: &BenchTrainArgs, ds: &InMemoryDataset) -> anyhow::Result<Vec<serde_json::Value>> {
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
    let tmp = tempfile::tempdir().context("creating a temporary directory")?;
    let dir = tmp.path().join("pyg");
    grandis_import::export_npy(&ds.view(), &dir, false).context("exporting the graph for PyG")?;
    let mut results = Vec::new();
    for adj in &args.pyg_adj {
        tracing::info!(
            "running the PyG baseline ({}, {adj})",
            args.pyg_script.display()
        );
        let mut cmd = std::process::Command::new(&args.python);
        cmd.arg(&args.pyg_script).arg("--dir").arg(&dir).args([
            "--layers",
            &args.layers.to_string(),
            "--hidden",
            &args.hidden.to_string(),
            "--model",
            &args.model.to_string(),
            "--heads",
            &args.heads.to_string(),
            "--dropout",
            &args.dropout.to_string(),
            "--epochs",
            &args.epochs.to_string(),
            "--threads",
            &args.threads.to_string(),
            "--device",
            &args.device.name(),
            "--adj",
            adj,
            "--seed",
            &args.seed.to_string(),
        ]);
        if args.target_acc.is_some() {
            cmd.arg("--eval");
        }
        let out = cmd
            .stderr(std::process::Stdio::inherit())
            .output()
            .with_context(|| format!("running {}", args.pyg_script.display()))?;
        if !out.status.success() {
            // One baseline failing (killed for memory on the CPU, say) must not throw away
            // the measurements already taken: it is reported as what happened.
            tracing::warn!(
                "{} --adj {adj} failed ({})",
                args.pyg_script.display(),
                out.status
            );
            results.push(serde_json::json!({
                "adj": adj,
                "error": format!("exited with {}", out.status),
            }));
            continue;
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let last = stdout
            .lines()
            .last()
            .context("the PyG baseline printed nothing")?;
        results.push(
            serde_json::from_str(last)
                .with_context(|| format!("the PyG baseline's last line is not JSON: {last}"))?,
        );
    }
    Ok(results)
}

/// What one run of the timed loop measured.
struct Measured {
    splits: Vec<Split3>,
    /// (training seconds so far, validation accuracy) after every epoch, with --target-acc.
    curve: Vec<(f64, f64)>,
    last_loss: f64,
}

/// Trains `args.epochs + 1` epochs (the first is warm-up) on `prepared`, timing each epoch to
/// the end of its device work and splitting it with `profile`'s operation timers.
fn timed_epochs<B: grandis_engine::Backend>(
    prepared: &Prepared<'_, B>,
    profile: &dyn OpProfile,
    args: &BenchTrainArgs,
    cfg: ModelConfig,
) -> anyhow::Result<Measured> {
    let b = &prepared.backend;
    let mut model = Model::new(b, cfg)?;
    let opts = TrainOptions {
        objective: Default::default(),
        epochs: args.epochs + 1,
        lr: 0.01,
        weight_decay: 0.0,
        adamw: false,
        grad_clip: None,
        seed: args.seed,
        // The loop below evaluates when it needs to (time to accuracy).
        eval: grandis_trainer::EvalSchedule::Never,
        embedding_dim: 0,
    };
    let mut m = Measured {
        splits: Vec::new(),
        curve: Vec::new(),
        last_loss: f64::NAN,
    };
    let mut trained_s = 0.0;
    let mut progress = grandis_telemetry::Progress::new("bench train", Some(opts.epochs as u64));
    profile.set_op_timing(true);
    for epoch in 1..=opts.epochs {
        let step = prepared.timed_train_step(&mut model, &opts, epoch, profile)?;
        let (loss, epoch_s, ops) = (step.loss, step.seconds, step.ops);
        trained_s += epoch_s;
        m.last_loss = loss;
        let others = profile.other_op_times();
        let mut line = format!(
            "epoch {epoch}: loss {loss:.4}, {epoch_s:.3}s (aggregation {:.3}s, gemm {:.3}s)",
            ops.aggregate_s, ops.gemm_s
        );
        if args.target_acc.is_some() {
            let logits = prepared.logits(&model, None)?;
            let val = prepared.accuracy(&logits, prepared.view.val);
            m.curve.push((trained_s, val));
            line.push_str(&format!(", val {val:.4} after {trained_s:.2}s of training"));
        }
        progress.println(line);
        progress.inc(1);
        if epoch > 1 {
            m.splits.push(Split3 {
                epoch_s,
                aggregate_s: ops.aggregate_s,
                gemm_s: ops.gemm_s,
                other_s: epoch_s - ops.aggregate_s - ops.gemm_s,
                aggregate_bytes: ops.aggregate_bytes,
                other_ops: others.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            });
        }
    }
    profile.set_op_timing(false);
    progress.finish();
    Ok(m)
}

/// Device-to-device copy rate of `b` (bytes read plus written per second), best of 5 copies
/// of a 1 GiB buffer: the bandwidth bound an aggregation is held against on a GPU.
fn copy_bandwidth<B: grandis_engine::Backend>(b: &B) -> anyhow::Result<f64> {
    let n = 256 << 20;
    let src = b.alloc(n)?;
    let mut dst = b.alloc(n)?;
    b.copy(&src, &mut dst, n)?;
    b.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        b.copy(&src, &mut dst, n)?;
        b.synchronize()?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok((2 * n * 4) as f64 / best)
}

/// What the device side of a run reports.
struct DeviceRun {
    measured: Measured,
    bandwidth: f64,
    bandwidth_name: &'static str,
    /// Peak bytes: the process's RSS on the CPU, grandis's live device buffers on a GPU.
    peak_bytes: u64,
    peak_name: &'static str,
    resident_before: u64,
    device_name: String,
}

fn run_on_cpu(
    args: &BenchTrainArgs,
    ds: &InMemoryDataset,
    cfg: ModelConfig,
) -> anyhow::Result<DeviceRun> {
    grandis_telemetry::reset_peak_rss();
    let resident_before = grandis_telemetry::current_rss_bytes();
    let prepared = Prepared::new(ds.view(), ModelKind::Sage, Some(args.threads))?;
    let bandwidth = triad_bandwidth(&prepared.backend);
    let measured = timed_epochs(&prepared, &prepared.backend, args, cfg)?;
    Ok(DeviceRun {
        measured,
        bandwidth,
        bandwidth_name: "triad",
        peak_bytes: grandis_telemetry::peak_rss_bytes(),
        peak_name: "peak RSS",
        resident_before,
        device_name: format!("cpu ({} threads)", args.threads),
    })
}

fn run_on_cuda(
    ordinal: usize,
    args: &BenchTrainArgs,
    ds: &InMemoryDataset,
    cfg: ModelConfig,
) -> anyhow::Result<DeviceRun> {
    let backend = crate::device::cuda_backend(ordinal)?;
    let device_name = backend.device_name().to_string();
    let bandwidth = copy_bandwidth(&backend)?;
    let metered = grandis_parallel::metered::Metered::new(backend);
    let meter = metered.meter.clone();
    let prepared = Prepared::with_backend(metered, ds.view(), ModelKind::Sage)?;
    let resident_before = meter.peak();
    let measured = timed_epochs(&prepared, &prepared.backend.inner, args, cfg)?;
    Ok(DeviceRun {
        measured,
        bandwidth,
        bandwidth_name: "device-to-device copy",
        peak_bytes: meter.peak(),
        peak_name: "peak device memory (grandis buffers)",
        resident_before,
        device_name,
    })
}

pub fn run(args: BenchTrainArgs) -> anyhow::Result<()> {
    if args.task == grandis_wire::Task::Link {
        return super::link::run(&args);
    }
    if args.model.is_typed() {
        return super::typed::run(&args);
    }
    if let Some(b) = &args.baseline {
        if b != "pyg" {
            bail!("unknown --baseline '{b}' (expected pyg)");
        }
    }
    for adj in &args.pyg_adj {
        if adj != "csr" && adj != "edge_index" {
            bail!("unknown --pyg-adj '{adj}' (expected csr and/or edge_index)");
        }
    }
    if let Some(t) = args.target_acc {
        if !(0.0..=1.0).contains(&t) {
            bail!("--target-acc must be a fraction in 0..1, got {t}");
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
    let cfg = ModelConfig {
        heads: args.heads,
        output_heads: grandis_wire::defaults::OUTPUT_HEADS as usize,
        dropout: args.dropout,
        seed: args.seed,
        ..ModelConfig::new(
            args.model,
            args.layers,
            ds.feature_dim,
            args.hidden,
            ds.num_classes,
        )
    };
    let run = match crate::device::single_ordinal(&args.device) {
        None => run_on_cpu(&args, &ds, cfg)?,
        Some(ordinal) => run_on_cuda(ordinal, &args, &ds, cfg)?,
    };
    let mut splits = run.measured.splits.clone();
    // The epoch with the median time, so its split adds up.
    splits.sort_by(|a, b| a.epoch_s.total_cmp(&b.epoch_s));
    let med = splits[splits.len() / 2].clone();
    let times: Vec<f64> = splits.iter().map(|s| s.epoch_s).collect();
    let median_epoch_s = grandis_telemetry::median(&times);
    // The fastest epoch is the least disturbed by other processes on a shared machine.
    let min_epoch_s = times[0];
    let bandwidth = run.bandwidth;
    let agg_bound_s = med.aggregate_bytes as f64 / bandwidth;
    let peak = run.peak_bytes;
    println!(
        "grandis on {}: {} vertices, {} edges, {}-layer {} hidden {} (load average at start: {loadavg})",
        run.device_name,
        ds.labels.len(),
        ds.graph.indices.len(),
        args.layers,
        args.model,
        args.hidden,
    );
    println!(
        "  median epoch {:.4}s = aggregation {:.4}s + gemm {:.4}s + rest {:.4}s",
        median_epoch_s, med.aggregate_s, med.gemm_s, med.other_s
    );
    let listed: Vec<String> = med
        .other_ops
        .iter()
        .take(6)
        .map(|(k, v)| format!("{k} {v:.4}s"))
        .collect();
    println!(
        "  rest: {} (untimed: allocation, launches and bookkeeping {:.4}s)",
        listed.join(", "),
        med.other_s - med.other_ops.iter().map(|(_, v)| v).sum::<f64>()
    );
    println!(
        "  aggregation moved {:.2} GB; {} bandwidth {:.2} GB/s -> bound {:.4}s ({:.2}x the bound)",
        med.aggregate_bytes as f64 / 1e9,
        run.bandwidth_name,
        bandwidth / 1e9,
        agg_bound_s,
        med.aggregate_s / agg_bound_s
    );
    println!(
        "  {} {:.1} MiB (resident before training: {:.1} MiB)",
        run.peak_name,
        peak as f64 / (1 << 20) as f64,
        run.resident_before as f64 / (1 << 20) as f64
    );
    let to_target = args
        .target_acc
        .map(|t| (t, super::graph::seconds_to(&run.measured.curve, t)));
    if let Some((t, secs)) = to_target {
        match secs {
            Some(s) => println!("  validation accuracy {t} after {s:.2}s of training"),
            None => println!(
                "  validation accuracy {t} not reached in {} epochs (best {:.4})",
                args.epochs + 1,
                run.measured.curve.iter().map(|c| c.1).fold(0.0, f64::max)
            ),
        }
    }
    let mut pyg = Vec::new();
    if args.baseline.is_some() {
        pyg = run_pyg(&args, &ds)?;
        for (adj, p) in args.pyg_adj.iter().zip(&pyg) {
            let get = |k: &str| p.get(k).and_then(|v| v.as_f64());
            if let Some(error) = p.get("error").and_then(|v| v.as_str()) {
                println!("PyG ({adj}): did not run to the end: {error}");
                continue;
            }
            let (Some(t), Some(mem)) = (get("median_epoch_s"), get("peak_bytes")) else {
                continue;
            };
            println!(
                "PyG ({adj}): median epoch {t:.4}s, {} {:.1} MiB -> grandis is {:.2}x faster per \
                 epoch, uses {:.2}x the memory",
                p.get("peak_name")
                    .and_then(|v| v.as_str())
                    .unwrap_or("peak"),
                mem / (1 << 20) as f64,
                t / median_epoch_s,
                peak as f64 / mem
            );
            if let (Some((target, ours)), Some(curve)) =
                (to_target, p.get("curve").and_then(|c| c.as_array()))
            {
                let theirs: Vec<(f64, f64)> = curve
                    .iter()
                    .filter_map(|c| Some((c.get(0)?.as_f64()?, c.get(1)?.as_f64()?)))
                    .collect();
                let fmt = |s: Option<f64>| s.map_or("not reached".into(), |s| format!("{s:.2}s"));
                println!(
                    "  seconds to validation accuracy {target}: grandis {}, PyG ({adj}) {}",
                    fmt(ours),
                    fmt(super::graph::seconds_to(&theirs, target))
                );
            }
        }
    }
    if args.json {
        let json = serde_json::json!({
            "device": run.device_name,
            "vertices": ds.labels.len(),
            "edges": ds.graph.indices.len(),
            "homophily": args.homophily,
            "features": ds.feature_dim,
            "classes": ds.num_classes,
            "layers": args.layers,
            "hidden": args.hidden,
            "threads": args.threads,
            "median_epoch_s": median_epoch_s,
            "min_epoch_s": min_epoch_s,
            "median_split": med,
            "bandwidth_kind": run.bandwidth_name,
            "bandwidth_bytes_per_s": bandwidth,
            "aggregation_bound_s": agg_bound_s,
            "peak_bytes": peak,
            "peak_kind": run.peak_name,
            "target_acc": args.target_acc,
            "seconds_to_target": to_target.and_then(|t| t.1),
            "val_curve": run.measured.curve,
            "final_loss": run.measured.last_loss,
            "load_average_at_start": loadavg,
            "pyg": pyg,
        });
        println!("{json}");
    }
    Ok(())
}
