//! `grandis bench ...`: each benchmark runs its baseline in the same invocation and reports
//! ratios against it, so results are comparable across machines.

mod modes;
mod partition;
mod plan;
mod train;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Partition one synthetic graph with every method; ratios against random.
    Partition(partition::BenchPartitionArgs),
    /// Full-batch training epoch time and memory on a synthetic graph.
    Train(train::BenchTrainArgs),
    /// FB_base vs FLX (k = 1..L) epoch time split and traffic; speedups against FB_base.
    Modes(modes::BenchModesArgs),
    /// The planner's predicted epoch time of every candidate against the measured one, over
    /// several emulated inter-server bandwidths; whether its choice is the fastest.
    Plan(plan::BenchPlanArgs),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Partition(args) => partition::run(args),
        BenchCommand::Train(args) => train::run(args),
        BenchCommand::Modes(args) => modes::run(args),
        BenchCommand::Plan(args) => plan::run(args),
    }
}
