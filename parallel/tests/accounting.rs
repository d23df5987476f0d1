//! Byte accounting and memory: the fabric's measured per-epoch halo bytes equal the masking
//! plan's predictions per link class; FLX with k = L sends no inter-server halo bytes; the
//! metered per-rank memory stays within a small factor of the memory model.

mod common;

use common::*;
use grandis_masking::{ModelDims, PlanContext, SplitMembership};
use grandis_models::ModelKind;
use grandis_parallel::{model_dims, Mode};

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
        fi += b.intra;
        fe += b.inter;
        if l > 0 || backward_at_0 {
            bi += b.intra;
            be += b.inter;
        }
    }
    (fi, fe, bi, be)
}

#[test]
fn measured_bytes_equal_plan_predictions() {
    let ds = random_dataset(9, 80, 400, 6, 3);
    let view = ds.view();
    let part = random_partition(&view, 2, 2, 9);
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
                r.forward_bytes_per_epoch.intra_server, fi,
                "{what} forward intra"
            );
            assert_eq!(
                r.forward_bytes_per_epoch.inter_server, fe,
                "{what} forward inter"
            );
            assert_eq!(
                r.backward_bytes_per_epoch.intra_server, bi,
                "{what} backward intra"
            );
            assert_eq!(
                r.backward_bytes_per_epoch.inter_server, be,
                "{what} backward inter"
            );
            assert_eq!(
                r.halo_bytes_per_epoch, r.predicted_halo_bytes_per_epoch,
                "{what}"
            );
            if k == layers {
                assert_eq!(r.halo_bytes_per_epoch.inter_server, 0, "{what}: k = L");
            }
            if k == 0 {
                assert!(
                    fe > 0,
                    "{what}: the random layout must cut inter-server edges"
                );
            }
            // The all-reduce moves the parameters: G - 1 device buffers to the head and back per
            // server, and 2 (S - 1) / S of the buffer per head between servers.
            let p = r.train.num_parameters as u64 * 4;
            assert_eq!(
                r.all_reduce_bytes_per_epoch.intra_server,
                2 * 2 * p,
                "{what}"
            );
            assert_eq!(r.all_reduce_bytes_per_epoch.inter_server, 2 * p, "{what}");
        }
    }
}

#[test]
fn flx_reduces_inter_server_bytes_monotonically() {
    let ds = random_dataset(5, 120, 500, 4, 3);
    let view = ds.view();
    let part = random_partition(&view, 2, 2, 5);
    let config = config(&view, ModelKind::Sage, 3);
    let opts = opts(1);
    let inter: Vec<u64> = (0..=3)
        .map(|k| {
            let mode = if k == 0 { Mode::Fb } else { Mode::Flx };
            parallel(view, &part, &config, &opts, mode, Some(k).filter(|_| k > 0))
                .unwrap()
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
    let ds = random_dataset(11, 400, 2400, 32, 4);
    let view = ds.view();
    let part = random_partition(&view, 2, 2, 11);
    let mut config = config(&view, ModelKind::Sage, 3);
    config.hidden = 32;
    let opts = opts(2);
    let mut peaks = Vec::new();
    for k in 0..=3 {
        let mode = if k == 0 { Mode::Fb } else { Mode::Flx };
        let r = parallel(view, &part, &config, &opts, mode, Some(k).filter(|_| k > 0)).unwrap();
        for m in &r.memory {
            let ratio = m.measured_peak_bytes as f64 / m.model_bytes as f64;
            eprintln!(
                "k={k} rank {}: measured peak {} B, model {} B, ratio {ratio:.2}",
                m.rank, m.measured_peak_bytes, m.model_bytes
            );
            assert!(
                (0.5..=2.5).contains(&ratio),
                "k={k} rank {}: measured/model = {ratio:.2}",
                m.rank
            );
        }
        peaks.push(
            r.memory
                .iter()
                .map(|m| m.measured_peak_bytes)
                .max()
                .unwrap(),
        );
    }
    // k = 1 holds both plans' graphs and the extracted rows; FB holds the fewest rows. (No
    // full monotonicity: at k = L the runner never uploads the FB graph, the model counts it.)
    assert!(peaks[1] > peaks[0], "peaks by k: {peaks:?}");
}
