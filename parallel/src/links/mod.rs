//! How a rank's halo rows, halo gradients and weight gradients travel: `RankLinks`, the
//! worker's handle on the device transports, beside the fabric [`Endpoint`] that carries
//! everything else (features fetched from their home rank, evaluation counts, barriers,
//! checkpoints' agreement) and every byte no device transport reaches.
//!
//! Transports (chosen per job by [`select`]):
//! - **fabric**: rows are downloaded to host buffers and go through the endpoint (the
//!   in-process channels, or QUIC between daemons). CPU ranks always use it.
//! - **NCCL** inside a server (`nccl`): CUDA ranks on distinct GPUs exchange rows straight
//!   from device buffers as one NCCL group per exchange (a send and a receive per peer: NCCL
//!   has no all-to-all), and reduce / broadcast the weight gradients on a communicator of the
//!   server's ranks. With `inter_transport = "nccl"` a communicator of all ranks carries every
//!   halo exchange and one of the servers' heads the all-reduce between servers.
//! - **device copies** (`copies`): NCCL refuses two ranks of one communicator on one device,
//!   so ranks of a process that share a GPU hand each other device buffers and copy them
//!   device to device (each rank on its own stream).
//!
//! Whatever carries them, the weight gradients are summed in the fabric's hierarchical order
//! (reduce to the server's head, all-reduce among heads, broadcast), every replica ends with the
//! same bits, and the endpoint's counters get the same bytes per link class, layer and phase as
//! the fabric would count ([`Endpoint::account_device_transfers`]), so reports and the checks
//! against the plans' predictions mean the same on every transport.

pub(crate) mod copies;
mod cuda_nccl;
mod device_link;
pub(crate) mod nccl;

pub(crate) use cuda_nccl::CudaNccl;
pub(crate) use device_link::DeviceLink;

use std::ops::Range;
use std::time::Instant;

use anyhow::Context;
use grandis_engine::Backend;
use grandis_fabric::{chunk_range, DeviceTransfer, Endpoint, Expected, Tag, Topology};
use grandis_wire::InterTransport;
use serde::Serialize;

use crate::compute::Compute;

/// What carries the traffic between the ranks of one server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IntraTransport {
    /// Host buffers through the fabric endpoint.
    Fabric,
    /// Device-to-device copies between ranks of one process (ranks sharing a GPU).
    DeviceCopies,
    /// NCCL (CUDA ranks on distinct GPUs).
    Nccl,
    /// NCCL's call sequence run on host buffers by `nccl::HostNccl`: how the NCCL paths are
    /// exercised on machines without GPUs (tests).
    NcclOnHost,
}

impl IntraTransport {
    pub fn name(self) -> &'static str {
        match self {
            IntraTransport::Fabric => "fabric",
            IntraTransport::DeviceCopies => "device copies",
            IntraTransport::Nccl => "nccl",
            IntraTransport::NcclOnHost => "nccl on host",
        }
    }

    fn is_nccl(self) -> bool {
        matches!(self, IntraTransport::Nccl | IntraTransport::NcclOnHost)
    }
}

/// The transports of a job's ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Transports {
    pub intra: IntraTransport,
    pub inter: InterTransport,
}

impl Transports {
    /// For reports: "nccl inside servers, quic between".
    pub fn describe(&self) -> String {
        format!(
            "{} inside servers, {} between",
            self.intra.name(),
            self.inter
        )
    }
}

/// Picks the transports: CPU ranks use the fabric; CUDA ranks of a server use NCCL when their
/// ordinals (`ordinals[d]` for device index d) are distinct, device copies when any two share
/// one (NCCL refuses them). `forced` (tests, benchmarks) replaces the automatic choice inside
/// a server. NCCL between servers needs NCCL inside them (every rank on its own GPU).
pub fn select(
    compute: &Compute,
    ordinals: &[usize],
    inter: InterTransport,
    forced: Option<IntraTransport>,
) -> anyhow::Result<Transports> {
    let shared_gpu = (1..ordinals.len()).any(|i| ordinals[..i].contains(&ordinals[i]));
    let intra = match (forced, compute) {
        (Some(IntraTransport::Nccl), Compute::Cpu) => {
            anyhow::bail!("the NCCL transport needs CUDA ranks (device cuda)")
        }
        (Some(IntraTransport::Nccl), Compute::Cuda { .. }) if shared_gpu => anyhow::bail!(
            "NCCL needs every rank of a server on its own GPU; these ranks share one \
             (cuda devices {ordinals:?}): use device copies"
        ),
        (Some(forced), _) => forced,
        (None, Compute::Cpu) => IntraTransport::Fabric,
        (None, Compute::Cuda { .. }) if shared_gpu => IntraTransport::DeviceCopies,
        (None, Compute::Cuda { .. }) => IntraTransport::Nccl,
    };
    if inter == InterTransport::Nccl && !intra.is_nccl() {
        anyhow::bail!(
            "inter_transport nccl needs NCCL inside every server too, that is CUDA ranks each \
             on its own GPU; this job's ranks use {} (use inter_transport quic)",
            intra.name()
        );
    }
    Ok(Transports { intra, inter })
}

/// Rank `ep`'s links for `transports` (call on every rank of the job, in the same order:
/// NCCL communicators are joined collectively). NCCL ids travel over the endpoint: each head
/// makes its server's and sends it to its devices; global rank 0 makes the world's and the
/// heads' (`inter_transport = "nccl"`) and broadcasts them. `hub` holds the device-copy
/// channels of this process's ranks (needed for [`IntraTransport::DeviceCopies`]).
pub(crate) fn connect<B, N>(
    b: &B,
    ep: &mut Endpoint,
    transports: Transports,
    hub: Option<&copies::CopyHub>,
) -> anyhow::Result<RankLinks<B>>
where
    B: Backend + 'static,
    B::Buf: 'static,
    N: nccl::Nccl<B> + 'static,
{
    let topo = ep.topology();
    let (rank, server, device) = (ep.rank(), ep.server(), ep.device());
    let timeout = ep.recv_timeout();
    let tag = Tag::other(crate::fetch::SETUP_EPOCH, 0);
    let mates: Vec<usize> = topo.ranks_of(server).collect();
    let intra: Option<Box<dyn DeviceLink<B>>> = match transports.intra {
        IntraTransport::Fabric => None,
        IntraTransport::DeviceCopies => {
            let hub = hub.context("device copies need the process's copy channels")?;
            Some(Box::new(hub.join::<B>(topo, rank, timeout)?))
        }
        IntraTransport::Nccl | IntraTransport::NcclOnHost => {
            let id = if ep.is_head() {
                let id = N::unique_id()?;
                for &m in &mates[1..] {
                    ep.send_bytes(m, id.clone(), tag)?;
                }
                id
            } else {
                ep.recv_bytes(mates[0], tag)?
            };
            let comm = N::join(b, &id, device, topo.devices, timeout)
                .with_context(|| format!("joining server {server}'s NCCL communicator"))?;
            Some(Box::new(nccl::NcclLink::new(comm, mates, rank)))
        }
    };
    if transports.inter != InterTransport::Nccl {
        return Ok(RankLinks::new(topo, intra, None, None));
    }
    let made = if rank == 0 {
        [N::unique_id()?, N::unique_id()?].concat()
    } else {
        Vec::new()
    };
    let ids = ep.broadcast_bytes(made, 0, tag)?;
    let (world_id, heads_id) = ids.split_at(ids.len() / 2);
    let world = N::join(b, world_id, rank, topo.world(), timeout)
        .context("joining the job's NCCL communicator")?;
    let world: Box<dyn DeviceLink<B>> = Box::new(nccl::NcclLink::new(
        world,
        (0..topo.world()).collect(),
        rank,
    ));
    let heads: Option<Box<dyn DeviceLink<B>>> = if ep.is_head() {
        let heads = N::join(b, heads_id, server, topo.servers, timeout)
            .context("joining the heads' NCCL communicator")?;
        let members = (0..topo.servers).map(|s| topo.head_of(s)).collect();
        Some(Box::new(nccl::NcclLink::new(heads, members, rank)))
    } else {
        None
    };
    Ok(RankLinks::new(topo, intra, Some(world), heads))
}

/// Rows received by [`RankLinks::exchange`]: host values from the fabric, or a buffer of this
/// rank from a device transport, to be copied or scattered into place.
pub(crate) enum Arrived<B: Backend> {
    Host(Vec<f32>),
    Device(B::Buf),
}

/// A rank's device transports (none: the fabric carries everything).
pub(crate) struct RankLinks<B: Backend> {
    /// This server's ranks.
    intra: Option<Box<dyn DeviceLink<B>>>,
    /// Every rank (`inter_transport = "nccl"`): carries every halo exchange.
    world: Option<Box<dyn DeviceLink<B>>>,
    /// The servers' heads (`inter_transport = "nccl"`): the all-reduce between servers.
    heads: Option<Box<dyn DeviceLink<B>>>,
    /// By global rank: whether the exchange link reaches it (else the fabric does).
    on_device: Vec<bool>,
}

impl<B: Backend> RankLinks<B> {
    /// Everything over the fabric endpoint.
    pub fn fabric() -> Self {
        RankLinks {
            intra: None,
            world: None,
            heads: None,
            on_device: Vec::new(),
        }
    }

    fn new(
        topo: Topology,
        intra: Option<Box<dyn DeviceLink<B>>>,
        world: Option<Box<dyn DeviceLink<B>>>,
        heads: Option<Box<dyn DeviceLink<B>>>,
    ) -> Self {
        // Halo exchanges use the world's link when there is one (it reaches every rank),
        // else the server's.
        let on_device = match world.as_ref().or(intra.as_ref()) {
            Some(link) => (0..topo.world()).map(|p| link.reaches(p)).collect(),
            None => Vec::new(),
        };
        RankLinks {
            intra,
            world,
            heads,
            on_device,
        }
    }

    /// One layer's halo exchange: sends `sends` (`(peer, buffer, element range)`) and returns
    /// what arrived from every `(peer, expected)` of `expect`, in that order. Peers a device
    /// link reaches go over it; the rest over the fabric, posted before the device round and
    /// collected after it, so both are in flight together. Only fabric peers may skip a
    /// transfer ([`Expected::ExactlyOrNone`]): device receives need their sizes in advance.
    pub fn exchange(
        &mut self,
        b: &B,
        ep: &mut Endpoint,
        sends: &[(usize, &B::Buf, Range<usize>)],
        expect: &[(usize, Expected)],
        tag: Tag,
    ) -> anyhow::Result<Vec<Arrived<B>>> {
        let RankLinks {
            intra,
            world,
            on_device: routed,
            ..
        } = self;
        let on_device = |peer: usize| routed.get(peer).copied().unwrap_or(false);
        let (dev_sends, host_sends): (Vec<_>, Vec<_>) = sends
            .iter()
            .map(|(p, buf, r)| (*p, *buf, r.clone()))
            .partition(|(p, _, _)| on_device(*p));
        let (dev_expect, host_expect): (Vec<_>, Vec<_>) =
            expect.iter().copied().partition(|&(p, _)| on_device(p));
        let dev_expect: Vec<(usize, usize)> = dev_expect
            .into_iter()
            .map(|(p, e)| match e {
                Expected::Exactly(n) => Ok((p, n)),
                Expected::ExactlyOrNone(_) => Err(anyhow::anyhow!(
                    "rank {p} is reached over a device link, which cannot skip a transfer ({tag})"
                )),
            })
            .collect::<anyhow::Result<_>>()?;
        let mut staged = Vec::with_capacity(host_sends.len());
        for (peer, buf, range) in host_sends {
            let mut host = vec![0f32; range.len()];
            b.download(buf, range.start, &mut host)?;
            staged.push((peer, host));
        }
        ep.exchange_post(staged, tag)?;
        let mut from_device = Vec::new();
        let link = world.as_mut().or(intra.as_mut());
        if let Some(link) = link.filter(|_| !dev_sends.is_empty() || !dev_expect.is_empty()) {
            let start = Instant::now();
            from_device = link
                .exchange(b, &dev_sends, &dev_expect)
                .with_context(|| format!("device exchange ({tag})"))?;
            let transfers = dev_sends
                .iter()
                .map(|(peer, _, range)| DeviceTransfer {
                    peer: *peer,
                    sent: Some(range.len() * 4),
                    received: None,
                })
                .chain(dev_expect.iter().map(|&(peer, len)| DeviceTransfer {
                    peer,
                    sent: None,
                    received: Some(len * 4),
                }));
            ep.account_device_transfers(tag, start.elapsed(), transfers);
        }
        let from_host = ep.exchange_collect(&host_expect, tag)?;
        let (mut from_device, mut from_host) = (from_device.into_iter(), from_host.into_iter());
        expect
            .iter()
            .map(|&(peer, _)| {
                let arrived = if on_device(peer) {
                    from_device.next().map(Arrived::Device)
                } else {
                    from_host.next().map(|(_, data)| Arrived::Host(data))
                };
                arrived.with_context(|| format!("nothing arrived from rank {peer} ({tag})"))
            })
            .collect()
    }

    /// Sums the concatenation of `parts` (buffers with their lengths: the weight gradients)
    /// over every rank, in the fabric's order, with the result on every rank, as one fused
    /// transfer: on the host through the endpoint when no device link serves this server,
    /// else in one device buffer: reduce to the head on the server's link, all-reduce among
    /// heads (their link, or the endpoint through host memory), broadcast on the server's link.
    pub fn all_reduce_sum(
        &mut self,
        b: &B,
        ep: &mut Endpoint,
        parts: &mut [(&mut B::Buf, usize)],
        tag: Tag,
    ) -> anyhow::Result<()> {
        let len: usize = parts.iter().map(|(_, n)| n).sum();
        let offsets = parts.iter().scan(0, |at, (_, n)| {
            *at += n;
            Some(*at - n)
        });
        let offsets: Vec<usize> = offsets.collect();
        let Some(intra) = self.intra.as_mut() else {
            let mut host = vec![0f32; len];
            for ((buf, n), &at) in parts.iter().zip(&offsets) {
                b.download(buf, 0, &mut host[at..at + *n])?;
            }
            ep.all_reduce_sum(&mut host, tag)?;
            for ((buf, n), &at) in parts.iter_mut().zip(&offsets) {
                b.upload_into(buf, 0, &host[at..at + *n])?;
            }
            return Ok(());
        };
        let mut flat = b.alloc(len)?;
        for ((buf, n), &at) in parts.iter().zip(&offsets) {
            b.copy_range(buf, 0, &mut flat, at, *n)?;
        }
        device_all_reduce(intra, self.heads.as_mut(), b, ep, &mut flat, len, tag)?;
        for ((buf, n), &at) in parts.iter_mut().zip(&offsets) {
            b.copy_range(&flat, at, buf, 0, *n)?;
        }
        Ok(())
    }
}

/// Reduce to the head on the server's link, all-reduce among heads (their link, or the
/// endpoint through host memory), broadcast on the server's link; each step accounted as the
/// fabric counts it.
fn device_all_reduce<B: Backend>(
    intra: &mut Box<dyn DeviceLink<B>>,
    heads: Option<&mut Box<dyn DeviceLink<B>>>,
    b: &B,
    ep: &mut Endpoint,
    buf: &mut B::Buf,
    len: usize,
    tag: Tag,
) -> anyhow::Result<()> {
    let topo = ep.topology();
    let (rank, server) = (ep.rank(), ep.server());
    let bytes = len * 4;
    let head = topo.head_of(server);
    let start = Instant::now();
    intra
        .reduce(b, buf, len)
        .context("reducing the weight gradients inside the server")?;
    let reduced = reduce_transfers(rank, head, topo.ranks_of(server), bytes);
    ep.account_device_transfers(tag, start.elapsed(), reduced);
    if ep.is_head() && topo.servers > 1 {
        match heads {
            Some(heads) => {
                let start = Instant::now();
                heads
                    .all_reduce(b, buf, len)
                    .context("all-reducing the weight gradients among the heads")?;
                let transfers = heads_transfers(topo, server, len);
                ep.account_device_transfers(tag, start.elapsed(), transfers);
            }
            None => {
                let mut host = vec![0f32; len];
                b.download(buf, 0, &mut host)?;
                ep.heads_all_reduce_sum(&mut host, tag)?;
                b.upload_into(buf, 0, &host)?;
            }
        }
    }
    let start = Instant::now();
    intra
        .broadcast(b, buf, len)
        .context("broadcasting the weight gradients inside the server")?;
    let broadcast = broadcast_transfers(rank, head, topo.ranks_of(server), bytes);
    ep.account_device_transfers(tag, start.elapsed(), broadcast);
    Ok(())
}

/// What the fabric counts for step 1 of its all-reduce: each device sends its buffer to the
/// head, which receives one from each.
fn reduce_transfers(
    rank: usize,
    head: usize,
    mates: impl Iterator<Item = usize>,
    bytes: usize,
) -> Vec<DeviceTransfer> {
    if rank != head {
        return vec![DeviceTransfer {
            peer: head,
            sent: Some(bytes),
            received: None,
        }];
    }
    mates
        .filter(|&m| m != head)
        .map(|peer| DeviceTransfer {
            peer,
            sent: None,
            received: Some(bytes),
        })
        .collect()
}

/// Step 3: the head sends the result to each device.
fn broadcast_transfers(
    rank: usize,
    head: usize,
    mates: impl Iterator<Item = usize>,
    bytes: usize,
) -> Vec<DeviceTransfer> {
    reduce_transfers(rank, head, mates, bytes)
        .into_iter()
        .map(|t| DeviceTransfer {
            peer: t.peer,
            sent: t.received,
            received: t.sent,
        })
        .collect()
}

/// Step 2: reduce-scatter and all-gather among the heads: this head sends every other head its
/// chunk of the buffer and then its own reduced chunk, and receives theirs (the fabric's
/// chunking).
fn heads_transfers(topo: Topology, server: usize, len: usize) -> Vec<DeviceTransfer> {
    let chunk = |c: usize| chunk_range(len, topo.servers, c).len();
    let others = (0..topo.servers).filter(|&c| c != server);
    let scatter = others.clone().map(|c| DeviceTransfer {
        peer: topo.head_of(c),
        sent: Some(chunk(c) * 4),
        received: Some(chunk(server) * 4),
    });
    let gather = others.map(|c| DeviceTransfer {
        peer: topo.head_of(c),
        sent: Some(chunk(server) * 4),
        received: Some(chunk(c) * 4),
    });
    scatter.chain(gather).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cuda() -> Compute {
        Compute::Cuda { ordinals: None }
    }

    #[test]
    fn ranks_pick_the_transport_their_devices_allow() {
        let quic = InterTransport::Quic;
        let pick = |compute: &Compute, ordinals: &[usize], inter, forced| {
            select(compute, ordinals, inter, forced).map(|t| t.intra)
        };
        assert_eq!(
            pick(&Compute::Cpu, &[], quic, None).unwrap(),
            IntraTransport::Fabric
        );
        assert_eq!(
            pick(&cuda(), &[0, 1, 2, 3], quic, None).unwrap(),
            IntraTransport::Nccl
        );
        // NCCL refuses two ranks of a communicator on one device.
        for shared in [&[0, 0][..], &[0, 1, 0], &[3, 3, 3, 3]] {
            assert_eq!(
                pick(&cuda(), shared, quic, None).unwrap(),
                IntraTransport::DeviceCopies
            );
        }
        // One rank per server: nothing to share.
        assert_eq!(
            pick(&cuda(), &[0], quic, None).unwrap(),
            IntraTransport::Nccl
        );
        let nccl = InterTransport::Nccl;
        assert_eq!(
            pick(&cuda(), &[0, 1], nccl, None).unwrap(),
            IntraTransport::Nccl
        );
        let errors = [
            select(&cuda(), &[0, 0], nccl, None),
            select(&Compute::Cpu, &[], nccl, None),
            select(&Compute::Cpu, &[], quic, Some(IntraTransport::Nccl)),
            select(&cuda(), &[1, 1], quic, Some(IntraTransport::Nccl)),
        ];
        for e in errors {
            assert!(e.is_err(), "{e:?}");
        }
        // Forced host transports run anywhere (tests on CPU ranks).
        assert_eq!(
            pick(&Compute::Cpu, &[], nccl, Some(IntraTransport::NcclOnHost)).unwrap(),
            IntraTransport::NcclOnHost
        );
    }

    #[test]
    fn device_all_reduces_count_what_the_fabric_counts() {
        let topo = Topology {
            servers: 3,
            devices: 2,
        };
        // 10 values over 3 heads: chunks of 3, 3 and 4.
        let t = heads_transfers(topo, 1, 10);
        let bytes: Vec<(usize, Option<usize>, Option<usize>)> =
            t.iter().map(|t| (t.peer, t.sent, t.received)).collect();
        assert_eq!(
            bytes,
            [
                (0, Some(12), Some(12)),
                (4, Some(16), Some(12)),
                (0, Some(12), Some(12)),
                (4, Some(12), Some(16)),
            ]
        );
        let head = reduce_transfers(2, 2, [2, 3].into_iter(), 40);
        assert_eq!(
            head,
            [DeviceTransfer {
                peer: 3,
                sent: None,
                received: Some(40)
            }]
        );
        let device = broadcast_transfers(3, 2, [2, 3].into_iter(), 40);
        assert_eq!(
            device,
            [DeviceTransfer {
                peer: 2,
                sent: None,
                received: Some(40)
            }]
        );
    }
}
