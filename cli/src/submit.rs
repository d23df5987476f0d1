//! `grandis submit`: send a job to the coordinator and, with `--follow`, stream its progress
//! (server-sent events) until it ends. Also the small REST client `grandis cluster up` uses.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use grandis_wire::{EpochProgress, JobState, JobStatus};

#[derive(clap::Args)]
pub struct SubmitArgs {
    /// Coordinator URL, e.g. http://127.0.0.1:7700.
    #[arg(long, env = "GRANDIS_COORDINATOR_URL")]
    pub coordinator: String,
    /// API bearer token (the coordinator's `token`).
    #[arg(long, env = "GRANDIS_TOKEN", hide_env_values = true)]
    pub token: String,
    /// Job file: TOML (`.toml`) or JSON (anything else). See docs/openapi.yaml for the fields.
    #[arg(required_unless_present_any = ["json", "dataset"], conflicts_with_all = ["json", "dataset"])]
    pub jobfile: Option<PathBuf>,
    /// The job as a JSON document on the command line instead of a file.
    #[arg(long, conflicts_with = "dataset")]
    pub json: Option<String>,
    /// The job as flags instead of a document: its dataset directory (a path on every server),
    /// with the job flags below (the flags of `grandis train`; --mode defaults to flx). The
    /// job flags are read only with --dataset.
    #[arg(long)]
    pub dataset: Option<String>,
    #[command(flatten)]
    pub job: crate::job_args::JobArgs,
    /// Stream per-epoch progress until the job ends; exit non-zero unless it succeeded.
    #[arg(long)]
    pub follow: bool,
}

/// A REST client of the coordinator's user API.
pub struct Api {
    agent: ureq::Agent,
    base: String,
    auth: String,
}

impl Api {
    pub fn new(base: &str, token: &str) -> Api {
        Api {
            agent: ureq::AgentBuilder::new()
                .timeout_connect(Duration::from_secs(10))
                .build(),
            base: base.trim_end_matches('/').to_string(),
            auth: format!("Bearer {token}"),
        }
    }

    fn fail(url: &str, e: ureq::Error) -> anyhow::Error {
        match e {
            ureq::Error::Status(code, r) => {
                let text = r.into_string().unwrap_or_default();
                let msg = serde_json::from_str::<serde_json::Value>(&text)
                    .ok()
                    .and_then(|v| v.get("error").and_then(|m| m.as_str()).map(String::from))
                    .unwrap_or(text);
                anyhow::anyhow!("{url}: the coordinator answered {code}: {msg}")
            }
            ureq::Error::Transport(t) => anyhow::anyhow!("cannot reach {url}: {t}"),
        }
    }

    /// POSTs a job document (`toml`: TOML, else JSON) and returns the created job.
    pub fn submit(&self, text: &str, toml: bool) -> anyhow::Result<JobStatus> {
        let url = format!("{}/v1/jobs", self.base);
        let ctype = if toml {
            "application/toml"
        } else {
            "application/json"
        };
        let r = self
            .agent
            .post(&url)
            .timeout(Duration::from_secs(30))
            .set("Authorization", &self.auth)
            .set("Content-Type", ctype)
            .send_string(text)
            .map_err(|e| Self::fail(&url, e))?;
        r.into_json()
            .with_context(|| format!("{url}: malformed reply"))
    }

    pub fn status(&self, id: u64) -> anyhow::Result<JobStatus> {
        let url = format!("{}/v1/jobs/{id}", self.base);
        let r = self
            .agent
            .get(&url)
            .timeout(Duration::from_secs(30))
            .set("Authorization", &self.auth)
            .call()
            .map_err(|e| Self::fail(&url, e))?;
        r.into_json()
            .with_context(|| format!("{url}: malformed reply"))
    }

    /// Streams the job's events, calling `on_progress` for every epoch and `on_state` for
    /// every state change, until the job ends; returns its final status. Reconnects (replaying
    /// from the job's state, which skips epochs already seen) if the stream breaks.
    pub fn follow(
        &self,
        id: u64,
        on_progress: &mut dyn FnMut(&EpochProgress),
        on_state: &mut dyn FnMut(&serde_json::Value),
    ) -> anyhow::Result<JobStatus> {
        let url = format!("{}/v1/jobs/{id}/events", self.base);
        let mut last_epoch = 0u32;
        let mut failures = 0;
        loop {
            let resp = self
                .agent
                .get(&url)
                .set("Authorization", &self.auth)
                .set("Accept", "text/event-stream")
                .call();
            let resp = match resp {
                Ok(r) => r,
                Err(e @ ureq::Error::Status(..)) => return Err(Self::fail(&url, e)),
                Err(e) => {
                    failures += 1;
                    if failures > 20 {
                        return Err(Self::fail(&url, e));
                    }
                    std::thread::sleep(Duration::from_millis(250));
                    continue;
                }
            };
            let reader = BufReader::new(resp.into_reader());
            let (mut event, mut data) = (String::new(), String::new());
            for line in reader.lines() {
                let Ok(line) = line else { break };
                if line.is_empty() {
                    match event.as_str() {
                        "progress" => {
                            if let Ok(p) = serde_json::from_str::<EpochProgress>(&data) {
                                if p.epoch > last_epoch {
                                    last_epoch = p.epoch;
                                    on_progress(&p);
                                }
                            }
                        }
                        "state" => {
                            if let Ok(v) = serde_json::from_str(&data) {
                                on_state(&v);
                            }
                        }
                        "end" => {
                            return serde_json::from_str(&data)
                                .with_context(|| format!("{url}: malformed end event"));
                        }
                        _ => {}
                    }
                    event.clear();
                    data.clear();
                } else if let Some(v) = line.strip_prefix("event:") {
                    event = v.trim().to_string();
                } else if let Some(v) = line.strip_prefix("data:") {
                    if !data.is_empty() {
                        data.push('\n');
                    }
                    data.push_str(v.strip_prefix(' ').unwrap_or(v));
                }
            }
            // The stream ended without an end event (coordinator restart?): ask directly.
            if let Ok(st) = self.status(id) {
                if st.state.is_terminal() {
                    return Ok(st);
                }
            }
            failures += 1;
            if failures > 20 {
                bail!("{url}: the event stream keeps breaking");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

/// One line per epoch, as `grandis train` prints them.
pub fn progress_line(p: &EpochProgress) -> String {
    crate::train::epoch_line(p.epoch as usize, p.loss, p.train_acc, p.val_acc, p.seconds)
}

/// `Err` naming the reason unless the job succeeded.
pub fn require_success(st: &JobStatus) -> anyhow::Result<()> {
    match &st.state {
        JobState::Succeeded => Ok(()),
        JobState::Failed { reason } => bail!("job {} failed: {reason}", st.id),
        other => bail!("job {} ended {}", st.id, other.name()),
    }
}

pub fn run(args: SubmitArgs) -> anyhow::Result<()> {
    let (text, toml) = match (&args.jobfile, &args.json, &args.dataset) {
        (Some(path), None, None) => (
            std::fs::read_to_string(path)
                .with_context(|| format!("reading job file {}", path.display()))?,
            path.extension().is_some_and(|e| e == "toml"),
        ),
        (None, Some(j), None) => (j.clone(), false),
        (None, None, Some(dataset)) => {
            let spec = args.job.spec(dataset.clone(), grandis_wire::Mode::Flx)?;
            crate::job_args::validate_as_flags(&spec)?;
            (serde_json::to_string(&spec)?, false)
        }
        _ => bail!("give one of a JOBFILE, --json or --dataset"),
    };
    let api = Api::new(&args.coordinator, &args.token);
    let st = api.submit(&text, toml)?;
    eprintln!("submitted job {} ({})", st.id, st.state.name());
    if !args.follow {
        println!("{}", serde_json::to_string(&st)?);
        return Ok(());
    }
    let end = api.follow(st.id, &mut |p| println!("{}", progress_line(p)), &mut |s| {
        let state = s.get("state").and_then(|v| v.as_str()).unwrap_or("?");
        eprintln!("job {}: {state}", st.id);
    })?;
    if let Some(sum) = &end.summary {
        eprintln!("{}", serde_json::to_string(sum)?);
    }
    require_success(&end)
}
