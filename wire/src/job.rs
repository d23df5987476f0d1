//! Job states and progress as the coordinator stores and reports them.
//!
//! ```text
//! queued ──► assigned ──► running ──► succeeded
//!  ▲ │           │           ├──────► failed(reason)
//!  │ └───────────┴───────────┴──────► cancelled          (and assigned ──► failed)
//!  └─────────────┴───────────┘  a server (or the coordinator) lost, retries left:
//!                               back to the queue, to resume from the last checkpoint
//! ```

use serde::{Deserialize, Serialize};

use crate::links::LinkBytes;
use crate::spec::JobSpec;
use crate::summary::RunSummary;

/// Job identifier: assigned by the coordinator, increasing, never reused (it survives restarts).
pub type JobId = u64;

/// Where a job is in its life. Serialised with a `state` tag (`{"state": "failed",
/// "reason": "..."}`), so it can be flattened into a larger object.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum JobState {
    /// Waiting for enough free servers.
    Queued,
    /// Servers chosen and told (through heartbeat replies); no daemon has started it yet.
    Assigned,
    /// At least one server reported that it started.
    Running,
    Succeeded,
    Failed {
        reason: String,
    },
    Cancelled,
}

impl JobState {
    pub fn name(&self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Assigned => "assigned",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed { .. } => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    /// Every state name, in life order (for metrics that list all states).
    pub const NAMES: [&'static str; 6] = [
        "queued",
        "assigned",
        "running",
        "succeeded",
        "failed",
        "cancelled",
    ];

    /// Succeeded, failed or cancelled: nothing changes any more.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed { .. } | JobState::Cancelled
        )
    }

    /// Assigned or running: servers are busy with it.
    pub fn is_active(&self) -> bool {
        matches!(self, JobState::Assigned | JobState::Running)
    }
}

/// One finished epoch, reported by the job's leader (server index 0) with cluster-wide
/// figures (loss after all-reduce, bytes summed over every device of every server).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochProgress {
    /// 1-based epoch number.
    pub epoch: u32,
    pub loss: f64,
    /// Absent (NaN) after an epoch that was not evaluated.
    #[serde(with = "crate::nan")]
    pub train_acc: f64,
    #[serde(with = "crate::nan")]
    pub val_acc: f64,
    /// Wall-clock seconds of this epoch.
    pub seconds: f64,
    /// Bytes moved during this epoch.
    #[serde(default)]
    pub bytes: LinkBytes,
}

/// One time a job went back to the queue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRetry {
    /// Unix time in milliseconds.
    pub at_ms: u64,
    /// What ended the run (e.g. "server 'node-b' stopped heartbeating").
    pub reason: String,
    /// The checkpoint's epoch the next run resumes after (`None`: from scratch).
    pub resume_epoch: Option<u32>,
    /// The run ended because the coordinator restarted, not because of the job or its
    /// servers: not counted against the job's `max_retries` (the coordinator bounds these
    /// separately, `max_restart_retries`).
    #[serde(default)]
    pub restart: bool,
    /// The servers (labels, by server index) of the run that ended.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub servers: Vec<String>,
}

impl JobRetry {
    /// Retries of `retries` that count against a job's `max_retries`.
    pub fn charged(retries: &[JobRetry]) -> u32 {
        retries.iter().filter(|r| !r.restart).count() as u32
    }
}

/// A job as `GET /v1/jobs/{id}` reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobStatus {
    pub id: JobId,
    pub name: String,
    #[serde(flatten)]
    pub state: JobState,
    pub spec: JobSpec,
    /// Unix time in milliseconds.
    pub submitted_at_ms: u64,
    /// When a server first started it (a retry keeps the first start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    /// Labels of the servers the job runs on, in server-index order (empty while queued).
    #[serde(default)]
    pub servers: Vec<String>,
    /// Why a queued job is still waiting (e.g. "needs 2 servers, 1 free").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<String>,
    /// Last reported epoch (absent before the first one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latest: Option<EpochProgress>,
    /// Bytes per link class summed over all reported epochs.
    #[serde(default)]
    pub bytes_total: LinkBytes,
    /// Every reported epoch (omitted in listings).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<EpochProgress>,
    /// Final summary from the leader, once succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<RunSummary>,
    /// Which run this is: 1, plus one per retry.
    #[serde(default = "one")]
    pub attempt: u32,
    /// Every time the job went back to the queue, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub retries: Vec<JobRetry>,
    /// Epoch of the latest checkpoint the coordinator holds for the job (its file is at
    /// `GET /v1/jobs/{id}/checkpoint`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_epoch: Option<u32>,
}

fn one() -> u32 {
    1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_is_flattened_with_its_reason() {
        let st = JobStatus {
            id: 7,
            name: "x".into(),
            state: JobState::Failed {
                reason: "server 'b' stopped heartbeating".into(),
            },
            spec: JobSpec {
                dataset: "d".into(),
                ..JobSpec::default()
            },
            submitted_at_ms: 1,
            started_at_ms: None,
            finished_at_ms: Some(2),
            servers: vec!["a".into(), "b".into()],
            waiting_for: None,
            latest: None,
            bytes_total: LinkBytes::default(),
            history: vec![],
            attempt: 1,
            retries: vec![],
            checkpoint_epoch: None,
            summary: None,
        };
        let v = serde_json::to_value(&st).unwrap();
        assert_eq!(v["state"], "failed");
        assert_eq!(v["reason"], "server 'b' stopped heartbeating");
        assert_eq!(serde_json::from_value::<JobStatus>(v).unwrap(), st);
        assert!(JobState::Cancelled.is_terminal() && !JobState::Running.is_terminal());
    }
}
