//! Shared helpers: random datasets, the single-process reference (the trainer's own code
//! path) and the comparison the exactness tests use.
#![allow(dead_code)]

use grandis_masking::Layout;
use grandis_models::{ModelConfig, ModelKind};
use grandis_parallel::{JobSpec, Machine, Mode, ParallelOptions, ParallelReport, PartitionedGraph};
use grandis_store::{DatasetView, EdgeOptions, InMemoryDataset, SelfLoops, Split};
use grandis_trainer::{CheckpointOptions, TrainOptions};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A random directed graph (some isolated vertices and self-loops), random features, labels
/// with a few unlabelled vertices, and train/val/test splits.
pub fn random_dataset(seed: u64, n: usize, edges: usize, f: usize, c: usize) -> InMemoryDataset {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let pairs: Vec<(u32, u32)> = (0..edges)
        .map(|_| (rng.gen_range(0..n as u32), rng.gen_range(0..n as u32)))
        .collect();
    let graph = grandis_store::graph_from_edges(
        n as u64,
        pairs,
        EdgeOptions {
            symmetrize: rng.gen_bool(0.5),
            self_loops: SelfLoops::Keep,
        },
    )
    .unwrap();
    let features = (0..n * f).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let labels = (0..n)
        .map(|_| {
            if rng.gen_bool(0.1) {
                -1
            } else {
                rng.gen_range(0..c as i32)
            }
        })
        .collect();
    let mut ids: Vec<u32> = (0..n as u32).collect();
    ids.shuffle(&mut rng);
    let a = n / 2;
    let b = a + n / 4;
    let mut split = Split {
        train: ids[..a.max(1)].to_vec(),
        val: ids[a.max(1)..b.max(a.max(1))].to_vec(),
        test: ids[b.max(a.max(1))..].to_vec(),
    };
    split.train.sort_unstable();
    split.val.sort_unstable();
    split.test.sort_unstable();
    InMemoryDataset {
        name: "random".into(),
        graph,
        features,
        feature_dim: f,
        labels,
        num_classes: c,
        split,
        types: None,
    }
}

/// The usual test case: [`random_dataset`] from `seed` (`n` vertices, `edges` edges, `f`
/// features, `c` classes) and a [`random_partition`] of it onto `servers x devices` ranks
/// from the same seed. The caller takes the view (`ds.view()`), which borrows the dataset.
pub fn random_case(
    seed: u64,
    n: usize,
    edges: usize,
    f: usize,
    c: usize,
    servers: usize,
    devices: usize,
) -> (InMemoryDataset, PartitionedGraph) {
    let ds = random_dataset(seed, n, edges, f, c);
    let part = random_partition(&ds.view(), servers, devices, seed);
    (ds, part)
}

/// A random layout with non-empty ranges and a random relabelling.
pub fn random_partition(
    view: &DatasetView<'_>,
    servers: usize,
    devices: usize,
    seed: u64,
) -> PartitionedGraph {
    let n = view.num_vertices();
    let ranks = servers * devices;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    let mut cuts: Vec<u32> = (1..n as u32).collect();
    cuts.shuffle(&mut rng);
    let mut bounds: Vec<u32> = cuts[..ranks - 1].to_vec();
    bounds.push(0);
    bounds.push(n as u32);
    bounds.sort_unstable();
    let layout = Layout::from_bounds(servers, devices, &bounds).unwrap();
    let mut perm: Vec<u32> = (0..n as u32).collect();
    perm.shuffle(&mut rng);
    PartitionedGraph::relabel(view.graph, perm, layout, "random test layout").unwrap()
}

pub fn config(view: &DatasetView<'_>, kind: ModelKind, layers: usize) -> ModelConfig {
    ModelConfig {
        kind,
        layers,
        in_dim: view.feature_dim,
        hidden: 8,
        heads: 2,
        output_heads: 1,
        classes: view.num_classes,
        dropout: 0.5,
        layer_norm: kind == ModelKind::ResSage,
        seed: 7,
        relations: view
            .types
            .map(grandis_models::ModelRelation::of)
            .unwrap_or_default(),
        num_bases: None,
    }
}

pub fn opts(epochs: usize) -> TrainOptions {
    // Through serde so that options the trainer adds later take their defaults.
    serde_json::from_value(serde_json::json!({
        "epochs": epochs,
        "lr": 0.01,
        "weight_decay": 5e-4,
        "adamw": false,
        "grad_clip": null,
        "seed": 3,
        // The final evaluation only (the accuracies after every epoch cost a pass each).
        "eval": "end",
    }))
    .unwrap()
}

/// `--mode single` exactly as the CLI runs it: `grandis_trainer::train` (per-epoch losses),
/// with a checkpoint that `grandis_trainer::predict_logits` reads back (final logits).
pub fn single(
    view: DatasetView<'_>,
    config: &ModelConfig,
    opts: &TrainOptions,
) -> (Vec<f64>, Vec<f32>) {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("single.safetensors");
    let ckpt = CheckpointOptions {
        path: Some(path.clone()),
        resume: false,
        ..Default::default()
    };
    let report =
        grandis_trainer::train(view, config.clone(), opts, &ckpt, Some(1), |_| {}).unwrap();
    let logits = grandis_trainer::predict_logits(view, &path, Some(1)).unwrap();
    (report.epochs.iter().map(|s| s.loss).collect(), logits)
}

pub fn parallel(
    view: DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    opts: &TrainOptions,
    mode: Mode,
    k: Option<usize>,
) -> anyhow::Result<ParallelReport> {
    let job = JobSpec {
        mode,
        preload_hops: k.map(|k| k as u32),
        ..JobSpec::default()
    };
    run_job(view, part, config, opts, job)
}

/// `job` run in one process, one thread per rank, the final logits collected.
pub fn run_job(
    view: DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    opts: &TrainOptions,
    job: JobSpec,
) -> anyhow::Result<ParallelReport> {
    let popts = ParallelOptions {
        job,
        machine: Machine {
            threads_per_rank: Some(1),
            collect_logits: true,
            ..Machine::default()
        },
    };
    grandis_parallel::train(view, part, config.clone(), opts, &popts, &mut |_| {})
}

/// Relative closeness: |a - b| <= tol * max(1, |b|) element by element.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * b.abs().max(1.0),
            "{what}: element {i} is {a}, single mode has {b}"
        );
    }
}

pub fn assert_losses(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: epoch counts differ");
    for (e, (&a, &b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * b.abs().max(1e-12),
            "{what}: epoch {} loss {a}, single mode {b}",
            e + 1
        );
    }
}

/// Runs the parallel mode and checks it against single mode.
pub fn check_exact(
    view: DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    opts: &TrainOptions,
    reference: &(Vec<f64>, Vec<f32>),
    mode: Mode,
    k: Option<usize>,
) -> ParallelReport {
    let what = format!(
        "{} {:?} k={:?} {}x{} ({})",
        config.kind.name(),
        mode,
        k,
        part.layout.servers(),
        part.layout.devices(),
        part.source
    );
    let r = parallel(view, part, config, opts, mode, k).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    let losses: Vec<f64> = r.train.epochs.iter().map(|s| s.loss).collect();
    assert_losses(&what, &losses, &reference.0, 1e-4);
    assert_close(&what, r.logits.as_ref().unwrap(), &reference.1, 1e-4);
    r
}

/// The largest memory-model estimate of any rank of a run.
pub fn peak_model_bytes(r: &ParallelReport) -> u64 {
    r.execution
        .memory
        .iter()
        .map(|m| m.model_bytes)
        .max()
        .unwrap_or(0)
}

/// Options that run `job` with the machine's defaults.
pub fn with_job(job: JobSpec) -> ParallelOptions {
    ParallelOptions {
        job,
        ..Default::default()
    }
}

/// A batched job: `mode` over batches of `batch` targets drawn by `sampling`.
pub fn batched(mode: Mode, batch: u32, sampling: grandis_wire::Sampling) -> JobSpec {
    JobSpec {
        mode,
        batch_size: Some(batch),
        sampling,
        ..JobSpec::default()
    }
}

/// An `.npy` file's values.
pub fn read<T: grandis_npy::Element>(path: &std::path::Path) -> Vec<T> {
    grandis_npy::NpyFile::open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .values::<T>()
        .unwrap()
        .into_owned()
}

/// The rows (`cols` each) of every rank's `what` file (`file(what, rank)`, `ranks` of them),
/// put back in dataset order through its `vertices` file; every one of the `vertices` written
/// exactly once.
pub fn gather_rank_files<T: grandis_npy::Element + Default>(
    file: impl Fn(&str, usize) -> std::path::PathBuf,
    what: &str,
    (ranks, vertices): (usize, usize),
    cols: usize,
) -> Vec<T> {
    let mut all = vec![T::default(); vertices * cols];
    let mut seen = vec![false; vertices];
    for r in 0..ranks {
        let ids = read::<i64>(&file("vertices", r));
        let rows = read::<T>(&file(what, r));
        assert_eq!(rows.len(), ids.len() * cols, "{what} of rank {r}");
        for (i, &v) in ids.iter().enumerate() {
            assert!(!seen[v as usize], "vertex {v} written twice");
            seen[v as usize] = true;
            all[v as usize * cols..(v as usize + 1) * cols]
                .copy_from_slice(&rows[i * cols..(i + 1) * cols]);
        }
    }
    assert!(seen.iter().all(|&s| s), "every vertex is written once");
    all
}
