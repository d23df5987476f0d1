//! End-to-end tests with real processes: `grandis coordinator` and one `grandis daemon` per
//! server, talking HTTP and QUIC over 127.0.0.1 on ports chosen at run time. The harness
//! (process handling, configs, REST client) is the `grandis-e2e` package in `tests/`. Every
//! wait is bounded; every process is killed when its handle drops.

use std::time::Duration;

use grandis_e2e::{last_json_line, run_grandis, wait_for, Cluster, Rest, Timing};
use grandis_quic::frame::{FRAME_OVERHEAD, PREAMBLE_BYTES};
use serde_json::{json, Value};

const EXE: &str = env!("CARGO_BIN_EXE_grandis");
const LONG: Duration = Duration::from_secs(120);

fn losses(v: &Value) -> Vec<f64> {
    v["losses"]
        .as_array()
        .unwrap_or_else(|| panic!("no losses in {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// Runs `grandis cluster up` (2 servers x 2 devices) and `grandis train` in one process with
/// the same flags; asserts equal per-epoch losses and returns both JSON summaries.
fn cluster_and_in_process(
    dataset: &str,
    mode: &str,
    extra: &[&str],
    epochs: u32,
) -> (Value, Value) {
    let epochs_s = epochs.to_string();
    // Both runs: 2 servers x 2 devices, the same mode, epochs, model and seed.
    let mut same = vec![
        "--servers",
        "2",
        "--devices",
        "2",
        "--mode",
        mode,
        "--epochs",
        &epochs_s,
        "--hidden",
        "16",
        "--seed",
        "3",
        "--json",
    ];
    same.extend_from_slice(extra);
    let mut args = vec!["cluster", "up", "--dataset", dataset, "--threads", "1"];
    args.extend_from_slice(&same);
    let (ok, out, err) = run_grandis(EXE, &args, LONG).unwrap();
    assert!(ok, "cluster up failed:\n{err}");
    let cluster = last_json_line(&out).unwrap_or_else(|| panic!("no JSON in {out}"));

    let mut args = vec!["train", dataset, "--threads", "4"];
    args.extend_from_slice(&same);
    let (ok, out, err) = run_grandis(EXE, &args, LONG).unwrap();
    assert!(ok, "train failed:\n{err}");
    let local = last_json_line(&out).unwrap();

    let (a, b) = (losses(&cluster), losses(&local));
    assert_eq!(a.len(), epochs as usize, "{cluster}");
    assert_eq!(a.len(), b.len());
    for (e, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-4,
            "{mode} epoch {}: cluster {x} vs in-process {y}",
            e + 1
        );
    }
    assert_eq!(cluster["preload_hops"], local["preload_hops"]);
    // The daemons fetch the same replicated features over QUIC as the threads over channels.
    for key in ["fetch_bytes_per_epoch", "setup_fetch_bytes"] {
        assert!(
            cluster[key]["inter_server"].is_u64(),
            "{mode}: no {key} in {cluster}"
        );
        assert_eq!(
            cluster[key]["inter_server"], local[key]["inter_server"],
            "{mode}: {key}"
        );
    }
    (cluster, local)
}

/// `grandis cluster up` on `dataset` against `grandis train` in one process, same flags, for
/// the exact full-batch modes: also the traffic against the plan's prediction.
fn cluster_up_equals_in_process(dataset: &str, mode: &str, extra: &[&str], epochs: u32) {
    let (cluster, local) = cluster_and_in_process(dataset, mode, extra, epochs);

    // Traffic: the fabric counted what the plan predicts, and the QUIC wire carried exactly
    // the fabric's inter-server bytes plus framing.
    assert_eq!(
        cluster["halo_bytes_per_epoch"]["inter_server"],
        local["halo_bytes_per_epoch"]["inter_server"]
    );
    assert_eq!(
        cluster["halo_bytes_per_epoch"]["inter_server"],
        cluster["predicted_halo_bytes_per_epoch"]["inter_server"]
    );
    assert_eq!(
        cluster["halo_bytes_per_epoch"]["intra_server"],
        cluster["predicted_halo_bytes_per_epoch"]["intra_server"]
    );
    let payload = cluster["quic_payload_bytes_sent"].as_u64().unwrap();
    assert!(payload > 0);
    assert_eq!(
        payload,
        cluster["fabric_inter_server_bytes_sent"].as_u64().unwrap()
    );
    for r in cluster["reports"].as_array().unwrap() {
        let w = &r["server"]["wire"];
        let u = |k: &str| w[k].as_u64().unwrap();
        assert_eq!(
            u("bytes_sent"),
            u("payload_bytes_sent")
                + u("frames_sent") * FRAME_OVERHEAD as u64
                + u("streams_opened") * PREAMBLE_BYTES as u64,
            "{r}"
        );
        assert_eq!(
            u("payload_bytes_sent"),
            r["server"]["inter_server_payload_sent"].as_u64().unwrap()
        );
    }
}

#[test]
fn cluster_up_matches_in_process_training_on_a_synthetic_graph() {
    let c = Cluster::new(EXE, &["unused"], Timing::default()).unwrap();
    let ds = c.synth("synth", 1500, 11).unwrap();
    let ds = ds.display().to_string();
    cluster_up_equals_in_process(&ds, "flx", &["--preload-hops", "1"], 4);
    cluster_up_equals_in_process(&ds, "fb", &[], 4);
    // GAT through the daemons: the job spec carries the model and its heads.
    cluster_up_equals_in_process(&ds, "fb", &["--model", "gat", "--heads", "4"], 3);
}

/// Typed graphs across daemons: each builds its ranks' blocks split by relation from the
/// dataset's types, so RGCN, hetero-SAGE and R-GAT train as in one process (flx with its halo
/// bytes as predicted, and fb), and mb with per-relation fanouts samples alike on both.
#[test]
fn cluster_up_trains_typed_models_like_the_in_process_run() {
    let c = Cluster::new(EXE, &["unused"], Timing::default()).unwrap();
    let path = c.path("typed");
    grandis_synth::generate_hetero_in_memory(&grandis_synth::HeteroConfig::academic(900, 8, 4, 2))
        .unwrap()
        .write(&path, false)
        .unwrap();
    let ds = path.display().to_string();
    cluster_up_equals_in_process(&ds, "flx", &["--preload-hops", "1", "--model", "rgcn"], 3);
    cluster_up_equals_in_process(&ds, "fb", &["--model", "heterosage"], 3);
    cluster_up_equals_in_process(&ds, "fb", &["--model", "rgat", "--heads", "2"], 3);
    let mb = [
        "--model",
        "rgcn",
        "--batch-size",
        "64",
        "--fanouts",
        "4,3",
        "--relation-fanouts",
        "cites=8,6",
    ];
    let (cluster, local) = cluster_and_in_process(&ds, "mb", &mb, 2);
    assert_eq!(cluster["sampling"], "sage(4,3, per relation)");
    assert_eq!(cluster["sampled_edges"], local["sampled_edges"]);
}

/// Learnable node embeddings across daemons: each rank's rows live in its daemon, asked for
/// and returned over QUIC between servers; the losses equal the in-process run's (flx, and
/// cob whose daemons each build their server's part of a step).
#[test]
fn cluster_up_trains_learnable_embeddings_like_the_in_process_run() {
    let c = Cluster::new(EXE, &["unused"], Timing::default()).unwrap();
    let ds = c.synth("synth", 900, 8).unwrap();
    let ds = ds.display().to_string();
    // flx: also its halo bytes as the plan predicts them (the embeddings' gradients travel
    // apart from the halo exchange).
    cluster_up_equals_in_process(
        &ds,
        "flx",
        &["--preload-hops", "1", "--embedding-dim", "8"],
        4,
    );
    // Four epochs: per-epoch bytes are whole in both runs (each server's report rounds its
    // own average before the cluster adds them up).
    let (cluster, _) = cluster_and_in_process(
        &ds,
        "cob",
        &["--cobatch-size", "150", "--embedding-dim", "8"],
        4,
    );
    assert_eq!(cluster["job"]["embedding_dim"], 8, "{cluster}");
    assert!(
        cluster["node_embedding_bytes_per_epoch"]["inter_server"].as_u64() > Some(0),
        "{cluster}"
    );
}

/// The sampled and mini-batch modes: each daemon builds its server's part of the per-step
/// plans of the in-process run (samplers and co-batches seeded by the job's seed; cob and mb
/// steps only that part, the other servers' replicated rows asked for by id), so the losses
/// and the sampling counters, added up across the servers, agree exactly.
#[test]
fn cluster_up_cob_and_flx_eas_match_in_process_training() {
    let c = Cluster::new(EXE, &["unused"], Timing::default()).unwrap();
    let ds = c.synth("synth", 1200, 5).unwrap();
    let ds = ds.display().to_string();
    for (mode, extra) in [
        ("cob", &["--cobatch-size", "150"][..]),
        (
            "mb",
            &[
                "--batch-size",
                "60",
                "--sampling",
                "fanout",
                "--fanouts",
                "4,3",
            ][..],
        ),
        (
            "flx",
            &[
                "--sampling",
                "eas",
                "--eas-fanout",
                "3",
                "--preload-hops",
                "1",
                "--resample-every",
                "2",
            ][..],
        ),
    ] {
        let (cluster, local) = cluster_and_in_process(&ds, mode, extra, 4);
        eprintln!(
            "{mode}: losses {} / sampled_edges {} / beta {}",
            cluster["losses"], cluster["sampled_edges"], cluster["beta"]
        );
        for key in [
            "sampled_edges",
            "inter_server_sampled_edges",
            "targets_per_epoch",
            "computed_vertices_per_layer",
            "aggregated_edges_per_layer",
            "beta",
            "iterations_per_epoch",
            "sampling",
        ] {
            assert!(!cluster[key].is_null(), "{mode}: no {key} in {cluster}");
            assert_eq!(cluster[key], local[key], "{mode}: {key}");
        }
        assert!(cluster["sampled_edges"].as_u64().unwrap() > 0);
        assert_eq!(
            cluster["halo_bytes_per_epoch"]["inter_server"],
            local["halo_bytes_per_epoch"]["inter_server"],
            "{mode}"
        );
        match mode {
            // A co-batch is masked to its server: no halo crosses servers in training, and
            // there are several iterations per epoch.
            "cob" | "mb" => {
                assert_eq!(cluster["halo_bytes_per_epoch"]["inter_server"], 0);
                assert!(cluster["iterations_per_epoch"].as_u64().unwrap() > 1);
                // ... except the features of the vertices a co-batch replicates, every step.
                assert!(
                    cluster["fetch_bytes_per_epoch"]["inter_server"]
                        .as_u64()
                        .unwrap()
                        > 0
                );
            }
            _ => assert!(
                cluster["sampling"].as_str().unwrap().starts_with("eas"),
                "{cluster}"
            ),
        }
    }
    // A partition written once by `grandis partition`: the job carries its path, every
    // daemon reads it instead of partitioning, and the run is the in-process one on it.
    // (4 epochs: per-epoch bytes are each server's total / epochs, summed, so an epoch count
    // that does not divide a server's total rounds differently from the in-process run.)
    let part = c.path("part");
    let part = part.display().to_string();
    let (ok, _, err) = run_grandis(
        EXE,
        &[
            "partition",
            &ds,
            "--servers",
            "2",
            "--devices",
            "2",
            "--method",
            "random",
            "--out",
            &part,
            "-q",
        ],
        LONG,
    )
    .unwrap();
    assert!(ok, "{err}");
    let extra = [
        "--cobatch-size",
        "150",
        "--partition-dir",
        &part,
        "--eval-every",
        "2",
    ];
    let (cluster, local) = cluster_and_in_process(&ds, "cob", &extra, 4);
    for summary in [&cluster, &local] {
        let source = summary["partition"].as_str().unwrap();
        assert!(source.starts_with("partition dir"), "{source}");
    }
    assert_eq!(cluster["test_acc"], local["test_acc"]);
}

/// `--predict-dir` through the daemons: every rank of both servers writes its vertices'
/// logits after training, equal to the in-process run's, and the QUIC wire carried exactly
/// the fabric's inter-server bytes, the inference exchange included.
#[test]
fn cluster_up_predicts_every_vertex_like_the_in_process_run() {
    let c = Cluster::new(EXE, &["unused"], Timing::default()).unwrap();
    let ds = c.synth("synth", 1000, 7).unwrap();
    let ds = ds.display().to_string();
    let (in_cluster, in_process) = (c.path("pred-cluster"), c.path("pred-local"));
    let run = |command: &[&str], dir: &std::path::Path| -> Value {
        let dir = dir.display().to_string();
        let mut args = command.to_vec();
        args.extend_from_slice(&[
            "--servers",
            "2",
            "--devices",
            "2",
            "--mode",
            "fb",
            "--epochs",
            "3",
            "--hidden",
            "16",
            "--seed",
            "3",
            "--threads",
            "2",
            "--json",
            "--predict-dir",
            &dir,
            "--predict-logits",
            "--predict-embeddings",
        ]);
        let (ok, out, err) = run_grandis(EXE, &args, LONG).unwrap();
        assert!(ok, "{command:?} failed:\n{err}");
        last_json_line(&out).unwrap_or_else(|| panic!("no JSON in {out}"))
    };
    let cluster = run(&["cluster", "up", "--dataset", &ds], &in_cluster);
    let local = run(&["train", &ds], &in_process);
    let inference = &cluster["inference"];
    assert_eq!(inference["vertices"], 1000, "{cluster}");
    assert_eq!(inference["ranks"], json!([0, 1, 2, 3]), "{cluster}");
    assert!(inference["bytes"]["inter_server"].as_u64().unwrap() > 0);
    assert_eq!(inference["bytes"], local["inference"]["bytes"]);
    assert_eq!(
        cluster["quic_payload_bytes_sent"],
        cluster["fabric_inter_server_bytes_sent"]
    );
    // Each server measured its links over QUIC (the probe's bytes are on the wire too).
    for r in cluster["reports"].as_array().unwrap() {
        let inter = &r["server"]["rates"]["inter"];
        assert!(
            inter["bandwidth_bytes_per_s"].as_f64().unwrap() > 0.0,
            "{r}"
        );
        assert!(inter["latency_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    let read = |dir: &std::path::Path, what: &str, rank: usize| {
        let f = grandis_npy::NpyFile::open(dir.join(format!("{what}.{rank}.npy"))).unwrap();
        match what {
            "vertices" => f
                .values::<i64>()
                .unwrap()
                .iter()
                .map(|&v| v as f32)
                .collect(),
            _ => f.values::<f32>().unwrap().into_owned(),
        }
    };
    for rank in 0..4 {
        for what in ["vertices", "predictions", "embeddings"] {
            let (a, b) = (read(&in_cluster, what, rank), read(&in_process, what, rank));
            assert_eq!(a.len(), b.len(), "{what}.{rank}");
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-4 * y.abs().max(1.0),
                    "{what}.{rank}[{i}]: cluster {x}, in-process {y}"
                );
            }
        }
    }
}

/// `mode auto` on two daemons: the first server plans on every server's measured rates and
/// both run its choice (one plan summary, whose predicted halo bytes the run moved); a job
/// no plan fits fails on every server with the planner's reason instead of hanging.
#[test]
fn cluster_up_auto_runs_one_plan_on_every_server() {
    let c = Cluster::new(EXE, &["unused"], Timing::default()).unwrap();
    let ds = c.synth("synth", 1000, 7).unwrap();
    let ds = ds.display().to_string();
    let run = |memory: &str| {
        run_grandis(
            EXE,
            &[
                "cluster",
                "up",
                "--dataset",
                &ds,
                "--servers",
                "2",
                "--devices",
                "2",
                "--mode",
                "auto",
                "--device-memory",
                memory,
                "--sampling",
                "fanout",
                "--fanouts",
                "5,5",
                "--epochs",
                "2",
                "--hidden",
                "16",
                "--threads",
                "1",
                "--json",
            ],
            LONG,
        )
        .unwrap()
    };
    let (ok, out, err) = run("1GiB");
    assert!(ok, "cluster up failed:\n{err}");
    let cluster = last_json_line(&out).unwrap_or_else(|| panic!("no JSON in {out}"));
    let plan = &cluster["plan"];
    let chosen = plan["chosen"]
        .as_str()
        .unwrap_or_else(|| panic!("{cluster}"));
    assert!(
        plan["prediction"]["epoch_s"].as_f64().unwrap() > 0.0,
        "{plan}"
    );
    assert_eq!(plan["candidates"].as_array().unwrap().len(), 11, "{plan}");
    assert!(err.contains(&format!("auto chose {chosen}")), "{err}");
    for r in cluster["reports"].as_array().unwrap() {
        assert_eq!(
            &r["plan"], plan,
            "every server runs the first server's plan"
        );
    }
    // The leader planned with the servers' rates measured over QUIC.
    assert!(
        plan["rates"]["inter"]["bandwidth_bytes_per_s"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert_eq!(
        cluster["halo_bytes_per_epoch"], plan["prediction"]["halo_bytes"],
        "{chosen}: the run moved what the plan predicted"
    );
    let (ok, _, err) = run("1KiB");
    assert!(!ok, "a job no plan fits must fail");
    assert!(
        err.contains("no plan fits") && err.contains("cob and mb"),
        "{err}"
    );
}

#[test]
fn cluster_up_matches_in_process_training_on_cora() {
    let Some(dir) = std::env::var_os("GRANDIS_CORA") else {
        if std::env::var_os("CI").is_some() {
            panic!("GRANDIS_CORA must point at an imported Cora dataset when CI is set");
        }
        eprintln!("skipping: set GRANDIS_CORA to an imported Cora dataset directory");
        return;
    };
    let ds = dir.to_string_lossy().to_string();
    cluster_up_equals_in_process(&ds, "flx", &["--preload-hops", "1"], 3);
    cluster_up_equals_in_process(&ds, "fb", &[], 3);
}

/// Submits a long fb job on both servers, without retries (so that a lost server fails it),
/// and waits until it reports epochs.
fn long_job_running(api: &Rest, t: &str, ds: &std::path::Path) -> u64 {
    let id = api
        .submit(
            t,
            &json!({"dataset": ds, "mode": "fb", "epochs": 1_000_000, "layers": 2,
                    "hidden": 16, "servers": 2, "devices": 2, "max_retries": 0}),
        )
        .unwrap();
    wait_for("two epochs", LONG, || {
        let j = api.job(t, id).ok()?;
        (j["latest"]["epoch"].as_u64().unwrap_or(0) >= 2).then_some(())
    })
    .unwrap();
    id
}

/// Waits for the job's end (within 20 s) and returns its failure reason.
fn failure_reason(api: &Rest, t: &str, id: u64, what: &str) -> String {
    let stopped = std::time::Instant::now();
    let end = api.wait_end(t, id, Duration::from_secs(20)).unwrap();
    assert_eq!(end["state"], "failed", "{end}");
    let reason = end["reason"].as_str().unwrap().to_string();
    eprintln!("job failed {:?} after {what}: {reason}", stopped.elapsed());
    reason
}

#[test]
fn stopped_or_killed_daemon_fails_the_job_naming_that_server_and_nothing_hangs() {
    let c = Cluster::new(EXE, &["node-a", "node-b"], Timing::default()).unwrap();
    let ds = c.synth("synth", 2000, 1).unwrap();
    let (_coord, url) = c.coordinator("127.0.0.1:0", "coord.redb").unwrap();
    let (_a, _) = c.daemon(&url, "node-a", 2, "certs").unwrap();
    let (mut b, _) = c.daemon(&url, "node-b", 2, "certs").unwrap();
    let api = Rest::new(&url);
    let t = c.token.clone();

    // SIGTERM: the stopping daemon says so before its peers notice the connection drop.
    let id = long_job_running(&api, &t, &ds);
    b.terminate(Duration::from_secs(10));
    let reason = failure_reason(&api, &t, id, "SIGTERM");
    assert!(
        reason.starts_with("server 'node-b': its daemon was stopped"),
        "the reason must blame the stopped server: {reason}"
    );

    // node-b comes back; the next job runs on both (no leftovers of the last one).
    let (mut b, _) = c.daemon(&url, "node-b", 2, "certs").unwrap();
    let id = long_job_running(&api, &t, &ds);
    b.kill9();
    let reason = failure_reason(&api, &t, id, "kill -9");
    assert!(
        reason.contains("node-b"),
        "reason does not name the server: {reason}"
    );
    // The surviving daemon stops its part and is idle again (nothing hangs).
    wait_for("node-a idle again", Duration::from_secs(20), || {
        let cl = api.get("/v1/cluster", Some(&t)).ok()?.body;
        let d = cl["daemons"]
            .as_array()?
            .iter()
            .find(|d| d["label"] == "node-a")?
            .clone();
        (d["state"] == "idle" && d["job"].is_null()).then_some(())
    })
    .unwrap();
}

#[test]
fn coordinator_restart_keeps_queued_and_finished_jobs() {
    let c = Cluster::new(EXE, &["solo"], Timing::default()).unwrap();
    let ds = c.synth("synth", 400, 2).unwrap();
    let (mut coord, url) = c.coordinator("127.0.0.1:0", "coord.redb").unwrap();
    let (daemon, ready) = c.daemon(&url, "solo", 2, "certs").unwrap();
    let api = Rest::new(&url);
    let t = c.token.clone();
    let done = api
        .submit(
            &t,
            &json!({"dataset": ds, "mode": "fb", "epochs": 2, "layers": 2, "hidden": 8,
                    "servers": 1, "devices": 2}),
        )
        .unwrap();
    let end = api.wait_end(&t, done, LONG).unwrap();
    assert_eq!(end["state"], "succeeded", "{end}");
    // The server measured its compute and links when the job started; the coordinator keeps
    // the figures (the cluster view and its metrics).
    let cluster = api.get("/v1/cluster", Some(&t)).unwrap().body;
    let rates = &cluster["servers"][0]["rates"];
    assert!(
        rates["compute"]["gemm_flops_per_s"].as_f64().unwrap() > 0.0,
        "{cluster}"
    );
    assert_eq!(rates["compute"]["width"], 8, "{cluster}");
    assert!(
        rates["intra"]["bandwidth_bytes_per_s"].as_f64().unwrap() > 0.0,
        "{cluster}"
    );
    assert!(
        rates["inter"].is_null(),
        "one server has no inter-server link: {cluster}"
    );
    let coordinator_metrics = api.get("/metrics", None).unwrap().body;
    let text = coordinator_metrics.as_str().unwrap_or_default();
    for needle in [
        "grandis_server_gemm_flops{label=\"solo\"}",
        "grandis_server_link_bandwidth_bytes{label=\"solo\",link_class=\"intra_server\"}",
    ] {
        assert!(text.contains(needle), "{needle} missing from:\n{text}");
    }
    // The daemon's metrics carry the job's figures.
    let metrics = Rest::new(&format!(
        "http://{}",
        ready["metrics_addr"].as_str().unwrap()
    ));
    let page = wait_for("the job's final metrics", Duration::from_secs(10), || {
        let body = metrics.get("/metrics", None).ok()?.body;
        let text = body.as_str()?.to_string();
        text.contains("grandis_daemon_jobs_total{outcome=\"succeeded\"} 1")
            .then_some(text)
    })
    .unwrap();
    for needle in [
        format!("grandis_job_epoch{{grandis_job=\"{done}\",server=\"solo\"}} 2.0"),
        "grandis_job_loss{".to_string(),
        "grandis_job_link_bytes{".to_string(),
        "grandis_job_all_reduce_seconds{".to_string(),
        "grandis_job_peak_memory_bytes{".to_string(),
        "grandis_job_preload_hops{".to_string(),
    ] {
        assert!(page.contains(&needle), "{needle} missing from:\n{page}");
    }
    // Needs two servers: stays queued.
    let queued = api
        .submit(&t, &json!({"dataset": ds, "servers": 2, "epochs": 1}))
        .unwrap();
    assert_eq!(api.job(&t, queued).unwrap()["state"], "queued");

    coord.kill9();
    let addr = url.trim_start_matches("http://").to_string();
    let (_coord2, url2) = c.coordinator(&addr, "coord.redb").unwrap();
    assert_eq!(url2, url);
    let finished = api.job(&t, done).unwrap();
    assert_eq!(finished["state"], "succeeded");
    assert_eq!(finished["history"].as_array().map(|h| h.len()), Some(2));
    assert!(finished["summary"]["losses"].is_array(), "{finished}");
    assert_eq!(api.job(&t, queued).unwrap()["state"], "queued");
    // The daemon finds out it is unknown and registers again.
    wait_for(
        "the daemon to register again",
        Duration::from_secs(20),
        || {
            let cl = api.get("/v1/cluster", Some(&t)).ok()?.body;
            cl["daemons"]
                .as_array()?
                .iter()
                .any(|d| d["label"] == "solo" && d["up"] == true)
                .then_some(())
        },
    )
    .unwrap();
    assert!(
        daemon.log_text().contains("registering again"),
        "{}",
        daemon.log_text()
    );
}

#[test]
fn truncated_job_database_is_a_clear_error_and_reset_starts_over() {
    let c = Cluster::new(EXE, &["solo"], Timing::default()).unwrap();
    let (mut coord, url) = c.coordinator("127.0.0.1:0", "coord.redb").unwrap();
    let api = Rest::new(&url);
    let queued = api
        .submit(
            &c.token,
            &json!({"dataset": "/nowhere", "servers": 1, "epochs": 1}),
        )
        .unwrap();
    assert_eq!(api.job(&c.token, queued).unwrap()["state"], "queued");
    coord.terminate(Duration::from_secs(5));
    let db = c.path("coord.redb");
    let bytes = std::fs::read(&db).unwrap();
    std::fs::write(&db, &bytes[..bytes.len() / 3]).unwrap();

    let config = c.path("coordinator.toml").display().to_string();
    let (ok, _, err) = run_grandis(
        EXE,
        &["coordinator", "--config", &config],
        Duration::from_secs(20),
    )
    .unwrap();
    assert!(!ok);
    assert!(
        err.contains("is damaged") && err.contains("--reset-damaged-db"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(std::fs::read(&db).unwrap(), &bytes[..bytes.len() / 3]);

    let addr_file = c.path("reset.addr");
    let mut reset = grandis_launch::Proc::spawn(
        "coordinator",
        std::path::Path::new(EXE),
        &[
            "coordinator",
            "--config",
            &config,
            "--reset-damaged-db",
            "--addr-file",
            &addr_file.display().to_string(),
        ],
        &c.path("reset.log"),
    )
    .unwrap();
    let addr = grandis_launch::wait_file(&addr_file, &mut reset, Duration::from_secs(20)).unwrap();
    let api = Rest::new(&format!("http://{}", addr.trim()));
    let jobs = api.get("/v1/jobs", Some(&c.token)).unwrap();
    assert_eq!(jobs.status, 200);
    assert_eq!(
        jobs.body.as_array().map(Vec::len),
        Some(0),
        "{:?}",
        jobs.body
    );
    let aside: Vec<_> = std::fs::read_dir(c.dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("coord.redb.damaged-")
        })
        .collect();
    assert_eq!(aside.len(), 1);
    assert_eq!(
        std::fs::read(aside[0].path()).unwrap(),
        &bytes[..bytes.len() / 3]
    );
    assert!(
        reset.log_text().contains("moved it to"),
        "{}",
        reset.log_text()
    );
}

#[test]
fn bad_requests_are_4xx_with_a_message_and_no_token_is_401() {
    let c = Cluster::new(EXE, &["solo"], Timing::default()).unwrap();
    let (_coord, url) = c.coordinator("127.0.0.1:0", "coord.redb").unwrap();
    let api = Rest::new(&url);
    let t = Some(c.token.as_str());
    let json_ct = "application/json";
    let cases: &[(&str, &str, u16, &str)] = &[
        (json_ct, "{\"dataset\": ", 400, "malformed JSON"),
        ("application/toml", "dataset = [", 400, "malformed TOML"),
        (
            json_ct,
            r#"{"dataset": "/d", "model": "transformer"}"#,
            422,
            "model",
        ),
        (json_ct, r#"{"dataset": "/d", "epochs": -3}"#, 422, "epochs"),
        (json_ct, r#"{"model": "sage"}"#, 422, "dataset"),
        ("text/plain", r#"{"dataset": "/d"}"#, 415, "Content-Type"),
    ];
    for (ct, body, status, needle) in cases {
        let r = api.post("/v1/jobs", t, ct, body).unwrap();
        assert_eq!(r.status, *status, "{body}: {:?}", r.body);
        let msg = r.body["error"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{body}: {msg}");
    }
    let ok = r#"{"dataset": "/d"}"#;
    let r = api.post("/v1/jobs", None, json_ct, ok).unwrap();
    assert_eq!(r.status, 401, "{:?}", r.body);
    let r = api.post("/v1/jobs", Some("wrong"), json_ct, ok).unwrap();
    assert_eq!(r.status, 401, "{:?}", r.body);
    assert_eq!(api.get("/v1/jobs", None).unwrap().status, 401);
    // Through the CLI too: a clear message and a non-zero exit.
    let (ok, _, err) = run_grandis(
        EXE,
        &[
            "submit",
            "--coordinator",
            &url,
            "--token",
            "wrong",
            "--json",
            r#"{"dataset": "/d"}"#,
        ],
        LONG,
    )
    .unwrap();
    assert!(!ok && err.contains("401"), "{err}");
}

/// `grandis submit --id-file` writes the id of the job it submitted; `grandis cancel` cancels
/// it (the job stays, `cancelled`), refuses a second cancel naming why unless `--if-running`,
/// and names an unknown job.
#[test]
fn cancel_cancels_a_submitted_job_by_the_id_submit_wrote() {
    let c = Cluster::new(EXE, &["solo"], Timing::default()).unwrap();
    let (_coord, url) = c.coordinator("127.0.0.1:0", "coord.redb").unwrap();
    let id_file = c.dir.path().join("job.id");
    let grandis = |command: &str, rest: &[&str]| {
        let mut args = vec![command, "--coordinator", &url, "--token", &c.token];
        args.extend(rest);
        run_grandis(EXE, &args, LONG).unwrap()
    };
    // No daemon: the job stays queued until cancelled.
    let (ok, _, err) = grandis(
        "submit",
        &[
            "--id-file",
            id_file.to_str().unwrap(),
            "--json",
            r#"{"dataset": "/d", "epochs": 1}"#,
        ],
    );
    assert!(ok, "{err}");
    let id = std::fs::read_to_string(&id_file)
        .unwrap()
        .trim()
        .to_string();
    assert!(err.contains(&format!("submitted job {id} ")), "{err}");

    let (ok, _, err) = grandis("cancel", &[&id]);
    assert!(ok && err.contains("cancelled"), "{err}");
    let api = Rest::new(&url);
    let st = api.get(&format!("/v1/jobs/{id}"), Some(&c.token)).unwrap();
    assert_eq!(st.body["state"], "cancelled", "{:?}", st.body);

    let (ok, _, err) = grandis("cancel", &[&id]);
    assert!(!ok && err.contains("409"), "{err}");
    let (ok, _, err) = grandis("cancel", &["--if-running", &id]);
    assert!(ok && err.contains("already ended"), "{err}");
    let (ok, _, err) = grandis("cancel", &["999"]);
    assert!(!ok && err.contains("404") && err.contains("999"), "{err}");
}

#[test]
fn missing_dataset_fails_the_job_naming_the_server() {
    let c = Cluster::new(EXE, &["solo"], Timing::default()).unwrap();
    let (_coord, _d, api) = solo(&c);
    let id = api
        .submit(
            &c.token,
            &json!({"dataset": "/nonexistent/grandis-data", "epochs": 1}),
        )
        .unwrap();
    fails_naming(&api, &c, id, &["/nonexistent/grandis-data"]);
}

/// A coordinator and one daemon, `solo`, with one device, on `c`, and a client: the cluster
/// of the tests of bad datasets (the processes run as long as they are held).
fn solo(c: &Cluster) -> (grandis_e2e::Proc, grandis_e2e::Proc, Rest) {
    let (coord, url) = c.coordinator("127.0.0.1:0", "coord.redb").unwrap();
    let (daemon, _) = c.daemon(&url, "solo", 1, "certs").unwrap();
    (coord, daemon, Rest::new(&url))
}

/// Job `id` ends failed, its reason naming the server `solo` and each of `words`.
fn fails_naming(api: &Rest, c: &Cluster, id: u64, words: &[&str]) {
    let end = api.wait_end(&c.token, id, LONG).unwrap();
    assert_eq!(end["state"], "failed", "{end}");
    let reason = end["reason"].as_str().unwrap();
    assert!(
        reason.contains("solo") && words.iter().all(|w| reason.contains(w)),
        "{reason}"
    );
}

/// A dataset whose files have the right sizes but corrupt contents (vertex ids out of range)
/// fails its job with the file and the bad value named, instead of panicking the daemon's job
/// thread and leaving the job `running` for good; the next job then runs.
#[test]
fn corrupt_dataset_fails_the_job_and_the_queue_moves_on() {
    let c = Cluster::new(EXE, &["solo"], Timing::default()).unwrap();
    let bad = c.synth("bad", 300, 1).unwrap();
    let good = c.synth("good", 300, 2).unwrap();
    // Overwrite the payload of graph.indices (after its 64-byte header) with 0xFF bytes.
    let indices = bad.join("graph.indices");
    let mut bytes = std::fs::read(&indices).unwrap();
    let n = bytes.len();
    bytes[64..n].fill(0xFF);
    std::fs::write(&indices, bytes).unwrap();

    let (_coord, _d, api) = solo(&c);
    let first = api
        .submit(&c.token, &json!({"dataset": bad, "epochs": 1}))
        .unwrap();
    let second = api
        .submit(&c.token, &json!({"dataset": good, "epochs": 1}))
        .unwrap();
    fails_naming(&api, &c, first, &["graph.indices", "out of range"]);
    let end = api.wait_end(&c.token, second, LONG).unwrap();
    assert_eq!(end["state"], "succeeded", "{end}");
}

/// A dataset whose structure is sound but whose bytes are not (flipped bits in the
/// features) fails its job with the file and its checksum named: daemons train only on
/// verified bytes (it trained to success when only the structure was checked). The same
/// dataset repaired then trains.
#[test]
fn flipped_bytes_in_a_dataset_fail_the_job_by_their_checksum() {
    let c = Cluster::new(EXE, &["solo"], Timing::default()).unwrap();
    let ds = c.synth("flipped", 300, 3).unwrap();
    let features = ds.join("features.f32");
    let clean = std::fs::read(&features).unwrap();
    let mut bytes = clean.clone();
    for i in (64..bytes.len()).step_by(997).take(1000) {
        bytes[i] ^= 0x01;
    }
    std::fs::write(&features, &bytes).unwrap();

    let (_coord, _d, api) = solo(&c);
    let id = api
        .submit(&c.token, &json!({"dataset": ds, "epochs": 1}))
        .unwrap();
    fails_naming(&api, &c, id, &["features.f32", "checksum mismatch"]);
    std::fs::write(&features, &clean).unwrap();
    let id = api
        .submit(&c.token, &json!({"dataset": ds, "epochs": 1}))
        .unwrap();
    let end = api.wait_end(&c.token, id, LONG).unwrap();
    assert_eq!(end["state"], "succeeded", "{end}");
}

/// A coordinator with the cluster CA refuses a daemon whose certificate another CA issued
/// at registration: the daemon exits naming the refusal, and never joins the cluster.
#[test]
fn daemon_with_a_certificate_from_another_ca_cannot_register() {
    let c = Cluster::new(EXE, &["node-a"], Timing::default()).unwrap();
    grandis_quic::init_cluster_with(
        c.path("rogue"),
        &["node-a"],
        &grandis_quic::InitOptions {
            include_localhost: true,
            ..Default::default()
        },
    )
    .unwrap();
    let (_coord, url) = c.coordinator("127.0.0.1:0", "coord.redb").unwrap();
    let Err(err) = c.daemon(&url, "node-a", 1, "rogue") else {
        panic!("a daemon with another CA's certificate registered");
    };
    let log = std::fs::read_to_string(c.path("node-a.log")).unwrap_or_default();
    assert!(
        log.contains("invalid_proof") && log.contains("not issued by the cluster CA"),
        "{err:#}\n{log}"
    );
    let cluster = Rest::new(&url).get("/v1/cluster", Some(&c.token)).unwrap();
    assert_eq!(
        cluster.body["servers"].as_array().map(Vec::len),
        Some(0),
        "{:?}",
        cluster.body
    );
    // The same label with the cluster's own certificate registers.
    c.daemon(&url, "node-a", 1, "certs").unwrap();
}

#[test]
fn daemon_with_a_certificate_from_another_ca_is_refused_and_logged() {
    let c = Cluster::new(EXE, &["node-a", "node-b"], Timing::default()).unwrap();
    // node-b's identity comes from a different CA.
    grandis_quic::init_cluster_with(
        c.path("rogue"),
        &["node-b"],
        &grandis_quic::InitOptions {
            include_localhost: true,
            ..Default::default()
        },
    )
    .unwrap();
    let ds = c.synth("synth", 300, 3).unwrap();
    // A coordinator that does not check certificates: the data plane refuses on its own.
    let (_coord, url) = c
        .coordinator_verifying("127.0.0.1:0", "coord.redb", false)
        .unwrap();
    let (a, _) = c.daemon(&url, "node-a", 1, "certs").unwrap();
    let (b, _) = c.daemon(&url, "node-b", 1, "rogue").unwrap();
    let api = Rest::new(&url);
    let id = api
        .submit(
            &c.token,
            &json!({"dataset": ds, "mode": "fb", "epochs": 2, "layers": 2, "servers": 2}),
        )
        .unwrap();
    let end = api.wait_end(&c.token, id, LONG).unwrap();
    assert_eq!(end["state"], "failed", "{end}");
    let reason = end["reason"].as_str().unwrap();
    assert!(reason.contains("node-"), "{reason}");
    let log = wait_for(
        "the refusal in node-a's log",
        Duration::from_secs(20),
        || {
            let l = a.log_text();
            l.contains("refused QUIC connection").then_some(l)
        },
    )
    .unwrap();
    assert!(log.contains("incoming"), "{log}");
    eprintln!("job failed: {reason}\nnode-b log:\n{}", b.log_text());
}
