//! A daemon is who its certificate says (a coordinator with `daemon_ca`): it registers only
//! as the label its node certificate names, proven over a one-time challenge, and acts only
//! as the daemon it registered as; free text from daemons is refused when it could forge log
//! lines.

mod common;

use std::path::Path;

use common::{config, start, Harness, HB};
use grandis_quic::{init_cluster_with, InitOptions, NodeIdentity};
use grandis_wire::{
    registration_message, DaemonState, DeviceInfo, HeartbeatRequest, JobEvent, JobEventRequest,
    NodeProof, RegisterRequest, RegisterResponse, DAEMON_SESSION_HEADER, PROTOCOL_VERSION,
};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

fn request(label: &str, proof: Option<NodeProof>) -> RegisterRequest {
    RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        label: label.into(),
        devices: vec![DeviceInfo {
            name: "fake".into(),
            memory_bytes: 1 << 30,
        }],
        memory_bytes: 1 << 35,
        data_addr: format!("10.0.0.{}:4433", label.len()),
        daemon_version: "test".into(),
        proof,
    }
}

async fn challenge(h: &Harness) -> String {
    let v: Value = h
        .call(Method::POST, "/v1/daemon/challenge")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["challenge"].as_str().unwrap().to_string()
}

async fn register(h: &Harness, req: &RegisterRequest) -> (StatusCode, Value) {
    let resp = h
        .call(Method::POST, "/v1/daemon/register")
        .json(req)
        .send()
        .await
        .unwrap();
    (resp.status(), resp.json().await.unwrap_or(Value::Null))
}

/// A daemon registered with its own certificate: its id and session header.
async fn registered(h: &Harness, node: &NodeIdentity) -> (u64, String) {
    let proof = node.prove_registration(&challenge(h).await).unwrap();
    let (status, v) = register(h, &request(&node.name, Some(proof))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let r: RegisterResponse = serde_json::from_value(v).unwrap();
    let session = r.session.expect("a session from a verifying coordinator");
    (r.daemon_id, format!("{}:{session}", r.daemon_id))
}

async fn heartbeat(h: &Harness, as_id: u64, session: Option<&str>) -> (StatusCode, Value) {
    let mut req = h
        .call(Method::POST, "/v1/daemon/heartbeat")
        .json(&HeartbeatRequest {
            protocol_version: PROTOCOL_VERSION,
            daemon_id: as_id,
            state: DaemonState::Idle,
            job: None,
        });
    if let Some(s) = session {
        req = req.header(DAEMON_SESSION_HEADER, s);
    }
    let resp = req.send().await.unwrap();
    (resp.status(), resp.json().await.unwrap_or(Value::Null))
}

fn certs(dir: &Path, nodes: &[&str]) {
    init_cluster_with(dir, nodes, &InitOptions::default()).unwrap();
}

#[tokio::test]
async fn a_daemon_registers_and_acts_only_as_its_certificate_says() {
    let dir = tempfile::tempdir().unwrap();
    certs(&dir.path().join("certs"), &["a", "b", "c"]);
    certs(&dir.path().join("rogue"), &["a"]);
    let h = start(grandis_coordinator::CoordinatorConfig {
        daemon_ca: Some(dir.path().join("certs/ca.pem")),
        ..config(&dir.path().join("c.redb"))
    })
    .await;
    let a = NodeIdentity::load(dir.path().join("certs"), "a").unwrap();
    let b = NodeIdentity::load(dir.path().join("certs"), "b").unwrap();
    let rogue = NodeIdentity::load(dir.path().join("rogue"), "a").unwrap();

    // No proof: refused, naming what to do.
    let (status, v) = register(&h, &request("a", None)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{v}");
    assert_eq!(v["code"], "proof_required");
    // a's certificate and key, registering as b (the token alone made this possible).
    let c = challenge(&h).await;
    let signed = a.sign(&registration_message("b", &c)).unwrap();
    use base64::Engine;
    let as_b = NodeProof {
        challenge: c,
        certificate: signed.chain_pem,
        scheme: signed.scheme,
        signature: base64::engine::general_purpose::STANDARD.encode(signed.signature),
    };
    let (status, v) = register(&h, &request("b", Some(as_b))).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(v["code"], "invalid_proof");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("not valid for node name \"b\""),
        "{v}"
    );
    // A certificate of another CA with the right name.
    let proof = rogue.prove_registration(&challenge(&h).await).unwrap();
    let (status, v) = register(&h, &request("a", Some(proof))).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("not issued by the cluster CA"),
        "{v}"
    );
    // A made-up challenge, and a used one.
    let proof = a.prove_registration("made-up").unwrap();
    let (status, v) = register(&h, &request("a", Some(proof))).await;
    assert_eq!(
        (status, v["code"].as_str()),
        (StatusCode::FORBIDDEN, Some("invalid_proof"))
    );
    // (As c, which takes no part in the job below.)
    let c = NodeIdentity::load(dir.path().join("certs"), "c").unwrap();
    let proof = c.prove_registration(&challenge(&h).await).unwrap();
    let (status, _) = register(&h, &request("c", Some(proof.clone()))).await;
    assert_eq!(status, StatusCode::OK);
    let (status, v) = register(&h, &request("c", Some(proof))).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "a replayed proof: {v}");

    // Registered daemons act as themselves only.
    let (a_id, a_session) = registered(&h, &a).await;
    let (b_id, b_session) = registered(&h, &b).await;
    assert_eq!(
        heartbeat(&h, a_id, Some(&a_session)).await.0,
        StatusCode::OK
    );
    let (status, v) = heartbeat(&h, b_id, Some(&a_session)).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(v["code"], "not_this_daemon");
    let (status, v) = heartbeat(&h, b_id, None).await;
    assert_eq!(
        (status, v["code"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("session_required"))
    );
    let forged = format!("{b_id}:{}", a_session.split_once(':').unwrap().1);
    let (status, v) = heartbeat(&h, b_id, Some(&forged)).await;
    assert_eq!(
        (status, v["code"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("invalid_session"))
    );

    // A two-server job on a and b: b cannot report for a, nor upload a's checkpoint.
    let job = h
        .submit(json!({"dataset": "/d", "servers": 2, "epochs": 3, "checkpoint_every": 1}))
        .await;
    let mut leader = None;
    for _ in 0..50 {
        let (_, ra) = heartbeat(&h, a_id, Some(&a_session)).await;
        let (_, rb) = heartbeat(&h, b_id, Some(&b_session)).await;
        if let Some(asg) = ra["assignment"]
            .as_object()
            .or(rb["assignment"].as_object())
        {
            leader = asg["servers"][0]["daemon_id"].as_u64();
            break;
        }
        tokio::time::sleep(HB).await;
    }
    let leader = leader.expect("the job was assigned");
    let (other_id, other_session) = if leader == a_id {
        (b_id, &b_session)
    } else {
        (a_id, &a_session)
    };
    let resp = h
        .call(Method::POST, &format!("/v1/daemon/jobs/{job}/events"))
        .header(DAEMON_SESSION_HEADER, other_session)
        .json(&JobEventRequest {
            protocol_version: PROTOCOL_VERSION,
            daemon_id: leader,
            attempt: Some(1),
            event: JobEvent::Failed {
                reason: "forged".into(),
                retryable: false,
            },
        })
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::FORBIDDEN);
    let resp = h
        .call(
            Method::PUT,
            &format!(
                "/v1/daemon/jobs/{job}/checkpoint?protocol_version={PROTOCOL_VERSION}\
             &daemon_id={leader}&attempt=1&epoch=1"
            ),
        )
        .header(DAEMON_SESSION_HEADER, other_session)
        .body(vec![0u8; 16])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::FORBIDDEN);
    assert_ne!(h.job(job).await["state"], "failed");
    // A daemon not on the job cannot download its checkpoint; one on it can ask.
    let (_, c_session) = registered(&h, &c).await;
    let download = |session: String| {
        h.call(Method::GET, &format!("/v1/daemon/jobs/{job}/checkpoint"))
            .header(DAEMON_SESSION_HEADER, session)
            .send()
    };
    let resp = download(c_session).await.unwrap();
    assert_eq!(resp.status(), StatusCode::FORBIDDEN);
    // (No checkpoint was uploaded: the job's own server is told so.)
    let resp = download(other_session.clone()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let _ = other_id;
    h.stop().await;
}

#[tokio::test]
async fn free_text_from_daemons_cannot_forge_log_lines() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(config(&dir.path().join("c.redb"))).await;
    for (field, req) in [
        (
            "label",
            request("node-a\nINFO head elected label=admin", None),
        ),
        ("label", request("a b", None)),
        (
            "daemon_version",
            RegisterRequest {
                daemon_version: "1.0\n2026-11-26T00:00:00Z INFO daemon registered label=admin"
                    .into(),
                ..request("a", None)
            },
        ),
        (
            "daemon_version",
            RegisterRequest {
                daemon_version: "x".repeat(1000),
                ..request("a", None)
            },
        ),
        (
            "data_addr",
            RegisterRequest {
                data_addr: "10.0.0.1\u{1b}[2J:4433".into(),
                ..request("a", None)
            },
        ),
        (
            "devices.name",
            RegisterRequest {
                devices: vec![DeviceInfo {
                    name: "gpu\r\nforged".into(),
                    memory_bytes: 1,
                }],
                ..request("a", None)
            },
        ),
    ] {
        let (status, v) = register(&h, &req).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{field}: {v}");
        assert!(v["error"].as_str().unwrap().starts_with(field), "{v}");
    }
    // A failure reason is kept as one plain line, bounded.
    let d = common::FakeDaemon::register(&h, "a", 1).await;
    let job = h.submit(json!({"dataset": "/d", "epochs": 1})).await;
    for _ in 0..50 {
        if d.heartbeat(None).await.assignment.is_some() {
            break;
        }
        tokio::time::sleep(HB).await;
    }
    let reason = format!(
        "boom\n2026-11-26T00:00:00Z INFO job succeeded\u{1b}[2J{}",
        "x".repeat(10_000)
    );
    let (status, v) = d
        .event(
            job,
            JobEvent::Failed {
                reason,
                retryable: false,
            },
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{v}");
    let end = h.wait_state(job, "failed").await;
    let got = end["reason"].as_str().unwrap();
    assert!(got.starts_with("server 'a': boom 2026-11-26"), "{got}");
    assert!(!got.chars().any(char::is_control), "{got:?}");
    assert!(
        got.len() <= 4200 && got.ends_with('…'),
        "{} bytes",
        got.len()
    );
    h.stop().await;
}
