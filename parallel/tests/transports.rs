//! The device transports (`grandis_parallel::links`) on CPU ranks: device copies, and NCCL's
//! call sequence on host buffers inside servers and between them, give every mode the fabric's
//! run value for value (they sum the weight gradients in the fabric's order) and the same bytes
//! per link class, layer and phase in the counters. On a GPU the same code runs with real NCCL
//! (`scripts/gpu-check.sh ranks`).

mod common;

use common::*;
use grandis_models::ModelKind;
use grandis_parallel::links::IntraTransport;
use grandis_parallel::{
    JobSpec, Machine, Mode, ParallelOptions, ParallelReport, PartitionedGraph, Sampling,
};
use grandis_wire::InterTransport;

fn run(
    part: &PartitionedGraph,
    view: grandis_store::DatasetView<'_>,
    kind: ModelKind,
    mode: Mode,
    k: Option<usize>,
    sampling: Sampling,
    transports: Option<(IntraTransport, InterTransport)>,
) -> ParallelReport {
    let config = config(&view, kind, 2);
    let popts = ParallelOptions {
        job: JobSpec {
            mode,
            preload_hops: k.map(|k| k as u32),
            batch_size: mode.is_mini_batch().then_some(12),
            sampling,
            inter_transport: transports.map_or(InterTransport::Quic, |t| t.1),
            ..JobSpec::default()
        },
        machine: Machine {
            threads_per_rank: Some(1),
            collect_logits: true,
            intra_transport: transports.map(|t| t.0),
            ..Machine::default()
        },
    };
    grandis_parallel::train(view, part, config, &opts(3), &popts, &mut |_| {})
        .unwrap_or_else(|e| panic!("{mode:?} k={k:?} over {transports:?}: {e:#}"))
}

#[test]
fn device_transports_equal_the_fabric_in_every_mode() {
    let (ds, part) = random_case(11, 80, 320, 6, 3, 2, 2);
    let view = ds.view();
    let eas = Sampling::Eas {
        hops: 1,
        fanout: 2,
        priority: Default::default(),
    };
    let eas_cob = eas.clone();
    let cases = [
        (ModelKind::Sage, Mode::Fb, None, Sampling::None),
        (ModelKind::Gat, Mode::Fb, None, Sampling::None),
        (ModelKind::Sage, Mode::Flx, Some(0), Sampling::None),
        (ModelKind::ResSage, Mode::Flx, Some(1), Sampling::None),
        (ModelKind::Gcn, Mode::Flx, Some(2), Sampling::None),
        (ModelKind::Sage, Mode::Flx, Some(1), eas),
        (ModelKind::Sage, Mode::Cob, None, Sampling::None),
        (ModelKind::Gat, Mode::Cob, None, eas_cob),
        (ModelKind::Sage, Mode::Mb, None, Sampling::None),
    ];
    for (kind, mode, k, sampling) in cases {
        let fabric = run(&part, view, kind, mode, k, sampling.clone(), None);
        for transports in [
            (IntraTransport::DeviceCopies, InterTransport::Quic),
            (IntraTransport::NcclOnHost, InterTransport::Quic),
            (IntraTransport::NcclOnHost, InterTransport::Nccl),
        ] {
            let what = format!("{kind:?} {mode:?} k={k:?} {sampling:?} over {transports:?}");
            let r = run(
                &part,
                view,
                kind,
                mode,
                k,
                sampling.clone(),
                Some(transports),
            );
            let losses = |r: &ParallelReport| -> Vec<f64> {
                r.train.epochs.iter().map(|s| s.loss).collect()
            };
            assert_eq!(losses(&r), losses(&fabric), "{what}: losses");
            assert_eq!(r.logits, fabric.logits, "{what}: logits");
            for (name, got, want) in [
                (
                    "halo",
                    r.execution.halo_bytes_per_epoch,
                    fabric.execution.halo_bytes_per_epoch,
                ),
                (
                    "forward",
                    r.execution.forward_bytes_per_epoch,
                    fabric.execution.forward_bytes_per_epoch,
                ),
                (
                    "backward",
                    r.execution.backward_bytes_per_epoch,
                    fabric.execution.backward_bytes_per_epoch,
                ),
                (
                    "all-reduce",
                    r.execution.all_reduce_bytes_per_epoch,
                    fabric.execution.all_reduce_bytes_per_epoch,
                ),
            ] {
                assert_eq!(got, want, "{what}: {name} bytes per epoch");
            }
            // The fabric's own checks hold the counters to the plans' prediction where plans
            // predict them (not for FLX-EAS, whose samples change); the device transports'
            // counters must meet the same prediction.
            if fabric.execution.predicted_halo_bytes_per_epoch
                == fabric.execution.halo_bytes_per_epoch
            {
                assert_eq!(
                    r.execution.predicted_halo_bytes_per_epoch, r.execution.halo_bytes_per_epoch,
                    "{what}: halo bytes against the plans' prediction"
                );
            }
        }
    }
}

#[test]
fn a_transport_that_cannot_serve_the_job_is_refused() {
    let (ds, part) = random_case(5, 30, 90, 4, 2, 2, 2);
    let view = ds.view();
    let config = config(&view, ModelKind::Sage, 2);
    for (intra, inter, want) in [
        (
            None,
            InterTransport::Nccl,
            "inter_transport nccl needs NCCL inside every server",
        ),
        (
            Some(IntraTransport::Nccl),
            InterTransport::Quic,
            "needs CUDA ranks",
        ),
        (
            Some(IntraTransport::DeviceCopies),
            InterTransport::Nccl,
            "inter_transport nccl needs NCCL inside every server",
        ),
    ] {
        let popts = ParallelOptions {
            job: JobSpec {
                mode: Mode::Fb,
                inter_transport: inter,
                ..JobSpec::default()
            },
            machine: Machine {
                threads_per_rank: Some(1),
                intra_transport: intra,
                ..Machine::default()
            },
        };
        let err =
            grandis_parallel::train(view, &part, config.clone(), &opts(1), &popts, &mut |_| {})
                .expect_err("an impossible transport must be refused");
        assert!(format!("{err:#}").contains(want), "{err:#}");
    }
}
