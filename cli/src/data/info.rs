//! Placeholder: being implemented.

#[derive(clap::Args)]
pub struct InfoArgs {}
#[derive(clap::Args)]
pub struct VerifyArgs {}

pub fn run(_args: InfoArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
pub fn verify(_args: VerifyArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
