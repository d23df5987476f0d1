//! What every device transport shares, below them all: the [`DeviceLink`] operations and the
//! labelled messages (with [`receive`]) the in-process transports pass on their channels.

use std::ops::Range;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use grandis_engine::Backend;

/// A message between ranks of one process on a device transport's channels: what it is for,
/// its length in values, and its payload.
pub(crate) struct Labelled<T> {
    pub what: &'static str,
    pub len: usize,
    pub payload: T,
}

/// Receives the next message from rank `from` on `inbox` within `timeout`; it must be `what`
/// of `len` values. `transport` names the channels in errors ("device copies", "host NCCL").
pub(crate) fn receive<T>(
    inbox: &Receiver<Labelled<T>>,
    transport: &str,
    rank: usize,
    from: usize,
    (what, len): (&'static str, usize),
    timeout: Duration,
) -> anyhow::Result<T> {
    let message = inbox.recv_timeout(timeout).map_err(|e| match e {
        RecvTimeoutError::Timeout => {
            anyhow::anyhow!(
                "{transport}: rank {rank} waited {timeout:?} for {what} from rank {from}"
            )
        }
        RecvTimeoutError::Disconnected => anyhow::anyhow!("{transport}: rank {from} is gone"),
    })?;
    if message.what != what || message.len != len {
        anyhow::bail!(
            "{transport}: rank {rank} expected {what} of {len} values from rank {from}, got {} of {}",
            message.what,
            message.len
        );
    }
    Ok(message.payload)
}

/// One device transport between a group of ranks (`members`, global ranks, sorted; the first
/// is the group's root: a server's head, or global rank 0). Every member calls the same
/// operations in the same order.
pub(crate) trait DeviceLink<B: Backend>: Send {
    /// Whether `peer` (a global rank) is a member.
    fn reaches(&self, peer: usize) -> bool;
    /// Sends `sends` (`(peer, buffer, element range)`) and receives `len` values from every
    /// `(peer, len)` of `recvs` into new buffers of this rank, returned in that order.
    fn exchange(
        &mut self,
        b: &B,
        sends: &[(usize, &B::Buf, Range<usize>)],
        recvs: &[(usize, usize)],
    ) -> anyhow::Result<Vec<B::Buf>>;
    /// Sums the first `len` values of every member's `buf` into the root's, in member order
    /// (the root's own first); other members' buffers are left as they were.
    fn reduce(&mut self, b: &B, buf: &mut B::Buf, len: usize) -> anyhow::Result<()>;
    /// Copies the root's first `len` values into every member's `buf`.
    fn broadcast(&mut self, b: &B, buf: &mut B::Buf, len: usize) -> anyhow::Result<()>;
    /// Sums over all members, in member order, the result on every member.
    fn all_reduce(&mut self, b: &B, buf: &mut B::Buf, len: usize) -> anyhow::Result<()> {
        self.reduce(b, buf, len)?;
        self.broadcast(b, buf, len)
    }
}
