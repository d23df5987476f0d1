//! `grandis bench train --model rgcn|heterosage|rgat`: full-batch node classification on a
//! typed synthetic graph (`data synth --hetero`'s academic graph: papers, authors,
//! institutions; cites, writes, written_by, affiliated_with) against PyG's same architecture
//! (scripts/bench_pyg_hetero.py: `RGCNConv` on the homogeneous graph with edge types, or
//! `to_hetero` of a `SAGEConv` or `GATConv(add_self_loops=False)` stack with `aggr="sum"`) in
//! the same invocation, over seeds
//! (each seeds both systems' weights and dropout on the same graph). Reported: final test
//! and validation accuracy after the same epochs, their mean difference in points, the
//! median epoch and the peak RSS of each, as ratios.

use anyhow::{bail, Context};
use grandis_models::{ModelConfig, ModelRelation};
use grandis_store::InMemoryDataset;
use grandis_trainer::{CheckpointOptions, Objective};

use super::mean;
use super::train::BenchTrainArgs;

/// One system's run on one seed.
#[derive(Debug, Clone, serde::Serialize)]
struct Run {
    seed: u64,
    val_acc: f64,
    test_acc: f64,
    final_loss: f64,
    median_epoch_s: f64,
    peak_rss_bytes: u64,
}

impl super::SeedRun for Run {
    const METRIC: &'static str = "test";
    fn scores(&self) -> [f64; 3] {
        [self.test_acc, self.val_acc, self.median_epoch_s]
    }
}

pub fn run(args: &BenchTrainArgs) -> anyhow::Result<()> {
    super::check_seed_args(args)?;
    if crate::device::single_ordinal(&args.device).is_some() {
        bail!(
            "--model {} runs on the CPU here (typed models on a GPU: issue 41)",
            args.model
        );
    }
    let mut cfg = grandis_synth::HeteroConfig::academic(
        args.vertices as u64,
        args.features,
        args.classes,
        args.seed,
    );
    cfg.homophily = args.homophily;
    let ds = grandis_synth::generate_hetero_in_memory(&cfg)?;
    let types = ds.types.as_ref().expect("a typed graph");
    eprintln!(
        "typed graph: {} vertices, {} edges, {} types, {} relations (homophily {})",
        ds.labels.len(),
        ds.graph.indices.len(),
        types.num_types(),
        types.num_relations(),
        args.homophily
    );
    let pyg_dir = tempfile::tempdir().context("creating a temporary directory")?;
    let exported = pyg_dir.path().join("pyg");
    if args.baseline.is_some() {
        grandis_import::export_npy(&ds.view(), &exported, false)
            .context("exporting the graph for PyG")?;
    }
    let (ours, theirs) = super::over_seeds(
        args,
        |_| Ok(()),
        |_, seed| run_grandis(args, &ds, seed),
        |_, seed| run_pyg(args, &exported, seed),
    )?;
    report(args, &ds, &ours, &theirs)
}

fn run_grandis(args: &BenchTrainArgs, ds: &InMemoryDataset, seed: u64) -> anyhow::Result<Run> {
    let view = ds.view();
    let config = ModelConfig {
        heads: args.heads,
        output_heads: grandis_wire::defaults::OUTPUT_HEADS as usize,
        dropout: args.dropout,
        seed,
        relations: view.types.map(ModelRelation::of).unwrap_or_default(),
        ..ModelConfig::new(
            args.model,
            args.layers,
            view.feature_dim,
            args.hidden,
            view.num_classes,
        )
    };
    let opts = super::seed_train_options(args, seed, Objective::Node, 0);
    grandis_telemetry::reset_peak_rss();
    let ck = CheckpointOptions::default();
    let report = grandis_trainer::train(view, config, &opts, &ck, Some(args.threads), |_| {})?;
    let times: Vec<f64> = report.epochs.iter().skip(1).map(|e| e.seconds).collect();
    Ok(Run {
        seed,
        val_acc: report.val_acc,
        test_acc: report.test_acc,
        final_loss: report.final_loss,
        median_epoch_s: grandis_telemetry::median(&times),
        peak_rss_bytes: grandis_telemetry::peak_rss_bytes(),
    })
}

/// PyG on the exported graph: scripts/bench_pyg_hetero.py.
fn run_pyg(args: &BenchTrainArgs, dir: &std::path::Path, seed: u64) -> anyhow::Result<Run> {
    let script = args.pyg_script.with_file_name("bench_pyg_hetero.py");
    let mut flags = super::baseline_flags(args, dir, seed);
    flags.extend(["--heads".to_string(), args.heads.to_string()]);
    let v = super::Baseline::run(&args.python, &script, &flags)?;
    let num = |k: &str| v.num(k);
    Ok(Run {
        seed,
        val_acc: num("val_acc")?,
        test_acc: num("test_acc")?,
        final_loss: num("final_loss")?,
        median_epoch_s: num("median_epoch_s")?,
        peak_rss_bytes: num("peak_bytes")? as u64,
    })
}

fn report(
    args: &BenchTrainArgs,
    ds: &InMemoryDataset,
    ours: &[Run],
    theirs: &[Run],
) -> anyhow::Result<()> {
    println!(
        "{} on a typed graph of {} vertices, {} edges ({}-layer, hidden {}, {} epochs, {} seeds, {} threads):",
        args.model,
        ds.labels.len(),
        ds.graph.indices.len(),
        args.layers,
        args.hidden,
        args.epochs,
        ours.len(),
        args.threads
    );
    println!("system   seed  test acc   val acc  final loss  median epoch  peak RSS");
    for (name, runs) in [("grandis", ours), ("PyG", theirs)] {
        for r in runs {
            println!(
                "{name:<8} {:>4}  {:>8.4}  {:>8.4}  {:>10.4}  {:>11.4}s  {:>6.1} MiB",
                r.seed,
                r.test_acc,
                r.val_acc,
                r.final_loss,
                r.median_epoch_s,
                r.peak_rss_bytes as f64 / (1 << 20) as f64
            );
        }
    }
    let summary = |runs: &[Run]| {
        serde_json::json!({
            "mean_test_acc": mean(runs, |r| r.test_acc),
            "mean_val_acc": mean(runs, |r| r.val_acc),
            "mean_median_epoch_s": mean(runs, |r| r.median_epoch_s),
            "mean_peak_rss_bytes": mean(runs, |r| r.peak_rss_bytes as f64),
            "runs": runs,
        })
    };
    let types = ds.types.as_ref().expect("a typed graph");
    let mut json = serde_json::json!({
        "model": args.model.to_string(),
        "vertices": ds.labels.len(),
        "edges": ds.graph.indices.len(),
        "types": types.num_types(),
        "relations": types.num_relations(),
        "homophily": args.homophily,
        "layers": args.layers,
        "hidden": args.hidden,
        "epochs": args.epochs,
        "threads": args.threads,
        "grandis": summary(ours),
    });
    if !theirs.is_empty() {
        let points = 100.0 * (mean(ours, |r| r.test_acc) - mean(theirs, |r| r.test_acc));
        let speed = mean(theirs, |r| r.median_epoch_s) / mean(ours, |r| r.median_epoch_s);
        let memory =
            mean(ours, |r| r.peak_rss_bytes as f64) / mean(theirs, |r| r.peak_rss_bytes as f64);
        println!(
            "mean test accuracy grandis {:.4}, PyG {:.4} ({points:+.2} points); grandis is \
             {speed:.2}x PyG's speed per epoch at {memory:.2}x its peak RSS (whole processes)",
            mean(ours, |r| r.test_acc),
            mean(theirs, |r| r.test_acc),
        );
        json["pyg"] = summary(theirs);
        json["test_acc_points_vs_pyg"] = points.into();
        json["epoch_speedup_vs_pyg"] = speed.into();
        json["peak_rss_ratio_vs_pyg"] = memory.into();
    }
    if args.json {
        println!("{json}");
    }
    Ok(())
}
