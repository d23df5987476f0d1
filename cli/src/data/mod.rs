//! `grandis data ...`: dataset import, export, generation, reordering, link splits and
//! inspection.

mod export;
mod import;
mod info;
mod reorder;
mod split_edges;
mod synth;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum DataCommand {
    /// Convert a dataset from another format into a grandis dataset directory.
    Import(import::ImportArgs),
    /// Write a dataset in another layout (the PyG .npy layout), for baselines.
    Export(export::ExportArgs),
    /// Print counts, split sizes and degree statistics of a dataset.
    Info(info::InfoArgs),
    /// Check every checksum, id and label of a dataset.
    Verify(info::VerifyArgs),
    /// Generate a synthetic power-law graph with planted classes.
    Synth(synth::SynthArgs),
    /// Renumber vertices so that neighbours get nearby ids (faster epochs on big graphs).
    Reorder(reorder::ReorderArgs),
    /// Split a dataset's edges for link prediction (train / validation / test edges, with
    /// negatives; the held-out edges leave the graph).
    SplitEdges(split_edges::SplitEdgesArgs),
}

pub fn run(cmd: DataCommand) -> anyhow::Result<()> {
    match cmd {
        DataCommand::Import(args) => import::run(args),
        DataCommand::Export(args) => export::run(args),
        DataCommand::Info(args) => info::run(args),
        DataCommand::Verify(args) => info::verify(args),
        DataCommand::Synth(args) => synth::run(args),
        DataCommand::Reorder(args) => reorder::run(args),
        DataCommand::SplitEdges(args) => split_edges::run(args),
    }
}
