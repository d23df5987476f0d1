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
        let (ds, part) = random_case(seed, n, n * degree, f, 3, servers, devices);
        let view = ds.view();
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
    let (ds, part) = random_case(9, 36, 150, 2, 3, 2, 2);
    let view = ds.view();
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

/// ResSAGE+ outside mode single is refused, naming the field; every other model and mode
/// takes embeddings.
#[test]
fn ressage_outside_single_is_refused() {
    let base = JobSpec {
        dataset: "data".into(),
        embedding_dim: 8,
        ..JobSpec::default()
    };
    for mode in [Mode::Fb, Mode::Cob] {
        let job = JobSpec {
            mode,
            model: grandis_wire::ModelKind::ResSage,
            ..base.clone()
        };
        let e = job.validate().unwrap_err().to_string();
        assert!(
            e.contains("embedding_dim") && e.contains("with models sage, gcn and gat"),
            "{e}"
        );
    }
    for mode in [
        Mode::Single,
        Mode::Fb,
        Mode::Flx,
        Mode::Cob,
        Mode::Mb,
        Mode::Cluster,
    ] {
        let job = JobSpec {
            mode,
            ..base.clone()
        };
        assert!(job.validate().is_ok(), "{mode}: {:?}", job.validate());
    }
    // A library caller's ResSAGE+ run gets an error, not a wrong gradient.
    let (ds, part) = random_case(2, 20, 60, 2, 2, 1, 2);
    let view = ds.view();
    let config = emb_config(&view, ModelKind::ResSage, 2);
    let e = parallel(view, &part, &config, &emb_opts(1), Mode::Fb, None).unwrap_err();
    assert!(
        format!("{e:#}").contains("learnable node embeddings"),
        "{e:#}"
    );
}

/// Predictions as logits into `dir`.
fn logits_to(dir: &std::path::Path) -> grandis_wire::PredictSpec {
    grandis_wire::PredictSpec {
        dir: dir.to_string_lossy().into_owned(),
        logits: true,
        embeddings: false,
        block_memory: None,
    }
}

/// The logits every rank wrote into `dir`, in dataset order.
fn predicted_logits(dir: &std::path::Path, vertices: usize, classes: usize) -> Vec<f32> {
    let file = |what: &str, rank: usize| dir.join(format!("{what}.{rank}.npy"));
    gather_rank_files(file, "predictions", (4, vertices), classes)
}

/// [`run_job`], its error a panic naming the job.
fn must_run(
    view: DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    opts: &TrainOptions,
    job: JobSpec,
) -> grandis_parallel::ParallelReport {
    let what = format!("{} {:?}", job.mode, job.sampling);
    run_job(view, part, config, opts, job).unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

/// The batched modes: one batch of every vertex (mb, cob; exact closures) is mode single's
/// epoch, embeddings and all (a row no step reads keeps a zero moment, so its missing Adam
/// steps change nothing); with fanout sampling and small batches they train (the loss
/// falls), the same run again gives the same losses, and the layer-wise evaluation reads the
/// embeddings (predictions after training too, equal to the evaluation's logits).
#[test]
fn batched_modes_train_embeddings() {
    let planted = grandis_synth::SynthConfig {
        nodes: 240,
        features: 0,
        signal: 3.0,
        ..Default::default()
    };
    let ds = grandis_synth::generate_in_memory(&planted).unwrap();
    let view = ds.view();
    let part = random_partition(&view, 2, 2, 4);
    let config = ModelConfig {
        dropout: 0.0,
        ..emb_config(&view, ModelKind::Sage, 2)
    };
    let reference = single(view, &config, &emb_opts(3));
    for mode in [Mode::Mb, Mode::Cob] {
        let r = must_run(
            view,
            &part,
            &config,
            &emb_opts(3),
            batched(mode, 240, grandis_wire::Sampling::None),
        );
        let losses: Vec<f64> = r.train.epochs.iter().map(|e| e.loss).collect();
        assert_losses(&format!("{mode} one batch"), &losses, &reference.0, 1e-4);
        assert_close(
            &format!("{mode} one batch"),
            r.logits.as_ref().unwrap(),
            &reference.1,
            1e-4,
        );
    }
    let fanouts = grandis_wire::Sampling::Fanout {
        fanouts: vec![4, 3],
        relation_fanouts: Default::default(),
    };
    let opts = TrainOptions {
        lr: 0.05,
        ..emb_opts(8)
    };
    let tmp = tempfile::tempdir().unwrap();
    for (mode, batch, sampling) in [
        (Mode::Mb, 16, fanouts.clone()),
        (Mode::Cob, 32, fanouts),
        (Mode::Cluster, 64, grandis_wire::Sampling::None),
    ] {
        let dir = tmp.path().join(mode.to_string());
        let job = JobSpec {
            predict: Some(logits_to(&dir)),
            ..batched(mode, batch, sampling)
        };
        let r = must_run(view, &part, &config, &opts, job.clone());
        let losses: Vec<f64> = r.train.epochs.iter().map(|e| e.loss).collect();
        assert!(r.execution.iterations_per_epoch > 1, "{mode}");
        assert!(
            losses[losses.len() - 1] < losses[0] * 0.9,
            "{mode}: {losses:?}"
        );
        let again = must_run(view, &part, &config, &opts, job);
        let again: Vec<f64> = again.train.epochs.iter().map(|e| e.loss).collect();
        assert_eq!(losses, again, "{mode}: the same run again");
        // The files hold the evaluation's logits, row for row.
        let written = predicted_logits(&dir, 240, config.classes);
        assert_close(
            &format!("{mode} predictions"),
            &written,
            r.logits.as_ref().unwrap(),
            1e-5,
        );
    }
}

/// Predictions after an fb run: the files hold mode single's logits.
#[test]
fn predictions_after_fb_read_the_embeddings() {
    let (ds, part) = random_case(13, 50, 200, 3, 3, 2, 2);
    let view = ds.view();
    let config = emb_config(&view, ModelKind::Gcn, 2);
    let reference = single(view, &config, &emb_opts(3));
    let tmp = tempfile::tempdir().unwrap();
    let job = JobSpec {
        mode: Mode::Fb,
        predict: Some(logits_to(tmp.path())),
        ..JobSpec::default()
    };
    must_run(view, &part, &config, &emb_opts(3), job);
    let written = predicted_logits(tmp.path(), 50, config.classes);
    assert_close("fb predictions", &written, &reference.1, 1e-4);
}

/// Mode auto plans (and calibrates) the model's whole input, embedding columns included, and
/// trains its choice.
#[test]
fn auto_plans_and_trains_with_embeddings() {
    let (ds, part) = random_case(17, 60, 240, 3, 3, 2, 2);
    let view = ds.view();
    let config = emb_config(&view, ModelKind::Sage, 2);
    let job = JobSpec {
        mode: Mode::Auto,
        embedding_dim: DIM as u32,
        ..JobSpec::default()
    };
    let r = must_run(view, &part, &config, &emb_opts(2), job);
    assert_ne!(r.execution.mode, Mode::Auto);
    assert!(r.train.epochs.iter().all(|e| e.loss.is_finite()));
}

/// The embeddings' traffic is counted apart, per training step: every ask carries a count
/// (4 bytes to each other rank), a row asked of its home on the other server its id, its
/// values and its gradient (4 + 8 x dim bytes), a halo row (whose values ride the layer-0
/// exchange) its id and its gradient (4 + 4 x dim), and no layer-0 gradient crosses the halo
/// exchange. One layer, 2 servers x 1 device: fb's rows are all halo rows, flx k=1's all asked.
#[test]
fn embedding_traffic_is_counted_per_link_class() {
    let (ds, part) = random_case(21, 60, 240, 3, 3, 2, 1);
    let view = ds.view();
    let config = emb_config(&view, ModelKind::Sage, 1);
    let (d, row) = (DIM as u64, (view.feature_dim + DIM) as u64 * 4);
    let fb = parallel(view, &part, &config, &emb_opts(2), Mode::Fb, None).unwrap();
    let x = &fb.execution;
    let halo = x.forward_bytes_per_epoch.inter_server / row;
    assert!(halo > 0);
    assert_eq!(x.backward_bytes_per_epoch.inter_server, 0, "fb");
    let bytes = x.node_embedding_bytes_per_epoch;
    assert_eq!(bytes.intra_server, 0);
    assert_eq!(bytes.inter_server, 2 * 4 + halo * (4 + 4 * d), "fb");
    let flx = parallel(view, &part, &config, &emb_opts(2), Mode::Flx, Some(1)).unwrap();
    let x = &flx.execution;
    let replicated = x.replicated_vertices as u64;
    assert!(replicated > 0);
    assert_eq!(x.forward_bytes_per_epoch.inter_server, 0, "flx k=1");
    let bytes = x.node_embedding_bytes_per_epoch;
    assert_eq!(
        bytes.inter_server,
        2 * 4 + replicated * (4 + 8 * d),
        "flx k=1"
    );
}
