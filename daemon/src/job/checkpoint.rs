//! A job's checkpoint between this server and the coordinator. The coordinator keeps the
//! latest checkpoint of every job, so a retry resumes on whichever servers it gets: before a
//! run, [`prepare`] puts the checkpoint the assignment names (or nothing) at the job's local
//! path on every server; during a run, the leader hands each checkpoint it writes to the
//! reporter thread, which [`upload`]s the newest one.

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context};
use grandis_client::{CallError, Client};
use grandis_wire::{Assignment, JobId};

use super::JobContext;
use crate::config::DaemonConfig;

/// The most a download reads: the coordinator's `max_checkpoint_bytes` bounds what it holds;
/// this only keeps a confused reply from filling the disk.
const MAX_DOWNLOAD_BYTES: u64 = 1 << 36;

/// The coordinator could not be reached for the checkpoint: a cluster problem (retryable),
/// unlike a checkpoint that is missing or wrong.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Unreachable(String);

/// Makes `path` hold what the run resumes from: the coordinator's checkpoint of the epoch the
/// assignment names, or no file at all (a first run, or a retry with no checkpoint yet).
pub(super) fn prepare(ctx: &JobContext, a: &Assignment, path: &Path) -> anyhow::Result<()> {
    let Some(epoch) = a.resume_epoch else {
        match std::fs::remove_file(path) {
            Ok(()) => tracing::info!(
                "removed the checkpoint {} left by an earlier run: this run starts from scratch",
                path.display()
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("removing stale checkpoint {}", path.display()))
            }
        }
        return Ok(());
    };
    let mut tries = 0;
    let (got, bytes) = loop {
        match ctx.client.checkpoint(a.job_id, true, MAX_DOWNLOAD_BYTES) {
            Ok(ok) => break ok,
            Err(CallError::Transport(e)) if tries < 4 => {
                tracing::warn!("fetching the job's checkpoint: {e}; retrying");
                tries += 1;
                std::thread::sleep(Duration::from_millis(250 << tries));
            }
            Err(e @ CallError::Transport(_)) => {
                return Err(Unreachable(format!("fetching the job's checkpoint: {e}")).into())
            }
            Err(e) => return Err(e).context("fetching the job's checkpoint to resume from"),
        }
    };
    // The leader of this run cannot write a newer one before every server has connected,
    // which each does only after this: a mismatch means something else went wrong.
    if got != epoch {
        bail!(
            "the coordinator's checkpoint of job {} is from epoch {got}, the assignment resumes \
             after epoch {epoch}",
            a.job_id
        );
    }
    grandis_store::write_file_atomic(path, &bytes)
        .with_context(|| format!("writing the job's checkpoint to {}", path.display()))?;
    tracing::info!(
        epoch,
        bytes = bytes.len(),
        "fetched the job's checkpoint from the coordinator; resuming after epoch {epoch}"
    );
    Ok(())
}

/// The newest checkpoint waiting for upload: the job thread puts, the reporter takes. A
/// slow coordinator thus holds back at most one copy, never a queue of them.
#[derive(Default)]
pub(super) struct Latest(Mutex<Option<(u32, Vec<u8>)>>);

impl Latest {
    pub(super) fn put(&self, epoch: u32, bytes: Vec<u8>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some((epoch, bytes));
    }

    fn take(&self) -> Option<(u32, Vec<u8>)> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Uploads the newest waiting checkpoint (none: a newer one already went), through
/// [`deliver`](super::deliver). A refusal is logged: the job goes on, and a retry would resume
/// from the last checkpoint the coordinator took.
pub(super) fn upload(client: &Client, daemon_id: u64, job: JobId, attempt: u32, latest: &Latest) {
    let Some((epoch, bytes)) = latest.take() else {
        return;
    };
    super::deliver(job, &format!("checkpoint of epoch {epoch}"), || {
        client.put_checkpoint(daemon_id, job, attempt, epoch, &bytes)
    });
    tracing::debug!(
        job,
        epoch,
        bytes = bytes.len(),
        "checkpoint handed to the coordinator"
    );
}

/// Deletes this daemon's checkpoint copies (`work_dir/jobs/ID/LABEL.checkpoint.safetensors`)
/// but those of the newest `keep` jobs by id; the jobs' reports stay. Best effort: what cannot
/// be listed or deleted is logged, and the next job's end tries again.
pub(super) fn prune(cfg: &DaemonConfig, keep: usize) {
    let jobs = cfg.work_dir.join("jobs");
    let Ok(entries) = std::fs::read_dir(&jobs) else {
        return;
    };
    let name = format!("{}.checkpoint.safetensors", cfg.label);
    let mut copies: Vec<(u64, std::path::PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let id = e.file_name().to_str()?.parse::<u64>().ok()?;
            let path = e.path().join(&name);
            path.is_file().then_some((id, path))
        })
        .collect();
    copies.sort_unstable_by_key(|&(id, _)| std::cmp::Reverse(id));
    for (id, path) in copies.into_iter().skip(keep) {
        match std::fs::remove_file(&path) {
            Ok(()) => tracing::info!(
                job = id,
                "deleted the checkpoint copy {} (keep_checkpoints = {keep})",
                path.display()
            ),
            Err(e) => tracing::warn!("cannot delete the checkpoint copy {}: {e}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the newest `keep` jobs' checkpoint copies stay; reports and other servers' files
    /// are left alone.
    #[test]
    fn old_checkpoint_copies_are_pruned() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = DaemonConfig {
            label: "node-a".into(),
            work_dir: dir.path().to_path_buf(),
            ..DaemonConfig::default()
        };
        let file = |id: u64, name: &str| dir.path().join("jobs").join(id.to_string()).join(name);
        for id in [1u64, 2, 3, 10] {
            std::fs::create_dir_all(file(id, "")).unwrap();
            for name in [
                "node-a.checkpoint.safetensors",
                "node-a.json",
                "node-b.checkpoint.safetensors",
            ] {
                std::fs::write(file(id, name), b"x").unwrap();
            }
        }
        prune(&cfg, 2);
        for id in [1u64, 2, 3, 10] {
            assert_eq!(
                file(id, "node-a.checkpoint.safetensors").exists(),
                id >= 3,
                "job {id}"
            );
            assert!(file(id, "node-a.json").exists());
            assert!(file(id, "node-b.checkpoint.safetensors").exists());
        }
        prune(&cfg, 0);
        assert!(!file(10, "node-a.checkpoint.safetensors").exists());
    }
}
