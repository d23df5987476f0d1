//! `grandis bench techniques` and `grandis bench steps` through the binary on small synthetic
//! graphs: every techniques group has its baseline first and its technique rows after, the
//! techniques move what they claim to (fewer inter-server bytes, the same computed
//! vertex-layers where only the traffic changes); steps are the same with any thread count;
//! bad flags are one clear error.

mod common;

use common::*;

fn row<'a>(groups: &'a serde_json::Value, group: &str, i: usize) -> &'a serde_json::Value {
    let g = groups
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["group"] == group)
        .unwrap_or_else(|| panic!("no group {group} in {groups}"));
    &g["rows"][i]
}

#[test]
fn bench_techniques_compares_each_technique_with_its_exact_run() {
    let out = grandis_ok(&[
        "bench",
        "techniques",
        "--vertices",
        "3000",
        "--avg-degree",
        "10",
        "--layers",
        "2",
        "--batch-size",
        "256",
        "--epochs",
        "3",
        "--seeds",
        "0,1",
        "--staleness",
        "1,8",
        "--json",
    ]);
    let report: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let groups = &report["groups"];
    assert_eq!(groups.as_array().unwrap().len(), 4, "{report}");
    let bytes = |g: &str, i: usize| {
        row(groups, g, i)["inter_server_bytes_per_epoch"]
            .as_f64()
            .unwrap()
    };
    let layers = |g: &str, i: usize| row(groups, g, i)["computed_vertex_layers"].clone();
    // SANCUS: a loose bound skips inter-server sends; the computation is the same.
    assert_eq!(row(groups, "SANCUS", 0)["variant"], "fb");
    assert!(bytes("SANCUS", 1) < bytes("SANCUS", 0), "{report}");
    assert_eq!(layers("SANCUS", 1), layers("SANCUS", 0));
    // DGS: epoch 1 fetches whole rows, epochs 2 and 3 half of them.
    for g in ["DGS cob", "DGS mb"] {
        let ratio = bytes(g, 1) / bytes(g, 0);
        assert!(ratio < 0.95, "{g}: {ratio} {report}");
        assert_eq!(layers(g, 1), layers(g, 0));
    }
    // Cluster batches share the cob and mb runs of the DGS groups (one run each).
    assert_eq!(row(groups, "cluster", 0)["variant"], "cob --fanouts 15,10");
    assert_eq!(bytes("cluster", 0), bytes("DGS cob", 0));
    assert_eq!(row(groups, "cluster", 2)["variant"], "cluster");
    for g in groups.as_array().unwrap() {
        let target = g["target_val_acc"].as_f64().unwrap();
        assert!(target > 0.0 && target < 1.0, "{g}");
        // The baseline reaches 98 % of its own best validation accuracy on some seed.
        assert!(
            g["rows"][0]["seeds_reaching_target"].as_u64().unwrap() >= 1,
            "{g}"
        );
    }
}

#[test]
fn bench_techniques_refuses_bad_flags_with_one_line() {
    for (flag, value, needle) in [
        ("--remote-features", "1.5", "--remote-features"),
        ("--staleness", "0.1", "BOUND,MAX_SKIPS"),
        ("--fanouts", "5,5,5", "--fanouts"),
        ("--target-acc", "2", "--target-acc"),
    ] {
        let (ok, _, err) = grandis(&[
            "bench",
            "techniques",
            "--vertices",
            "500",
            "--layers",
            "2",
            "--epochs",
            "1",
            flag,
            value,
        ]);
        assert!(!ok, "{flag} {value} was accepted");
        assert!(err.contains(needle), "{flag} {value}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// `grandis bench steps` on a small synthetic graph: one row per mode and thread count, each
/// with positive stage times, plus one of the producers with two threads, and the same steps
/// (sampled edges, input rows) whatever the number of threads or producers; bad flags are one
/// clear error naming the flag.
#[test]
fn bench_steps_times_the_same_steps_with_any_thread_count() {
    let out = grandis_ok(&[
        "bench",
        "steps",
        "--vertices",
        "3000",
        "--avg-degree",
        "10",
        "--features",
        "8",
        "--classes",
        "4",
        "--train-fraction",
        "0.3",
        "--fanouts",
        "5,3",
        "--batch-size",
        "64",
        "--steps",
        "3",
        "--threads",
        "1,2",
        "--json",
    ]);
    let report: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let rows = report["rows"].as_array().unwrap();
    // Per mode: one thread and two on a step, and two producers building whole steps.
    assert_eq!(rows.len(), 6, "{report}");
    for mode in ["mb", "cob"] {
        let of: Vec<&serde_json::Value> = rows.iter().filter(|r| r["mode"] == mode).collect();
        assert_eq!(of.len(), 3, "{report}");
        let across: Vec<&str> = of.iter().map(|r| r["across"].as_str().unwrap()).collect();
        assert_eq!(across, ["step", "step", "producers"], "{report}");
        for r in &of {
            assert_eq!(r["system"], "grandis");
            let mut keys = vec!["sample_plan_ms", "gather_ms", "sampled_edges", "input_rows"];
            if r["across"] == "step" {
                keys.extend(["sample_ms", "plan_ms"]);
            }
            for key in keys {
                assert!(r[key].as_f64().unwrap() > 0.0, "{key}: {r}");
            }
        }
        for r in &of[1..] {
            assert_eq!(of[0]["sampled_edges"], r["sampled_edges"], "{report}");
            assert_eq!(of[0]["input_rows"], r["input_rows"], "{report}");
        }
    }
    for (flag, value) in [
        ("--modes", "mb,xx"),
        ("--fanouts", "5,0"),
        ("--threads", "0"),
        ("--baseline", "pyg"),
    ] {
        let (ok, _, err) = grandis(&["bench", "steps", flag, value]);
        assert!(!ok, "{flag} {value} was accepted");
        assert!(err.contains(flag), "{flag} {value}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// `bench train --task link` without a baseline: each seed's run reports AUC, MRR and
/// Hits@10/50 of the test edges (each a fraction), and their means.
#[test]
fn bench_link_reports_ogb_scores_per_seed() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("synth");
    let data = data.to_str().unwrap();
    synth("600", "8", "8", "4", &["--out", data]);
    let out = grandis_ok(&[
        "bench",
        "train",
        "--task",
        "link",
        "--data",
        data,
        "--layers",
        "2",
        "--hidden",
        "16",
        "--out-dim",
        "8",
        "--epochs",
        "3",
        "--seeds",
        "2",
        "--json",
    ]);
    let report: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let ours = &report["grandis"];
    let runs = ours["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{report}");
    for key in ["test_auc", "test_mrr", "test_hits_at_10", "test_hits_at_50"] {
        for r in runs {
            let v = r[key].as_f64().unwrap_or_else(|| panic!("no {key} in {r}"));
            assert!((0.0..=1.0).contains(&v), "{key} {v}");
        }
        let mean = ours[format!("mean_{key}")].as_f64().unwrap();
        let want = (runs[0][key].as_f64().unwrap() + runs[1][key].as_f64().unwrap()) / 2.0;
        assert!((mean - want).abs() < 1e-12, "mean_{key} {mean} vs {want}");
    }
    assert!(out.contains("test MRR  Hits@10  Hits@50"), "{out}");
}
