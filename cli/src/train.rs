//! `grandis train`: the job's flags ([`JobArgs`]) become a typed job spec; `--mode single`
//! runs it on the exact single-process trainer (`grandis-trainer`), `--mode
//! fb|flx|cob|mb|cluster|auto` partition-parallel in this process ([`crate::train_parallel`]).

use anyhow::{bail, Context};
use grandis_models::ModelConfig;
use grandis_trainer::{CheckpointOptions, TrainOptions};
use grandis_wire::Mode;
use std::path::PathBuf;

use crate::job_args::{validate_as_flags, JobArgs};
use crate::output::{print_summary, stats_line};

#[derive(clap::Args)]
pub struct TrainArgs {
    /// Dataset directory (as written by `grandis data ...`).
    pub dataset: PathBuf,
    #[command(flatten)]
    pub job: JobArgs,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub device: crate::device::DeviceArgs,
    /// Print the run summary as one JSON object on the last stdout line.
    #[arg(long)]
    pub json: bool,
    /// Save the trained model (safetensors, with the Adam state) here after the last epoch,
    /// and every --checkpoint-every epochs; in every mode (rank 0 writes it atomically).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Continue from --checkpoint when it exists (only --epochs may differ).
    #[arg(long)]
    pub resume: bool,
    #[command(flatten)]
    pub local: crate::train_parallel::LocalArgs,
}

fn open_dataset(args: &TrainArgs) -> anyhow::Result<grandis_store::Dataset> {
    grandis_store::Dataset::open_verified(&args.dataset)
        .with_context(|| format!("opening dataset {}", args.dataset.display()))
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let mut spec = args
        .job
        .spec(args.dataset.display().to_string(), Mode::Single)?;
    if args.resume && args.checkpoint.is_none() {
        bail!("--resume needs --checkpoint PATH");
    }
    if spec.checkpoint_every.is_some() && args.checkpoint.is_none() {
        bail!("--checkpoint-every needs --checkpoint PATH");
    }
    if spec.elastic || spec.max_retries != grandis_wire::defaults::MAX_RETRIES {
        bail!(
            "--max-retries and --elastic are for cluster jobs (`cluster up`, `submit`): one \
             process has no server to lose; rerun it with --resume to continue from its \
             checkpoint"
        );
    }
    let ckpt = CheckpointOptions {
        path: args.checkpoint.clone(),
        resume: args.resume,
        every: spec.checkpoint_every.map(|n| n as usize),
    };
    if spec.mode.is_distributed() {
        let compute = args.device.compute()?;
        if compute.is_cuda() {
            // Fail fast (and show the devices) before the dataset is read and partitioned.
            crate::device::describe_cuda()?;
        }
        crate::job_args::fill_auto_budget(&mut spec, &compute)?;
        validate_as_flags(&spec)?;
        let dataset = open_dataset(&args)?;
        return crate::train_parallel::run(
            &dataset,
            &spec,
            &args.local,
            crate::train_parallel::Ranks {
                threads: args.threads,
                compute,
                device: args.device.device.name(),
                checkpoint: ckpt,
            },
            args.json,
        );
    }
    validate_as_flags(&spec)?;
    // Open the device before reading the dataset so a missing GPU fails fast.
    let cuda = crate::device::single_backend(&args.device.device)?;
    let dataset = open_dataset(&args)?;
    let view = dataset.view();
    let config = ModelConfig::for_job(&spec, &view);
    let opts = TrainOptions::for_job(&spec);
    tracing::info!(
        "training {} ({} layers, hidden {}) on {} vertices, {} edges",
        spec.model,
        spec.layers,
        spec.hidden,
        view.num_vertices(),
        view.graph.num_edges()
    );
    let mut progress = grandis_telemetry::Progress::new("train", Some(spec.epochs as u64));
    let on_epoch = |s: &grandis_trainer::EpochStats| {
        progress.println(stats_line(s));
        progress.inc(1);
    };
    let report = match cuda {
        Some(backend) => {
            grandis_trainer::train_on(backend, view, config.clone(), &opts, &ckpt, on_epoch)?
        }
        None => grandis_trainer::train(view, config.clone(), &opts, &ckpt, args.threads, on_epoch)?,
    };
    progress.finish();
    print_summary(&report.summary(&spec, args.device.device.name()), args.json)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use grandis_parallel::Compute;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        train: TrainArgs,
    }

    /// What asking for CUDA says on this machine (no driver): that the build has no CUDA, or,
    /// in a CUDA build, that the driver is missing.
    fn without_cuda_error() -> &'static str {
        if grandis_parallel::CUDA_BUILT {
            "CUDA driver library not found"
        } else {
            grandis_parallel::NOT_BUILT_WITH_CUDA
        }
    }

    fn args(extra: &[&str]) -> TrainArgs {
        let mut argv = vec!["grandis", "/nonexistent/dataset"];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv).unwrap().train
    }

    /// `--device` is parsed by clap into the one device type, every command alike: a bad
    /// value is a usage error naming the grammar.
    #[test]
    fn device_parses_cpu_cuda_and_ordinals() {
        assert_eq!(args(&[]).device.device, Compute::Cpu);
        assert_eq!(
            args(&["--device", "cuda:3"]).device.device,
            Compute::Cuda {
                ordinals: Some(vec![3])
            }
        );
        assert_eq!(
            args(&["--device", "cuda"]).device.device,
            Compute::Cuda { ordinals: None }
        );
        for bad in ["gpu", "cuda:", "cuda:-1", "cuda:x", "CPU", "", "tpu"] {
            let argv = ["grandis", "/nonexistent/dataset", "--device", bad];
            let err = Cli::try_parse_from(argv)
                .err()
                .expect("a usage error")
                .to_string();
            assert!(err.contains("expected cpu, cuda or cuda:N"), "{bad}: {err}");
        }
    }

    /// On a machine without an NVIDIA driver (this build machine), `--device cuda:0` fails with
    /// the clean message before the dataset is even opened; with a driver it is skipped.
    #[test]
    fn cuda_device_without_support_or_driver_is_a_clean_error() {
        if grandis_engine::cuda::driver_library_present() {
            eprintln!("skipped: a CUDA driver is present");
            return;
        }
        let err = format!("{:#}", run(args(&["--device", "cuda:0"])).unwrap_err());
        assert!(err.contains(without_cuda_error()), "{err}");
    }

    #[test]
    fn cuda_device_with_a_distributed_mode_needs_cuda() {
        if grandis_engine::cuda::driver_library_present() {
            return; // a GPU machine: covered by scripts/gpu-check.sh
        }
        for device in ["cuda", "cuda:0"] {
            let err = format!(
                "{:#}",
                run(args(&["--device", device, "--mode", "flx"])).unwrap_err()
            );
            assert!(err.contains(without_cuda_error()), "{err}");
        }
        let err = format!(
            "{:#}",
            run(args(&["--mode", "fb", "--cuda-devices", "0,1"])).unwrap_err()
        );
        assert!(
            err.contains("--cuda-devices: a list of CUDA devices needs device cuda"),
            "{err}"
        );
    }
}
