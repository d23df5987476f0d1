//! `grandis data export`: a grandis dataset out in another layout (today the PyG `.npy`
//! layout that `grandis data import --format npy` reads), so baselines train on the same data.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;

#[derive(Clone, Copy, clap::ValueEnum)]
enum ExportFormat {
    /// PyG layout: edge_index.npy (2 x E int64: row 0 sources, row 1 destinations), x.npy
    /// (N x F float32), y.npy (N int64, -1 = unlabelled), train_idx.npy, val_idx.npy,
    /// test_idx.npy (int64 ids).
    Npy,
}

/// Arguments of `grandis data export`.
#[derive(clap::Args)]
#[command(after_help = "\
The output directory appears only when every file is complete; on any error nothing is left \
behind. `grandis data import --format npy --input OUT --out DIR` gives the same dataset back.

Example:
  grandis data export --format npy data/cora data/cora-pyg")]
pub struct ExportArgs {
    /// Output layout.
    #[arg(long, value_enum, default_value = "npy")]
    format: ExportFormat,
    /// Dataset directory (as written by `grandis data ...`).
    dataset: PathBuf,
    /// Output directory; must not exist unless --force.
    out: PathBuf,
    /// Replace the output directory if it already exists.
    #[arg(long)]
    force: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: ExportArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let ds = grandis_store::Dataset::open_verified(&args.dataset)
        .with_context(|| format!("opening dataset {}", args.dataset.display()))?;
    let summary = match args.format {
        ExportFormat::Npy => grandis_import::export_npy(&ds.view(), &args.out, args.force),
    }
    .with_context(|| {
        format!(
            "exporting {} to {}",
            args.dataset.display(),
            args.out.display()
        )
    })?;
    let seconds = started.elapsed().as_secs_f64();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "out": summary.out,
                "format": "npy",
                "vertices": summary.vertices,
                "edges": summary.edges,
                "features": summary.features,
                "files": summary.files,
                "seconds": seconds,
            })
        );
    } else {
        println!(
            "exported {} vertices, {} edges, {} features to {} ({}) in {seconds:.2}s",
            summary.vertices,
            summary.edges,
            summary.features,
            summary.out.display(),
            summary.files.join(", ")
        );
    }
    Ok(())
}
