//! The performance model's counts against what runs measure: for every candidate the planner
//! considers on a fixed small case, the halo and fetch bytes it predicts per link class and
//! the vertex-layers it counts are exactly what one epoch of that candidate moves and
//! computes (counts, not seconds: a test of the model that cannot flake on a busy machine).

mod common;

use common::{config, opts, random_dataset, random_partition};
use grandis_models::ModelKind;
use grandis_parallel::planner::{candidates, plan, Rates};
use grandis_parallel::{ParallelOptions, Sampling};
use grandis_wire::{ComputeRate, LinkRate};

#[test]
fn predicted_counts_are_what_every_candidate_moves_and_computes() {
    let ds = random_dataset(21, 400, 2400, 8, 4);
    let view = ds.view();
    let part = random_partition(&view, 2, 2, 3);
    let cfg = config(&view, ModelKind::Sage, 2);
    let train = opts(1);
    let base = ParallelOptions {
        threads_per_rank: Some(1),
        device_memory: Some(1 << 30),
        ..Default::default()
    };
    let rates = Rates {
        compute: ComputeRate {
            gemm_flops_per_s: 1e9,
            aggregation_edge_cols_per_s: 1e9,
            aggregation_uncached_edge_cols_per_s: 2e8,
            width: 8,
        },
        intra: LinkRate {
            bandwidth_bytes_per_s: 1e9,
            latency_s: 1e-5,
        },
        inter: LinkRate {
            bandwidth_bytes_per_s: 1e8,
            latency_s: 1e-4,
        },
        contention: 1.0,
        calibration: 1.0,
        shared_cores: None,
    };
    let sampling = Sampling::Fanout {
        fanouts: vec![3, 3],
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
    let planned = plan(view, &part, &cfg, train.seed, &base, &cands, &rates).unwrap();
    for p in &planned {
        let what = &p.name;
        let pred = p
            .prediction
            .as_ref()
            .unwrap_or_else(|| panic!("{what}: {:?}", p.error));
        assert!(p.fits, "{what}");
        assert!(pred.epoch_s > 0.0, "{what}: {pred:?}");
        let r = grandis_parallel::train(
            view,
            &part,
            cfg.clone(),
            &train,
            &p.candidate.options(&base),
            &mut |_| {},
        )
        .unwrap_or_else(|e| panic!("{what}: {e:#}"));
        assert_eq!(
            pred.halo_bytes, r.halo_bytes_per_epoch,
            "{what}: halo bytes"
        );
        assert_eq!(
            pred.fetch_bytes, r.fetch_bytes_per_epoch,
            "{what}: fetched bytes"
        );
        assert_eq!(
            pred.computed_vertex_layers, r.computed_vertex_layers,
            "{what}: vertex-layers"
        );
        let setup = r.setup_fetch_bytes.inter_server + r.setup_fetch_bytes.intra_server;
        assert_eq!(pred.setup_fetch_bytes, setup, "{what}: setup fetch");
    }
}
