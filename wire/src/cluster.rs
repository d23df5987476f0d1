//! The cluster as `GET /v1/cluster` reports it: servers (labels) with their elected heads and
//! every daemon with its resources and heartbeat age.

use serde::{Deserialize, Serialize};

use crate::job::JobId;
use crate::protocol::{DaemonId, DaemonState, DeviceInfo, HeadInfo};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterView {
    pub heartbeat_interval_ms: u64,
    pub lease_ms: u64,
    pub down_timeout_ms: u64,
    /// One entry per label, sorted by label.
    pub servers: Vec<ServerView>,
    /// Every daemon that registered since the coordinator started, sorted by id.
    pub daemons: Vec<DaemonView>,
}

/// One server: all daemons sharing a label.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerView {
    pub label: String,
    /// Election term (increases with every new head; survives coordinator restarts).
    pub term: u64,
    pub head: Option<HeadInfo>,
    /// A server is up while its head holds a lease.
    pub up: bool,
    /// The active job on this server, if any.
    pub job: Option<JobId>,
    pub daemons: Vec<DaemonId>,
    /// What the server measured when its last job started (absent until one did).
    #[serde(default)]
    pub rates: Option<crate::ServerRates>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DaemonView {
    pub id: DaemonId,
    pub label: String,
    /// False once the daemon missed heartbeats for the down timeout.
    pub up: bool,
    pub is_head: bool,
    pub state: DaemonState,
    pub job: Option<JobId>,
    pub epoch: Option<u32>,
    pub devices: Vec<DeviceInfo>,
    pub memory_bytes: u64,
    pub data_addr: String,
    pub daemon_version: String,
    /// Seconds since the last heartbeat (or registration).
    pub last_heartbeat_age_s: f64,
}
