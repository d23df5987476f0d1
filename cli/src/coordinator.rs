//! `grandis coordinator`: the job service users submit to and daemons report to
//! (`grandis-coordinator`).

use std::path::PathBuf;

use anyhow::Context;

#[derive(clap::Args)]
pub struct CoordinatorArgs {
    /// Configuration file (TOML). Keys: listen, db_path, token, daemon_token,
    /// heartbeat_interval_ms, lease_ms, down_timeout_ms, sse_keepalive_ms; each can be
    /// overridden by GRANDIS_COORDINATOR_<KEY>. Without a file, defaults and the environment.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Print the merged configuration (with the source of every key) and exit.
    #[arg(long)]
    pub print_config: bool,
    /// Once listening (and the database is open), write the bound address (host:port) to this
    /// file (useful with `listen = "127.0.0.1:0"`).
    #[arg(long)]
    pub addr_file: Option<PathBuf>,
    /// If the job database is damaged (the coordinator refuses to start and says so), move it
    /// aside to DB_PATH.damaged-UNIXSECONDS and start with a new, empty one. Jobs in the old
    /// file are not carried over; daemons register again by themselves. A healthy database is
    /// left alone, so the flag is safe to leave in a unit file.
    #[arg(long)]
    pub reset_damaged_db: bool,
}

pub fn run(args: CoordinatorArgs) -> anyhow::Result<()> {
    if args.print_config {
        print!(
            "{}",
            grandis_coordinator::print_config(args.config.as_deref())?
        );
        return Ok(());
    }
    grandis_launch::exit_with_parent();
    let config = grandis_coordinator::CoordinatorConfig::load(args.config.as_deref())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    if args.reset_damaged_db {
        // Logs where the old file went when it moves it.
        grandis_coordinator::store::Store::set_aside_if_damaged(&config.db_path)?;
    }
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&config.listen)
            .await
            .with_context(|| format!("listen: cannot bind {}", config.listen))?;
        let handle = grandis_coordinator::spawn(config, listener).await?;
        if let Some(path) = &args.addr_file {
            grandis_store::write_file_atomic(path, handle.local_addr().to_string().as_bytes())
                .with_context(|| format!("--addr-file: writing {}", path.display()))?;
        }
        handle.run_until_signal().await
    })
}
