//! Sampled and mini-batch modes: a co-batch forward without sampling equals the full-graph
//! forward on its targets; one co-batch (or one mini-batch per device) per epoch reproduces
//! the single-process trainer; EAS that keeps every dependency equals exact FLX; sampled runs
//! are deterministic per seed and report their counters; bad combinations are errors.

mod common;

use common::*;
use grandis_models::{Model, ModelKind};
use grandis_parallel::{
    embeddings, plan_context, JobSpec, Machine, Mode, ParallelOptions, Priority, Sampling,
};
use grandis_sampling::{cob_plan, CoBatcher, Eas, Exact, Fanout};

fn run(
    view: grandis_store::DatasetView<'_>,
    part: &grandis_parallel::PartitionedGraph,
    config: &grandis_models::ModelConfig,
    epochs: usize,
    popts: ParallelOptions,
) -> anyhow::Result<grandis_parallel::ParallelReport> {
    let popts = ParallelOptions {
        machine: Machine {
            threads_per_rank: Some(1),
            collect_logits: true,
            ..popts.machine
        },
        ..popts
    };
    grandis_parallel::train(
        view,
        part,
        config.clone(),
        &opts(epochs),
        &popts,
        &mut |_| {},
    )
}

fn losses(r: &grandis_parallel::ParallelReport) -> Vec<f64> {
    r.train.epochs.iter().map(|s| s.loss).collect()
}

/// Full-graph logits of the freshly initialised model (the trainer's own code path).
fn full_logits(
    view: grandis_store::DatasetView<'_>,
    config: &grandis_models::ModelConfig,
) -> Vec<f32> {
    let prepared = grandis_trainer::Prepared::new(view, config.kind, Some(1)).unwrap();
    let model = Model::new(&prepared.backend, config.clone()).unwrap();
    prepared.logits(&model, None).unwrap()
}

#[test]
fn cob_forward_without_sampling_equals_full_graph_logits() {
    let ds = random_dataset(21, 90, 420, 5, 3);
    let view = ds.view();
    for (servers, devices) in [(2, 2), (1, 3)] {
        let part = random_partition(&view, servers, devices, 21);
        let ctx = plan_context(&view, &part).unwrap();
        for kind in [
            ModelKind::Sage,
            ModelKind::Gcn,
            ModelKind::ResSage,
            ModelKind::Gat,
        ] {
            let config = config(&view, kind, 3);
            let want = full_logits(view, &config);
            let batcher = CoBatcher::new(&ctx, 7, 5).unwrap();
            assert!(
                batcher.iterations() > 1,
                "the test needs several co-batches"
            );
            for it in [0, batcher.iterations() - 1] {
                let batch = batcher.batch(2, it).unwrap();
                let plan = cob_plan(&ctx, &batch, 3, &Exact, 0).unwrap();
                let got = embeddings(view, &part, &config, None, Some(plan), Some(1)).unwrap();
                let c = config.classes;
                let mut checked = 0;
                for &new in batch.iter().flatten() {
                    let o = part.new_to_old[new as usize] as usize;
                    assert!(got.computed[o], "target {o} was not computed");
                    assert_close(
                        &format!(
                            "{} {servers}x{devices} iteration {it} vertex {o}",
                            kind.name()
                        ),
                        &got.logits[o * c..(o + 1) * c],
                        &want[o * c..(o + 1) * c],
                        1e-4,
                    );
                    checked += 1;
                }
                assert!(checked > 0);
                // Only the co-batch's targets are outputs.
                assert_eq!(got.computed.iter().filter(|&&b| b).count(), checked);
            }
        }
    }
}

#[test]
fn one_cobatch_or_minibatch_per_epoch_equals_single_trainer() {
    let (ds, part) = random_case(4, 70, 300, 4, 3, 2, 2);
    let view = ds.view();
    for kind in [
        ModelKind::Sage,
        ModelKind::Gcn,
        ModelKind::ResSage,
        ModelKind::Gat,
    ] {
        let config = config(&view, kind, 2);
        let reference = single(view, &config, &opts(3));
        for mode in [Mode::Cob, Mode::Mb] {
            // A batch larger than any server's (device's) train set: one step per epoch on
            // the exact closure of every training vertex, same dropout keys as the trainer.
            let r = run(
                view,
                &part,
                &config,
                3,
                ParallelOptions {
                    job: JobSpec {
                        mode,
                        batch_size: Some(1000),
                        ..JobSpec::default()
                    },
                    ..Default::default()
                },
            )
            .unwrap();
            let what = format!("{} {}", kind.name(), mode.name());
            assert_eq!(r.execution.iterations_per_epoch, 1, "{what}");
            assert_losses(&what, &losses(&r), &reference.0, 1e-4);
            // Evaluation is exact full-graph inference.
            assert_close(&what, r.logits.as_ref().unwrap(), &reference.1, 1e-4);
            if mode == Mode::Mb {
                assert_eq!(
                    r.execution.halo_bytes_per_epoch.intra_server, 0,
                    "{what}: MB shares nothing"
                );
            }
            assert_eq!(r.execution.halo_bytes_per_epoch.inter_server, 0, "{what}");
        }
    }
}

/// Batched modes evaluate with the layer-wise pass across the ranks, never on a plan of a
/// whole partition: the logits of every vertex are the whole graph's forward pass under the
/// trained weights (read back from the run's checkpoint), and the accuracies the argmax counts
/// over every labelled vertex. Sampled training (fanout) does not change that evaluation is
/// exact.
#[test]
fn batched_evaluation_is_the_whole_graph_forward_pass() {
    let (ds, part) = random_case(8, 90, 420, 5, 3, 2, 2);
    let view = ds.view();
    let dir = tempfile::tempdir().unwrap();
    for kind in [ModelKind::Sage, ModelKind::Gat] {
        let config = config(&view, kind, 2);
        for (mode, batch) in [(Mode::Cob, 7), (Mode::Mb, 3)] {
            let what = format!("{} {}", kind.name(), mode.name());
            let path = dir.path().join(format!("{what}.safetensors"));
            let r = run(
                view,
                &part,
                &config,
                2,
                ParallelOptions {
                    job: JobSpec {
                        mode,
                        batch_size: Some(batch),
                        sampling: grandis_parallel::Sampling::Fanout {
                            fanouts: vec![2, 2],
                            relation_fanouts: Default::default(),
                        },
                        ..JobSpec::default()
                    },
                    machine: Machine {
                        checkpoint: grandis_trainer::CheckpointOptions {
                            path: Some(path.clone()),
                            ..Default::default()
                        },
                        ..Machine::default()
                    },
                },
            )
            .unwrap();
            assert!(
                r.execution.iterations_per_epoch > 1,
                "{what}: several batches"
            );
            let prepared = grandis_trainer::Prepared::new(view, kind, Some(1)).unwrap();
            let mut model = Model::new(&prepared.backend, config.clone()).unwrap();
            grandis_trainer::load_checkpoint(&path)
                .unwrap()
                .restore(&prepared.backend, &mut model, false)
                .unwrap();
            let want = prepared.logits(&model, None).unwrap();
            let got = r.logits.as_ref().unwrap();
            assert_close(&what, got, &want, 1e-4);
            let c = config.classes;
            let accuracy = |ids: &[u32]| {
                let labelled: Vec<u32> = ids
                    .iter()
                    .copied()
                    .filter(|&v| (0..c as i32).contains(&view.labels[v as usize]))
                    .collect();
                let hits = labelled
                    .iter()
                    .filter(|&&v| {
                        let row = &want[v as usize * c..(v as usize + 1) * c];
                        grandis_trainer::argmax(row) as i32 == view.labels[v as usize]
                    })
                    .count();
                hits as f64 / labelled.len() as f64
            };
            assert_eq!(r.train.train_acc, accuracy(view.train), "{what}: train");
            assert_eq!(r.train.val_acc, accuracy(view.val), "{what}: val");
            assert_eq!(r.train.test_acc, accuracy(view.test), "{what}: test");
        }
    }
}

#[test]
fn eas_keeping_every_dependency_equals_exact_flx() {
    let (ds, part) = random_case(8, 60, 260, 4, 3, 2, 2);
    let view = ds.view();
    let config = config(&view, ModelKind::Sage, 2);
    let exact = run(
        view,
        &part,
        &config,
        3,
        ParallelOptions {
            job: JobSpec {
                mode: Mode::Flx,
                preload_hops: Some(2),
                ..JobSpec::default()
            },
            ..Default::default()
        },
    )
    .unwrap();
    let eas = run(
        view,
        &part,
        &config,
        3,
        ParallelOptions {
            job: JobSpec {
                mode: Mode::Flx,
                preload_hops: Some(2),
                sampling: Sampling::Eas {
                    hops: 2,
                    fanout: 10_000,
                    priority: Priority::Degree,
                },
                ..JobSpec::default()
            },
            ..Default::default()
        },
    )
    .unwrap();
    assert_losses("eas(f=inf)", &losses(&eas), &losses(&exact), 1e-4);
    assert_eq!(eas.execution.sampled_edges, exact.execution.sampled_edges);
}

#[test]
fn sampled_modes_are_deterministic_and_report_counters() {
    let (ds, part) = random_case(12, 120, 900, 4, 3, 2, 2);
    let view = ds.view();
    let config = config(&view, ModelKind::Sage, 2);
    let cases = [
        (
            "flx-eas",
            ParallelOptions {
                job: JobSpec {
                    mode: Mode::Flx,
                    preload_hops: Some(2),
                    sampling: Sampling::Eas {
                        hops: 1,
                        fanout: 2,
                        priority: Priority::Degree,
                    },
                    resample_every: Some(1),
                    ..JobSpec::default()
                },
                ..Default::default()
            },
        ),
        (
            "cob-eas",
            with_job(batched(
                Mode::Cob,
                9,
                Sampling::Eas {
                    hops: 1,
                    fanout: 2,
                    priority: Priority::Uniform,
                },
            )),
        ),
        (
            "cob-sage",
            with_job(batched(
                Mode::Cob,
                9,
                Sampling::Fanout {
                    fanouts: vec![3, 2],
                    relation_fanouts: Default::default(),
                },
            )),
        ),
        (
            "cob-saint",
            with_job(batched(Mode::Cob, 20, Sampling::Saint { walk_length: 2 })),
        ),
        (
            "mb-sage",
            with_job(batched(
                Mode::Mb,
                5,
                Sampling::Fanout {
                    fanouts: vec![3, 2],
                    relation_fanouts: Default::default(),
                },
            )),
        ),
    ];
    let labelled_train = view
        .train
        .iter()
        .filter(|&&v| view.labels[v as usize] >= 0)
        .count() as u64;
    for (name, popts) in cases {
        let a = run(view, &part, &config, 2, popts.clone()).unwrap();
        let b = run(view, &part, &config, 2, popts.clone()).unwrap();
        assert_eq!(losses(&a), losses(&b), "{name}: same seed, same losses");
        assert!(losses(&a).iter().all(|l| l.is_finite()), "{name}");
        assert_eq!(a.execution.beta.len(), 2, "{name}: beta per server");
        assert!(
            a.execution.beta.iter().all(|&x| (0.0..=1.0).contains(&x)),
            "{name}"
        );
        assert_eq!(a.execution.computed_vertices_per_layer.len(), 2, "{name}");
        assert!(a.execution.sampled_edges > 0, "{name}");
        assert!(
            a.execution.inter_server_sampled_edges <= a.execution.sampled_edges,
            "{name}: a subset of the sampled edges"
        );
        if name.starts_with("mb") || (name.starts_with("cob-") && name != "cob-saint") {
            // Two servers' targets sample each other's vertices.
            assert!(a.execution.inter_server_sampled_edges > 0, "{name}");
        }
        assert_eq!(
            a.execution.halo_bytes_per_epoch.inter_server, 0,
            "{name}: no inter-server halo"
        );
        if name.starts_with("cob-e") || name.starts_with("cob-sage") || name.starts_with("mb") {
            // An epoch covers every labelled training vertex exactly once.
            assert_eq!(a.execution.targets_per_epoch, labelled_train, "{name}");
            assert!(a.execution.iterations_per_epoch > 1, "{name}");
        }
        if name.starts_with("mb") {
            assert_eq!(a.execution.halo_bytes_per_epoch.intra_server, 0, "{name}");
        }
        if name == "cob-sage" {
            // Per layer, at most (fanout + 1) x the rows of the layer above are computed.
            let c = &a.execution.computed_vertices_per_layer;
            assert!(c[1] <= c[0], "{name}: {c:?}");
        }
        let other_seed = grandis_parallel::train(
            view,
            &part,
            config.clone(),
            &grandis_trainer::TrainOptions {
                seed: 99,
                eval: Default::default(),
                ..opts(2)
            },
            &ParallelOptions {
                machine: Machine {
                    threads_per_rank: Some(1),
                    ..popts.machine.clone()
                },
                ..popts.clone()
            },
            &mut |_| {},
        )
        .unwrap();
        assert_ne!(
            losses(&other_seed),
            losses(&a),
            "{name}: another seed samples anew"
        );
    }
}

#[test]
fn sampling_error_is_zero_only_without_dropped_edges() {
    let (ds, part) = random_case(30, 80, 500, 4, 3, 2, 1);
    let view = ds.view();
    let ctx = plan_context(&view, &part).unwrap();
    let config = config(&view, ModelKind::Sage, 2);
    let full = embeddings(view, &part, &config, None, None, Some(1)).unwrap();
    assert!(full.computed.iter().all(|&b| b));
    let err = |plan| {
        let e = embeddings(view, &part, &config, None, Some(plan), Some(1)).unwrap();
        let w = e.widths[0];
        (0..view.num_vertices())
            .filter(|&v| e.computed[v])
            .map(|v| {
                let a = &e.layers[0][v * w..(v + 1) * w];
                let b = &full.layers[0][v * w..(v + 1) * w];
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y) * (x - y))
                    .sum::<f32>()
                    .sqrt()
            })
            .sum::<f32>()
    };
    let all = |s: &dyn grandis_sampling::Sampler| {
        let ranges: Vec<Vec<u32>> = (0..2)
            .map(|s| part.layout.server_range(s).collect())
            .collect();
        cob_plan(&ctx, &ranges, 2, s, 0).unwrap()
    };
    let keep_all = Eas::new(2, 10_000, Priority::Degree, 1).unwrap();
    assert!(err(all(&keep_all)) < 1e-3);
    let eas = Eas::new(1, 1, Priority::Degree, 1).unwrap();
    assert!(err(all(&eas)) > 1e-3);
    let fan = Fanout::new(vec![1, 1], 1).unwrap();
    assert!(err(all(&fan)) > 1e-3);
}

#[test]
fn bad_sampling_combinations_are_errors() {
    let (ds, part) = random_case(2, 40, 120, 3, 2, 2, 1);
    let view = ds.view();
    let config = config(&view, ModelKind::Sage, 2);
    let err = |p: ParallelOptions| format!("{:#}", run(view, &part, &config, 1, p).unwrap_err());
    let e = err(ParallelOptions {
        job: JobSpec {
            mode: Mode::Fb,
            sampling: Sampling::Eas {
                hops: 1,
                fanout: 3,
                priority: Priority::Degree,
            },
            ..JobSpec::default()
        },
        ..Default::default()
    });
    assert!(e.contains("mode 'fb' trains on the exact graph"), "{e}");
    let e = err(with_job(batched(
        Mode::Mb,
        4,
        Sampling::Saint { walk_length: 0 },
    )));
    assert!(e.contains("saint"), "{e}");
    let e = err(with_job(batched(
        Mode::Cob,
        4,
        Sampling::Fanout {
            fanouts: vec![3, 3, 3],
            relation_fanouts: Default::default(),
        },
    )));
    assert!(e.contains("fanouts"), "{e}");
    let e = err(ParallelOptions {
        job: JobSpec {
            mode: Mode::Cob,
            batch_size: Some(4),
            preload_hops: Some(1),
            ..JobSpec::default()
        },
        ..Default::default()
    });
    assert!(e.contains("preload"), "{e}");
}

/// Steps are pure functions of their index: several producer threads, finishing in any
/// order, give the run one producer gives (losses, logits, traffic and statistics), with
/// sampling and with a window far smaller than the steps of an epoch.
#[test]
fn plan_producer_threads_do_not_change_the_run() {
    let (ds, part) = random_case(21, 200, 1000, 4, 3, 2, 2);
    let view = ds.view();
    let config = config(&view, ModelKind::Sage, 2);
    for (mode, batch) in [(Mode::Cob, 6), (Mode::Mb, 3)] {
        let with = |threads| {
            run(
                view,
                &part,
                &config,
                2,
                ParallelOptions {
                    job: JobSpec {
                        mode,
                        batch_size: Some(batch),
                        sampling: Sampling::Fanout {
                            fanouts: vec![3, 2],
                            relation_fanouts: Default::default(),
                        },
                        ..JobSpec::default()
                    },
                    machine: Machine {
                        plan_threads: Some(threads),
                        ..Machine::default()
                    },
                },
            )
            .unwrap()
        };
        let one = with(1);
        assert!(
            one.execution.iterations_per_epoch > 6,
            "{mode}: many steps per epoch, got {}",
            one.execution.iterations_per_epoch
        );
        for threads in [2, 5] {
            let many = with(threads);
            let what = format!("{mode} with {threads} producers");
            assert_eq!(losses(&many), losses(&one), "{what}");
            assert_eq!(many.logits, one.logits, "{what}");
            assert_eq!(
                many.execution.halo_bytes_per_epoch, one.execution.halo_bytes_per_epoch,
                "{what}"
            );
            assert_eq!(
                many.execution.fetch_bytes_per_epoch, one.execution.fetch_bytes_per_epoch,
                "{what}"
            );
            assert_eq!(
                many.execution.sampled_edges, one.execution.sampled_edges,
                "{what}"
            );
            assert_eq!(many.execution.beta, one.execution.beta, "{what}");
            assert_eq!(
                many.execution.computed_vertices_per_layer,
                one.execution.computed_vertices_per_layer,
                "{what}"
            );
        }
    }
}
