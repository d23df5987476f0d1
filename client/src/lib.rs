//! The one REST client of the grandis coordinator (`docs/openapi.yaml`), blocking, with
//! bounded connect, read and write timeouts so an unreachable coordinator never wedges a
//! caller. Users' calls ([`Client::submit`], [`Client::status`], [`Client::follow`]) serve
//! `grandis submit` and `grandis cluster up`; the daemon protocol ([`Client::register`],
//! [`Client::heartbeat`], [`Client::event`], [`Client::put_checkpoint`],
//! [`Client::checkpoint`]) serves the daemons; [`Client::send`] is the raw
//! call under both, for callers that need the status of any answer (the end-to-end tests).
//!
//! Every call carries the bearer token; an error status becomes [`CallError::Status`] with the
//! coordinator's [`ErrorBody`] and the URL, anything else (refused, timed out, malformed)
//! [`CallError::Transport`].

use std::io::{BufRead, BufReader, Read};
use std::time::Duration;

use grandis_wire::{
    EpochProgress, ErrorBody, HeartbeatRequest, HeartbeatResponse, JobEvent, JobEventRequest,
    JobId, JobStatus, NodeProof, RegisterRequest, RegisterResponse, CHECKPOINT_EPOCH_HEADER,
    PROTOCOL_VERSION,
};
use serde::de::DeserializeOwned;

/// Why a call failed.
#[derive(Debug)]
pub enum CallError {
    /// The coordinator answered with an error status.
    Status {
        url: String,
        status: u16,
        body: ErrorBody,
    },
    /// No usable answer (connection refused, timeout, malformed reply).
    Transport(String),
}

impl CallError {
    /// 404 `unknown_daemon`: the coordinator forgot the daemon (it restarted); register again.
    pub fn is_unknown_daemon(&self) -> bool {
        matches!(self, CallError::Status { status: 404, body, .. } if body.code == "unknown_daemon")
    }

    /// Whether the coordinator answered an error with this `code` (docs/openapi.yaml, `Error`).
    pub fn is_code(&self, code: &str) -> bool {
        matches!(self, CallError::Status { body, .. } if body.code == code)
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Status { url, status, body } => {
                write!(
                    f,
                    "{url}: the coordinator answered {status}: {}",
                    body.error
                )
            }
            CallError::Transport(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for CallError {}

/// The error of a non-2xx answer: the coordinator's [`ErrorBody`], or the text as its message.
fn status_error(url: String, status: u16, text: String) -> CallError {
    let body = serde_json::from_str(&text).unwrap_or(ErrorBody {
        code: "unknown".into(),
        error: text,
        fields: Vec::new(),
    });
    CallError::Status { url, status, body }
}

/// The error of a 204 where an answer was expected.
fn empty_reply(path: &str) -> CallError {
    CallError::Transport(format!("{path}: empty reply"))
}

/// A 2xx answer as it is; an error status as [`CallError::Status`], no answer as
/// [`CallError::Transport`].
fn success(
    url: &str,
    result: Result<ureq::Response, ureq::Error>,
) -> Result<ureq::Response, CallError> {
    match result {
        Ok(r) => Ok(r),
        Err(ureq::Error::Status(status, r)) => Err(status_error(
            url.to_string(),
            status,
            r.into_string().unwrap_or_default(),
        )),
        Err(ureq::Error::Transport(t)) => {
            Err(CallError::Transport(format!("cannot reach {url}: {t}")))
        }
    }
}

/// The format of a job document sent to [`Client::submit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobFormat {
    Json,
    Toml,
}

/// An answer of any status: the status and the body's text.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub text: String,
}

/// A coordinator client (cheap to clone).
#[derive(Clone)]
pub struct Client {
    agent: ureq::Agent,
    base: String,
    auth: Option<String>,
    /// A registered daemon's session (`<id>:<credential>`), sent on every call.
    session: Option<String>,
}

/// Makes a daemon's proof of its label over a coordinator's challenge ([`Client::register`]).
pub type Prove<'a> = &'a dyn Fn(&str) -> Result<NodeProof, String>;

/// Reconnections of [`Client::follow`] before it gives up, 250 ms apart.
const FOLLOW_RETRIES: u32 = 20;

impl Client {
    /// A client of the coordinator at `base` (`http://host:port`) sending `token`; each
    /// connect, read and write is bounded by `timeout`.
    pub fn new(base: &str, token: &str, timeout: Duration) -> Client {
        Client {
            agent: ureq::AgentBuilder::new()
                .timeout_connect(timeout)
                .timeout_read(timeout)
                .timeout_write(timeout)
                // A connection per request: the coordinator closes kept-alive connections
                // after `header_read_timeout_ms`, and a POST on a connection it just closed
                // would fail (ureq retries only idempotent requests). Calls are seconds apart,
                // so the extra handshake costs nothing that matters.
                .max_idle_connections_per_host(0)
                .build(),
            base: base.trim_end_matches('/').to_string(),
            auth: Some(format!("Bearer {token}")),
            session: None,
        }
    }

    /// The same client acting as daemon `daemon_id` with the session its registration gave
    /// (none: a coordinator that does not verify daemon identities).
    pub fn with_session(&self, daemon_id: u64, session: Option<&str>) -> Client {
        Client {
            session: session.map(|s| format!("{daemon_id}:{s}")),
            ..self.clone()
        }
    }

    /// The same client with another token, or none (`None` sends no Authorization).
    pub fn with_token(&self, token: Option<&str>) -> Client {
        Client {
            auth: token.map(|t| format!("Bearer {t}")),
            ..self.clone()
        }
    }

    /// The coordinator's base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    fn request(&self, method: &str, path: &str) -> (String, ureq::Request) {
        let url = format!("{}{path}", self.base);
        let mut req = self.agent.request(method, &url);
        if let Some(a) = &self.auth {
            req = req.set("Authorization", a);
        }
        if let Some(s) = &self.session {
            req = req.set(grandis_wire::DAEMON_SESSION_HEADER, s);
        }
        (url, req)
    }

    /// `method path` with an optional `(content type, body)`; answers of every status are
    /// returned as they are.
    pub fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &str)>,
    ) -> Result<Reply, CallError> {
        let (url, req) = self.request(method, path);
        let resp = match body {
            Some((content_type, text)) => req.set("Content-Type", content_type).send_string(text),
            None => req.call(),
        };
        let resp = match resp {
            Ok(r) | Err(ureq::Error::Status(_, r)) => r,
            Err(ureq::Error::Transport(t)) => {
                return Err(CallError::Transport(format!("cannot reach {url}: {t}")))
            }
        };
        let status = resp.status();
        let text = resp
            .into_string()
            .map_err(|e| CallError::Transport(format!("reading the reply of {url}: {e}")))?;
        Ok(Reply { status, text })
    }

    /// A call whose 2xx answer is a `T` (None for 204); other statuses are errors.
    fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &str)>,
    ) -> Result<Option<T>, CallError> {
        let url = format!("{}{path}", self.base);
        let Reply { status, text } = self.send(method, path, body)?;
        if !(200..300).contains(&status) {
            return Err(status_error(url, status, text));
        }
        if status == 204 {
            return Ok(None);
        }
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| CallError::Transport(format!("malformed reply of {url}: {e}: {text}")))
    }

    /// A call that must answer a `T`.
    fn call_for<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &str)>,
    ) -> Result<T, CallError> {
        self.call(method, path, body)?
            .ok_or_else(|| empty_reply(path))
    }

    /// A POST of `body` as JSON whose answer is a `T` (None for 204).
    fn post_json<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &impl serde::Serialize,
    ) -> Result<Option<T>, CallError> {
        let text = serde_json::to_string(body)
            .map_err(|e| CallError::Transport(format!("encoding the request to {path}: {e}")))?;
        self.call("POST", path, Some(("application/json", &text)))
    }

    /// Submits a job document and returns the created job.
    pub fn submit(&self, document: &str, format: JobFormat) -> Result<JobStatus, CallError> {
        let content_type = match format {
            JobFormat::Json => "application/json",
            JobFormat::Toml => "application/toml",
        };
        self.call_for("POST", "/v1/jobs", Some((content_type, document)))
    }

    /// Cancels a job that has not ended; returns it, cancelled (409 `job_finished` when it
    /// already ended).
    pub fn cancel(&self, id: JobId) -> Result<JobStatus, CallError> {
        self.call_for("DELETE", &format!("/v1/jobs/{id}"), None)
    }

    /// The cluster: servers (with what they measured), heads and daemons.
    pub fn cluster(&self) -> Result<grandis_wire::ClusterView, CallError> {
        self.call_for("GET", "/v1/cluster", None)
    }

    /// A job's status.
    pub fn status(&self, id: JobId) -> Result<JobStatus, CallError> {
        self.call_for("GET", &format!("/v1/jobs/{id}"), None)
    }

    /// Streams the job's events, calling `on_progress` for every epoch and `on_state` for
    /// every state change, until the job ends; returns its final status. Reconnects (replaying
    /// from the job's state, which skips epochs already seen) if the stream breaks.
    pub fn follow(
        &self,
        id: JobId,
        on_progress: &mut dyn FnMut(&EpochProgress),
        on_state: &mut dyn FnMut(&serde_json::Value),
    ) -> Result<JobStatus, CallError> {
        let path = format!("/v1/jobs/{id}/events");
        let mut last_epoch = 0u32;
        let mut failures = 0;
        loop {
            let (url, req) = self.request("GET", &path);
            let resp = match success(&url, req.set("Accept", "text/event-stream").call()) {
                Ok(r) => r,
                Err(CallError::Transport(_)) if failures < FOLLOW_RETRIES => {
                    failures += 1;
                    std::thread::sleep(Duration::from_millis(250));
                    continue;
                }
                Err(e) => return Err(e),
            };
            let (mut event, mut data) = (String::new(), String::new());
            for line in BufReader::new(resp.into_reader()).lines() {
                let Ok(line) = line else { break };
                if !line.is_empty() {
                    if let Some(v) = line.strip_prefix("event:") {
                        event = v.trim().to_string();
                    } else if let Some(v) = line.strip_prefix("data:") {
                        if !data.is_empty() {
                            data.push('\n');
                        }
                        data.push_str(v.strip_prefix(' ').unwrap_or(v));
                    }
                    continue;
                }
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
                        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&data) {
                            // A retry repeats the epochs after its checkpoint: show them again.
                            if let Some(resume) = v.get("retry").map(|r| r["resume_epoch"].as_u64())
                            {
                                if v["state"] == "queued" {
                                    last_epoch = last_epoch.min(resume.unwrap_or(0) as u32);
                                }
                            }
                            on_state(&v);
                        }
                    }
                    "end" => {
                        return serde_json::from_str(&data).map_err(|e| {
                            CallError::Transport(format!("{url}: malformed end event: {e}"))
                        });
                    }
                    _ => {}
                }
                event.clear();
                data.clear();
            }
            // The stream ended without an end event (coordinator restart?): ask directly.
            if let Ok(st) = self.status(id) {
                if st.state.is_terminal() {
                    return Ok(st);
                }
            }
            failures += 1;
            if failures > FOLLOW_RETRIES {
                return Err(CallError::Transport(format!(
                    "{url}: the event stream keeps breaking"
                )));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Daemon protocol: registers a daemon. With `prove`, the registration carries the proof
    /// `prove` makes of a fresh challenge (signed with the node's key).
    pub fn register(
        &self,
        req: &RegisterRequest,
        prove: Option<Prove<'_>>,
    ) -> Result<RegisterResponse, CallError> {
        let mut req = req.clone();
        if let Some(prove) = prove {
            let path = "/v1/daemon/challenge";
            let c: grandis_wire::ChallengeResponse = self
                .post_json(path, &serde_json::json!({}))?
                .ok_or_else(|| empty_reply(path))?;
            req.proof = Some(prove(&c.challenge).map_err(CallError::Transport)?);
        }
        let path = "/v1/daemon/register";
        self.post_json(path, &req)?.ok_or_else(|| empty_reply(path))
    }

    /// Daemon protocol: one heartbeat.
    pub fn heartbeat(&self, req: &HeartbeatRequest) -> Result<HeartbeatResponse, CallError> {
        let path = "/v1/daemon/heartbeat";
        self.post_json(path, req)?.ok_or_else(|| empty_reply(path))
    }

    /// Daemon protocol: an event of a job the daemon runs.
    /// Daemon protocol: reports `event` of run `attempt` of job `job`.
    pub fn event(
        &self,
        daemon_id: u64,
        job: JobId,
        attempt: u32,
        event: JobEvent,
    ) -> Result<(), CallError> {
        let req = JobEventRequest {
            protocol_version: PROTOCOL_VERSION,
            daemon_id,
            attempt: Some(attempt),
            event,
        };
        self.post_json::<serde_json::Value>(&format!("/v1/daemon/jobs/{job}/events"), &req)
            .map(|_| ())
    }

    /// Daemon protocol: uploads the checkpoint the leader of `attempt` wrote after `epoch`.
    pub fn put_checkpoint(
        &self,
        daemon_id: u64,
        job: JobId,
        attempt: u32,
        epoch: u32,
        bytes: &[u8],
    ) -> Result<(), CallError> {
        let path = format!(
            "/v1/daemon/jobs/{job}/checkpoint?protocol_version={PROTOCOL_VERSION}\
             &daemon_id={daemon_id}&attempt={attempt}&epoch={epoch}"
        );
        let (url, req) = self.request("PUT", &path);
        let sent = req
            .set("Content-Type", "application/octet-stream")
            .send_bytes(bytes);
        success(&url, sent).map(|_| ())
    }

    /// The job's latest checkpoint and the epoch it was written after (daemon protocol with
    /// `daemon` true, else the user route); at most `limit` bytes are read.
    pub fn checkpoint(
        &self,
        job: JobId,
        daemon: bool,
        limit: u64,
    ) -> Result<(u32, Vec<u8>), CallError> {
        let path = if daemon {
            format!("/v1/daemon/jobs/{job}/checkpoint")
        } else {
            format!("/v1/jobs/{job}/checkpoint")
        };
        let (url, req) = self.request("GET", &path);
        let resp = success(&url, req.call())?;
        let epoch = resp
            .header(CHECKPOINT_EPOCH_HEADER)
            .and_then(|v| v.trim().parse::<u32>().ok())
            .ok_or_else(|| {
                CallError::Transport(format!(
                    "{url}: the reply has no valid {CHECKPOINT_EPOCH_HEADER} header"
                ))
            })?;
        let mut bytes = Vec::new();
        resp.into_reader()
            .take(limit.saturating_add(1))
            .read_to_end(&mut bytes)
            .map_err(|e| CallError::Transport(format!("reading the reply of {url}: {e}")))?;
        if bytes.len() as u64 > limit {
            return Err(CallError::Transport(format!(
                "{url}: the checkpoint is larger than {limit} bytes"
            )));
        }
        Ok((epoch, bytes))
    }
}
