//! Hand-checked cases. The Figure 6 style graph: vertices 0-3 on server 0, 4-7 on server 1,
//! undirected edges 0-1, 1-2, 2-3 (server 0), 4-5, 5-7, 6-7 (server 1) and the cut edges
//! 2-4, 3-4, 3-6. External distances from server 0: 4 and 6 are 1 hop away, 5 and 7 two.
//!
//! EAS with h = 2, f = 1, degree priority, 2 hops, expected by hand:
//! - server 0, hop 1: frontier 0..=3; external candidates: 2 <- {4}, 3 <- {4, 6}. Vertex 4
//!   reaches two unsaturated vertices (2, 3), 6 one: take 4, keep 4->2 and 4->3; now 2 and 3
//!   are saturated, 6 reaches none and is dropped. Hop 2: frontier {4}; its in-neighbours 2,
//!   3 are inner (kept) and 5 (distance 2 <= h) is its only candidate: keep 5->4. So server 0
//!   preloads 4 and 5 only, where the exact 2-hop closure has all of 4..=7.
//! - server 1, hop 1: candidates 4 <- {2, 3}, 6 <- {3}: 3 reaches two, 2 one: take 3 (3->4,
//!   3->6), drop 2. Hop 2: frontier {3}: inner in-neighbours 4, 6 kept, candidate 2 (distance
//!   1): keep 2->3. Server 1 extracts 2..=7.

use grandis_masking::{Edges, PlanContext, SplitMembership};
use grandis_sampling::{external_distance, Eas, Priority, Sampler};
use grandis_store::CsrGraph;

fn graph() -> CsrGraph {
    let edges = [
        (0, 1),
        (1, 2),
        (2, 3),
        (4, 5),
        (5, 7),
        (6, 7),
        (2, 4),
        (3, 4),
        (3, 6),
    ];
    grandis_masking::testing::undirected(8, &edges)
}

fn ctx(g: &CsrGraph) -> PlanContext<'_> {
    grandis_masking::testing::two_by_two_of_eight(g, SplitMembership::none(8))
}

fn kept_row(spec: &grandis_masking::ExtractionSpec, v: u32) -> Vec<u32> {
    match &spec.edges {
        Edges::Sampled(e) => e.kept_sources(v),
        Edges::Exact => panic!("EAS gives sampled edges"),
    }
}

#[test]
fn figure6_priority_selection() {
    let g = graph();
    let c = ctx(&g);
    assert_eq!(external_distance(&c, 0, 2), vec![0, 0, 0, 0, 1, 2, 1, 2]);
    let eas = Eas::new(2, 1, Priority::Degree, 7).unwrap();
    let s0 = eas.spec(&c, 0, (0..4).collect(), 2, 0).unwrap();
    assert_eq!(kept_row(&s0, 0), vec![1]);
    assert_eq!(kept_row(&s0, 1), vec![0, 2]);
    assert_eq!(kept_row(&s0, 2), vec![1, 3, 4]);
    assert_eq!(kept_row(&s0, 3), vec![2, 4]); // 6 dropped
    assert_eq!(kept_row(&s0, 4), vec![2, 3, 5]);
    assert_eq!(kept_row(&s0, 5), Vec::<u32>::new()); // level 2 = k: no row
    let s1 = eas.spec(&c, 1, (4..8).collect(), 2, 0).unwrap();
    assert_eq!(kept_row(&s1, 4), vec![3, 5]); // 2 dropped
    assert_eq!(kept_row(&s1, 6), vec![3, 7]);
    assert_eq!(kept_row(&s1, 3), vec![2, 4, 6]);

    let plan = eas.flx_plan(&c, 2, 0).unwrap();
    assert_eq!(plan.extracted(0), vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(plan.extracted(1), vec![2, 3, 4, 5, 6, 7]);
    let exact = c.flx_plan(2).unwrap();
    assert_eq!(exact.extracted(0), (0..8).collect::<Vec<_>>());
    // Vertex 3 aggregates over its 2 kept in-edges, not its global 3.
    let d = plan
        .devices
        .iter()
        .find(|d| d.local_of(3).is_some_and(|r| (r as usize) < d.n_owned) && d.server == 0)
        .unwrap();
    let r = d.local_of(3).unwrap() as usize;
    assert_eq!((d.agg_degree[r], d.in_degree[r]), (2, 3));
    assert!(d.is_sampled());
}

#[test]
fn uniform_differs_from_priority_on_the_figure6_graph() {
    let g = graph();
    let c = ctx(&g);
    let prio = Eas::new(2, 1, Priority::Degree, 0)
        .unwrap()
        .flx_plan(&c, 2, 0)
        .unwrap();
    // Uniform lets vertex 3 keep 6 instead of 4 for some seeds, which then pulls in 7.
    let differing = (0..64u64)
        .filter(|&seed| {
            let u = Eas::new(2, 1, Priority::Uniform, seed)
                .unwrap()
                .flx_plan(&c, 2, 0)
                .unwrap();
            u.extracted(0) != prio.extracted(0)
        })
        .count();
    assert!(differing > 0, "uniform never differed from priority");
    // Priority is the same whatever the seed here: no ties at any decision.
    for seed in 0..8 {
        let p = Eas::new(2, 1, Priority::Degree, seed)
            .unwrap()
            .flx_plan(&c, 2, 0)
            .unwrap();
        assert_eq!(p.extracted(0), prio.extracted(0));
    }
}

#[test]
fn h_limits_external_distance() {
    let g = graph();
    let c = ctx(&g);
    // h = 1: 5 (distance 2) can never be kept; f = 3 lets 3 keep both 4 and 6.
    let plan = Eas::new(1, 3, Priority::Degree, 0)
        .unwrap()
        .flx_plan(&c, 3, 0)
        .unwrap();
    assert_eq!(plan.extracted(0), vec![0, 1, 2, 3, 4, 6]);
    // h = 0: nothing external at all.
    let plan = Eas::new(0, 3, Priority::Degree, 0)
        .unwrap()
        .flx_plan(&c, 3, 0)
        .unwrap();
    assert_eq!(plan.extracted(0), vec![0, 1, 2, 3]);
    assert_eq!(plan.servers[0].replicated, 0);
}

#[test]
fn bad_inputs_are_errors() {
    let g = graph();
    let c = ctx(&g);
    let eas = Eas::paper_default(0);
    let e = eas.spec(&c, 0, vec![5], 2, 0).unwrap_err().to_string();
    assert!(e.contains("target 5 is not one of its vertices"), "{e}");
    let e = eas.spec(&c, 2, vec![], 2, 0).unwrap_err().to_string();
    assert!(e.contains("server 2 does not exist"), "{e}");
    assert!(grandis_sampling::Fanout::parse("25,x", 0).is_err());
    assert!(grandis_sampling::Fanout::parse("25,0", 0).is_err());
    let f = grandis_sampling::Fanout::parse("2,2", 0).unwrap();
    let e = f.spec(&c, 0, vec![0], 3, 0).unwrap_err().to_string();
    assert!(e.contains("2 given for a 3-layer model"), "{e}");
    assert!("bogus".parse::<Priority>().is_err());
}
