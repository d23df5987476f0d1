//! The coordinator's state machine: jobs and their queue, daemons, per-label elections.
//!
//! Everything here is synchronous and takes the current [`Instant`] as an argument, so the
//! same code runs under the HTTP handlers, the periodic tick and unit tests with a synthetic
//! clock. Rules:
//!
//! - **Liveness.** A daemon is *alive* while its last heartbeat is at most `lease` old and
//!   *up* while it is at most `down_timeout` old.
//! - **Elections.** Each label has a term and at most one head. A head stays head while alive
//!   (its heartbeats renew the lease). When it is not, the lowest-id alive, non-draining daemon
//!   of the label becomes head and the term increments (the term is persisted, so it never goes
//!   back, even across restarts). A newer daemon never preempts a live head.
//! - **Scheduling.** Strict FIFO: the oldest queued job is assigned as soon as `servers`
//!   labels are free (a live head with at least `devices` devices and no active job); jobs
//!   behind it wait, so a large job is never starved by small ones. Labels are taken in name
//!   order, so assignments are deterministic.
//! - **Failures.** An active job's run ends, naming the server, as soon as the head it was
//!   assigned to loses its lease (within `lease` of its last heartbeat) or a daemon reports a
//!   failure. A lost server, or a failure the daemon calls retryable (a lost peer, a daemon
//!   being stopped), puts the job back in the queue while it has retries left
//!   (`max_retries`): it keeps its place by id, its history is cut back to the checkpoint the
//!   coordinator holds, and its next run (attempt) resumes from that checkpoint once enough
//!   servers are free (fewer than asked for when the job is `elastic`). Other failures, and a
//!   job out of retries, fail it.
//! - **Checkpoints.** The leader of a run uploads every checkpoint it writes; the coordinator
//!   stores it with the job record in one transaction, so the record's `checkpoint_epoch`
//!   always names the stored file.
//! - **Restart.** Jobs that were assigned or running when the coordinator stopped end their
//!   run as if their servers were lost (a retry from the last checkpoint, if retries are
//!   left): their daemons' in-memory state cannot line up with a coordinator that lost every
//!   lease. Daemons that still run such a run are told to cancel it in their next heartbeat
//!   reply; the retry starts once they have. Queued and finished jobs are kept as they were.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use grandis_wire::{
    Assignment, ClusterView, DaemonId, DaemonJob, DaemonState, DaemonView, DeviceInfo,
    EpochProgress, HeadInfo, HeartbeatRequest, HeartbeatResponse, JobEvent, JobId, JobRetry,
    JobSpec, JobState, JobStatus, LinkBytes, RegisterRequest, RegisterResponse, ServerSlot,
    ServerView, PROTOCOL_VERSION,
};
use tokio::sync::broadcast;

use crate::error::ApiError;
use crate::store::{JobRecord, Store, NEXT_DAEMON_ID, NEXT_JOB_ID};

/// The reason given to runs that were active when the coordinator stopped.
pub const RESTART_REASON: &str = "coordinator restarted";

/// What the coordinator keeps and allows beyond a job's own spec.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Finished jobs whose checkpoints are kept ([`Core::prune_checkpoints`]).
    pub keep_finished_checkpoints: usize,
    /// Runs of one job that may end by a restart of the coordinator (not charged to the job's
    /// `max_retries`).
    pub max_restart_retries: u32,
}

/// What ended a run, for the retry it may get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ending {
    /// The job or its servers: retried while the job's `max_retries` allow, when retryable.
    Job { retryable: bool },
    /// A restart of the coordinator: retried while [`Limits::max_restart_retries`] allow.
    Restart,
}

#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub heartbeat_interval: Duration,
    pub lease: Duration,
    pub down_timeout: Duration,
    /// A daemon down for this long is forgotten: it leaves `/v1/cluster` and the metrics, and
    /// registers anew if it ever comes back.
    pub forget_after: Duration,
}

#[derive(Clone, Debug)]
pub struct Daemon {
    pub id: DaemonId,
    pub label: String,
    pub devices: Vec<DeviceInfo>,
    pub memory_bytes: u64,
    pub data_addr: String,
    pub version: String,
    pub last_seen: Instant,
    pub state: DaemonState,
    pub job: Option<DaemonJob>,
    pub up: bool,
}

#[derive(Clone, Debug, Default)]
pub struct Label {
    pub term: u64,
    pub head: Option<DaemonId>,
    /// What the server measured when its last job started (kept in memory: a restarted
    /// coordinator learns them again with the next job).
    pub rates: Option<grandis_wire::ServerRates>,
}

/// What changed, for server-sent event streams.
#[derive(Clone, Debug)]
pub enum Update {
    /// The job's state (or servers, or summary) changed.
    State(JobId),
    /// The job's leader reported an epoch.
    Progress(JobId, EpochProgress),
}

pub struct Core {
    pub(crate) timing: Timing,
    pub(crate) store: Store,
    pub(crate) jobs: BTreeMap<JobId, JobRecord>,
    pub(crate) queue: VecDeque<JobId>,
    pub(crate) waiting: HashMap<JobId, String>,
    pub(crate) daemons: BTreeMap<DaemonId, Daemon>,
    pub(crate) labels: BTreeMap<String, Label>,
    next_job_id: u64,
    next_daemon_id: u64,
    /// Heads elected since start (a metrics counter).
    pub(crate) elections: u64,
    limits: Limits,
    updates: broadcast::Sender<Update>,
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn age(now: Instant, then: Instant) -> Duration {
    now.saturating_duration_since(then)
}

impl Core {
    /// Loads the store; runs that were active end as if their servers were lost (see the
    /// module docs).
    pub fn open(
        store: Store,
        timing: Timing,
        limits: Limits,
        updates: broadcast::Sender<Update>,
    ) -> anyhow::Result<Core> {
        let mut jobs = BTreeMap::new();
        let mut queue = VecDeque::new();
        let mut interrupted = Vec::new();
        for rec in store.load_jobs()? {
            if rec.state.is_active() {
                interrupted.push(rec.id);
            }
            if rec.state == JobState::Queued {
                queue.push_back(rec.id);
            }
            jobs.insert(rec.id, rec);
        }
        let max_id = jobs.keys().next_back().copied().unwrap_or(0);
        let next_job_id = store.meta(NEXT_JOB_ID)?.unwrap_or(1).max(max_id + 1);
        let next_daemon_id = store.meta(NEXT_DAEMON_ID)?.unwrap_or(1).max(1);
        let labels = store
            .load_terms()?
            .into_iter()
            .map(|(name, term)| {
                (
                    name,
                    Label {
                        term,
                        head: None,
                        rates: None,
                    },
                )
            })
            .collect();
        let mut core = Core {
            timing,
            store,
            jobs,
            queue,
            waiting: HashMap::new(),
            daemons: BTreeMap::new(),
            labels,
            next_job_id,
            next_daemon_id,
            elections: 0,
            limits,
            updates,
        };
        for &id in &interrupted {
            core.end_run(id, RESTART_REASON.into(), Ending::Restart)
                .map_err(|e| anyhow::anyhow!("{}", e.message))?;
        }
        core.prune_checkpoints()
            .map_err(|e| anyhow::anyhow!("{}", e.message))?;
        tracing::info!(
            jobs = core.jobs.len(),
            queued = core.queue.len(),
            interrupted_by_restart = interrupted.len(),
            "coordinator state loaded"
        );
        Ok(core)
    }

    pub fn close(&self) {
        self.store.close();
    }

    fn notify(&self, update: Update) {
        // No subscribers is fine: nobody is watching.
        let _ = self.updates.send(update);
    }

    fn alive(&self, d: &Daemon, now: Instant) -> bool {
        age(now, d.last_seen) <= self.timing.lease
    }

    fn commit(&mut self, rec: JobRecord, durable: bool) -> Result<(), ApiError> {
        self.store.put_job(&rec, None, durable)?;
        let id = rec.id;
        let ended = rec.state.is_terminal() && rec.checkpoint_epoch.is_some();
        self.jobs.insert(id, rec);
        self.notify(Update::State(id));
        if ended {
            self.prune_checkpoints()?;
        }
        Ok(())
    }

    /// Deletes the checkpoints of finished jobs but the newest `keep_finished_checkpoints`
    /// by finish time (then id): every job's final checkpoint stayed in the database before,
    /// 35 MB after about 60 small jobs. Queued and running jobs keep theirs (a retry resumes
    /// from it).
    fn prune_checkpoints(&mut self) -> Result<(), ApiError> {
        let mut finished: Vec<(u64, JobId)> = self
            .jobs
            .values()
            .filter(|r| r.state.is_terminal() && r.checkpoint_epoch.is_some())
            .map(|r| (r.finished_at_ms.unwrap_or(0), r.id))
            .collect();
        finished.sort_unstable_by(|a, b| b.cmp(a));
        let keep = self.limits.keep_finished_checkpoints;
        for &(_, id) in finished.iter().skip(keep) {
            let Some(rec) = self.jobs.get_mut(&id) else {
                continue;
            };
            let mut pruned = rec.clone();
            pruned.checkpoint_epoch = None;
            self.store.drop_checkpoint(&pruned)?;
            *rec = pruned;
            tracing::info!(
                job = id,
                "deleted the checkpoint of a finished job (keep_finished_checkpoints = {keep})"
            );
        }
        Ok(())
    }

    // ---- jobs -----------------------------------------------------------------------------

    pub fn submit(&mut self, spec: JobSpec, now: Instant) -> Result<JobStatus, ApiError> {
        let id = self.next_job_id;
        let rec = JobRecord::queued(id, spec, now_ms());
        self.store
            .put_job(&rec, Some((NEXT_JOB_ID, id + 1)), true)?;
        self.next_job_id = id + 1;
        tracing::info!(job = id, name = %rec.spec.display_name(), "job submitted");
        self.jobs.insert(id, rec);
        self.queue.push_back(id);
        self.notify(Update::State(id));
        self.schedule(now);
        Ok(self.status(id, true).expect("just inserted"))
    }

    pub fn status(&self, id: JobId, with_history: bool) -> Option<JobStatus> {
        let rec = self.jobs.get(&id)?;
        let mut bytes_total = LinkBytes::default();
        for p in &rec.history {
            bytes_total.add(&p.bytes);
        }
        Some(JobStatus {
            id,
            name: rec.spec.display_name(),
            state: rec.state.clone(),
            spec: rec.spec.clone(),
            submitted_at_ms: rec.submitted_at_ms,
            started_at_ms: rec.started_at_ms,
            finished_at_ms: rec.finished_at_ms,
            servers: rec.servers.iter().map(|s| s.label.clone()).collect(),
            waiting_for: self.waiting.get(&id).cloned(),
            latest: rec.history.last().cloned(),
            bytes_total,
            history: if with_history {
                rec.history.clone()
            } else {
                Vec::new()
            },
            summary: rec.summary.clone(),
            attempt: rec.attempt(),
            retries: rec.retries.clone(),
            checkpoint_epoch: rec.checkpoint_epoch,
        })
    }

    pub fn list(&self) -> Vec<JobStatus> {
        self.jobs
            .keys()
            .filter_map(|&id| self.status(id, false))
            .collect()
    }

    pub fn cancel(&mut self, id: JobId, now: Instant) -> Result<JobStatus, ApiError> {
        let rec = self.job(id)?;
        if rec.state.is_terminal() {
            return Err(ApiError::conflict(
                "job_finished",
                format!("job {id} already {}; nothing to cancel", rec.state.name()),
            ));
        }
        let mut rec = rec.clone();
        rec.state = JobState::Cancelled;
        rec.finished_at_ms = Some(now_ms());
        self.commit(rec, true)?;
        self.queue.retain(|&q| q != id);
        self.waiting.remove(&id);
        tracing::info!(job = id, "job cancelled");
        // Its servers are free now (their daemons learn to stop from heartbeat replies), or it
        // was the head of the queue and blocked the jobs behind it.
        self.schedule(now);
        Ok(self.status(id, true).expect("exists"))
    }

    // ---- daemons --------------------------------------------------------------------------

    pub fn register(
        &mut self,
        req: RegisterRequest,
        now: Instant,
    ) -> Result<RegisterResponse, ApiError> {
        // The label is the node name of the daemon's certificate (what the data plane and a
        // `daemon_ca` check), so it obeys the same rule, within 128 bytes.
        let label = req.label.as_str();
        if let Err(e) = grandis_quic::certs::validate_node_name(label) {
            return Err(ApiError::bad_request(
                "invalid_registration",
                format!("label: {e} (the label is its certificate's node name)"),
            ));
        }
        if label.len() > 128 {
            return Err(ApiError::bad_request(
                "invalid_registration",
                format!("label: at most 128 bytes, got {}", label.len()),
            ));
        }
        // Free text from a daemon ends up in log lines, `GET /v1/cluster` and terminals: no
        // control characters (a newline could forge a log line), bounded lengths.
        let printable = |field: &str, value: &str, max: usize| {
            if value.len() > max || value.chars().any(char::is_control) {
                Err(ApiError::bad_request(
                    "invalid_registration",
                    format!(
                        "{field}: must be at most {max} bytes without control characters \
                         (newlines, tabs, escape codes), got {} bytes",
                        value.len()
                    ),
                ))
            } else {
                Ok(())
            }
        };
        printable("daemon_version", &req.daemon_version, 64)?;
        printable("data_addr", &req.data_addr, 256)?;
        for d in &req.devices {
            printable("devices.name", &d.name, 128)?;
        }
        let port_ok = req
            .data_addr
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !port_ok {
            return Err(ApiError::bad_request(
                "invalid_registration",
                format!(
                    "data_addr: expected host:port of the QUIC data plane, got {:?}",
                    req.data_addr
                ),
            ));
        }
        let id = self.next_daemon_id;
        self.store.put_meta(NEXT_DAEMON_ID, id + 1)?;
        self.next_daemon_id = id + 1;
        tracing::info!(
            daemon = id,
            label,
            devices = req.devices.len(),
            data_addr = %req.data_addr,
            version = %req.daemon_version,
            "daemon registered"
        );
        self.daemons.insert(
            id,
            Daemon {
                id,
                label: label.to_string(),
                devices: req.devices,
                memory_bytes: req.memory_bytes,
                data_addr: req.data_addr,
                version: req.daemon_version,
                last_seen: now,
                state: DaemonState::Idle,
                job: None,
                up: true,
            },
        );
        self.labels.entry(label.to_string()).or_default();
        self.tick(now);
        Ok(RegisterResponse {
            protocol_version: PROTOCOL_VERSION,
            daemon_id: id,
            heartbeat_interval_ms: self.timing.heartbeat_interval.as_millis() as u64,
            lease_ms: self.timing.lease.as_millis() as u64,
            down_timeout_ms: self.timing.down_timeout.as_millis() as u64,
            session: None,
        })
    }

    /// Whether daemon `id` is registered (and not forgotten).
    pub fn knows_daemon(&self, id: DaemonId) -> bool {
        self.daemons.contains_key(&id)
    }

    /// Whether daemon `daemon` is one of the servers of job `id`'s current (or last) run.
    pub fn assigned(&self, id: JobId, daemon: DaemonId) -> Result<bool, ApiError> {
        Ok(self.job(id)?.servers.iter().any(|s| s.daemon_id == daemon))
    }

    pub fn heartbeat(
        &mut self,
        req: HeartbeatRequest,
        now: Instant,
    ) -> Result<HeartbeatResponse, ApiError> {
        let id = req.daemon_id;
        if req.state == DaemonState::Down {
            return Err(ApiError::bad_request(
                "invalid_heartbeat",
                "state: a daemon reports idle, running or draining (down is the coordinator's \
                 word for a daemon it does not hear from)",
            ));
        }
        if req.job.is_some_and(|job| job.attempt == 0) {
            return Err(ApiError::bad_request(
                "invalid_heartbeat",
                "job.attempt: attempts are numbered from 1",
            ));
        }
        let d = self.daemons.get_mut(&id).ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "unknown_daemon",
                format!("unknown daemon id {id}; register again"),
            )
        })?;
        if !d.up {
            tracing::info!(daemon = id, label = %d.label, "daemon is back");
        }
        d.last_seen = now;
        d.state = req.state;
        d.job = req.job;
        d.up = true;
        let label = d.label.clone();
        self.tick(now);

        let mut cancel = Vec::new();
        if let Some(job) = req.job {
            let ours = self
                .jobs
                .get(&job.job_id)
                .filter(|rec| rec.state.is_active() && rec.attempt() == job.attempt)
                .and_then(|rec| {
                    rec.servers
                        .iter()
                        .position(|s| s.daemon_id == id)
                        .map(|_| rec)
                });
            match ours {
                Some(rec) if rec.state == JobState::Assigned => {
                    let mut rec = rec.clone();
                    rec.start();
                    self.commit(rec, true)?;
                }
                Some(_) => {}
                None => cancel.push(job.job_id),
            }
        }

        let lab = self.labels.get(&label).cloned().unwrap_or_default();
        let is_head = lab.head == Some(id);
        let head = lab.head.and_then(|h| {
            self.daemons.get(&h).map(|d| HeadInfo {
                daemon_id: h,
                data_addr: d.data_addr.clone(),
            })
        });
        let assignment = if is_head {
            self.jobs
                .values()
                .filter(|rec| rec.state.is_active())
                .find_map(|rec| {
                    let idx = rec.servers.iter().position(|s| s.daemon_id == id)?;
                    Some(Assignment {
                        job_id: rec.id,
                        // An elastic retry may run on fewer servers than submitted.
                        spec: JobSpec {
                            servers: rec.servers.len() as u32,
                            ..rec.spec.clone()
                        },
                        server_index: idx as u32,
                        servers: rec.servers.clone(),
                        attempt: rec.attempt(),
                        resume_epoch: rec.resume_epoch(),
                    })
                })
        } else {
            None
        };
        Ok(HeartbeatResponse {
            protocol_version: PROTOCOL_VERSION,
            term: lab.term,
            is_head,
            head,
            assignment,
            cancel,
        })
    }

    /// `attempt`: the run the event is about (None: the current one). A `finished` report of
    /// the run a coordinator restart ended is taken from that run's leader (by label: it
    /// registered anew) while the job waits to run again ([`Core::finish_restarted_run`]).
    pub fn job_event(
        &mut self,
        job_id: JobId,
        daemon_id: DaemonId,
        attempt: Option<u32>,
        event: JobEvent,
        now: Instant,
    ) -> Result<(), ApiError> {
        if !self.daemons.contains_key(&daemon_id) {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "unknown_daemon",
                format!("unknown daemon id {daemon_id}; register again"),
            ));
        }
        let rec = self.job(job_id)?;
        if let (Some(a), JobEvent::Finished { summary }) = (attempt, &event) {
            if self.restarted_run_leader(rec, a, daemon_id) {
                let summary = summary.clone();
                return self.finish_restarted_run(job_id, a, summary, now);
            }
        }
        if let Some(a) = attempt.filter(|&a| a != rec.attempt()) {
            return Err(ApiError::conflict(
                "stale_attempt",
                format!(
                    "job {job_id} is at run {}, not run {a}; this run's events are no longer \
                     taken",
                    rec.attempt()
                ),
            ));
        }
        let Some(idx) = rec.servers.iter().position(|s| s.daemon_id == daemon_id) else {
            return Err(ApiError::conflict(
                "not_assigned",
                format!("daemon {daemon_id} is not assigned to job {job_id}"),
            ));
        };
        if rec.state.is_terminal() {
            return Err(ApiError::conflict(
                "job_finished",
                format!(
                    "job {job_id} is already {}; stop working on it",
                    rec.state.name()
                ),
            ));
        }
        let label = rec.servers[idx].label.clone();
        let mut rec = rec.clone();
        let start = |rec: &mut JobRecord| {
            if rec.state == JobState::Assigned {
                rec.start();
            }
        };
        match event {
            JobEvent::Started => {
                start(&mut rec);
                self.commit(rec, true)?;
            }
            JobEvent::Progress { progress } => {
                if idx != 0 {
                    return Err(ApiError::conflict(
                        "not_leader",
                        format!(
                            "only the job's leader (server index 0, '{}') reports progress; \
                             daemon {daemon_id} is server {idx} ('{label}')",
                            rec.servers[0].label
                        ),
                    ));
                }
                if progress.epoch < 1 || progress.epoch > rec.spec.epochs {
                    return Err(ApiError::bad_request(
                        "invalid_event",
                        format!(
                            "progress.epoch: must be between 1 and the job's epochs ({}), got {}",
                            rec.spec.epochs, progress.epoch
                        ),
                    ));
                }
                // Retries after a lost reply re-send an epoch already recorded: ignore them.
                if rec
                    .history
                    .last()
                    .is_some_and(|p| p.epoch >= progress.epoch)
                {
                    return Ok(());
                }
                let was_assigned = rec.state == JobState::Assigned;
                start(&mut rec);
                rec.history.push(progress.clone());
                // Epoch records are frequent: skip the fsync (the next durable commit covers them).
                self.store.put_job(&rec, None, false)?;
                self.jobs.insert(job_id, rec);
                if was_assigned {
                    self.notify(Update::State(job_id));
                }
                self.notify(Update::Progress(job_id, progress));
            }
            JobEvent::Finished { summary } => {
                start(&mut rec);
                if !rec.finished_servers.contains(&(idx as u32)) {
                    rec.finished_servers.push(idx as u32);
                }
                if idx == 0 {
                    rec.summary = Some(*summary);
                }
                let done = rec.finished_servers.len() == rec.servers.len();
                if done {
                    rec.state = JobState::Succeeded;
                    rec.finished_at_ms = Some(now_ms());
                    tracing::info!(job = job_id, "job succeeded");
                }
                self.commit(rec, true)?;
                if done {
                    self.schedule(now);
                }
            }
            JobEvent::Measured { rates } => {
                tracing::info!(job = job_id, server = %label, ?rates, "server rates measured");
                self.labels.entry(label).or_default().rates = Some(rates);
            }
            JobEvent::Failed { reason, retryable } => {
                self.end_run(
                    job_id,
                    format!(
                        "server '{label}': {}",
                        plain_text(&reason, REASON_MAX_BYTES)
                    ),
                    Ending::Job { retryable },
                )?;
                self.schedule(now);
            }
        }
        Ok(())
    }

    /// Whether `daemon_id` was the leader of run `attempt` of `rec`, the run before the current
    /// one, ended by a coordinator restart, while the job has not run again (queued, or
    /// assigned with no server started: registering anew may assign it at once).
    fn restarted_run_leader(&self, rec: &JobRecord, attempt: u32, daemon_id: DaemonId) -> bool {
        let label = self.daemons.get(&daemon_id).map(|d| d.label.as_str());
        matches!(rec.state, JobState::Queued | JobState::Assigned)
            && attempt + 1 == rec.attempt()
            && rec
                .retries
                .last()
                .is_some_and(|r| r.restart && r.servers.first().map(String::as_str) == label)
    }

    /// Takes the `finished` report of the run a coordinator restart ended (its leader finished
    /// it while the coordinator was down): the job succeeds with that run's summary, the
    /// retry the restart queued is undone, and the run is not repeated.
    fn finish_restarted_run(
        &mut self,
        id: JobId,
        attempt: u32,
        summary: Box<grandis_wire::RunSummary>,
        now: Instant,
    ) -> Result<(), ApiError> {
        let mut rec = self.jobs[&id].clone();
        rec.retries.pop();
        // An assignment of the next run, not started yet, is withdrawn: its servers are told
        // to stop at their next heartbeat, as for any job that ended.
        rec.servers.clear();
        rec.state = JobState::Succeeded;
        rec.summary = Some(*summary);
        rec.finished_at_ms = Some(now_ms());
        tracing::info!(
            job = id,
            attempt,
            "job succeeded: its run finished while the coordinator was down"
        );
        self.commit(rec, true)?;
        self.queue.retain(|&q| q != id);
        self.schedule(now);
        Ok(())
    }

    // ---- time-driven rules ----------------------------------------------------------------

    /// Applies every time-driven rule: down marks, elections, lost servers, scheduling.
    pub fn tick(&mut self, now: Instant) {
        let down_timeout = self.timing.down_timeout;
        for d in self.daemons.values_mut() {
            let up = age(now, d.last_seen) <= down_timeout;
            if d.up && !up {
                tracing::warn!(daemon = d.id, label = %d.label,
                    "daemon is down (no heartbeat for {:.1} s)", age(now, d.last_seen).as_secs_f64());
            }
            d.up = up;
        }
        let forget_after = self.timing.forget_after;
        self.daemons.retain(|_, d| {
            let gone = age(now, d.last_seen) > forget_after;
            if gone {
                tracing::info!(daemon = d.id, label = %d.label,
                    "forgetting daemon, down for {:.0} s", age(now, d.last_seen).as_secs_f64());
            }
            !gone
        });
        self.elect(now);
        self.fail_lost_jobs(now);
        self.schedule(now);
    }

    fn elect(&mut self, now: Instant) {
        let lease = self.timing.lease;
        let daemons = &self.daemons;
        let alive = |d: &Daemon| age(now, d.last_seen) <= lease;
        for (name, lab) in self.labels.iter_mut() {
            if lab.head.and_then(|h| daemons.get(&h)).is_some_and(&alive) {
                continue;
            }
            if let Some(old) = lab.head.take() {
                tracing::warn!(label = %name, daemon = old, term = lab.term, "head lost its lease");
            }
            let candidate = daemons
                .values()
                .filter(|d| &d.label == name && alive(d) && d.state != DaemonState::Draining)
                .map(|d| d.id)
                .min();
            if let Some(c) = candidate {
                lab.term += 1;
                lab.head = Some(c);
                self.elections += 1;
                tracing::info!(label = %name, daemon = c, term = lab.term, "head elected");
                if let Err(e) = self.store.put_term(name, lab.term) {
                    tracing::error!("persisting the term of '{name}': {e:#}");
                }
            }
        }
    }

    fn fail_lost_jobs(&mut self, now: Instant) {
        let mut failures = Vec::new();
        for rec in self.jobs.values().filter(|r| r.state.is_active()) {
            for slot in &rec.servers {
                let problem = match self.daemons.get(&slot.daemon_id) {
                    None => Some("is no longer registered".to_string()),
                    Some(d) if !self.alive(d, now) => Some(format!(
                        "stopped heartbeating (last seen {:.1} s ago)",
                        age(now, d.last_seen).as_secs_f64()
                    )),
                    Some(d) if self.labels.get(&d.label).and_then(|l| l.head) != Some(d.id) => {
                        Some("lost its head daemon".to_string())
                    }
                    _ => None,
                };
                if let Some(p) = problem {
                    failures.push((rec.id, format!("server '{}' {p}", slot.label)));
                    break;
                }
            }
        }
        for (id, reason) in failures {
            if let Err(e) = self.end_run(id, reason, Ending::Job { retryable: true }) {
                tracing::error!("ending the run of job {id}: {}", e.message);
            }
        }
    }

    /// Ends the current run of an active job: back to the queue when `retryable` and retries
    /// are left (see the module docs), else failed with `reason`. The caller schedules.
    fn end_run(&mut self, id: JobId, reason: String, ending: Ending) -> Result<(), ApiError> {
        let mut rec = self.jobs[&id].clone();
        let charged = JobRetry::charged(&rec.retries);
        let restarts = rec.retries.len() as u32 - charged;
        let max_restarts = self.limits.max_restart_retries;
        let retried = match ending {
            Ending::Job { retryable } => retryable && charged < rec.spec.max_retries,
            Ending::Restart => restarts < max_restarts,
        };
        if !retried {
            let reason = match (ending, charged) {
                (Ending::Restart, _) => format!(
                    "{reason}; gave up after {restarts} runs ended by coordinator restarts \
                     (max_restart_retries = {max_restarts})"
                ),
                (Ending::Job { retryable: true }, 0) => {
                    format!("{reason}; not retried (max_retries = 0)")
                }
                (Ending::Job { retryable: true }, n) => {
                    format!("{reason}; gave up after {n} retries")
                }
                (Ending::Job { retryable: false }, _) => reason,
            };
            tracing::warn!(job = id, %reason, "job failed");
            rec.state = JobState::Failed { reason };
            rec.finished_at_ms = Some(now_ms());
            return self.commit(rec, true);
        }
        let resume_epoch = rec.checkpoint_epoch;
        tracing::warn!(
            job = id,
            %reason,
            attempt = rec.attempt() + 1,
            resume_epoch = ?resume_epoch,
            "job goes back to the queue"
        );
        rec.retries.push(JobRetry {
            at_ms: now_ms(),
            reason,
            resume_epoch,
            restart: ending == Ending::Restart,
            servers: rec.servers.iter().map(|s| s.label.clone()).collect(),
        });
        rec.state = JobState::Queued;
        rec.servers.clear();
        rec.finished_servers.clear();
        rec.summary = None;
        // The next run repeats the epochs after the checkpoint: they are reported again. A run
        // a restart ended keeps them until the next run starts: it may have finished while
        // the coordinator was down, and its report still be taken.
        if ending != Ending::Restart {
            rec.history
                .retain(|p| resume_epoch.is_some_and(|e| p.epoch <= e));
        }
        self.commit(rec, true)?;
        // Its place in the queue is its id's (it was submitted before the jobs behind it).
        let at = self.queue.partition_point(|&q| q < id);
        self.queue.insert(at, id);
        Ok(())
    }

    /// Stores a checkpoint the leader of job `id`'s current run (`attempt`) wrote after
    /// `epoch`. A stale upload (an older epoch, a retried request) is ignored.
    /// Whether an upload of job `id`'s checkpoint for `epoch` by `daemon_id` in `attempt` is
    /// taken, decided before its body is read: an error when it is refused (unknown job, an
    /// attempt no longer running, not the leader, an epoch out of range), `false` when a
    /// checkpoint as new is stored already (a safe retry, ignored).
    pub fn checkpoint_wanted(
        &self,
        id: JobId,
        daemon_id: DaemonId,
        attempt: u32,
        epoch: u32,
    ) -> Result<bool, ApiError> {
        let rec = self.job(id)?;
        if !rec.state.is_active() || rec.attempt() != attempt {
            return Err(ApiError::conflict(
                "not_running",
                format!(
                    "job {id} is {} at attempt {}, not running attempt {attempt}; its \
                     checkpoints are no longer taken",
                    rec.state.name(),
                    rec.attempt()
                ),
            ));
        }
        if rec.servers.first().map(|s| s.daemon_id) != Some(daemon_id) {
            return Err(ApiError::conflict(
                "not_leader",
                format!("only the leader (server index 0) of job {id} uploads checkpoints"),
            ));
        }
        if epoch < 1 || epoch > rec.spec.epochs {
            return Err(ApiError::bad_request(
                "invalid_checkpoint",
                format!(
                    "epoch: must be between 1 and the job's epochs ({}), got {epoch}",
                    rec.spec.epochs
                ),
            ));
        }
        Ok(rec.checkpoint_epoch.is_none_or(|e| e < epoch))
    }

    /// Job `id`'s record; a 404 naming it when there is none.
    fn job(&self, id: JobId) -> Result<&JobRecord, ApiError> {
        self.jobs
            .get(&id)
            .ok_or_else(|| ApiError::not_found(format!("no job {id}")))
    }

    /// The spec job `id` was submitted with (what its checkpoints are checked against).
    pub fn job_spec(&self, id: JobId) -> Result<JobSpec, ApiError> {
        self.job(id).map(|rec| rec.spec.clone())
    }

    /// Stores job `id`'s checkpoint for `epoch` if [`Core::checkpoint_wanted`] still says so
    /// (the job may have moved on while the body was read). The bytes were checked against
    /// the job first (`grandis_wire::checkpoint::check_upload`, outside the core's lock: a
    /// checksum over hundreds of MB takes a while).
    pub fn put_checkpoint(
        &mut self,
        id: JobId,
        daemon_id: DaemonId,
        attempt: u32,
        epoch: u32,
        bytes: &[u8],
    ) -> Result<(), ApiError> {
        if !self.checkpoint_wanted(id, daemon_id, attempt, epoch)? {
            return Ok(());
        }
        if bytes.is_empty() {
            return Err(ApiError::bad_request(
                "invalid_checkpoint",
                "the checkpoint is empty".to_string(),
            ));
        }
        let mut rec = self.job(id)?.clone();
        rec.checkpoint_epoch = Some(epoch);
        self.store.put_checkpoint(&rec, bytes)?;
        tracing::debug!(job = id, epoch, bytes = bytes.len(), "checkpoint stored");
        self.jobs.insert(id, rec);
        Ok(())
    }

    /// The job's stored checkpoint and its epoch.
    pub fn checkpoint(&self, id: JobId) -> Result<(u32, Vec<u8>), ApiError> {
        let rec = self.job(id)?;
        let missing = || {
            let why = if rec.state.is_terminal() {
                "none was taken, or it was deleted as older than the newest \
                 keep_finished_checkpoints finished jobs'"
            } else {
                "give it checkpoint_every, or wait for its first one"
            };
            ApiError::not_found(format!("job {id} has no checkpoint ({why})"))
        };
        let epoch = rec.checkpoint_epoch.ok_or_else(missing)?;
        let bytes = self.store.checkpoint(id)?.ok_or_else(missing)?;
        Ok((epoch, bytes))
    }

    /// Assigns queued jobs in FIFO order while the oldest one fits. A job that could not run
    /// even with every server that is up (more servers, or more devices, than the cluster
    /// has) does not hold the queue: later jobs pass it until enough servers come up. A
    /// server is free once no job is active on it *and* its daemon says it has finished its
    /// last one (a cancelled job may still be winding down there; the next job would meet
    /// its leftovers).
    fn schedule(&mut self, now: Instant) {
        self.waiting.clear();
        let busy: HashSet<&str> = self
            .jobs
            .values()
            .filter(|r| r.state.is_active())
            .flat_map(|r| r.servers.iter().map(|s| s.label.as_str()))
            .collect();
        let mut free: Vec<(String, DaemonId)> = self
            .labels
            .iter()
            .filter(|(name, _)| !busy.contains(name.as_str()))
            .filter_map(|(name, lab)| {
                let d = self.daemons.get(&lab.head?)?;
                (self.alive(d, now) && d.state != DaemonState::Draining && d.job.is_none())
                    .then(|| (name.clone(), d.id))
            })
            .collect();
        // Devices of each server that is up (its head's), to tell "busy" from "never enough".
        let up_devices: Vec<usize> = self
            .labels
            .values()
            .filter_map(|lab| self.daemons.get(&lab.head?))
            .filter(|d| self.alive(d, now))
            .map(|d| d.devices.len())
            .collect();
        let mut blocked_by: Option<JobId> = None;
        let mut assigned = Vec::new();
        for &id in &self.queue {
            let rec = &self.jobs[&id];
            let devices = rec.spec.devices as usize;
            let could = up_devices.iter().filter(|&&n| n >= devices).count();
            // An elastic retry takes the servers that remain (at least one).
            let servers = if rec.spec.elastic && !rec.retries.is_empty() {
                (rec.spec.servers as usize).min(could).max(1)
            } else {
                rec.spec.servers as usize
            };
            if let Some(first) = blocked_by {
                self.waiting
                    .insert(id, format!("behind job {first}, which waits for servers"));
                continue;
            }
            let fitting: Vec<usize> = free
                .iter()
                .enumerate()
                .filter(|(_, (_, h))| self.daemons[h].devices.len() >= devices)
                .map(|(i, _)| i)
                .take(servers)
                .collect();
            if fitting.len() < servers {
                let why = format!(
                    "needs {servers} free server(s) with ≥ {devices} device(s) each; {} free, \
                     {} up ({could} with enough devices)",
                    fitting.len(),
                    up_devices.len()
                );
                if could >= servers {
                    // It fits the cluster once servers free up: keep FIFO, so it is not
                    // starved by smaller jobs passing it.
                    blocked_by = Some(id);
                    self.waiting.insert(id, why);
                } else {
                    self.waiting.insert(
                        id,
                        format!("{why}; later jobs run first until enough servers are up"),
                    );
                }
                continue;
            }
            let slots: Vec<ServerSlot> = fitting
                .iter()
                .map(|&i| {
                    let (label, h) = &free[i];
                    ServerSlot {
                        label: label.clone(),
                        daemon_id: *h,
                        data_addr: self.daemons[h].data_addr.clone(),
                    }
                })
                .collect();
            let mut rec = self.jobs[&id].clone();
            rec.state = JobState::Assigned;
            rec.servers = slots;
            assigned.push(rec);
            for &i in fitting.iter().rev() {
                free.remove(i);
            }
        }
        for rec in assigned {
            let id = rec.id;
            let labels: Vec<&str> = rec.servers.iter().map(|s| s.label.as_str()).collect();
            tracing::info!(job = id, servers = ?labels, "job assigned");
            if let Err(e) = self.commit(rec, true) {
                tracing::error!("assigning job {id}: {}", e.message);
                continue;
            }
            self.queue.retain(|&q| q != id);
        }
    }

    // ---- views ----------------------------------------------------------------------------

    pub fn cluster(&self, now: Instant) -> ClusterView {
        let active_job = |label: &str| {
            self.jobs
                .values()
                .find(|r| r.state.is_active() && r.servers.iter().any(|s| s.label == label))
                .map(|r| r.id)
        };
        let servers = self
            .labels
            .iter()
            // A server whose daemons were all forgotten is gone from the view (its term stays
            // in the database for when it returns).
            .filter(|(name, _)| self.daemons.values().any(|d| &d.label == *name))
            .map(|(name, lab)| ServerView {
                label: name.clone(),
                term: lab.term,
                head: lab.head.and_then(|h| {
                    self.daemons.get(&h).map(|d| HeadInfo {
                        daemon_id: h,
                        data_addr: d.data_addr.clone(),
                    })
                }),
                up: lab.head.is_some(),
                job: active_job(name),
                daemons: self
                    .daemons
                    .values()
                    .filter(|d| &d.label == name)
                    .map(|d| d.id)
                    .collect(),
                rates: lab.rates.clone(),
            })
            .collect();
        let daemons = self
            .daemons
            .values()
            .map(|d| DaemonView {
                id: d.id,
                label: d.label.clone(),
                up: d.up,
                is_head: self.labels.get(&d.label).and_then(|l| l.head) == Some(d.id),
                // A daemon not heard from is down, whatever it last said it was doing: its
                // job (if any) is the coordinator's to retry, not its to run.
                state: if d.up { d.state } else { DaemonState::Down },
                job: d.job.filter(|_| d.up).map(|j| j.job_id),
                epoch: d.job.filter(|_| d.up).map(|j| j.epoch),
                devices: d.devices.clone(),
                memory_bytes: d.memory_bytes,
                data_addr: d.data_addr.clone(),
                daemon_version: d.version.clone(),
                last_heartbeat_age_s: age(now, d.last_seen).as_secs_f64(),
            })
            .collect();
        ClusterView {
            heartbeat_interval_ms: self.timing.heartbeat_interval.as_millis() as u64,
            lease_ms: self.timing.lease.as_millis() as u64,
            down_timeout_ms: self.timing.down_timeout.as_millis() as u64,
            servers,
            daemons,
        }
    }
}

/// The longest failure reason from a daemon kept (the job's `reason`, log lines).
const REASON_MAX_BYTES: usize = 4096;

/// `text` as one plain line for logs, terminals and job reasons: control characters (a newline
/// could forge a log line, an escape code repaint a terminal) become spaces, and it is cut to
/// `max` bytes at a character boundary, marked with an ellipsis.
fn plain_text(text: &str, max: usize) -> String {
    let mut out: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if out.len() > max {
        let mut end = max.saturating_sub('…'.len_utf8());
        while !out.is_char_boundary(end) {
            end -= 1;
        }
        out.truncate(end);
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    //! The rules with a synthetic clock (the HTTP tests in `tests/` cover the same paths
    //! end to end with real time).
    use super::*;

    fn core(dir: &std::path::Path) -> Core {
        core_keeping(dir, 20)
    }

    /// A core keeping the checkpoints of the newest `keep` finished jobs.
    fn core_keeping(dir: &std::path::Path, keep: usize) -> Core {
        let store = Store::open(&dir.join("c.redb")).unwrap();
        let timing = Timing {
            heartbeat_interval: Duration::from_millis(100),
            lease: Duration::from_millis(300),
            down_timeout: Duration::from_millis(1000),
            forget_after: Duration::from_millis(5000),
        };
        let limits = Limits {
            keep_finished_checkpoints: keep,
            max_restart_retries: 2,
        };
        Core::open(store, timing, limits, broadcast::channel(16).0).unwrap()
    }

    fn reg(c: &mut Core, label: &str, devices: usize, now: Instant) -> DaemonId {
        c.register(
            RegisterRequest {
                protocol_version: PROTOCOL_VERSION,
                label: label.into(),
                devices: vec![
                    DeviceInfo {
                        name: "cpu".into(),
                        memory_bytes: 1 << 30
                    };
                    devices
                ],
                memory_bytes: 1 << 34,
                data_addr: format!("{label}:4433"),
                daemon_version: "test".into(),
                proof: None,
            },
            now,
        )
        .unwrap()
        .daemon_id
    }

    fn hb(c: &mut Core, id: DaemonId, now: Instant) -> HeartbeatResponse {
        c.heartbeat(
            HeartbeatRequest {
                protocol_version: PROTOCOL_VERSION,
                daemon_id: id,
                state: DaemonState::Idle,
                job: None,
            },
            now,
        )
        .unwrap()
    }

    fn submit(c: &mut Core, spec: JobSpec, now: Instant) -> JobId {
        c.submit(spec, now).unwrap().id
    }

    /// A one-server job that checkpoints every epoch.
    fn checkpointed() -> JobSpec {
        JobSpec {
            checkpoint_every: Some(1),
            ..spec(1, 1)
        }
    }

    fn spec(servers: u32, devices: u32) -> JobSpec {
        JobSpec {
            dataset: "/d".into(),
            servers,
            devices,
            ..JobSpec::default()
        }
    }

    #[test]
    fn election_failover_and_no_preemption() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = core(dir.path());
        let t0 = Instant::now();
        let a = reg(&mut c, "x", 1, t0);
        let b = reg(&mut c, "x", 1, t0);
        assert_eq!((c.labels["x"].head, c.labels["x"].term), (Some(a), 1));
        let r = hb(&mut c, b, t0 + Duration::from_millis(100));
        assert!(!r.is_head);
        assert_eq!(r.head.unwrap().daemon_id, a);
        // a stops; b keeps heartbeating past a's lease.
        let t1 = t0 + Duration::from_millis(400);
        let r = hb(&mut c, b, t1);
        assert!(r.is_head);
        assert_eq!(r.term, 2);
        assert_eq!(c.elections, 2);
        // a comes back: b stays head (no preemption by the lower id).
        let r = hb(&mut c, a, t1 + Duration::from_millis(50));
        assert!(!r.is_head);
        assert_eq!(r.term, 2);
    }

    /// A daemon not heard from is shown down in the cluster view, without the job it last
    /// reported, until it returns (then as it reports) or is forgotten; a heartbeat claiming
    /// `down` is refused.
    #[test]
    fn down_daemons_are_not_listed_running() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = core(dir.path());
        let t0 = Instant::now();
        let a = reg(&mut c, "a", 1, t0);
        let b = reg(&mut c, "b", 1, t0);
        let job = submit(&mut c, spec(1, 1), t0);
        let running = |state| HeartbeatRequest {
            protocol_version: PROTOCOL_VERSION,
            daemon_id: a,
            state,
            job: Some(DaemonJob {
                job_id: job,
                attempt: 1,
                epoch: 2,
            }),
        };
        c.heartbeat(running(DaemonState::Running), t0).unwrap();
        let view_of = |c: &Core, now| {
            c.cluster(now)
                .daemons
                .into_iter()
                .find(|d| d.id == a)
                .map(|d| (d.up, d.state, d.job, d.epoch))
        };
        assert_eq!(
            view_of(&c, t0),
            Some((true, DaemonState::Running, Some(job), Some(2)))
        );
        // `a` falls silent past the down timeout while `b` heartbeats.
        let t1 = t0 + Duration::from_millis(1500);
        hb(&mut c, b, t1);
        assert_eq!(
            view_of(&c, t1),
            Some((false, DaemonState::Down, None, None))
        );
        // Forgotten after `forget_after`: gone from the view.
        let t2 = t0 + Duration::from_millis(5500);
        hb(&mut c, b, t2);
        assert_eq!(view_of(&c, t2), None);
        let err = c
            .heartbeat(running(DaemonState::Down), t2)
            .expect_err("a daemon claiming to be down");
        assert_eq!(err.code, "invalid_heartbeat");
        // Attempts are numbered from 1: a heartbeat running attempt 0 is malformed, not a
        // stale run to cancel.
        let mut zeroth = running(DaemonState::Running);
        zeroth.job.as_mut().unwrap().attempt = 0;
        let err = c.heartbeat(zeroth, t2).expect_err("attempt 0");
        assert_eq!(err.code, "invalid_heartbeat");
        assert!(err.message.contains("job.attempt"), "{}", err.message);
    }

    #[test]
    fn fifo_with_head_of_line_blocking_and_device_fit() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = core(dir.path());
        let t0 = Instant::now();
        let a = reg(&mut c, "a", 2, t0);
        reg(&mut c, "b", 2, t0);
        let first = submit(&mut c, spec(1, 1), t0);
        assert_eq!(c.jobs[&first].servers[0].label, "a", "labels in name order");
        // Fits the cluster, but only once `a` is free again: it holds the queue.
        let big = submit(&mut c, spec(2, 2), t0);
        let small = submit(&mut c, spec(1, 1), t0);
        assert_eq!(c.jobs[&big].state, JobState::Queued);
        assert_eq!(c.jobs[&small].state, JobState::Queued, "strict FIFO");
        assert!(c.waiting[&big].contains("needs 2 free server(s) with ≥ 2 device(s)"));
        assert!(
            c.waiting[&small].starts_with("behind job 2"),
            "{}",
            c.waiting[&small]
        );
        // The first job ends on the coordinator's side, but `a`'s daemon still reports it
        // (winding down): `a` is not free until it says it is idle.
        let running = |c: &mut Core, ms| {
            c.heartbeat(
                HeartbeatRequest {
                    protocol_version: PROTOCOL_VERSION,
                    daemon_id: a,
                    state: DaemonState::Running,
                    job: Some(DaemonJob {
                        job_id: first,
                        attempt: 1,
                        epoch: 3,
                    }),
                },
                t0 + Duration::from_millis(ms),
            )
            .unwrap()
        };
        assert!(running(&mut c, 5).cancel.is_empty());
        c.cancel(first, t0 + Duration::from_millis(6)).unwrap();
        let r = running(&mut c, 10);
        assert_eq!(r.cancel, vec![first]);
        assert!(r.assignment.is_none(), "{:?}", r.assignment);
        assert_eq!(c.jobs[&big].state, JobState::Queued);
        hb(&mut c, a, t0 + Duration::from_millis(20));
        assert_eq!(c.jobs[&big].state, JobState::Assigned);
        assert_eq!(c.jobs[&small].state, JobState::Queued);
    }

    #[test]
    fn daemons_down_past_forget_after_leave_the_cluster_view() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = core(dir.path());
        let t0 = Instant::now();
        let a = reg(&mut c, "a", 1, t0);
        reg(&mut c, "b", 1, t0);
        let later = t0 + Duration::from_millis(4000);
        hb(&mut c, a, later);
        let view = c.cluster(later);
        assert_eq!(view.daemons.len(), 2, "down but remembered");
        assert!(view.daemons.iter().any(|d| d.label == "b" && !d.up));
        let much_later = t0 + Duration::from_millis(6000);
        hb(&mut c, a, much_later);
        let view = c.cluster(much_later);
        assert_eq!(view.daemons.len(), 1);
        assert_eq!(view.daemons[0].label, "a");
        assert_eq!(view.servers.len(), 1);
        assert_eq!(view.servers[0].label, "a");
    }

    #[test]
    fn a_job_larger_than_the_cluster_lets_later_jobs_pass() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = core(dir.path());
        let t0 = Instant::now();
        reg(&mut c, "a", 2, t0);
        reg(&mut c, "b", 1, t0);
        let too_big = submit(&mut c, spec(2, 2), t0);
        let small = submit(&mut c, spec(1, 1), t0);
        assert_eq!(c.jobs[&too_big].state, JobState::Queued);
        assert!(
            c.waiting[&too_big].contains("1 with enough devices")
                && c.waiting[&too_big].contains("later jobs run first"),
            "{}",
            c.waiting[&too_big]
        );
        assert_eq!(c.jobs[&small].state, JobState::Assigned);
        // Once a second 2-device server is up, the big job is next in line again.
        reg(&mut c, "c", 2, t0);
        let after = submit(&mut c, spec(1, 1), t0);
        assert_eq!(c.jobs[&too_big].state, JobState::Queued);
        assert_eq!(
            c.jobs[&after].state,
            JobState::Queued,
            "FIFO behind it again"
        );
    }

    #[test]
    fn lost_head_fails_its_job_naming_the_server() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = core(dir.path());
        let t0 = Instant::now();
        let a = reg(&mut c, "node-a", 1, t0);
        let b = reg(&mut c, "node-b", 1, t0);
        let no_retries = JobSpec {
            max_retries: 0,
            ..spec(2, 1)
        };
        let job = submit(&mut c, no_retries, t0);
        assert_eq!(c.jobs[&job].state, JobState::Assigned);
        let r = hb(&mut c, b, t0 + Duration::from_millis(50));
        assert_eq!(r.assignment.as_ref().unwrap().server_index, 1);
        // a keeps going, b goes silent.
        let mut t = t0;
        for _ in 0..5 {
            t += Duration::from_millis(100);
            hb(&mut c, a, t);
        }
        match &c.jobs[&job].state {
            JobState::Failed { reason } => {
                assert!(
                    reason.starts_with("server 'node-b' stopped heartbeating (last seen 0."),
                    "{reason}"
                )
            }
            other => panic!("{other:?}"),
        }
        // a is told to cancel when it reports the job.
        let r = c
            .heartbeat(
                HeartbeatRequest {
                    protocol_version: PROTOCOL_VERSION,
                    daemon_id: a,
                    state: DaemonState::Running,
                    job: Some(DaemonJob {
                        job_id: job,
                        attempt: 1,
                        epoch: 3,
                    }),
                },
                t,
            )
            .unwrap();
        assert_eq!(r.cancel, vec![job]);
        assert!(r.assignment.is_none());
    }

    fn progress(c: &mut Core, job: JobId, leader: DaemonId, epoch: u32, now: Instant) {
        let p = EpochProgress {
            epoch,
            loss: 1.0 / epoch as f64,
            train_acc: 0.0,
            val_acc: 0.0,
            seconds: 0.1,
            bytes: LinkBytes::default(),
        };
        c.job_event(job, leader, None, JobEvent::Progress { progress: p }, now)
            .unwrap();
    }

    fn running(
        c: &mut Core,
        d: DaemonId,
        job: JobId,
        attempt: u32,
        now: Instant,
    ) -> HeartbeatResponse {
        c.heartbeat(
            HeartbeatRequest {
                protocol_version: PROTOCOL_VERSION,
                daemon_id: d,
                state: DaemonState::Running,
                job: Some(DaemonJob {
                    job_id: job,
                    attempt,
                    epoch: 0,
                }),
            },
            now,
        )
        .unwrap()
    }

    #[test]
    fn a_lost_server_requeues_the_job_to_resume_from_its_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = core(dir.path());
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let a = reg(&mut c, "node-a", 1, t0);
        let b = reg(&mut c, "node-b", 1, t0);
        let job = submit(
            &mut c,
            JobSpec {
                checkpoint_every: Some(2),
                max_retries: 1,
                epochs: 10,
                ..spec(2, 1)
            },
            t0,
        );
        running(&mut c, a, job, 1, ms(10));
        running(&mut c, b, job, 1, ms(10));
        for e in 1..=5 {
            progress(&mut c, job, a, e, ms(20));
            if e % 2 == 0 {
                c.put_checkpoint(job, a, 1, e, format!("ck{e}").as_bytes())
                    .unwrap();
            }
        }
        // Only the leader of the current attempt uploads; stale epochs are ignored.
        assert_eq!(
            c.put_checkpoint(job, b, 1, 5, b"x").unwrap_err().code,
            "not_leader"
        );
        c.put_checkpoint(job, a, 1, 2, b"old").unwrap();
        assert_eq!(c.checkpoint(job).unwrap(), (4, b"ck4".to_vec()));

        // node-b goes silent: the job goes back to the queue, cut back to epoch 4.
        let mut t = ms(20);
        for _ in 0..5 {
            t += Duration::from_millis(100);
            running(&mut c, a, job, 1, t);
        }
        let st = c.status(job, true).unwrap();
        assert_eq!(st.state, JobState::Queued);
        assert_eq!(st.attempt, 2);
        let first_start = st.started_at_ms.expect("it ran");
        assert_eq!(st.history.len(), 4);
        assert_eq!(st.retries.len(), 1);
        assert!(st.retries[0]
            .reason
            .starts_with("server 'node-b' stopped heartbeating"));
        assert_eq!(st.retries[0].resume_epoch, Some(4));
        // a still runs attempt 1: it is told to cancel, and stays busy until it has.
        let r = running(&mut c, a, job, 1, t);
        assert_eq!(r.cancel, vec![job]);
        assert_eq!(
            c.put_checkpoint(job, a, 1, 6, b"late").unwrap_err().code,
            "not_running"
        );
        // node-b comes back as a new daemon; once a is idle the job runs again on both.
        let b2 = reg(&mut c, "node-b", 1, t);
        hb(&mut c, b2, t);
        assert_eq!(
            c.jobs[&job].state,
            JobState::Queued,
            "a has not stopped yet"
        );
        let r = hb(&mut c, a, t + Duration::from_millis(10));
        let asg = r.assignment.expect("assigned again");
        assert_eq!((asg.attempt, asg.resume_epoch), (2, Some(4)));
        assert_eq!(asg.spec.servers, 2);
        assert_ne!(asg.session(), 0);
        std::thread::sleep(Duration::from_millis(2));
        running(&mut c, a, job, 2, t + Duration::from_millis(20));
        assert_eq!(c.jobs[&job].state, JobState::Running);
        assert_eq!(
            c.jobs[&job].started_at_ms,
            Some(first_start),
            "a retry keeps the first start"
        );
        // Its second loss uses up its one retry.
        let mut t = t + Duration::from_millis(10);
        for _ in 0..5 {
            t += Duration::from_millis(100);
            running(&mut c, b2, job, 2, t);
        }
        match &c.jobs[&job].state {
            JobState::Failed { reason } => assert!(
                reason.starts_with("server 'node-a' stopped heartbeating")
                    && reason.ends_with("; gave up after 1 retries"),
                "{reason}"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_elastic_job_resumes_on_the_servers_that_remain() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = core(dir.path());
        let t0 = Instant::now();
        let a = reg(&mut c, "node-a", 1, t0);
        let b = reg(&mut c, "node-b", 1, t0);
        let job = submit(
            &mut c,
            JobSpec {
                elastic: true,
                ..spec(2, 1)
            },
            t0,
        );
        running(&mut c, a, job, 1, t0);
        running(&mut c, b, job, 1, t0);
        // b reports that its peer is gone (retryable) and then goes silent.
        c.job_event(
            job,
            b,
            None,
            JobEvent::Failed {
                reason: "peer gone".into(),
                retryable: true,
            },
            t0,
        )
        .unwrap();
        assert_eq!(c.jobs[&job].state, JobState::Queued);
        let mut t = t0;
        for _ in 0..5 {
            t += Duration::from_millis(100);
            hb(&mut c, a, t);
        }
        let st = c.status(job, false).unwrap();
        assert_eq!(st.state, JobState::Assigned);
        assert_eq!(st.servers, vec!["node-a".to_string()]);
        let asg = hb(&mut c, a, t).assignment.unwrap();
        assert_eq!(
            (asg.spec.servers, asg.attempt, asg.resume_epoch),
            (1, 2, None)
        );
        // A failure that is not retryable fails the job at once.
        c.job_event(
            job,
            a,
            None,
            JobEvent::Failed {
                reason: "dataset /d: not found".into(),
                retryable: false,
            },
            t,
        )
        .unwrap();
        assert_eq!(
            c.jobs[&job].state,
            JobState::Failed {
                reason: "server 'node-a': dataset /d: not found".into()
            }
        );
    }

    #[test]
    fn a_coordinator_restart_requeues_running_jobs() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = Instant::now();
        let job = {
            let mut c = core(dir.path());
            let a = reg(&mut c, "a", 1, t0);
            let job = submit(&mut c, checkpointed(), t0);
            running(&mut c, a, job, 1, t0);
            progress(&mut c, job, a, 1, t0);
            c.put_checkpoint(job, a, 1, 1, b"ck1").unwrap();
            progress(&mut c, job, a, 2, t0);
            c.close();
            job
        };
        let mut c = core(dir.path());
        let st = c.status(job, true).unwrap();
        assert_eq!(st.state, JobState::Queued);
        assert_eq!(st.retries[0].reason, RESTART_REASON);
        assert_eq!(st.retries[0].resume_epoch, Some(1));
        assert_eq!(st.retries[0].servers, vec!["a".to_string()]);
        // The run's epochs stay until the next run starts (its report may still come) ...
        assert_eq!(st.history.len(), 2);
        assert_eq!(c.checkpoint(job).unwrap(), (1, b"ck1".to_vec()));
        // ... which repeats those after the checkpoint.
        let a = reg(&mut c, "a", 1, t0);
        assert_eq!(hb(&mut c, a, t0).assignment.unwrap().resume_epoch, Some(1));
        assert_eq!(c.status(job, true).unwrap().history.len(), 2);
        running(&mut c, a, job, 2, t0);
        c.job_event(job, a, Some(2), JobEvent::Started, t0).unwrap();
        assert_eq!(c.status(job, true).unwrap().history.len(), 1);
    }

    /// A run that finished while the coordinator was down (its leader's report refused, the
    /// daemons registered anew) is taken when the leader sends the report again for that run:
    /// the job succeeds with its summary and history, the restart's retry undone. Only the
    /// leader's report of that run counts; other late events are refused as stale.
    #[test]
    fn a_run_finished_while_the_coordinator_was_down_is_taken() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = Instant::now();
        let job = {
            let mut c = core(dir.path());
            let a = reg(&mut c, "a", 1, t0);
            let b = reg(&mut c, "b", 1, t0);
            let job = submit(&mut c, spec(2, 1), t0);
            hb(&mut c, a, t0);
            running(&mut c, a, job, 1, t0);
            running(&mut c, b, job, 1, t0);
            progress(&mut c, job, a, 1, t0);
            progress(&mut c, job, a, 2, t0);
            c.close();
            job
        };
        let mut c = core(dir.path());
        assert_eq!(c.status(job, false).unwrap().state, JobState::Queued);
        let (a, b) = (reg(&mut c, "a", 1, t0), reg(&mut c, "b", 1, t0));
        let summary = || {
            Box::new(grandis_wire::RunSummary {
                final_loss: 0.5,
                ..Default::default()
            })
        };
        let stale = c
            .job_event(
                job,
                b,
                Some(1),
                JobEvent::Finished { summary: summary() },
                t0,
            )
            .unwrap_err();
        assert_eq!(stale.code, "stale_attempt", "{}", stale.message);
        c.job_event(
            job,
            a,
            Some(1),
            JobEvent::Finished { summary: summary() },
            t0,
        )
        .unwrap();
        let st = c.status(job, true).unwrap();
        assert_eq!(st.state, JobState::Succeeded);
        assert!(st.retries.is_empty());
        assert_eq!(st.history.len(), 2);
        assert_eq!(c.jobs[&job].summary.as_ref().unwrap().final_loss, 0.5);
        assert!(c.queue.is_empty());
        assert!(
            hb(&mut c, a, t0).assignment.is_none(),
            "the run is not repeated"
        );
    }

    /// Only the newest `keep_finished_checkpoints` finished jobs keep their checkpoints (a
    /// running job always keeps its own), when a job finishes and when the coordinator starts.
    #[test]
    fn finished_jobs_checkpoints_are_pruned_to_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = Instant::now();
        let (jobs, live) = {
            let mut c = core_keeping(dir.path(), 1);
            let a = reg(&mut c, "a", 1, t0);
            let b = reg(&mut c, "b", 1, t0);
            let mut jobs = Vec::new();
            for _ in 0..3 {
                let job = submit(&mut c, checkpointed(), t0);
                let d = hb(&mut c, a, t0)
                    .assignment
                    .map(|_| a)
                    .unwrap_or_else(|| hb(&mut c, b, t0).assignment.map(|_| b).unwrap());
                running(&mut c, d, job, 1, t0);
                progress(&mut c, job, d, 1, t0);
                c.put_checkpoint(job, d, 1, 1, b"ck1").unwrap();
                let summary = Box::new(grandis_wire::RunSummary::default());
                c.job_event(job, d, None, JobEvent::Finished { summary }, t0)
                    .unwrap();
                assert_eq!(c.jobs[&job].state, JobState::Succeeded);
                jobs.push(job);
            }
            // A running job keeps its checkpoint whatever the finished ones do.
            let live = submit(&mut c, checkpointed(), t0);
            hb(&mut c, a, t0).assignment.unwrap();
            running(&mut c, a, live, 1, t0);
            progress(&mut c, live, a, 1, t0);
            c.put_checkpoint(live, a, 1, 1, b"live").unwrap();
            for (i, &job) in jobs.iter().enumerate() {
                let kept = i == jobs.len() - 1;
                assert_eq!(c.checkpoint(job).is_ok(), kept, "job {job}");
                assert_eq!(c.jobs[&job].checkpoint_epoch.is_some(), kept, "job {job}");
            }
            c.close();
            (jobs, live)
        };
        // At start with none kept: every finished job's goes, the interrupted run's stays.
        let c = core_keeping(dir.path(), 0);
        for job in jobs {
            assert!(c.checkpoint(job).is_err(), "job {job}");
        }
        assert_eq!(c.checkpoint(live).unwrap(), (1, b"live".to_vec()));
    }

    /// A run ended by a coordinator restart is requeued without using the job's retries
    /// (three restarts used up `max_retries` though no server was lost), up to
    /// `max_restart_retries` such runs (2 here); the next restart fails the job, saying so.
    #[test]
    fn coordinator_restarts_are_not_charged_to_the_jobs_retries() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = Instant::now();
        let job = {
            let mut c = core(dir.path());
            let a = reg(&mut c, "a", 1, t0);
            let job = submit(
                &mut c,
                JobSpec {
                    max_retries: 0,
                    ..spec(1, 1)
                },
                t0,
            );
            hb(&mut c, a, t0).assignment.unwrap();
            running(&mut c, a, job, 1, t0);
            c.close();
            job
        };
        for restart in 1..=3u32 {
            let mut c = core(dir.path());
            let st = c.status(job, false).unwrap();
            if restart == 3 {
                match st.state {
                    JobState::Failed { reason } => {
                        assert!(reason.contains("max_restart_retries = 2"), "{reason}")
                    }
                    other => panic!("{other:?}"),
                }
                break;
            }
            assert_eq!(st.state, JobState::Queued, "restart {restart}");
            assert_eq!(st.retries.len() as u32, restart);
            assert!(st
                .retries
                .iter()
                .all(|r| r.restart && r.reason == RESTART_REASON));
            let a = reg(&mut c, "a", 1, t0);
            let asg = hb(&mut c, a, t0).assignment.unwrap();
            assert_eq!(asg.attempt, restart + 1);
            running(&mut c, a, job, restart + 1, t0);
            c.close();
        }
    }
}
