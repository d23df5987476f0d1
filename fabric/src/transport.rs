//! The seam between "move these bytes to that rank" and everything above it.
//!
//! A [`Transport`] delivers [`Envelope`]s between ranks with per-pair FIFO order and reports
//! a vanished peer or a timeout as an error. [`crate::Endpoint`] builds accounting, tag checks
//! and collectives on top, so a later transport (QUIC between daemons for the inter-server
//! class, NCCL for the intra class) only has to implement [`Transport::send`] and
//! [`Transport::recv`]. [`ChannelTransport`] is the in-process implementation: one unbounded
//! channel per ordered pair of ranks, plus optional link emulation ([`LinkEmulator`]).

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::{LinkModel, Topology};
use crate::counters::LinkClass;
use crate::tag::{Op, Tag};

/// What a message is: its tag and the fabric operation it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    /// Caller's tag.
    pub tag: Tag,
    /// Fabric operation (and step).
    pub op: Op,
}

/// Message body: `f32` values (features, gradients) or raw bytes (metadata).
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    /// A buffer of `f32` values; 4 payload bytes each.
    F32(Vec<f32>),
    /// Raw bytes.
    Bytes(Vec<u8>),
}

impl Payload {
    /// Payload size in bytes (what the accounting and the link model count).
    pub fn byte_len(&self) -> usize {
        match self {
            Payload::F32(v) => std::mem::size_of_val(v.as_slice()),
            Payload::Bytes(v) => v.len(),
        }
    }

    /// "f32 values" or "bytes", for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Payload::F32(_) => "f32 values",
            Payload::Bytes(_) => "bytes",
        }
    }
}

/// One message.
#[derive(Clone, Debug, PartialEq)]
pub struct Envelope {
    /// Tag and operation, checked by the receiver.
    pub header: Header,
    /// Body.
    pub payload: Payload,
}

/// Failures a transport reports; [`crate::Endpoint`] adds rank, tag and operation to them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransportError {
    /// The peer's side of the link is gone (dropped endpoint, closed connection).
    Disconnected,
    /// Nothing arrived within the timeout.
    Timeout,
    /// Anything else, described.
    Failed(String),
}

/// Moves envelopes between ranks. Implementations must keep per-pair FIFO order (messages from
/// rank a to rank b are received by b in the order a sent them), must not block in `send` on
/// the receiver (so that "everyone sends, then everyone receives" cannot deadlock), and must
/// turn a vanished peer into [`TransportError::Disconnected`] rather than waiting forever.
pub trait Transport: Send {
    /// Sends `envelope` to rank `to`. Must not wait for the receiver to call `recv`.
    fn send(&mut self, to: usize, envelope: Envelope) -> Result<(), TransportError>;

    /// Receives the next envelope from rank `from`, waiting at most `timeout` for it to arrive.
    fn recv(&mut self, from: usize, timeout: Duration) -> Result<Envelope, TransportError>;
}

/// What travels through an in-process channel: the envelope and, under link emulation, the
/// instant before which the receiver must not see it.
struct Packet {
    envelope: Envelope,
    deliver_at: Option<Instant>,
}

/// In-process transport: one unbounded channel per ordered pair of ranks. Dropping it drops its
/// senders, so every peer blocked on a message from this rank wakes up with `Disconnected`
/// (after draining what was already sent).
pub struct ChannelTransport {
    rank: usize,
    /// `to_peer[p]`: sender of channel rank → p (`None` for p = rank).
    to_peer: Vec<Option<Sender<Packet>>>,
    /// `from_peer[p]`: receiver of channel p → rank (`None` for p = rank).
    from_peer: Vec<Option<Receiver<Packet>>>,
    emulator: Option<Arc<LinkEmulator>>,
}

impl ChannelTransport {
    /// Builds the transports of all `topology.world()` ranks, index = rank. `emulator` is
    /// shared by all of them (`None`: deliver immediately).
    pub fn mesh(topology: Topology, emulator: Option<Arc<LinkEmulator>>) -> Vec<ChannelTransport> {
        let world = topology.world();
        let mut to_peer: Vec<Vec<Option<Sender<Packet>>>> = (0..world)
            .map(|_| (0..world).map(|_| None).collect())
            .collect();
        let mut from_peer: Vec<Vec<Option<Receiver<Packet>>>> = (0..world)
            .map(|_| (0..world).map(|_| None).collect())
            .collect();
        for (src, senders) in to_peer.iter_mut().enumerate() {
            for (dst, slot) in senders.iter_mut().enumerate() {
                if src != dst {
                    let (tx, rx) = channel();
                    *slot = Some(tx);
                    from_peer[dst][src] = Some(rx);
                }
            }
        }
        to_peer
            .into_iter()
            .zip(from_peer)
            .enumerate()
            .map(|(rank, (to_peer, from_peer))| ChannelTransport {
                rank,
                to_peer,
                from_peer,
                emulator: emulator.clone(),
            })
            .collect()
    }
}

impl Transport for ChannelTransport {
    fn send(&mut self, to: usize, envelope: Envelope) -> Result<(), TransportError> {
        let tx = self
            .to_peer
            .get(to)
            .and_then(Option::as_ref)
            .ok_or_else(|| TransportError::Failed(format!("no channel to rank {to}")))?;
        let deliver_at = self
            .emulator
            .as_ref()
            .and_then(|e| e.schedule(self.rank, to, envelope.payload.byte_len()));
        tx.send(Packet {
            envelope,
            deliver_at,
        })
        .map_err(|_| TransportError::Disconnected)
    }

    fn recv(&mut self, from: usize, timeout: Duration) -> Result<Envelope, TransportError> {
        let rx = self
            .from_peer
            .get(from)
            .and_then(Option::as_ref)
            .ok_or_else(|| TransportError::Failed(format!("no channel from rank {from}")))?;
        let packet = rx.recv_timeout(timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => TransportError::Timeout,
            RecvTimeoutError::Disconnected => TransportError::Disconnected,
        })?;
        if let Some(at) = packet.deliver_at {
            // The message "is still on the wire" until its modelled arrival.
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
        }
        Ok(packet.envelope)
    }
}

/// Token-bucket link emulation shared by all in-process endpoints (see the crate docs).
///
/// Buckets: per server one inter-server NIC per direction (egress, ingress); per device one
/// intra-server link per direction. Each bucket remembers the instant at which it becomes free.
pub struct LinkEmulator {
    topology: Topology,
    intra: LinkModel,
    inter: LinkModel,
    buckets: Mutex<Buckets>,
}

struct Buckets {
    nic_out: Vec<Instant>,
    nic_in: Vec<Instant>,
    dev_out: Vec<Instant>,
    dev_in: Vec<Instant>,
}

impl LinkEmulator {
    /// An emulator for `topology`; returns `None` when both models are unlimited, so that the
    /// default configuration never touches a clock or a lock.
    pub fn new(topology: Topology, intra: LinkModel, inter: LinkModel) -> Option<LinkEmulator> {
        if intra.is_unlimited() && inter.is_unlimited() {
            return None;
        }
        let now = Instant::now();
        Some(LinkEmulator {
            topology,
            intra,
            inter,
            buckets: Mutex::new(Buckets {
                nic_out: vec![now; topology.servers],
                nic_in: vec![now; topology.servers],
                dev_out: vec![now; topology.world()],
                dev_in: vec![now; topology.world()],
            }),
        })
    }

    /// Reserves the buckets a message of `bytes` from `from` to `to` needs and returns the
    /// instant at which it arrives, or `None` when its class is unlimited.
    pub fn schedule(&self, from: usize, to: usize, bytes: usize) -> Option<Instant> {
        let class = self.topology.class(from, to);
        let model = match class {
            LinkClass::IntraServer => self.intra,
            LinkClass::InterServer => self.inter,
        };
        if model.is_unlimited() {
            return None;
        }
        let now = Instant::now();
        let finish = match model.bandwidth_bytes_per_s {
            None => now,
            Some(bw) => {
                let busy = Duration::from_secs_f64(bytes as f64 / bw);
                // A poisoned lock only means another worker panicked while holding it; the
                // instants inside are still valid, so keep going (the panic is reported
                // through the dropped endpoint instead).
                let mut b = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
                let (out_idx, in_idx) = match class {
                    LinkClass::InterServer => {
                        (self.topology.server_of(from), self.topology.server_of(to))
                    }
                    LinkClass::IntraServer => (from, to),
                };
                let b = &mut *b;
                let (out, inn) = match class {
                    LinkClass::InterServer => (&mut b.nic_out, &mut b.nic_in),
                    LinkClass::IntraServer => (&mut b.dev_out, &mut b.dev_in),
                };
                let start = now.max(out[out_idx]).max(inn[in_idx]);
                let finish = start + busy;
                out[out_idx] = finish;
                inn[in_idx] = finish;
                finish
            }
        };
        Some(finish + model.latency)
    }
}
