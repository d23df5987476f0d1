//! Test harness: a coordinator on 127.0.0.1:0 with fast timers, an HTTP client, and fake
//! daemons that speak the daemon protocol over real HTTP.
#![allow(dead_code)]

use std::path::Path;
use std::time::{Duration, Instant};

use grandis_coordinator::{spawn, CoordinatorConfig, CoordinatorHandle};
use grandis_wire::{
    DaemonJob, DaemonState, DeviceInfo, HeartbeatRequest, HeartbeatResponse, JobEvent,
    JobEventRequest, RegisterRequest, RegisterResponse, PROTOCOL_VERSION,
};
use reqwest::{Client, Method, StatusCode};
use serde_json::Value;

pub const TOKEN: &str = "s3cret-test-token";
/// Heartbeat interval of the fake daemons and of the test coordinators.
pub const HB: Duration = Duration::from_millis(100);

/// Leases long enough that nothing expires while a test runs, however slow the machine: for
/// tests that drive the daemons by hand and are not about timeouts.
pub fn config(db: &Path) -> CoordinatorConfig {
    CoordinatorConfig {
        listen: "127.0.0.1:0".into(),
        db_path: db.to_path_buf(),
        token: Some(TOKEN.into()),
        daemon_token: None,
        heartbeat_interval_ms: HB.as_millis() as u64,
        lease_ms: 30_000,
        down_timeout_ms: 60_000,
        sse_keepalive_ms: 1000,
        ..CoordinatorConfig::default()
    }
}

/// Short leases for tests about failover and silent servers; the fake daemons that must stay
/// alive heartbeat every 100 ms, five times per lease.
pub fn fast_config(db: &Path) -> CoordinatorConfig {
    CoordinatorConfig {
        lease_ms: 500,
        down_timeout_ms: 1000,
        ..config(db)
    }
}

pub struct Harness {
    pub handle: CoordinatorHandle,
    pub base: String,
    pub client: Client,
}

pub async fn start(config: CoordinatorConfig) -> Harness {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let handle = spawn(config, listener).await.unwrap();
    let base = format!("http://{}", handle.local_addr());
    Harness {
        handle,
        base,
        client: Client::new(),
    }
}

impl Harness {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A request to `path` with the API token, to finish and send.
    pub fn call(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, self.url(path))
            .bearer_auth(TOKEN)
    }

    pub async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<(&str, String)>,
    ) -> (StatusCode, Value) {
        let mut req = self.call(method, path);
        if let Some((ct, text)) = body {
            req = req.header("content-type", ct).body(text);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status();
        let text = resp.text().await.unwrap();
        let value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        (status, value)
    }

    pub async fn get(&self, path: &str) -> Value {
        let (status, v) = self.request(Method::GET, path, None).await;
        assert_eq!(status, StatusCode::OK, "GET {path}: {v}");
        v
    }

    pub async fn submit(&self, spec: Value) -> u64 {
        let (status, v) = self
            .request(
                Method::POST,
                "/v1/jobs",
                Some(("application/json", spec.to_string())),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        v["id"].as_u64().unwrap()
    }

    pub async fn job(&self, id: u64) -> Value {
        self.get(&format!("/v1/jobs/{id}")).await
    }

    /// Polls the job until its state is `state` (10 s at most).
    pub async fn wait_state(&self, id: u64, state: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let job = self.job(id).await;
            if job["state"] == state {
                return job;
            }
            assert!(
                Instant::now() < deadline,
                "job {id} never became {state}: {job}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn stop(self) {
        self.handle.shutdown().await.unwrap();
    }
}

pub struct FakeDaemon {
    pub id: u64,
    pub label: String,
    pub data_addr: String,
    client: Client,
    base: String,
}

impl FakeDaemon {
    pub async fn register(h: &Harness, label: &str, devices: usize) -> FakeDaemon {
        let data_addr = format!("10.0.0.{}:4433", label.len());
        let resp = h
            .client
            .post(h.url("/v1/daemon/register"))
            .bearer_auth(TOKEN)
            .json(&RegisterRequest {
                protocol_version: PROTOCOL_VERSION,
                label: label.into(),
                devices: vec![
                    DeviceInfo {
                        name: "fake".into(),
                        memory_bytes: 1 << 30,
                    };
                    devices
                ],
                memory_bytes: 1 << 35,
                data_addr: data_addr.clone(),
                daemon_version: "test".into(),
                proof: None,
            })
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let r: RegisterResponse = resp.json().await.unwrap();
        assert_eq!(r.heartbeat_interval_ms, HB.as_millis() as u64);
        FakeDaemon {
            id: r.daemon_id,
            label: label.into(),
            data_addr,
            client: h.client.clone(),
            base: h.base.clone(),
        }
    }

    /// A heartbeat reporting `(job, epoch)` of the job's first attempt, or nothing.
    pub async fn heartbeat(&self, job: Option<(u64, u32)>) -> HeartbeatResponse {
        self.heartbeat_run(job.map(|(id, epoch)| (id, 1, epoch)))
            .await
    }

    /// A heartbeat reporting `(job, attempt, epoch)`, or nothing.
    pub async fn heartbeat_run(&self, job: Option<(u64, u32, u32)>) -> HeartbeatResponse {
        let resp = self
            .client
            .post(format!("{}/v1/daemon/heartbeat", self.base))
            .bearer_auth(TOKEN)
            .json(&HeartbeatRequest {
                protocol_version: PROTOCOL_VERSION,
                daemon_id: self.id,
                state: if job.is_some() {
                    DaemonState::Running
                } else {
                    DaemonState::Idle
                },
                job: job.map(|(job_id, attempt, epoch)| DaemonJob {
                    job_id,
                    attempt,
                    epoch,
                }),
            })
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        resp.json().await.unwrap()
    }

    pub async fn event(&self, job: u64, event: JobEvent) -> (StatusCode, Value) {
        let resp = self
            .client
            .post(format!("{}/v1/daemon/jobs/{job}/events", self.base))
            .bearer_auth(TOKEN)
            .json(&JobEventRequest {
                protocol_version: PROTOCOL_VERSION,
                daemon_id: self.id,
                attempt: None,
                event,
            })
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let text = resp.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }
}

/// Heartbeats every [`HB`] in the background (as the daemon's own job, if any) until aborted.
pub fn keep_alive(d: &FakeDaemon, job: Option<(u64, u32)>) -> tokio::task::JoinHandle<()> {
    let d = FakeDaemon {
        id: d.id,
        label: d.label.clone(),
        data_addr: d.data_addr.clone(),
        client: d.client.clone(),
        base: d.base.clone(),
    };
    tokio::spawn(async move {
        loop {
            d.heartbeat(job).await;
            tokio::time::sleep(HB).await;
        }
    })
}

/// Splits a server-sent event stream into (event name, JSON data) pairs.
pub fn parse_sse(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter_map(|block| {
            let mut name = None;
            let mut data = String::new();
            for line in block.lines() {
                if let Some(n) = line.strip_prefix("event:") {
                    name = Some(n.trim().to_string());
                } else if let Some(d) = line.strip_prefix("data:") {
                    data.push_str(d.trim_start());
                }
            }
            Some((name?, serde_json::from_str(&data).ok()?))
        })
        .collect()
}
