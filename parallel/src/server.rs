//! One server's share of a partition-parallel run: the G ranks of THIS server, each on its own
//! thread, over endpoints the caller built (the daemon builds them over the QUIC hybrid
//! transport of `grandis-quic`: same-server peers over channels, other servers over QUIC).
//!
//! No plan is shipped between servers: the plans are deterministic functions of (dataset,
//! partition, mode, k, seed), so every server builds the same global plans from the same inputs
//! and its ranks pick their own device plans — the head group of GraNNDIS §7. What does travel
//! when a plan is built are the features of the vertices it replicates from another server,
//! sent by their home rank (`crate::fetch`).
//! The setup and the per-rank worker are exactly those of [`crate::train`], so the losses
//! equal the in-process run's. What differs is the report's scope: counters, bytes, time split
//! and memory cover this server's ranks only (sum them over servers for the cluster), while
//! the losses and accuracies are cluster-wide (they are all-reduced).

use anyhow::{bail, Context};
use grandis_fabric::{Endpoint, FabricError};
use grandis_models::ModelConfig;
use grandis_store::DatasetView;
use grandis_trainer::{EpochStats, TrainOptions};

use crate::{ParallelOptions, ParallelReport, PartitionedGraph};

/// Trains this server's ranks. `endpoints` are the ranks of one server (any order; they are
/// sorted by rank), built for the topology of `part.layout`. `on_epoch` is called by the
/// server's first device after every epoch with the cluster-wide loss and accuracies.
/// `popts.intra`/`inter` are ignored (the links are real); `popts.threads_per_rank` defaults
/// to the machine's cores divided by this server's devices.
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
    let mut popts = popts.clone();
    if popts.threads_per_rank.is_none() {
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        popts.threads_per_rank = Some((cores / devices).max(1));
    }
    crate::train_ranks(view, part, config, opts, &popts, on_epoch, Some(endpoints))
}

/// Runs `work` once per endpoint on scoped threads named `grandis-rank-<r>` and returns the
/// results in the endpoints' order. As in `Fabric::run`, a failing rank drops its endpoint
/// (peers then fail with `PeerGone` instead of waiting), and the error returned is the first
/// one that is not merely such a consequence.
pub(crate) fn run_endpoints<R, F>(endpoints: Vec<Endpoint>, work: F) -> anyhow::Result<Vec<R>>
where
    R: Send,
    F: Fn(Endpoint) -> anyhow::Result<R> + Sync,
{
    let work = &work;
    let outcomes: Vec<(usize, anyhow::Result<R>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = endpoints
            .into_iter()
            .map(|ep| {
                let rank = ep.rank();
                let h = std::thread::Builder::new()
                    .name(format!("grandis-rank-{rank}"))
                    .spawn_scoped(scope, move || work(ep));
                (rank, h)
            })
            .collect();
        handles
            .into_iter()
            .map(|(rank, h)| {
                let r = match h {
                    Err(e) => Err(anyhow::anyhow!(
                        "cannot start the thread of rank {rank}: {e}"
                    )),
                    Ok(h) => h
                        .join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("rank {rank} panicked"))),
                };
                (rank, r)
            })
            .collect()
    });
    let is_consequence = |e: &anyhow::Error| {
        e.chain().any(|c| {
            c.downcast_ref::<FabricError>()
                .is_some_and(FabricError::is_peer_gone)
        })
    };
    let mut root: Option<(usize, anyhow::Error)> = None;
    let mut results = Vec::with_capacity(outcomes.len());
    for (rank, outcome) in outcomes {
        match outcome {
            Ok(r) => results.push(r),
            Err(e) => {
                let better = match &root {
                    None => true,
                    Some((_, cur)) => is_consequence(cur) && !is_consequence(&e),
                };
                if better {
                    if let Some((r, old)) = root.replace((rank, e)) {
                        tracing::debug!("rank {r} also failed: {old:#}");
                    }
                } else {
                    tracing::debug!("rank {rank} also failed: {e:#}");
                }
            }
        }
    }
    match root {
        Some((rank, e)) => Err(e).with_context(|| format!("worker of rank {rank} failed")),
        None => Ok(results),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use grandis_fabric::{Fabric, FabricConfig};
    use grandis_models::ModelKind;
    use grandis_synth::SynthConfig;

    /// Two "servers" of one process, each running `train_server` over its half of an
    /// in-process fabric's endpoints, reproduce `train` exactly: same losses and accuracies,
    /// and the two servers' byte counters add up to the in-process run's.
    #[test]
    fn servers_run_separately_equal_the_in_process_run() {
        let ds = grandis_synth::generate_in_memory(&SynthConfig {
            nodes: 300,
            ..SynthConfig::default()
        })
        .unwrap();
        let view = ds.view();
        let part = PartitionedGraph::partition(
            &view,
            true,
            2,
            2,
            grandis_partition::PartitionMethod::Random,
            3,
        )
        .unwrap();
        let config = ModelConfig {
            kind: ModelKind::Sage,
            layers: 2,
            in_dim: view.feature_dim,
            hidden: 8,
            classes: view.num_classes,
            dropout: 0.5,
            layer_norm: false,
            seed: 5,
        };
        let opts = TrainOptions {
            epochs: 3,
            lr: 0.01,
            weight_decay: 5e-4,
            adamw: false,
            grad_clip: None,
            seed: 5,
        };
        for mode in [crate::Mode::Fb, crate::Mode::Flx] {
            let popts = ParallelOptions {
                mode,
                preload_hops: (mode == crate::Mode::Flx).then_some(1),
                threads_per_rank: Some(1),
                ..Default::default()
            };
            let reference =
                crate::train(view, &part, config.clone(), &opts, &popts, &mut |_| {}).unwrap();
            let mut eps = Fabric::new(FabricConfig::new(2, 2))
                .unwrap()
                .into_endpoints();
            let second: Vec<_> = eps.split_off(2);
            let halves = [eps, second];
            let reports: Vec<ParallelReport> = std::thread::scope(|s| {
                let hs: Vec<_> = halves
                    .into_iter()
                    .map(|eps| {
                        let (part, config, popts, opts) = (&part, config.clone(), &popts, &opts);
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
            });
            for r in &reports {
                for (a, b) in r.train.epochs.iter().zip(&reference.train.epochs) {
                    assert!((a.loss - b.loss).abs() < 1e-9, "{mode:?}: {a:?} vs {b:?}");
                }
                assert_eq!(r.train.test_acc, reference.train.test_acc);
            }
            let sum = |f: fn(&ParallelReport) -> u64| reports.iter().map(f).sum::<u64>();
            assert_eq!(
                sum(|r| r.halo_bytes_per_epoch.inter_server),
                reference.halo_bytes_per_epoch.inter_server
            );
            assert_eq!(
                sum(|r| r.halo_bytes_per_epoch.intra_server),
                reference.halo_bytes_per_epoch.intra_server
            );
            assert_eq!(
                reference.halo_bytes_per_epoch,
                reference.predicted_halo_bytes_per_epoch
            );
        }
    }

    #[test]
    fn endpoints_of_two_servers_are_rejected() {
        let ds = grandis_synth::generate_in_memory(&SynthConfig {
            nodes: 100,
            ..SynthConfig::default()
        })
        .unwrap();
        let view = ds.view();
        let part = PartitionedGraph::partition(
            &view,
            true,
            2,
            2,
            grandis_partition::PartitionMethod::Random,
            0,
        )
        .unwrap();
        let config = ModelConfig {
            kind: ModelKind::Sage,
            layers: 2,
            in_dim: view.feature_dim,
            hidden: 4,
            classes: view.num_classes,
            dropout: 0.0,
            layer_norm: false,
            seed: 0,
        };
        let opts = TrainOptions {
            epochs: 1,
            lr: 0.01,
            weight_decay: 0.0,
            adamw: false,
            grad_clip: None,
            seed: 0,
        };
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
