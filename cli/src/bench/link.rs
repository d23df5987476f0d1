//! `grandis bench train --task link`: link prediction on a real dataset (`--data`) against
//! PyG's own protocol (scripts/bench_pyg_link.py, its examples/link_pred.py) in the same
//! invocation, over seeds: each seed splits the edges anew (PyG's `RandomLinkSplit` fractions
//! of that example: 5 % validation, 10 % test, one negative per held-out edge), or, for a
//! dataset that carries its own link split (Last.fm's listens), keeps it and seeds the
//! models alone; both systems train the same encoder (with `--embedding-dim`, beside learnable
//! node embeddings) on the same split and are scored on the same held-out pairs.
//! Reported: test and validation AUC, the test edges' MRR and Hits@10/50 (OGB's evaluator
//! semantics on both sides; their mean differences in points), the median epoch and the peak
//! RSS of each, as ratios.

use anyhow::Context;
use grandis_models::ModelConfig;
use grandis_store::{Dataset, DatasetView, EdgeSplitOptions, InMemoryDataset, LinkSplit, Split};
use grandis_trainer::{CheckpointOptions, Objective};

use super::mean;
use super::train::BenchTrainArgs;

/// The held-out fractions of PyG's link_pred.py.
const VAL: f64 = 0.05;
const TEST: f64 = 0.1;

/// One system's run on one seed.
#[derive(Debug, Clone, serde::Serialize)]
struct Run {
    seed: u64,
    val_auc: f64,
    test_auc: f64,
    test_mrr: f64,
    test_hits_at_10: f64,
    test_hits_at_50: f64,
    median_epoch_s: f64,
    peak_rss_bytes: u64,
    /// On a GPU: grandis's live device buffers at their peak, PyG's
    /// `torch.cuda.max_memory_allocated`.
    #[serde(skip_serializing_if = "Option::is_none")]
    peak_device_bytes: Option<u64>,
}

impl super::SeedRun for Run {
    const METRIC: &'static str = "test AUC";
    fn scores(&self) -> [f64; 3] {
        [self.test_auc, self.val_auc, self.median_epoch_s]
    }
}

pub fn run(args: &BenchTrainArgs) -> anyhow::Result<()> {
    let data = args
        .data
        .as_ref()
        .context("--task link needs --data DIR (a dataset whose edges each seed splits)")?;
    super::check_seed_args(args)?;
    // One device for both systems: grandis's encoder on it (the decoder on the rows read
    // back), PyG's whole model on the same `cuda:N`.
    let ordinal = crate::device::single_ordinal(&args.device);
    let dataset = Dataset::open_verified(data)
        .with_context(|| format!("opening dataset {}", data.display()))?;
    let view = dataset.view();
    let undirected = dataset.manifest().symmetric;
    // Each seed's split of the edges, in memory beside a copy of the features; a dataset
    // with its own split (its graph the message-passing one already) is used as it is.
    let split = |seed: u64| -> anyhow::Result<Option<(InMemoryDataset, LinkSplit)>> {
        if view.links.is_some() {
            return Ok(None);
        }
        let split_opts = EdgeSplitOptions {
            val: VAL,
            test: TEST,
            negatives: 1,
            seed,
        };
        let (graph, split) = grandis_store::split_edges(view.graph, undirected, &split_opts)
            .map_err(|e| anyhow::anyhow!("splitting the edges of {}: {e}", data.display()))?;
        let ds = InMemoryDataset {
            name: dataset.manifest().name.clone(),
            graph,
            features: view.features.to_vec(),
            feature_dim: view.feature_dim,
            labels: view.labels.to_vec(),
            num_classes: view.num_classes,
            split: Split::default(),
            types: view.types.cloned(),
        };
        Ok(Some((ds, split)))
    };
    let (ours, theirs) = super::over_seeds(
        args,
        split,
        |split, seed| run_grandis(args, split_view(view, split), ordinal, seed),
        |split, seed| run_pyg(args, &split_view(view, split), seed),
    )?;
    report(args, data, &ours, &theirs)
}

/// The dataset one seed trains on: its own split of the edges, or the dataset itself (its
/// node splits dropped) when it carries a link split.
fn split_view<'a>(
    view: DatasetView<'a>,
    split: &'a Option<(InMemoryDataset, LinkSplit)>,
) -> DatasetView<'a> {
    match split {
        None => DatasetView {
            train: &[],
            val: &[],
            test: &[],
            ..view
        },
        Some((ds, split)) => DatasetView {
            links: Some(split.view()),
            ..ds.view()
        },
    }
}

/// grandis on one seed's split (on `ordinal`'s GPU, metered, when given).
fn run_grandis(
    args: &BenchTrainArgs,
    split_view: DatasetView<'_>,
    ordinal: Option<usize>,
    seed: u64,
) -> anyhow::Result<Run> {
    let config = ModelConfig {
        kind: args.model,
        layers: args.layers,
        in_dim: split_view.feature_dim + args.embedding_dim,
        hidden: args.hidden,
        heads: args.heads,
        output_heads: grandis_wire::defaults::OUTPUT_HEADS as usize,
        classes: args.out_dim,
        dropout: args.dropout,
        layer_norm: false,
        seed,
        relations: split_view
            .types
            .map(grandis_models::ModelRelation::of)
            .unwrap_or_default(),
        num_bases: None,
    };
    let objective = Objective::Link {
        negatives: args.negatives,
        decoder: args.decoder,
    };
    let opts = super::seed_train_options(args, seed, objective, args.embedding_dim);
    grandis_telemetry::reset_peak_rss();
    let ck = CheckpointOptions::default();
    let (report, peak_device_bytes) = match ordinal {
        None => (
            grandis_trainer::train(split_view, config, &opts, &ck, Some(args.threads), |_| {})?,
            None,
        ),
        Some(ordinal) => {
            let metered =
                grandis_parallel::metered::Metered::new(crate::device::cuda_backend(ordinal)?);
            let meter = metered.meter.clone();
            let report =
                grandis_trainer::train_on(metered, split_view, config, &opts, &ck, |_| {})?;
            (report, Some(meter.peak()))
        }
    };
    let link = report.link.context("the run reported no link scores")?;
    let times: Vec<f64> = report.epochs.iter().skip(1).map(|e| e.seconds).collect();
    Ok(Run {
        seed,
        val_auc: link.val.auc,
        test_auc: link.test.auc,
        test_mrr: link.test.mrr,
        test_hits_at_10: link.test.hits_at_10,
        test_hits_at_50: link.test.hits_at_50,
        median_epoch_s: grandis_telemetry::median(&times),
        peak_rss_bytes: grandis_telemetry::peak_rss_bytes(),
        peak_device_bytes,
    })
}

/// PyG on the same split: exported in the PyG layout, scripts/bench_pyg_link.py run on it.
fn run_pyg(
    args: &BenchTrainArgs,
    view: &grandis_store::DatasetView<'_>,
    seed: u64,
) -> anyhow::Result<Run> {
    let tmp = tempfile::tempdir().context("creating a temporary directory")?;
    let dir = tmp.path().join("pyg");
    grandis_import::export_npy(view, &dir, false).context("exporting the split for PyG")?;
    let script = args.pyg_script.with_file_name("bench_pyg_link.py");
    let device = crate::device::single_ordinal(&args.device)
        .map_or("cpu".to_string(), |o| format!("cuda:{o}"));
    let mut flags = super::baseline_flags(args, &dir, seed);
    for (flag, value) in [
        ("--out-dim", args.out_dim.to_string()),
        ("--embedding-dim", args.embedding_dim.to_string()),
        ("--decoder", args.decoder.name().to_string()),
        ("--device", device),
    ] {
        flags.extend([flag.to_string(), value]);
    }
    let v = super::Baseline::run(&args.python, &script, &flags)?;
    let num = |k: &str| v.num(k);
    Ok(Run {
        seed,
        val_auc: num("val_auc")?,
        test_auc: num("test_auc")?,
        test_mrr: num("test_mrr")?,
        test_hits_at_10: num("test_hits_at_10")?,
        test_hits_at_50: num("test_hits_at_50")?,
        median_epoch_s: num("median_epoch_s")?,
        peak_rss_bytes: num("peak_rss_bytes")? as u64,
        peak_device_bytes: v.get("peak_device_bytes").and_then(|x| x.as_u64()),
    })
}

fn report(
    args: &BenchTrainArgs,
    data: &std::path::Path,
    ours: &[Run],
    theirs: &[Run],
) -> anyhow::Result<()> {
    println!(
        "link prediction on {} ({}-layer {} {} -> {}, {} decoder, {} epochs, {} seeds, {} threads):",
        data.display(),
        args.layers,
        args.model,
        args.hidden,
        args.out_dim,
        args.decoder,
        args.epochs,
        ours.len(),
        args.threads
    );
    // On a GPU the memory that matters is the device's.
    let on_device = ours.iter().all(|r| r.peak_device_bytes.is_some());
    let peak = |r: &Run| match r.peak_device_bytes {
        Some(b) if on_device => b as f64,
        _ => r.peak_rss_bytes as f64,
    };
    println!(
        "system   seed  test AUC   val AUC  test MRR  Hits@10  Hits@50  median epoch  {}",
        if on_device { "peak device" } else { "peak RSS" }
    );
    for (name, runs) in [("grandis", ours), ("PyG", theirs)] {
        for r in runs {
            println!(
                "{name:<8} {:>4}  {:>8.4}  {:>8.4}  {:>8.4}  {:>7.4}  {:>7.4}  {:>10.4}s  {:>6.1} MiB",
                r.seed,
                r.test_auc,
                r.val_auc,
                r.test_mrr,
                r.test_hits_at_10,
                r.test_hits_at_50,
                r.median_epoch_s,
                peak(r) / (1 << 20) as f64
            );
        }
    }
    let summary = |runs: &[Run]| {
        serde_json::json!({
            "mean_test_auc": mean(runs, |r| r.test_auc),
            "mean_val_auc": mean(runs, |r| r.val_auc),
            "mean_test_mrr": mean(runs, |r| r.test_mrr),
            "mean_test_hits_at_10": mean(runs, |r| r.test_hits_at_10),
            "mean_test_hits_at_50": mean(runs, |r| r.test_hits_at_50),
            "mean_median_epoch_s": mean(runs, |r| r.median_epoch_s),
            "mean_peak_rss_bytes": mean(runs, |r| r.peak_rss_bytes as f64),
            "mean_peak_device_bytes": on_device.then(|| mean(runs, peak)),
            "runs": runs,
        })
    };
    let mut json = serde_json::json!({
        "dataset": data,
        "model": args.model.to_string(),
        "layers": args.layers,
        "hidden": args.hidden,
        "out_dim": args.out_dim,
        "embedding_dim": args.embedding_dim,
        "decoder": args.decoder.name(),
        "epochs": args.epochs,
        "threads": args.threads,
        "val_fraction": VAL,
        "test_fraction": TEST,
        "grandis": summary(ours),
    });
    if !theirs.is_empty() {
        let points = |f: fn(&Run) -> f64| 100.0 * (mean(ours, f) - mean(theirs, f));
        let speed = mean(theirs, |r| r.median_epoch_s) / mean(ours, |r| r.median_epoch_s);
        let memory =
            mean(ours, |r| r.peak_rss_bytes as f64) / mean(theirs, |r| r.peak_rss_bytes as f64);
        let device_memory = mean(ours, peak) / mean(theirs, peak);
        println!(
            "mean test AUC grandis {:.4}, PyG {:.4} ({:+.2} points); MRR {:+.2}, Hits@10 \
             {:+.2}, Hits@50 {:+.2} points; grandis is {speed:.2}x PyG's speed per epoch at \
             {:.2}x its {}",
            mean(ours, |r| r.test_auc),
            mean(theirs, |r| r.test_auc),
            points(|r| r.test_auc),
            points(|r| r.test_mrr),
            points(|r| r.test_hits_at_10),
            points(|r| r.test_hits_at_50),
            if on_device { device_memory } else { memory },
            if on_device {
                "peak device memory (grandis's live buffers, PyG's max_memory_allocated)"
            } else {
                "peak RSS (whole processes)"
            },
        );
        json["pyg"] = summary(theirs);
        json["test_auc_points_vs_pyg"] = points(|r| r.test_auc).into();
        json["test_mrr_points_vs_pyg"] = points(|r| r.test_mrr).into();
        json["test_hits_at_10_points_vs_pyg"] = points(|r| r.test_hits_at_10).into();
        json["test_hits_at_50_points_vs_pyg"] = points(|r| r.test_hits_at_50).into();
        json["epoch_speedup_vs_pyg"] = speed.into();
        json["peak_rss_ratio_vs_pyg"] = memory.into();
        if on_device {
            json["peak_device_ratio_vs_pyg"] = device_memory.into();
        }
    }
    if args.json {
        println!("{json}");
    }
    Ok(())
}
