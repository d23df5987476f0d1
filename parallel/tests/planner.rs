//! The performance model's counts against what runs measure: for every candidate the planner
//! considers on a fixed small case, the halo and fetch bytes it predicts per link class and
//! the vertex-layers it counts are exactly what one epoch of that candidate moves and
//! computes (counts, not seconds: a test of the model that cannot flake on a busy machine).

mod common;

use common::{config, opts, random_dataset, random_partition};
use grandis_models::ModelKind;
use grandis_parallel::planner::{
    candidates, choose, layer_work, parameters, plan, rule, rule_cost, static_floor, Counting,
};
use grandis_parallel::{JobSpec, Machine, Mode, ParallelOptions, Sampling};
use grandis_wire::{ComputeRate, LinkRate, PlanRates, ServerRates};

/// Rates with `compute` for both kernels (a fifth of it beyond the caches) and links of
/// `intra` and `inter` bytes/s.
fn rates(compute: f64, intra: f64, inter: f64) -> PlanRates {
    PlanRates {
        compute: ComputeRate {
            gemm_flops_per_s: compute,
            aggregation_edge_cols_per_s: compute,
            aggregation_uncached_edge_cols_per_s: compute / 5.0,
            width: 8,
            aggregation_row_edges: 0.0,
        },
        intra: LinkRate {
            bandwidth_bytes_per_s: intra,
            latency_s: 1e-5,
        },
        inter: LinkRate {
            bandwidth_bytes_per_s: inter,
            latency_s: 1e-4,
        },
        contention: 1.0,
        calibration: 1.0,
        kernel_calibration: None,
        shared_cores: None,
        cache_sharers: 1.0,
    }
}

fn is_static(mode: Mode) -> bool {
    matches!(mode, Mode::Fb | Mode::Flx)
}

/// What the candidates are made from: fb with a 1 GiB budget, one thread per rank.
fn base_options() -> ParallelOptions {
    ParallelOptions {
        job: JobSpec {
            mode: Mode::Fb,
            device_memory: Some(1 << 30),
            ..JobSpec::default()
        },
        machine: Machine {
            threads_per_rank: Some(1),
            ..Machine::default()
        },
    }
}

/// Every candidate of `cands` predicted (all counted, `rates` as in [`rates`]) and one epoch
/// of it run as the candidate's options say: (name, prediction, the run's execution summary).
fn predicted_and_run(
    view: grandis_store::DatasetView<'_>,
    part: &grandis_parallel::PartitionedGraph,
    (cfg, train): (&grandis_models::ModelConfig, &grandis_trainer::TrainOptions),
    base: &ParallelOptions,
    cands: &[grandis_parallel::planner::Candidate],
) -> Vec<(String, grandis_wire::Prediction, grandis_wire::Execution)> {
    let ctx = grandis_parallel::plan_context(&view, part).unwrap();
    let rates = rates(1e9, 1e9, 1e8);
    let planned = plan(
        view,
        part,
        &ctx,
        cfg,
        train.seed,
        base,
        cands,
        &rates,
        Counting::Every,
    )
    .unwrap();
    planned
        .into_iter()
        .map(|p| {
            let what = p.name.clone();
            let pred = p
                .prediction
                .unwrap_or_else(|| panic!("{what}: {:?}", p.error));
            assert!(p.fits, "{what}");
            assert!(pred.epoch_s > 0.0, "{what}: {pred:?}");
            let r = grandis_parallel::train(
                view,
                part,
                cfg.clone(),
                train,
                &p.candidate.options(base),
                &mut |_| {},
            )
            .unwrap_or_else(|e| panic!("{what}: {e:#}"));
            (what, pred, r.execution)
        })
        .collect()
}

#[test]
fn predicted_counts_are_what_every_candidate_moves_and_computes() {
    let ds = random_dataset(21, 400, 2400, 8, 4);
    let view = ds.view();
    let part = random_partition(&view, 2, 2, 3);
    let cfg = config(&view, ModelKind::Sage, 2);
    let train = opts(1);
    let base = base_options();
    let sampling = Sampling::Fanout {
        fanouts: vec![3, 3],
        relation_fanouts: Default::default(),
    };
    let cands = candidates(2, 48, 2, &sampling);
    let names: Vec<String> = cands.iter().map(|c| c.name()).collect();
    assert_eq!(
        names,
        [
            "fb",
            "flx k=1",
            "flx k=2",
            "flx-eas h=1 f=5",
            "flx-eas h=1 f=15",
            "flx-eas h=2 f=5",
            "flx-eas h=2 f=15",
            "cob 48 sage(3,3)",
            "cob 24 sage(3,3)",
            "cob 12 sage(3,3)",
            "mb 24 sage(3,3)",
        ]
    );
    for (what, pred, x) in predicted_and_run(view, &part, (&cfg, &train), &base, &cands) {
        assert_eq!(
            pred.halo_bytes, x.halo_bytes_per_epoch,
            "{what}: halo bytes"
        );
        assert_eq!(
            pred.fetch_bytes, x.fetch_bytes_per_epoch,
            "{what}: fetched bytes"
        );
        assert_eq!(
            pred.computed_vertex_layers, x.computed_vertex_layers,
            "{what}: vertex-layers"
        );
        let setup = x.setup_fetch_bytes.inter_server + x.setup_fetch_bytes.intra_server;
        assert_eq!(pred.setup_fetch_bytes, setup, "{what}: setup fetch");
    }
}

/// The floors a pruned plan rules static candidates out with never exceed what those
/// candidates are predicted to cost, and pruning never changes the choice: over compute- and
/// link-bound rates and several exact preferences, the pruned plan picks the candidate the
/// full one does (and does prune somewhere). Under a budget below the memory floor every
/// static candidate is ruled out uncounted.
#[test]
fn pruning_rules_out_only_what_cannot_be_chosen() {
    let ds = random_dataset(21, 400, 2400, 8, 4);
    let view = ds.view();
    let part = random_partition(&view, 2, 2, 3);
    let cfg = config(&view, ModelKind::Sage, 2);
    let seed = opts(1).seed;
    let base = base_options();
    let cands = candidates(
        2,
        48,
        2,
        &Sampling::Fanout {
            fanouts: vec![3, 3],
            relation_fanouts: Default::default(),
        },
    );
    let ctx = grandis_parallel::plan_context(&view, &part).unwrap();
    let dims = grandis_parallel::model_dims(&cfg);
    let work = layer_work(&cfg, &dims).unwrap();
    let params = parameters(&cfg).unwrap();
    let mut pruned_any = false;
    for (compute, inter) in [(1e9, 1e9), (1e5, 1e9), (1e9, 1e4)] {
        let rates = rates(compute, 1e9, inter);
        let every = plan(
            view,
            &part,
            &ctx,
            &cfg,
            seed,
            &base,
            &cands,
            &rates,
            Counting::Every,
        )
        .unwrap();
        let floor = static_floor(&ctx, &dims, &work, params, &rates);
        for p in every.iter().filter(|p| is_static(p.candidate.mode)) {
            let x = p.prediction.as_ref().unwrap();
            let at_least = match p.candidate.is_exact() {
                true => floor.exact_s,
                false => floor.sampled_s,
            };
            assert!(
                at_least <= x.epoch_s * (1.0 + 1e-9),
                "{}: {floor:?} vs {x:?}",
                p.name
            );
            assert!(
                floor.bytes <= x.peak_bytes,
                "{}: {floor:?} vs {x:?}",
                p.name
            );
        }
        for preference in [1.0, 1.2, 100.0] {
            let counting = Counting::Pruned {
                exact_preference: preference,
            };
            let pruned = plan(
                view, &part, &ctx, &cfg, seed, &base, &cands, &rates, counting,
            )
            .unwrap();
            let pick = |planned: &[grandis_parallel::planner::Planned]| {
                choose(planned, preference).map(|(i, _)| planned[i].name.clone())
            };
            assert_eq!(
                pick(&every),
                pick(&pruned),
                "compute {compute}, inter {inter}"
            );
            for (a, b) in every.iter().zip(&pruned) {
                assert_eq!(a.name, b.name);
                if b.pruned.is_none() {
                    assert_eq!(
                        a.prediction.as_ref().map(|x| x.epoch_s),
                        b.prediction.as_ref().map(|x| x.epoch_s)
                    );
                } else {
                    assert!(is_static(b.candidate.mode), "{}", b.name);
                    pruned_any = true;
                }
            }
        }
    }
    assert!(pruned_any, "no setting pruned a static candidate");
    let rates = rates(1e9, 1e9, 1e8);
    let floor = static_floor(&ctx, &dims, &work, params, &rates);
    let mut tight = base.clone();
    tight.job.device_memory = Some(floor.bytes - 1);
    let counting = Counting::Pruned {
        exact_preference: 1.2,
    };
    let pruned = plan(
        view, &part, &ctx, &cfg, seed, &tight, &cands, &rates, counting,
    )
    .unwrap();
    for p in pruned.iter().filter(|p| is_static(p.candidate.mode)) {
        let why = p
            .pruned
            .as_deref()
            .unwrap_or_else(|| panic!("{} was counted", p.name));
        assert!(why.contains("budget"), "{why}");
    }
    // The rule over any times (bench plan applies it to measured epochs): the fastest exact
    // candidate, unless a sampled one is `preference` times faster; candidates without a
    // time do not count.
    let exact: Vec<usize> = (0..pruned.len())
        .filter(|&i| pruned[i].candidate.is_exact())
        .collect();
    let sampled: Vec<usize> = (0..pruned.len())
        .filter(|&i| !pruned[i].candidate.is_exact())
        .collect();
    assert!(exact.len() >= 2 && !sampled.is_empty());
    let (e, s, exact) = (exact[1], sampled[0], &exact);
    let times = |sampled_t: Option<f64>, exact_t: Option<f64>| {
        move |i: usize| match i {
            i if i == e => exact_t,
            i if i == s => sampled_t,
            i if exact.contains(&i) => exact_t.map(|t| t * 2.0),
            _ => None,
        }
    };
    let chosen = |sampled_t, exact_t| rule(&pruned, 1.2, times(sampled_t, exact_t)).chosen;
    assert_eq!(chosen(Some(0.9), Some(1.0)), Some(e), "not 1.2x faster");
    assert_eq!(chosen(Some(0.8), Some(1.0)), Some(s), "1.25x faster");
    assert_eq!(chosen(None, Some(1.0)), Some(e));
    assert_eq!(chosen(Some(5.0), None), Some(s), "no exact plan measured");
    assert_eq!(chosen(None, None), None);
    let ruled = rule(&pruned, 1.0, times(Some(0.99), Some(1.0)));
    assert_eq!(
        (ruled.exact, ruled.sampled, ruled.chosen),
        (Some(e), Some(s), Some(s))
    );
    // The rule takes the least cost; a choice is judged by cost, continuous across the
    // preference (an exact choice against a sampled plan 1.21x faster lost 0.8 %).
    for sampled_t in [0.5, 0.8, 0.83, 0.84, 0.9, 1.3] {
        let t = times(Some(sampled_t), Some(1.0));
        let chosen = rule(&pruned, 1.2, t).chosen.unwrap();
        let cost = |i: usize| rule_cost(pruned[i].candidate.is_exact(), t(i).unwrap(), 1.2);
        assert!(cost(chosen) <= cost(e).min(cost(s)), "{sampled_t}");
    }
    let cost = |exact, t| rule_cost(exact, t, 1.2);
    assert!((cost(true, 1.0) / cost(false, 1.0 / 1.21) - 1.0 - 0.008).abs() < 1e-3);
}

/// `mode auto` runs the plan it chose: the chosen candidate's predicted halo bytes and
/// vertex-layers are exactly the run's, and a budget below every static plan's memory floor
/// makes it a per-iteration plan.
#[test]
fn auto_runs_the_plan_it_chose() {
    let ds = random_dataset(22, 400, 2400, 8, 4);
    let view = ds.view();
    let part = random_partition(&view, 2, 2, 5);
    let cfg = config(&view, ModelKind::Sage, 2);
    let train = opts(1);
    let measured = ServerRates {
        device: "cpu".into(),
        compute: rates(1e9, 1e9, 1e8).compute,
        intra: Some(rates(1e9, 1e9, 1e8).intra),
        inter: Some(rates(1e9, 1e9, 1e8).inter),
        seconds: 0.0,
        memory_copy_bytes_per_s: 0.0,
    };
    let ctx = grandis_parallel::plan_context(&view, &part).unwrap();
    let dims = grandis_parallel::model_dims(&cfg);
    let work = layer_work(&cfg, &dims).unwrap();
    let floor = static_floor(
        &ctx,
        &dims,
        &work,
        parameters(&cfg).unwrap(),
        &rates(1e9, 1e9, 1e8),
    );
    for (budget, batch) in [(1u64 << 30, None), (floor.bytes - 1, Some(16))] {
        let popts = ParallelOptions {
            job: JobSpec {
                mode: Mode::Auto,
                device_memory: Some(budget),
                batch_size: batch,
                sampling: Sampling::Fanout {
                    fanouts: vec![3, 3],
                    relation_fanouts: Default::default(),
                },
                ..JobSpec::default()
            },
            machine: Machine {
                threads_per_rank: Some(1),
                measured: Some(measured.clone()),
                ..Machine::default()
            },
        };
        // The planner fits training steps to the budget; evaluation's layer-wise blocks fit
        // it too.
        let r = grandis_parallel::train(view, &part, cfg.clone(), &train, &popts, &mut |_| {})
            .unwrap_or_else(|e| panic!("budget {budget}: {e:#}"));
        assert_eq!(r.train.num_parameters, parameters(&cfg).unwrap());
        let plan = r.execution.plan.as_ref().expect("auto reports its plan");
        let x = &plan.prediction;
        assert!(x.epoch_s > 0.0, "{plan:?}");
        assert_eq!(plan.candidates.len(), 11, "{plan:?}");
        assert!(plan.candidates.iter().any(|c| c.name == plan.chosen));
        assert_eq!(
            x.halo_bytes, r.execution.halo_bytes_per_epoch,
            "{}",
            plan.chosen
        );
        assert_eq!(
            x.computed_vertex_layers, r.execution.computed_vertex_layers,
            "{}",
            plan.chosen
        );
        if budget < floor.bytes {
            assert!(
                !is_static(r.execution.mode),
                "{} under {budget} bytes",
                plan.chosen
            );
            assert!(plan.chosen.ends_with("sage(3,3)"), "{}", plan.chosen);
        }
    }
}

/// A link job's decoder is compute on every rank each iteration: its row accesses priced as
/// aggregation edges, the MLP's products on top at the dense rate, linear in the pairs.
#[test]
fn the_link_decoder_is_priced_per_rank_and_iteration() {
    use grandis_parallel::planner::{predict, DecoderWork, EpochCounts, StepCounts};
    let layout = grandis_masking::Layout::even(1000, 2, 2).unwrap();
    let r = rates(1e9, 1e9, 1e8);
    let compute = |pairs_per_rank: f64, mlp: bool| {
        // Three steps of no layers: the decoder's compute alone.
        let counts = EpochCounts {
            iterations: 3,
            steps: vec![StepCounts::default(); 3],
            scale: 1.0,
            decoder: DecoderWork {
                pairs_per_rank,
                cols: 8,
                rows: 1000.0,
                mlp,
            },
            ..Default::default()
        };
        predict(&counts, &[], &layout, &r).compute_s
    };
    assert_eq!(compute(0.0, false), 0.0);
    // 1000 rows of 8 columns are within the calibration's cached rows: the cached rate.
    let dot = compute(1000.0, false);
    assert!(
        (dot - 3.0 * 4.0 * 1000.0 * 8.0 / 1e9).abs() < 1e-12,
        "{dot}"
    );
    let mlp = compute(1000.0, true);
    assert!(
        (mlp - dot - 3.0 * 6.0 * 1000.0 * 64.0 / 1e9).abs() < 1e-12,
        "{mlp}"
    );
    assert!((compute(2000.0, false) - 2.0 * dot).abs() < 1e-12);
}

/// With learnable embeddings every candidate's predicted embedding bytes (asks, rows,
/// gradients) and halo bytes are what its run moves.
#[test]
fn predicted_embedding_bytes_are_what_every_candidate_moves() {
    let ds = random_dataset(23, 300, 1500, 4, 4);
    let view = ds.view();
    let part = random_partition(&view, 2, 2, 5);
    let dim = 6;
    let cfg = grandis_models::ModelConfig {
        in_dim: view.feature_dim + dim,
        ..config(&view, ModelKind::Gcn, 2)
    };
    let train = grandis_trainer::TrainOptions {
        embedding_dim: dim,
        ..opts(1)
    };
    let mut base = base_options();
    base.job.embedding_dim = dim as u32;
    let sampling = Sampling::Fanout {
        fanouts: vec![3, 3],
        relation_fanouts: Default::default(),
    };
    let cands: Vec<_> = candidates(2, 48, 2, &sampling)
        .into_iter()
        .filter(|c| !c.name().starts_with("flx-eas"))
        .collect();
    for (what, pred, x) in predicted_and_run(view, &part, (&cfg, &train), &base, &cands) {
        assert!(x.node_embedding_bytes_per_epoch.inter_server > 0, "{what}");
        assert_eq!(
            pred.node_embedding_bytes, x.node_embedding_bytes_per_epoch,
            "{what}: embedding bytes"
        );
        assert_eq!(
            pred.halo_bytes, x.halo_bytes_per_epoch,
            "{what}: halo bytes"
        );
    }
}
