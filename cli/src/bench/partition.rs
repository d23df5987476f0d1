//! Placeholder: being implemented.

#[derive(clap::Args)]
pub struct BenchPartitionArgs {}

pub fn run(_args: BenchPartitionArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
