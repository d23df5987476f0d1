//! `grandis train`: `--mode single` runs the exact single-process trainer
//! (`grandis-trainer`); `--mode fb|flx|cob|mb|auto` run partition-parallel
//! (`grandis-parallel`), with `--sampling none|eas|fanout|saint`.

use anyhow::{bail, Context};
use grandis_models::{ModelConfig, ModelKind};
use grandis_trainer::{CheckpointOptions, TrainOptions};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct TrainArgs {
    /// Dataset directory (as written by `grandis data ...`).
    pub dataset: PathBuf,
    /// Execution mode: single (one process, exact reference), fb, flx, cob (cooperative
    /// batching), mb (per-GPU mini-batches) or auto (FLX when the graph fits --device-memory,
    /// else CoB with the largest co-batch that fits).
    #[arg(long, default_value = "single")]
    pub mode: String,
    /// Model: sage, gcn, ressage, or mlp (features only, no graph).
    #[arg(long, default_value = "sage")]
    pub model: String,
    /// Number of graph convolutions.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    /// Hidden width.
    #[arg(long, default_value_t = 64)]
    pub hidden: usize,
    #[arg(long, default_value_t = 100)]
    pub epochs: usize,
    /// Dropout probability.
    #[arg(long, default_value_t = 0.5)]
    pub dropout: f32,
    /// Adam learning rate.
    #[arg(long, default_value_t = 0.01)]
    pub lr: f32,
    /// Weight decay (an L2 penalty with Adam, decoupled with --adamw).
    #[arg(long, default_value_t = 5e-4)]
    pub weight_decay: f32,
    /// Use AdamW (decoupled weight decay).
    #[arg(long)]
    pub adamw: bool,
    /// Normalisation between layers: layernorm or none.
    #[arg(long, default_value = "none")]
    pub norm: String,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    pub grad_clip: Option<f32>,
    /// Seed of the weight init and the dropout masks.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print one JSON object as the last stdout line.
    #[arg(long)]
    pub json: bool,
    /// Save the trained model (safetensors) here.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Continue from --checkpoint when it exists (only --epochs may differ).
    #[arg(long)]
    pub resume: bool,
    #[command(flatten)]
    pub parallel: grandis_parallel::cli::ParallelArgs,
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    match args.mode.as_str() {
        "single" | "fb" | "flx" | "cob" | "mb" | "auto" => {}
        other => bail!("unknown --mode '{other}' (expected single, fb, flx, cob, mb or auto)"),
    }
    let kind = ModelKind::parse(&args.model).with_context(|| {
        format!(
            "unknown --model '{}' (expected sage, gcn, ressage or mlp)",
            args.model
        )
    })?;
    let layer_norm = match args.norm.as_str() {
        "layernorm" => true,
        "none" => false,
        other => bail!("unknown --norm '{other}' (expected layernorm or none)"),
    };
    if args.resume && args.checkpoint.is_none() {
        bail!("--resume needs --checkpoint PATH");
    }
    let dataset = grandis_store::Dataset::open_verified(&args.dataset)
        .with_context(|| format!("opening dataset {}", args.dataset.display()))?;
    let view = dataset.view();
    let config = ModelConfig {
        kind,
        layers: args.layers,
        in_dim: view.feature_dim,
        hidden: args.hidden,
        classes: view.num_classes,
        dropout: args.dropout,
        layer_norm,
        seed: args.seed,
    };
    let opts = TrainOptions {
        epochs: args.epochs,
        lr: args.lr,
        weight_decay: args.weight_decay,
        adamw: args.adamw,
        grad_clip: args.grad_clip,
        seed: args.seed,
    };
    // `auto` picks FLX or CoB from the memory model (None below).
    let parallel_mode = match args.mode.as_str() {
        "auto" => Some(None),
        m => grandis_parallel::Mode::parse(m).map(Some),
    };
    if let Some(mode) = parallel_mode {
        if args.checkpoint.is_some() {
            bail!("--checkpoint and --resume work with --mode single only");
        }
        let (threads, json) = (args.threads, args.json);
        return grandis_parallel::cli::run(
            &dataset,
            mode,
            &args.parallel,
            config,
            opts,
            threads,
            json,
        );
    }
    tracing::info!(
        "training {} ({} layers, hidden {}) on {} vertices, {} edges",
        kind.name(),
        args.layers,
        args.hidden,
        view.num_vertices(),
        view.graph.num_edges()
    );
    let mut progress = grandis_telemetry::Progress::new("train", Some(args.epochs as u64));
    let report = grandis_trainer::train(
        view,
        config.clone(),
        &opts,
        &CheckpointOptions {
            path: args.checkpoint.clone(),
            resume: args.resume,
        },
        args.threads,
        |s| {
            progress.println(format!(
                "epoch {:>4}  loss {:.4}  train {:.4}  val {:.4}  {:.3}s",
                s.epoch, s.loss, s.train_acc, s.val_acc, s.seconds
            ));
            progress.inc(1);
        },
    )?;
    progress.finish();
    let summary = format!(
        "final loss {:.4}  train {:.4}  val {:.4}  test {:.4}  median epoch {:.3}s",
        report.final_loss, report.train_acc, report.val_acc, report.test_acc, report.median_epoch_s
    );
    if args.json {
        eprintln!("{summary}");
        let json = serde_json::json!({
            "mode": "single",
            "model": config,
            "train": opts,
            "num_parameters": report.num_parameters,
            "first_epoch": report.first_epoch,
            "test_acc": report.test_acc,
            "val_acc": report.val_acc,
            "train_acc": report.train_acc,
            "final_loss": report.final_loss,
            "median_epoch_s": report.median_epoch_s,
            "peak_rss_bytes": grandis_telemetry::peak_rss_bytes(),
            "losses": report.epochs.iter().map(|s| s.loss).collect::<Vec<_>>(),
            "epoch_seconds": report.epochs.iter().map(|s| s.seconds).collect::<Vec<_>>(),
        });
        println!("{json}");
    } else {
        println!("{summary}");
    }
    Ok(())
}
