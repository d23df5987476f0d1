//! Types that the grandis coordinator, the daemons and the CLI exchange. [`spec`] is the job
//! description users submit (JSON or TOML) with field-by-field validation whose errors name the
//! field; [`job`] is the job state machine and per-epoch progress as the REST API reports it;
//! [`protocol`] is the daemon ↔ coordinator control protocol (register, heartbeat, job events),
//! versioned by [`PROTOCOL_VERSION`]; [`summary`] is the one run summary every front end prints
//! and reads; [`rates`] what a server measures of its compute and links; [`plan`] what the
//! planner predicts and chooses from them; [`checkpoint`] the checkpoint container the
//! trainer writes and the coordinator checks before storing an upload. Everything here is
//! plain data (serde, bytes) with no I/O, so every side of the system agrees on one definition
//! and the coordinator, daemon and CLI can evolve separately.

pub mod checkpoint;
pub mod cluster;
pub mod job;
pub mod links;
pub mod nan;
pub mod plan;
pub mod protocol;
pub mod rates;
pub mod spec;
pub mod summary;

pub use cluster::{ClusterView, DaemonView, ServerView};
pub use job::{EpochProgress, JobId, JobRetry, JobState, JobStatus};
pub use links::{LinkBytes, LinkClass, PerLink};
pub use plan::{CandidateSummary, KernelCalibration, PlanRates, PlanSummary, Prediction};
pub use protocol::{
    registration_message, Assignment, ChallengeResponse, DaemonId, DaemonJob, DaemonState,
    DeviceInfo, ErrorBody, HeadInfo, HeartbeatRequest, HeartbeatResponse, JobEvent,
    JobEventRequest, NodeProof, RegisterRequest, RegisterResponse, ServerSlot,
    CHECKPOINT_EPOCH_HEADER, DAEMON_SESSION_HEADER, PROTOCOL_VERSION,
};
pub use rates::{ComputeRate, LinkRate, ServerRates};
pub use spec::{
    defaults, task_conflict, FieldError, InterTransport, JobSpec, LinkDecoder, LinkSpec, Mode,
    ModelKind, PartitionMethod, PredictSpec, Priority, Sampling, SpecError, Staleness, Task,
    UnknownName,
};
pub use summary::{
    Execution, InferenceSummary, LinkScores, LinkSummary, RankMemory, RunSummary, ServerTraffic,
    StaleSummary, TimeSplit, WireStats,
};
