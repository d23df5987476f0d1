//! `grandis predict`: class ids (int64, one per vertex) or logits (f32, vertices x classes)
//! of a trained checkpoint, and optionally the vertex embeddings (a link-prediction
//! checkpoint: its output embeddings, and the scores of an edge list), written as `.npy` by
//! layer-wise inference ([`grandis_trainer::layerwise`]): one stage at a time over the whole
//! graph in blocks that fit a memory budget, so graphs whose features and embeddings do not
//! fit in memory work too.

use anyhow::Context;
use grandis_trainer::layerwise::{
    predict_layerwise, LayerwiseOptions, LayerwiseOutputs, LayerwiseReport, Predictions,
};
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
    /// Write the logits (f32, N x C) instead of class ids (int64, N). A link-prediction
    /// checkpoint always writes its output embeddings (f32, N x out_dim).
    #[arg(long)]
    pub logits: bool,
    /// A link-prediction checkpoint: also score these pairs (`.npy`, integers, shape (2, E):
    /// row 0 sources, row 1 destinations; or OGB's (E, 2), a pair a row) into --scores.
    #[arg(long, requires = "scores")]
    pub score_edges: Option<PathBuf>,
    /// Where --score-edges writes the scores (`.npy`, f32, E: the dot products of the ends'
    /// embeddings, the logits of each edge's probability).
    #[arg(long, requires = "score_edges")]
    pub scores: Option<PathBuf>,
    /// Also write the vertex embeddings (the input of the model's last stage, f32, N x
    /// hidden) to this `.npy` file.
    #[arg(long)]
    pub embeddings: Option<PathBuf>,
    /// Memory one block of vertices may use, bytes or with a unit ("512MiB", "8GiB")
    /// [default: half the available memory (of the GPU with --device cuda:N); the rest is
    /// left to the page cache holding the input].
    #[arg(long, value_parser = grandis_wire::spec::parse_bytes)]
    pub memory_budget: Option<u64>,
    /// At most this many vertices per block (default: as many as the budget allows).
    #[arg(long)]
    pub block_rows: Option<usize>,
    /// Directory for the intermediate layers (default: the output's directory); each is
    /// removed once the next layer is written.
    #[arg(long)]
    pub scratch_dir: Option<PathBuf>,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Compute device: cpu or cuda:N (cuda: ordinal 0; needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: grandis_parallel::Compute,
    /// Print what the pass did (per stage: blocks, source rows, seconds) and its peak RSS as
    /// one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: PredictArgs) -> anyhow::Result<()> {
    // Open the device before reading the dataset so a missing GPU fails fast.
    let cuda = crate::device::single_backend(&args.device)?;
    let block_budget = match args.memory_budget {
        Some(bytes) => bytes,
        None => {
            let (bytes, why) = grandis_parallel::default_budget(&args.device, 1, 1)?;
            tracing::info!("block budget: half of {bytes} bytes ({why})");
            bytes / 2
        }
    };
    // An output whose directory is missing would only fail after a whole stage: say so now.
    for path in std::iter::once(&args.out).chain(&args.embeddings) {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if !dir.is_dir() {
                anyhow::bail!(
                    "cannot write {}: {} is not a directory",
                    path.display(),
                    dir.display()
                );
            }
        }
    }
    let decoder = grandis_trainer::load_checkpoint(&args.checkpoint)?.link_decoder(false)?;
    let link = decoder.is_some();
    if args.score_edges.is_some() && !link {
        anyhow::bail!(
            "--score-edges scores pairs with a link-prediction checkpoint (`train --task \
             link`); {} was trained for node classification",
            args.checkpoint.display()
        );
    }
    let dataset = grandis_store::Dataset::open_verified(&args.dataset)
        .with_context(|| format!("opening dataset {}", args.dataset.display()))?;
    let scratch_dir = match &args.scratch_dir {
        Some(dir) => dir.clone(),
        None => match args.out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        },
    };
    let outputs = LayerwiseOutputs {
        predictions: args.out.clone(),
        kind: if args.logits || link {
            Predictions::Logits
        } else {
            Predictions::ClassIds
        },
        embeddings: args.embeddings.clone(),
    };
    let opts = LayerwiseOptions {
        block_budget,
        max_block_rows: args.block_rows,
        scratch_dir,
    };
    let report: LayerwiseReport = match cuda {
        Some(backend) => predict_layerwise(&backend, &dataset, &args.checkpoint, &outputs, &opts)?,
        None => {
            let backend = grandis_engine::CpuBackend::new(args.threads)?;
            // The planner's gathers run in the backend's pool too, so --threads bounds them.
            backend.install(|| {
                predict_layerwise(&backend, &dataset, &args.checkpoint, &outputs, &opts)
            })?
        }
    };
    if let (Some(pairs), Some(scores), Some(decoder)) = (&args.score_edges, &args.scores, &decoder)
    {
        let e = grandis_trainer::link::score_pairs_npy(&args.out, pairs, scores, decoder)?;
        tracing::info!(
            "scored {e} pairs of {} into {}",
            pairs.display(),
            scores.display()
        );
    }
    let peak_rss = grandis_telemetry::peak_rss_bytes();
    tracing::info!(
        "wrote predictions of {} vertices to {} in {:.1} s (peak RSS {:.0} MiB)",
        report.vertices,
        args.out.display(),
        report.seconds,
        peak_rss as f64 / (1u64 << 20) as f64
    );
    if args.json {
        let mut value = serde_json::to_value(&report)?;
        value["peak_rss_bytes"] = peak_rss.into();
        value["block_budget_bytes"] = block_budget.into();
        println!("{value}");
    }
    Ok(())
}
