//! Harness of grandis's end-to-end tests: it starts REAL `grandis coordinator` and `grandis
//! daemon` processes on 127.0.0.1 with ports chosen at run time (the processes bind port 0 and
//! report the bound address through a file) through `grandis-launch`, keeps their logs, and
//! talks to the coordinator's REST API through `grandis-client`. Every wait is bounded and
//! every process is killed when its [`Proc`] is dropped, so a failing test never leaves
//! processes behind or hangs.
//!
//! Where the tests are: `cli/tests/e2e.rs`. Cargo tells a test the path of a binary
//! (`CARGO_BIN_EXE_grandis`) only when the test belongs to the binary's own package, so the
//! tests live in `grandis-cli` and this package (a dev-dependency there) holds what they share.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::bail;
use grandis_client::{Client, JobFormat};
use grandis_coordinator::CoordinatorConfig;
use grandis_daemon::DaemonConfig;
pub use grandis_launch::Proc;
use serde_json::Value;

/// Polls `cond` every 20 ms until it returns `Some`, failing after `timeout` with `what`.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut cond: impl FnMut() -> Option<T>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = cond() {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Timing of a test cluster: short heartbeats so failures are seen in about a second.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub heartbeat_ms: u64,
    pub lease_ms: u64,
    pub down_timeout_ms: u64,
    /// Daemons: QUIC idle timeout (how fast a dead peer is noticed).
    pub peer_timeout_ms: u64,
    /// Daemons: connection set-up bound.
    pub connect_timeout_ms: u64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            heartbeat_ms: 100,
            lease_ms: 600,
            down_timeout_ms: 1200,
            peer_timeout_ms: 3000,
            connect_timeout_ms: 5000,
        }
    }
}

/// A working directory with a cluster CA and the paths of the processes' files.
pub struct Cluster {
    pub exe: PathBuf,
    pub dir: tempfile::TempDir,
    pub token: String,
    pub timing: Timing,
}

impl Cluster {
    /// A fresh directory with certificates for `nodes` under `certs/`.
    pub fn new(exe: &str, nodes: &[&str], timing: Timing) -> anyhow::Result<Cluster> {
        let dir = tempfile::Builder::new().prefix("grandis-e2e-").tempdir()?;
        grandis_quic::init_cluster_with(
            dir.path().join("certs"),
            nodes,
            &grandis_quic::InitOptions {
                include_localhost: true,
                validity_days: 2,
                overwrite: false,
            },
        )?;
        Ok(Cluster {
            exe: PathBuf::from(exe),
            dir,
            token: "e2e-secret-token".into(),
            timing,
        })
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// A synthetic dataset of `nodes` vertices under `name/`.
    pub fn synth(&self, name: &str, nodes: u64, seed: u64) -> anyhow::Result<PathBuf> {
        let out = self.path(name);
        grandis_synth::generate(
            &grandis_synth::SynthConfig {
                name: name.into(),
                nodes,
                seed,
                ..Default::default()
            },
            &out,
            false,
        )?;
        Ok(out)
    }

    /// Starts the coordinator on `listen` (e.g. `127.0.0.1:0`) with the database `db` (kept
    /// across restarts), verifying daemons by the cluster's CA, and returns it with its base
    /// URL.
    pub fn coordinator(&self, listen: &str, db: &str) -> anyhow::Result<(Proc, String)> {
        self.coordinator_verifying(listen, db, true)
    }

    /// [`Cluster::coordinator`]; `verify_daemons` false takes daemons' labels on trust (no
    /// `daemon_ca`), to test what the data plane refuses by itself.
    pub fn coordinator_verifying(
        &self,
        listen: &str,
        db: &str,
        verify_daemons: bool,
    ) -> anyhow::Result<(Proc, String)> {
        let t = self.timing;
        let config = CoordinatorConfig {
            listen: listen.into(),
            db_path: self.path(db),
            daemon_ca: verify_daemons.then(|| self.path("certs/ca.pem")),
            token: Some(self.token.clone()),
            heartbeat_interval_ms: t.heartbeat_ms,
            lease_ms: t.lease_ms,
            down_timeout_ms: t.down_timeout_ms,
            sse_keepalive_ms: 500,
            ..CoordinatorConfig::default()
        };
        // One log per start: a restarted coordinator keeps the first one's log.
        let n = std::fs::read_dir(self.dir.path())?.count();
        let log = self.path(&format!("coordinator-{n}.log"));
        grandis_launch::start_coordinator(&self.exe, &config, self.dir.path(), &log)
    }

    /// Starts a daemon `label` with `devices` devices, certificates from `cert_dir` (relative
    /// to the cluster dir), and waits until it registered. Returns it with its ready JSON.
    pub fn daemon(
        &self,
        url: &str,
        label: &str,
        devices: usize,
        cert_dir: &str,
    ) -> anyhow::Result<(Proc, Value)> {
        let t = self.timing;
        let config = DaemonConfig {
            coordinator: url.into(),
            token: Some(self.token.clone()),
            label: label.into(),
            devices,
            threads: Some(1),
            data_listen: "127.0.0.1:0".into(),
            cert_dir: self.path(cert_dir),
            work_dir: self.dir.path().to_path_buf(),
            metrics_listen: Some("127.0.0.1:0".into()),
            ready_file: Some(self.path(&format!("{label}.ready.json"))),
            connect_timeout_ms: t.connect_timeout_ms,
            peer_timeout_ms: t.peer_timeout_ms,
            recv_timeout_ms: 60_000,
            ..DaemonConfig::default()
        };
        let log = self.path(&format!("{label}.log"));
        let mut p = grandis_launch::start_daemon(&self.exe, &config, self.dir.path(), &log)?;
        let ready = grandis_launch::wait_ready(&mut p, &config)?;
        Ok((p, serde_json::to_value(ready)?))
    }
}

/// A response: status and body (JSON when it parses, else the text as a JSON string).
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
}

/// The coordinator's REST API for tests: raw calls with any token and content type (to check
/// error answers), and typed ones through `grandis-client`.
pub struct Rest {
    client: Client,
}

impl Rest {
    pub fn new(base: &str) -> Rest {
        Rest {
            client: Client::new(base, "", Duration::from_secs(10)).with_token(None),
        }
    }

    fn reply(r: grandis_client::Reply) -> Reply {
        let body = serde_json::from_str(&r.text).unwrap_or(Value::String(r.text));
        Reply {
            status: r.status,
            body,
        }
    }

    /// POST `body` to `path` with `content_type`; `token` None sends no Authorization.
    pub fn post(
        &self,
        path: &str,
        token: Option<&str>,
        content_type: &str,
        body: &str,
    ) -> anyhow::Result<Reply> {
        let r = self
            .client
            .with_token(token)
            .send("POST", path, Some((content_type, body)))?;
        Ok(Self::reply(r))
    }

    pub fn get(&self, path: &str, token: Option<&str>) -> anyhow::Result<Reply> {
        Ok(Self::reply(
            self.client.with_token(token).send("GET", path, None)?,
        ))
    }

    /// Submits a JSON job; the new job's id.
    pub fn submit(&self, token: &str, job: &Value) -> anyhow::Result<u64> {
        let st = self
            .client
            .with_token(Some(token))
            .submit(&job.to_string(), JobFormat::Json)?;
        Ok(st.id)
    }

    /// The job's status JSON.
    pub fn job(&self, token: &str, id: u64) -> anyhow::Result<Value> {
        Ok(serde_json::to_value(
            self.client.with_token(Some(token)).status(id)?,
        )?)
    }

    /// Waits (bounded) until job `id` is in a terminal state; returns its status.
    pub fn wait_end(&self, token: &str, id: u64, timeout: Duration) -> anyhow::Result<Value> {
        wait_for(&format!("job {id} to end"), timeout, || {
            let j = self.job(token, id).ok()?;
            matches!(
                j["state"].as_str(),
                Some("succeeded" | "failed" | "cancelled")
            )
            .then_some(j)
        })
    }
}

/// The last line of `text` that parses as a JSON object.
pub fn last_json_line(text: &str) -> Option<Value> {
    text.lines().rev().find_map(|l| {
        serde_json::from_str::<Value>(l.trim())
            .ok()
            .filter(|v| v.is_object())
    })
}

/// Runs `grandis args...` to completion (bounded by `timeout`, killed after it) and returns
/// (success, stdout, stderr).
pub fn run_grandis(
    exe: &str,
    args: &[&str],
    timeout: Duration,
) -> anyhow::Result<(bool, String, String)> {
    let dir = tempfile::tempdir()?;
    let (out, err) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = Command::new(exe)
        .args(args)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out)?)
        .stderr(std::fs::File::create(&err)?)
        .spawn()?;
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "grandis {args:?} did not finish within {timeout:?}; stderr: {}",
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Ok((
        status.success(),
        std::fs::read_to_string(out)?,
        std::fs::read_to_string(err)?,
    ))
}
