//! Property tests over random graphs and layouts: EAS keeps every inner dependency and only
//! samples external ones (<= f per vertex, <= h hops from the server); co-batches partition
//! the training vertices and their exact plans equal the exact L-hop closure with the masking
//! exactness invariant; fanout rows respect the fanout per layer; SAINT subgraphs are induced.

use std::collections::BTreeSet;

use grandis_masking::testing::{self, Case, CaseBounds};
use grandis_masking::{Edges, ExtractionSpec, FlxPlan, PlanContext, SampledEdges};
use grandis_sampling::{
    cob_plan, external_distance, sample_stats, CoBatcher, Eas, Exact, Fanout, Priority, Saint,
    SaintKind, Sampler,
};
use proptest::prelude::*;

fn case() -> impl Strategy<Value = Case> {
    testing::case(CaseBounds {
        max_servers: 3,
        max_devices: 3,
        max_vertices: 40,
        edges_per_vertex: 4,
    })
}

fn ctx(c: &Case) -> PlanContext<'_> {
    c.ctx()
}

/// Exact valid sets V_l (l = 0..k) of targets over the full graph.
fn exact_sets(c: &Case, targets: &[u32], k: usize) -> Vec<BTreeSet<u32>> {
    let g = c.graph.view();
    let mut sets = vec![BTreeSet::new(); k];
    sets[k - 1] = targets.iter().copied().collect();
    for l in (1..k).rev() {
        let mut next = sets[l].clone();
        for &v in &sets[l] {
            next.extend(g.neighbors(v).iter().copied());
        }
        sets[l - 1] = next;
    }
    sets
}

/// Rows valid at each layer over the devices of `server`, with the plan-level exactness
/// invariant checked on the way: every valid row aggregates exactly `want_row(v, l)` and
/// reads only exact inputs.
fn valid_sets(
    plan: &FlxPlan,
    server: usize,
    want_row: &dyn Fn(u32, usize) -> Vec<u32>,
) -> Result<Vec<BTreeSet<u32>>, TestCaseError> {
    let mut out = vec![BTreeSet::new(); plan.k];
    for d in plan.devices.iter().filter(|d| d.server == server) {
        for (l, set) in out.iter_mut().enumerate() {
            let inputs = d.input_bitmap(l);
            let lg = d.layer_graph(l);
            for i in d.valid_output_rows(l) {
                let v = d.global_ids[i as usize];
                set.insert(v);
                let read = grandis_masking::testing::read_globals(d, l, i);
                prop_assert_eq!(read, want_row(v, l), "row of {} at layer {}", v, l);
                prop_assert!(lg.neighbors(i).iter().all(|&x| inputs[x as usize]));
            }
        }
    }
    Ok(out)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn eas_only_samples_external_dependencies(
        c in case(), h in 0usize..=2, f in 0usize..=3, k in 1usize..=3, uniform in any::<bool>(), seed in 0u64..4,
    ) {
        let cx = ctx(&c);
        let g = c.graph.view();
        let priority = if uniform { Priority::Uniform } else { Priority::Degree };
        let eas = Eas::new(h, f, priority, seed).unwrap();
        for s in 0..c.layout.servers() {
            let range = c.layout.server_range(s);
            let dist = external_distance(&cx, s, h);
            let spec = eas.spec(&cx, s, range.clone().collect(), k, 3).unwrap();
            prop_assert_eq!(&spec, &eas.spec(&cx, s, range.clone().collect(), k, 3).unwrap());
            let Edges::Sampled(e) = &spec.edges else { panic!("sampled") };
            for &v in e.row_vertices() {
                let row = e.kept_sources(v);
                let inner: Vec<u32> = g.neighbors(v).iter().copied().filter(|u| range.contains(u)).collect();
                let kept_inner: Vec<u32> = row.iter().copied().filter(|u| range.contains(u)).collect();
                prop_assert_eq!(kept_inner, inner, "inner in-edges of {} must all be kept", v);
                let ext: Vec<u32> = row.iter().copied().filter(|u| !range.contains(u)).collect();
                prop_assert!(ext.len() <= f, "{} keeps {} external in-neighbours", v, ext.len());
                for u in ext {
                    prop_assert!(g.has_edge(u, v));
                    prop_assert!(usize::from(dist[u as usize]) <= h && dist[u as usize] >= 1);
                }
            }
        }
        // The plan: every inner vertex is extracted and computed at every layer (targets =
        // range, level 0), and rows aggregate exactly their kept edges from exact inputs.
        let plan = eas.flx_plan(&cx, k, 3).unwrap();
        for s in 0..c.layout.servers() {
            let spec = eas.spec(&cx, s, c.layout.server_range(s).collect(), k, 3).unwrap();
            let Edges::Sampled(e) = &spec.edges else { panic!("sampled") };
            let sets = valid_sets(&plan, s, &|v, _| e.kept_sources(v))?;
            let range: BTreeSet<u32> = c.layout.server_range(s).collect();
            prop_assert_eq!(&sets[k - 1], &range);
            // Only external vertices are ever dropped: the extraction holds every vertex of the
            // range, and whatever else it holds is a subset of the exact closure.
            let exact: BTreeSet<u32> = cx.flx_plan(k).unwrap().extracted(s).into_iter().collect();
            let got: BTreeSet<u32> = plan.extracted(s).into_iter().collect();
            prop_assert!(range.is_subset(&got) && got.is_subset(&exact));
        }
        let stats = sample_stats(&cx, &plan);
        prop_assert!(stats.boundary_ratio.iter().all(|b| (0.0..=1.0).contains(b)));
    }

    #[test]
    fn cob_epochs_partition_and_exact_plans(c in case(), b in 1usize..=12, layers in 1usize..=3, epoch in 0u64..3) {
        let cx = ctx(&c);
        let batcher = CoBatcher::new(&cx, b, 11).unwrap();
        let batches = batcher.epoch(epoch);
        prop_assert_eq!(batches.len(), batcher.iterations());
        let mut seen: Vec<u32> = Vec::new();
        for it in &batches {
            prop_assert_eq!(it.len(), c.layout.servers());
            for (s, t) in it.iter().enumerate() {
                prop_assert!(t.len() <= b);
                prop_assert!(t.windows(2).all(|w| w[0] < w[1]));
                prop_assert!(t.iter().all(|v| c.layout.server_range(s).contains(v)));
                seen.extend(t);
            }
        }
        seen.sort_unstable();
        prop_assert_eq!(&seen, &c.train, "an epoch covers every train vertex exactly once");
        if let Some(first) = batches.first() {
            let plan = cob_plan(&cx, first, layers, &Exact, 0).unwrap();
            let g = c.graph.view();
            for (s, t) in first.iter().enumerate() {
                let want = exact_sets(&c, t, layers);
                let got = valid_sets(&plan, s, &|v, _| g.neighbors(v).to_vec())?;
                prop_assert_eq!(&got, &want);
                // The dependency graph = exact L-hop in-closure of the co-batch.
                let mut closure = want[0].clone();
                for &v in &want[0] { closure.extend(g.neighbors(v)); }
                prop_assert_eq!(plan.extracted(s).into_iter().collect::<BTreeSet<_>>(), closure);
                // Loss rows are exactly the co-batch.
                let mut loss: Vec<u32> = plan.devices.iter().filter(|d| d.server == s)
                    .flat_map(|d| d.loss_rows().into_iter().map(|r| d.global_ids[r as usize])).collect();
                loss.sort_unstable();
                prop_assert_eq!(&loss, t);
            }
            // Masked sends carry valid rows only (exchange side of the invariant).
            for d in &plan.devices {
                for l in 1..layers {
                    for si in 0..d.sends.len() {
                        prop_assert!(d.send_rows(l, si).iter().all(|&r| r < d.valid_owned(l - 1).end));
                    }
                }
            }
        }
    }

    #[test]
    fn fanout_rows_respect_fanouts(c in case(), fanouts in prop::collection::vec(1usize..=3, 1..=3), seed in 0u64..4) {
        let cx = ctx(&c);
        let layers = fanouts.len();
        let sampler = Fanout::new(fanouts.clone(), seed).unwrap();
        let batch: Vec<Vec<u32>> = (0..c.layout.servers())
            .map(|s| c.train.iter().copied().filter(|v| c.layout.server_range(s).contains(v)).collect())
            .collect();
        let plan = cob_plan(&cx, &batch, layers, &sampler, 5).unwrap();
        let g = c.graph.view();
        for d in &plan.devices {
            prop_assert_eq!(d.layer_graphs.len(), layers);
            for l in 0..layers {
                let fan = fanouts[layers - 1 - l];
                for i in d.valid_output_rows(l) {
                    let v = d.global_ids[i as usize];
                    let row = d.layer_graph(l).neighbors(i);
                    prop_assert_eq!(row.len(), g.degree(v).min(fan));
                    prop_assert_eq!(d.agg_degree_at(l, i) as usize, row.len());
                    prop_assert!(row.iter().all(|&x| g.has_edge(d.global_ids[x as usize], v)));
                }
            }
        }
        // Same (seed, round): same plan; targets computed at the last layer.
        prop_assert_eq!(&plan, &cob_plan(&cx, &batch, layers, &sampler, 5).unwrap());
        for (s, t) in batch.iter().enumerate() {
            let last: BTreeSet<u32> = plan.devices.iter().filter(|d| d.server == s)
                .flat_map(|d| d.valid_output_rows(layers - 1).into_iter().map(|r| d.global_ids[r as usize])).collect();
            prop_assert_eq!(last, t.iter().copied().collect::<BTreeSet<_>>());
        }
    }

    /// The layer-wise sampler numbers its vertices as a plan orders its rows and declares
    /// its levels, so plans are built from it by array indexing without a scan for levels;
    /// the same edges numbered by global id (the general path, with maps and the scan) give
    /// the very same plans, co-batch and standalone alike.
    #[test]
    fn fanout_plans_equal_plans_of_the_same_edges_by_global_id(c in case(), fanouts in prop::collection::vec(1usize..=3, 1..=3), seed in 0u64..4, round in 0u64..3) {
        let cx = ctx(&c);
        let layers = fanouts.len();
        let sampler = Fanout::new(fanouts, seed).unwrap();
        let renumbered = |spec: &ExtractionSpec| -> ExtractionSpec {
            let Edges::Sampled(e) = &spec.edges else { panic!("sampled") };
            let per_layer = (0..layers)
                .map(|l| {
                    e.iter_rows()
                        .map(|(v, base, srcs)| {
                            let at_l = srcs.iter().enumerate()
                                .filter(|&(j, _)| e.used_at(base + j, l))
                                .map(|(_, &u)| e.vertices()[u as usize])
                                .collect();
                            (v, at_l)
                        })
                        .collect()
                })
                .collect();
            ExtractionSpec {
                edges: Edges::Sampled(SampledEdges::from_layer_rows(per_layer).unwrap()),
                ..spec.clone()
            }
        };
        let specs: Vec<ExtractionSpec> = (0..c.layout.servers())
            .map(|s| {
                let targets = c.train.iter().copied().filter(|v| c.layout.server_range(s).contains(v)).collect();
                sampler.spec(&cx, s, targets, layers, round).unwrap()
            })
            .collect();
        let by_id: Vec<ExtractionSpec> = specs.iter().map(renumbered).collect();
        prop_assert_eq!(cx.extract_plan(&specs).unwrap(), cx.extract_plan(&by_id).unwrap());
        for (a, b) in specs.iter().zip(&by_id) {
            for device in 0..c.layout.devices() {
                prop_assert_eq!(
                    cx.extract_device_plan(a, device).unwrap(),
                    cx.extract_device_plan(b, device).unwrap()
                );
            }
        }
    }

    #[test]
    fn saint_subgraphs_are_induced(c in case(), rw in any::<bool>(), budget in 1usize..=20, hops in 1usize..=3) {
        let cx = ctx(&c);
        let kind = if rw { SaintKind::RandomWalk { roots: budget / 4 + 1, length: 3 } } else { SaintKind::Node { budget } };
        let saint = Saint { kind, seed: 9 };
        let plan = saint.plan(&cx, hops, 2).unwrap();
        let g = c.graph.view();
        for s in 0..c.layout.servers() {
            let sample = saint.sample_vertices(&cx, s, 2).unwrap();
            prop_assert!(sample.iter().all(|v| c.layout.server_range(s).contains(v)));
            let set: BTreeSet<u32> = sample.iter().copied().collect();
            prop_assert_eq!(plan.extracted(s).into_iter().collect::<BTreeSet<_>>(), set.clone());
            let sets = valid_sets(&plan, s, &|v, _| g.neighbors(v).iter().copied().filter(|u| set.contains(u)).collect())?;
            // Unmasked: every sampled vertex is computed at every layer.
            prop_assert!(sets.iter().all(|x| *x == set));
        }
    }
}
