//! `grandis data reorder` through the binary: the reordered dataset verifies, has the same
//! vertices and edges, its id map is a permutation, it trains, and an existing output is
//! refused.

use std::path::Path;

const EXE: &str = env!("CARGO_BIN_EXE_grandis");

/// `grandis args...` to completion, killed (and failed) past a generous bound rather than
/// hanging the test run.
fn grandis(args: &[&str]) -> (bool, String, String) {
    grandis_e2e::run_grandis(EXE, args, std::time::Duration::from_secs(600)).unwrap()
}

fn info_line(ds: &Path, key: &str) -> String {
    let (ok, out, err) = grandis(&["data", "info", ds.to_str().unwrap()]);
    assert!(ok, "{err}");
    out.lines()
        .find(|l| l.trim_start().starts_with(key))
        .unwrap_or_else(|| panic!("no {key} line in {out}"))
        .trim()
        .to_string()
}

#[test]
fn reorder_keeps_the_graph_and_maps_ids_back() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("synth");
    let out = dir.path().join("local");
    let (ok, _, err) = grandis(&[
        "data",
        "synth",
        "--nodes",
        "3000",
        "--avg-degree",
        "10",
        "--features",
        "8",
        "--classes",
        "4",
        "--seed",
        "1",
        "--out",
        src.to_str().unwrap(),
        "-q",
    ]);
    assert!(ok, "{err}");
    let (ok, json, err) = grandis(&[
        "data",
        "reorder",
        src.to_str().unwrap(),
        out.to_str().unwrap(),
        "--cluster-vertices",
        "300",
        "--json",
    ]);
    assert!(ok, "{err}");
    let report: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
    assert_eq!(report["clusters"]["count"], 10, "{report}");
    assert!(
        report["clusters"]["edges_inside"].as_u64().unwrap() > 0,
        "{report}"
    );
    let ds = out.join("dataset");
    let (ok, _, err) = grandis(&["data", "verify", ds.to_str().unwrap()]);
    assert!(ok, "{err}");
    for key in ["vertices", "edges", "split"] {
        assert_eq!(info_line(&src, key), info_line(&ds, key));
    }
    // new_to_old.u32: a 64-byte header, then one u32 per vertex, a permutation.
    let bytes = std::fs::read(out.join("new_to_old.u32")).unwrap();
    let mut ids: Vec<u32> = bytes[64..]
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..3000).collect::<Vec<u32>>());
    let (ok, _, err) = grandis(&["train", ds.to_str().unwrap(), "--epochs", "2", "-q"]);
    assert!(ok, "{err}");
    let (ok, _, err) = grandis(&[
        "data",
        "reorder",
        src.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(err.contains("already exists"), "{err}");
}
