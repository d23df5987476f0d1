//! The one local-cluster launcher: starts `grandis coordinator` and `grandis daemon` processes
//! on this machine from their typed configs ([`CoordinatorConfig`], [`DaemonConfig`], written
//! as TOML next to their logs), waits until they are up (the coordinator writes its bound
//! address to a file, a daemon its [`Ready`] file once registered), and stops them again.
//! `grandis cluster up` and the end-to-end tests both launch through it.
//!
//! No process outlives its launcher: a [`Proc`] is killed and reaped when dropped, and every
//! child gets [`PARENT_ENV`] so that it exits by itself ([`exit_with_parent`]) when the
//! launching process disappears without dropping it (killed with SIGKILL). Every wait is
//! bounded and fails early, with the log, when the process exits.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use grandis_coordinator::CoordinatorConfig;
use grandis_daemon::{DaemonConfig, Ready};

/// Environment variable telling a child process to exit when its parent (this pid) is gone.
pub const PARENT_ENV: &str = "GRANDIS_EXIT_WITH_PARENT";

/// How long a coordinator or daemon may take to come up.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Called by `grandis coordinator` / `grandis daemon`: when started by a launcher, exit as
/// soon as the parent process is gone, so a killed launcher leaves no processes behind.
pub fn exit_with_parent() {
    #[cfg(unix)]
    if let Some(pid) = std::env::var(PARENT_ENV)
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
    {
        let _ = std::thread::Builder::new()
            .name("grandis-parent-watch".into())
            .spawn(move || loop {
                if std::os::unix::process::parent_id() != pid {
                    eprintln!("parent process {pid} is gone; exiting");
                    std::process::exit(1);
                }
                std::thread::sleep(Duration::from_millis(200));
            });
    }
}

/// A child process whose stdout and stderr go to `log`; killed (SIGKILL) and reaped on drop.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `exe args...` in its own process group (a terminal's Ctrl-C reaches only the
    /// launcher, which then stops its children in order), with `RUST_LOG` (default `info`)
    /// and [`PARENT_ENV`] set, output to `log`.
    pub fn spawn(name: &str, exe: &Path, args: &[&str], log: &Path) -> anyhow::Result<Proc> {
        let file = std::fs::File::create(log)
            .with_context(|| format!("creating log file {}", log.display()))?;
        let mut cmd = Command::new(exe);
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd
            .args(args)
            .env(PARENT_ENV, std::process::id().to_string())
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {name} ({})", exe.display()))?;
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

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// An error naming the process if it has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Ok(Some(status)) = self.child.try_wait() {
            bail!(
                "{} exited early ({status}); its log {}",
                self.name,
                self.log.display()
            );
        }
        Ok(())
    }

    /// `kill -9` and reap.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM (the coordinator closes its database, a daemon cancels its job), then waits
    /// up to `grace` for the exit; SIGKILL if it does not come.
    pub fn terminate(&mut self, grace: Duration) {
        stop_all(std::slice::from_mut(self), grace);
    }

    fn signal_term(&mut self) {
        #[cfg(unix)]
        {
            // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped).
            let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
            if rc == 0 {
                return;
            }
        }
        let _ = self.child.kill();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Stops `procs` together: SIGTERM to all, then waits up to `grace` for every exit and kills
/// what is left.
pub fn stop_all(procs: &mut [Proc], grace: Duration) {
    for p in procs.iter_mut() {
        p.signal_term();
    }
    let deadline = Instant::now() + grace;
    for p in procs.iter_mut() {
        loop {
            match p.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Ok(None) => {
                    tracing::warn!("{} did not stop within {grace:?}; killing it", p.name);
                    p.kill9();
                    break;
                }
            }
        }
    }
}

/// Waits until `path` holds non-blank text (written atomically by `proc`), failing when
/// `proc` exits or after `timeout`.
pub fn wait_file(path: &Path, proc: &mut Proc, timeout: Duration) -> anyhow::Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(t) = std::fs::read_to_string(path) {
            if !t.trim().is_empty() {
                return Ok(t);
            }
        }
        if proc.exited() {
            bail!(
                "{} exited before writing {}: {}",
                proc.name,
                path.display(),
                proc.log_text().trim_end()
            );
        }
        if Instant::now() > deadline {
            bail!(
                "{} did not start within {timeout:?} (no {}); its log {}",
                proc.name,
                path.display(),
                proc.log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes a config as TOML.
fn write_toml(path: &Path, config: &impl serde::Serialize) -> anyhow::Result<()> {
    let text = toml::to_string(config).context("encoding a config as TOML")?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Starts a coordinator of `config` (listening where it says, port 0 for any) with its
/// config file `dir/<name>.toml` and log `log`, and waits until it listens. Returns it with
/// its base URL.
pub fn start_coordinator(
    exe: &Path,
    config: &CoordinatorConfig,
    dir: &Path,
    log: &Path,
) -> anyhow::Result<(Proc, String)> {
    let cfg = dir.join("coordinator.toml");
    write_toml(&cfg, config)?;
    let addr_file = dir.join("coordinator.addr");
    let _ = std::fs::remove_file(&addr_file);
    let mut p = Proc::spawn(
        "coordinator",
        exe,
        &[
            "coordinator",
            "--config",
            &cfg.display().to_string(),
            "--addr-file",
            &addr_file.display().to_string(),
        ],
        log,
    )?;
    let addr = wait_file(&addr_file, &mut p, START_TIMEOUT)?;
    Ok((p, format!("http://{}", addr.trim())))
}

/// Where a launched daemon says it registered: its `ready_file`, which it must have.
fn ready_file(config: &DaemonConfig) -> anyhow::Result<&Path> {
    config
        .ready_file
        .as_deref()
        .context("a launched daemon needs a ready_file")
}

/// Starts a daemon of `config` (which must name a `ready_file`) with its config file
/// `dir/<label>.toml` and log `log`; [`wait_ready`] then waits for its registration, so many
/// daemons can come up together.
pub fn start_daemon(
    exe: &Path,
    config: &DaemonConfig,
    dir: &Path,
    log: &Path,
) -> anyhow::Result<Proc> {
    let _ = std::fs::remove_file(ready_file(config)?);
    let cfg = dir.join(format!("{}.toml", config.label));
    write_toml(&cfg, config)?;
    Proc::spawn(
        &format!("daemon {}", config.label),
        exe,
        &["daemon", "--config", &cfg.display().to_string()],
        log,
    )
}

/// Waits until the daemon `proc` of `config` registered; its [`Ready`] file.
pub fn wait_ready(proc: &mut Proc, config: &DaemonConfig) -> anyhow::Result<Ready> {
    let path = ready_file(config)?;
    let text = wait_file(path, proc, START_TIMEOUT)?;
    serde_json::from_str(&text).with_context(|| format!("malformed ready file {}", path.display()))
}
