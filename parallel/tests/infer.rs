//! Layer-wise inference across ranks (`grandis_parallel::infer`) against the one-process pass
//! (`grandis_trainer::layerwise`) on the checkpoint the same run wrote: every architecture,
//! blocks and exchange rounds much smaller than a rank's range, class ids, and a failure that
//! must leave no files.

mod common;

use common::{
    assert_close, config, gather_rank_files, opts, random_dataset, random_partition, read,
};
use grandis_models::ModelKind;
use grandis_parallel::infer::InferOptions;
use grandis_parallel::{JobSpec, Machine, Mode, ParallelOptions, ParallelReport, PartitionedGraph};
use grandis_store::Dataset;
use grandis_trainer::layerwise::{
    predict_layerwise, LayerwiseOptions, LayerwiseOutputs, Predictions,
};
use grandis_trainer::CheckpointOptions;
use grandis_wire::PredictSpec;
use std::path::{Path, PathBuf};

const VERTICES: usize = 240;

fn dataset(dir: &Path) -> Dataset {
    random_dataset(11, VERTICES, 1400, 6, 4)
        .write(dir.join("ds"), false)
        .unwrap()
}

/// Trains on `part` with inference after training into `infer.dir`, writing the checkpoint
/// to `ckpt`, continuing from it when `resume` (and it exists).
#[allow(clippy::too_many_arguments)]
fn run(
    ds: &Dataset,
    part: &PartitionedGraph,
    kind: ModelKind,
    layers: usize,
    mode: Mode,
    infer: InferOptions,
    ckpt: &Path,
    resume: bool,
) -> anyhow::Result<ParallelReport> {
    let view = ds.view();
    let popts = ParallelOptions {
        job: JobSpec {
            mode,
            batch_size: (mode == Mode::Cob).then_some(40),
            // The job's predict section that asks for these outputs.
            predict: Some(PredictSpec {
                dir: infer.dir.to_string_lossy().into_owned(),
                logits: infer.kind == Predictions::Logits,
                embeddings: infer.embeddings,
                block_memory: infer.block_budget,
            }),
            ..JobSpec::default()
        },
        machine: Machine {
            threads_per_rank: Some(1),
            collect_logits: true,
            checkpoint: CheckpointOptions {
                path: Some(ckpt.to_path_buf()),
                resume,
                ..Default::default()
            },
            ..Machine::default()
        },
    };
    grandis_parallel::train(
        view,
        part,
        config(&view, kind, layers),
        &opts(2),
        &popts,
        &mut |_| {},
    )
}

/// The one-process pass over the checkpoint: (logits, embeddings) in dataset order.
fn reference(ds: &Dataset, ckpt: &Path, dir: &Path) -> (Vec<f32>, Vec<f32>) {
    let outputs = LayerwiseOutputs {
        predictions: dir.join("ref-logits.npy"),
        kind: Predictions::Logits,
        embeddings: Some(dir.join("ref-emb.npy")),
    };
    let opts = LayerwiseOptions {
        block_budget: 1 << 30,
        max_block_rows: None,
        scratch_dir: dir.to_path_buf(),
    };
    let b = grandis_engine::CpuBackend::new(Some(1)).unwrap();
    predict_layerwise(&b, ds, ckpt, &outputs, &opts).unwrap();
    (
        read::<f32>(&outputs.predictions),
        read::<f32>(outputs.embeddings.as_ref().unwrap()),
    )
}

/// The rows of every rank's `what` file, put back in dataset order.
fn gather<T: grandis_npy::Element + Default>(
    infer: &InferOptions,
    what: &str,
    ranks: usize,
    cols: usize,
) -> Vec<T> {
    gather_rank_files(|w, r| infer.file(w, r), what, (ranks, VERTICES), cols)
}

fn hidden_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with('.'))
        .collect()
}

/// Every architecture, 2 x 2 ranks, blocks and exchange rounds of a few rows: the ranks'
/// logits and embeddings equal the one-process pass over the checkpoint the run wrote (and
/// the run's own exact final logits), and no scratch file is left.
#[test]
fn ranks_predict_what_one_process_predicts() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    let view = ds.view();
    let part = random_partition(&view, 2, 2, 5);
    for (kind, layers) in [
        (ModelKind::Sage, 2),
        (ModelKind::Sage, 3),
        (ModelKind::Gcn, 2),
        (ModelKind::Gat, 2),
        (ModelKind::ResSage, 2),
    ] {
        let what = format!("{} {layers} layers", kind.name());
        let dir = tmp.path().join(format!("{}-{layers}", kind.name()));
        let infer = InferOptions {
            dir: dir.join("out"),
            kind: Predictions::Logits,
            embeddings: true,
            // A few vertices a block and a few rows an exchange round.
            block_budget: Some(12 << 10),
        };
        let ckpt = dir.join("model.safetensors");
        let r = run(
            &ds,
            &part,
            kind,
            layers,
            Mode::Fb,
            infer.clone(),
            &ckpt,
            false,
        )
        .unwrap_or_else(|e| panic!("{what}: {e:#}"));
        let (logits, emb) = reference(&ds, &ckpt, &dir);
        let classes = view.num_classes;
        let got = gather::<f32>(&infer, "predictions", 4, classes);
        assert_close(&what, &got, &logits, 1e-4);
        assert_close(&what, &got, r.logits.as_ref().unwrap(), 1e-4);
        let width = emb.len() / VERTICES;
        assert_close(
            &what,
            &gather::<f32>(&infer, "embeddings", 4, width),
            &emb,
            1e-4,
        );
        let sum = r
            .execution
            .inference
            .as_ref()
            .expect("an inference summary");
        assert_eq!(sum.vertices, VERTICES as u64, "{what}");
        assert_eq!(sum.ranks, vec![0, 1, 2, 3], "{what}");
        assert!(
            sum.halo_rows > 0 && sum.bytes.inter_server > 0,
            "{what}: {sum:?}"
        );
        assert!(hidden_files(&infer.dir).is_empty(), "{what}: scratch left");
    }
}

/// Class ids after sampled co-batch training: the argmax of the one-process logits.
#[test]
fn class_ids_after_cooperative_batches() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    let view = ds.view();
    let part = random_partition(&view, 1, 2, 8);
    let infer = InferOptions {
        dir: tmp.path().join("out"),
        kind: Predictions::ClassIds,
        embeddings: false,
        block_budget: None,
    };
    let ckpt = tmp.path().join("model.safetensors");
    run(
        &ds,
        &part,
        ModelKind::Sage,
        2,
        Mode::Cob,
        infer.clone(),
        &ckpt,
        false,
    )
    .unwrap();
    let (logits, _) = reference(&ds, &ckpt, tmp.path());
    let ids = gather::<i64>(&infer, "predictions", 2, 1);
    let c = view.num_classes;
    for (v, &id) in ids.iter().enumerate() {
        let row = &logits[v * c..(v + 1) * c];
        let best = grandis_trainer::argmax(row);
        // Ties within float noise may pick either.
        assert!(
            id as usize == best || (row[id as usize] - row[best]).abs() < 1e-5,
            "vertex {v}: class {id}, the logits say {best}"
        );
    }
    assert!(!infer.file("embeddings", 0).exists());
    // From the checkpoint that holds every epoch (a retry after a failure in the inference,
    // or `train --resume`): no training, the same predictions.
    let again = InferOptions {
        dir: tmp.path().join("again"),
        ..infer.clone()
    };
    let r = run(
        &ds,
        &part,
        ModelKind::Sage,
        2,
        Mode::Cob,
        again.clone(),
        &ckpt,
        true,
    )
    .unwrap();
    assert!(
        r.train.epochs.is_empty(),
        "trained again: {:?}",
        r.train.epochs
    );
    assert_eq!(gather::<i64>(&again, "predictions", 2, 1), ids);
}

/// A directory that cannot be written fails the job naming it, and no rank leaves files.
#[test]
fn an_unwritable_directory_fails_the_run_and_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    let view = ds.view();
    let part = random_partition(&view, 2, 1, 2);
    let blocker = tmp.path().join("taken");
    std::fs::write(&blocker, b"a file").unwrap();
    let infer = InferOptions {
        dir: blocker.join("out"),
        kind: Predictions::ClassIds,
        embeddings: false,
        block_budget: None,
    };
    let ckpt = tmp.path().join("model.safetensors");
    let e = run(
        &ds,
        &part,
        ModelKind::Sage,
        2,
        Mode::Fb,
        infer,
        &ckpt,
        false,
    )
    .unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("prediction directory"), "{msg}");
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".npy"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
