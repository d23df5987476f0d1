//! Byte accounting and memory: the fabric's measured per-epoch halo bytes equal the masking
//! plan's predictions per link class; FLX with k = L sends no inter-server halo bytes; the
//! features of replicated vertices fetched from other servers are exactly the plans' rows
//! homed there; the metered per-rank memory stays within a small factor of the memory model.

mod common;

use common::*;
use grandis_fabric::{Counters, LinkClass, Phase};
use grandis_masking::{FlxPlan, Layout, ModelDims, PlanContext, SplitMembership};
use grandis_models::ModelKind;
use grandis_parallel::{
    model_dims, plan_context, JobSpec, Machine, Mode, ParallelOptions, Priority, Sampling,
    EVAL_EPOCH_BIT,
};
use grandis_sampling::{cob_plan, round_of, CoBatcher, Exact};
use grandis_trainer::{EvalSchedule, TrainOptions};

/// Prediction straight from the masking crate: the forward exchange feeding each layer, and
/// the same rows back for every layer whose input gradient is needed.
fn predicted(
    part: &grandis_parallel::PartitionedGraph,
    dims: &ModelDims,
    k: usize,
    backward_at_0: bool,
) -> (u64, u64, u64, u64) {
    let n = part.graph.view().num_vertices();
    let ctx = PlanContext::new(
        part.graph.view(),
        part.layout.clone(),
        SplitMembership::none(n),
    )
    .unwrap();
    let plan = ctx.preload_plan(k, dims.layers).unwrap();
    let (mut fi, mut fe, mut bi, mut be) = (0, 0, 0, 0);
    for l in 0..dims.layers {
        let b = plan.forward_exchange_bytes(l, dims);
        fi += b.intra_server;
        fe += b.inter_server;
        if l > 0 || backward_at_0 {
            bi += b.intra_server;
            be += b.inter_server;
        }
    }
    (fi, fe, bi, be)
}

#[test]
fn measured_bytes_equal_plan_predictions() {
    let (ds, part) = random_case(9, 80, 400, 6, 3, 2, 2);
    let view = ds.view();
    for (kind, layers) in [(ModelKind::Sage, 3), (ModelKind::ResSage, 2)] {
        let config = config(&view, kind, layers);
        let dims = model_dims(&config);
        let opts = opts(2);
        for k in 0..=layers {
            let mode = if k == 0 { Mode::Fb } else { Mode::Flx };
            let r = parallel(view, &part, &config, &opts, mode, Some(k).filter(|_| k > 0)).unwrap();
            let (fi, fe, bi, be) = predicted(&part, &dims, k, kind == ModelKind::ResSage);
            let what = format!("{} k={k}", kind.name());
            assert_eq!(
                r.execution.forward_bytes_per_epoch.intra_server, fi,
                "{what} forward intra"
            );
            assert_eq!(
                r.execution.forward_bytes_per_epoch.inter_server, fe,
                "{what} forward inter"
            );
            assert_eq!(
                r.execution.backward_bytes_per_epoch.intra_server, bi,
                "{what} backward intra"
            );
            assert_eq!(
                r.execution.backward_bytes_per_epoch.inter_server, be,
                "{what} backward inter"
            );
            assert_eq!(
                r.execution.halo_bytes_per_epoch, r.execution.predicted_halo_bytes_per_epoch,
                "{what}"
            );
            if k == layers {
                assert_eq!(
                    r.execution.halo_bytes_per_epoch.inter_server, 0,
                    "{what}: k = L"
                );
            }
            if k == 0 {
                assert!(
                    fe > 0,
                    "{what}: the random layout must cut inter-server edges"
                );
            }
            // The all-reduce moves the parameters (and, on the epoch's last step, the epoch's
            // loss: two floats): G - 1 device buffers to the head and back per server, and
            // 2 (S - 1) / S of the buffer per head between servers.
            let p = (r.train.num_parameters as u64 + 2) * 4;
            assert_eq!(
                r.execution.all_reduce_bytes_per_epoch.intra_server,
                2 * 2 * p,
                "{what}"
            );
            assert_eq!(
                r.execution.all_reduce_bytes_per_epoch.inter_server,
                2 * p,
                "{what}"
            );
            // Only link prediction gathers embeddings.
            assert_eq!(
                r.execution.link_embedding_bytes_per_epoch,
                Default::default(),
                "{what}"
            );
        }
    }
}

#[test]
fn flx_reduces_inter_server_bytes_monotonically() {
    let (ds, part) = random_case(5, 120, 500, 4, 3, 2, 2);
    let view = ds.view();
    let config = config(&view, ModelKind::Sage, 3);
    let opts = opts(1);
    let inter: Vec<u64> = (0..=3)
        .map(|k| {
            let mode = if k == 0 { Mode::Fb } else { Mode::Flx };
            parallel(view, &part, &config, &opts, mode, Some(k).filter(|_| k > 0))
                .unwrap()
                .execution
                .halo_bytes_per_epoch
                .inter_server
        })
        .collect();
    assert!(
        inter.windows(2).all(|w| w[1] <= w[0]),
        "inter-server bytes by k: {inter:?}"
    );
    assert_eq!(inter[3], 0);
}

#[test]
fn metered_memory_tracks_the_memory_model() {
    let (ds, part) = random_case(11, 400, 2400, 32, 4, 2, 2);
    let view = ds.view();
    for kind in [ModelKind::Sage, ModelKind::Gat] {
        let mut config = config(&view, kind, 3);
        config.hidden = 32;
        let opts = opts(2);
        let mut peaks = Vec::new();
        for k in 0..=3 {
            let mode = if k == 0 { Mode::Fb } else { Mode::Flx };
            let r = parallel(view, &part, &config, &opts, mode, Some(k).filter(|_| k > 0)).unwrap();
            for m in &r.execution.memory {
                let ratio = m.measured_peak_bytes as f64 / m.model_bytes as f64;
                eprintln!(
                    "{} k={k} rank {}: measured peak {} B, model {} B, ratio {ratio:.2}",
                    kind.name(),
                    m.rank,
                    m.measured_peak_bytes,
                    m.model_bytes
                );
                assert!(
                    (0.5..=2.5).contains(&ratio),
                    "{} k={k} rank {}: measured/model = {ratio:.2}",
                    kind.name(),
                    m.rank
                );
            }
            peaks.push(
                r.execution
                    .memory
                    .iter()
                    .map(|m| m.measured_peak_bytes)
                    .max()
                    .unwrap(),
            );
        }
        // k = 1 holds both plans' graphs and the extracted rows; FB holds the fewest rows. (No
        // full monotonicity: at k = L the runner never uploads the FB graph, the model counts
        // it.)
        assert!(
            peaks[1] > peaks[0],
            "{}: peaks by k: {peaks:?}",
            kind.name()
        );
    }
}

/// (device, owned row) pairs of `plan` whose vertex lives on another server.
fn remote_rows(layout: &Layout, plan: &FlxPlan) -> u64 {
    plan.devices
        .iter()
        .enumerate()
        .map(|(r, d)| {
            let server = layout.server_of_rank(r);
            d.global_ids[..d.n_owned]
                .iter()
                .filter(|&&g| layout.server_of(g) != server)
                .count() as u64
        })
        .sum()
}

/// Fetch-phase payload bytes sent in tag epoch `epoch` over `class`.
fn fetched(c: &Counters, epoch: u32, class: LinkClass) -> u64 {
    sent(c, epoch, Phase::Fetch, class)
}

fn sent(c: &Counters, epoch: u32, phase: Phase, class: LinkClass) -> u64 {
    c.epoch(epoch).map_or(0, |e| {
        e.links
            .iter()
            .filter(|r| r.phase == phase && r.class == class)
            .map(|r| r.bytes_sent)
            .sum()
    })
}

/// The bytes one layer-wise pass of `config`'s model sends between servers: per stage that
/// reads neighbours, every rank receives once the rows of its in-neighbours homed on another
/// server, as wide as the rows the stage gathers.
fn layerwise_inter_bytes(
    part: &grandis_parallel::PartitionedGraph,
    config: &grandis_models::ModelConfig,
) -> u64 {
    let b = grandis_engine::CpuBackend::new(Some(1)).unwrap();
    let model = grandis_models::Model::new(&b, config.clone()).unwrap();
    let (graph, layout) = (part.graph.view(), &part.layout);
    let halo_rows: u64 = (0..layout.num_ranks())
        .map(|r| {
            let own = layout.range(r);
            let server = layout.server_of(own.start);
            let mut halo: Vec<u32> = own
                .clone()
                .flat_map(|v| graph.neighbors(v).iter().copied())
                .filter(|&u| layout.server_of(u) != server)
                .collect();
            halo.sort_unstable();
            halo.dedup();
            halo.len() as u64
        })
        .sum();
    (0..model.num_stages())
        .filter(|&s| model.stage_reads_neighbors(s))
        .map(|s| {
            let cols = match model
                .stage_neighbour_width(s)
                .filter(|_| model.stage_splits(s))
            {
                Some(w) => w,
                None => model.stage_dims(s).0,
            };
            halo_rows * cols as u64 * 4
        })
        .sum()
}

/// The evaluations a batched run makes are the ones its schedule names (the last epoch's
/// being the final one), each exchanging its halo rows; a run that never evaluates sends
/// nothing outside its steps and reports no accuracy. Training is the same either way.
#[test]
fn batched_runs_evaluate_on_their_schedule() {
    let (ds, part) = random_case(17, 240, 1200, 5, 3, 2, 2);
    let view = ds.view();
    let config = config(&view, ModelKind::Sage, 2);
    let popts = ParallelOptions {
        job: JobSpec {
            mode: Mode::Cob,
            batch_size: Some(50),
            ..JobSpec::default()
        },
        machine: Machine {
            threads_per_rank: Some(1),
            ..Machine::default()
        },
    };
    let run = |eval| {
        let opts = TrainOptions { eval, ..opts(5) };
        grandis_parallel::train(view, &part, config.clone(), &opts, &popts, &mut |_| {}).unwrap()
    };
    let evaluated = |r: &grandis_parallel::ParallelReport| -> Vec<u32> {
        r.counters
            .epochs
            .iter()
            .filter(|e| e.epoch & EVAL_EPOCH_BIT != 0)
            .filter(|e| sent(&r.counters, e.epoch, Phase::Forward, LinkClass::InterServer) > 0)
            .map(|e| e.epoch & !EVAL_EPOCH_BIT)
            .collect()
    };
    let every = run(EvalSchedule::Every(2));
    assert_eq!(evaluated(&every), [2, 4, 5]);
    let accs: Vec<bool> = every
        .train
        .epochs
        .iter()
        .map(|e| e.train_acc.is_nan())
        .collect();
    assert_eq!(accs, [true, false, true, false, false]);
    assert!(every.train.test_acc.is_finite());
    let end = run(EvalSchedule::End);
    assert_eq!(evaluated(&end), [5]);
    assert_eq!(end.train.test_acc, every.train.test_acc);
    let never = run(EvalSchedule::Never);
    assert_eq!(evaluated(&never), Vec::<u32>::new());
    assert!(
        never.train.train_acc.is_nan()
            && never.train.val_acc.is_nan()
            && never.train.test_acc.is_nan()
    );
    let losses = |r: &grandis_parallel::ParallelReport| -> Vec<u64> {
        r.train.epochs.iter().map(|e| e.loss.to_bits()).collect()
    };
    assert_eq!(losses(&never), losses(&every));
    assert_eq!(losses(&end), losses(&every));
}

/// Cooperative batching (exact, 2 servers x 2 devices): every step's features of vertices
/// homed on the other server cross the inter-server link, 4 x F bytes per (rank, owned row)
/// pair, counted here from the co-batch plans the runner builds (same seed). The first step is
/// built before the first epoch (tag epoch 0), the others inside their epoch, and the report
/// spreads them all over the epochs. Evaluation is the layer-wise pass: it fetches no
/// feature rows, and each stage that reads neighbours sends every rank its halo's rows. FB fetches nothing at all; FLX with k = L fetches its
/// preloaded rows once, at setup.
#[test]
fn fetched_bytes_equal_the_remote_rows_of_every_step() {
    let (ds, part) = random_case(13, 300, 1500, 5, 3, 2, 2);
    let view = ds.view();
    let layers = 2;
    let config = config(&view, ModelKind::Sage, layers);
    let epochs = 2;
    let opts = TrainOptions {
        eval: EvalSchedule::Every(1),
        ..opts(epochs)
    };
    let row = 4 * view.feature_dim as u64;
    let batch = 40;
    let popts = ParallelOptions {
        job: JobSpec {
            mode: Mode::Cob,
            batch_size: Some(batch as u32),
            ..JobSpec::default()
        },
        machine: Machine {
            threads_per_rank: Some(1),
            ..Machine::default()
        },
    };
    let r =
        grandis_parallel::train(view, &part, config.clone(), &opts, &popts, &mut |_| {}).unwrap();

    let ctx = plan_context(&view, &part).unwrap();
    let batcher = CoBatcher::new(&ctx, batch, opts.seed).unwrap();
    let n = batcher.iterations();
    assert!(n > 1, "several steps per epoch");
    let mut per_step = Vec::new();
    for e in 0..epochs as u64 {
        for it in 0..n {
            let b = batcher.batch(e, it).unwrap();
            let plan = cob_plan(&ctx, &b, layers, &Exact, round_of(e, it, n)).unwrap();
            per_step.push(remote_rows(&part.layout, &plan));
        }
    }
    assert!(
        per_step.iter().sum::<u64>() > 0,
        "co-batches reach the other server"
    );
    let c = &r.counters;
    let inter = |epoch| fetched(c, epoch, LinkClass::InterServer);
    assert_eq!(
        inter(0),
        row * per_step[0],
        "before the first epoch: the first step"
    );
    for e in 1..=epochs {
        let first = if e == 1 { 1 } else { (e - 1) * n };
        let want: u64 = per_step[first..e * n].iter().sum();
        assert_eq!(inter(e as u32), row * want, "epoch {e}");
    }
    let eval_bytes = layerwise_inter_bytes(&part, &config);
    assert!(eval_bytes > 0);
    let mut evaluations = 0;
    for e in c.epochs.iter() {
        assert_eq!(fetched(c, e.epoch, LinkClass::IntraServer), 0);
        if e.epoch & EVAL_EPOCH_BIT != 0 {
            let what = format!("evaluation {}", e.epoch & !EVAL_EPOCH_BIT);
            assert_eq!(fetched(c, e.epoch, LinkClass::InterServer), 0, "{what}");
            assert_eq!(
                sent(c, e.epoch, Phase::Forward, LinkClass::InterServer),
                eval_bytes,
                "{what}"
            );
            evaluations += 1;
        }
    }
    assert_eq!(
        evaluations, epochs,
        "after every epoch, the last one's being the final evaluation"
    );
    assert_eq!(
        r.execution.setup_fetch_bytes.inter_server, 0,
        "co-batch plans recur"
    );
    assert_eq!(
        r.execution.fetch_bytes_per_epoch.inter_server,
        row * per_step.iter().sum::<u64>() / epochs as u64
    );
    assert_eq!(r.execution.fetch_bytes_per_epoch.intra_server, 0);

    let fb = parallel(view, &part, &config, &opts, Mode::Fb, None).unwrap();
    assert!(
        fb.counters
            .epochs
            .iter()
            .all(|e| e.links.iter().all(|l| l.phase != Phase::Fetch)),
        "FB owns only its own range"
    );
    assert_eq!(fb.execution.setup_fetch_bytes.inter_server, 0);
    assert_eq!(fb.execution.fetch_bytes_per_epoch.inter_server, 0);

    let flx = parallel(view, &part, &config, &opts, Mode::Flx, Some(layers)).unwrap();
    let preload = ctx.preload_plan(layers, layers).unwrap();
    let preloaded = remote_rows(&part.layout, preload.flx.as_ref().unwrap());
    assert!(preloaded > 0);
    assert_eq!(
        flx.execution.setup_fetch_bytes.inter_server,
        row * preloaded
    );
    assert_eq!(flx.execution.fetch_bytes_per_epoch.inter_server, 0);
    assert_eq!(flx.execution.halo_bytes_per_epoch.inter_server, 0);

    // FLX-EAS: one sample serves the run (setup); resampled every epoch, each sample's fetch
    // is paid per epoch.
    for (every, recurs) in [(None, false), (Some(1), true)] {
        let popts = ParallelOptions {
            job: JobSpec {
                mode: Mode::Flx,
                preload_hops: Some(layers as u32),
                sampling: Sampling::Eas {
                    hops: 1,
                    fanout: 2,
                    priority: Priority::Degree,
                },
                resample_every: every,
                ..JobSpec::default()
            },
            machine: Machine {
                threads_per_rank: Some(1),
                ..Machine::default()
            },
        };
        let r = grandis_parallel::train(view, &part, config.clone(), &opts, &popts, &mut |_| {})
            .unwrap();
        let total: u64 = r
            .counters
            .epochs
            .iter()
            .map(|e| fetched(&r.counters, e.epoch, LinkClass::InterServer))
            .sum();
        assert!(total > 0, "{every:?}");
        let (per_epoch, setup) = if recurs {
            (total / epochs as u64, 0)
        } else {
            (0, total)
        };
        assert_eq!(
            r.execution.fetch_bytes_per_epoch.inter_server, per_epoch,
            "{every:?}"
        );
        assert_eq!(
            r.execution.setup_fetch_bytes.inter_server, setup,
            "{every:?}"
        );
    }
}

/// The time split's parts are disjoint pieces of the epoch: per-step modes report the time
/// spent waiting for and loading steps and the producer's build time; static plans none.
#[test]
fn time_split_accounts_for_the_step_pipeline() {
    let (ds, part) = random_case(17, 300, 1500, 5, 3, 2, 2);
    let view = ds.view();
    let config = config(&view, ModelKind::Sage, 2);
    let opts = opts(3);
    for (mode, batch) in [
        (Mode::Fb, None),
        (Mode::Cob, Some(40)),
        (Mode::Mb, Some(20)),
    ] {
        let popts = ParallelOptions {
            job: JobSpec {
                mode,
                batch_size: batch,
                ..JobSpec::default()
            },
            machine: Machine {
                threads_per_rank: Some(1),
                ..Machine::default()
            },
        };
        let r = grandis_parallel::train(view, &part, config.clone(), &opts, &popts, &mut |_| {})
            .unwrap();
        let t = r.execution.time_split;
        let parts = t.compute_s
            + t.intra_comm_s
            + t.inter_comm_s
            + t.fetch_s
            + t.all_reduce_s
            + t.plan_wait_s
            + t.plan_load_s;
        assert!(
            parts <= t.epoch_s * 1.0001 + 1e-9,
            "{mode}: parts {parts} exceed the epoch {}",
            t.epoch_s
        );
        if batch.is_some() {
            assert!(
                r.execution.iterations_per_epoch > 1,
                "{mode}: several steps"
            );
            assert!(
                t.plan_build_s > 0.0,
                "{mode}: the producer's time is reported"
            );
            assert!(
                t.plan_inputs_s > 0.0 && t.plan_inputs_s < t.plan_build_s,
                "{mode}: reading the steps' inputs is part of building them: {t:?}"
            );
            assert!(t.plan_load_s > 0.0, "{mode}: switching steps takes time");
        } else {
            // Static plans are built once, before the epochs: each epoch only takes the same
            // step again.
            assert_eq!(t.plan_build_s, 0.0, "{mode}");
            assert_eq!(t.plan_inputs_s, 0.0, "{mode}");
            assert!(t.plan_wait_s + t.plan_load_s < 1e-3, "{mode}: {t:?}");
        }
    }
}
