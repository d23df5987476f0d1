//! `grandis submit`: send a job to the coordinator and, with `--follow`, stream its progress
//! (server-sent events) until it ends.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use grandis_client::{Client, JobFormat};
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
    /// Write the job's id to this file once the coordinator has accepted it (replacing the
    /// file whole), for scripts that may have to cancel the job later (`grandis cancel`).
    #[arg(long, value_name = "PATH")]
    pub id_file: Option<PathBuf>,
}

/// `grandis cancel`: cancel a job that has not ended.
#[derive(clap::Args)]
pub struct CancelArgs {
    /// Coordinator URL, e.g. http://127.0.0.1:7700.
    #[arg(long, env = "GRANDIS_COORDINATOR_URL")]
    pub coordinator: String,
    /// API bearer token (the coordinator's `token`).
    #[arg(long, env = "GRANDIS_TOKEN", hide_env_values = true)]
    pub token: String,
    /// The job's id (as `grandis submit` printed it).
    pub id: grandis_wire::JobId,
    /// Succeed also when the job has already ended (a script's clean-up that may race the
    /// job's own end); without it, cancelling an ended job is an error.
    #[arg(long)]
    pub if_running: bool,
}

/// How long one connect, read or write to the coordinator may take (above the coordinator's
/// default SSE keep-alive of 15 s, so a quiet event stream is not cut).
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// The coordinator client of `submit` and `cluster up`.
pub fn client(base: &str, token: &str) -> Client {
    Client::new(base, token, HTTP_TIMEOUT)
}

/// One line per epoch, as `grandis train` prints them.
pub fn progress_line(p: &EpochProgress) -> String {
    crate::output::epoch_line(p.epoch as usize, p.loss, p.train_acc, p.val_acc, p.seconds)
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
    let (text, format) = match (&args.jobfile, &args.json, &args.dataset) {
        (Some(path), None, None) => (
            std::fs::read_to_string(path)
                .with_context(|| format!("reading job file {}", path.display()))?,
            if path.extension().is_some_and(|e| e == "toml") {
                JobFormat::Toml
            } else {
                JobFormat::Json
            },
        ),
        (None, Some(j), None) => (j.clone(), JobFormat::Json),
        (None, None, Some(dataset)) => {
            let spec = args.job.spec(dataset.clone(), grandis_wire::Mode::Flx)?;
            crate::job_args::validate_as_flags(&spec)?;
            (serde_json::to_string(&spec)?, JobFormat::Json)
        }
        _ => bail!("give one of a JOBFILE, --json or --dataset"),
    };
    let api = client(&args.coordinator, &args.token);
    let st = api.submit(&text, format)?;
    eprintln!("submitted job {} ({})", st.id, st.state.name());
    if let Some(path) = &args.id_file {
        grandis_store::write_file_atomic(path, format!("{}\n", st.id).as_bytes())
            .with_context(|| format!("writing the job id to {}", path.display()))?;
    }
    if !args.follow {
        println!("{}", serde_json::to_string(&st)?);
        return Ok(());
    }
    let end = api.follow(st.id, &mut |p| println!("{}", progress_line(p)), &mut |s| {
        eprintln!("{}", state_line(st.id, s))
    })?;
    if let Some(sum) = &end.summary {
        eprintln!("{}", serde_json::to_string(sum)?);
    }
    require_success(&end)
}

pub fn cancel(args: CancelArgs) -> anyhow::Result<()> {
    let api = client(&args.coordinator, &args.token);
    match api.cancel(args.id) {
        Ok(st) => {
            eprintln!("job {}: {}", st.id, st.state.name());
            Ok(())
        }
        Err(e) if args.if_running && e.is_code("job_finished") => {
            eprintln!("job {}: already ended", args.id);
            Ok(())
        }
        Err(e) => Err(e).with_context(|| format!("cancelling job {}", args.id)),
    }
}

/// A state event of a followed job as one line: the state, its servers, and for a job that
/// went back to the queue, why and where it resumes.
pub(crate) fn state_line(id: grandis_wire::JobId, s: &serde_json::Value) -> String {
    let state = s.get("state").and_then(|v| v.as_str()).unwrap_or("?");
    let servers = s.get("servers").cloned().unwrap_or_default();
    match (state, s.get("retry")) {
        ("queued", Some(r)) => format!(
            "job {id}: queued again for attempt {} ({}); it resumes {}",
            s["attempt"],
            r["reason"].as_str().unwrap_or("?"),
            match r["resume_epoch"].as_u64() {
                Some(e) => format!("after epoch {e}"),
                None => "from scratch (no checkpoint yet)".into(),
            }
        ),
        (_, _) if servers.as_array().is_some_and(|a| !a.is_empty()) => {
            format!("job {id}: {state} {servers}")
        }
        _ => format!("job {id}: {state}"),
    }
}
