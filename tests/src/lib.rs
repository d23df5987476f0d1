//! Harness of grandis's end-to-end tests: it starts REAL `grandis coordinator` and `grandis
//! daemon` processes on 127.0.0.1 with ports chosen at run time (the processes bind port 0 and
//! report the bound address through a file), writes their configs, keeps their logs, and
//! talks to the coordinator's REST API. Every wait is bounded and every process is killed when
//! its [`Proc`] is dropped, so a failing test never leaves processes behind or hangs.
//!
//! Where the tests are: `cli/tests/e2e.rs`. Cargo tells a test the path of a binary
//! (`CARGO_BIN_EXE_grandis`) only when the test belongs to the binary's own package, so the
//! tests live in `grandis-cli` and this package (a dev-dependency there) holds what they share.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;

/// A child process, killed (SIGKILL) and reaped on drop; its stdout and stderr go to `log`.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `exe args...` with `RUST_LOG=info`, output to `log`.
    pub fn spawn(name: &str, exe: &Path, args: &[&str], log: &Path) -> anyhow::Result<Proc> {
        let file = std::fs::File::create(log)?;
        let child = Command::new(exe)
            .args(args)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {name}: {}", exe.display()))?;
        Ok(Proc {
            name: name.into(),
            child,
            log: log.to_path_buf(),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `kill -9`.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits (bounded) for the exit; SIGKILL if it does not come.
    pub fn terminate(&mut self, grace: Duration) {
        // SAFETY: kill(2) on our own, not yet reaped child.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill9();
    }

    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

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

fn q(s: &str) -> String {
    serde_json::to_string(s).expect("string")
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
    /// across restarts) and returns it with its base URL.
    pub fn coordinator(&self, listen: &str, db: &str) -> anyhow::Result<(Proc, String)> {
        let t = self.timing;
        let cfg = self.path("coordinator.toml");
        std::fs::write(
            &cfg,
            format!(
                "listen = {}\ndb_path = {}\ntoken = {}\nheartbeat_interval_ms = {}\nlease_ms = {}\n\
                 down_timeout_ms = {}\nsse_keepalive_ms = 500\n",
                q(listen),
                q(&self.path(db).display().to_string()),
                q(&self.token),
                t.heartbeat_ms,
                t.lease_ms,
                t.down_timeout_ms
            ),
        )?;
        let addr_file = self.path("coordinator.addr");
        let _ = std::fs::remove_file(&addr_file);
        let n = std::fs::read_dir(self.dir.path())?.count();
        let mut p = Proc::spawn(
            "coordinator",
            &self.exe,
            &[
                "coordinator",
                "--config",
                &cfg.display().to_string(),
                "--addr-file",
                &addr_file.display().to_string(),
            ],
            &self.path(&format!("coordinator-{n}.log")),
        )?;
        let addr = wait_for("the coordinator's address", Duration::from_secs(30), || {
            if p.exited() {
                return Some(Err(anyhow::anyhow!("coordinator exited: {}", p.log_text())));
            }
            std::fs::read_to_string(&addr_file)
                .ok()
                .filter(|s| !s.is_empty())
                .map(Ok)
        })??;
        Ok((p, format!("http://{}", addr.trim())))
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
        let cfg = self.path(&format!("{label}.toml"));
        let ready = self.path(&format!("{label}.ready.json"));
        let _ = std::fs::remove_file(&ready);
        std::fs::write(
            &cfg,
            format!(
                "coordinator = {}\ntoken = {}\nlabel = {}\ndevices = {devices}\nthreads = 1\n\
                 data_listen = \"127.0.0.1:0\"\ncert_dir = {}\nwork_dir = {}\n\
                 metrics_listen = \"127.0.0.1:0\"\nready_file = {}\nconnect_timeout_ms = {}\n\
                 peer_timeout_ms = {}\nrecv_timeout_ms = 60000\n",
                q(url),
                q(&self.token),
                q(label),
                q(&self.path(cert_dir).display().to_string()),
                q(&self.dir.path().display().to_string()),
                q(&ready.display().to_string()),
                t.connect_timeout_ms,
                t.peer_timeout_ms
            ),
        )?;
        let mut p = Proc::spawn(
            label,
            &self.exe,
            &["daemon", "--config", &cfg.display().to_string()],
            &self.path(&format!("{label}.log")),
        )?;
        let r = wait_for(
            &format!("daemon {label} to register"),
            Duration::from_secs(30),
            || {
                if p.exited() {
                    return Some(Err(anyhow::anyhow!(
                        "daemon {label} exited: {}",
                        p.log_text()
                    )));
                }
                std::fs::read_to_string(&ready)
                    .ok()
                    .and_then(|s| serde_json::from_str::<Value>(&s).ok())
                    .map(Ok)
            },
        )??;
        Ok((p, r))
    }
}

/// A response: status and body (JSON when it parses, else the text as a JSON string).
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
}

/// Minimal REST client of the coordinator.
pub struct Rest {
    agent: ureq::Agent,
    pub base: String,
}

impl Rest {
    pub fn new(base: &str) -> Rest {
        Rest {
            agent: ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(10))
                .build(),
            base: base.trim_end_matches('/').into(),
        }
    }

    fn reply(r: Result<ureq::Response, ureq::Error>) -> anyhow::Result<Reply> {
        let r = match r {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => bail!("request failed: {e}"),
        };
        let status = r.status();
        let text = r.into_string()?;
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok(Reply { status, body })
    }

    /// POST `body` to `path` with `content_type`; `token` None sends no Authorization.
    pub fn post(
        &self,
        path: &str,
        token: Option<&str>,
        content_type: &str,
        body: &str,
    ) -> anyhow::Result<Reply> {
        let mut req = self
            .agent
            .post(&format!("{}{path}", self.base))
            .set("Content-Type", content_type);
        if let Some(t) = token {
            req = req.set("Authorization", &format!("Bearer {t}"));
        }
        Self::reply(req.send_string(body))
    }

    pub fn get(&self, path: &str, token: Option<&str>) -> anyhow::Result<Reply> {
        let mut req = self.agent.get(&format!("{}{path}", self.base));
        if let Some(t) = token {
            req = req.set("Authorization", &format!("Bearer {t}"));
        }
        Self::reply(req.call())
    }

    /// Submits a JSON job; the new job's id.
    pub fn submit(&self, token: &str, job: &Value) -> anyhow::Result<u64> {
        let r = self.post(
            "/v1/jobs",
            Some(token),
            "application/json",
            &job.to_string(),
        )?;
        if r.status != 201 {
            bail!("submit answered {}: {}", r.status, r.body);
        }
        r.body["id"].as_u64().context("job id")
    }

    /// The job's status JSON.
    pub fn job(&self, token: &str, id: u64) -> anyhow::Result<Value> {
        let r = self.get(&format!("/v1/jobs/{id}"), Some(token))?;
        if r.status != 200 {
            bail!("GET job {id} answered {}: {}", r.status, r.body);
        }
        Ok(r.body)
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
