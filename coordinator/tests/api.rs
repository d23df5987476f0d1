//! REST API behaviour over real HTTP: auth, body validation, job listing and cancelling, the
//! daemon protocol's version check, and the OpenAPI document against the router.

mod common;

use std::collections::BTreeSet;

use common::*;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

#[tokio::test]
async fn auth_is_required_except_on_metrics_and_healthz() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(config(&dir.path().join("c.redb"))).await;
    for (method, path) in [
        (Method::GET, "/v1/jobs"),
        (Method::POST, "/v1/jobs"),
        (Method::GET, "/v1/cluster"),
        (Method::POST, "/v1/daemon/heartbeat"),
    ] {
        for auth in [
            None,
            Some("Bearer wrong"),
            Some("Basic czNjcmV0"),
            Some("Bearer "),
        ] {
            let mut req = h.client.request(method.clone(), h.url(path));
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let resp = req.send().await.unwrap();
            assert_eq!(
                resp.status(),
                StatusCode::UNAUTHORIZED,
                "{method} {path} {auth:?}"
            );
            assert_eq!(resp.headers()["www-authenticate"], "Bearer");
            let body: Value = resp.json().await.unwrap();
            assert_eq!(body["code"], "unauthorized");
            assert!(body["error"].as_str().unwrap().contains("token"), "{body}");
        }
    }
    // The scheme is case-insensitive; the token is not.
    let resp = h
        .client
        .get(h.url("/v1/jobs"))
        .header("authorization", format!("bearer {TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let resp = h
        .client
        .get(h.url("/v1/jobs"))
        .bearer_auth(TOKEN.to_uppercase())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);

    let health = h.client.get(h.url("/healthz")).send().await.unwrap();
    assert_eq!(health.status(), StatusCode::OK);
    let metrics = h.client.get(h.url("/metrics")).send().await.unwrap();
    assert_eq!(metrics.status(), StatusCode::OK);
    assert!(metrics.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/openmetrics-text"));
    let text = metrics.text().await.unwrap();
    assert!(text.contains("grandis_queue_depth 0"), "{text}");
    assert!(text.ends_with("# EOF\n"));
    h.stop().await;
}

/// Reads until the server closes the connection (or `limit` passes); true when it closed.
async fn closed_within(stream: &mut tokio::net::TcpStream, limit: std::time::Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    tokio::time::timeout(limit, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_slow_connections_cannot_lock_out_clients() {
    use std::time::{Duration, Instant};
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpStream;

    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(&dir.path().join("c.redb"));
    cfg.max_connections = 16;
    cfg.header_read_timeout_ms = 600;
    cfg.idle_timeout_ms = 3000;
    let h = start(cfg).await;
    let addr = h.handle.local_addr();

    // A flood of connections that never send a byte, many times the cap.
    let mut flood = Vec::new();
    for _ in 0..200 {
        flood.push(TcpStream::connect(addr).await.unwrap());
    }
    // Real clients still get answers at once: each new connection pushes out an idle one.
    for _ in 0..5 {
        let started = Instant::now();
        let health = h
            .client
            .get(h.url("/healthz"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .unwrap();
        assert_eq!(health.status(), StatusCode::OK);
        assert!(started.elapsed() < Duration::from_secs(1));
    }
    // The idle ones are closed by the cap or by the header deadline, none left hanging.
    for s in flood.iter_mut() {
        assert!(closed_within(s, Duration::from_secs(3)).await);
    }

    // Slowloris: a request head trickled a byte at a time is cut at the header deadline.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    let started = Instant::now();
    let head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut cut = false;
    for b in head {
        if slow.write_all(&[*b]).await.is_err() {
            cut = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(cut || closed_within(&mut slow, Duration::from_secs(2)).await);
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );

    // A kept-alive connection sitting between requests is closed at the header deadline.
    let mut kept = TcpStream::connect(addr).await.unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    assert!(closed_within(&mut kept, Duration::from_secs(2)).await);

    let health = h.client.get(h.url("/healthz")).send().await.unwrap();
    assert_eq!(health.status(), StatusCode::OK);
    h.stop().await;
}

#[tokio::test]
async fn separate_daemon_token_splits_the_two_apis() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(&dir.path().join("c.redb"));
    cfg.daemon_token = Some("daemon-only".into());
    let h = start(cfg).await;
    let hb = json!({"protocol_version": grandis_wire::PROTOCOL_VERSION, "daemon_id": 1, "state": "idle"});
    let as_user = h
        .call(Method::POST, "/v1/daemon/heartbeat")
        .json(&hb)
        .send()
        .await
        .unwrap();
    assert_eq!(as_user.status(), StatusCode::UNAUTHORIZED);
    let as_daemon = h
        .client
        .post(h.url("/v1/daemon/heartbeat"))
        .bearer_auth("daemon-only")
        .json(&hb)
        .send()
        .await
        .unwrap();
    // Authenticated, but no daemon 1 registered yet.
    assert_eq!(as_daemon.status(), StatusCode::NOT_FOUND);
    let body: Value = as_daemon.json().await.unwrap();
    assert_eq!(body["code"], "unknown_daemon");
    let jobs_as_daemon = h
        .client
        .get(h.url("/v1/jobs"))
        .bearer_auth("daemon-only")
        .send()
        .await
        .unwrap();
    assert_eq!(jobs_as_daemon.status(), StatusCode::UNAUTHORIZED);
    h.stop().await;
}

#[tokio::test]
async fn bad_bodies_are_rejected_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(config(&dir.path().join("c.redb"))).await;
    let json_ct = "application/json";
    let toml_ct = "application/toml";
    let cases: &[(&str, &str, u16, &str)] = &[
        (json_ct, "{\"dataset\": ", 400, "malformed JSON: "),
        (toml_ct, "dataset = = 3", 400, "malformed TOML: "),
        (
            json_ct,
            r#"{"dataset": "/d", "model": "foo"}"#,
            422,
            "model: unknown model 'foo' (expected sage, gcn, ressage, mlp, gat, rgcn, heterosage or rgat)",
        ),
        (
            json_ct,
            r#"{"dataset": "/d", "epochs": -3}"#,
            422,
            "epochs: must be ≥ 1, got -3",
        ),
        (
            toml_ct,
            "dataset = \"/d\"\nepochs = -3\n",
            422,
            "epochs: must be ≥ 1, got -3",
        ),
        (
            json_ct,
            r#"{"dataset": ""}"#,
            422,
            "dataset: must not be empty",
        ),
        (json_ct, r#"{"model": "gcn"}"#, 422, "dataset: required"),
        (
            json_ct,
            r#"{"dataset": "/d", "hidden": "wide"}"#,
            422,
            "hidden: expected an integer",
        ),
        (json_ct, r#"[1, 2]"#, 422, "expected an object"),
        (
            "text/plain",
            r#"{"dataset": "/d"}"#,
            415,
            "unsupported Content-Type 'text/plain'",
        ),
    ];
    for (ct, body, status, needle) in cases {
        let (got, v) = h
            .request(Method::POST, "/v1/jobs", Some((ct, body.to_string())))
            .await;
        assert_eq!(got.as_u16(), *status, "{body}: {v}");
        let msg = v["error"].as_str().unwrap();
        assert!(msg.contains(needle), "{body}: {msg:?} lacks {needle:?}");
    }
    // Several bad fields: all are listed, each with its name.
    let (got, v) = h
        .request(
            Method::POST,
            "/v1/jobs",
            Some((
                json_ct,
                r#"{"dataset": "/d", "model": "foo", "epochs": 0, "servers": -1}"#.into(),
            )),
        )
        .await;
    assert_eq!(got, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(v["code"], "invalid_job");
    let fields: Vec<&str> = v["fields"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["field"].as_str().unwrap())
        .collect();
    assert_eq!(fields, ["model", "epochs", "servers"]);
    // Nothing was queued by the rejected requests.
    assert_eq!(h.get("/v1/jobs").await, json!([]));
    h.stop().await;
}

#[tokio::test]
async fn submit_list_get_and_cancel() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(config(&dir.path().join("c.redb"))).await;
    let resp = h.call(Method::POST, "/v1/jobs")
        .header("content-type", "application/toml; charset=utf-8")
        .body("name = \"flx-run\"\ndataset = \"/data/reddit\"\nmode = \"flx\"\npreload_hops = 1\nservers = 2\nsampling = \"eas\"\n")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
    assert_eq!(resp.headers()["location"], "/v1/jobs/1");
    let job: Value = resp.json().await.unwrap();
    assert_eq!(job["state"], "queued");
    assert_eq!(job["name"], "flx-run");
    assert_eq!(
        job["spec"]["sampling"],
        json!({"method": "eas", "hops": 1, "fanout": 15, "priority": "degree"})
    );
    assert!(job["waiting_for"]
        .as_str()
        .unwrap()
        .contains("needs 2 free server(s)"));

    let second = h
        .submit(json!({"dataset": "/data/cora", "epochs": 5}))
        .await;
    assert_eq!(second, 2);
    let list = h.get("/v1/jobs").await;
    let states: Vec<(u64, &str)> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|j| (j["id"].as_u64().unwrap(), j["state"].as_str().unwrap()))
        .collect();
    assert_eq!(states, [(1, "queued"), (2, "queued")]);
    assert!(h
        .get("/metrics")
        .await
        .as_str()
        .unwrap()
        .contains("grandis_queue_depth 2"));

    let (status, v) = h.request(Method::DELETE, "/v1/jobs/1", None).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "cancelled");
    let (status, v) = h.request(Method::DELETE, "/v1/jobs/1", None).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(v["error"], "job 1 already cancelled; nothing to cancel");

    for path in ["/v1/jobs/99", "/v1/jobs/abc", "/v1/jobs/99/events"] {
        let (status, v) = h.request(Method::GET, path, None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(v["code"], "not_found");
    }
    let (status, _) = h.request(Method::DELETE, "/v1/jobs/99", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, v) = h.request(Method::GET, "/v1/nothing", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["error"], "no route for GET /v1/nothing");
    let (status, v) = h.request(Method::PUT, "/v1/jobs", None).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{v}");
    h.stop().await;
}

#[tokio::test]
async fn daemon_protocol_rejects_other_versions_and_bad_messages() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(config(&dir.path().join("c.redb"))).await;
    // A registration the coordinator refuses: its 400 body.
    let refused = |body: Value| {
        let request = h.call(Method::POST, "/v1/daemon/register").json(&body);
        async move {
            let resp = request.send().await.unwrap();
            assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
            let v: Value = resp.json().await.unwrap();
            v
        }
    };
    let error = |v: &Value| v["error"].as_str().unwrap().to_string();
    let v = refused(json!({"protocol_version": 999, "label": "a"})).await;
    assert_eq!(v["code"], "protocol_mismatch");
    assert!(error(&v).contains("daemon speaks 999"), "{v}");
    let v = refused(json!({"label": "a"})).await;
    assert!(error(&v).starts_with("protocol_version: required"), "{v}");
    let v =
        refused(json!({"protocol_version": grandis_wire::PROTOCOL_VERSION, "label": "a"})).await;
    assert!(error(&v).contains("missing field `devices`"), "{v}");
    let v = refused(
        json!({"protocol_version": grandis_wire::PROTOCOL_VERSION, "label": "a", "devices": [],
        "memory_bytes": 1, "data_addr": "nowhere", "daemon_version": "x"}),
    )
    .await;
    assert!(
        error(&v).starts_with("data_addr: expected host:port"),
        "{v}"
    );
    h.stop().await;
}

/// Paths and methods under `paths:` in docs/openapi.yaml.
fn documented_routes() -> BTreeSet<(String, String)> {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/openapi.yaml"))
            .expect("reading docs/openapi.yaml");
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("docs/openapi.yaml parses");
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let mut out = BTreeSet::new();
    for (path, item) in doc["paths"].as_mapping().expect("paths") {
        for (method, _) in item.as_mapping().unwrap() {
            let m = method.as_str().unwrap();
            if ["get", "post", "put", "delete", "patch"].contains(&m) {
                out.insert((m.to_uppercase(), path.as_str().unwrap().to_string()));
            }
        }
    }
    out
}

#[test]
fn openapi_documents_exactly_the_routes() {
    let documented = documented_routes();
    let routed: BTreeSet<(String, String)> = grandis_coordinator::api::ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    let missing: Vec<_> = routed.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&routed).collect();
    assert!(
        missing.is_empty(),
        "routes missing from docs/openapi.yaml: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "docs/openapi.yaml documents routes the router lacks: {extra:?}"
    );
}

#[tokio::test]
async fn router_serves_every_listed_route() {
    // Unauthenticated requests: a listed route answers 200 (open) or 401 (protected), never
    // the 404/405 of a route the router does not have.
    let dir = tempfile::tempdir().unwrap();
    let h = start(config(&dir.path().join("c.redb"))).await;
    for (method, path) in grandis_coordinator::api::ROUTES {
        let url = h.url(&path.replace("{id}", "1"));
        let resp = h
            .client
            .request(Method::from_bytes(method.as_bytes()).unwrap(), url)
            .send()
            .await
            .unwrap();
        let expected = if ["/healthz", "/metrics"].contains(path) {
            StatusCode::OK
        } else {
            StatusCode::UNAUTHORIZED
        };
        assert_eq!(resp.status(), expected, "{method} {path}");
    }
    h.stop().await;
}
