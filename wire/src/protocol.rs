//! The daemon ↔ coordinator control protocol: JSON over HTTP on the coordinator's REST server,
//! authenticated with a bearer token like every other API call.
//!
//! 1. `POST /v1/daemon/challenge` → [`ChallengeResponse`], then `POST /v1/daemon/register`
//!    with [`RegisterRequest`] → [`RegisterResponse`]: the daemon proves its label with its node
//!    certificate ([`NodeProof`] over the challenge) and gets its id, a session credential
//!    that every later call carries ([`DAEMON_SESSION_HEADER`]), the heartbeat interval and the
//!    lease length. A coordinator without the cluster CA (`daemon_ca`) takes labels on trust
//!    and issues no session.
//! 2. `POST /v1/daemon/heartbeat` with [`HeartbeatRequest`] every interval →
//!    [`HeartbeatResponse`]: the current term of the daemon's label, whether it is the label's
//!    head (and who is), an [`Assignment`] if a job is waiting for it, and jobs to cancel.
//!    A head keeps its lease only by heartbeating; when it misses the lease, the coordinator
//!    starts a new term and elects the lowest-id live daemon of the label. Assignments are
//!    repeated in every reply until the job ends, so a lost reply costs one interval; daemons
//!    must treat an assignment for the job they already run as a no-op. An unknown daemon id
//!    (e.g. after a coordinator restart) is answered 404 `unknown_daemon`: register again.
//! 3. `POST /v1/daemon/jobs/{id}/events` with [`JobEventRequest`]: started, per-epoch progress
//!    (leader only), finished with a summary, or failed with a reason.
//! 4. `PUT /v1/daemon/jobs/{id}/checkpoint?daemon_id=D&attempt=A&epoch=E` with the bytes of a
//!    checkpoint file (leader only, after every checkpoint it writes); `GET` of the same path
//!    returns the job's latest one, with its epoch in the [`CHECKPOINT_EPOCH_HEADER`] header.
//!    The coordinator keeps it with the job, so a retry resumes from it on any servers.
//!
//! Every request carries [`PROTOCOL_VERSION`]; a mismatch is rejected with 400
//! `protocol_mismatch` before anything else is read, so old daemons fail loudly.

use serde::{Deserialize, Serialize};

use crate::job::{EpochProgress, JobId};
use crate::spec::JobSpec;
use crate::summary::RunSummary;

/// Version of the messages in this module. Bump on any incompatible change.
pub const PROTOCOL_VERSION: u32 = 3;

/// Response header of a checkpoint download: the epoch the checkpoint was written after.
pub const CHECKPOINT_EPOCH_HEADER: &str = "x-grandis-checkpoint-epoch";

/// Daemon identifier: assigned by the coordinator, increasing, never reused (also across
/// coordinator restarts), so "lowest id" means "registered first".
pub type DaemonId = u64;

/// One accelerator of a server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// e.g. "NVIDIA H100 80GB HBM3", or "cpu" for the CPU backend.
    pub name: String,
    pub memory_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterRequest {
    pub protocol_version: u32,
    /// Server name; daemons with the same label are the same server (one is the head).
    pub label: String,
    pub devices: Vec<DeviceInfo>,
    /// Host memory in bytes.
    pub memory_bytes: u64,
    /// `host:port` where this daemon's QUIC data plane listens.
    pub data_addr: String,
    /// The daemon's software version (informational).
    pub daemon_version: String,
    /// Proof that the daemon holds the node key of `label`'s certificate; required by a
    /// coordinator that verifies daemon identities (`daemon_ca`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proof: Option<NodeProof>,
}

/// A daemon's proof of its label: a signature of [`registration_message`] (its label and a
/// challenge of `POST /v1/daemon/challenge`) by the key of its node certificate, which the
/// cluster CA issued for the label.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeProof {
    /// The challenge signed (each is accepted once, for a short time).
    pub challenge: String,
    /// The node certificate (then any intermediates), PEM.
    pub certificate: String,
    /// The TLS signature scheme code of the signature (0x0403: ECDSA P-256 SHA-256).
    pub scheme: u16,
    /// The signature, base64 (standard alphabet, padded).
    pub signature: String,
}

/// What a daemon signs to register as `label`: the purpose, the label and the challenge, so a
/// signature serves no other label, challenge or use.
pub fn registration_message(label: &str, challenge: &str) -> Vec<u8> {
    format!("grandis daemon registration\n{label}\n{challenge}").into_bytes()
}

/// `POST /v1/daemon/challenge`: a one-time challenge to sign for a registration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChallengeResponse {
    pub protocol_version: u32,
    pub challenge: String,
    /// The challenge is refused after this many milliseconds.
    pub expires_ms: u64,
}

/// Request header of every daemon call after registration at a coordinator that verifies
/// identities: `<daemon_id>:<session>` of the [`RegisterResponse`], which binds the call to
/// the registered daemon (its label proven by its certificate).
pub const DAEMON_SESSION_HEADER: &str = "x-grandis-daemon-session";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterResponse {
    pub protocol_version: u32,
    pub daemon_id: DaemonId,
    /// Send a heartbeat this often.
    pub heartbeat_interval_ms: u64,
    /// A head that has not heartbeated for this long loses its headship (and its job fails).
    pub lease_ms: u64,
    /// A daemon that has not heartbeated for this long is reported down.
    pub down_timeout_ms: u64,
    /// The session credential of every later call ([`DAEMON_SESSION_HEADER`]); absent from a
    /// coordinator that does not verify daemon identities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
}

/// What a daemon is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DaemonState {
    /// Free for a job.
    Idle,
    /// Preparing or training a job (see [`HeartbeatRequest::job`]).
    Running,
    /// Shutting down; takes no new jobs.
    Draining,
    /// Not heard from within the down timeout: what the cluster view shows for such a daemon
    /// until it returns or is forgotten (a daemon never reports it; a heartbeat saying it is
    /// refused).
    Down,
}

/// The job a daemon is working on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonJob {
    pub job_id: JobId,
    /// Which run of the job (1, then one more per retry): see [`Assignment::attempt`].
    #[serde(default = "first_attempt")]
    pub attempt: u32,
    /// Last epoch completed (0 before the first).
    #[serde(default)]
    pub epoch: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatRequest {
    pub protocol_version: u32,
    pub daemon_id: DaemonId,
    pub state: DaemonState,
    #[serde(default)]
    pub job: Option<DaemonJob>,
}

/// The head of a label.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadInfo {
    pub daemon_id: DaemonId,
    pub data_addr: String,
}

/// One server of an assigned job, in server-index order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerSlot {
    pub label: String,
    /// The head daemon of that label at assignment time.
    pub daemon_id: DaemonId,
    /// Its QUIC data-plane address.
    pub data_addr: String,
}

fn first_attempt() -> u32 {
    1
}

/// A job for this daemon's server.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    pub job_id: JobId,
    /// The job as this run executes it: `servers` is the length of `servers` below (fewer
    /// than submitted on an elastic retry).
    pub spec: JobSpec,
    /// This server's index in `servers` (0 = the job's leader, which reports progress).
    pub server_index: u32,
    pub servers: Vec<ServerSlot>,
    /// Which run of the job this is: 1, then one more each time it went back to the queue.
    /// A daemon runs each (job, attempt) at most once, and the data plane's sessions are
    /// keyed by both, so nothing of an earlier run can meet a later one.
    #[serde(default = "first_attempt")]
    pub attempt: u32,
    /// The epoch of the checkpoint the coordinator holds for the job: every server downloads
    /// it and resumes after that epoch. `None`: start from scratch (and drop any local one).
    #[serde(default)]
    pub resume_epoch: Option<u32>,
}

impl Assignment {
    /// The data plane's session id of this run: the job and the attempt.
    pub fn session(&self) -> u64 {
        (self.job_id << 16) ^ u64::from(self.attempt)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HeartbeatResponse {
    pub protocol_version: u32,
    /// Election term of this daemon's label (increases with every new head).
    pub term: u64,
    /// Whether this daemon is the head of its label.
    pub is_head: bool,
    /// The current head of the label (absent while no live daemon is left).
    pub head: Option<HeadInfo>,
    /// A job to run (heads only); repeated until the job ends.
    pub assignment: Option<Assignment>,
    /// Jobs this daemon must stop.
    pub cancel: Vec<JobId>,
}

/// What happened to a job on one server.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum JobEvent {
    /// The server loaded its partition and started (moves the job to running).
    Started,
    /// One epoch done (leader only: server index 0).
    Progress { progress: EpochProgress },
    /// The server measured its compute and link rates (when the job started); the
    /// coordinator keeps the latest per server.
    Measured { rates: crate::ServerRates },
    /// The server finished; the leader's summary becomes the job's summary. The job succeeds
    /// once every server has finished.
    Finished { summary: Box<RunSummary> },
    /// The server gave up (e.g. "dataset /data/x not found"); the job fails with the reason
    /// prefixed by the server's label, or, when `retryable` and the job has retries left,
    /// goes back to the queue.
    Failed {
        reason: String,
        /// The failure is about the cluster, not the job: a peer server was lost, or this
        /// daemon is being stopped. A run on healthy servers may succeed; a bad dataset or
        /// a bug would fail the same way again, so those are not retryable.
        #[serde(default)]
        retryable: bool,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobEventRequest {
    pub protocol_version: u32,
    pub daemon_id: DaemonId,
    /// The run of the job the event is about (daemons send it; absent = the job's current
    /// run). A run's `finished` report is taken after the coordinator restarted and the
    /// daemon registered anew, while the job waits to run again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    #[serde(flatten)]
    pub event: JobEvent,
}

/// The body of every error response of the coordinator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// Stable machine-readable code (`unauthorized`, `invalid_job`, `not_found`, ...).
    pub code: String,
    /// Human-readable message naming the problem (and the field, for invalid jobs).
    pub error: String,
    /// Per-field problems of an invalid job spec.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<crate::spec::FieldError>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_json_shape() {
        let ev = JobEventRequest {
            protocol_version: PROTOCOL_VERSION,
            daemon_id: 3,
            attempt: Some(2),
            event: JobEvent::Failed {
                reason: "dataset /data/x not found".into(),
                retryable: false,
            },
        };
        let v = serde_json::to_value(&ev).unwrap();
        assert_eq!(v["kind"], "failed");
        assert_eq!(v["reason"], "dataset /data/x not found");
        assert_eq!(serde_json::from_value::<JobEventRequest>(v).unwrap(), ev);
        let hb: HeartbeatRequest =
            serde_json::from_str(r#"{"protocol_version": 2, "daemon_id": 2, "state": "idle"}"#)
                .unwrap();
        assert_eq!(hb.job, None);
    }
}
