//! `grandis predict`: class ids (int64, one per vertex) or logits (f32, vertices x classes)
//! of a trained checkpoint, written as `.npy`.

use crate::train::Device;
use anyhow::Context;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct PredictArgs {
    /// Dataset directory.
    pub dataset: PathBuf,
    /// Checkpoint written by `grandis train --checkpoint`.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Output `.npy` file.
    #[arg(long)]
    pub out: PathBuf,
    /// Write the logits (f32, N x C) instead of class ids (int64, N).
    #[arg(long)]
    pub logits: bool,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Compute device: cpu or cuda:N (needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

pub fn run(args: PredictArgs) -> anyhow::Result<()> {
    let device = Device::parse(&args.device)?;
    // Open the device before reading the dataset so a missing GPU fails fast.
    let cuda = match device {
        Device::Cpu => None,
        Device::Cuda(ordinal) => Some(Device::cuda_backend(ordinal)?),
    };
    let dataset = grandis_store::Dataset::open_verified(&args.dataset)
        .with_context(|| format!("opening dataset {}", args.dataset.display()))?;
    let view = dataset.view();
    let logits = match cuda {
        // Without the `cuda` feature the backend type is uninhabited: this arm cannot run.
        #[cfg(not(feature = "cuda"))]
        Some(backend) => match backend {},
        #[cfg(feature = "cuda")]
        Some(backend) => grandis_trainer::predict_logits_on(backend, view, &args.checkpoint)?,
        None => grandis_trainer::predict_logits(view, &args.checkpoint, args.threads)?,
    };
    let (n, c) = (view.num_vertices(), view.num_classes);
    if args.logits {
        grandis_npy::write_npy(&args.out, &[n as u64, c as u64], &logits)
    } else {
        let ids: Vec<i64> = logits
            .chunks_exact(c)
            .map(|row| grandis_trainer::argmax(row) as i64)
            .collect();
        grandis_npy::write_npy(&args.out, &[n as u64], &ids)
    }
    .with_context(|| format!("writing {}", args.out.display()))?;
    tracing::info!(
        "wrote predictions of {n} vertices to {}",
        args.out.display()
    );
    Ok(())
}
