//! Learnable node embeddings in the single-process trainer: on a featureless graph whose
//! edges follow communities they learn both tasks (node classes above chance on held-out
//! vertices, held-out links far above chance), beside features too; a run is repeatable, a
//! resumed run equals an uninterrupted one (the table and its sparse Adam state are in the
//! checkpoint), `predict_logits` reads the table back; a featureless dataset without them is
//! a clear error.

mod common;

use grandis_models::{ModelConfig, ModelKind};
use grandis_store::{EdgeSplitOptions, InMemoryDataset, LinkSplit, Split};
use grandis_trainer::{train, CheckpointOptions, Objective, TrainOptions, TrainReport};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `classes` communities of `n` vertices (90 % of edges inside one), NO features, the
/// community as the label, a 50 / 25 / 25 vertex split.
fn communities(n: usize, classes: usize, seed: u64) -> InMemoryDataset {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let graph = common::community_graph(&mut r, n, classes, 6);
    let ids: Vec<u32> = (0..n as u32).collect();
    // Every class in every part: the part from the vertex's index inside its community.
    let part = |v: &u32| (*v as usize / classes) % 4;
    InMemoryDataset {
        name: "featureless".into(),
        graph,
        features: Vec::new(),
        feature_dim: 0,
        labels: (0..n).map(|v| (v % classes) as i32).collect(),
        num_classes: classes,
        split: Split {
            train: ids.iter().copied().filter(|v| part(v) < 2).collect(),
            val: ids.iter().copied().filter(|v| part(v) == 2).collect(),
            test: ids.iter().copied().filter(|v| part(v) == 3).collect(),
        },
        types: None,
    }
}

fn config(ds: &InMemoryDataset, dim: usize, outputs: usize) -> ModelConfig {
    ModelConfig {
        heads: 1,
        dropout: 0.1,
        seed: 3,
        ..ModelConfig::new(ModelKind::Gcn, 2, ds.feature_dim + dim, 16, outputs)
    }
}

fn opts(epochs: usize, objective: Objective, dim: usize) -> TrainOptions {
    TrainOptions {
        objective,
        epochs,
        lr: 0.02,
        weight_decay: 0.0,
        adamw: false,
        grad_clip: None,
        seed: 5,
        eval: Default::default(),
        embedding_dim: dim,
    }
}

fn run(ds: &InMemoryDataset, o: &TrainOptions, ck: &CheckpointOptions) -> TrainReport {
    let outputs = match o.objective {
        Objective::Node => ds.num_classes,
        Objective::Link { .. } => 8,
    };
    train(
        ds.view(),
        config(ds, o.embedding_dim, outputs),
        o,
        ck,
        Some(2),
        |_| {},
    )
    .unwrap()
}

#[test]
fn embeddings_learn_node_classes_on_a_featureless_graph() {
    let ds = communities(800, 4, 1);
    let r = run(
        &ds,
        &opts(60, Objective::Node, 16),
        &CheckpointOptions::default(),
    );
    // Chance is 0.25: held-out vertices are classified through their trained neighbours.
    assert!(r.train_acc > 0.9, "train {}", r.train_acc);
    assert!(r.test_acc > 0.6, "test {}", r.test_acc);
    let losses: Vec<f64> = r.epochs.iter().map(|e| e.loss).collect();
    assert!(losses[59] < 0.5 * losses[0], "{losses:?}");
}

#[test]
fn embeddings_learn_links_on_a_featureless_graph() {
    let ds = communities(600, 4, 2);
    let (graph, split) = grandis_store::split_edges(
        ds.graph.view(),
        true,
        &EdgeSplitOptions {
            val: 0.1,
            test: 0.1,
            negatives: 3,
            seed: 2,
        },
    )
    .unwrap();
    let ds = InMemoryDataset { graph, ..ds };
    let r = run_links(&ds, &split, 40);
    let link = r.link.expect("link scores");
    // Frozen at their random start the embeddings reach 0.72 here: the table must learn.
    assert!(link.test.auc > 0.78, "{link:?}");
}

fn run_links(ds: &InMemoryDataset, split: &LinkSplit, epochs: usize) -> TrainReport {
    let mut view = ds.view();
    view.links = Some(split.view());
    let link = Objective::Link {
        negatives: 2,
        decoder: Default::default(),
    };
    let o = opts(epochs, link, 16);
    common::train_plain(view, config(ds, 16, 8), &o, Some(2))
}

#[test]
fn embeddings_are_exact_resume_exactly_and_predict_from_the_checkpoint() {
    // Beside features this time: one noisy column.
    let mut ds = communities(300, 3, 3);
    let mut r = ChaCha8Rng::seed_from_u64(9);
    ds.features = (0..300).map(|_| r.gen_range(-1.0f32..1.0)).collect();
    ds.feature_dim = 1;
    let o = opts(8, Objective::Node, 6);
    let none = CheckpointOptions::default();
    let a = run(&ds, &o, &none);
    let b = run(&ds, &o, &none);
    let losses = |r: &TrainReport| r.epochs.iter().map(|e| e.loss).collect::<Vec<_>>();
    assert_eq!(losses(&a), losses(&b), "same seed, same losses to the bit");

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("emb.safetensors");
    let ck = CheckpointOptions {
        path: Some(path.clone()),
        resume: true,
        ..Default::default()
    };
    let first = run(&ds, &opts(3, Objective::Node, 6), &ck);
    let second = run(&ds, &o, &ck);
    assert_eq!(second.first_epoch, 4);
    let resumed: Vec<f64> = losses(&first).into_iter().chain(losses(&second)).collect();
    assert_eq!(
        resumed,
        losses(&a),
        "the table and its Adam state resume exactly"
    );
    assert_eq!(second.test_acc, a.test_acc);

    // Prediction reads the trained table from the checkpoint: the run's own accuracy.
    let logits = grandis_trainer::predict_logits(ds.view(), &path, Some(1)).unwrap();
    let c = ds.num_classes;
    let correct = ds
        .split
        .test
        .iter()
        .filter(|&&v| {
            let row = &logits[v as usize * c..(v as usize + 1) * c];
            grandis_trainer::argmax(row) as i32 == ds.labels[v as usize]
        })
        .count();
    assert_eq!(correct as f64 / ds.split.test.len() as f64, a.test_acc);

    // Another graph's vertex count: the table does not fit, a clear error.
    let other = communities(150, 3, 3);
    let mut other = InMemoryDataset {
        features: vec![0.0; 150],
        feature_dim: 1,
        ..other
    };
    other.name = "other".into();
    let err = grandis_trainer::predict_logits(other.view(), &path, Some(1)).unwrap_err();
    assert!(format!("{err:#}").contains("300 rows"), "{err:#}");
}

#[test]
fn a_featureless_graph_without_embeddings_is_a_clear_error() {
    let ds = communities(40, 2, 4);
    let o = opts(1, Objective::Node, 0);
    let err = train(
        ds.view(),
        config(&ds, 0, 2),
        &o,
        &CheckpointOptions::default(),
        Some(1),
        |_| {},
    )
    .unwrap_err();
    assert!(format!("{err:#}").contains("--embedding-dim"), "{err:#}");
}
