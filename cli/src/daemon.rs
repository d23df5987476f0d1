//! `grandis daemon`: one per server (`grandis-daemon`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(clap::Args)]
pub struct DaemonArgs {
    /// Configuration file (TOML); see docs/daemon.md. Every key can be overridden by
    /// GRANDIS_DAEMON_<KEY> (e.g. GRANDIS_DAEMON_TOKEN). Required keys: coordinator, token,
    /// label, cert_dir.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Print the merged configuration (with the source of every key) and exit.
    #[arg(long)]
    pub print_config: bool,
}

pub fn run(args: DaemonArgs) -> anyhow::Result<()> {
    if args.print_config {
        print!("{}", grandis_daemon::print_config(args.config.as_deref())?);
        return Ok(());
    }
    grandis_launch::exit_with_parent();
    let config = grandis_daemon::DaemonConfig::load(args.config.as_deref())?;
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        // Ctrl-C / SIGTERM: stop heartbeating, cancel the running job, exit.
        ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst))
            .map_err(|e| anyhow::anyhow!("cannot install the signal handler: {e}"))?;
    }
    grandis_daemon::run(config, stop)
}
