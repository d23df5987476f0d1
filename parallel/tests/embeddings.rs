//! Learnable node embeddings in the distributed modes: FB and FLX (every k), each rank keeping
//! its own vertices' rows, reproduce `--mode single` — per-epoch losses and final logits
//! within 1e-4 relative, dropout on — with features beside the embeddings or none, for node
//! classification and link prediction; a run resumed from its checkpoint continues exactly,
//! and the checkpoint holds single's table; the modes and models that cannot train them yet
//! are refused with a message naming the field.

mod common;

use common::*;
use grandis_models::{ModelConfig, ModelKind};
use grandis_parallel::{JobSpec, Machine, Mode, ParallelOptions, PartitionedGraph};
use grandis_store::DatasetView;
use grandis_trainer::{CheckpointOptions, LinkDecoder, Objective, TrainOptions};
use proptest::prelude::*;

const DIM: usize = 4;

fn emb_config(view: &DatasetView<'_>, kind: ModelKind, layers: usize) -> ModelConfig {
    ModelConfig {
        in_dim: view.feature_dim + DIM,
        ..config(view, kind, layers)
    }
}

fn emb_opts(epochs: usize) -> TrainOptions {
    TrainOptions {
        embedding_dim: DIM,
        ..opts(epochs)
    }
}

/// FB and FLX with every k against single.
fn check_modes(
    view: DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    opts: &TrainOptions,
) {
    let reference = single(view, config, opts);
    check_exact(view, part, config, opts, &reference, Mode::Fb, None);
    for k in 0..=config.layers {
        check_exact(view, part, config, opts, &reference, Mode::Flx, Some(k));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    #[test]
    fn fb_and_flx_with_embeddings_match_single(
        seed in 0u64..1_000_000,
        n in 16usize..40,
        degree in 2usize..5,
        features in proptest::bool::ANY,
        servers in 1usize..=3,
        devices in 1usize..=2,
        kind in 0usize..3,
        layers in 1usize..=2,
    ) {
        let f = if features { 3 } else { 0 };
        let ds = random_dataset(seed, n, n * degree, f, 3);
        let view = ds.view();
        let part = random_partition(&view, servers, devices, seed);
        let kind = [ModelKind::Sage, ModelKind::Gcn, ModelKind::Gat][kind];
        check_modes(view, &part, &emb_config(&view, kind, layers), &emb_opts(3));
    }
}

/// Link prediction on a featureless graph, the embeddings its whole input (LastFM's case).
#[test]
fn featureless_link_prediction_matches_single() {
    let ds = random_dataset(5, 40, 160, 0, 2);
    let symmetric = ds.graph.view().is_symmetric();
    let split_opts = grandis_store::EdgeSplitOptions {
        val: 0.1,
        test: 0.1,
        negatives: 3,
        seed: 5,
    };
    let (graph, split) =
        grandis_store::split_edges(ds.graph.view(), symmetric, &split_opts).unwrap();
    let ds = grandis_store::InMemoryDataset {
        graph,
        labels: vec![-1; 40],
        num_classes: 0,
        split: Default::default(),
        ..ds
    };
    let mut view = ds.view();
    view.links = Some(split.view());
    let part = random_partition(&view, 2, 2, 5);
    let config = ModelConfig {
        classes: 6,
        ..emb_config(&view, ModelKind::Sage, 2)
    };
    let opts = TrainOptions {
        objective: Objective::Link {
            negatives: 2,
            decoder: LinkDecoder::Dot,
        },
        ..emb_opts(4)
    };
    check_modes(view, &part, &config, &opts);
}

/// Two epochs, a checkpoint, two more from it: the four epochs of one run, and the
/// checkpoint's table is the one mode single writes after two epochs.
#[test]
fn a_checkpoint_with_embeddings_resumes_exactly() {
    let ds = random_dataset(9, 36, 150, 2, 3);
    let view = ds.view();
    let part = random_partition(&view, 2, 2, 9);
    let config = emb_config(&view, ModelKind::Sage, 2);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("run.safetensors");
    let run = |epochs: usize, resume: bool, mode: Mode| {
        let popts = ParallelOptions {
            job: JobSpec {
                mode,
                preload_hops: (mode == Mode::Flx).then_some(1),
                ..JobSpec::default()
            },
            machine: Machine {
                threads_per_rank: Some(1),
                collect_logits: true,
                checkpoint: CheckpointOptions {
                    path: Some(path.clone()),
                    resume,
                    ..Default::default()
                },
                ..Machine::default()
            },
        };
        grandis_parallel::train(
            view,
            &part,
            config.clone(),
            &emb_opts(epochs),
            &popts,
            &mut |_| {},
        )
        .unwrap()
    };
    for mode in [Mode::Fb, Mode::Flx] {
        let whole = parallel(
            view,
            &part,
            &config,
            &emb_opts(4),
            mode,
            (mode == Mode::Flx).then_some(1),
        )
        .unwrap();
        run(2, false, mode);
        let saved = grandis_trainer::load_checkpoint(&path).unwrap();
        let table = saved.node_embeddings(36, true).unwrap().expect("the table");
        let single_path = tmp.path().join("single.safetensors");
        let ckpt = CheckpointOptions {
            path: Some(single_path.clone()),
            resume: false,
            ..Default::default()
        };
        grandis_trainer::train(view, config.clone(), &emb_opts(2), &ckpt, Some(1), |_| {}).unwrap();
        let single_table = grandis_trainer::load_checkpoint(&single_path)
            .unwrap()
            .node_embeddings(36, true)
            .unwrap()
            .expect("single's table");
        assert_close(
            &format!("{mode} table"),
            table.table(),
            single_table.table(),
            1e-4,
        );
        let resumed = run(4, true, mode);
        let losses = |r: &grandis_parallel::ParallelReport| {
            r.train.epochs.iter().map(|e| e.loss).collect::<Vec<_>>()
        };
        assert_eq!(resumed.train.epochs.len(), 2, "{mode}: epochs 3 and 4");
        assert_losses(
            &format!("{mode} resumed"),
            &losses(&resumed),
            &losses(&whole)[2..],
            1e-6,
        );
        assert_close(
            &format!("{mode} resumed logits"),
            resumed.logits.as_ref().unwrap(),
            whole.logits.as_ref().unwrap(),
            1e-6,
        );
    }
}

/// What cannot train embeddings yet says so, naming the field.
#[test]
fn other_modes_and_models_are_refused() {
    let base = JobSpec {
        dataset: "data".into(),
        embedding_dim: 8,
        ..JobSpec::default()
    };
    for (job, says) in [
        (
            JobSpec {
                mode: Mode::Cob,
                ..base.clone()
            },
            "not mode 'cob'",
        ),
        (
            JobSpec {
                mode: Mode::Fb,
                model: grandis_wire::ModelKind::ResSage,
                ..base.clone()
            },
            "with models sage, gcn and gat",
        ),
    ] {
        let e = job.validate().unwrap_err().to_string();
        assert!(e.contains("embedding_dim") && e.contains(says), "{e}");
    }
    for mode in [Mode::Single, Mode::Fb, Mode::Flx] {
        let job = JobSpec {
            mode,
            ..base.clone()
        };
        assert!(job.validate().is_ok(), "{mode}: {:?}", job.validate());
    }
    // A library caller's ResSAGE+ run gets an error, not a wrong gradient.
    let ds = random_dataset(2, 20, 60, 2, 2);
    let view = ds.view();
    let part = random_partition(&view, 1, 2, 2);
    let config = emb_config(&view, ModelKind::ResSage, 2);
    let e = parallel(view, &part, &config, &emb_opts(1), Mode::Fb, None).unwrap_err();
    assert!(
        format!("{e:#}").contains("learnable node embeddings"),
        "{e:#}"
    );
}
