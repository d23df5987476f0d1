//! The same-device transport: ranks of one process hand each other device buffers over
//! channels and copy them device to device on their own stream. NCCL refuses two ranks of one
//! communicator on one GPU, so this is how ranks that share a GPU (a 2 × 2 plan on one card)
//! exchange rows without a host round trip.
//!
//! Ordering: a sender copies what it sends into a new buffer on its stream and synchronises
//! before handing the buffer over, so the receiver's stream only ever reads finished data. The
//! receiver copies it into a buffer of its own (which is also what makes ranks on different
//! GPUs of one process correct: the copy goes through unified addressing) and synchronises
//! before dropping the sender's buffer, whose memory returns to the sender's stream.

use std::any::Any;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use grandis_engine::Backend;
use grandis_fabric::Topology;

use super::device_link::{receive, DeviceLink, Labelled};

/// One handed-over buffer: its payload is the `Arc<B::Buf>` itself.
type Parcel = Labelled<Box<dyn Any + Send>>;

/// A rank's ends of the channels to and from the other ranks of its server.
struct Ends {
    out: HashMap<usize, Sender<Parcel>>,
    inbox: HashMap<usize, Receiver<Parcel>>,
}

/// The channels between every two ranks of each server among a process's ranks; each rank
/// takes its ends once ([`CopyHub::join`]). A rank that fails drops its ends, and a peer
/// waiting on it learns so at once instead of at the timeout.
pub(crate) struct CopyHub {
    ends: Mutex<HashMap<usize, Ends>>,
}

impl CopyHub {
    /// Channels among the ranks `ranks` (global ranks of `topology`), paired per server.
    pub fn new(topology: Topology, ranks: &[usize]) -> CopyHub {
        let mut ends: HashMap<usize, Ends> = ranks
            .iter()
            .map(|&r| {
                let e = Ends {
                    out: HashMap::new(),
                    inbox: HashMap::new(),
                };
                (r, e)
            })
            .collect();
        for &from in ranks {
            for &to in ranks {
                if from != to && topology.server_of(from) == topology.server_of(to) {
                    let (tx, rx) = channel();
                    ends.get_mut(&from).map(|e| e.out.insert(to, tx));
                    ends.get_mut(&to).map(|e| e.inbox.insert(from, rx));
                }
            }
        }
        CopyHub {
            ends: Mutex::new(ends),
        }
    }

    /// The link of `rank`, whose members are the ranks of its server.
    pub fn join<B: Backend>(
        &self,
        topology: Topology,
        rank: usize,
        timeout: Duration,
    ) -> anyhow::Result<DeviceCopies<B>> {
        let ends = self
            .ends
            .lock()
            .map_err(|_| anyhow::anyhow!("device-copy channels poisoned"))?
            .remove(&rank)
            .with_context(|| {
                format!("rank {rank} has no device-copy channels (or joined twice)")
            })?;
        let server = topology.server_of(rank);
        Ok(DeviceCopies {
            rank,
            members: topology.ranks_of(server).collect(),
            ends,
            timeout,
            backend: PhantomData,
        })
    }
}

/// The same-device link of one rank ([`DeviceLink`] over [`CopyHub`] channels).
pub(crate) struct DeviceCopies<B> {
    rank: usize,
    members: Vec<usize>,
    ends: Ends,
    timeout: Duration,
    backend: PhantomData<fn() -> B>,
}

impl<B: Backend> DeviceCopies<B>
where
    B::Buf: 'static,
{
    /// A copy of `buf[range]` on this rank's stream, finished (synchronise after the last).
    fn copy_out(b: &B, buf: &B::Buf, range: Range<usize>) -> anyhow::Result<B::Buf> {
        let mut copy = b.alloc(range.len())?;
        b.copy_range(buf, range.start, &mut copy, 0, range.len())?;
        Ok(copy)
    }

    fn post(
        &self,
        to: usize,
        what: &'static str,
        buf: Arc<B::Buf>,
        len: usize,
    ) -> anyhow::Result<()> {
        let parcel = Parcel {
            what,
            len,
            payload: Box::new(buf),
        };
        self.ends
            .out
            .get(&to)
            .with_context(|| format!("rank {to} is not on rank {}'s server", self.rank))?
            .send(parcel)
            .map_err(|_| anyhow::anyhow!("rank {to} is gone (its device-copy channel closed)"))
    }

    fn take(&self, from: usize, what: &'static str, len: usize) -> anyhow::Result<Arc<B::Buf>> {
        let inbox = self
            .ends
            .inbox
            .get(&from)
            .with_context(|| format!("rank {from} is not on rank {}'s server", self.rank))?;
        receive(
            inbox,
            "device copies",
            self.rank,
            from,
            (what, len),
            self.timeout,
        )?
        .downcast::<Arc<B::Buf>>()
        .map(|b| *b)
        .map_err(|_| anyhow::anyhow!("rank {from} sent a buffer of another backend"))
    }

    fn root(&self) -> usize {
        self.members[0]
    }
}

impl<B: Backend> DeviceLink<B> for DeviceCopies<B>
where
    B::Buf: 'static,
{
    fn reaches(&self, peer: usize) -> bool {
        peer != self.rank && self.members.contains(&peer)
    }

    fn exchange(
        &mut self,
        b: &B,
        sends: &[(usize, &B::Buf, Range<usize>)],
        recvs: &[(usize, usize)],
    ) -> anyhow::Result<Vec<B::Buf>> {
        let staged = sends
            .iter()
            .map(|(peer, buf, range)| {
                Ok((*peer, range.len(), Self::copy_out(b, buf, range.clone())?))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        if !staged.is_empty() {
            b.synchronize()?;
        }
        for (peer, len, copy) in staged {
            self.post(peer, "rows", Arc::new(copy), len)?;
        }
        let mut got = Vec::with_capacity(recvs.len());
        let mut theirs = Vec::with_capacity(recvs.len());
        for &(peer, len) in recvs {
            let foreign = self.take(peer, "rows", len)?;
            got.push(Self::copy_out(b, &foreign, 0..len)?);
            theirs.push(foreign);
        }
        if !theirs.is_empty() {
            b.synchronize()?;
        }
        Ok(got)
    }

    fn reduce(&mut self, b: &B, buf: &mut B::Buf, len: usize) -> anyhow::Result<()> {
        if self.rank != self.root() {
            let copy = Self::copy_out(b, buf, 0..len)?;
            b.synchronize()?;
            return self.post(self.root(), "reduce", Arc::new(copy), len);
        }
        let mut theirs = Vec::with_capacity(self.members.len());
        let mut scratch = b.alloc(len)?;
        for &m in &self.members[1..] {
            let foreign = self.take(m, "reduce", len)?;
            b.copy_range(&foreign, 0, &mut scratch, 0, len)?;
            // buf + 1·x: the fabric's left fold, value for value.
            b.axpy(1.0, &scratch, buf, len)?;
            theirs.push(foreign);
        }
        b.synchronize()?;
        Ok(())
    }

    fn broadcast(&mut self, b: &B, buf: &mut B::Buf, len: usize) -> anyhow::Result<()> {
        if self.rank == self.root() {
            let copy = Arc::new(Self::copy_out(b, buf, 0..len)?);
            b.synchronize()?;
            for &m in &self.members[1..] {
                self.post(m, "broadcast", copy.clone(), len)?;
            }
            return Ok(());
        }
        let foreign = self.take(self.root(), "broadcast", len)?;
        b.copy_range(&foreign, 0, buf, 0, len)?;
        b.synchronize()?;
        Ok(())
    }
}
