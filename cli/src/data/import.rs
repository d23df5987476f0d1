//! Placeholder: being implemented.

#[derive(clap::Args)]
pub struct ImportArgs {}

pub fn run(_args: ImportArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
