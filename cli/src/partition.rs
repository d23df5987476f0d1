//! Placeholder: being implemented.

#[derive(clap::Args)]
pub struct PartitionArgs {}

pub fn run(_args: PartitionArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
