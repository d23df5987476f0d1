//! Daemon configuration: defaults, then a TOML file, then `GRANDIS_DAEMON_*` environment
//! variables (later sources win), merged with figment.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use figment::Figment;
use grandis_config::Layers;
use serde::{Deserialize, Serialize};

/// Prefix of the environment variables that override the file (`GRANDIS_DAEMON_LABEL`,
/// `GRANDIS_DAEMON_TOKEN`, ...: the prefix followed by the key in upper case).
pub const ENV_PREFIX: &str = "GRANDIS_DAEMON_";

/// Every key, in the order `print_config` shows them.
pub const KEYS: &[&str] = &[
    "coordinator",
    "token",
    "label",
    "devices",
    "device",
    "cuda_devices",
    "memory_bytes",
    "device_memory",
    "threads",
    "data_listen",
    "data_advertise",
    "cert_dir",
    "work_dir",
    "metrics_listen",
    "ready_file",
    "http_timeout_ms",
    "connect_timeout_ms",
    "peer_timeout_ms",
    "recv_timeout_ms",
    "keep_checkpoints",
];

const LAYERS: Layers = Layers {
    service: "daemon",
    env_prefix: ENV_PREFIX,
    keys: KEYS,
    secrets: &["token"],
};

/// Everything a daemon needs. See `docs/daemon.md` for an annotated example.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DaemonConfig {
    /// Base URL of the coordinator (`http://host:port`). Required.
    pub coordinator: String,
    /// Bearer token of the daemon protocol (the coordinator's `daemon_token`, or its `token`).
    /// Required.
    #[serde(deserialize_with = "grandis_config::opt_string_lenient")]
    pub token: Option<String>,
    /// This server's name: daemons with the same label are the same server. It is also the
    /// node name of the data-plane certificate (`<cert_dir>/<label>.pem`), so it must be a DNS
    /// name (letters, digits, `-`, `.`). Required.
    pub label: String,
    /// Device workers this server offers.
    pub devices: usize,
    /// Where the device workers compute: `cpu` (each a group of worker threads), `cuda`
    /// (device worker d on GPU d, or on the d-th of `cuda_devices`) or `cuda:N` (all on GPU
    /// N, each on its own stream). CUDA needs a build with `--features cuda`; without
    /// `device_memory` a CUDA worker's budget comes from its GPU's free memory.
    pub device: String,
    /// With `device = "cuda"`: the GPU ordinals of the device workers, e.g. `[0, 1, 2, 3]`
    /// (cycled when there are more workers than ordinals).
    pub cuda_devices: Option<Vec<usize>>,
    /// Host memory in bytes reported to the coordinator; absent = `MemTotal` of /proc/meminfo.
    pub memory_bytes: Option<u64>,
    /// Per-device memory budget (bytes) for choosing the preloaded hops when a job sets
    /// neither `preload_hops` nor `device_memory`; absent = available memory / devices. Every
    /// server of a job must arrive at the same k: on mixed hardware set it in the job.
    pub device_memory: Option<u64>,
    /// Compute threads shared by the device workers; absent = all cores.
    pub threads: Option<usize>,
    /// UDP address of the QUIC data plane. Port 0 picks a free port at start-up (it is kept
    /// reserved between jobs).
    pub data_listen: String,
    /// `host:port` other daemons dial; absent = `data_listen` with the bound port (which must
    /// then not be an unspecified address such as 0.0.0.0).
    pub data_advertise: Option<String>,
    /// Directory with `ca.pem`, `<label>.pem` and `<label>.key` (`grandis certs init`).
    /// Required.
    pub cert_dir: PathBuf,
    /// Where per-job reports (`<work_dir>/jobs/<job id>/<label>.json`) and checkpoints
    /// (`<label>.checkpoint.safetensors` beside them) are written.
    pub work_dir: PathBuf,
    /// `host:port` of the Prometheus metrics endpoint (`GET /metrics`); absent = off.
    pub metrics_listen: Option<String>,
    /// Written (atomically) once registered: JSON with the daemon id and the bound data-plane
    /// and metrics addresses, for orchestration (`grandis cluster up` waits for it).
    pub ready_file: Option<PathBuf>,
    /// Timeout of each request to the coordinator.
    pub http_timeout_ms: u64,
    /// How long a job may take to connect to the other servers of the job.
    pub connect_timeout_ms: u64,
    /// A data-plane connection silent for this long (keep-alives included) is lost: the bound
    /// on noticing a peer server that died.
    pub peer_timeout_ms: u64,
    /// How long a device worker waits for one message before failing the job.
    pub recv_timeout_ms: u64,
    /// Checkpoint copies kept in `work_dir`: those of the newest this many jobs (by id) this
    /// daemon ran; older ones are deleted when a job ends (reports stay). A retry fetches its
    /// checkpoint from the coordinator, so these copies are for users only; 0 deletes each
    /// job's copy when it ends.
    pub keep_checkpoints: usize,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            coordinator: "http://127.0.0.1:7700".into(),
            token: None,
            label: String::new(),
            devices: 1,
            device: "cpu".into(),
            cuda_devices: None,
            memory_bytes: None,
            device_memory: None,
            threads: None,
            data_listen: "127.0.0.1:7701".into(),
            data_advertise: None,
            cert_dir: PathBuf::from("certs"),
            work_dir: PathBuf::from("grandis-work"),
            metrics_listen: None,
            ready_file: None,
            http_timeout_ms: 5_000,
            connect_timeout_ms: 30_000,
            peer_timeout_ms: 10_000,
            recv_timeout_ms: 300_000,
            keep_checkpoints: 5,
        }
    }
}

impl DaemonConfig {
    /// The merged sources: defaults < `path` (if given; it must exist) < environment.
    pub fn figment(path: Option<&Path>) -> anyhow::Result<Figment> {
        LAYERS.figment::<DaemonConfig>(path)
    }

    /// Loads and checks the configuration.
    pub fn load(path: Option<&Path>) -> anyhow::Result<DaemonConfig> {
        let config: DaemonConfig = LAYERS.extract(path)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what types cannot; every message names its key.
    pub fn validate(&self) -> anyhow::Result<()> {
        let url = self.coordinator.trim();
        if !url.starts_with("http://") {
            bail!(
                "coordinator: expected an http:// URL of the coordinator, got {:?} (the daemon \
                 speaks plain HTTP; terminate TLS in front of the coordinator if needed)",
                self.coordinator
            );
        }
        match &self.token {
            None => bail!("token: not set (set `token` in the config file or {ENV_PREFIX}TOKEN)"),
            Some(t) if t.trim().is_empty() => bail!("token: must not be empty"),
            _ => {}
        }
        if self.label.trim().is_empty() {
            bail!("label: not set (the server's name, e.g. label = \"node-a\")");
        }
        grandis_quic::certs::validate_node_name(&self.label).map_err(|e| {
            anyhow::anyhow!("label: {e} (the label is the certificate's node name)")
        })?;
        if self.devices == 0 || self.devices > 256 {
            bail!("devices: must be between 1 and 256, got {}", self.devices);
        }
        let compute = self.compute()?;
        if compute.is_cuda() && !grandis_parallel::CUDA_BUILT {
            bail!(
                "device: {:?} needs a grandis built with `--features cuda` (this one is not)",
                self.device
            );
        }
        if self.threads == Some(0) {
            bail!("threads: must be ≥ 1 when set");
        }
        if self.device_memory == Some(0) {
            bail!("device_memory: must be > 0 when set");
        }
        self.data_listen_addr()?;
        if let Some(a) = &self.data_advertise {
            resolve(a).with_context(|| format!("data_advertise: {a:?}"))?;
        }
        if let Some(m) = &self.metrics_listen {
            resolve(m).with_context(|| format!("metrics_listen: {m:?}"))?;
        }
        for (key, v) in [
            ("http_timeout_ms", self.http_timeout_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("peer_timeout_ms", self.peer_timeout_ms),
            ("recv_timeout_ms", self.recv_timeout_ms),
        ] {
            if v < 10 {
                bail!("{key}: must be ≥ 10 ms, got {v}");
            }
        }
        Ok(())
    }

    /// Where the device workers compute (`device` refined by `cuda_devices`).
    pub fn compute(&self) -> anyhow::Result<grandis_parallel::Compute> {
        grandis_parallel::Compute::parse(&self.device)
            .and_then(|c| c.with_ordinals(self.cuda_devices.as_deref()))
            .with_context(|| {
                format!(
                    "device: {:?} with cuda_devices {:?}",
                    self.device, self.cuda_devices
                )
            })
    }

    /// `data_listen` resolved.
    pub fn data_listen_addr(&self) -> anyhow::Result<SocketAddr> {
        resolve(&self.data_listen).with_context(|| format!("data_listen: {:?}", self.data_listen))
    }

    pub fn token(&self) -> &str {
        self.token.as_deref().unwrap_or_default()
    }

    pub fn http_timeout(&self) -> Duration {
        Duration::from_millis(self.http_timeout_ms)
    }
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    pub fn peer_timeout(&self) -> Duration {
        Duration::from_millis(self.peer_timeout_ms)
    }
    pub fn recv_timeout(&self) -> Duration {
        Duration::from_millis(self.recv_timeout_ms)
    }
}

/// Resolves `host:port` to its first address.
pub fn resolve(addr: &str) -> anyhow::Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_context(|| format!("cannot resolve {addr:?} (expected host:port)"))?
        .next()
        .with_context(|| format!("{addr:?} resolves to no address"))
}

/// Renders the merged configuration as TOML, each key annotated with the source it came from;
/// the token is redacted.
pub fn print_config(path: Option<&Path>) -> anyhow::Result<String> {
    let config = DaemonConfig::load(path)?;
    LAYERS.render(path, &config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, text: &str) -> PathBuf {
        let p = dir.join("daemon.toml");
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API returns figment::Error.
    fn file_then_environment_and_errors_name_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            dir.path(),
            "coordinator = \"http://127.0.0.1:9\"\ntoken = \"t\"\nlabel = \"node-a\"\ndevices = 2\n",
        );
        figment::Jail::expect_with(|jail| {
            jail.set_env("GRANDIS_DAEMON_DEVICES", "3");
            jail.set_env("GRANDIS_DAEMON_UNRELATED", "x");
            let c = DaemonConfig::load(Some(&p)).unwrap();
            assert_eq!((c.devices, c.label.as_str()), (3, "node-a"));
            let text = print_config(Some(&p)).unwrap();
            assert!(
                text.contains("environment GRANDIS_DAEMON_DEVICES"),
                "{text}"
            );
            assert!(text.contains("\"<redacted>\""), "{text}");
            assert!(!text.contains("token = \"t\""), "{text}");
            Ok(())
        });
        let bad = write(dir.path(), "token = \"t\"\nlabel = \"a b\"\n");
        let e = DaemonConfig::load(Some(&bad)).unwrap_err().to_string();
        assert!(e.starts_with("label:"), "{e}");
        let typo = write(dir.path(), "token = \"t\"\nlabel = \"a\"\ndevicez = 1\n");
        let e = DaemonConfig::load(Some(&typo)).unwrap_err().to_string();
        assert!(e.contains("devicez"), "{e}");
        let no_token = write(dir.path(), "label = \"a\"\n");
        let e = DaemonConfig::load(Some(&no_token)).unwrap_err().to_string();
        assert!(e.starts_with("token:"), "{e}");
        let e = DaemonConfig::load(Some(&dir.path().join("nope.toml")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not found"), "{e}");
    }

    #[test]
    fn device_key_names_where_workers_compute() {
        let dir = tempfile::tempdir().unwrap();
        let base = "token = \"t\"\nlabel = \"a\"\ndevices = 2\n";
        let load = |extra: &str| {
            DaemonConfig::load(Some(&write(dir.path(), &format!("{base}{extra}"))))
                .map_err(|e| format!("{e:#}"))
        };
        let c = load("").unwrap();
        assert_eq!(c.compute().unwrap(), grandis_parallel::Compute::Cpu);
        let e = load("device = \"gpu\"\n").unwrap_err();
        assert!(
            e.starts_with("device:") && e.contains("expected cpu, cuda"),
            "{e}"
        );
        let e = load("cuda_devices = [0, 1]\n").unwrap_err();
        assert!(
            e.starts_with("device:") && e.contains("needs device cuda"),
            "{e}"
        );
        let cuda = load("device = \"cuda\"\ncuda_devices = [1, 0]\n");
        if grandis_parallel::CUDA_BUILT {
            let c = cuda.unwrap();
            assert_eq!(
                c.compute().unwrap(),
                grandis_parallel::Compute::Cuda {
                    ordinals: Some(vec![1, 0])
                }
            );
        } else {
            let e = cuda.unwrap_err();
            assert!(e.contains("built with `--features cuda`"), "{e}");
        }
    }
}
