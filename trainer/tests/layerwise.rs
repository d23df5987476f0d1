//! Layer-wise inference (`grandis_trainer::layerwise`) against the whole-graph forward pass:
//! every architecture, blocks of every size, the embeddings file, budgets and failures.

use grandis_models::{ModelConfig, ModelKind};
use grandis_store::Dataset;
use grandis_synth::SynthConfig;
use grandis_trainer::layerwise::{
    predict_layerwise, LayerwiseOptions, LayerwiseOutputs, Predictions,
};
use grandis_trainer::{train, CheckpointOptions, TrainOptions};
use std::path::Path;

const VERTICES: usize = 600;

/// A synthetic graph written to `dir` (layer-wise inference reads a stored dataset).
fn dataset(dir: &Path) -> Dataset {
    grandis_synth::generate_in_memory(&SynthConfig {
        nodes: VERTICES as u64,
        avg_degree: 8.0,
        features: 12,
        classes: 5,
        seed: 3,
        ..SynthConfig::default()
    })
    .unwrap()
    .write(dir.join("ds"), false)
    .unwrap()
}

/// Trains `kind` for three epochs and returns the checkpoint's path.
fn checkpoint(ds: &Dataset, dir: &Path, kind: ModelKind, layers: usize) -> std::path::PathBuf {
    let view = ds.view();
    let cfg = ModelConfig {
        heads: 2,
        layer_norm: kind == ModelKind::ResSage,
        seed: 4,
        ..ModelConfig::new(kind, layers, view.feature_dim, 16, view.num_classes)
    };
    let path = dir.join(format!("{kind:?}-{layers}.safetensors"));
    let opts = TrainOptions {
        objective: Default::default(),
        epochs: 3,
        lr: 0.01,
        weight_decay: 5e-4,
        adamw: false,
        grad_clip: None,
        seed: 1,
        eval: Default::default(),
        embedding_dim: 0,
    };
    let ck = CheckpointOptions {
        path: Some(path.clone()),
        ..Default::default()
    };
    train(view, cfg, &opts, &ck, Some(2), |_| {}).unwrap();
    path
}

fn options(dir: &Path, max_block_rows: Option<usize>) -> LayerwiseOptions {
    LayerwiseOptions {
        block_budget: 1 << 30,
        max_block_rows,
        scratch_dir: dir.to_path_buf(),
    }
}

fn read_f32(path: &Path) -> Vec<f32> {
    grandis_npy::NpyFile::open(path)
        .unwrap()
        .values::<f32>()
        .unwrap()
        .into_owned()
}

/// Logits and class ids equal the whole-graph forward pass for every architecture and block
/// size (a single vertex per block, a size that leaves a ragged last block, one block), the
/// embeddings do not depend on the block size, and no scratch file is left behind.
#[test]
fn layerwise_equals_whole_graph() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let b = grandis_engine::CpuBackend::new(Some(2)).unwrap();
    for (kind, layers) in [
        (ModelKind::Sage, 3),
        (ModelKind::Gcn, 2),
        (ModelKind::Gat, 2),
        (ModelKind::ResSage, 4),
        (ModelKind::Mlp, 2),
    ] {
        let ck = checkpoint(&ds, dir.path(), kind, layers);
        let whole = grandis_trainer::predict_logits(ds.view(), &ck, Some(2)).unwrap();
        let mut first_embeddings: Option<Vec<f32>> = None;
        for max_rows in [Some(1), Some(97), None] {
            let out = dir.path().join("out");
            std::fs::create_dir_all(&out).unwrap();
            let logits_path = out.join("logits.npy");
            let emb_path = out.join("emb.npy");
            let outputs = LayerwiseOutputs {
                predictions: logits_path.clone(),
                kind: Predictions::Logits,
                embeddings: Some(emb_path.clone()),
            };
            let report =
                predict_layerwise(&b, &ds, &ck, &outputs, &options(&out, max_rows)).unwrap();
            let logits = read_f32(&logits_path);
            assert_eq!(logits.len(), whole.len());
            let worst = logits
                .iter()
                .zip(&whole)
                .map(|(a, w)| (a - w).abs() / w.abs().max(1.0))
                .fold(0.0f32, f32::max);
            assert!(worst < 1e-5, "{kind:?} blocks of {max_rows:?}: {worst}");
            let emb = read_f32(&emb_path);
            match &first_embeddings {
                None => first_embeddings = Some(emb),
                Some(e) => assert_eq!(*e, emb, "{kind:?} embeddings with {max_rows:?}"),
            }
            if kind == ModelKind::Sage {
                // 12 -> 16 aggregates its input; 16 -> 16 and 16 -> 5 are split and gather
                // their transformed rows.
                let cols: Vec<usize> = report.stages.iter().map(|s| s.gathered_cols).collect();
                assert_eq!(cols, [12, 16, 5]);
            }
            if max_rows == Some(1) {
                assert!(report.stages.iter().all(|s| s.blocks == VERTICES));
            }
            // Class ids are the argmax of the same logits.
            let ids_path = out.join("ids.npy");
            let outputs = LayerwiseOutputs {
                predictions: ids_path.clone(),
                kind: Predictions::ClassIds,
                embeddings: None,
            };
            predict_layerwise(&b, &ds, &ck, &outputs, &options(&out, max_rows)).unwrap();
            let ids = grandis_npy::NpyFile::open(&ids_path)
                .unwrap()
                .values::<i64>()
                .unwrap()
                .into_owned();
            let c = ds.view().num_classes;
            let expected: Vec<i64> = whole
                .chunks_exact(c)
                .map(|r| grandis_trainer::argmax(r) as i64)
                .collect();
            assert_eq!(ids, expected, "{kind:?}");
            let mut left: Vec<_> = std::fs::read_dir(&out)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            left.sort();
            assert_eq!(left, ["emb.npy", "ids.npy", "logits.npy"], "{kind:?}");
            std::fs::remove_dir_all(&out).unwrap();
        }
    }
}

/// The budget decides the block size: a small one gives many blocks that each fit it, one
/// below a single vertex's block is an error naming the budget, and a failed pass leaves no
/// output and no scratch file.
#[test]
fn the_budget_bounds_every_block() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let ck = checkpoint(&ds, dir.path(), ModelKind::Sage, 2);
    let b = grandis_engine::CpuBackend::new(Some(1)).unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let outputs = LayerwiseOutputs {
        predictions: out.join("p.npy"),
        kind: Predictions::ClassIds,
        embeddings: None,
    };
    let budget = 64 << 10;
    let opts = LayerwiseOptions {
        block_budget: budget,
        ..options(&out, None)
    };
    let report = predict_layerwise(&b, &ds, &ck, &outputs, &opts).unwrap();
    for s in &report.stages {
        assert!(s.blocks > 3, "{s:?}");
        assert!(s.largest_block_bytes <= budget, "{s:?}");
        assert!(s.source_rows >= VERTICES as u64);
    }
    std::fs::remove_file(out.join("p.npy")).unwrap();
    let opts = LayerwiseOptions {
        block_budget: 2 << 10,
        ..opts
    };
    let err = predict_layerwise(&b, &ds, &ck, &outputs, &opts).unwrap_err();
    let msg = format!("{err:#}");
    assert!(msg.contains("block budget of"), "{msg}");
    assert_eq!(
        std::fs::read_dir(&out).unwrap().count(),
        0,
        "left behind after {msg}"
    );
}

/// A checkpoint of another dataset's shape is an error before anything is written.
#[test]
fn a_mismatched_checkpoint_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let other = grandis_synth::generate_in_memory(&SynthConfig {
        nodes: 50,
        features: 7,
        classes: 5,
        ..SynthConfig::default()
    })
    .unwrap()
    .write(dir.path().join("other"), false)
    .unwrap();
    let ck = checkpoint(&other, dir.path(), ModelKind::Sage, 2);
    let b = grandis_engine::CpuBackend::new(Some(1)).unwrap();
    let outputs = LayerwiseOutputs {
        predictions: dir.path().join("p.npy"),
        kind: Predictions::Logits,
        embeddings: None,
    };
    let err = predict_layerwise(&b, &ds, &ck, &outputs, &options(dir.path(), None)).unwrap_err();
    assert!(format!("{err:#}").contains("expects 7 features"), "{err:#}");
    assert!(!dir.path().join("p.npy").exists());
}
