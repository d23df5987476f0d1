//! Computed vertex-layers and memory estimates per epoch: cooperative batching (CoB, one MFG
//! per server spread over its devices) against the per-GPU mini-batch baseline (MB, one MFG per
//! device), on a synthetic power-law graph partitioned with METIS into 2 servers x 2 devices.
//! Usage:
//! `cargo run --release -p grandis-sampling --example cob_vs_mb -- [nodes] [avg_degree] [b] [method]`
//! (defaults 200000 20 1024 metis; method = metis | random). Model: 3 layers, F = 128,
//! H = 256, C = 8; sampling GraphSAGE fanouts 25,10,5 (hop 1 first) unless stated.

use std::time::Instant;

use grandis_masking::{InputCopy, Layout, ModelDims, PlanContext, SplitMembership};
use grandis_partition::{assign, relabel, PartitionConfig, PartitionMethod};
use grandis_sampling::{
    cob_epoch_stats, largest_cobatch, mb_epoch_stats, sample_stats, CoBatcher, Eas, EpochStats,
    Fanout, MiniBatcher, Sampler,
};
use grandis_store::EdgeOptions;
use grandis_synth::{generate_in_memory, SynthConfig};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: u64| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let nodes = arg(1, 200_000);
    let degree = arg(2, 20) as f64;
    let b = arg(3, 1024) as usize;
    let method: PartitionMethod = args
        .get(4)
        .map_or("metis", |s| s.as_str())
        .parse()
        .expect("method");
    let (servers, devices) = (2u32, 2u32);

    let t = Instant::now();
    let ds = generate_in_memory(&SynthConfig {
        nodes,
        avg_degree: degree,
        features: 8,
        classes: 8,
        seed: 0,
        ..Default::default()
    })
    .expect("synth");
    let view = ds.view();
    println!(
        "graph: {nodes} vertices, {} edges, {} train (synth in {:.1?})",
        view.graph.num_edges(),
        view.train.len(),
        t.elapsed()
    );
    let t = Instant::now();
    let cfg = PartitionConfig {
        servers,
        devices,
        method,
        ..Default::default()
    };
    let a = assign(&view, true, &cfg).expect("partition");
    let r = relabel(&a, servers, devices);
    let g = view.graph;
    let o2n = &r.old_to_new;
    let edges = (0..nodes as u32).flat_map(|v| {
        g.neighbors(v)
            .iter()
            .map(move |&u| (o2n[u as usize], o2n[v as usize]))
    });
    let graph =
        grandis_store::graph_from_edges(nodes, edges, EdgeOptions::default()).expect("relabel");
    let train = r.map_sorted(view.train);
    let bounds: Vec<u32> = r.starts.iter().map(|&s| s as u32).collect();
    let layout = Layout::from_bounds(servers as usize, devices as usize, &bounds).expect("layout");
    let splits = SplitMembership::from_lists(nodes as usize, &train, &[], &[]).expect("splits");
    let ctx = PlanContext::new(graph.view(), layout, splits).expect("context");
    println!(
        "{method} partition + relabel + context: {:.1?}",
        t.elapsed()
    );

    let dims = ModelDims {
        layers: 3,
        features: 128,
        hidden: 256,
        classes: 8,
        input_copy: InputCopy::None,
        attention: None,
        link_embedding_values: 0,
        relations: 0,
    };
    let sage = Fanout::new(vec![25, 10, 5], 1).expect("fanouts");
    let eas = Eas::paper_default(1);
    let mib = |x: u64| x as f64 / (1u64 << 20) as f64;
    let row = |e: &EpochStats, secs: f64| {
        println!(
            "{:>4} {:<22} B={:<6} iters={:<4} mfgs={:<4} computed/layer={:?} total={:<10} edges={:<11} peak={:.1} MiB ({secs:.1}s)",
            e.mode,
            e.sampler,
            e.batch_size,
            e.iterations,
            e.mfgs,
            e.computed_vertices_per_layer,
            e.computed_vertex_layers,
            e.aggregated_edges_per_layer.iter().sum::<u64>(),
            mib(e.peak_bytes)
        )
    };

    let t = Instant::now();
    let mb = mb_epoch_stats(
        &ctx,
        &MiniBatcher::new(&ctx, b, 1).expect("mb"),
        3,
        &sage,
        Some(&dims),
        0,
    )
    .expect("mb epoch");
    row(&mb, t.elapsed().as_secs_f64());
    let g_count = devices as usize;
    let runs: Vec<(usize, &dyn Sampler)> = vec![
        (g_count * b, &sage),
        (4 * g_count * b, &sage),
        (16 * g_count * b, &sage),
        (g_count * b, &eas),
        (16 * g_count * b, &eas),
    ];
    for (batch, sampler) in runs {
        let t = Instant::now();
        let cob = cob_epoch_stats(
            &ctx,
            &CoBatcher::new(&ctx, batch, 1).expect("cob"),
            3,
            sampler,
            Some(&dims),
            0,
        )
        .expect("cob epoch");
        row(&cob, t.elapsed().as_secs_f64());
        println!(
            "     MB / CoB computed vertex-layers = {:.2}x, aggregated edges = {:.2}x",
            mb.computed_vertex_layers as f64 / cob.computed_vertex_layers as f64,
            mb.aggregated_edges_per_layer.iter().sum::<u64>() as f64
                / cob.aggregated_edges_per_layer.iter().sum::<u64>() as f64
        );
    }

    let t = Instant::now();
    let flx_eas = eas.flx_plan(&ctx, 3, 0).expect("flx-eas");
    let exact = ctx.flx_plan(3).expect("flx");
    let s = sample_stats(&ctx, &flx_eas);
    let se = sample_stats(&ctx, &exact);
    println!(
        "FLX k=3 exact: replicated {:?}, computed/layer {:?}, beta {:.3?}",
        exact
            .servers
            .iter()
            .map(|x| x.replicated)
            .collect::<Vec<_>>(),
        se.computed_vertices_per_layer,
        se.boundary_ratio
    );
    println!(
        "FLX-EAS k=3 {}: replicated {:?}, computed/layer {:?}, sampled edges {} (exact {}), beta {:.3?} ({:.1?})",
        eas.name(),
        flx_eas.servers.iter().map(|x| x.replicated).collect::<Vec<_>>(),
        s.computed_vertices_per_layer,
        s.sampled_edges,
        se.sampled_edges,
        s.boundary_ratio,
        t.elapsed()
    );
    for budget_mib in [8192u64, 1024, 256] {
        let t = Instant::now();
        match largest_cobatch(&ctx, &dims, budget_mib << 20, &sage, 1) {
            Ok(fit) => println!(
                "budget {budget_mib} MiB/device: co-batch {} of at most {} ({} bytes on rank {}; \
                 {:.1?})",
                fit.batch_size,
                fit.max_batch,
                fit.estimate_bytes,
                fit.worst_rank,
                t.elapsed()
            ),
            Err(e) => println!("budget {budget_mib} MiB/device: {e}"),
        }
    }
}
