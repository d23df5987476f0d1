//! [`NodeTransport`]: the hybrid transport of one rank hosted by a [`crate::QuicNode`] —
//! same-server peers over the fabric's in-process channels, other-server peers over QUIC.

use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Duration;

use grandis_fabric::{ChannelTransport, Envelope, Topology, Transport, TransportError};
use tokio::sync::mpsc as tokio_mpsc;

use crate::frame::encode_frame;
use crate::node::state::{Inbound, Shared};

/// Transport of one rank of a [`crate::QuicNode`]'s server; obtain all of them with
/// [`crate::QuicNode::take_transports`] and box each into
/// [`grandis_fabric::Endpoint::with_transport`].
///
/// * Same server: the fabric's [`ChannelTransport`] (a mesh over this server's G ranks).
/// * Other servers: the envelope is encoded into a frame on the caller's thread (so a too-large
///   message fails right here) and queued for the node's writer task of this (src, dst) pair,
///   which writes it on the pair's QUIC stream: per-pair order is the queue's order, and
///   `send` never waits for the network or the receiver.
/// * Receiving from another server reads the pair's queue, filled by the node's stream reader.
///   A peer that went away gives [`TransportError::Disconnected`]; a connection that ended
///   because of a protocol violation or a network failure gives [`TransportError::Failed`]
///   with a message naming the peer server.
///
/// Dropping it finishes this rank's outgoing streams after their queued frames, so remote
/// ranks waiting on it see `Disconnected` (like the in-process transport).
pub struct NodeTransport {
    rank: usize,
    topology: Topology,
    local: ChannelTransport,
    /// By global rank: queue to the writer of pair (rank → that rank); `None` on this server.
    out: Vec<Option<tokio_mpsc::UnboundedSender<Vec<u8>>>>,
    /// By global rank: queue filled by the reader of pair (that rank → rank).
    inbound: Vec<Option<std_mpsc::Receiver<Inbound>>>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for NodeTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeTransport")
            .field("rank", &self.rank)
            .field("topology", &self.topology)
            .finish_non_exhaustive()
    }
}

impl NodeTransport {
    pub(crate) fn new(
        rank: usize,
        local: ChannelTransport,
        out: Vec<Option<tokio_mpsc::UnboundedSender<Vec<u8>>>>,
        inbound: Vec<Option<std_mpsc::Receiver<Inbound>>>,
        shared: Arc<Shared>,
    ) -> NodeTransport {
        NodeTransport {
            rank,
            topology: shared.topology,
            local,
            out,
            inbound,
            shared,
        }
    }

    /// The global rank this transport belongs to.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The cluster shape.
    pub fn topology(&self) -> Topology {
        self.topology
    }

    fn check_peer(&self, peer: usize) -> Result<(), TransportError> {
        if peer >= self.topology.world() {
            return Err(TransportError::Failed(format!(
                "rank {peer} is outside the world of {} ranks",
                self.topology.world()
            )));
        }
        if peer == self.rank {
            return Err(TransportError::Failed(format!(
                "rank {peer} cannot send to itself"
            )));
        }
        Ok(())
    }

    fn is_local(&self, peer: usize) -> bool {
        self.topology.server_of(peer) == self.shared.server
    }

    /// `Disconnected`, or `Failed` with the recorded reason when the connection to `peer`'s
    /// server ended abnormally.
    fn gone(&self, peer: usize) -> TransportError {
        match self.shared.failure(self.topology.server_of(peer)) {
            Some(reason) => TransportError::Failed(reason),
            None => TransportError::Disconnected,
        }
    }
}

impl Transport for NodeTransport {
    fn send(&mut self, to: usize, envelope: Envelope) -> Result<(), TransportError> {
        self.check_peer(to)?;
        if self.is_local(to) {
            return self.local.send(self.topology.device_of(to), envelope);
        }
        if self.shared.is_closed(self.topology.server_of(to)) {
            return Err(self.gone(to));
        }
        let frame = encode_frame(&envelope, self.shared.max_frame_bytes).map_err(|e| {
            TransportError::Failed(format!("cannot send to rank {to} over QUIC: {e}"))
        })?;
        let tx = self.out[to]
            .as_ref()
            .ok_or_else(|| TransportError::Failed(format!("no QUIC queue to rank {to}")))?;
        tx.send(frame).map_err(|_| self.gone(to))
    }

    fn recv(&mut self, from: usize, timeout: Duration) -> Result<Envelope, TransportError> {
        self.check_peer(from)?;
        if self.is_local(from) {
            return self.local.recv(self.topology.device_of(from), timeout);
        }
        let rx = self.inbound[from]
            .as_ref()
            .ok_or_else(|| TransportError::Failed(format!("no QUIC queue from rank {from}")))?;
        match rx.recv_timeout(timeout) {
            Ok(Ok(envelope)) => Ok(envelope),
            Ok(Err(message)) => Err(TransportError::Failed(message)),
            Err(std_mpsc::RecvTimeoutError::Timeout) => Err(TransportError::Timeout),
            Err(std_mpsc::RecvTimeoutError::Disconnected) => Err(self.gone(from)),
        }
    }
}
