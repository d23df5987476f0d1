//! The cluster fabric of grandis: S servers × G devices as ranks (rank = server·G + device) that
//! move `f32` buffers and bytes between each other, with two link classes — intra-server (devices
//! of one server) and inter-server — as in GraNNDIS §4. Today all ranks are worker threads of one
//! process: [`Fabric::new`] builds one [`Endpoint`] per rank over an in-process
//! [`ChannelTransport`], and [`Fabric::run`] ([`run_ranks`] over any endpoints) runs a closure per
//! rank on scoped threads. An [`Endpoint`] offers point-to-point messages, the per-peer all-to-all
//! [`Endpoint::exchange`] that every GNN layer needs (each device sends every peer the rows it
//! needs and receives its halo rows per peer), and hierarchical collectives
//! ([`Endpoint::all_reduce_sum`], bit-identical on all ranks; [`Endpoint::broadcast`];
//! [`Endpoint::barrier`]). Every transfer carries a [`Tag`] (epoch, layer, phase); receivers check
//! it, and [`Counters`] account payload bytes per epoch × link class × layer × phase × direction
//! plus the seconds spent, serialisable for the trainer's JSON. The [`Transport`] trait is the seam
//! where QUIC (inter-server) plugs in: it only moves envelopes; accounting, tag checks and
//! collectives stay in [`Endpoint`]. Device transports (NCCL, device copies: `grandis-parallel`'s
//! `links`) move rows outside the fabric and count them with
//! [`Endpoint::account_device_transfers`], so counters mean the same on every transport. A worker that fails or panics drops
//! its endpoint, and every peer waiting on it gets [`FabricError::PeerGone`] naming it; receives
//! also time out ([`FabricConfig::recv_timeout`], 300 s by default) with an error naming the peer
//! and tag.
//!
//! # Link model
//!
//! Emulation is optional per class ([`LinkModel`]); with the default (unlimited bandwidth,
//! zero latency) nothing sleeps and no clock is read. Otherwise:
//!
//! * **Buckets.** Each server has one inter-server NIC per direction (egress, ingress) whose
//!   bandwidth `inter.bandwidth_bytes_per_s` is shared by all its devices. Each device has its
//!   own intra-server link per direction (egress, ingress) of bandwidth
//!   `intra.bandwidth_bytes_per_s`. Each bucket is a "free at" instant.
//! * **A message** of `n` payload bytes (`f32` = 4 bytes; headers are free) from rank a to
//!   rank b uses the sender-side egress bucket and the receiver-side ingress bucket of its
//!   class (the servers' NICs if a and b are on different servers, else the devices' links).
//!   It is scheduled when sent: `start = max(now, egress_free, ingress_free)`,
//!   `finish = start + n / bandwidth`, both buckets become free at `finish`, and the message
//!   arrives at `finish + latency` (latency does not occupy the bucket: links are pipelined).
//!   Without a bandwidth, `finish = now`.
//! * **Timing.** Sends never block; the receiver does not see a message before its arrival
//!   instant (it sleeps until then), so the wall time of an exchange or collective — and
//!   hence of an epoch — reflects the modelled cluster. Messages queue behind each other on a
//!   busy bucket in the order they were sent. Collective traffic goes through the same buckets.
//!
//! Example: `inter = LinkModel::new(2e6, Duration::ZERO)` makes 200 KB from server 0 to
//! server 1 take at least 0.1 s, and two devices of server 0 sending 100 KB each to server 1
//! share that NIC and finish no earlier than 0.1 s after the first send.

pub mod config;
pub mod counters;
pub mod endpoint;
pub mod error;
pub mod probe;
pub mod tag;
pub mod transport;

use std::sync::Arc;

pub use config::{FabricConfig, LinkModel, Topology, DEFAULT_RECV_TIMEOUT};
pub use counters::{CallRecord, Counters, Direction, EpochCounters, LinkClass, LinkRecord};
pub use endpoint::{chunk_range, DeviceTransfer, Endpoint, Expected};
pub use error::{FabricError, Result};
pub use probe::{LinkProbe, PROBE_EPOCH};
pub use tag::{Op, Phase, Tag};
pub use transport::{
    ChannelTransport, Envelope, Header, LinkEmulator, Payload, Transport, TransportError,
};

/// An in-process cluster: one [`Endpoint`] per rank, connected by channels.
#[derive(Debug)]
pub struct Fabric {
    config: FabricConfig,
    endpoints: Vec<Endpoint>,
}

impl Fabric {
    /// Validates `config` and builds the endpoints of all S × G ranks.
    pub fn new(config: FabricConfig) -> Result<Fabric> {
        config.validate()?;
        let topology = config.topology();
        let emulator = LinkEmulator::new(topology, config.intra, config.inter).map(Arc::new);
        let endpoints = ChannelTransport::mesh(topology, emulator)
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                Endpoint::with_transport(topology, rank, Box::new(t), config.recv_timeout)
            })
            .collect::<Result<Vec<_>>>()?;
        tracing::debug!(
            servers = config.servers,
            devices = config.devices,
            emulated = !(config.intra.is_unlimited() && config.inter.is_unlimited()),
            "fabric created"
        );
        Ok(Fabric { config, endpoints })
    }

    /// The configuration this fabric was built from.
    pub fn config(&self) -> &FabricConfig {
        &self.config
    }

    /// The cluster shape.
    pub fn topology(&self) -> Topology {
        self.config.topology()
    }

    /// The endpoints, index = rank, to be moved into worker threads.
    pub fn into_endpoints(self) -> Vec<Endpoint> {
        self.endpoints
    }

    /// Runs `work` once per rank ([`run_ranks`] over all endpoints) and returns the results in
    /// rank order.
    pub fn run<R, F>(self, work: F) -> anyhow::Result<Vec<R>>
    where
        R: Send,
        F: Fn(Endpoint) -> anyhow::Result<R> + Sync,
    {
        run_ranks(self.endpoints, work)
    }
}

/// Runs `work` once per endpoint, each on its own scoped thread named `grandis-rank-<r>`, and
/// returns the results in the endpoints' order. The endpoints may be all ranks of an in-process
/// [`Fabric`] or only one server's ranks over a real transport (the daemon's QUIC hybrid).
///
/// If any rank fails (returns an error or panics), its endpoint is dropped, which makes
/// peers waiting on it fail with [`FabricError::PeerGone`] instead of hanging. The error
/// returned is the root cause: the first failing rank (in the endpoints' order) whose error is
/// not merely a `PeerGone` consequence, with the rank in its context; other ranks' errors are
/// logged at debug level.
pub fn run_ranks<R, F>(endpoints: Vec<Endpoint>, work: F) -> anyhow::Result<Vec<R>>
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
                let handle = std::thread::Builder::new()
                    .name(format!("grandis-rank-{rank}"))
                    .spawn_scoped(scope, move || work(ep));
                (rank, handle)
            })
            .collect();
        handles
            .into_iter()
            .map(|(rank, handle)| {
                let outcome = match handle {
                    Err(e) => Err(anyhow::anyhow!(
                        "cannot start worker thread of rank {rank}: {e}"
                    )),
                    Ok(h) => match h.join() {
                        Ok(r) => r,
                        Err(panic) => Err(anyhow::anyhow!(
                            "rank {rank} panicked: {}",
                            grandis_telemetry::panic::message(panic.as_ref())
                        )),
                    },
                };
                (rank, outcome)
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
        Some((rank, e)) => Err(e.context(format!("worker of rank {rank} failed"))),
        None => Ok(results),
    }
}
