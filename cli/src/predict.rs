//! Placeholder: being implemented.

#[derive(clap::Args)]
pub struct PredictArgs {}

pub fn run(_args: PredictArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
