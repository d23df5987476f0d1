//! `grandis certs init`: the cluster CA and one certificate + key per node for the QUIC data
//! plane's mutual TLS (`grandis-quic`).

use std::path::PathBuf;

use clap::{Args, Subcommand};

#[derive(Subcommand)]
pub enum CertsCommand {
    /// Create a cluster CA and one certificate per node.
    ///
    /// Writes ca.pem, ca.key and <node>.pem / <node>.key for every node into --out. Give each
    /// server ca.pem plus its own pair (the daemon's `cert_dir`); keep ca.key off the servers.
    /// A daemon's label is its node name. Peers with a certificate from another CA are refused.
    Init(InitArgs),
}

#[derive(Args)]
pub struct InitArgs {
    /// Directory to write the files into (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Comma-separated node names (the daemons' labels), e.g. node-a,node-b.
    #[arg(long)]
    pub nodes: String,
    /// Also make every certificate valid for localhost and 127.0.0.1 (single-host clusters).
    #[arg(long)]
    pub localhost: bool,
    /// Validity of the CA and the node certificates, in days from now.
    #[arg(long, default_value_t = 3650)]
    pub days: u32,
    /// Overwrite existing files instead of refusing.
    #[arg(long)]
    pub force: bool,
}

pub fn run(cmd: CertsCommand) -> anyhow::Result<()> {
    match cmd {
        CertsCommand::Init(a) => {
            if a.days == 0 {
                anyhow::bail!("--days must be at least 1");
            }
            grandis_quic::run_init(
                &a.out,
                &a.nodes,
                &grandis_quic::InitOptions {
                    include_localhost: a.localhost,
                    validity_days: a.days,
                    overwrite: a.force,
                },
            )?;
            Ok(())
        }
    }
}
