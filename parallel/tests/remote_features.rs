//! DGS's feature-level sampling of remote vertices (the job's `remote_features`): the
//! first epoch fetches whole rows (no trained weights to rank columns by yet) and equals the
//! exact run; from the second on, every row fetched from another server carries exactly
//! `ceil(fraction · F)` columns, so each epoch's fetched bytes are the exact run's times
//! `k / F` (the batches are the same: same seed).

mod common;

use common::*;
use grandis_fabric::{Direction, LinkClass, Phase};
use grandis_models::ModelKind;
use grandis_parallel::{JobSpec, Machine, Mode, ParallelOptions, ParallelReport, Sampling};

fn run(
    view: grandis_store::DatasetView<'_>,
    part: &grandis_parallel::PartitionedGraph,
    mode: Mode,
    remote_features: Option<f64>,
) -> anyhow::Result<ParallelReport> {
    let config = config(&view, ModelKind::Sage, 2);
    let popts = ParallelOptions {
        job: JobSpec {
            mode,
            batch_size: mode.is_mini_batch().then_some(10),
            sampling: match mode {
                Mode::Mb => Sampling::Fanout {
                    fanouts: vec![4, 3],
                    relation_fanouts: Default::default(),
                },
                _ => Sampling::None,
            },
            remote_features,
            ..JobSpec::default()
        },
        machine: Machine {
            threads_per_rank: Some(1),
            ..Machine::default()
        },
    };
    grandis_parallel::train(view, part, config, &opts(4), &popts, &mut |_| {})
}

/// Inter-server fetch bytes sent in training epoch `epoch`.
fn fetched(r: &ParallelReport, epoch: u32) -> u64 {
    r.counters
        .epochs
        .iter()
        .filter(|e| e.epoch == epoch)
        .map(|e| {
            e.bytes_where(Direction::Sent, |l| {
                l.phase == Phase::Fetch && l.class == LinkClass::InterServer
            })
        })
        .sum()
}

#[test]
fn remote_rows_carry_the_chosen_fraction_of_columns() {
    let f = 8u64;
    let (ds, part) = random_case(31, 90, 360, f as usize, 3, 2, 2);
    let view = ds.view();
    for mode in [Mode::Mb, Mode::Cob] {
        let exact = run(view, &part, mode, None).unwrap();
        // ceil(0.3 * 8) = 3 columns.
        let r = run(view, &part, mode, Some(0.3)).unwrap();
        let k = 3u64;
        let losses =
            |r: &ParallelReport| -> Vec<f64> { r.train.epochs.iter().map(|s| s.loss).collect() };
        assert_eq!(
            losses(&r)[0],
            losses(&exact)[0],
            "{mode:?}: epoch 1 is exact"
        );
        assert!(losses(&r).iter().all(|l| l.is_finite()));
        assert_eq!(
            fetched(&r, 1),
            fetched(&exact, 1),
            "{mode:?}: whole rows first"
        );
        for epoch in 2..=4 {
            let (got, full) = (fetched(&r, epoch), fetched(&exact, epoch));
            assert!(
                full > 0,
                "{mode:?}: epoch {epoch} fetches from the other server"
            );
            assert_eq!(got * f, full * k, "{mode:?} epoch {epoch}: {got} vs {full}");
        }
        assert!(
            r.execution.fetch_bytes_per_epoch.inter_server
                < exact.execution.fetch_bytes_per_epoch.inter_server
        );
        // Evaluation stays exact, and nothing else moves differently inside servers.
        assert_eq!(
            r.execution.halo_bytes_per_epoch.intra_server,
            exact.execution.halo_bytes_per_epoch.intra_server
        );
    }
}
