//! [`Endpoint`]: one rank's handle on the fabric — point-to-point messages, the per-peer
//! exchange of GNN layers, hierarchical collectives, and the traffic counters.

use std::fmt;
use std::time::{Duration, Instant};

use crate::config::Topology;
use crate::counters::{CounterSet, Counters, LinkClass};
use crate::error::{FabricError, Result};
use crate::tag::{Op, Tag};
use crate::transport::{Envelope, Header, Payload, Transport, TransportError};

/// Bytes one operation moved between this rank and one peer on a device transport
/// ([`Endpoint::account_device_transfers`]); `None` where nothing went that way (an empty
/// message is `Some(0)` and counts as a message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceTransfer {
    pub peer: usize,
    pub sent: Option<usize>,
    pub received: Option<usize>,
}

/// What one message of [`Endpoint::exchange_collect`] may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expected {
    /// Exactly this many `f32` values.
    Exactly(usize),
    /// Exactly this many, or none: the sender may skip the transfer (an empty message says
    /// so; SANCUS's stale boundary rows).
    ExactlyOrNone(usize),
}

impl Expected {
    /// The full length.
    pub fn full_len(self) -> usize {
        match self {
            Expected::Exactly(n) | Expected::ExactlyOrNone(n) => n,
        }
    }
}

/// One rank's handle on the fabric. `Send`, so it can move into its worker thread.
///
/// Ordering contract: messages from one rank to another are received in the order they were
/// sent, and each receive checks that the next message from the peer carries the expected tag
/// and operation ([`FabricError::TagMismatch`] otherwise). All ranks must therefore call the
/// collectives ([`Endpoint::all_reduce_sum`], [`Endpoint::broadcast`], [`Endpoint::barrier`])
/// in the same order with the same tags, and the two sides of every point-to-point pair must
/// agree on the sequence of transfers between them — the usual SPMD discipline.
///
/// Sends never wait for the receiver, so "everyone sends, then everyone receives" (which is
/// what [`Endpoint::exchange`] does) cannot deadlock.
pub struct Endpoint {
    topology: Topology,
    rank: usize,
    transport: Box<dyn Transport>,
    recv_timeout: Duration,
    counters: CounterSet,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("rank", &self.rank)
            .field("topology", &self.topology)
            .field("recv_timeout", &self.recv_timeout)
            .finish_non_exhaustive()
    }
}

/// Adds `x` into `acc` element by element (`acc[i] = acc[i] + x[i]`, in index order).
fn add_into(acc: &mut [f32], x: &[f32]) {
    debug_assert_eq!(acc.len(), x.len());
    for (a, b) in acc.iter_mut().zip(x) {
        *a += *b;
    }
}

/// Element range of chunk `c` when `n` elements are split into `parts` nearly equal chunks:
/// head `c`'s chunk in the heads' all-reduce. Both the sender and the receiver of a chunk
/// compute it, so no lengths travel; device transports count their bytes by it too.
pub fn chunk_range(n: usize, parts: usize, c: usize) -> std::ops::Range<usize> {
    // u128: n * parts cannot overflow even for absurd sizes.
    let lo = (n as u128 * c as u128 / parts as u128) as usize;
    let hi = (n as u128 * (c as u128 + 1) / parts as u128) as usize;
    lo..hi
}

impl Endpoint {
    /// An endpoint for `rank` of `topology` over any [`Transport`]. [`crate::Fabric::new`]
    /// uses this with the in-process transport; a networked deployment will use it with its
    /// own transport.
    pub fn with_transport(
        topology: Topology,
        rank: usize,
        transport: Box<dyn Transport>,
        recv_timeout: Duration,
    ) -> Result<Endpoint> {
        if topology.servers == 0 || topology.devices == 0 {
            return Err(FabricError::Config(format!(
                "topology needs at least 1 server and 1 device, got {} × {}",
                topology.servers, topology.devices
            )));
        }
        if rank >= topology.world() {
            return Err(FabricError::Config(format!(
                "rank {rank} is outside the world of {} ranks",
                topology.world()
            )));
        }
        Ok(Endpoint {
            topology,
            rank,
            transport,
            recv_timeout,
            counters: CounterSet::default(),
        })
    }

    /// This endpoint's rank, `server * devices + device`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks, S × G.
    pub fn world(&self) -> usize {
        self.topology.world()
    }

    /// This rank's server.
    pub fn server(&self) -> usize {
        self.topology.server_of(self.rank)
    }

    /// This rank's device index within its server.
    pub fn device(&self) -> usize {
        self.topology.device_of(self.rank)
    }

    /// Number of servers S.
    pub fn servers(&self) -> usize {
        self.topology.servers
    }

    /// Devices per server G.
    pub fn devices(&self) -> usize {
        self.topology.devices
    }

    /// The cluster shape (rank ↔ server/device arithmetic, link class of a pair).
    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// True for device 0 of each server (the server's head in collectives).
    pub fn is_head(&self) -> bool {
        self.device() == 0
    }

    /// Link class between this rank and `peer`.
    pub fn link_class(&self, peer: usize) -> LinkClass {
        self.topology.class(self.rank, peer)
    }

    /// Current receive timeout.
    pub fn recv_timeout(&self) -> Duration {
        self.recv_timeout
    }

    /// Changes the receive timeout of this endpoint.
    pub fn set_recv_timeout(&mut self, timeout: Duration) {
        self.recv_timeout = timeout;
    }

    /// Snapshot of this rank's counters since creation or the last [`Self::take_counters`].
    pub fn counters(&self) -> Counters {
        self.counters.snapshot()
    }

    /// Snapshot of this rank's counters, resetting them to zero.
    pub fn take_counters(&mut self) -> Counters {
        std::mem::take(&mut self.counters).snapshot()
    }

    // ---------------------------------------------------------------- point-to-point

    /// Sends `data` to `peer`. Returns without waiting for the receiver.
    pub fn send(&mut self, peer: usize, data: Vec<f32>, tag: Tag) -> Result<()> {
        self.timed(tag, |ep| {
            ep.check_peer(peer, tag, Op::PointToPoint)?;
            ep.post(peer, Op::PointToPoint, tag, Payload::F32(data))
        })
    }

    /// Receives the next message from `peer`, which must be an `f32` message with `tag`.
    pub fn recv(&mut self, peer: usize, tag: Tag) -> Result<Vec<f32>> {
        self.timed(tag, |ep| {
            ep.check_peer(peer, tag, Op::PointToPoint)?;
            ep.take_f32(peer, Op::PointToPoint, tag, None)
        })
    }

    /// Like [`Self::recv`], and the message must hold exactly `len` values.
    pub fn recv_exact(&mut self, peer: usize, len: usize, tag: Tag) -> Result<Vec<f32>> {
        self.timed(tag, |ep| {
            ep.check_peer(peer, tag, Op::PointToPoint)?;
            ep.take_f32(peer, Op::PointToPoint, tag, Some(len))
        })
    }

    /// Sends raw bytes to `peer` (metadata, serialised structures).
    pub fn send_bytes(&mut self, peer: usize, data: Vec<u8>, tag: Tag) -> Result<()> {
        self.timed(tag, |ep| {
            ep.check_peer(peer, tag, Op::PointToPoint)?;
            ep.post(peer, Op::PointToPoint, tag, Payload::Bytes(data))
        })
    }

    /// Receives the next message from `peer`, which must be a byte message with `tag`.
    pub fn recv_bytes(&mut self, peer: usize, tag: Tag) -> Result<Vec<u8>> {
        self.timed(tag, |ep| {
            ep.check_peer(peer, tag, Op::PointToPoint)?;
            let payload = ep.take(peer, Op::PointToPoint, tag)?;
            ep.expect_bytes(payload, peer, Op::PointToPoint, tag)
        })
    }

    // ---------------------------------------------------------------- exchange

    /// All-to-all of per-peer contiguous buffers, the communication of one GNN layer.
    ///
    /// Sends every `(peer, buffer)` of `sends`, then receives exactly one message from every
    /// peer in `expect_from`, and returns them as `(peer, buffer)` in the order of
    /// `expect_from`. Peers with nothing to exchange are simply left out on both sides (an empty
    /// buffer may still be sent and is delivered as such); the caller's `expect_from` must list
    /// exactly the peers whose `sends` name this rank — a mismatch shows up as a
    /// [`FabricError::TagMismatch`] at the next transfer between the two ranks, or as a
    /// timeout. Each peer may appear at most once in `sends` and once in `expect_from`, and
    /// never this rank itself; these are checked before anything is sent.
    pub fn exchange(
        &mut self,
        sends: Vec<(usize, Vec<f32>)>,
        expect_from: &[usize],
        tag: Tag,
    ) -> Result<Vec<(usize, Vec<f32>)>> {
        self.timed(tag, |ep| {
            ep.exchange_impl(sends, expect_from.iter().map(|&p| (p, None)), tag)
        })
    }

    /// Like [`Self::exchange`], with the exact number of `f32` values expected from each peer
    /// (`expect` = `(peer, len)`); a message of another length is a
    /// [`FabricError::SizeMismatch`]. GNN layers know their halo sizes, so prefer this.
    pub fn exchange_sized(
        &mut self,
        sends: Vec<(usize, Vec<f32>)>,
        expect: &[(usize, usize)],
        tag: Tag,
    ) -> Result<Vec<(usize, Vec<f32>)>> {
        self.timed(tag, |ep| {
            ep.exchange_impl(
                sends,
                expect.iter().map(|&(p, n)| (p, Some(Expected::Exactly(n)))),
                tag,
            )
        })
    }

    /// The first half of [`Self::exchange_sized`]: sends every `(peer, buffer)` of `sends`
    /// and returns without waiting. The receiving side calls [`Self::exchange_collect`] with
    /// the same tag. A rank whose exchange also has a part on a device transport posts here,
    /// runs that part, then collects, so both parts are in flight together.
    pub fn exchange_post(&mut self, sends: Vec<(usize, Vec<f32>)>, tag: Tag) -> Result<()> {
        self.timed(tag, |ep| ep.post_exchange_impl(sends, tag))
    }

    /// The second half of [`Self::exchange_sized`]: receives from every `(peer, expected)` of
    /// `expect`, in that order, a message of the length `expected` allows.
    pub fn exchange_collect(
        &mut self,
        expect: &[(usize, Expected)],
        tag: Tag,
    ) -> Result<Vec<(usize, Vec<f32>)>> {
        self.timed(tag, |ep| {
            ep.collect_exchange_impl(expect.iter().map(|&(p, e)| (p, Some(e))), tag)
        })
    }

    fn exchange_impl(
        &mut self,
        sends: Vec<(usize, Vec<f32>)>,
        expect: impl Iterator<Item = (usize, Option<Expected>)> + Clone,
        tag: Tag,
    ) -> Result<Vec<(usize, Vec<f32>)>> {
        // Validate everything before the first send, so a bad call leaves no stray messages.
        self.check_peer_list(expect.clone().map(|(p, _)| p), tag, "expect_from")?;
        self.post_exchange_impl(sends, tag)?;
        self.collect_exchange_impl(expect, tag)
    }

    fn post_exchange_impl(&mut self, sends: Vec<(usize, Vec<f32>)>, tag: Tag) -> Result<()> {
        self.check_peer_list(sends.iter().map(|&(p, _)| p), tag, "sends")?;
        for (peer, data) in sends {
            self.post(peer, Op::Exchange, tag, Payload::F32(data))?;
        }
        Ok(())
    }

    /// Receives one exchange message from every `(peer, expected)` of `expect`, in order
    /// (`None`: any length).
    fn collect_exchange_impl(
        &mut self,
        expect: impl Iterator<Item = (usize, Option<Expected>)> + Clone,
        tag: Tag,
    ) -> Result<Vec<(usize, Vec<f32>)>> {
        self.check_peer_list(expect.clone().map(|(p, _)| p), tag, "expect_from")?;
        let mut out = Vec::new();
        for (peer, expected) in expect {
            let payload = self.take(peer, Op::Exchange, tag)?;
            let data = match (expected, &payload) {
                (Some(Expected::ExactlyOrNone(_)), Payload::F32(v)) if v.is_empty() => Vec::new(),
                _ => self.expect_f32(
                    payload,
                    peer,
                    Op::Exchange,
                    tag,
                    expected.map(Expected::full_len),
                )?,
            };
            out.push((peer, data));
        }
        Ok(out)
    }

    /// Every peer of an exchange list is another rank of the world, listed once.
    fn check_peer_list(
        &self,
        peers: impl Iterator<Item = usize>,
        tag: Tag,
        list: &str,
    ) -> Result<()> {
        let mut seen = vec![false; self.world()];
        for peer in peers {
            self.check_peer(peer, tag, Op::Exchange)?;
            if std::mem::replace(&mut seen[peer], true) {
                return Err(self.invalid_peer(
                    peer,
                    tag,
                    Op::Exchange,
                    &format!("listed twice in {list}"),
                ));
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- collectives

    /// Sums `buf` over all ranks, in place, hierarchically; every rank must call it with the
    /// same tag and the same length (checked: [`FabricError::SizeMismatch`]).
    ///
    /// 1. Each device sends its buffer to its server's head (device 0) over the intra class;
    ///    the head folds them in device order: `s = b₀ + b₁ + … + b_{G-1}` (left to right).
    /// 2. The S heads all-reduce over the inter class by reduce-scatter + all-gather: the
    ///    buffer is cut into S nearly equal chunks, head c owns chunk c and sums it over the
    ///    servers in server order `s₀ + s₁ + … + s_{S-1}`, then sends the reduced chunk to every
    ///    other head. Each head sends and receives 2·(S-1)/S of the buffer over its NIC.
    /// 3. Each head sends the result to the devices of its server.
    ///
    /// Every element is therefore `((b₀₀ + b₀₁ + …) + (b₁₀ + b₁₁ + …) + …)` with a fixed
    /// order, computed once and copied: bit-identical on all ranks and independent of thread
    /// timing. All bytes are counted under `tag` (use `Phase::AllReduce`).
    pub fn all_reduce_sum(&mut self, buf: &mut [f32], tag: Tag) -> Result<()> {
        self.timed(tag, |ep| ep.all_reduce_impl(buf, tag))
    }

    fn all_reduce_impl(&mut self, buf: &mut [f32], tag: Tag) -> Result<()> {
        let topo = self.topology;
        let server = self.server();
        let n = buf.len();
        let head = topo.head_of(server);
        if !self.is_head() {
            self.post(head, Op::ReduceToHead, tag, Payload::F32(buf.to_vec()))?;
            let result = self.take_f32(head, Op::HeadToDevices, tag, Some(n))?;
            buf.copy_from_slice(&result);
            return Ok(());
        }
        // Step 1: fold the server's devices in device order into the head's own buffer.
        for device in 1..topo.devices {
            let v = self.take_f32(topo.rank_of(server, device), Op::ReduceToHead, tag, Some(n))?;
            add_into(buf, &v);
        }
        // Step 2: reduce-scatter + all-gather among heads, summing in server order.
        self.heads_all_reduce_impl(buf, tag)?;
        // Step 3: hand the result to the server's devices.
        for device in 1..topo.devices {
            let rank = topo.rank_of(server, device);
            self.post(rank, Op::HeadToDevices, tag, Payload::F32(buf.to_vec()))?;
        }
        Ok(())
    }

    /// Step 2 of [`Self::all_reduce_sum`] alone: sums `buf` over the servers' heads (device 0
    /// of each server), in server order, by reduce-scatter + all-gather over the inter class.
    /// Only heads call it, all with the same tag and length; it is how a server whose devices
    /// reduce among themselves on another transport (NCCL, device copies) joins the others.
    pub fn heads_all_reduce_sum(&mut self, buf: &mut [f32], tag: Tag) -> Result<()> {
        if !self.is_head() {
            return Err(self.invalid_peer(
                self.rank,
                tag,
                Op::HeadReduceScatter,
                "only a server's head (device 0) joins the heads' all-reduce",
            ));
        }
        self.timed(tag, |ep| ep.heads_all_reduce_impl(buf, tag))
    }

    fn heads_all_reduce_impl(&mut self, buf: &mut [f32], tag: Tag) -> Result<()> {
        let topo = self.topology;
        let server = self.server();
        let n = buf.len();
        let s_count = topo.servers;
        if s_count > 1 {
            for c in (0..s_count).filter(|&c| c != server) {
                let part = buf[chunk_range(n, s_count, c)].to_vec();
                self.post(
                    topo.head_of(c),
                    Op::HeadReduceScatter,
                    tag,
                    Payload::F32(part),
                )?;
            }
            let mine = chunk_range(n, s_count, server);
            let mut parts: Vec<Option<Vec<f32>>> = vec![None; s_count];
            for c in (0..s_count).filter(|&c| c != server) {
                let part = self.take_f32(
                    topo.head_of(c),
                    Op::HeadReduceScatter,
                    tag,
                    Some(mine.len()),
                )?;
                parts[c] = Some(part);
            }
            let own = &buf[mine.clone()];
            // Left fold in server order; the first term is copied rather than added to zero
            // so that the result does not depend on how the fold starts (-0.0 + 0.0 = 0.0).
            let mut acc = parts[0].take().unwrap_or_else(|| own.to_vec());
            for part in parts.iter().skip(1) {
                match part {
                    Some(p) => add_into(&mut acc, p),
                    None => add_into(&mut acc, own),
                }
            }
            buf[mine.clone()].copy_from_slice(&acc);
            for c in (0..s_count).filter(|&c| c != server) {
                self.post(
                    topo.head_of(c),
                    Op::HeadAllGather,
                    tag,
                    Payload::F32(acc.clone()),
                )?;
            }
            for c in (0..s_count).filter(|&c| c != server) {
                let range = chunk_range(n, s_count, c);
                let part =
                    self.take_f32(topo.head_of(c), Op::HeadAllGather, tag, Some(range.len()))?;
                buf[range].copy_from_slice(&part);
            }
        }
        Ok(())
    }

    /// Accounts bytes that moved between this rank and `peer` outside the fabric, on a device
    /// transport (NCCL, device-to-device copies), under `tag` and the pair's link class, so
    /// counters, reports and the checks against the plans' predictions keep their meaning
    /// whichever transport carried the rows. `op_seconds` is the wall time of the operation
    /// the transfers belong to (counted once per call, as the fabric's own calls are).
    pub fn account_device_transfers(
        &mut self,
        tag: Tag,
        op_seconds: Duration,
        transfers: impl IntoIterator<Item = DeviceTransfer>,
    ) {
        for t in transfers {
            let class = self.topology.class(self.rank, t.peer);
            if let Some(bytes) = t.sent {
                self.counters.add_sent(tag, class, bytes);
            }
            if let Some(bytes) = t.received {
                self.counters.add_received(tag, class, bytes);
            }
        }
        self.counters.add_call(tag, op_seconds);
    }

    /// Copies `buf` of rank `root` into `buf` of every rank. All ranks must pass buffers of
    /// the same length ([`FabricError::SizeMismatch`] otherwise). Hierarchical: the root sends
    /// to the head of every other server (inter class) and to the other devices of its own
    /// server; each other head forwards to its devices (intra class).
    pub fn broadcast(&mut self, buf: &mut [f32], root: usize, tag: Tag) -> Result<()> {
        self.timed(tag, |ep| {
            let mine = (ep.rank == root).then(|| Payload::F32(buf.to_vec()));
            let (payload, from, op) = ep.broadcast_impl(mine, root, tag)?;
            if ep.rank != root {
                let data = ep.expect_f32(payload, from, op, tag, Some(buf.len()))?;
                buf.copy_from_slice(&data);
            }
            Ok(())
        })
    }

    /// Broadcasts a byte string of any length from `root`; `data` is ignored on other ranks
    /// (pass an empty vector). Returns the root's bytes on every rank.
    pub fn broadcast_bytes(&mut self, data: Vec<u8>, root: usize, tag: Tag) -> Result<Vec<u8>> {
        self.timed(tag, |ep| {
            let mine = (ep.rank == root).then_some(Payload::Bytes(data));
            let (payload, from, op) = ep.broadcast_impl(mine, root, tag)?;
            ep.expect_bytes(payload, from, op, tag)
        })
    }

    /// Returns the payload and, for error messages, whom it came from and with which op.
    fn broadcast_impl(
        &mut self,
        mine: Option<Payload>,
        root: usize,
        tag: Tag,
    ) -> Result<(Payload, usize, Op)> {
        let topo = self.topology;
        if root >= topo.world() {
            return Err(self.invalid_peer(
                root,
                tag,
                Op::BroadcastFromRoot,
                &format!("root is outside the world of {} ranks", topo.world()),
            ));
        }
        let root_server = topo.server_of(root);
        let server = self.server();
        if let Some(payload) = mine {
            let mut targets: Vec<usize> = (0..topo.servers)
                .filter(|&s| s != root_server)
                .map(|s| topo.head_of(s))
                .collect();
            targets.extend(
                (0..topo.devices)
                    .map(|d| topo.rank_of(root_server, d))
                    .filter(|&r| r != root),
            );
            for &t in &targets {
                self.post(t, Op::BroadcastFromRoot, tag, payload.clone())?;
            }
            return Ok((payload, root, Op::BroadcastFromRoot));
        }
        if server == root_server || self.is_head() {
            let payload = self.take(root, Op::BroadcastFromRoot, tag)?;
            if server != root_server {
                for device in 1..topo.devices {
                    let rank = topo.rank_of(server, device);
                    self.post(rank, Op::BroadcastFromHead, tag, payload.clone())?;
                }
            }
            return Ok((payload, root, Op::BroadcastFromRoot));
        }
        let head = topo.head_of(server);
        let payload = self.take(head, Op::BroadcastFromHead, tag)?;
        Ok((payload, head, Op::BroadcastFromHead))
    }

    /// Returns once every rank has entered the barrier with this tag (an all-reduce of an
    /// empty buffer: zero payload bytes, but the full message pattern).
    pub fn barrier(&mut self, tag: Tag) -> Result<()> {
        self.timed(tag, |ep| ep.all_reduce_impl(&mut [], tag))
    }

    // ---------------------------------------------------------------- internals

    fn timed<R>(&mut self, tag: Tag, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        let start = Instant::now();
        let result = f(self);
        self.counters.add_call(tag, start.elapsed());
        result
    }

    fn invalid_peer(&self, peer: usize, tag: Tag, op: Op, reason: &str) -> FabricError {
        FabricError::InvalidPeer {
            rank: self.rank,
            peer,
            tag,
            op,
            reason: reason.to_string(),
        }
    }

    fn check_peer(&self, peer: usize, tag: Tag, op: Op) -> Result<()> {
        if peer >= self.world() {
            return Err(self.invalid_peer(
                peer,
                tag,
                op,
                &format!("outside the world of {} ranks", self.world()),
            ));
        }
        if peer == self.rank {
            return Err(self.invalid_peer(peer, tag, op, "a rank cannot send to itself"));
        }
        Ok(())
    }

    fn transport_error(
        &self,
        e: TransportError,
        peer: usize,
        tag: Tag,
        op: Op,
        waited: Duration,
    ) -> FabricError {
        match e {
            TransportError::Disconnected => FabricError::PeerGone {
                rank: self.rank,
                peer,
                tag,
                op,
            },
            TransportError::Timeout => FabricError::Timeout {
                rank: self.rank,
                peer,
                tag,
                op,
                waited,
            },
            TransportError::Failed(message) => FabricError::Transport {
                rank: self.rank,
                peer,
                tag,
                op,
                message,
            },
        }
    }

    /// Sends one message and counts it.
    fn post(&mut self, peer: usize, op: Op, tag: Tag, payload: Payload) -> Result<()> {
        let bytes = payload.byte_len();
        let envelope = Envelope {
            header: Header { tag, op },
            payload,
        };
        self.transport
            .send(peer, envelope)
            .map_err(|e| self.transport_error(e, peer, tag, op, Duration::ZERO))?;
        self.counters
            .add_sent(tag, self.topology.class(self.rank, peer), bytes);
        Ok(())
    }

    /// Receives the next message from `peer`, checks its header and counts it.
    fn take(&mut self, peer: usize, op: Op, tag: Tag) -> Result<Payload> {
        let class = self.topology.class(self.rank, peer);
        let start = Instant::now();
        let received = self.transport.recv(peer, self.recv_timeout);
        let waited = start.elapsed();
        self.counters.add_wait(tag, class, waited);
        let envelope = received.map_err(|e| self.transport_error(e, peer, tag, op, waited))?;
        let expected = Header { tag, op };
        if envelope.header != expected {
            return Err(FabricError::TagMismatch {
                rank: self.rank,
                peer,
                expected: tag,
                expected_op: op,
                got: envelope.header.tag,
                got_op: envelope.header.op,
            });
        }
        self.counters
            .add_received(tag, class, envelope.payload.byte_len());
        Ok(envelope.payload)
    }

    fn take_f32(&mut self, peer: usize, op: Op, tag: Tag, len: Option<usize>) -> Result<Vec<f32>> {
        let payload = self.take(peer, op, tag)?;
        self.expect_f32(payload, peer, op, tag, len)
    }

    fn expect_f32(
        &self,
        payload: Payload,
        peer: usize,
        op: Op,
        tag: Tag,
        len: Option<usize>,
    ) -> Result<Vec<f32>> {
        match payload {
            Payload::F32(v) => match len {
                Some(expected) if v.len() != expected => Err(FabricError::SizeMismatch {
                    rank: self.rank,
                    peer,
                    tag,
                    op,
                    expected,
                    got: v.len(),
                    unit: "f32 values",
                }),
                _ => Ok(v),
            },
            other => Err(FabricError::PayloadKind {
                rank: self.rank,
                peer,
                tag,
                op,
                expected: "f32 values",
                got: other.kind(),
            }),
        }
    }

    fn expect_bytes(&self, payload: Payload, peer: usize, op: Op, tag: Tag) -> Result<Vec<u8>> {
        match payload {
            Payload::Bytes(v) => Ok(v),
            other => Err(FabricError::PayloadKind {
                rank: self.rank,
                peer,
                tag,
                op,
                expected: "bytes",
                got: other.kind(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_exactly() {
        for n in 0..40 {
            for parts in 1..7 {
                let mut next = 0;
                for c in 0..parts {
                    let r = chunk_range(n, parts, c);
                    assert_eq!(r.start, next, "n={n} parts={parts} c={c}");
                    assert!(r.end >= r.start);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn endpoint_is_send() {
        fn assert_send<T: Send>() {}
        assert_send::<Endpoint>();
    }
}
