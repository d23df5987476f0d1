//! `grandis predict` through the binary on a graph larger than the memory it is given: the
//! layer-wise pass cuts every stage into blocks that fit the budget, its peak RSS stays far
//! below the data it reads and writes, and the outputs equal a one-block pass.

mod common;

use common::*;

use std::path::Path;

const VERTICES: u64 = 300_000;
const FEATURES: u64 = 64;
const HIDDEN: u64 = 64;
const CLASSES: u64 = 8;

fn values<T: grandis_npy::Element>(path: &Path) -> Vec<T> {
    grandis_npy::NpyFile::open(path)
        .unwrap()
        .values::<T>()
        .unwrap()
        .into_owned()
}

#[test]
fn predict_streams_a_graph_larger_than_its_budget() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    synth(
        &VERTICES.to_string(),
        "10",
        &FEATURES.to_string(),
        &CLASSES.to_string(),
        &["--seed", "1", "--out", &p("ds"), "-q"],
    );
    grandis_ok(&[
        "train",
        &p("ds"),
        "--epochs",
        "1",
        "--layers",
        "2",
        "--hidden",
        &HIDDEN.to_string(),
        "--checkpoint",
        &p("m.safetensors"),
        "--threads",
        "2",
    ]);

    // 16 MiB per block, against 77 MB of features and 77 MB of embeddings.
    let budget = 16u64 << 20;
    let out = grandis_ok(&[
        "predict",
        &p("ds"),
        "--checkpoint",
        &p("m.safetensors"),
        "--out",
        &p("logits.npy"),
        "--logits",
        "--embeddings",
        &p("emb.npy"),
        "--memory-budget",
        "16MiB",
        "--json",
    ]);
    let report = grandis_e2e::last_json_line(&out).unwrap_or_else(|| panic!("no JSON in {out}"));
    for stage in report["stages"].as_array().unwrap() {
        assert!(stage["blocks"].as_u64().unwrap() > 4, "{stage}");
        assert!(
            stage["largest_block_bytes"].as_u64().unwrap() <= budget,
            "{stage}"
        );
    }
    let data = VERTICES * (FEATURES + HIDDEN) * 4;
    let peak = report["peak_rss_bytes"].as_u64().unwrap();
    // What stays: the budget, dataset verification's 64 MiB scan window, O(V) state and the
    // binary; never the data the pass streams through.
    assert!(
        peak < budget + (100 << 20) && peak < data,
        "peak RSS {peak} with a {budget}-byte budget over {data} bytes of data"
    );

    // One block (default budget) gives the same embeddings and logits, and class ids are
    // their argmax.
    grandis_ok(&[
        "predict",
        &p("ds"),
        "--checkpoint",
        &p("m.safetensors"),
        "--out",
        &p("ids.npy"),
        "--embeddings",
        &p("emb1.npy"),
        "--threads",
        "2",
    ]);
    assert_eq!(
        values::<f32>(&dir.path().join("emb.npy")),
        values::<f32>(&dir.path().join("emb1.npy"))
    );
    let logits = values::<f32>(&dir.path().join("logits.npy"));
    assert_eq!(logits.len() as u64, VERTICES * CLASSES);
    let ids = values::<i64>(&dir.path().join("ids.npy"));
    let argmax: Vec<i64> = logits
        .chunks_exact(CLASSES as usize)
        .map(|r| grandis_trainer::argmax(r) as i64)
        .collect();
    assert_eq!(ids, argmax);

    // An output in a missing directory is refused before any work.
    let (ok, _, err) = grandis(&[
        "predict",
        &p("ds"),
        "--checkpoint",
        &p("m.safetensors"),
        "--out",
        &p("missing/ids.npy"),
    ]);
    assert!(!ok);
    assert!(err.contains("is not a directory"), "{err}");

    // A budget below one vertex's block is one clear line and writes nothing.
    let (ok, _, err) = grandis(&[
        "predict",
        &p("ds"),
        "--checkpoint",
        &p("m.safetensors"),
        "--out",
        &p("none.npy"),
        "--memory-budget",
        "64KiB",
    ]);
    assert!(!ok);
    assert!(err.contains("raise the memory budget"), "{err}");
    assert!(!dir.path().join("none.npy").exists());
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "scratch files left: {left:?}");
}

/// A model with learnable node embeddings: `--embedding-dim` trains them, the checkpoint keeps
/// them, and `grandis predict` (layer-wise, in blocks) reads them back to the run's own
/// test accuracy; mode fb on 2 x 2 ranks trains them to the same predictions; ResSAGE+
/// outside mode single is refused by flag.
#[test]
fn predict_reads_learnt_node_embeddings_from_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    synth(
        "3000",
        "8",
        "4",
        "4",
        &["--seed", "2", "--out", &p("ds"), "-q"],
    );
    // 20 epochs of GCN over the features and 8 embedding columns, checkpointed to `name`.
    let train = |name: &str, extra: &[&str]| {
        let checkpoint = p(name);
        let mut args = vec![
            "train",
            &p("ds"),
            "--epochs",
            "20",
            "--model",
            "gcn",
            "--hidden",
            "16",
            "--embedding-dim",
            "8",
            "--checkpoint",
            &checkpoint,
            "-q",
        ]
        .into_iter()
        .map(String::from)
        .collect::<Vec<String>>();
        args.extend(extra.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        grandis(&args)
    };
    let (ok, json, err) = train("m.safetensors", &["--json"]);
    assert!(ok, "{err}");
    let summary: serde_json::Value = serde_json::from_str(json.lines().last().unwrap()).unwrap();
    assert_eq!(summary["job"]["embedding_dim"], 8, "{summary}");
    let test_acc = summary["test_acc"].as_f64().unwrap();
    grandis_ok(&[
        "predict",
        &p("ds"),
        "--checkpoint",
        &p("m.safetensors"),
        "--out",
        &p("ids.npy"),
        "--memory-budget",
        "1MiB",
    ]);
    let ids: Vec<i64> = values(Path::new(&p("ids.npy")));
    let ds = grandis_store::Dataset::open(p("ds")).unwrap();
    let view = ds.view();
    let correct = view
        .test
        .iter()
        .filter(|&&v| ids[v as usize] == i64::from(view.labels[v as usize]))
        .count();
    let acc = correct as f64 / view.test.len() as f64;
    assert!(
        (acc - test_acc).abs() < 1e-9,
        "predict {acc}, the run {test_acc}"
    );

    // Mode fb 2 x 2 trains the same embeddings (each rank its own vertices' rows): the same
    // predictions from its checkpoint.
    let (ok, _, err) = train(
        "fb.safetensors",
        &["--mode", "fb", "--servers", "2", "--devices", "2"],
    );
    assert!(ok, "{err}");
    grandis_ok(&[
        "predict",
        &p("ds"),
        "--checkpoint",
        &p("fb.safetensors"),
        "--out",
        &p("fb-ids.npy"),
    ]);
    let fb_ids: Vec<i64> = values(Path::new(&p("fb-ids.npy")));
    let differ = fb_ids.iter().zip(&ids).filter(|(a, b)| a != b).count();
    // Near-ties of two classes may fall either way after 20 epochs of f32 sums in another
    // order.
    assert!(differ <= 3, "{differ} of {} predictions differ", ids.len());

    let (ok, _, err) = grandis(&[
        "train",
        &p("ds"),
        "--embedding-dim",
        "8",
        "--model",
        "ressage",
        "--mode",
        "fb",
        "--servers",
        "2",
    ]);
    assert!(!ok && err.contains("--embedding-dim"), "{err}");
}
