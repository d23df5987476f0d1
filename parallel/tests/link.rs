//! Link prediction in the distributed modes: FB and FLX (every k) reproduce `--mode single`'s
//! link prediction — per-epoch losses and final embeddings within 1e-4 relative, dropout on —
//! on random graphs with random layouts, every model, and so does MB, seeded by edges, when
//! one batch holds every supervision edge (exact closures), and so does COB with one co-batch
//! per server; both with fanout sampling train and are functions of their seed; the run
//! reports its link scores; cluster batches are refused with the rule's message.

mod common;

use common::*;
use grandis_models::{ModelConfig, ModelKind};
use grandis_parallel::{JobSpec, Machine, Mode, ParallelOptions, PartitionedGraph};
use grandis_store::{DatasetView, EdgeSplitOptions, InMemoryDataset, LinkSplit};
use grandis_trainer::{LinkDecoder, Objective, TrainOptions};
use grandis_wire::Sampling;
use proptest::prelude::*;

/// `random_dataset`'s graph made symmetric or not, its edges split for link prediction
/// (validation and test edges out of the message-passing graph), no labels.
fn link_dataset(seed: u64, n: usize, degree: usize, f: usize) -> (InMemoryDataset, LinkSplit) {
    let (ds, mut split) = held_out(random_dataset(seed, n, n * degree, f, 2), seed);
    // Negatives drawn among the training edges' destinations' range, as a typed relation's
    // are (every mode must draw the same ones).
    let first = split.train.chunks_exact(2).map(|p| p[1]).min().unwrap();
    split.destinations = Some((first, n as u32));
    (ds, split)
}

/// `ds` with a tenth of its edges held out for validation and a tenth for testing (3
/// negatives each), no labels.
fn held_out(ds: InMemoryDataset, seed: u64) -> (InMemoryDataset, LinkSplit) {
    let symmetric = ds.graph.view().is_symmetric();
    let opts = EdgeSplitOptions {
        val: 0.1,
        test: 0.1,
        negatives: 3,
        seed,
    };
    let (graph, split) = grandis_store::split_edges(ds.graph.view(), symmetric, &opts).unwrap();
    let n = ds.labels.len();
    (
        InMemoryDataset {
            graph,
            labels: vec![-1; n],
            num_classes: 0,
            split: Default::default(),
            ..ds
        },
        split,
    )
}

fn link_config(view: &DatasetView<'_>, kind: ModelKind, layers: usize) -> ModelConfig {
    ModelConfig {
        classes: 6,
        ..config(view, kind, layers)
    }
}

fn link_opts(epochs: usize, decoder: LinkDecoder) -> TrainOptions {
    TrainOptions {
        objective: Objective::Link {
            negatives: 2,
            decoder,
        },
        ..opts(epochs)
    }
}

/// Every exact mode against single on one dataset, layout and model.
fn check_link_exact(
    view: DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    opts: &TrainOptions,
) {
    let reference = single(view, config, opts);
    let single_scores = grandis_trainer::train(
        view,
        config.clone(),
        opts,
        &Default::default(),
        Some(1),
        |_| {},
    )
    .unwrap()
    .link
    .expect("single's link scores");
    let mut runs = vec![(Mode::Fb, None)];
    runs.extend((0..=config.layers).map(|k| (Mode::Flx, Some(k))));
    // Modes mb and cob seeded by edges, one batch per device or server holding all its
    // supervision edges and exact closures: each rank scores its edges and their negatives
    // (mode single's draw), and the ranks' sums are single's epoch.
    runs.extend([(Mode::Mb, None), (Mode::Cob, None)]);
    // Mode cluster with one batch of every vertex (clusters of at least the graph: eight
    // per batch): every supervision edge inside it, mode single's negatives.
    runs.push((Mode::Cluster, None));
    let every_edge = view.links.map_or(0, |l| l.train.len() / 2) as u32;
    let every_vertex_clusters = 8 * view.num_vertices() as u32;
    for (mode, k) in runs {
        let what = format!(
            "link {} {mode} k={k:?} {}x{}",
            config.kind.name(),
            part.layout.servers(),
            part.layout.devices()
        );
        let r = match mode {
            Mode::Mb | Mode::Cob => {
                batched_link(view, part, config, opts, (mode, every_edge), Sampling::None)
            }
            Mode::Cluster => batched_link(
                view,
                part,
                config,
                opts,
                (mode, every_vertex_clusters),
                Sampling::None,
            ),
            _ => parallel(view, part, config, opts, mode, k),
        }
        .unwrap_or_else(|e| panic!("{what}: {e:#}"));
        let losses: Vec<f64> = r.train.epochs.iter().map(|s| s.loss).collect();
        assert_losses(&what, &losses, &reference.0, 1e-4);
        assert_close(&what, r.logits.as_ref().unwrap(), &reference.1, 1e-4);
        let scores = r.train.link.as_ref().expect("link scores in the report");
        // Ranks of near-equal scores may swap: the AUCs agree closely, not to the bit.
        assert!(
            (scores.test.auc - single_scores.test.auc).abs() < 0.02,
            "{what}: test AUC {} against single's {}",
            scores.test.auc,
            single_scores.test.auc
        );
        assert!(r.train.test_acc.is_nan(), "{what}: no accuracy");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    #[test]
    fn fb_and_flx_link_prediction_match_single(
        seed in 0u64..1_000_000,
        n in 16usize..40,
        degree in 2usize..5,
        servers in 1usize..=3,
        devices in 1usize..=2,
        kind in 0usize..4,
        layers in 1usize..=2,
        mlp in proptest::bool::ANY,
    ) {
        let (ds, split) = link_dataset(seed, n, degree, 5);
        let mut view = ds.view();
        view.links = Some(split.view());
        let part = random_partition(&view, servers, devices, seed);
        let kind = [ModelKind::Sage, ModelKind::Gcn, ModelKind::ResSage, ModelKind::Gat][kind];
        let config = link_config(&view, kind, layers);
        let decoder = if mlp { LinkDecoder::Mlp } else { LinkDecoder::Dot };
        check_link_exact(view, &part, &config, &link_opts(3, decoder));
    }
}

/// A fixed case with more epochs, evaluation after each and the per-epoch validation AUC.
#[test]
fn every_model_fixed_case_with_per_epoch_scores() {
    let (ds, split) = link_dataset(11, 60, 4, 6);
    let mut view = ds.view();
    view.links = Some(split.view());
    let part = random_partition(&view, 2, 2, 11);
    for (kind, layers) in [
        (ModelKind::Sage, 2),
        (ModelKind::Gcn, 2),
        (ModelKind::ResSage, 2),
        (ModelKind::Gat, 2),
    ] {
        let config = link_config(&view, kind, layers);
        // The MLP decoder for two of the models: its weights train on every rank alike.
        let decoder = if layers % 2 == 0 && kind != ModelKind::Gat {
            LinkDecoder::Mlp
        } else {
            LinkDecoder::Dot
        };
        let mut opts = link_opts(5, decoder);
        opts.eval = grandis_trainer::EvalSchedule::Every(1);
        check_link_exact(view, &part, &config, &opts);
        let r = parallel(view, &part, &config, &opts, Mode::Fb, None).unwrap();
        assert!(
            r.train
                .epochs
                .iter()
                .all(|e| e.val_auc.is_finite() && e.val_acc.is_nan()),
            "{:?}",
            r.train.epochs
        );
        // The decoder's traffic is counted apart: each step all-reduces the 60 x 6 matrix
        // of embeddings and its gradient, and the MLP's gradient, hierarchically as the
        // weight gradients are (2 x 2 x their bytes within the servers, 2 x between them:
        // see tests/accounting.rs), one step per epoch.
        let mlp = match decoder {
            LinkDecoder::Mlp => (6 * 6 + 2 * 6 + 1) * 4,
            LinkDecoder::Dot => 0,
        };
        let b = 2 * 60 * 6 * 4 + mlp;
        let gather = r.execution.link_embedding_bytes_per_epoch;
        assert_eq!(
            (gather.intra_server, gather.inter_server),
            (2 * 2 * b, 2 * b),
            "{kind:?}"
        );
    }
}

/// A link job's batched run (mode mb or cob): batches of `batch` supervision edges per
/// device or server, `sampling`.
fn batched_link(
    view: DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    opts: &TrainOptions,
    (mode, batch): (Mode, u32),
    sampling: Sampling,
) -> anyhow::Result<grandis_parallel::ParallelReport> {
    run_job(view, part, config, opts, batched(mode, batch, sampling))
}

/// Modes mb and cob with fanout sampling and small edge batches: several steps an epoch, the
/// loss falls, validation AUC beats chance, and the run is a function of its seed (the same
/// losses again, whatever the number of plan threads).
#[test]
fn batched_link_prediction_with_fanout_sampling_trains_deterministically() {
    // Planted classes, homophilous edges and features that carry the class: links to learn.
    let planted = grandis_synth::SynthConfig {
        nodes: 300,
        signal: 3.0,
        ..Default::default()
    };
    let (ds, split) = held_out(grandis_synth::generate_in_memory(&planted).unwrap(), 11);
    let mut view = ds.view();
    view.links = Some(split.view());
    let part = random_partition(&view, 2, 2, 11);
    let config = ModelConfig {
        dropout: 0.0,
        ..link_config(&view, ModelKind::Sage, 2)
    };
    let opts = TrainOptions {
        lr: 0.02,
        ..link_opts(12, LinkDecoder::Dot)
    };
    let fanouts = Sampling::Fanout {
        fanouts: vec![3, 2],
        relation_fanouts: Default::default(),
    };
    for (mode, batch, sampling) in [
        (Mode::Mb, 16, fanouts.clone()),
        (Mode::Cob, 32, fanouts.clone()),
        // Cluster batches of 64 vertices: the edges inside each, negatives among its
        // vertices.
        (Mode::Cluster, 64, Sampling::None),
    ] {
        let r = batched_link(view, &part, &config, &opts, (mode, batch), sampling.clone())
            .unwrap_or_else(|e| panic!("{mode}: {e:#}"));
        let losses: Vec<f64> = r.train.epochs.iter().map(|s| s.loss).collect();
        assert!(
            r.execution.iterations_per_epoch > 1,
            "{mode}: {}",
            r.execution.iterations_per_epoch
        );
        assert!(losses[losses.len() - 1] < losses[0], "{mode}: {losses:?}");
        let scores = r.train.link.as_ref().expect("link scores");
        assert!(scores.val.auc > 0.5, "{mode}: {scores:?}");
        let popts = ParallelOptions {
            job: batched(mode, batch, sampling),
            machine: Machine {
                threads_per_rank: Some(1),
                plan_threads: Some(3),
                ..Machine::default()
            },
        };
        let again =
            grandis_parallel::train(view, &part, config.clone(), &opts, &popts, &mut |_| {})
                .unwrap();
        let again: Vec<f64> = again.train.epochs.iter().map(|s| s.loss).collect();
        assert_eq!(losses, again, "{mode}");
    }
}

/// A mode and sampling that do not train link prediction (flx with a sampled plan) is a clear
/// refusal, not node classification in its place.
#[test]
fn sampled_flx_refuses_link_prediction() {
    let (ds, split) = link_dataset(3, 40, 3, 4);
    let mut view = ds.view();
    view.links = Some(split.view());
    let part = random_partition(&view, 2, 1, 3);
    let config = link_config(&view, ModelKind::Sage, 2);
    let p = ParallelOptions {
        job: JobSpec {
            mode: Mode::Flx,
            sampling: Sampling::Fanout {
                fanouts: vec![2, 2],
                relation_fanouts: Default::default(),
            },
            ..JobSpec::default()
        },
        machine: Machine::default(),
    };
    let err = grandis_parallel::train(
        view,
        &part,
        config,
        &link_opts(1, LinkDecoder::Dot),
        &p,
        &mut |_| {},
    )
    .unwrap_err();
    assert!(
        format!("{err:#}").contains("link prediction trains in modes single, fb, flx, cluster"),
        "{err:#}"
    );
}

/// `mode auto` plans a link job among the exact plans (fb, flx for every k) and batches of its
/// supervision edges: exact co-batches (the job's batch size, its half and its quarter)
/// without sampling; with fanout sampling, sampled co-batches and per-device mini-batches
/// (their FLX-EAS candidates are not link candidates). Each is counted from the steps a run of
/// it builds, and auto trains the one it chose exactly as that mode does.
#[test]
fn auto_plans_link_prediction_over_exact_plans_and_edge_batches() {
    let (ds, split) = link_dataset(5, 80, 4, 6);
    let mut view = ds.view();
    view.links = Some(split.view());
    let part = random_partition(&view, 2, 2, 5);
    let config = link_config(&view, ModelKind::Sage, 2);
    let opts = link_opts(2, LinkDecoder::Dot);
    let machine = Machine {
        threads_per_rank: Some(1),
        collect_logits: true,
        ..Machine::default()
    };
    let fanout = Sampling::Fanout {
        fanouts: vec![3, 2],
        relation_fanouts: Default::default(),
    };
    let job = |mode: Mode, k: Option<u32>, sampling: &Sampling, batch: Option<u32>| JobSpec {
        mode,
        preload_hops: k,
        sampling: sampling.clone(),
        batch_size: batch,
        device_memory: Some(1 << 30),
        ..JobSpec::default()
    };
    let exact = ["fb", "flx k=1", "flx k=2"];
    for (sampling, batched) in [
        (
            Sampling::None,
            vec![
                ("cob 40 exact", Mode::Cob, 40),
                ("cob 20 exact", Mode::Cob, 20),
                ("cob 10 exact", Mode::Cob, 10),
            ],
        ),
        (
            fanout.clone(),
            vec![
                ("cob 40 sage(3,2)", Mode::Cob, 40),
                ("cob 20 sage(3,2)", Mode::Cob, 20),
                ("cob 10 sage(3,2)", Mode::Cob, 10),
                ("mb 20 sage(3,2)", Mode::Mb, 20),
            ],
        ),
    ] {
        let p = ParallelOptions {
            job: job(Mode::Auto, None, &sampling, Some(40)),
            machine: machine.clone(),
        };
        let r = grandis_parallel::train(view, &part, config.clone(), &opts, &p, &mut |_| {})
            .unwrap_or_else(|e| panic!("{e:#}"));
        let plan = r.execution.plan.as_ref().expect("auto reports its plan");
        let names: Vec<&str> = plan.candidates.iter().map(|c| c.name.as_str()).collect();
        let want: Vec<&str> = exact
            .iter()
            .copied()
            .chain(batched.iter().map(|b| b.0))
            .collect();
        assert_eq!(names, want, "{plan:?}");
        // Every batched candidate was counted (a node-classification batch of this dataset,
        // which has no labelled vertex, has no step to count), and a larger co-batch gathers
        // more.
        let counted = &plan.candidates[exact.len()..];
        for c in counted {
            assert!(c.epoch_s.is_some() && c.note.is_none(), "{c:?}");
        }
        assert!(counted[0].peak_bytes > counted[2].peak_bytes, "{counted:?}");
        let direct = match plan.chosen.as_str() {
            "fb" => job(Mode::Fb, None, &Sampling::None, None),
            "flx k=1" => job(Mode::Flx, Some(1), &Sampling::None, None),
            "flx k=2" => job(Mode::Flx, Some(2), &Sampling::None, None),
            chosen => match batched.iter().find(|b| b.0 == chosen) {
                Some(&(_, mode, b)) => job(mode, None, &sampling, Some(b)),
                None => panic!("auto chose {chosen}"),
            },
        };
        let direct = ParallelOptions {
            job: direct,
            machine: machine.clone(),
        };
        let direct =
            grandis_parallel::train(view, &part, config.clone(), &opts, &direct, &mut |_| {})
                .unwrap_or_else(|e| panic!("{e:#}"));
        let losses = |r: &grandis_parallel::ParallelReport| -> Vec<f64> {
            r.train.epochs.iter().map(|e| e.loss).collect()
        };
        assert_eq!(losses(&r), losses(&direct), "auto against {}", plan.chosen);
    }
}

/// A link job holds every vertex's output embedding and its gradient on every rank, and its
/// memory model says so: `job_dims` prices them (node classification does not), and every
/// rank's model bytes of an fb link run include them.
#[test]
fn the_memory_model_holds_the_gathered_embeddings() {
    let (ds, split) = link_dataset(7, 80, 4, 6);
    let mut view = ds.view();
    view.links = Some(split.view());
    let part = random_partition(&view, 2, 2, 7);
    let config = link_config(&view, ModelKind::Sage, 2);
    let link_job = JobSpec {
        task: grandis_wire::Task::Link,
        ..JobSpec::default()
    };
    let dims = grandis_parallel::job_dims(&config, &link_job, 80);
    assert_eq!(dims.link_embedding_values, 80 * 6);
    // Co-batches gather their targets only: 2 servers x (5 sources + 5 x (1 + 2) ends), or
    // every vertex once per server when a co-batch could reach them all; mb gathers nothing.
    let cob = |batch: u32| JobSpec {
        mode: Mode::Cob,
        servers: 2,
        batch_size: Some(batch),
        link: Some(grandis_wire::LinkSpec {
            negatives: 2,
            ..Default::default()
        }),
        ..link_job.clone()
    };
    let values = |job: &JobSpec| grandis_parallel::job_dims(&config, job, 80).link_embedding_values;
    assert_eq!(values(&cob(5)), 2 * 20 * 6);
    assert_eq!(values(&cob(50)), 2 * 80 * 6);
    let mb = JobSpec {
        mode: Mode::Mb,
        ..link_job.clone()
    };
    assert_eq!(values(&mb), 0);
    assert_eq!(
        grandis_parallel::job_dims(&config, &JobSpec::default(), 80),
        grandis_parallel::model_dims(&config)
    );
    let opts = link_opts(1, LinkDecoder::Dot);
    let r =
        parallel(view, &part, &config, &opts, Mode::Fb, None).unwrap_or_else(|e| panic!("{e:#}"));
    let peak = peak_model_bytes(&r);
    // Room for everything but the embeddings and their gradient on the largest rank: refused.
    let held = 2 * 80 * 6 * 4;
    let p = ParallelOptions {
        job: JobSpec {
            mode: Mode::Fb,
            device_memory: Some(peak - held + 1),
            ..JobSpec::default()
        },
        machine: Machine {
            threads_per_rank: Some(1),
            ..Machine::default()
        },
    };
    let e = grandis_parallel::train(view, &part, config.clone(), &opts, &p, &mut |_| {})
        .map(|_| ())
        .expect_err("the embeddings do not fit");
    assert!(format!("{e:#}").contains("out of memory"), "{e:#}");
}

/// Without a batch size, auto's co-batch candidates of a link job start from the largest
/// co-batch of supervision edges whose first step fits the budget: every edge of a server
/// when memory is plenty, fewer when the whole co-batch's step does not fit.
#[test]
fn auto_searches_the_largest_link_cobatch_that_fits() {
    let (ds, split) = link_dataset(8, 120, 4, 6);
    let mut view = ds.view();
    view.links = Some(split.view());
    let part = random_partition(&view, 2, 1, 8);
    let config = link_config(&view, ModelKind::Sage, 2);
    let opts = link_opts(1, LinkDecoder::Dot);
    let plan_with = |memory: u64| {
        let p = ParallelOptions {
            job: JobSpec {
                mode: Mode::Auto,
                device_memory: Some(memory),
                ..JobSpec::default()
            },
            machine: Machine {
                threads_per_rank: Some(1),
                ..Machine::default()
            },
        };
        let r = grandis_parallel::train(view, &part, config.clone(), &opts, &p, &mut |_| {})
            .unwrap_or_else(|e| panic!("{e:#}"));
        r.execution.plan.expect("auto reports its plan").candidates
    };
    let cob = |candidates: &[grandis_wire::CandidateSummary]| {
        let c = candidates
            .iter()
            .find(|c| c.name.starts_with("cob "))
            .expect("a co-batch candidate")
            .clone();
        let b: usize = c.name.split(' ').nth(1).unwrap().parse().unwrap();
        (b, c)
    };
    let sources: Vec<u32> = split.train.chunks_exact(2).map(|p| p[0]).collect();
    let old_to_new = {
        let mut m = vec![0u32; part.new_to_old.len()];
        for (new, &old) in part.new_to_old.iter().enumerate() {
            m[old as usize] = new as u32;
        }
        m
    };
    let mut per_server = [0usize; 2];
    for s in sources {
        per_server[part.layout.server_of(old_to_new[s as usize])] += 1;
    }
    let most = *per_server.iter().max().unwrap();
    let (whole, whole_c) = cob(&plan_with(1 << 34));
    assert_eq!(whole, most, "every edge of the larger server");
    // One byte short of the whole co-batch's single step: a smaller co-batch.
    let budget = whole_c.peak_bytes.unwrap() - 1;
    let (fitted, _) = cob(&plan_with(budget));
    assert!(
        (1..whole).contains(&fitted),
        "{fitted} of {whole} edges at {budget} bytes"
    );
}
