//! Property tests of plans built from extraction specs: arbitrary targets, exact or sampled
//! kept edges, optionally per layer. One checker compares every plan with a reference
//! computed straight from the definition: `V_{k-1}` = targets, `V_{l-1}` = `V_l` plus the
//! sources of the layer-l kept edges of `V_l`; the rows valid at layer l must be exactly
//! `V_l`, each aggregating exactly its layer-l kept edges from inputs that are exact.

use std::collections::{BTreeMap, BTreeSet};

use grandis_masking::testing::{self, CaseBounds};
use grandis_masking::{
    estimate_masked, estimate_masked_inference, DevicePlan, Edges, ExtractionSpec, FlxPlan,
    InputCopy, Layout, ModelDims, PlanContext, SampledEdges, SplitMembership,
};
use grandis_store::{CsrGraph, EdgeOptions};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    graph: CsrGraph,
    layout: Layout,
    /// Per vertex: is it a target of its server.
    target: Vec<bool>,
    /// Per edge (CSR order) and layer: kept bits (bit l = used at layer l).
    bits: Vec<u8>,
    k: usize,
}

/// The shared random graph and layout; its train split serves as the targets, plus random
/// per-edge, per-layer kept bits and a hop count.
fn case() -> impl Strategy<Value = Case> {
    let bounds = CaseBounds {
        max_servers: 3,
        max_devices: 3,
        max_vertices: 40,
        edges_per_vertex: 3,
    };
    (
        testing::case(bounds),
        1usize..=3,
        prop::collection::vec(any::<u8>(), 1..=240),
    )
        .prop_map(|(base, k, bits)| {
            let n = base.graph.view().num_vertices();
            let mut target = vec![false; n];
            for &t in &base.train {
                target[t as usize] = true;
            }
            let bits = (0..base.graph.indices.len())
                .map(|e| bits[e % bits.len()])
                .collect();
            Case {
                graph: base.graph,
                layout: base.layout,
                target,
                bits,
                k,
            }
        })
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    Exact,
    Sampled,
    PerLayer,
}

/// Kept sources of `v` at `layer` under `mode`.
fn kept(c: &Case, mode: Mode, v: u32, layer: usize) -> Vec<u32> {
    let g = c.graph.view();
    let base = g.offsets[v as usize] as usize;
    g.neighbors(v)
        .iter()
        .enumerate()
        .filter(|&(j, _)| match mode {
            Mode::Exact => true,
            Mode::Sampled => c.bits[base + j] & 1 == 1,
            Mode::PerLayer => c.bits[base + j] >> layer & 1 == 1,
        })
        .map(|(_, &u)| u)
        .collect()
}

fn targets(c: &Case, s: usize) -> Vec<u32> {
    c.layout
        .server_range(s)
        .filter(|&v| c.target[v as usize])
        .collect()
}

fn specs(c: &Case, mode: Mode) -> Vec<ExtractionSpec> {
    let n = c.graph.view().num_vertices() as u32;
    (0..c.layout.servers())
        .map(|s| {
            let edges = match mode {
                Mode::Exact => Edges::Exact,
                Mode::Sampled => Edges::Sampled(
                    SampledEdges::from_rows((0..n).map(|v| (v, kept(c, mode, v, 0)))).unwrap(),
                ),
                Mode::PerLayer => Edges::Sampled(
                    SampledEdges::from_layer_rows(
                        (0..c.k)
                            .map(|l| (0..n).map(|v| (v, kept(c, mode, v, l))).collect())
                            .collect(),
                    )
                    .unwrap(),
                ),
            };
            ExtractionSpec {
                server: s,
                targets: targets(c, s),
                hops: c.k,
                edges,
            }
        })
        .collect()
}

/// Reference valid sets `V_l` (l = 0..k) of server `s`.
fn reference(c: &Case, mode: Mode, s: usize) -> Vec<BTreeSet<u32>> {
    let k = c.k;
    let mut sets = vec![BTreeSet::new(); k];
    sets[k - 1] = targets(c, s).into_iter().collect();
    for l in (1..k).rev() {
        let mut next = sets[l].clone();
        for &v in &sets[l] {
            next.extend(kept(c, mode, v, l));
        }
        sets[l - 1] = next;
    }
    sets
}

/// The compact row space of `layer` holds exactly the rows the layer reads and writes: every
/// compact edge names the same vertex as the plan's edge, the layer-0 space is the local one,
/// and the layer's output rows are the next layer's owned input rows.
fn check_compact(d: &DevicePlan, layer: usize) -> Result<(), TestCaseError> {
    let rows = d.layer_rows(layer);
    let g = d.compact_graph(&rows).unwrap();
    let ids = d.compact_global_ids(&rows);
    prop_assert_eq!(ids.len(), rows.n_src);
    prop_assert_eq!(rows.n_dst, d.valid_owned(layer).len());
    let lg = d.layer_graph(layer);
    for i in 0..rows.n_dst as u32 {
        let compact: Vec<u32> = g
            .view()
            .neighbors(i)
            .iter()
            .map(|&x| ids[x as usize])
            .collect();
        let local: Vec<u32> = lg
            .neighbors(i)
            .iter()
            .map(|&x| d.global_ids[x as usize])
            .collect();
        prop_assert_eq!(compact, local, "rank {} layer {} row {}", d.rank, layer, i);
    }
    d.check_sends(layer, &rows).unwrap();
    if layer == 0 {
        prop_assert!(rows.n_src == d.n_local() && rows.owned_src == d.n_owned);
    } else {
        prop_assert_eq!(rows.owned_src, d.layer_rows(layer - 1).n_dst);
    }
    Ok(())
}

fn check(c: &Case, mode: Mode, plan: &FlxPlan) -> Result<(), TestCaseError> {
    let k = c.k;
    prop_assert_eq!(plan.k, k);
    for s in 0..c.layout.servers() {
        let refs = reference(c, mode, s);
        let devs: Vec<_> = plan.devices.iter().filter(|d| d.server == s).collect();
        for d in &devs {
            // Inner rows are this device's targets, in order.
            let want: Vec<u32> = c
                .layout
                .range(d.rank)
                .filter(|&v| c.target[v as usize])
                .collect();
            prop_assert_eq!(&d.global_ids[..d.n_inner], &want[..]);
            prop_assert!(d.halo.iter().all(|g| plan.devices[g.peer].server == s));
            prop_assert_eq!(d.agg_degree.len(), d.n_local());
        }
        for (l, want_valid) in refs.iter().enumerate() {
            let mut valid = BTreeSet::new();
            for d in &devs {
                let inputs = d.input_bitmap(l);
                let lg = d.layer_graph(l);
                for i in d.valid_output_rows(l) {
                    let v = d.global_ids[i as usize];
                    prop_assert!(valid.insert(v), "vertex {} valid twice", v);
                    let read = grandis_masking::testing::read_globals(d, l, i);
                    prop_assert_eq!(&read, &kept(c, mode, v, l), "row of {} at layer {}", v, l);
                    prop_assert_eq!(d.agg_degree_at(l, i) as usize, read.len());
                    for &x in lg.neighbors(i) {
                        prop_assert!(
                            inputs[x as usize],
                            "{} reads inexact input at layer {}",
                            v,
                            l
                        );
                        if l > 0 {
                            let gid = d.global_ids[x as usize];
                            let owner = if (x as usize) < d.n_owned {
                                *d
                            } else {
                                &plan.devices
                                    [d.halo.iter().find(|g| g.rows.contains(&x)).unwrap().peer]
                            };
                            let at = owner.local_of(gid).unwrap();
                            prop_assert!(at < owner.valid_owned(l - 1).end);
                        }
                    }
                }
                // Everything sent before layer l >= 1 is a valid output of layer l - 1.
                if l > 0 {
                    for si in 0..d.sends.len() {
                        prop_assert!(d
                            .send_rows(l, si)
                            .iter()
                            .all(|&r| r < d.valid_owned(l - 1).end));
                    }
                }
            }
            prop_assert_eq!(&valid, want_valid, "server {} layer {}", s, l);
            for d in &devs {
                check_compact(d, l)?;
            }
        }
        // The extraction holds V_0 plus the layer-0 inputs, nothing else.
        let mut all: BTreeSet<u32> = refs[0].clone();
        for &v in &refs[0] {
            all.extend(kept(c, mode, v, 0));
        }
        prop_assert_eq!(plan.extracted(s).into_iter().collect::<BTreeSet<_>>(), all);
    }
    Ok(())
}

/// Checks the placement rule of `PlanContext::flx_plan`'s doc, computed here from the FULL
/// graph's out-neighbours: levels in order, vertices of a level ascending; before level d every
/// device's capacity is `ceil(|levels 0..=d| / G)`; u goes to the device below capacity owning
/// the most out-neighbours w of u at level d - 1 that keep the edge u -> w, ties to the smaller
/// load, then the smaller device.
fn check_placement(c: &Case, mode: Mode, plan: &FlxPlan) -> Result<(), TestCaseError> {
    let g_count = c.layout.devices();
    let reverse = c.graph.view().transpose();
    for s in 0..c.layout.servers() {
        // (level, device) of every vertex the server extracted, from its devices' owned rows.
        let mut at: BTreeMap<u32, (u8, usize)> = BTreeMap::new();
        for d in plan.devices.iter().filter(|d| d.server == s) {
            for i in 0..d.n_owned {
                at.insert(d.global_ids[i], (d.level[i], d.device));
            }
        }
        let keeps = |u: u32, w: u32| -> bool {
            match mode {
                Mode::PerLayer => (0..c.k).any(|l| kept(c, mode, w, l).contains(&u)),
                _ => kept(c, mode, w, 0).contains(&u),
            }
        };
        let mut loads = vec![0usize; g_count];
        let mut total = 0;
        for d in 0..=c.k as u8 {
            let level: Vec<u32> = at
                .iter()
                .filter(|(_, &(l, _))| l == d)
                .map(|(&v, _)| v)
                .collect();
            total += level.len();
            if d == 0 {
                for v in &level {
                    loads[at[v].1] += 1;
                }
                continue;
            }
            let cap = total.div_ceil(g_count);
            for &u in &level {
                let mut counts = vec![0usize; g_count];
                for &w in reverse.view().neighbors(u) {
                    if let Some(&(lw, gw)) = at.get(&w) {
                        if lw == d - 1 && keeps(u, w) {
                            counts[gw] += 1;
                        }
                    }
                }
                let best = (0..g_count)
                    .filter(|&g| loads[g] < cap)
                    .max_by_key(|&g| (counts[g], std::cmp::Reverse(loads[g]), std::cmp::Reverse(g)))
                    .unwrap();
                prop_assert_eq!(at[&u].1, best, "server {} level {} vertex {}", s, d, u);
                loads[best] += 1;
            }
        }
    }
    Ok(())
}

fn ctx(c: &Case) -> PlanContext<'_> {
    let n = c.graph.view().num_vertices();
    PlanContext::new(c.graph.view(), c.layout.clone(), SplitMembership::none(n)).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    #[test]
    fn exact_extraction_of_arbitrary_targets(c in case()) {
        let plan = ctx(&c).extract_plan(&specs(&c, Mode::Exact)).unwrap();
        check(&c, Mode::Exact, &plan)?;
        for d in &plan.devices {
            prop_assert_eq!(&d.agg_degree, &d.in_degree);
            prop_assert!(!d.is_sampled());
        }
    }

    #[test]
    fn sampled_extraction_masks_follow_kept_edges(c in case()) {
        let plan = ctx(&c).extract_plan(&specs(&c, Mode::Sampled)).unwrap();
        check(&c, Mode::Sampled, &plan)?;
        prop_assert!(plan.servers.iter().all(|s| s.sampled));
    }

    #[test]
    fn per_layer_extraction(c in case()) {
        let plan = ctx(&c).extract_plan(&specs(&c, Mode::PerLayer)).unwrap();
        check(&c, Mode::PerLayer, &plan)?;
        for d in &plan.devices {
            prop_assert_eq!(d.layer_graphs.len(), c.k);
            // Every per-layer row is a subset of the union row.
            for (l, g) in d.layer_graphs.iter().enumerate() {
                for i in 0..d.n_owned as u32 {
                    let union: BTreeMap<u32, ()> = d.row(i).iter().map(|&x| (x, ())).collect();
                    prop_assert!(g.view().neighbors(i).iter().all(|x| union.contains_key(x)), "layer {}", l);
                }
            }
        }
        let dims = ModelDims { layers: c.k, features: 3, hidden: 4, classes: 2, input_copy: InputCopy::None, attention: None, link_embedding_values: 0, relations: 0 };
        let e = estimate_masked(&dims, &plan);
        prop_assert_eq!(e.devices.len(), c.layout.num_ranks());
        // An inference pass keeps no tensor for backward: never more than training, never
        // less than what both hold (features, graphs, metadata, parameters) plus the widest
        // layer's output.
        for (d, t) in plan.devices.iter().zip(&e.devices) {
            let i = estimate_masked_inference(&dims, d);
            prop_assert!(i.total <= t.total, "inference {} > training {}", i.total, t.total);
            prop_assert_eq!(i.backward_scratch, 0);
            let held = t.features + t.graph + t.metadata + t.params + t.halo_buffers;
            let widest_output = t.layers.iter().map(|m| m.pre_activation).max().unwrap_or(0);
            prop_assert!(i.total >= held + widest_output);
        }
    }

    #[test]
    fn placement_follows_the_out_neighbour_rule(c in case()) {
        for mode in [Mode::Exact, Mode::Sampled, Mode::PerLayer] {
            let plan = ctx(&c).extract_plan(&specs(&c, mode)).unwrap();
            check_placement(&c, mode, &plan)?;
        }
    }

    #[test]
    fn single_device_extraction_has_no_halo(c in case(), dev in 0usize..3) {
        let cx = ctx(&c);
        let dev = dev % c.layout.devices();
        for spec in specs(&c, Mode::Sampled) {
            let p = cx.extract_device_plan(&spec, dev).unwrap();
            prop_assert_eq!(p.n_halo(), 0);
            prop_assert_eq!(p.n_inner, spec.targets.len());
            prop_assert_eq!(p.rank, c.layout.rank(spec.server, dev));
            let refs = reference(&c, Mode::Sampled, spec.server);
            for (l, want) in refs.iter().enumerate() {
                let got: BTreeSet<u32> = p.valid_output_rows(l).iter().map(|&r| p.global_ids[r as usize]).collect();
                prop_assert_eq!(&got, want);
            }
        }
    }
}

#[test]
fn flx_is_the_range_exact_special_case() {
    let g = grandis_store::graph_from_edges(
        6,
        [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 0)],
        EdgeOptions {
            symmetrize: true,
            ..Default::default()
        },
    )
    .unwrap();
    let layout = Layout::even(6, 2, 1).unwrap();
    let cx = PlanContext::new(g.view(), layout.clone(), SplitMembership::none(6)).unwrap();
    let specs: Vec<_> = (0..2).map(|s| ExtractionSpec::flx(&layout, s, 2)).collect();
    assert_eq!(cx.extract_plan(&specs).unwrap(), cx.flx_plan(2).unwrap());
}

/// Knowing the graph symmetric changes no plan (only fine clustering reads it).
#[test]
fn symmetric_context_plans_what_the_plain_one_does() {
    let n = 60u32;
    let edges: Vec<(u32, u32)> = (0..n)
        .flat_map(|v| [(v, (v * 7 + 3) % n), (v, (v * v + 1) % n), (v, (v + 1) % n)])
        .collect();
    let opts = EdgeOptions {
        symmetrize: true,
        ..Default::default()
    };
    let g = grandis_store::graph_from_edges(n as u64, edges, opts).unwrap();
    let layout = Layout::even(n, 2, 2).unwrap();
    let none = || SplitMembership::none(n as usize);
    let built = PlanContext::new(g.view(), layout.clone(), none()).unwrap();
    let shared = PlanContext::symmetric(g.view(), layout.clone(), none()).unwrap();
    assert!(shared.is_symmetric() && !built.is_symmetric());
    for k in 1..=2 {
        assert_eq!(built.flx_plan(k).unwrap(), shared.flx_plan(k).unwrap());
    }
    let specs: Vec<_> = (0..2)
        .map(|s| {
            let targets: Vec<u32> = layout.server_range(s).step_by(3).collect();
            ExtractionSpec::exact(s, targets, 2)
        })
        .collect();
    assert_eq!(
        built.extract_plan(&specs).unwrap(),
        shared.extract_plan(&specs).unwrap()
    );
}

#[test]
fn bad_specs_are_rejected_with_reasons() {
    let g = grandis_store::graph_from_edges(4, [(0, 1), (1, 2), (2, 3)], EdgeOptions::default())
        .unwrap();
    let layout = Layout::even(4, 2, 1).unwrap();
    let cx = PlanContext::new(g.view(), layout, SplitMembership::none(4)).unwrap();
    let ok = |s: usize, t: Vec<u32>| ExtractionSpec::exact(s, t, 1);
    let err = |specs: Vec<ExtractionSpec>| cx.extract_plan(&specs).unwrap_err().to_string();
    assert!(err(vec![ok(0, vec![0])]).contains("1 extraction specs given for 2 servers"));
    assert!(err(vec![ok(0, vec![2]), ok(1, vec![])]).contains("target 2 is not one of its"));
    assert!(err(vec![ok(0, vec![1, 0]), ok(1, vec![])]).contains("sorted and distinct"));
    assert!(err(vec![ok(1, vec![]), ok(0, vec![])]).contains("server order"));
    let sampled = |rows: Vec<(u32, Vec<u32>)>| {
        vec![
            ExtractionSpec {
                server: 0,
                targets: vec![1],
                hops: 1,
                edges: Edges::Sampled(SampledEdges::from_rows(rows).unwrap()),
            },
            ok(1, vec![]),
        ]
    };
    // An id past the graph is refused in every build; a non-edge in debug builds (tests).
    let e = err(sampled(vec![(1, vec![9])]));
    assert!(
        e.contains("sampled edge 9 -> 1, the graph has 4 vertices"),
        "{e}"
    );
    if cfg!(debug_assertions) {
        let e = err(sampled(vec![(1, vec![3])]));
        assert!(e.contains("sampled edge 3 -> 1 is not an edge"), "{e}");
    }
    assert!(SampledEdges::from_rows([(1u32, vec![0u32]), (1, vec![])]).is_err());
    let layered = SampledEdges::from_layer_rows(vec![vec![(1u32, vec![0u32])]]).unwrap();
    let e = err(vec![
        ExtractionSpec {
            server: 0,
            targets: vec![1],
            hops: 2,
            edges: Edges::Sampled(layered),
        },
        ExtractionSpec::exact(1, vec![], 2),
    ]);
    assert!(e.contains("1 per-layer edge sets for 2 hops"), "{e}");
}
