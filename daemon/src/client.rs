//! The daemon's side of the control protocol: blocking JSON-over-HTTP calls to the
//! coordinator (`grandis_wire::protocol`), with bounded timeouts so that an unreachable
//! coordinator never wedges a heartbeat.

use std::time::Duration;

use grandis_wire::{
    ErrorBody, HeartbeatRequest, HeartbeatResponse, JobEvent, JobEventRequest, JobId,
    RegisterRequest, RegisterResponse, PROTOCOL_VERSION,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Why a call failed.
#[derive(Debug)]
pub enum CallError {
    /// The coordinator answered with an error status.
    Status { status: u16, body: ErrorBody },
    /// No usable answer (connection refused, timeout, malformed reply).
    Transport(String),
}

impl CallError {
    /// 404 `unknown_daemon`: the coordinator forgot us (it restarted); register again.
    pub fn is_unknown_daemon(&self) -> bool {
        matches!(self, CallError::Status { status: 404, body } if body.code == "unknown_daemon")
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Status { status, body } => {
                write!(
                    f,
                    "coordinator answered {status} {}: {}",
                    body.code, body.error
                )
            }
            CallError::Transport(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for CallError {}

/// A coordinator client.
#[derive(Clone)]
pub struct Client {
    agent: ureq::Agent,
    base: String,
    auth: String,
}

impl Client {
    pub fn new(base: &str, token: &str, timeout: Duration) -> Client {
        Client {
            agent: ureq::AgentBuilder::new()
                .timeout_connect(timeout)
                .timeout_read(timeout)
                .timeout_write(timeout)
                .build(),
            base: base.trim_end_matches('/').to_string(),
            auth: format!("Bearer {token}"),
        }
    }

    fn post<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        path: &str,
        body: &Req,
    ) -> Result<Option<Resp>, CallError> {
        let url = format!("{}{path}", self.base);
        let text = serde_json::to_string(body)
            .map_err(|e| CallError::Transport(format!("encoding the request to {url}: {e}")))?;
        let resp = self
            .agent
            .post(&url)
            .set("Authorization", &self.auth)
            .set("Content-Type", "application/json")
            .send_string(&text);
        match resp {
            Ok(r) => {
                if r.status() == 204 {
                    return Ok(None);
                }
                let text = r.into_string().map_err(|e| {
                    CallError::Transport(format!("reading the reply of {url}: {e}"))
                })?;
                serde_json::from_str(&text).map(Some).map_err(|e| {
                    CallError::Transport(format!("malformed reply of {url}: {e}: {text}"))
                })
            }
            Err(ureq::Error::Status(status, r)) => {
                let text = r.into_string().unwrap_or_default();
                let body = serde_json::from_str(&text).unwrap_or(ErrorBody {
                    code: "unknown".into(),
                    error: text,
                    fields: Vec::new(),
                });
                Err(CallError::Status { status, body })
            }
            Err(ureq::Error::Transport(t)) => {
                Err(CallError::Transport(format!("cannot reach {url}: {t}")))
            }
        }
    }

    pub fn register(&self, req: &RegisterRequest) -> Result<RegisterResponse, CallError> {
        self.post("/v1/daemon/register", req)?
            .ok_or_else(|| CallError::Transport("empty registration reply".into()))
    }

    pub fn heartbeat(&self, req: &HeartbeatRequest) -> Result<HeartbeatResponse, CallError> {
        self.post("/v1/daemon/heartbeat", req)?
            .ok_or_else(|| CallError::Transport("empty heartbeat reply".into()))
    }

    pub fn event(&self, daemon_id: u64, job: JobId, event: JobEvent) -> Result<(), CallError> {
        let req = JobEventRequest {
            protocol_version: PROTOCOL_VERSION,
            daemon_id,
            event,
        };
        self.post::<_, serde_json::Value>(&format!("/v1/daemon/jobs/{job}/events"), &req)
            .map(|_| ())
    }
}
