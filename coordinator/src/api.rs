//! The HTTP surface: routes, bearer-token auth, request parsing and server-sent events.

use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use grandis_wire::{
    HeartbeatRequest, JobEventRequest, JobId, JobSpec, JobState, JobStatus, RegisterRequest,
    SpecError, CHECKPOINT_EPOCH_HEADER, PROTOCOL_VERSION,
};
use serde::de::DeserializeOwned;
use serde_json::json;
use subtle::ConstantTimeEq;
use tokio::sync::{broadcast, watch};

use crate::error::ApiError;
use crate::identity::{check_acting, Acting, DaemonAuth};
use crate::metrics;
use crate::state::{Core, Update};

/// Every route of the router, as (method, path template). `docs/openapi.yaml` must document
/// each of them (a test checks it, and another checks the router answers each of them).
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/healthz"),
    ("GET", "/metrics"),
    ("POST", "/v1/jobs"),
    ("GET", "/v1/jobs"),
    ("GET", "/v1/jobs/{id}"),
    ("DELETE", "/v1/jobs/{id}"),
    ("GET", "/v1/jobs/{id}/events"),
    ("GET", "/v1/jobs/{id}/checkpoint"),
    ("GET", "/v1/cluster"),
    ("POST", "/v1/daemon/challenge"),
    ("POST", "/v1/daemon/register"),
    ("POST", "/v1/daemon/heartbeat"),
    ("POST", "/v1/daemon/jobs/{id}/events"),
    ("PUT", "/v1/daemon/jobs/{id}/checkpoint"),
    ("GET", "/v1/daemon/jobs/{id}/checkpoint"),
];

pub struct AppState {
    pub core: Mutex<Core>,
    pub updates: broadcast::Sender<Update>,
    pub shutdown: watch::Receiver<bool>,
    pub user_token: String,
    pub daemon_token: String,
    pub sse_keepalive: Duration,
    /// The largest checkpoint upload accepted.
    pub max_checkpoint_bytes: usize,
    /// The cluster CA daemons prove their labels with; None: labels are taken on trust.
    pub daemon_ca: Option<grandis_quic::ClusterCa>,
    /// Registration challenges and daemon sessions ([`crate::identity`]).
    pub daemon_auth: Mutex<DaemonAuth>,
}

impl AppState {
    pub fn core(&self) -> MutexGuard<'_, Core> {
        // A panic while holding the lock must not take the whole API down with it.
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn auth(&self) -> MutexGuard<'_, DaemonAuth> {
        self.daemon_auth.lock().unwrap_or_else(|e| e.into_inner())
    }
}

type Shared = Arc<AppState>;

pub fn router(state: Shared) -> Router {
    let user = Router::new()
        .route("/v1/jobs", post(submit_job).get(list_jobs))
        .route("/v1/jobs/{id}", get(get_job).delete(cancel_job))
        .route("/v1/jobs/{id}/events", get(job_events))
        .route("/v1/jobs/{id}/checkpoint", get(get_checkpoint))
        .route("/v1/cluster", get(cluster))
        .route_layer(middleware::from_fn_with_state(state.clone(), user_auth));
    let daemon = Router::new()
        .route("/v1/daemon/challenge", post(challenge))
        .route("/v1/daemon/register", post(register))
        .route("/v1/daemon/heartbeat", post(heartbeat))
        .route("/v1/daemon/jobs/{id}/events", post(daemon_job_event))
        .route(
            "/v1/daemon/jobs/{id}/checkpoint",
            // The upload reads its body itself, up to `max_checkpoint_bytes`.
            put(put_checkpoint).get(get_daemon_checkpoint),
        )
        .route_layer(middleware::from_fn_with_state(state.clone(), daemon_auth));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics_handler))
        .merge(user)
        .merge(daemon)
        .fallback(|method: Method, uri: axum::http::Uri| async move {
            ApiError::not_found(format!("no route for {method} {}", uri.path()))
        })
        .method_not_allowed_fallback(|method: Method, uri: axum::http::Uri| async move {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!("{method} is not allowed on {}", uri.path()),
            )
        })
        .with_state(state)
}

// ---- auth -----------------------------------------------------------------------------------

fn check_bearer(headers: &HeaderMap, expected: &str) -> Result<(), ApiError> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Err(ApiError::unauthorized(
            "missing bearer token (send 'Authorization: Bearer <token>')",
        ));
    };
    let value = value.as_bytes();
    let token = match value.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => &value[7..],
        _ => {
            return Err(ApiError::unauthorized(
                "the Authorization header must carry a Bearer token",
            ))
        }
    };
    // Constant time in the token's content (only its length can leak).
    if bool::from(token.ct_eq(expected.as_bytes())) {
        Ok(())
    } else {
        Err(ApiError::unauthorized("invalid bearer token"))
    }
}

async fn user_auth(State(st): State<Shared>, req: Request, next: Next) -> Response {
    match check_bearer(req.headers(), &st.user_token) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

/// The daemon token, then (when identities are verified) the session of every call but the
/// two that open one: the call's [`Acting`] daemon.
async fn daemon_auth(State(st): State<Shared>, mut req: Request, next: Next) -> Response {
    if let Err(e) = check_bearer(req.headers(), &st.daemon_token) {
        return e.into_response();
    }
    let opens_session = matches!(
        req.uri().path(),
        "/v1/daemon/challenge" | "/v1/daemon/register"
    );
    if st.daemon_ca.is_some() && !opens_session {
        let header = req
            .headers()
            .get(grandis_wire::DAEMON_SESSION_HEADER)
            .map(|v| v.as_bytes());
        match st.auth().session_daemon(header) {
            Ok(id) => {
                req.extensions_mut().insert(Acting(id));
            }
            Err(e) => return e.into_response(),
        }
    }
    next.run(req).await
}

// ---- open endpoints -------------------------------------------------------------------------

async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok", "protocol_version": PROTOCOL_VERSION}))
}

async fn metrics_handler(State(st): State<Shared>) -> Response {
    let text = metrics::render(&st.core(), Instant::now());
    ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response()
}

// ---- jobs -----------------------------------------------------------------------------------

fn parse_job_id(raw: &str) -> Result<JobId, ApiError> {
    raw.parse()
        .map_err(|_| ApiError::not_found(format!("no job '{raw}' (job ids are integers)")))
}

async fn submit_job(
    State(st): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).to_string());
    let mime = content_type.as_deref().map(|c| {
        c.split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase()
    });
    let text = std::str::from_utf8(&body)
        .map_err(|e| ApiError::bad_request("malformed_body", format!("body is not UTF-8: {e}")))?;
    let parsed = match mime.as_deref() {
        // No Content-Type: JSON, the API's default.
        None | Some("application/json") => JobSpec::from_json_str(text),
        Some(m) if m.ends_with("+json") => JobSpec::from_json_str(text),
        Some("application/toml" | "text/toml" | "application/x-toml") => {
            JobSpec::from_toml_str(text)
        }
        Some(other) => {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!(
                    "unsupported Content-Type '{other}' (send application/json or application/toml)"
                ),
            ))
        }
    };
    let spec = parsed.and_then(|spec| spec.check_cluster_job().map(|()| spec));
    let spec = spec.map_err(|e| match e {
        SpecError::Syntax { .. } => ApiError::bad_request("malformed_body", e.to_string()),
        SpecError::Invalid(fields) => {
            let mut err = ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_job",
                SpecError::Invalid(fields.clone()).to_string(),
            );
            err.fields = fields;
            err
        }
    })?;
    let status = st.core().submit(spec, Instant::now())?;
    let location = format!("/v1/jobs/{}", status.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(status),
    )
        .into_response())
}

async fn list_jobs(State(st): State<Shared>) -> Json<Vec<JobStatus>> {
    Json(st.core().list())
}

async fn get_job(
    State(st): State<Shared>,
    Path(id): Path<String>,
) -> Result<Json<JobStatus>, ApiError> {
    let id = parse_job_id(&id)?;
    st.core()
        .status(id, true)
        .map(Json)
        .ok_or_else(|| ApiError::not_found(format!("no job {id}")))
}

async fn cancel_job(
    State(st): State<Shared>,
    Path(id): Path<String>,
) -> Result<Json<JobStatus>, ApiError> {
    let id = parse_job_id(&id)?;
    let status = st.core().cancel(id, Instant::now())?;
    Ok(Json(status))
}

async fn cluster(State(st): State<Shared>) -> Json<grandis_wire::ClusterView> {
    Json(st.core().cluster(Instant::now()))
}

/// A daemon's download of a job's checkpoint: only of a job it is assigned to, when
/// identities are verified.
async fn get_daemon_checkpoint(
    State(st): State<Shared>,
    Path(raw): Path<String>,
    acting: Option<axum::Extension<Acting>>,
) -> Result<Response, ApiError> {
    if let Some(axum::Extension(Acting(daemon))) = acting {
        let id = parse_job_id(&raw)?;
        if !st.core().assigned(id, daemon)? {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "not_assigned",
                format!("daemon {daemon} is not assigned to job {id}"),
            ));
        }
    }
    get_checkpoint(State(st), Path(raw)).await
}

/// The job's latest checkpoint (a safetensors file), for users (the trained model of a cluster
/// job) and for the daemons of a retry.
async fn get_checkpoint(
    State(st): State<Shared>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_job_id(&id)?;
    // Reading a checkpoint of up to `max_checkpoint_bytes` blocks: not on a runtime worker
    // (the upload's write runs on a blocking thread for the same reason).
    let (epoch, bytes) = tokio::task::spawn_blocking(move || st.core().checkpoint(id))
        .await
        .map_err(|e| ApiError::internal(anyhow::anyhow!("reading the checkpoint: {e}")))??;
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"job-{id}-epoch-{epoch}.safetensors\""),
            ),
            (
                header::HeaderName::from_static(CHECKPOINT_EPOCH_HEADER),
                epoch.to_string(),
            ),
        ],
        bytes,
    )
        .into_response())
}

/// State of one server-sent event stream.
struct EventStream {
    st: Shared,
    id: JobId,
    rx: broadcast::Receiver<Update>,
    shutdown: watch::Receiver<bool>,
    pending: std::collections::VecDeque<Event>,
    /// Last epoch sent (so that replays after lag or at start never repeat one).
    last_epoch: u32,
    last_state: Option<JobState>,
    /// The attempt whose epochs were sent: a retry repeats the epochs after its checkpoint,
    /// and they are sent again.
    last_attempt: u32,
    done: bool,
}

fn json_event(name: &str, data: &impl serde::Serialize) -> Event {
    Event::default()
        .event(name)
        .json_data(data)
        .unwrap_or_else(|e| Event::default().event("error").data(e.to_string()))
}

impl EventStream {
    /// Queues whatever the client has not seen yet: new epochs, a state change, and the final
    /// status when the job has ended (which closes the stream).
    fn catch_up(&mut self) {
        let Some(status) = self.st.core().status(self.id, true) else {
            self.done = true;
            return;
        };
        if status.attempt != self.last_attempt {
            if self.last_attempt != 0 {
                let resume = status.retries.last().and_then(|r| r.resume_epoch);
                self.last_epoch = self.last_epoch.min(resume.unwrap_or(0));
            }
            self.last_attempt = status.attempt;
        }
        let seen = self.last_epoch;
        for p in status.history.iter().filter(|p| p.epoch > seen) {
            self.pending.push_back(json_event("progress", p));
            self.last_epoch = p.epoch;
        }
        if self.last_state.as_ref() != Some(&status.state) {
            // {"id", "state", "reason"?, "servers", "attempt", "retry"?}: the state's own
            // fields, flattened, and why the job went back to the queue, if it did.
            let mut data = serde_json::to_value(&status.state).unwrap_or_default();
            if let Some(obj) = data.as_object_mut() {
                obj.insert("id".into(), json!(self.id));
                obj.insert("servers".into(), json!(status.servers));
                obj.insert("attempt".into(), json!(status.attempt));
                if let Some(r) = status.retries.last() {
                    obj.insert("retry".into(), json!(r));
                }
            }
            self.pending.push_back(json_event("state", &data));
            self.last_state = Some(status.state.clone());
        }
        if status.state.is_terminal() {
            self.pending.push_back(json_event("end", &status));
            self.done = true;
        }
    }

    async fn next_event(mut self) -> Option<(Result<Event, Infallible>, EventStream)> {
        loop {
            if let Some(ev) = self.pending.pop_front() {
                return Some((Ok(ev), self));
            }
            if self.done {
                return None;
            }
            tokio::select! {
                msg = self.rx.recv() => match msg {
                    Ok(Update::Progress(id, p)) if id == self.id => {
                        if p.epoch > self.last_epoch {
                            self.last_epoch = p.epoch;
                            self.pending.push_back(json_event("progress", &p));
                        }
                    }
                    Ok(Update::State(id)) if id == self.id => self.catch_up(),
                    Ok(_) => {}
                    // Missed updates: the state has everything, replay from it.
                    Err(broadcast::error::RecvError::Lagged(_)) => self.catch_up(),
                    Err(broadcast::error::RecvError::Closed) => self.done = true,
                },
                _ = self.shutdown.changed() => self.done = true,
            }
        }
    }
}

async fn job_events(
    State(st): State<Shared>,
    Path(id): Path<String>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let id = parse_job_id(&id)?;
    // Subscribe before reading the state so nothing falls between the two.
    let rx = st.updates.subscribe();
    if st.core().status(id, false).is_none() {
        return Err(ApiError::not_found(format!("no job {id}")));
    }
    let mut es = EventStream {
        st: st.clone(),
        id,
        rx,
        shutdown: st.shutdown.clone(),
        pending: Default::default(),
        last_epoch: 0,
        last_state: None,
        last_attempt: 0,
        done: false,
    };
    if *es.shutdown.borrow() {
        es.done = true;
    }
    es.catch_up();
    let keepalive = st.sse_keepalive;
    Ok(Sse::new(stream::unfold(es, EventStream::next_event))
        .keep_alive(KeepAlive::new().interval(keepalive)))
}

// ---- daemon protocol ------------------------------------------------------------------------

/// Checks the protocol version before the message itself, so that a daemon of another
/// version gets "protocol version mismatch" rather than a confusing field error.
fn parse_daemon_message<T: DeserializeOwned>(body: &[u8], what: &str) -> Result<T, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request("malformed_body", format!("malformed JSON: {e}")))?;
    check_protocol(value.get("protocol_version").and_then(|v| v.as_u64()))?;
    serde_json::from_value(value)
        .map_err(|e| ApiError::bad_request("malformed_body", format!("malformed {what}: {e}")))
}

async fn challenge(
    State(st): State<Shared>,
) -> Result<Json<grandis_wire::ChallengeResponse>, ApiError> {
    Ok(Json(grandis_wire::ChallengeResponse {
        protocol_version: PROTOCOL_VERSION,
        challenge: st.auth().challenge(Instant::now())?,
        expires_ms: crate::identity::CHALLENGE_TTL.as_millis() as u64,
    }))
}

async fn register(
    State(st): State<Shared>,
    body: Bytes,
) -> Result<Json<grandis_wire::RegisterResponse>, ApiError> {
    let req: RegisterRequest = parse_daemon_message(&body, "registration")?;
    let now = Instant::now();
    if let Some(ca) = &st.daemon_ca {
        // The challenge is used up under the lock; the signature is checked outside it and
        // outside the core's (tens of microseconds, while other daemons' calls go on).
        let proof = st.auth().take_proof(&req, now)?;
        crate::identity::verify_proof(ca, &req.label, proof)?;
    }
    let mut core = st.core();
    let mut resp = core.register(req, now)?;
    if st.daemon_ca.is_some() {
        resp.session = Some(
            st.auth()
                .open_session(resp.daemon_id, |d| core.knows_daemon(d))?,
        );
    }
    Ok(Json(resp))
}

async fn heartbeat(
    State(st): State<Shared>,
    acting: Option<axum::Extension<Acting>>,
    body: Bytes,
) -> Result<Json<grandis_wire::HeartbeatResponse>, ApiError> {
    let req: HeartbeatRequest = parse_daemon_message(&body, "heartbeat")?;
    check_acting(acting.map(|a| a.0), req.daemon_id)?;
    Ok(Json(st.core().heartbeat(req, Instant::now())?))
}

/// The daemon's protocol version (`None`: it sent none) must be this coordinator's.
fn check_protocol(version: Option<u64>) -> Result<(), ApiError> {
    match version {
        None => Err(ApiError::bad_request(
            "protocol_mismatch",
            format!(
                "protocol_version: required (this coordinator speaks protocol {PROTOCOL_VERSION})"
            ),
        )),
        Some(v) if v != PROTOCOL_VERSION as u64 => Err(ApiError::bad_request(
            "protocol_mismatch",
            format!(
                "protocol version mismatch: the daemon speaks {v}, this coordinator speaks \
                 {PROTOCOL_VERSION}; upgrade the older side"
            ),
        )),
        Some(_) => Ok(()),
    }
}

/// `key=value&...` of a daemon request's query, each value an unsigned integer; the message
/// names what is missing or malformed.
fn query_numbers<const N: usize>(raw: Option<&str>, keys: [&str; N]) -> Result<[u64; N], ApiError> {
    let mut out = [None; N];
    for pair in raw.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if let Some(i) = keys.iter().position(|&key| key == k) {
            out[i] = Some(v.parse::<u64>().map_err(|_| {
                ApiError::bad_request(
                    "malformed_query",
                    format!("{k}: expected an unsigned integer, got {v:?}"),
                )
            })?);
        }
    }
    let mut values = [0; N];
    for (i, v) in out.into_iter().enumerate() {
        values[i] = v.ok_or_else(|| {
            ApiError::bad_request(
                "malformed_query",
                format!("query parameter {} is required", keys[i]),
            )
        })?;
    }
    Ok(values)
}

async fn put_checkpoint(
    State(st): State<Shared>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
    acting: Option<axum::Extension<Acting>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<StatusCode, ApiError> {
    let id = parse_job_id(&id)?;
    let [version, daemon_id, attempt, epoch] = query_numbers(
        query.as_deref(),
        ["protocol_version", "daemon_id", "attempt", "epoch"],
    )?;
    check_protocol(Some(version))?;
    check_acting(acting.map(|a| a.0), daemon_id)?;
    let small = |v: u64, what: &str| {
        u32::try_from(v).map_err(|_| {
            ApiError::bad_request("malformed_query", format!("{what}: {v} is out of range"))
        })
    };
    let (attempt, epoch) = (small(attempt, "attempt")?, small(epoch, "epoch")?);
    // Refused before a byte of the body is read: too large by its declared length, or not
    // taken at all (a finished attempt, another daemon, ...); a chunked body is read up to
    // the limit and no further.
    let limit = st.max_checkpoint_bytes;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "checkpoint_too_large",
            format!("a checkpoint may hold at most {limit} bytes (max_checkpoint_bytes)"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    if !st.core().checkpoint_wanted(id, daemon_id, attempt, epoch)? {
        return Ok(StatusCode::NO_CONTENT);
    }
    let body = http_body_util::BodyExt::collect(http_body_util::Limited::new(body, limit))
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                too_large()
            } else {
                ApiError::bad_request("invalid_checkpoint", format!("reading the body: {e}"))
            }
        })?
        .to_bytes();
    // The check and the store's write run on a blocking thread: a large checkpoint must not
    // stall the runtime's workers. Checked before it is stored (a container whose checksum
    // holds, of the job's model, holding the epochs it claims), outside the core's lock.
    let st2 = st.clone();
    tokio::task::spawn_blocking(move || {
        let spec = st2.core().job_spec(id)?;
        grandis_wire::checkpoint::check_upload(&body, &spec, u64::from(epoch)).map_err(|e| {
            ApiError::bad_request(
                "invalid_checkpoint",
                format!("the checkpoint of job {id} for epoch {epoch} is refused: {e}"),
            )
        })?;
        st2.core()
            .put_checkpoint(id, daemon_id, attempt, epoch, &body)
    })
    .await
    .map_err(|e| ApiError::internal(anyhow::anyhow!("storing the checkpoint: {e}")))??;
    Ok(StatusCode::NO_CONTENT)
}

async fn daemon_job_event(
    State(st): State<Shared>,
    Path(id): Path<String>,
    acting: Option<axum::Extension<Acting>>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let id = parse_job_id(&id)?;
    let req: JobEventRequest = parse_daemon_message(&body, "job event")?;
    check_acting(acting.map(|a| a.0), req.daemon_id)?;
    st.core()
        .job_event(id, req.daemon_id, req.attempt, req.event, Instant::now())?;
    Ok(StatusCode::NO_CONTENT)
}
