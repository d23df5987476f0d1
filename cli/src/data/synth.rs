//! Placeholder: being implemented.

#[derive(clap::Args)]
pub struct SynthArgs {}

pub fn run(_args: SynthArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
