//! `grandis bench ...`: each benchmark runs its baseline in the same invocation and reports
//! ratios against it, so results are comparable across machines.

mod partition;
mod train;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Partition one synthetic graph with every method; ratios against random.
    Partition(partition::BenchPartitionArgs),
    /// Full-batch training epoch time and memory on a synthetic graph.
    Train(train::BenchTrainArgs),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Partition(args) => partition::run(args),
        BenchCommand::Train(args) => train::run(args),
    }
}
