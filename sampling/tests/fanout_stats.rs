//! Statistical properties of the layer-wise fanout sampler (its draws are not compared with
//! any earlier implementation's, only with what uniform sampling without replacement, drawn
//! independently per layer and round, must give). Vertex 0 has the 20 in-neighbours 1..=20.

use grandis_masking::{Layout, PlanContext, SplitMembership};
use grandis_sampling::{Fanout, Sampler};
use grandis_store::{CsrGraph, EdgeOptions};

const DEGREE: u32 = 20;
const FANOUT: usize = 5;
const ROUNDS: u64 = 4000;

fn star() -> CsrGraph {
    grandis_store::graph_from_edges(
        DEGREE as u64 + 1,
        (1..=DEGREE).map(|u| (u, 0)),
        EdgeOptions::default(),
    )
    .unwrap()
}

/// A symmetric graph of `n` vertices, each with 9 in-neighbours spread over the ids.
fn spread(n: u32) -> CsrGraph {
    grandis_store::graph_from_edges(
        n as u64,
        (0..n).flat_map(|v| (1..=9u32).map(move |k| ((v * 7 + k * 7919) % n, v))),
        EdgeOptions {
            symmetrize: true,
            ..Default::default()
        },
    )
    .unwrap()
}

use grandis_masking::testing::one_device as ctx;

#[test]
fn every_in_neighbour_is_equally_likely_and_drawn_once() {
    let g = star();
    let c = ctx(&g);
    let f = Fanout::new(vec![FANOUT], 7).unwrap();
    let mut counts = [0u64; DEGREE as usize + 1];
    for round in 0..ROUNDS {
        let row = f.sample_row(&c, 0, 0, FANOUT, round);
        assert_eq!(row.len(), FANOUT);
        assert!(
            row.windows(2).all(|w| w[0] < w[1]),
            "sorted, no repeats: {row:?}"
        );
        for u in row {
            counts[u as usize] += 1;
        }
    }
    // Each neighbour: Binomial(4000, 1/4), mean 1000, sd 27; 5 sd either side.
    let expect = ROUNDS as f64 * FANOUT as f64 / DEGREE as f64;
    for (u, &n) in counts.iter().enumerate().skip(1) {
        assert!(
            (n as f64 - expect).abs() < 5.0 * (expect * 0.75).sqrt(),
            "neighbour {u}: {n} draws"
        );
    }
    // Chi-square over the 20 cells (19 degrees of freedom; 99.9th percentile 43.8).
    let chi: f64 = counts[1..]
        .iter()
        .map(|&n| (n as f64 - expect).powi(2) / expect)
        .sum();
    assert!(chi < 43.8, "chi-square {chi:.1}");
}

#[test]
fn layers_and_rounds_draw_independently() {
    let g = star();
    let c = ctx(&g);
    let f = Fanout::new(vec![FANOUT, FANOUT], 3).unwrap();
    // Two independent 5-subsets of 20 share 5 * 5 / 20 = 1.25 neighbours on average; equal
    // draws would share 5.
    let overlap = |a: &[u32], b: &[u32]| a.iter().filter(|x| b.contains(x)).count() as f64;
    let (mut layers, mut rounds) = (0.0, 0.0);
    for round in 0..ROUNDS {
        let a = f.sample_row(&c, 0, 0, FANOUT, round);
        layers += overlap(&a, &f.sample_row(&c, 0, 1, FANOUT, round));
        rounds += overlap(&a, &f.sample_row(&c, 0, 0, FANOUT, round + ROUNDS));
    }
    for (what, total) in [("layers", layers), ("rounds", rounds)] {
        let mean = total / ROUNDS as f64;
        assert!((mean - 1.25).abs() < 0.08, "{what}: mean overlap {mean:.3}");
    }
}

#[test]
fn the_step_is_the_same_whatever_the_threads() {
    let g = grandis_store::graph_from_edges(
        3000,
        (0..3000u32).flat_map(|v| (1..=12u32).map(move |k| ((v * 7 + k * 131) % 3000, v))),
        EdgeOptions {
            symmetrize: true,
            ..Default::default()
        },
    )
    .unwrap();
    let c = ctx(&g);
    let f = Fanout::new(vec![6, 4, 3], 11).unwrap();
    let targets: Vec<u32> = (0..3000).step_by(7).collect();
    let one = spec_on_threads(1, &f, &c, &targets, 5);
    assert_eq!(one, spec_on_threads(3, &f, &c, &targets, 5));
    assert_eq!(one, spec_on_threads(8, &f, &c, &targets, 5));
    // The same with each kind of id map a sample numbers its vertices with (an array over
    // the graph, a stamped array reused by the thread, a hash map), as the targets are many
    // or few against the graph.
    let n = 100_000u32;
    let g = spread(n);
    let c = ctx(&g);
    for count in [20_000u32, 60, 4] {
        let targets: Vec<u32> = (0..count).map(|t| t * (n / count)).collect();
        let one = spec_on_threads(1, &f, &c, &targets, 9);
        assert_eq!(
            one,
            spec_on_threads(2, &f, &c, &targets, 9),
            "{count} targets"
        );
        assert_eq!(
            one,
            spec_on_threads(5, &f, &c, &targets, 9),
            "{count} targets"
        );
    }
}

/// The 3-hop spec of `targets` in `round`, drawn on a pool of `threads` threads.
fn spec_on_threads(
    threads: usize,
    f: &Fanout,
    c: &PlanContext<'_>,
    targets: &[u32],
    round: u64,
) -> grandis_masking::ExtractionSpec {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(|| f.spec(c, 0, targets.to_vec(), 3, round).unwrap())
}

/// A step's plans are the same on any number of threads, also where they have more rows than
/// one task of the plan builder takes (16,384): the standalone plan of a sample (keyed by
/// the sample's numbers), the masked plan of two servers' samples (keyed through a map), and
/// the exact full-batch plan.
#[test]
fn plans_are_the_same_on_any_number_of_threads() {
    let n = 100_000u32;
    let g = spread(n);
    let f = Fanout::new(vec![6, 4, 3], 11).unwrap();
    let on = |threads: usize, f: &(dyn Fn() -> String + Sync)| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(f)
    };
    // One server and device: a standalone plan.
    let c = ctx(&g);
    let targets: Vec<u32> = (0..20_000u32).map(|t| t * 5).collect();
    let spec = f.spec(&c, 0, targets, 3, 1).unwrap();
    let standalone = || format!("{:?}", c.extract_device_plan(&spec, 0).unwrap());
    // Two servers of one device each: a masked plan over both servers' samples.
    let two = PlanContext::new(
        g.view(),
        Layout::even(n, 2, 1).unwrap(),
        SplitMembership::none(n as usize),
    )
    .unwrap();
    let specs: Vec<_> = (0..2u32)
        .map(|s| {
            let first = s * n / 2;
            let targets = (0..20_000u32).map(|t| first + t * 2).collect();
            f.spec(&two, s as usize, targets, 3, 1).unwrap()
        })
        .collect();
    let masked = || format!("{:?}", two.extract_plan(&specs).unwrap());
    let exact = || format!("{:?}", two.fb_plan().unwrap());
    for build in [&standalone as &(dyn Fn() -> String + Sync), &masked, &exact] {
        let one = on(1, build);
        assert!(one.len() > 1000);
        assert_eq!(one, on(2, build));
        assert_eq!(one, on(5, build));
    }
}
