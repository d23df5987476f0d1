//! SANCUS's staleness-bounded exchange (the job's `staleness`): a bound of 0 skips only
//! rows that did not change, so the run equals the exact one value for value; a loose bound
//! skips sends between servers, and every byte not sent is accounted for against the plan's
//! prediction; traffic inside servers never changes.

mod common;

use common::*;
use grandis_models::ModelKind;
use grandis_parallel::{JobSpec, Machine, Mode, ParallelOptions, ParallelReport, PartitionedGraph};
use grandis_wire::Staleness;

fn run(
    part: &PartitionedGraph,
    view: grandis_store::DatasetView<'_>,
    kind: ModelKind,
    mode: Mode,
    k: Option<usize>,
    staleness: Option<Staleness>,
) -> anyhow::Result<ParallelReport> {
    let config = config(&view, kind, 2);
    let popts = ParallelOptions {
        job: JobSpec {
            mode,
            preload_hops: k.map(|k| k as u32),
            batch_size: mode.is_mini_batch().then_some(12),
            staleness,
            ..JobSpec::default()
        },
        machine: Machine {
            threads_per_rank: Some(1),
            collect_logits: true,
            ..Machine::default()
        },
    };
    grandis_parallel::train(view, part, config, &opts(6), &popts, &mut |_| {})
}

fn losses(r: &ParallelReport) -> Vec<f64> {
    r.train.epochs.iter().map(|s| s.loss).collect()
}

#[test]
fn a_zero_bound_skips_only_unchanged_rows_and_changes_nothing() {
    let (ds, part) = random_case(21, 80, 320, 6, 3, 2, 2);
    let view = ds.view();
    // (model, mode, k, whether some layer's rows between servers never change).
    for (kind, mode, k, constant_rows) in [
        // Layer 0 exchanges the input features: constant, so they go once.
        (ModelKind::Sage, Mode::Fb, None, true),
        (ModelKind::Gcn, Mode::Fb, None, true),
        // FLX preloads layer 0; layer 1's rows change every epoch.
        (ModelKind::Gcn, Mode::Flx, Some(1), false),
        // Its layer 0 reads the encoder's output, which changes every epoch.
        (ModelKind::ResSage, Mode::Fb, None, false),
    ] {
        let what = format!("{kind:?} {mode:?} k={k:?}");
        let exact = run(&part, view, kind, mode, k, None).unwrap();
        let zero = Staleness {
            bound: 0.0,
            max_skips: 100,
        };
        let r = run(&part, view, kind, mode, k, Some(zero)).unwrap();
        assert_eq!(losses(&r), losses(&exact), "{what}");
        assert_eq!(r.logits, exact.logits, "{what}");
        let st = r
            .execution
            .staleness
            .expect("a run with staleness reports it");
        assert!(st.sends > 0, "{what}");
        assert_eq!(st.skips > 0, constant_rows, "{what}: {st:?}");
        assert_eq!(
            st.saved_bytes_per_epoch > 0,
            constant_rows,
            "{what}: {st:?}"
        );
        assert_eq!(
            r.execution.halo_bytes_per_epoch.intra_server,
            exact.execution.halo_bytes_per_epoch.intra_server,
            "{what}: traffic inside servers is never stale"
        );
    }
}

#[test]
fn a_loose_bound_skips_sends_between_servers_and_accounts_for_every_byte() {
    let (ds, part) = random_case(22, 80, 320, 6, 3, 2, 2);
    let view = ds.view();
    let exact = run(&part, view, ModelKind::Sage, Mode::Fb, None, None).unwrap();
    let loose = Staleness {
        bound: 10.0,
        max_skips: 2,
    };
    let r = run(&part, view, ModelKind::Sage, Mode::Fb, None, Some(loose)).unwrap();
    let st = r.execution.staleness.unwrap();
    // Nothing moves by 1000%: every pair sends once, skips twice, sends again... over 6
    // epochs: sent in epochs 1 and 4, skipped in 2, 3, 5, 6.
    assert_eq!(st.skips, 2 * st.sends, "{st:?}");
    assert!(
        r.execution.halo_bytes_per_epoch.inter_server
            < exact.execution.halo_bytes_per_epoch.inter_server
    );
    // Counted + not sent = the plan's prediction (per-epoch figures are rounded down).
    let predicted = r.execution.predicted_halo_bytes_per_epoch.inter_server;
    let accounted = r.execution.halo_bytes_per_epoch.inter_server + st.saved_bytes_per_epoch;
    assert!(
        accounted <= predicted && predicted - accounted <= 1,
        "counted {} + saved {} vs predicted {predicted}",
        r.execution.halo_bytes_per_epoch.inter_server,
        st.saved_bytes_per_epoch
    );
    assert_eq!(
        exact.execution.halo_bytes_per_epoch.inter_server, predicted,
        "the exact run sends the prediction"
    );
    assert_eq!(
        r.execution.halo_bytes_per_epoch.intra_server,
        exact.execution.halo_bytes_per_epoch.intra_server
    );
    assert!(losses(&r).iter().all(|l| l.is_finite()));
    // The first epoch sends everything, so it is the exact run's.
    assert_eq!(losses(&r)[0], losses(&exact)[0]);
}
