//! One server's share of a partition-parallel run: the G ranks of THIS server, each on its own
//! thread, over endpoints the caller built (the daemon builds them over the QUIC hybrid
//! transport of `grandis-quic`: same-server peers over channels, other servers over QUIC).
//!
//! No plan is shipped between servers: the plans are deterministic functions of (dataset,
//! partition, mode, k, seed), so each server builds what its ranks run from the same inputs —
//! the head group of GraNNDIS §7: its own part of every batched step (`crate::steps::StepPart`),
//! and whole plans where its ranks need every rank's (FB exchanges). What does travel when a
//! plan is built are the features of the vertices it replicates from another server, sent by
//! their home rank (`crate::fetch`; asked for by id where the asking server's plans were not
//! built there).
//! The setup and the per-rank worker are exactly those of [`crate::train`], so the losses
//! equal the in-process run's. What differs is the report's scope: counters, bytes, time split
//! and memory cover this server's ranks only (sum them over servers for the cluster), while
//! the losses, accuracies and what the steps computed are cluster-wide (all-reduced, and the
//! servers' step counts added up at the end of the run).

use anyhow::bail;
use grandis_fabric::Endpoint;
use grandis_models::ModelConfig;
use grandis_store::DatasetView;
use grandis_trainer::{EpochStats, TrainOptions};

use crate::{ParallelOptions, ParallelReport, PartitionedGraph};

/// Trains this server's ranks. `endpoints` are the ranks of one server (any order; they are
/// sorted by rank), built for the topology of `part.layout`. `on_epoch` is called by the
/// server's first device after every epoch with the cluster-wide loss and accuracies.
/// `popts.intra`/`inter` are ignored (the links are real); `popts.threads_per_rank` defaults
/// to the machine's cores divided by this server's devices (the ranks run here).
pub fn train_server(
    view: DatasetView<'_>,
    part: &PartitionedGraph,
    config: ModelConfig,
    opts: &TrainOptions,
    popts: &ParallelOptions,
    mut endpoints: Vec<Endpoint>,
    on_epoch: &mut (dyn FnMut(&EpochStats) + Send),
) -> anyhow::Result<ParallelReport> {
    let (servers, devices) = (part.layout.servers(), part.layout.devices());
    if endpoints.len() != devices {
        bail!(
            "this server has {} endpoints but the partition has {devices} devices per server",
            endpoints.len()
        );
    }
    endpoints.sort_by_key(|e| e.rank());
    let server = endpoints[0].server();
    for (d, ep) in endpoints.iter().enumerate() {
        let t = ep.topology();
        if t.servers != servers || t.devices != devices {
            bail!(
                "endpoint of rank {} is for {} servers x {} devices, the partition for \
                 {servers} x {devices}",
                ep.rank(),
                t.servers,
                t.devices
            );
        }
        if ep.server() != server || ep.device() != d {
            bail!(
                "the endpoints are not the {devices} devices of one server (rank {} is server \
                 {} device {})",
                ep.rank(),
                ep.server(),
                ep.device()
            );
        }
    }
    crate::train::train_ranks(view, part, config, opts, popts, on_epoch, Some(endpoints))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{random_2x2, sage, synth, train_opts};
    use crate::{JobSpec, Machine};
    use grandis_fabric::{Fabric, FabricConfig};

    /// `job` with one thread per rank.
    fn one_thread(job: JobSpec) -> ParallelOptions {
        ParallelOptions {
            job,
            machine: Machine {
                threads_per_rank: Some(1),
                ..Machine::default()
            },
        }
    }

    /// The two halves of a 2 x 2 in-process fabric, each running `train_server` on its own
    /// thread (as two daemons would); every server's report, each checked to report the
    /// losses its first device saw.
    fn two_servers(
        view: DatasetView<'_>,
        part: &PartitionedGraph,
        config: &ModelConfig,
        opts: &TrainOptions,
        popts: &ParallelOptions,
    ) -> Vec<ParallelReport> {
        let mut eps = Fabric::new(FabricConfig::new(2, 2))
            .unwrap()
            .into_endpoints();
        let second: Vec<_> = eps.split_off(2);
        std::thread::scope(|s| {
            let hs: Vec<_> = [eps, second]
                .into_iter()
                .map(|eps| {
                    let config = config.clone();
                    s.spawn(move || {
                        let mut seen = Vec::new();
                        let r = train_server(view, part, config, opts, popts, eps, &mut |e| {
                            seen.push(e.loss)
                        })
                        .unwrap();
                        let losses: Vec<f64> = r.train.epochs.iter().map(|e| e.loss).collect();
                        assert_eq!(seen, losses, "every server's first device reports");
                        r
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Link prediction's batched modes (edges dealt by their sources' servers, co-batch
    /// targets on any server, their features asked for by id) and fb: two servers run apart
    /// train as the in-process run does, to the same losses and scores.
    #[test]
    fn link_servers_run_separately_equal_the_in_process_run() {
        let ds = synth(300, 2);
        let options = grandis_store::EdgeSplitOptions {
            val: 0.1,
            test: 0.1,
            negatives: 2,
            seed: 2,
        };
        let (graph, split) = grandis_store::split_edges(ds.graph.view(), true, &options).unwrap();
        let ds = grandis_store::InMemoryDataset { graph, ..ds };
        let mut view = ds.view();
        view.links = Some(split.view());
        let part = random_2x2(&view, 4);
        let config = ModelConfig {
            classes: 6,
            ..sage(&view, 8, 0.5, 3)
        };
        let opts = TrainOptions {
            objective: grandis_trainer::Objective::Link {
                negatives: 2,
                decoder: grandis_wire::LinkDecoder::Mlp,
            },
            ..train_opts(2, 0.0, 3)
        };
        use grandis_wire::{Mode, Sampling};
        let fanout = Sampling::Fanout {
            fanouts: vec![4, 3],
            relation_fanouts: Default::default(),
        };
        for (mode, sampling, batch_size) in [
            (Mode::Mb, fanout.clone(), Some(64)),
            (Mode::Cob, fanout, Some(128)),
            (Mode::Cluster, Sampling::None, Some(64)),
            (Mode::Fb, Sampling::None, None),
        ] {
            let popts = one_thread(JobSpec {
                mode,
                sampling,
                batch_size,
                ..JobSpec::default()
            });
            let reference =
                crate::train(view, &part, config.clone(), &opts, &popts, &mut |_| {}).unwrap();
            let want = reference.train.link.as_ref().expect("link scores");
            for r in two_servers(view, &part, &config, &opts, &popts) {
                assert_eq!(r.train.epochs.len(), reference.train.epochs.len());
                for (a, b) in r.train.epochs.iter().zip(&reference.train.epochs) {
                    assert!((a.loss - b.loss).abs() < 1e-9, "{mode:?}: {a:?} vs {b:?}");
                }
                let got = r.train.link.as_ref().expect("link scores");
                assert_eq!(got.test.auc, want.test.auc, "{mode:?}");
            }
        }
    }

    /// Two "servers" of one process, each running `train_server` over its half of an
    /// in-process fabric's endpoints, reproduce `train` exactly: same losses and accuracies,
    /// and the two servers' byte counters add up to the in-process run's. In the batched
    /// modes each server builds only its part of every step (the replicated rows asked for by
    /// id), and the run's counters, added up across the servers, equal the in-process run's.
    #[test]
    fn servers_run_separately_equal_the_in_process_run() {
        let ds = synth(300, 0);
        let view = ds.view();
        let part = random_2x2(&view, 3);
        let config = sage(&view, 8, 0.5, 5);
        let opts = train_opts(3, 5e-4, 5);
        use grandis_wire::{Mode, Sampling};
        let fanout = Sampling::Fanout {
            fanouts: vec![4, 3],
            relation_fanouts: Default::default(),
        };
        let cases = [
            (Mode::Fb, Sampling::None, None),
            (Mode::Flx, Sampling::None, None),
            (Mode::Cob, fanout.clone(), Some(40)),
            (Mode::Mb, fanout, Some(20)),
            (Mode::Cob, Sampling::None, Some(40)),
        ];
        for (mode, sampling, batch_size) in cases {
            let popts = one_thread(JobSpec {
                mode,
                preload_hops: (mode == Mode::Flx).then_some(1),
                sampling,
                batch_size,
                ..JobSpec::default()
            });
            let reference =
                crate::train(view, &part, config.clone(), &opts, &popts, &mut |_| {}).unwrap();
            let reports = two_servers(view, &part, &config, &opts, &popts);
            for r in &reports {
                assert_eq!(r.train.epochs.len(), reference.train.epochs.len());
                for (a, b) in r.train.epochs.iter().zip(&reference.train.epochs) {
                    assert!((a.loss - b.loss).abs() < 1e-9, "{mode:?}: {a:?} vs {b:?}");
                }
                assert_eq!(r.train.test_acc, reference.train.test_acc, "{mode:?}");
                // What the steps computed, every server's part added up.
                assert_eq!(
                    r.execution.sampled_edges, reference.execution.sampled_edges,
                    "{mode:?}"
                );
                assert_eq!(
                    r.execution.inter_server_sampled_edges,
                    reference.execution.inter_server_sampled_edges,
                    "{mode:?}"
                );
                assert_eq!(
                    r.execution.targets_per_epoch, reference.execution.targets_per_epoch,
                    "{mode:?}"
                );
                assert_eq!(
                    r.execution.computed_vertices_per_layer,
                    reference.execution.computed_vertices_per_layer,
                    "{mode:?}"
                );
                assert_eq!(
                    r.execution.aggregated_edges_per_layer,
                    reference.execution.aggregated_edges_per_layer,
                    "{mode:?}"
                );
                assert_eq!(
                    r.execution.replicated_vertices, reference.execution.replicated_vertices,
                    "{mode:?}"
                );
                for (a, b) in r.execution.beta.iter().zip(&reference.execution.beta) {
                    assert!(
                        (a - b).abs() < 1e-12,
                        "{mode:?}: β {:?} vs {:?}",
                        r.execution.beta,
                        reference.execution.beta
                    );
                }
            }
            if batch_size.is_some() {
                assert!(reference.execution.sampled_edges > 0, "{mode:?}");
                assert!(
                    reference.execution.fetch_bytes_per_epoch.inter_server > 0,
                    "{mode:?}: the batches reach into the other server"
                );
            }
            // Per-epoch figures are whole bytes divided by the epochs, in each server's
            // report: their sum may fall one byte per server below the whole run's.
            let sums_to = |f: fn(&ParallelReport) -> u64, whole: u64, what: &str| {
                let sum = reports.iter().map(f).sum::<u64>();
                assert!(
                    sum <= whole && whole - sum < reports.len() as u64,
                    "{mode:?} {what}: the servers' {sum} against the run's {whole}"
                );
            };
            sums_to(
                |r| r.execution.fetch_bytes_per_epoch.inter_server,
                reference.execution.fetch_bytes_per_epoch.inter_server,
                "fetch",
            );
            sums_to(
                |r| r.execution.halo_bytes_per_epoch.inter_server,
                reference.execution.halo_bytes_per_epoch.inter_server,
                "inter-server halo",
            );
            sums_to(
                |r| r.execution.halo_bytes_per_epoch.intra_server,
                reference.execution.halo_bytes_per_epoch.intra_server,
                "intra-server halo",
            );
            if batch_size.is_none() {
                // Full-batch plans predict their halo bytes (batched ones do not).
                assert_eq!(
                    reference.execution.halo_bytes_per_epoch,
                    reference.execution.predicted_halo_bytes_per_epoch
                );
            }
        }
    }

    #[test]
    fn endpoints_of_two_servers_are_rejected() {
        let ds = synth(100, 0);
        let view = ds.view();
        let part = random_2x2(&view, 0);
        let config = sage(&view, 4, 0.0, 0);
        let opts = train_opts(1, 0.0, 0);
        let mut eps = Fabric::new(FabricConfig::new(2, 2))
            .unwrap()
            .into_endpoints();
        let mixed = vec![eps.remove(1), eps.remove(1)];
        let err = train_server(
            view,
            &part,
            config,
            &opts,
            &ParallelOptions::default(),
            mixed,
            &mut |_| {},
        )
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("not the 2 devices of one server"),
            "{err:#}"
        );
    }
}
