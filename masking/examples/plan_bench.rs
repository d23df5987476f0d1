//! Builds FB and FLX plans on a synthetic "already partitioned" graph and prints sizes, the
//! memory model and build times. Usage:
//! `cargo run --release -p grandis-masking --example plan_bench -- [vertices] [degree] [remote%]`
//! Each vertex gets `degree` in-edges (symmetrised afterwards): most from a window of nearby
//! ids (what a min-cut partitioner's relabelling produces), `remote%` from anywhere.

use std::time::Instant;

use grandis_masking::{InputCopy, Layout, ModelDims, PlanContext, SplitMembership};
use grandis_store::EdgeOptions;
use rand::{Rng, SeedableRng};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: u64| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let n = arg(1, 200_000) as u32;
    let degree = arg(2, 10) as u32;
    let remote_pct = arg(3, 5) as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let window = 2_000u32.min(n.max(2) - 1);
    let mut edges = Vec::with_capacity((n * degree) as usize);
    for v in 0..n {
        for _ in 0..degree {
            let u = if rng.gen_range(0..100) < remote_pct {
                rng.gen_range(0..n)
            } else {
                let off = rng.gen_range(1..=window);
                (v + off) % n
            };
            edges.push((u, v));
        }
    }
    let t = Instant::now();
    let graph = grandis_store::graph_from_edges(
        n as u64,
        edges,
        EdgeOptions {
            symmetrize: true,
            ..Default::default()
        },
    )
    .expect("valid edges");
    println!(
        "graph: {n} vertices, {} edges (built in {:.2?})",
        graph.indices.len(),
        t.elapsed()
    );
    let layout = Layout::even(n, 2, 4).expect("layout");
    let t = Instant::now();
    let ctx =
        PlanContext::new(graph.view(), layout, SplitMembership::none(n as usize)).expect("context");
    println!("context (transpose): {:.2?}", t.elapsed());
    let t = Instant::now();
    let fb = ctx.fb_plan().expect("fb");
    let s = fb.stats();
    println!(
        "FB: {:.2?}; halo rows intra {} inter {}; max n_local {}",
        t.elapsed(),
        s.halo_rows.intra_server,
        s.halo_rows.inter_server,
        s.max_n_local
    );
    let dims = ModelDims {
        layers: 3,
        features: 128,
        hidden: 256,
        classes: 16,
        input_copy: InputCopy::None,
        attention: None,
        link_embedding_values: 0,
        relations: 0,
    };
    println!(
        "k=0 estimate: {} MiB max/device",
        grandis_masking::estimate(&dims, &fb, None).max_bytes >> 20
    );
    for k in 1..=3 {
        let t = Instant::now();
        let flx = ctx.flx_plan(k).expect("flx");
        let took = t.elapsed();
        let s = flx.stats();
        let e = grandis_masking::estimate(&dims, &fb, Some(&flx));
        println!(
            "FLX k={k}: {took:.2?}; replicated/server {:?}; halo rows intra {} inter {}; \
             max n_local {}; estimate {} MiB max/device",
            s.replicated_per_server,
            s.halo_rows.intra_server,
            s.halo_rows.inter_server,
            s.max_n_local,
            e.max_bytes >> 20
        );
    }
    let budget = 512u64 << 20;
    let t = Instant::now();
    match ctx.choose_k(&dims, budget) {
        Ok(c) => println!("choose_k(512 MiB): {} in {:.2?}", c.reason, t.elapsed()),
        Err(e) => println!("choose_k(512 MiB): error: {e}"),
    }
}
