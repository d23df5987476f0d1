//! Jobs and daemons end to end over real HTTP, with the test playing the daemons: a job's
//! whole life (GET, SSE, metrics), elections and failover, a silent server failing its job,
//! cancellation of a running job, a lost server's job retried from its checkpoint, and
//! persistence across a restart.

mod common;

use std::time::Duration;

use common::*;
use grandis_wire::checkpoint::testing::container;
use grandis_wire::{EpochProgress, JobEvent, LinkBytes, RunSummary, PROTOCOL_VERSION};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

fn progress(epoch: u32) -> JobEvent {
    JobEvent::Progress {
        progress: EpochProgress {
            epoch,
            loss: 2.0 / epoch as f64,
            train_acc: 0.5 + 0.1 * epoch as f64,
            val_acc: 0.4 + 0.1 * epoch as f64,
            seconds: 0.25,
            bytes: LinkBytes {
                intra_server: 1000 * epoch as u64,
                inter_server: 10 * epoch as u64,
            },
        },
    }
}

fn summary(text: &str) -> JobEvent {
    JobEvent::Finished {
        // The sampler's name tags whose summary it is.
        summary: Box::new(RunSummary {
            test_acc: 0.81,
            execution: grandis_wire::Execution {
                sampling: text.into(),
                ..Default::default()
            },
            ..RunSummary::default()
        }),
    }
}

#[tokio::test]
async fn job_runs_from_queue_to_success_visible_in_get_sse_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(config(&dir.path().join("c.redb"))).await;
    let id = h
        .submit(json!({"dataset": "/data/synth", "servers": 2, "devices": 2, "epochs": 3, "mode": "flx"}))
        .await;
    assert_eq!(h.job(id).await["state"], "queued");

    // Follow the job from the start with server-sent events.
    // The response headers arrive once the stream is subscribed, so nothing is missed.
    let resp = h
        .call(Method::GET, &format!("/v1/jobs/{id}/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let sse = tokio::spawn(async move { resp.text().await.unwrap() });

    // One server with too few devices does not count.
    let small = FakeDaemon::register(&h, "node-c", 1).await;
    let a = FakeDaemon::register(&h, "node-a", 2).await;
    assert_eq!(h.job(id).await["state"], "queued");
    let b = FakeDaemon::register(&h, "node-b", 4).await;
    let job = h.wait_state(id, "assigned").await;
    assert_eq!(job["servers"], json!(["node-a", "node-b"]));

    let ra = a.heartbeat(None).await;
    let rb = b.heartbeat(None).await;
    assert!(ra.is_head && rb.is_head);
    assert!(small.heartbeat(None).await.assignment.is_none());
    let asg_a = ra.assignment.expect("node-a gets the job");
    let asg_b = rb.assignment.expect("node-b gets the job");
    assert_eq!((asg_a.job_id, asg_a.server_index), (id, 0));
    assert_eq!((asg_b.job_id, asg_b.server_index), (id, 1));
    assert_eq!(asg_a.servers, asg_b.servers);
    assert_eq!(asg_a.servers[1].data_addr, b.data_addr);
    assert_eq!(asg_a.spec.epochs, 3);

    // Reporting the job in a heartbeat starts it; the assignment is repeated (idempotent).
    let again = a.heartbeat(Some((id, 0))).await;
    assert_eq!(again.assignment.unwrap().job_id, id);
    assert!(again.cancel.is_empty());
    assert_eq!(h.job(id).await["state"], "running");

    for epoch in 1..=3 {
        let (status, v) = a.event(id, progress(epoch)).await;
        assert_eq!(status, StatusCode::NO_CONTENT, "{v}");
    }
    // A retried epoch is ignored; progress from a non-leader is refused.
    assert_eq!(a.event(id, progress(3)).await.0, StatusCode::NO_CONTENT);
    let (status, v) = b.event(id, progress(1)).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("only the job's leader"),
        "{v}"
    );

    let job = h.job(id).await;
    assert_eq!(job["latest"]["epoch"], 3);
    assert_eq!(job["history"].as_array().unwrap().len(), 3);
    assert_eq!(
        job["bytes_total"],
        json!({"intra_server": 6000, "inter_server": 60})
    );
    let metrics = h.get("/metrics").await;
    let metrics = metrics.as_str().unwrap();
    for line in [
        "grandis_job_epoch{grandis_job=\"1\"} 3",
        "grandis_job_link_bytes{grandis_job=\"1\",link_class=\"inter_server\"} 60.0",
        "grandis_jobs{state=\"running\"} 1",
        "grandis_elections_total 3",
    ] {
        assert!(metrics.contains(line), "metrics lack {line:?}:\n{metrics}");
    }
    assert!(metrics.contains("grandis_daemon_heartbeat_age_seconds{daemon=\"1\",label=\"node-c\"}"));
    // No series may carry a label Prometheus attaches itself (it would rename ours to
    // exported_job / exported_instance on scrape).
    for clash in ["{job=", ",job=", "{instance=", ",instance="] {
        assert!(
            !metrics.contains(clash),
            "metrics use {clash:?}:\n{metrics}"
        );
    }

    // Both servers must finish; the leader's summary is the job's.
    assert_eq!(b.event(id, summary("b")).await.0, StatusCode::NO_CONTENT);
    assert_eq!(h.job(id).await["state"], "running");
    assert_eq!(a.event(id, summary("a")).await.0, StatusCode::NO_CONTENT);
    let job = h.job(id).await;
    assert_eq!(job["state"], "succeeded");
    assert_eq!(job["summary"]["sampling"], "a");
    assert!(job["finished_at_ms"].as_u64().unwrap() >= job["started_at_ms"].as_u64().unwrap());

    // The event stream saw everything and ended by itself.
    let text = tokio::time::timeout(Duration::from_secs(10), sse)
        .await
        .expect("SSE stream ends when the job ends")
        .unwrap();
    let events = parse_sse(&text);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["state", "state", "state", "progress", "progress", "progress", "state", "end"],
        "{text}"
    );
    let states: Vec<&Value> = events
        .iter()
        .filter(|(n, _)| n == "state")
        .map(|(_, v)| &v["state"])
        .collect();
    assert_eq!(states, ["queued", "assigned", "running", "succeeded"]);
    assert_eq!(events[5].1["loss"], 2.0 / 3.0);
    assert_eq!(events[7].1["summary"]["test_acc"], 0.81);

    // A late subscriber gets the whole story at once, then the end.
    let late = h.get(&format!("/v1/jobs/{id}/events")).await;
    let late = parse_sse(late.as_str().unwrap());
    assert_eq!(late.len(), 5);
    assert_eq!(late.last().unwrap().0, "end");

    // The servers are free again once their daemons say so: the next job is assigned then.
    a.heartbeat(None).await;
    let next = h.submit(json!({"dataset": "/d", "servers": 2})).await;
    assert_eq!(h.job(next).await["servers"], json!(["node-a", "node-b"]));
    h.stop().await;
}

#[tokio::test]
async fn election_with_two_daemons_per_label_and_failover_on_lease_loss() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(fast_config(&dir.path().join("c.redb"))).await;
    let a1 = FakeDaemon::register(&h, "node-a", 1).await;
    let a2 = FakeDaemon::register(&h, "node-a", 1).await;
    let r1 = a1.heartbeat(None).await;
    let r2 = a2.heartbeat(None).await;
    assert!(r1.is_head && !r2.is_head);
    assert_eq!((r1.term, r2.term), (1, 1));
    let head = r2.head.unwrap();
    assert_eq!(
        (head.daemon_id, head.data_addr.as_str()),
        (a1.id, a1.data_addr.as_str())
    );

    // a1 stops heartbeating; a2 keeps going and takes over in a new term.
    let keep = keep_alive(&a2, None);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let view = loop {
        let view = h.get("/v1/cluster").await;
        if view["servers"][0]["head"]["daemon_id"] == a2.id {
            break view;
        }
        assert!(std::time::Instant::now() < deadline, "no failover: {view}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(view["servers"][0]["term"], 2);
    assert_eq!(view["servers"][0]["label"], "node-a");
    let r2 = a2.heartbeat(None).await;
    assert!(r2.is_head);
    assert_eq!(r2.term, 2);

    // Past the down timeout a1 is reported down; the label stays up with its new head.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let view = loop {
        let view = h.get("/v1/cluster").await;
        if view["daemons"][0]["up"] == false {
            break view;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a1 never down: {view}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(view["daemons"][0]["last_heartbeat_age_s"].as_f64().unwrap() >= 1.0);
    assert_eq!(view["daemons"][1]["is_head"], true);
    assert_eq!(view["servers"][0]["up"], true);

    // a1 comes back as a follower: no preemption, same term.
    let r1 = a1.heartbeat(None).await;
    assert!(!r1.is_head);
    assert_eq!(r1.term, 2);
    let metrics = h.get("/metrics").await;
    assert!(metrics
        .as_str()
        .unwrap()
        .contains("grandis_elections_total 2"));
    assert!(metrics
        .as_str()
        .unwrap()
        .contains("grandis_server_term{label=\"node-a\"} 2"));
    keep.abort();
    h.stop().await;
}

#[tokio::test]
async fn server_that_stops_heartbeating_fails_its_running_job() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(fast_config(&dir.path().join("c.redb"))).await;
    let a = FakeDaemon::register(&h, "node-a", 1).await;
    let b = FakeDaemon::register(&h, "node-b", 1).await;
    let id = h
        .submit(json!({"dataset": "/d", "servers": 2, "max_retries": 0}))
        .await;
    h.wait_state(id, "assigned").await;
    let ka = keep_alive(&a, Some((id, 1)));
    let kb = keep_alive(&b, Some((id, 1)));
    h.wait_state(id, "running").await;
    assert_eq!(a.event(id, progress(1)).await.0, StatusCode::NO_CONTENT);
    kb.abort();
    let job = h.wait_state(id, "failed").await;
    let reason = job["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("server 'node-b' stopped heartbeating (last seen "),
        "{reason}"
    );
    assert!(
        reason.ends_with(" s ago); not retried (max_retries = 0)"),
        "{reason}"
    );
    // The surviving server is told to stop, and its later events are refused.
    let r = a.heartbeat(Some((id, 2))).await;
    assert_eq!(r.cancel, vec![id]);
    let (status, v) = a.event(id, progress(2)).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(v["code"], "job_finished");
    ka.abort();
    h.stop().await;
}

#[tokio::test]
async fn daemon_reported_failure_and_cancel_of_a_running_job() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(config(&dir.path().join("c.redb"))).await;
    let a = FakeDaemon::register(&h, "node-a", 1).await;
    let first = h.submit(json!({"dataset": "/data/missing"})).await;
    let second = h.submit(json!({"dataset": "/data/ok"})).await;
    assert_eq!(
        h.job(second).await["waiting_for"],
        "needs 1 free server(s) with ≥ 1 device(s) each; 0 free, 1 up (1 with enough devices)"
    );
    assert_eq!(a.heartbeat(None).await.assignment.unwrap().job_id, first);
    let (status, _) = a
        .event(
            first,
            JobEvent::Failed {
                reason: "dataset /data/missing not found".into(),
                retryable: false,
            },
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let job = h.job(first).await;
    assert_eq!(job["state"], "failed");
    assert_eq!(
        job["reason"],
        "server 'node-a': dataset /data/missing not found"
    );

    // The server is free, so the second job moves on; cancel it while it runs.
    let r = a.heartbeat(None).await;
    assert_eq!(r.assignment.unwrap().job_id, second);
    assert_eq!(
        a.event(second, JobEvent::Started).await.0,
        StatusCode::NO_CONTENT
    );
    assert_eq!(h.job(second).await["state"], "running");
    let (status, v) = h
        .request(Method::DELETE, &format!("/v1/jobs/{second}"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "cancelled");
    let r = a.heartbeat(Some((second, 0))).await;
    assert_eq!(r.cancel, vec![second]);
    assert!(r.assignment.is_none());
    h.stop().await;
}

#[tokio::test]
async fn restart_keeps_queued_and_finished_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("state/c.redb");
    let h = start(config(&db)).await;
    let a = FakeDaemon::register(&h, "node-a", 1).await;
    let done = h.submit(json!({"dataset": "/d1", "epochs": 2})).await;
    let running = h.submit(json!({"dataset": "/d2"})).await;
    let queued = h
        .submit(json!({"dataset": "/d3", "servers": 3, "name": "big"}))
        .await;
    assert_eq!(
        a.heartbeat(Some((done, 0)))
            .await
            .assignment
            .unwrap()
            .job_id,
        done
    );
    for epoch in 1..=2 {
        assert_eq!(
            a.event(done, progress(epoch)).await.0,
            StatusCode::NO_CONTENT
        );
    }
    assert_eq!(
        a.event(done, summary("kept")).await.0,
        StatusCode::NO_CONTENT
    );
    // The daemon ended `done` and says so: the next job is its.
    let r = a.heartbeat(None).await;
    assert_eq!(r.assignment.unwrap().job_id, running);
    a.heartbeat(Some((running, 0))).await;
    h.wait_state(running, "running").await;
    let before = h.job(done).await;
    h.stop().await;

    let h = start(config(&db)).await;
    let after = h.job(done).await;
    assert_eq!(after, before, "a finished job survives unchanged");
    assert_eq!(after["history"].as_array().unwrap().len(), 2);
    // The interrupted run goes back to the queue (a retry), to resume once servers are back.
    let job = h.job(running).await;
    assert_eq!(job["state"], "queued");
    assert_eq!(job["attempt"], 2);
    assert_eq!(job["retries"][0]["reason"], "coordinator restarted");
    let job = h.job(queued).await;
    assert_eq!(job["state"], "queued");
    assert_eq!(job["name"], "big");
    // Old daemon ids are unknown; ids keep increasing.
    let resp = h
        .call(Method::POST, "/v1/daemon/heartbeat")
        .json(&json!({"protocol_version": PROTOCOL_VERSION, "daemon_id": a.id, "state": "idle"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let a2 = FakeDaemon::register(&h, "node-a", 1).await;
    assert!(a2.id > a.id);
    assert_eq!(a2.heartbeat(None).await.term, 2, "terms never go back");
    assert_eq!(h.submit(json!({"dataset": "/d4"})).await, queued + 1);
    h.stop().await;
}

#[tokio::test]
async fn a_retried_job_resumes_from_its_checkpoint_and_its_stream_repeats_the_rerun_epochs() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(fast_config(&dir.path().join("c.redb"))).await;
    let a = FakeDaemon::register(&h, "node-a", 1).await;
    let b = FakeDaemon::register(&h, "node-b", 1).await;
    let id = h
        .submit(json!({"dataset": "/d", "servers": 2, "epochs": 5, "checkpoint_every": 2}))
        .await;
    h.wait_state(id, "assigned").await;
    let resp = h
        .call(Method::GET, &format!("/v1/jobs/{id}/events"))
        .send()
        .await
        .unwrap();
    let sse = tokio::spawn(async move { resp.text().await.unwrap() });
    let ka = keep_alive(&a, Some((id, 0)));
    let kb = keep_alive(&b, Some((id, 0)));
    h.wait_state(id, "running").await;
    for epoch in 1..=3 {
        assert_eq!(a.event(id, progress(epoch)).await.0, StatusCode::NO_CONTENT);
    }
    let put = |daemon: u64, attempt: u32, epoch: u32, body: Vec<u8>| {
        h.call(Method::PUT, &format!(
                "/v1/daemon/jobs/{id}/checkpoint?protocol_version={PROTOCOL_VERSION}&daemon_id={daemon}\
                 &attempt={attempt}&epoch={epoch}"
            ))
            .body(body)
            .send()
    };
    let spec = grandis_wire::JobSpec::from_json_str(
        r#"{"dataset": "/d", "servers": 2, "epochs": 5, "checkpoint_every": 2}"#,
    )
    .unwrap();
    let ck2 = container(&spec, 2, true);
    // Checked before it is stored, each refusal naming why: garbage, flipped bytes, another
    // run's file (more epochs than claimed), another model.
    let mut flipped = ck2.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    let other_model = grandis_wire::JobSpec {
        hidden: spec.hidden * 2,
        ..spec.clone()
    };
    for (body, why) in [
        (b"ck2".to_vec(), "not a safetensors file"),
        (flipped, "checksum mismatch"),
        (
            container(&spec, 4, true),
            "holds 4 epochs but was uploaded as epoch 2",
        ),
        (container(&other_model, 2, true), "another model"),
    ] {
        let resp = put(a.id, 1, 2, body).await.unwrap();
        assert_eq!(resp.status(), 400);
        let text = resp.text().await.unwrap();
        assert!(
            text.contains("invalid_checkpoint") && text.contains(why),
            "{text}"
        );
    }
    let none = h
        .call(Method::GET, &format!("/v1/jobs/{id}/checkpoint"))
        .send()
        .await
        .unwrap();
    assert_eq!(none.status(), 404, "a refused checkpoint is not stored");
    assert_eq!(put(a.id, 1, 2, ck2.clone()).await.unwrap().status(), 204);
    assert_eq!(put(b.id, 1, 2, ck2.clone()).await.unwrap().status(), 409);
    let missing = h
        .call(
            Method::PUT,
            &format!("/v1/daemon/jobs/{id}/checkpoint?daemon_id={}", a.id),
        )
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 400);
    let ck = h
        .call(Method::GET, &format!("/v1/jobs/{id}/checkpoint"))
        .send()
        .await
        .unwrap();
    assert_eq!(ck.headers()["x-grandis-checkpoint-epoch"], "2");
    assert_eq!(&ck.bytes().await.unwrap()[..], &ck2[..]);

    // node-b goes silent: back to the queue, history cut to the checkpoint.
    kb.abort();
    let job = h.wait_state(id, "queued").await;
    assert_eq!(job["attempt"], 2);
    assert_eq!(job["retries"][0]["resume_epoch"], 2);
    assert_eq!(job["history"].as_array().unwrap().len(), 2);
    ka.abort();
    // node-a has stopped the old run; node-b is back as a new daemon: attempt 2 starts.
    let b2 = FakeDaemon::register(&h, "node-b", 1).await;
    b2.heartbeat(None).await;
    let asg = a
        .heartbeat(None)
        .await
        .assignment
        .expect("attempt 2 assigned");
    assert_eq!((asg.attempt, asg.resume_epoch), (2, Some(2)));
    let ka = keep_alive(&a, None);
    let kb = keep_alive(&b2, None);
    for epoch in 3..=5 {
        assert_eq!(a.event(id, progress(epoch)).await.0, StatusCode::NO_CONTENT);
    }
    for d in [&a, &b2] {
        assert_eq!(d.event(id, summary("done")).await.0, StatusCode::NO_CONTENT);
    }
    let job = h.wait_state(id, "succeeded").await;
    let epochs: Vec<u64> = job["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["epoch"].as_u64().unwrap())
        .collect();
    assert_eq!(epochs, vec![1, 2, 3, 4, 5]);
    // The stream showed epoch 3 twice: once from each attempt.
    let text = tokio::time::timeout(Duration::from_secs(10), sse)
        .await
        .unwrap()
        .unwrap();
    let threes = text
        .lines()
        .filter(|l| l.starts_with("data: {\"epoch\":3,"))
        .count();
    assert_eq!(threes, 2, "{text}");
    assert!(text.contains("\"retry\""), "{text}");
    ka.abort();
    kb.abort();
    h.stop().await;
}

/// A checkpoint upload is answered before its body is read: a declared length above
/// `max_checkpoint_bytes` gets 413 and an upload to an attempt that is not running gets 409,
/// while the client has sent the headers alone (both used to wait for the whole body).
#[tokio::test]
async fn checkpoint_uploads_are_refused_before_their_body_is_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let h = start(fast_config(&dir.path().join("c.redb"))).await;
    let a = FakeDaemon::register(&h, "node-a", 1).await;
    let id = h
        .submit(json!({"dataset": "/d", "servers": 1, "epochs": 5, "checkpoint_every": 2}))
        .await;
    h.wait_state(id, "assigned").await;
    let ka = keep_alive(&a, Some((id, 0)));
    h.wait_state(id, "running").await;
    let addr = h.base.trim_start_matches("http://").to_string();
    let headers_only = |attempt: u32, length: u64| {
        let addr = addr.clone();
        let daemon = a.id;
        async move {
            let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let request = format!(
                "PUT /v1/daemon/jobs/{id}/checkpoint?protocol_version={PROTOCOL_VERSION}&daemon_id={daemon}\
                 &attempt={attempt}&epoch=2 HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer \
                 {TOKEN}\r\nContent-Length: {length}\r\n\r\n"
            );
            tcp.write_all(request.as_bytes()).await.unwrap();
            let mut head = vec![0u8; 512];
            let n = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut head))
                .await
                .expect("no answer while the body was not sent")
                .unwrap();
            String::from_utf8_lossy(&head[..n]).to_string()
        }
    };
    let too_large = headers_only(1, 1 << 40).await;
    assert!(too_large.starts_with("HTTP/1.1 413"), "{too_large}");
    assert!(too_large.contains("checkpoint_too_large"), "{too_large}");
    let stale = headers_only(7, 1 << 20).await;
    assert!(stale.starts_with("HTTP/1.1 409"), "{stale}");
    assert!(stale.contains("not_running"), "{stale}");
    ka.abort();
    h.stop().await;
}
