//! NCCL as a [`DeviceLink`]: the sequence of NCCL calls each exchange and collective makes
//! ([`NcclLink`]), written once against the [`Nccl`] trait, which the CUDA build implements
//! with the real library (`cuda_nccl`) and [`HostNccl`] on host buffers, so the sequence and the
//! numbers it produces are tested on machines without GPUs.
//!
//! An exchange is one group: `ncclGroupStart`, a send per peer, a receive per peer,
//! `ncclGroupEnd` (NCCL has no all-to-all; inside a group the transfers run together and
//! cannot deadlock on their order), then a wait. Empty transfers are left out on both sides
//! (both know the length). The weight gradients use `ncclReduce` to the server's head and
//! `ncclBroadcast` from it on the server's communicator, and `ncclAllReduce` on the heads'.
//! Every wait has the fabric's timeout: a communicator whose peer is gone is aborted and the
//! rank fails with an error instead of hanging.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use grandis_engine::Backend;

use super::device_link::{receive, DeviceLink, Labelled};

/// The NCCL calls the transports make, on device buffers of backend `B`. Ranks and roots are
/// ranks of the communicator; buffers are `B`'s, used on the backend's stream.
pub(crate) trait Nccl<B: Backend>: Send + Sized {
    /// A new communicator id (`ncclGetUniqueId`), made by the communicator's rank 0 and sent to
    /// the others.
    fn unique_id() -> anyhow::Result<Vec<u8>>;
    /// Joins communicator `id` as `rank` of `size` (`ncclCommInitRank`; returns once every
    /// member has joined).
    fn join(b: &B, id: &[u8], rank: usize, size: usize, timeout: Duration) -> anyhow::Result<Self>;
    fn group_start(&mut self) -> anyhow::Result<()>;
    fn group_end(&mut self) -> anyhow::Result<()>;
    /// `ncclSend` of `buf[range]` to `peer`.
    fn send(&mut self, b: &B, buf: &B::Buf, range: Range<usize>, peer: usize)
        -> anyhow::Result<()>;
    /// `ncclRecv` of `len` values from `peer` into `buf[..len]`.
    fn recv(&mut self, b: &B, buf: &mut B::Buf, len: usize, peer: usize) -> anyhow::Result<()>;
    /// In-place `ncclReduce` (sum) of `buf[..len]` to `root`.
    fn reduce(&mut self, b: &B, buf: &mut B::Buf, len: usize, root: usize) -> anyhow::Result<()>;
    /// In-place `ncclBroadcast` of `root`'s `buf[..len]`.
    fn broadcast(&mut self, b: &B, buf: &mut B::Buf, len: usize, root: usize)
        -> anyhow::Result<()>;
    /// In-place `ncclAllReduce` (sum) of `buf[..len]`.
    fn all_reduce(&mut self, b: &B, buf: &mut B::Buf, len: usize) -> anyhow::Result<()>;
    /// Waits until the calls queued so far have finished, or fails (and aborts the
    /// communicator) when a peer is gone or the timeout passes.
    fn wait(&mut self, b: &B) -> anyhow::Result<()>;
}

/// A communicator of `members` (global ranks, its rank i = `members[i]`) as a device link.
pub(crate) struct NcclLink<N> {
    comm: N,
    members: Vec<usize>,
    rank: usize,
}

impl<N> NcclLink<N> {
    /// The link of global rank `rank` on `comm`, whose ranks are `members`.
    pub fn new(comm: N, members: Vec<usize>, rank: usize) -> Self {
        NcclLink {
            comm,
            members,
            rank,
        }
    }

    /// The communicator (tests read [`HostNccl::calls`]).
    #[cfg(test)]
    pub fn comm(&self) -> &N {
        &self.comm
    }

    fn comm_rank(&self, peer: usize) -> anyhow::Result<usize> {
        self.members
            .iter()
            .position(|&m| m == peer)
            .with_context(|| format!("rank {peer} is not on this NCCL communicator"))
    }
}

impl<B: Backend, N: Nccl<B>> DeviceLink<B> for NcclLink<N> {
    fn reaches(&self, peer: usize) -> bool {
        peer != self.rank && self.members.contains(&peer)
    }

    fn exchange(
        &mut self,
        b: &B,
        sends: &[(usize, &B::Buf, Range<usize>)],
        recvs: &[(usize, usize)],
    ) -> anyhow::Result<Vec<B::Buf>> {
        // Every receive buffer exists before the group: NCCL writes into them asynchronously.
        let mut got = recvs
            .iter()
            .map(|&(_, len)| b.alloc(len))
            .collect::<Result<Vec<_>, _>>()?;
        let sends = sends
            .iter()
            .filter(|(_, _, range)| !range.is_empty())
            .map(|(peer, buf, range)| Ok((self.comm_rank(*peer)?, *buf, range.clone())))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let recv_ranks = recvs
            .iter()
            .map(|&(peer, len)| Ok((self.comm_rank(peer)?, len)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        if sends.is_empty() && recv_ranks.iter().all(|&(_, len)| len == 0) {
            return Ok(got);
        }
        self.comm.group_start()?;
        let queued = (|| {
            for (peer, buf, range) in sends {
                self.comm.send(b, buf, range, peer)?;
            }
            for (&(peer, len), buf) in recv_ranks.iter().zip(&mut got) {
                if len > 0 {
                    self.comm.recv(b, buf, len, peer)?;
                }
            }
            Ok::<_, anyhow::Error>(())
        })();
        // The group is closed whatever happened inside it, so the thread's NCCL state stays
        // balanced.
        let ended = self.comm.group_end();
        queued?;
        ended?;
        self.comm.wait(b)?;
        Ok(got)
    }

    fn reduce(&mut self, b: &B, buf: &mut B::Buf, len: usize) -> anyhow::Result<()> {
        self.comm.reduce(b, buf, len, 0)?;
        self.comm.wait(b)
    }

    fn broadcast(&mut self, b: &B, buf: &mut B::Buf, len: usize) -> anyhow::Result<()> {
        self.comm.broadcast(b, buf, len, 0)?;
        self.comm.wait(b)
    }

    fn all_reduce(&mut self, b: &B, buf: &mut B::Buf, len: usize) -> anyhow::Result<()> {
        self.comm.all_reduce(b, buf, len)?;
        self.comm.wait(b)
    }
}

/// One NCCL call as [`HostNccl`] records it (ranks of the communicator, counts in values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NcclCall {
    GroupStart,
    GroupEnd,
    Send { peer: usize, count: usize },
    Recv { peer: usize, count: usize },
    Reduce { root: usize, count: usize },
    Broadcast { root: usize, count: usize },
    AllReduce { count: usize },
    Wait,
}

/// One host "NCCL" message: the call that sent it and its values.
type Packet = Labelled<Vec<f32>>;

/// A host communicator's channels: `to[a][b]` sends from rank a to rank b, `from[b][a]`
/// receives them.
struct HostComm {
    to: Vec<Vec<Sender<Packet>>>,
    from: Vec<Vec<Mutex<Receiver<Packet>>>>,
}

/// Communicators being joined, by id; removed when the last member has joined.
type Joining = HashMap<Vec<u8>, (Arc<HostComm>, usize)>;
static JOINING: Mutex<Option<Joining>> = Mutex::new(None);

/// NCCL's semantics on host buffers (through the backend's download / upload), for ranks that
/// are threads of one process: it checks what NCCL would leave to a hang or corrupt data (a
/// transfer outside a group, a collective inside one, a send and a receive of different
/// lengths, a call the peer did not make) and records every call. Reductions sum in rank
/// order, as the fabric does, so its runs equal the fabric's value for value.
pub(crate) struct HostNccl {
    comm: Arc<HostComm>,
    rank: usize,
    size: usize,
    grouped: bool,
    timeout: Duration,
    calls: Vec<NcclCall>,
}

impl HostNccl {
    /// Every call made so far, in order.
    #[cfg(test)]
    pub fn calls(&self) -> &[NcclCall] {
        &self.calls
    }

    fn post(&self, to: usize, call: &'static str, data: Vec<f32>) -> anyhow::Result<()> {
        self.comm.to[self.rank][to]
            .send(Packet {
                what: call,
                len: data.len(),
                payload: data,
            })
            .map_err(|_| anyhow::anyhow!("host NCCL: rank {to} is gone"))
    }

    fn take(&self, from: usize, call: &'static str, len: usize) -> anyhow::Result<Vec<f32>> {
        let inbox = self.comm.from[self.rank][from]
            .lock()
            .map_err(|_| anyhow::anyhow!("host NCCL channel poisoned"))?;
        // Where NCCL would hang (a call that never comes) or corrupt memory (a length the peer
        // did not send), this is an error.
        receive(
            &inbox,
            "host NCCL",
            self.rank,
            from,
            (call, len),
            self.timeout,
        )
    }

    fn p2p(&mut self, call: NcclCall) -> anyhow::Result<()> {
        self.calls.push(call);
        if !self.grouped {
            bail!("host NCCL: {call:?} outside a group (the transports group every exchange)");
        }
        Ok(())
    }

    fn collective(&mut self, call: NcclCall) -> anyhow::Result<()> {
        self.calls.push(call);
        if self.grouped {
            bail!("host NCCL: {call:?} inside a group");
        }
        Ok(())
    }

    fn download<B: Backend>(
        b: &B,
        buf: &B::Buf,
        at: usize,
        len: usize,
    ) -> anyhow::Result<Vec<f32>> {
        let mut host = vec![0f32; len];
        b.download(buf, at, &mut host)?;
        Ok(host)
    }

    /// Sums every rank's values in rank order at `root`.
    fn fold_at_root(
        &self,
        mine: Vec<f32>,
        root: usize,
        call: &'static str,
    ) -> anyhow::Result<Vec<f32>> {
        let len = mine.len();
        let mut mine = Some(mine);
        let mut acc: Option<Vec<f32>> = None;
        for r in 0..self.size {
            let part = if r == root {
                mine.take().unwrap_or_default()
            } else {
                self.take(r, call, len)?
            };
            match &mut acc {
                None => acc = Some(part),
                Some(acc) => acc.iter_mut().zip(&part).for_each(|(a, x)| *a += *x),
            }
        }
        Ok(acc.unwrap_or_default())
    }
}

impl<B: Backend> Nccl<B> for HostNccl {
    fn unique_id() -> anyhow::Result<Vec<u8>> {
        // Unique within the process, which is as far as host communicators reach.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok([
            std::process::id().to_le_bytes().as_slice(),
            &n.to_le_bytes(),
        ]
        .concat())
    }

    fn join(_: &B, id: &[u8], rank: usize, size: usize, timeout: Duration) -> anyhow::Result<Self> {
        if rank >= size {
            bail!("host NCCL: rank {rank} of a communicator of {size}");
        }
        let comm = {
            let mut joining = JOINING
                .lock()
                .map_err(|_| anyhow::anyhow!("host NCCL registry poisoned"))?;
            let joining = joining.get_or_insert_with(HashMap::new);
            let entry = joining.entry(id.to_vec()).or_insert_with(|| {
                // to[a][b] sends from a to b; from[b][a] receives what a sent to b.
                let (to, mut from): (Vec<Vec<_>>, Vec<Vec<_>>) = (
                    (0..size).map(|_| Vec::new()).collect(),
                    (0..size).map(|_| Vec::new()).collect(),
                );
                let to = to
                    .into_iter()
                    .map(|mut row: Vec<Sender<Packet>>| {
                        for inbox in from.iter_mut() {
                            let (tx, rx) = channel();
                            row.push(tx);
                            inbox.push(Mutex::new(rx));
                        }
                        row
                    })
                    .collect();
                (Arc::new(HostComm { to, from }), 0)
            });
            entry.1 += 1;
            let comm = entry.0.clone();
            if entry.1 == size {
                joining.remove(id);
            }
            comm
        };
        Ok(HostNccl {
            comm,
            rank,
            size,
            grouped: false,
            timeout,
            calls: Vec::new(),
        })
    }

    fn group_start(&mut self) -> anyhow::Result<()> {
        self.calls.push(NcclCall::GroupStart);
        if std::mem::replace(&mut self.grouped, true) {
            bail!("host NCCL: nested group");
        }
        Ok(())
    }

    fn group_end(&mut self) -> anyhow::Result<()> {
        self.calls.push(NcclCall::GroupEnd);
        if !std::mem::replace(&mut self.grouped, false) {
            bail!("host NCCL: group end without a start");
        }
        Ok(())
    }

    fn send(
        &mut self,
        b: &B,
        buf: &B::Buf,
        range: Range<usize>,
        peer: usize,
    ) -> anyhow::Result<()> {
        self.p2p(NcclCall::Send {
            peer,
            count: range.len(),
        })?;
        let data = Self::download(b, buf, range.start, range.len())?;
        self.post(peer, "send", data)
    }

    fn recv(&mut self, b: &B, buf: &mut B::Buf, len: usize, peer: usize) -> anyhow::Result<()> {
        self.p2p(NcclCall::Recv { peer, count: len })?;
        // Inside the group every send was queued before the first receive (the sequence of
        // `NcclLink::exchange`), so a blocking receive here cannot wait on a send to come.
        let data = self.take(peer, "send", len)?;
        Ok(b.upload_into(buf, 0, &data)?)
    }

    fn reduce(&mut self, b: &B, buf: &mut B::Buf, len: usize, root: usize) -> anyhow::Result<()> {
        self.collective(NcclCall::Reduce { root, count: len })?;
        let mine = Self::download(b, buf, 0, len)?;
        if self.rank != root {
            return self.post(root, "reduce", mine);
        }
        let sum = self.fold_at_root(mine, root, "reduce")?;
        Ok(b.upload_into(buf, 0, &sum)?)
    }

    fn broadcast(
        &mut self,
        b: &B,
        buf: &mut B::Buf,
        len: usize,
        root: usize,
    ) -> anyhow::Result<()> {
        self.collective(NcclCall::Broadcast { root, count: len })?;
        if self.rank == root {
            let mine = Self::download(b, buf, 0, len)?;
            for r in (0..self.size).filter(|&r| r != root) {
                self.post(r, "broadcast", mine.clone())?;
            }
            return Ok(());
        }
        let data = self.take(root, "broadcast", len)?;
        Ok(b.upload_into(buf, 0, &data)?)
    }

    fn all_reduce(&mut self, b: &B, buf: &mut B::Buf, len: usize) -> anyhow::Result<()> {
        self.collective(NcclCall::AllReduce { count: len })?;
        let mine = Self::download(b, buf, 0, len)?;
        let sum = if self.rank == 0 {
            let sum = self.fold_at_root(mine, 0, "all_reduce")?;
            for r in 1..self.size {
                self.post(r, "all_reduce result", sum.clone())?;
            }
            sum
        } else {
            self.post(0, "all_reduce", mine)?;
            self.take(0, "all_reduce result", len)?
        };
        Ok(b.upload_into(buf, 0, &sum)?)
    }

    fn wait(&mut self, _: &B) -> anyhow::Result<()> {
        self.calls.push(NcclCall::Wait);
        if self.grouped {
            bail!("host NCCL: wait inside a group");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use grandis_engine::CpuBackend;

    const TIMEOUT: Duration = Duration::from_secs(20);

    /// Runs `work(comm rank, link, backend)` on every member of a new host communicator whose
    /// global ranks are `members`; returns each member's result and its calls.
    fn on_members<R: Send>(
        members: &[usize],
        work: impl Fn(usize, &mut NcclLink<HostNccl>, &CpuBackend) -> R + Sync,
    ) -> Vec<(R, Vec<NcclCall>)> {
        let id = <HostNccl as Nccl<CpuBackend>>::unique_id().unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..members.len())
                .map(|r| {
                    let (id, work) = (&id, &work);
                    s.spawn(move || {
                        let b = CpuBackend::new(Some(1)).unwrap();
                        let comm = HostNccl::join(&b, id, r, members.len(), TIMEOUT).unwrap();
                        let mut link = NcclLink::new(comm, members.to_vec(), members[r]);
                        let out = work(r, &mut link, &b);
                        (out, link.comm().calls().to_vec())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn an_exchange_is_one_group_of_sends_then_receives_and_empty_transfers_are_left_out() {
        let members = [4, 5, 6];
        // Rank i sends rank j (i + 1) * (j + 1) % 4 values, all equal to 10 i + j.
        let count = |i: usize, j: usize| (i + 1) * (j + 1) % 4;
        let results = on_members(&members, |r, link, b| {
            let peers: Vec<usize> = (0..3).filter(|&j| j != r).collect();
            let bufs: Vec<Vec<f32>> = peers
                .iter()
                .map(|&j| vec![(10 * r + j) as f32; count(r, j)])
                .collect();
            let sends: Vec<_> = peers
                .iter()
                .zip(&bufs)
                .map(|(&j, buf)| (members[j], buf, 0..buf.len()))
                .collect();
            let recvs: Vec<_> = peers.iter().map(|&j| (members[j], count(j, r))).collect();
            let got = DeviceLink::<CpuBackend>::exchange(link, b, &sends, &recvs).unwrap();
            for (&j, data) in peers.iter().zip(&got) {
                assert_eq!(data, &vec![(10 * j + r) as f32; count(j, r)]);
            }
        });
        for (r, (_, calls)) in results.iter().enumerate() {
            let mut want = vec![NcclCall::GroupStart];
            let peers = (0..3).filter(|&j| j != r);
            want.extend(
                peers
                    .clone()
                    .filter(|&j| count(r, j) > 0)
                    .map(|peer| NcclCall::Send {
                        peer,
                        count: count(r, peer),
                    }),
            );
            want.extend(
                peers
                    .filter(|&j| count(j, r) > 0)
                    .map(|peer| NcclCall::Recv {
                        peer,
                        count: count(peer, r),
                    }),
            );
            want.extend([NcclCall::GroupEnd, NcclCall::Wait]);
            assert_eq!(calls, &want, "comm rank {r}");
        }
    }

    #[test]
    fn gradients_reduce_to_the_root_and_come_back_by_broadcast_in_rank_order() {
        let results = on_members(&[0, 1, 2, 3], |r, link, b| {
            // Values whose float sum depends on the order: rank order is the fabric's.
            let mut buf = vec![1e8, 1.0 + r as f32, -(r as f32) * 0.1];
            DeviceLink::<CpuBackend>::reduce(link, b, &mut buf, 3).unwrap();
            let reduced = buf.clone();
            DeviceLink::<CpuBackend>::broadcast(link, b, &mut buf, 3).unwrap();
            let mut all = vec![r as f32, 0.5];
            DeviceLink::<CpuBackend>::all_reduce(link, b, &mut all, 2).unwrap();
            (reduced, buf, all)
        });
        let ordered = |col: usize| {
            let v = [
                [1e8f32, 1.0, 0.0],
                [1e8, 2.0, -0.1],
                [1e8, 3.0, -0.2],
                [1e8, 4.0, -0.3],
            ];
            v[1..].iter().fold(v[0][col], |acc, row| acc + row[col])
        };
        let want: Vec<f32> = (0..3).map(ordered).collect();
        for (r, ((reduced, buf, all), calls)) in results.iter().enumerate() {
            if r == 0 {
                assert_eq!(reduced, &want);
            }
            assert_eq!(buf, &want, "rank {r} after the broadcast");
            assert_eq!(all, &vec![6.0, 2.0], "rank {r} after the all-reduce");
            assert_eq!(
                calls,
                &[
                    NcclCall::Reduce { root: 0, count: 3 },
                    NcclCall::Wait,
                    NcclCall::Broadcast { root: 0, count: 3 },
                    NcclCall::Wait,
                    NcclCall::AllReduce { count: 2 },
                    NcclCall::Wait,
                ]
            );
        }
    }

    #[test]
    fn a_length_the_peer_did_not_send_is_an_error_not_a_hang() {
        let results = on_members(&[0, 1], |r, link, b| {
            let buf = vec![1.0f32; 3];
            if r == 0 {
                DeviceLink::<CpuBackend>::exchange(link, b, &[(1, &buf, 0..3)], &[]).map(|_| ())
            } else {
                DeviceLink::<CpuBackend>::exchange(link, b, &[], &[(0, 4)]).map(|_| ())
            }
        });
        assert!(results[0].0.is_ok());
        let err = format!("{:#}", results[1].0.as_ref().unwrap_err());
        assert!(
            err.contains("expected send of 4 values from rank 0, got send of 3"),
            "{err}"
        );
    }
}
