//! Cooperative batching against the per-GPU baseline on a power-law graph, resampling, and
//! the `--mode auto` decision.

use grandis_masking::{
    estimate_masked, InputCopy, Layout, ModelDims, PlanContext, SplitMembership,
};
use grandis_sampling::{
    cob_epoch_stats, cob_plan, largest_cobatch, mb_epoch_stats, mb_plans, round_for_epoch,
    sample_stats, CoBatcher, Eas, Exact, Fanout, MiniBatcher, Priority,
};
use grandis_synth::{generate_in_memory, SynthConfig};

fn dataset(nodes: u64) -> grandis_store::InMemoryDataset {
    generate_in_memory(&SynthConfig {
        nodes,
        avg_degree: 10.0,
        features: 4,
        classes: 3,
        seed: 5,
        ..Default::default()
    })
    .unwrap()
}

fn ctx(ds: &grandis_store::InMemoryDataset) -> PlanContext<'_> {
    let v = ds.view();
    let n = v.graph.num_vertices();
    let layout = Layout::even(n as u32, 2, 2).unwrap();
    let splits = SplitMembership::from_lists(n, v.train, v.val, v.test).unwrap();
    PlanContext::new(v.graph, layout, splits).unwrap()
}

/// Mini-batches of edges: every supervision edge once per epoch, on the rank that owns its
/// source, at most the batch size per rank, reshuffled each epoch; a source outside the
/// graph is an error naming the edge.
#[test]
fn edge_batches_deal_each_edge_once_an_epoch_to_its_sources_rank() {
    let ds = dataset(400);
    let cx = ctx(&ds);
    let layout = cx.layout();
    let sources: Vec<u32> = (0..1000u32).map(|i| (i * 7919) % 400).collect();
    let mb = MiniBatcher::for_edges(&cx, &sources, 50, 3).unwrap();
    let most = (0..4)
        .map(|r| {
            let range = layout.range(r);
            sources.iter().filter(|s| range.contains(s)).count()
        })
        .max()
        .unwrap();
    assert_eq!(mb.iterations(), most.div_ceil(50));
    let mut firsts = Vec::new();
    for epoch in 0..2 {
        let mut seen = vec![0u32; sources.len()];
        for it in 0..mb.iterations() {
            let batch = mb.batch(epoch, it).unwrap();
            for (rank, edges) in batch.iter().enumerate() {
                assert!(edges.len() <= 50);
                for &e in edges {
                    seen[e as usize] += 1;
                    assert_eq!(layout.owner(sources[e as usize]), rank, "edge {e}");
                }
            }
            if it == 0 {
                firsts.push(batch);
            }
        }
        assert!(seen.iter().all(|&c| c == 1), "epoch {epoch}");
    }
    assert_ne!(firsts[0], firsts[1], "reshuffled each epoch");
    let e = MiniBatcher::for_edges(&cx, &[3, 400], 50, 3)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("supervision edge 1: source 400 is not a vertex"),
        "{e}"
    );
}

#[test]
fn server_wise_mfg_computes_less_than_per_device_mfgs() {
    let ds = dataset(3000);
    let cx = ctx(&ds);
    let mb = MiniBatcher::new(&cx, 32, 1).unwrap();
    let per_rank = mb.batch(0, 0).unwrap();
    // The co-batch of a server = the union of its devices' mini-batches: same targets.
    let co: Vec<Vec<u32>> = (0..2)
        .map(|s| {
            let mut t: Vec<u32> = per_rank[s * 2..s * 2 + 2].concat();
            t.sort_unstable();
            t
        })
        .collect();
    for layers in [2, 3] {
        let mb_plans = mb_plans(&cx, &per_rank, layers, &Exact, 0).unwrap();
        let mb_work: u64 = mb_plans.iter().flat_map(|p| p.computed_rows(layers)).sum();
        let cob = cob_plan(&cx, &co, layers, &Exact, 0).unwrap();
        let cob_work = sample_stats(&cx, &cob).computed_vertex_layers;
        assert!(
            cob_work < mb_work,
            "{layers} layers: CoB computes {cob_work} vertex-layers, MB {mb_work}"
        );
        // Same targets at the last layer.
        let last: u64 = mb_plans
            .iter()
            .map(|p| p.valid_owned(layers - 1).len() as u64)
            .sum();
        assert_eq!(last, co.iter().map(|t| t.len() as u64).sum::<u64>());
    }
    // Epoch counters agree with the per-plan counts and cover the train set.
    let fan = Fanout::new(vec![5, 3], 2).unwrap();
    let dims = ModelDims {
        layers: 2,
        features: 4,
        hidden: 8,
        classes: 3,
        input_copy: InputCopy::None,
        attention: None,
        link_embedding_values: 0,
        relations: 0,
    };
    let cob = CoBatcher::new(&cx, 64, 1).unwrap();
    let e = cob_epoch_stats(&cx, &cob, 2, &fan, Some(&dims), 0).unwrap();
    assert_eq!(e.targets, ds.view().train.len() as u64);
    assert_eq!(e.computed_vertices_per_layer[1], e.targets);
    assert!(e.peak_bytes > 0);
    let m = mb_epoch_stats(
        &cx,
        &MiniBatcher::new(&cx, 16, 1).unwrap(),
        2,
        &fan,
        Some(&dims),
        0,
    )
    .unwrap();
    assert_eq!(m.targets, e.targets);
}

#[test]
fn resampling_changes_the_sample_and_rounds_are_reproducible() {
    let ds = dataset(2000);
    let cx = ctx(&ds);
    for priority in [Priority::Degree, Priority::Uniform] {
        let eas = Eas::new(1, 2, priority, 3).unwrap();
        let a = eas.flx_plan(&cx, 2, round_for_epoch(0, Some(2))).unwrap();
        let b = eas.flx_plan(&cx, 2, round_for_epoch(1, Some(2))).unwrap();
        let c = eas.flx_plan(&cx, 2, round_for_epoch(2, Some(2))).unwrap();
        assert_eq!(a, b, "epochs 0 and 1 share a sampling round");
        assert_ne!(a, c, "{priority:?}: epoch 2 must resample");
        // Sampling reduces the replicated set against the exact FLX plan.
        let exact = cx.flx_plan(2).unwrap();
        let rep =
            |p: &grandis_masking::FlxPlan| p.servers.iter().map(|s| s.replicated).sum::<usize>();
        assert!(rep(&a) < rep(&exact));
    }
    assert_eq!(round_for_epoch(7, None), 0);
}

#[test]
fn the_largest_cobatch_that_fits_is_maximal() {
    let ds = dataset(1500);
    let cx = ctx(&ds);
    let dims = ModelDims {
        layers: 2,
        features: 4,
        hidden: 16,
        classes: 3,
        input_copy: InputCopy::None,
        attention: None,
        link_embedding_values: 0,
        relations: 0,
    };
    let est = |b: usize| {
        let batcher = CoBatcher::new(&cx, b, 0).unwrap();
        estimate_masked(
            &dims,
            &cob_plan(&cx, &batcher.batch(0, 0).unwrap(), 2, &Exact, 0).unwrap(),
        )
        .max_bytes
    };
    // A budget that holds every co-batch: the whole train set of a server.
    let all = largest_cobatch(&cx, &dims, u64::MAX, &Exact, 0).unwrap();
    assert_eq!(all.batch_size, all.max_batch);
    // Half of plain FB: the chosen size fits and one more does not.
    let fb = cx.choose_k(&dims, u64::MAX).unwrap().estimates[0].max_bytes;
    let budget = fb / 2;
    let fit = largest_cobatch(&cx, &dims, budget, &Exact, 0).unwrap();
    assert!(fit.batch_size < fit.max_batch, "{fit:?}");
    assert!(fit.estimate_bytes <= budget, "{fit:?}");
    assert_eq!(est(fit.batch_size), fit.estimate_bytes);
    assert!(est(fit.batch_size + 1) > budget, "{fit:?}");
    let e = largest_cobatch(&cx, &dims, 10, &Exact, 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("even a co-batch of 1"), "{e}");
}
