//! GraphTheta's cluster batches (`Mode::Cluster`): a batch that holds every cluster is the
//! whole graph, so the run equals the single-process trainer (the exactness property every
//! mode keeps); smaller batches compute only the vertices of their clusters, deterministically;
//! other sampling is refused.

mod common;

use common::*;
use grandis_models::ModelKind;
use grandis_parallel::{
    JobSpec, Machine, Mode, ParallelOptions, ParallelReport, PartitionedGraph, Sampling,
};

fn run(
    view: grandis_store::DatasetView<'_>,
    part: &PartitionedGraph,
    kind: ModelKind,
    batch: usize,
    sampling: Sampling,
) -> anyhow::Result<ParallelReport> {
    let popts = ParallelOptions {
        job: JobSpec {
            mode: Mode::Cluster,
            batch_size: Some(batch as u32),
            sampling,
            ..JobSpec::default()
        },
        machine: Machine {
            threads_per_rank: Some(1),
            collect_logits: true,
            ..Machine::default()
        },
    };
    grandis_parallel::train(
        view,
        part,
        config(&view, kind, 2),
        &opts(3),
        &popts,
        &mut |_| {},
    )
}

#[test]
fn one_batch_of_every_cluster_is_the_exact_full_graph_run() {
    let (ds, part) = random_case(41, 70, 280, 5, 3, 2, 2);
    let view = ds.view();
    for kind in [ModelKind::Sage, ModelKind::Gcn, ModelKind::Gat] {
        let config = config(&view, kind, 2);
        let reference = single(view, &config, &opts(3));
        // A batch as large as the graph: each server's clusters all fit in one batch.
        let r = run(view, &part, kind, 1024, Sampling::None).unwrap();
        assert_eq!(r.execution.iterations_per_epoch, 1, "{kind:?}");
        let losses: Vec<f64> = r.train.epochs.iter().map(|s| s.loss).collect();
        assert_losses(&format!("cluster {kind:?}"), &losses, &reference.0, 1e-4);
        assert_close(
            &format!("cluster {kind:?}"),
            r.logits.as_ref().unwrap(),
            &reference.1,
            1e-4,
        );
    }
}

#[test]
fn small_batches_compute_only_their_clusters() {
    let (ds, part) = random_case(42, 120, 480, 5, 3, 2, 1);
    let view = ds.view();
    // Clusters of 16 / 8 = 2 vertices, 8 per server per iteration.
    let a = run(view, &part, ModelKind::Sage, 16, Sampling::None).unwrap();
    let b = run(view, &part, ModelKind::Sage, 16, Sampling::None).unwrap();
    let losses =
        |r: &ParallelReport| -> Vec<f64> { r.train.epochs.iter().map(|s| s.loss).collect() };
    assert_eq!(losses(&a), losses(&b), "deterministic");
    assert!(losses(&a).iter().all(|l| l.is_finite()));
    assert!(a.execution.iterations_per_epoch > 1);
    assert!(
        a.execution.sampling.starts_with("cluster("),
        "{}",
        a.execution.sampling
    );
    // Every vertex of every batch is computed at both layers (a full convolution on the
    // batch), so an epoch computes at least every vertex twice and, with restricted
    // neighbourhoods, far fewer edges than the whole graph has per iteration.
    assert!(
        a.execution.computed_vertex_layers >= 2 * 120,
        "{}",
        a.execution.computed_vertex_layers
    );
    let full_edges = 2 * view.graph.num_edges() as u64 * a.execution.iterations_per_epoch as u64;
    let aggregated: u64 = a.execution.aggregated_edges_per_layer.iter().sum();
    assert!(aggregated < full_edges / 2, "{aggregated} of {full_edges}");
}

#[test]
fn cluster_batches_refuse_other_sampling() {
    let (ds, part) = random_case(43, 60, 200, 4, 3, 2, 1);
    let view = ds.view();
    let e = run(
        view,
        &part,
        ModelKind::Sage,
        16,
        Sampling::Fanout {
            fanouts: vec![3],
            relation_fanouts: Default::default(),
        },
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("cluster"), "{e:#}");
}
