//! Placeholder: being implemented.

#[derive(clap::Args)]
pub struct TrainArgs {}

pub fn run(_args: TrainArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
