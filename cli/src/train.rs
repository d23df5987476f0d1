//! `grandis train`: `--mode single` runs the exact single-process trainer
//! (`grandis-trainer`); `--mode fb|flx|cob|mb|auto` run partition-parallel
//! (`grandis-parallel`), with `--sampling none|eas|fanout|saint`.

use anyhow::{bail, Context};
use grandis_models::{ModelConfig, ModelKind};
use grandis_trainer::{CheckpointOptions, TrainOptions};
use std::path::PathBuf;

/// Where the single-process trainer (and `grandis predict`) computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl Device {
    /// Parses `cpu` or `cuda:N`.
    pub fn parse(s: &str) -> anyhow::Result<Device> {
        if s == "cpu" {
            return Ok(Device::Cpu);
        }
        if let Some(n) = s.strip_prefix("cuda:") {
            if let Ok(ordinal) = n.parse::<usize>() {
                return Ok(Device::Cuda(ordinal));
            }
        }
        bail!("invalid --device '{s}' (expected cpu or cuda:N, e.g. cuda:0)")
    }

    /// Opens the CUDA backend of `cuda:N`; a clean error when this binary has no CUDA
    /// support or the machine has no driver/device.
    #[cfg(feature = "cuda")]
    pub fn cuda_backend(ordinal: usize) -> anyhow::Result<grandis_engine::cuda::CudaBackend> {
        eprintln!("{}", grandis_engine::cuda::describe_device(ordinal)?);
        Ok(grandis_engine::cuda::CudaBackend::new(ordinal)?)
    }

    #[cfg(not(feature = "cuda"))]
    pub fn cuda_backend(_ordinal: usize) -> anyhow::Result<std::convert::Infallible> {
        bail!("this grandis was built without CUDA support; rebuild with `--features cuda`")
    }

    /// Prints one line per CUDA device the driver reports (`--device cuda` of the parallel
    /// modes), or fails with the clean error of a build or machine without CUDA.
    #[cfg(feature = "cuda")]
    pub fn describe_cuda() -> anyhow::Result<()> {
        let n = grandis_engine::cuda::device_count()?;
        if n == 0 {
            bail!("--device cuda: the driver reports no CUDA device");
        }
        for ordinal in 0..n {
            eprintln!("{}", grandis_engine::cuda::describe_device(ordinal)?);
        }
        Ok(())
    }

    #[cfg(not(feature = "cuda"))]
    pub fn describe_cuda() -> anyhow::Result<()> {
        bail!("this grandis was built without CUDA support; rebuild with `--features cuda`")
    }
}

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
    /// Compute device: cpu or cuda:N; the parallel modes also take cuda (device index d of
    /// a server on ordinal d, see --cuda-devices). CUDA needs a build with `--features cuda`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
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

fn open_dataset(args: &TrainArgs) -> anyhow::Result<grandis_store::Dataset> {
    grandis_store::Dataset::open_verified(&args.dataset)
        .with_context(|| format!("opening dataset {}", args.dataset.display()))
}

fn model_and_options(
    args: &TrainArgs,
    kind: ModelKind,
    layer_norm: bool,
    view: &grandis_store::DatasetView<'_>,
) -> (ModelConfig, TrainOptions) {
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
    (config, opts)
}

/// `--mode fb|flx|cob|mb|auto`: partition-parallel ranks on CPU threads or CUDA devices.
fn run_parallel(args: TrainArgs, kind: ModelKind, layer_norm: bool) -> anyhow::Result<()> {
    if args.checkpoint.is_some() || args.resume {
        bail!("--checkpoint and --resume work with --mode single only");
    }
    // `auto` picks FLX or CoB from the memory model (None).
    let mode = match args.mode.as_str() {
        "auto" => None,
        m => Some(grandis_parallel::Mode::parse(m).context("a parallel mode")?),
    };
    let compute = args.parallel.compute(&args.device)?;
    if compute.is_cuda() {
        // Fail fast (and show the devices) before the dataset is read and partitioned.
        Device::describe_cuda()?;
    }
    let dataset = open_dataset(&args)?;
    let view = dataset.view();
    let (config, opts) = model_and_options(&args, kind, layer_norm, &view);
    grandis_parallel::cli::run(
        &dataset,
        mode,
        &args.parallel,
        config,
        opts,
        grandis_parallel::cli::RankResources {
            threads: args.threads,
            compute,
        },
        args.json,
    )
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
    if args.mode != "single" {
        return run_parallel(args, kind, layer_norm);
    }
    let device = Device::parse(&args.device)?;
    // Open the device before reading the dataset so a missing GPU fails fast.
    let cuda = match device {
        Device::Cpu => None,
        Device::Cuda(ordinal) => Some(Device::cuda_backend(ordinal)?),
    };
    let dataset = open_dataset(&args)?;
    let view = dataset.view();
    let (config, opts) = model_and_options(&args, kind, layer_norm, &view);
    tracing::info!(
        "training {} ({} layers, hidden {}) on {} vertices, {} edges",
        kind.name(),
        args.layers,
        args.hidden,
        view.num_vertices(),
        view.graph.num_edges()
    );
    let mut progress = grandis_telemetry::Progress::new("train", Some(args.epochs as u64));
    let ckpt = CheckpointOptions {
        path: args.checkpoint.clone(),
        resume: args.resume,
    };
    let on_epoch = |s: &grandis_trainer::EpochStats| {
        progress.println(format!(
            "epoch {:>4}  loss {:.4}  train {:.4}  val {:.4}  {:.3}s",
            s.epoch, s.loss, s.train_acc, s.val_acc, s.seconds
        ));
        progress.inc(1);
    };
    let report = match cuda {
        // Without the `cuda` feature the backend type is uninhabited: this arm cannot run.
        #[cfg(not(feature = "cuda"))]
        Some(backend) => match backend {},
        #[cfg(feature = "cuda")]
        Some(backend) => {
            grandis_trainer::train_on(backend, view, config.clone(), &opts, &ckpt, on_epoch)?
        }
        None => grandis_trainer::train(view, config.clone(), &opts, &ckpt, args.threads, on_epoch)?,
    };
    progress.finish();
    let summary = format!(
        "final loss {:.4}  train {:.4}  val {:.4}  test {:.4}  median epoch {:.3}s",
        report.final_loss, report.train_acc, report.val_acc, report.test_acc, report.median_epoch_s
    );
    if args.json {
        eprintln!("{summary}");
        let json = serde_json::json!({
            "mode": "single",
            "device": args.device,
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        train: TrainArgs,
    }

    fn args(extra: &[&str]) -> TrainArgs {
        let mut argv = vec!["grandis", "/nonexistent/dataset"];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv).unwrap().train
    }

    #[test]
    fn device_parses_cpu_and_cuda_ordinals_only() {
        assert_eq!(Device::parse("cpu").unwrap(), Device::Cpu);
        assert_eq!(Device::parse("cuda:3").unwrap(), Device::Cuda(3));
        for bad in ["gpu", "cuda", "cuda:", "cuda:-1", "cuda:x", "CPU", ""] {
            let err = format!("{:#}", Device::parse(bad).unwrap_err());
            assert!(err.contains("expected cpu or cuda:N"), "{bad}: {err}");
        }
    }

    /// On a machine without an NVIDIA driver (this build machine), `--device cuda:0` fails with
    /// the clean message before the dataset is even opened; with a driver it is skipped.
    #[test]
    fn cuda_device_without_support_or_driver_is_a_clean_error() {
        #[cfg(feature = "cuda")]
        if grandis_engine::cuda::driver_library_present() {
            eprintln!("skipped: a CUDA driver is present");
            return;
        }
        let err = format!("{:#}", run(args(&["--device", "cuda:0"])).unwrap_err());
        #[cfg(not(feature = "cuda"))]
        assert!(
            err.contains("built without CUDA support; rebuild with `--features cuda`"),
            "{err}"
        );
        #[cfg(feature = "cuda")]
        assert!(err.contains("CUDA driver library not found"), "{err}");
    }

    #[test]
    fn cuda_device_with_a_distributed_mode_needs_cuda() {
        #[cfg(feature = "cuda")]
        if grandis_engine::cuda::driver_library_present() {
            return; // a GPU machine: covered by scripts/gpu-check.sh
        }
        for device in ["cuda", "cuda:0"] {
            let err = format!(
                "{:#}",
                run(args(&["--device", device, "--mode", "flx"])).unwrap_err()
            );
            #[cfg(not(feature = "cuda"))]
            assert!(err.contains("built without CUDA support"), "{err}");
            #[cfg(feature = "cuda")]
            assert!(err.contains("CUDA driver library not found"), "{err}");
        }
        let err = format!(
            "{:#}",
            run(args(&["--mode", "fb", "--cuda-devices", "0,1"])).unwrap_err()
        );
        assert!(err.contains("--cuda-devices needs --device cuda"), "{err}");
        let err = format!(
            "{:#}",
            run(args(&["--mode", "fb", "--device", "cuda:x"])).unwrap_err()
        );
        assert!(err.contains("expected cpu, cuda or cuda:N"), "{err}");
        let err = format!("{:#}", run(args(&["--device", "tpu"])).unwrap_err());
        assert!(err.contains("invalid --device 'tpu'"), "{err}");
    }
}
