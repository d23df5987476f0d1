//! Placeholder: being implemented.

#[derive(clap::Args)]
pub struct BenchTrainArgs {}

pub fn run(_args: BenchTrainArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
