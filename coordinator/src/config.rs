//! Coordinator configuration: defaults, then a TOML file, then `GRANDIS_COORDINATOR_*`
//! environment variables (later sources win), merged with figment.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::bail;
use figment::Figment;
use grandis_config::Layers;
use serde::{Deserialize, Serialize};

/// Prefix of the environment variables that override the file (`GRANDIS_COORDINATOR_LISTEN`,
/// `GRANDIS_COORDINATOR_TOKEN`, ...: the prefix followed by the key in upper case).
pub const ENV_PREFIX: &str = "GRANDIS_COORDINATOR_";

/// Every key, in the order `print_config` shows them.
pub const KEYS: &[&str] = &[
    "listen",
    "db_path",
    "token",
    "daemon_token",
    "daemon_ca",
    "heartbeat_interval_ms",
    "lease_ms",
    "down_timeout_ms",
    "forget_after_ms",
    "sse_keepalive_ms",
    "max_connections",
    "header_read_timeout_ms",
    "idle_timeout_ms",
    "max_checkpoint_bytes",
    "keep_finished_checkpoints",
    "max_restart_retries",
];

const LAYERS: Layers = Layers {
    service: "coordinator",
    env_prefix: ENV_PREFIX,
    keys: KEYS,
    secrets: &["token", "daemon_token"],
};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoordinatorConfig {
    /// Address to listen on (`run_blocking` binds it; `serve` takes a bound listener).
    pub listen: String,
    /// The redb database holding jobs, id counters and election terms.
    pub db_path: PathBuf,
    /// Bearer token for the REST API (and for daemons unless `daemon_token` is set). Required.
    #[serde(deserialize_with = "grandis_config::opt_string_lenient")]
    pub token: Option<String>,
    /// Separate bearer token for the daemon protocol; when set, the user token is not accepted
    /// there and this one is not accepted on the user API.
    #[serde(deserialize_with = "grandis_config::opt_string_lenient")]
    pub daemon_token: Option<String>,
    /// The cluster CA certificate (`ca.pem` of `grandis certs init`): a daemon registers only
    /// as the label its node certificate names, proven by signing a one-time challenge, and
    /// every later daemon call carries the session it was given, so it acts only as itself.
    /// Absent: labels are taken on trust from any holder of the daemon token (a warning at
    /// start).
    pub daemon_ca: Option<PathBuf>,
    /// How often daemons heartbeat.
    pub heartbeat_interval_ms: u64,
    /// A head that has not heartbeated for this long loses its lease: a new term starts and its
    /// running job fails.
    pub lease_ms: u64,
    /// A daemon that has not heartbeated for this long is reported down.
    pub down_timeout_ms: u64,
    /// A daemon down for this long is forgotten: it leaves `GET /v1/cluster` and the metrics
    /// (and registers anew if it comes back).
    pub forget_after_ms: u64,
    /// Interval of keep-alive comments on server-sent event streams.
    pub sse_keepalive_ms: u64,
    /// HTTP connections open at once. Past it, the oldest connection that has not sent a
    /// request yet is closed to make room (so a flood of idle connections cannot lock users
    /// out); when every open connection is in use, new ones are refused.
    pub max_connections: usize,
    /// A client must send a whole request head within this time of the server starting to
    /// wait for it (also how long a kept-alive connection may sit between requests).
    pub header_read_timeout_ms: u64,
    /// A connection that moves no byte either way for this long is closed (greater than
    /// `sse_keepalive_ms`, so event streams stay open).
    pub idle_timeout_ms: u64,
    /// The largest checkpoint a job's leader may upload (bytes). Checkpoints are kept in the
    /// database, one per job (the latest), so that a retry resumes on any servers.
    pub max_checkpoint_bytes: u64,
    /// Finished jobs whose checkpoints stay in the database (for download): the newest this
    /// many by finish time; an older finished job's checkpoint is deleted when another job
    /// finishes (and at start). Queued and running jobs keep theirs.
    pub keep_finished_checkpoints: usize,
    /// Runs of one job that may end by a restart of this coordinator before the job fails:
    /// such runs are requeued without counting against the job's `max_retries` (it is not
    /// the job's fault), up to this many.
    pub max_restart_retries: u32,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            listen: "127.0.0.1:7700".into(),
            db_path: PathBuf::from("grandis-coordinator.redb"),
            token: None,
            daemon_token: None,
            daemon_ca: None,
            heartbeat_interval_ms: 1000,
            lease_ms: 3000,
            down_timeout_ms: 10_000,
            forget_after_ms: 3_600_000,
            sse_keepalive_ms: 15_000,
            max_connections: 1024,
            header_read_timeout_ms: 10_000,
            idle_timeout_ms: 60_000,
            max_checkpoint_bytes: 1 << 30,
            keep_finished_checkpoints: 20,
            max_restart_retries: 10,
        }
    }
}

impl CoordinatorConfig {
    /// The merged sources: defaults < `path` (if given; it must exist) < environment.
    pub fn figment(path: Option<&Path>) -> anyhow::Result<Figment> {
        LAYERS.figment::<CoordinatorConfig>(path)
    }

    /// Loads and checks the configuration.
    pub fn load(path: Option<&Path>) -> anyhow::Result<CoordinatorConfig> {
        let config: CoordinatorConfig = LAYERS.extract(path)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks values that types cannot (the token is set, timeouts are ordered).
    pub fn validate(&self) -> anyhow::Result<()> {
        match &self.token {
            None => bail!(
                "token: not set (set `token` in the config file or {ENV_PREFIX}TOKEN); \
                 every API call needs it"
            ),
            Some(t) if t.trim().is_empty() => bail!("token: must not be empty"),
            _ => {}
        }
        if matches!(&self.daemon_token, Some(t) if t.trim().is_empty()) {
            bail!("daemon_token: must not be empty when set");
        }
        if self.heartbeat_interval_ms < 10 {
            bail!(
                "heartbeat_interval_ms: must be ≥ 10, got {}",
                self.heartbeat_interval_ms
            );
        }
        if self.lease_ms <= self.heartbeat_interval_ms {
            bail!(
                "lease_ms: must be greater than heartbeat_interval_ms ({}), got {}",
                self.heartbeat_interval_ms,
                self.lease_ms
            );
        }
        if self.down_timeout_ms < self.lease_ms {
            bail!(
                "down_timeout_ms: must be ≥ lease_ms ({}), got {}",
                self.lease_ms,
                self.down_timeout_ms
            );
        }
        if self.forget_after_ms < self.down_timeout_ms {
            bail!(
                "forget_after_ms: must be ≥ down_timeout_ms ({}), got {}",
                self.down_timeout_ms,
                self.forget_after_ms
            );
        }
        if self.sse_keepalive_ms == 0 {
            bail!("sse_keepalive_ms: must be > 0");
        }
        if self.max_connections < 2 {
            bail!("max_connections: must be ≥ 2, got {}", self.max_connections);
        }
        if self.header_read_timeout_ms == 0 {
            bail!("header_read_timeout_ms: must be > 0");
        }
        if self.idle_timeout_ms <= self.sse_keepalive_ms {
            bail!(
                "idle_timeout_ms: must be greater than sse_keepalive_ms ({}), or event streams \
                 would be cut; got {}",
                self.sse_keepalive_ms,
                self.idle_timeout_ms
            );
        }
        if self.max_checkpoint_bytes == 0 || self.max_checkpoint_bytes > usize::MAX as u64 {
            bail!(
                "max_checkpoint_bytes: must be between 1 and {}, got {}",
                usize::MAX,
                self.max_checkpoint_bytes
            );
        }
        Ok(())
    }

    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }
    pub fn down_timeout(&self) -> Duration {
        Duration::from_millis(self.down_timeout_ms)
    }
    pub fn forget_after(&self) -> Duration {
        Duration::from_millis(self.forget_after_ms)
    }
    /// The HTTP listener's limits.
    pub fn http_limits(&self) -> crate::http::Limits {
        crate::http::Limits {
            max_connections: self.max_connections,
            header_read_timeout: Duration::from_millis(self.header_read_timeout_ms),
            idle_timeout: Duration::from_millis(self.idle_timeout_ms),
        }
    }
}

/// Renders the merged configuration as TOML, each key annotated with the source it came from;
/// tokens are redacted.
pub fn print_config(path: Option<&Path>) -> anyhow::Result<String> {
    let config = CoordinatorConfig::load(path)?;
    LAYERS.render(path, &config)
}
