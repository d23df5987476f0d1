//! Coordinator configuration: defaults, then a TOML file, then `GRANDIS_COORDINATOR_*`
//! environment variables (later sources win), merged with figment.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Deserializer, Serialize};

/// Prefix of the environment variables that override the file (`GRANDIS_COORDINATOR_LISTEN`,
/// `GRANDIS_COORDINATOR_TOKEN`, ...: the prefix followed by the key in upper case).
pub const ENV_PREFIX: &str = "GRANDIS_COORDINATOR_";

/// Every key, in the order `print_config` shows them.
pub const KEYS: &[&str] = &[
    "listen",
    "db_path",
    "token",
    "daemon_token",
    "heartbeat_interval_ms",
    "lease_ms",
    "down_timeout_ms",
    "sse_keepalive_ms",
];

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoordinatorConfig {
    /// Address to listen on (`run_blocking` binds it; `serve` takes a bound listener).
    pub listen: String,
    /// The redb database holding jobs, id counters and election terms.
    pub db_path: PathBuf,
    /// Bearer token for the REST API (and for daemons unless `daemon_token` is set). Required.
    #[serde(deserialize_with = "opt_string_lenient")]
    pub token: Option<String>,
    /// Separate bearer token for the daemon protocol; when set, the user token is not accepted
    /// there and this one is not accepted on the user API.
    #[serde(deserialize_with = "opt_string_lenient")]
    pub daemon_token: Option<String>,
    /// How often daemons heartbeat.
    pub heartbeat_interval_ms: u64,
    /// A head that has not heartbeated for this long loses its lease: a new term starts and its
    /// running job fails.
    pub lease_ms: u64,
    /// A daemon that has not heartbeated for this long is reported down.
    pub down_timeout_ms: u64,
    /// Interval of keep-alive comments on server-sent event streams.
    pub sse_keepalive_ms: u64,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            listen: "127.0.0.1:7700".into(),
            db_path: PathBuf::from("grandis-coordinator.redb"),
            token: None,
            daemon_token: None,
            heartbeat_interval_ms: 1000,
            lease_ms: 3000,
            down_timeout_ms: 10_000,
            sse_keepalive_ms: 15_000,
        }
    }
}

/// Tokens made only of digits arrive from the environment as numbers; accept them as text.
fn opt_string_lenient<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Lenient {
        S(String),
        U(u64),
        I(i64),
        F(f64),
    }
    Ok(Option::<Lenient>::deserialize(d)?.map(|v| match v {
        Lenient::S(s) => s,
        Lenient::U(n) => n.to_string(),
        Lenient::I(n) => n.to_string(),
        Lenient::F(n) => n.to_string(),
    }))
}

impl CoordinatorConfig {
    /// The merged sources: defaults < `path` (if given; it must exist) < environment.
    pub fn figment(path: Option<&Path>) -> anyhow::Result<Figment> {
        let mut fig = Figment::from(Serialized::defaults(CoordinatorConfig::default()));
        if let Some(path) = path {
            if !path.is_file() {
                bail!("config file {}: not found", path.display());
            }
            fig = fig.merge(Toml::file_exact(path));
        }
        // Only known keys are taken from the environment, so unrelated GRANDIS_COORDINATOR_*
        // variables cannot break startup; typos in the file are still errors.
        Ok(fig.merge(Env::prefixed(ENV_PREFIX).only(KEYS)))
    }

    /// Loads and checks the configuration.
    pub fn load(path: Option<&Path>) -> anyhow::Result<CoordinatorConfig> {
        let fig = Self::figment(path)?;
        let config: CoordinatorConfig = fig.extract().map_err(|e| {
            anyhow::anyhow!(
                "invalid coordinator configuration{}: {e}",
                path.map(|p| format!(" ({})", p.display()))
                    .unwrap_or_default()
            )
        })?;
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
        if self.sse_keepalive_ms == 0 {
            bail!("sse_keepalive_ms: must be > 0");
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
}

/// Renders the merged configuration as TOML, each key annotated with the source it came from;
/// tokens are redacted.
pub fn print_config(path: Option<&Path>) -> anyhow::Result<String> {
    let fig = CoordinatorConfig::figment(path)?;
    let config = CoordinatorConfig::load(path)?;
    let table = toml::Table::try_from(&config).context("rendering the configuration")?;
    let mut out = String::from(
        "# grandis coordinator configuration: defaults < config file < GRANDIS_COORDINATOR_* \
         environment\n",
    );
    for key in KEYS {
        let value = match (*key, table.get(*key)) {
            ("token" | "daemon_token", Some(_)) => "\"<redacted>\"".to_string(),
            (_, Some(v)) => v.to_string(),
            (_, None) => "# (not set)".to_string(),
        };
        let source = match fig.find_metadata(key) {
            Some(m) if m.name.contains("environment") => {
                format!("environment {ENV_PREFIX}{}", key.to_ascii_uppercase())
            }
            Some(m) => match &m.source {
                Some(figment::Source::File(file)) => format!("config file {}", file.display()),
                _ => "default".to_string(),
            },
            None => "default".to_string(),
        };
        let line = if value.starts_with('#') {
            format!("# {key} {value}")
        } else {
            format!("{key} = {value}")
        };
        out.push_str(&format!("{line:<48} # from {source}\n"));
    }
    Ok(out)
}
