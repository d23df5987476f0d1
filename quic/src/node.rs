//! [`QuicNode`]: one server's QUIC endpoint — connection set-up with mutual TLS and the hello
//! handshake, the per-pair stream writers and readers, wire statistics and refusals.
//!
//! Channels are created when the node is bound, not when a peer connects: the ranks' queues
//! exist from the start, so a rank can send before the connection to the destination server
//! is up (the frames wait in the queue) and a peer that connects early finds its receivers.
//! When the connection to server `s` is installed, its pending queue ends move into the tasks
//! of that connection; when the connection ends, those tasks end and drop them, which is how
//! the ranks learn that the peer is gone (`Disconnected`, or `Failed` with the reason when the
//! connection ended because of a protocol violation or a network failure).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use grandis_fabric::{Envelope, Topology};
use quinn::{ConnectionError, ReadError, ReadExactError, VarInt};
use serde::Serialize;
use tokio::sync::mpsc as tokio_mpsc;
use tokio::task::JoinHandle;

use crate::certs::{validate_node_name, NodeIdentity};
use crate::frame::{
    self, check_frame_len, decode_frame_body, Hello, Preamble, FRAME_OVERHEAD, HELLO_MAGIC,
    MAX_HELLO_BYTES, PREAMBLE_BYTES, PROTOCOL_VERSION,
};
use crate::transport::NodeTransport;
use crate::{tls, QuicError, Result};

/// Application close code: orderly shutdown of a node (peers see a plain `Disconnected`).
const CLOSE_SHUTDOWN: u32 = 0;
/// Application close code: the hello handshake was rejected.
const CLOSE_HANDSHAKE_REJECTED: u32 = 1;
/// Application close code: the peer sent malformed data.
const CLOSE_PROTOCOL_VIOLATION: u32 = 2;

/// At most this many refusals are kept (a misconfigured peer retrying must not grow memory).
const MAX_REFUSALS: usize = 256;

/// What arrives for a rank from a remote rank: an envelope, or the description of a malformed
/// frame on that pair's stream.
pub(crate) type Inbound = std::result::Result<Envelope, String>;

/// Everything a [`QuicNode`] needs.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Cluster shape (S servers × G devices); must be the same on every node.
    pub topology: Topology,
    /// Node name of each server, index = server; must be the same on every node.
    pub roster: Vec<String>,
    /// This node's server index (its name is `roster[server]`, matching its certificate).
    pub server: usize,
    /// UDP address to bind; port 0 picks a free port (see [`QuicNode::local_addr`]).
    pub listen: SocketAddr,
    /// Certificates and key of this node.
    pub identity: NodeIdentity,
    /// Largest frame (head + payload) sent or accepted; larger sends fail, larger incoming
    /// frames are a protocol violation of the peer.
    pub max_frame_bytes: usize,
    /// How long TLS + hello may take before a connection attempt fails.
    pub handshake_timeout: Duration,
    /// A connection with no traffic (not even keep-alives) for this long is lost.
    pub idle_timeout: Duration,
    /// Interval of QUIC keep-alive pings.
    pub keep_alive: Duration,
    /// Worker threads of the node's tokio runtime.
    pub worker_threads: usize,
}

impl NodeConfig {
    /// A configuration with defaults: 1 GiB frames, 10 s handshake, 30 s idle timeout, 5 s
    /// keep-alive, 2 runtime threads.
    pub fn new(
        topology: Topology,
        roster: Vec<String>,
        server: usize,
        listen: SocketAddr,
        identity: NodeIdentity,
    ) -> NodeConfig {
        NodeConfig {
            topology,
            roster,
            server,
            listen,
            identity,
            max_frame_bytes: frame::DEFAULT_MAX_FRAME_BYTES,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(5),
            worker_threads: 2,
        }
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(QuicError::Config(m));
        let t = self.topology;
        if t.servers == 0 || t.devices == 0 {
            return bad(format!(
                "topology needs at least 1 server and 1 device, got {} × {}",
                t.servers, t.devices
            ));
        }
        match t.servers.checked_mul(t.devices) {
            Some(w) if w <= u32::MAX as usize => {}
            _ => {
                return bad(format!(
                    "{} × {} ranks do not fit in u32",
                    t.servers, t.devices
                ))
            }
        }
        if self.roster.len() != t.servers {
            return bad(format!(
                "roster names {} nodes but the topology has {} servers",
                self.roster.len(),
                t.servers
            ));
        }
        for (i, name) in self.roster.iter().enumerate() {
            validate_node_name(name)?;
            if self.roster[..i]
                .iter()
                .any(|m| m.eq_ignore_ascii_case(name))
            {
                return bad(format!("node name {name:?} appears twice in the roster"));
            }
        }
        if self.server >= t.servers {
            return bad(format!(
                "server index {} is outside the {} servers",
                self.server, t.servers
            ));
        }
        if self.identity.name != self.roster[self.server] {
            return bad(format!(
                "this node's certificate is for {:?} but the roster names server {} {:?}",
                self.identity.name, self.server, self.roster[self.server]
            ));
        }
        if self.max_frame_bytes < frame::FRAME_HEAD_BYTES
            || self.max_frame_bytes > u32::MAX as usize
        {
            return bad(format!(
                "max_frame_bytes must be between {} and {}, got {}",
                frame::FRAME_HEAD_BYTES,
                u32::MAX,
                self.max_frame_bytes
            ));
        }
        for (what, d) in [
            ("handshake_timeout", self.handshake_timeout),
            ("idle_timeout", self.idle_timeout),
            ("keep_alive", self.keep_alive),
        ] {
            if d.is_zero() {
                return bad(format!("{what} must be positive"));
            }
        }
        if self.keep_alive >= self.idle_timeout {
            return bad(format!(
                "keep_alive ({:?}) must be shorter than idle_timeout ({:?})",
                self.keep_alive, self.idle_timeout
            ));
        }
        if self.worker_threads == 0 {
            return bad("worker_threads must be at least 1".into());
        }
        Ok(())
    }
}

/// A connection attempt that was refused (TLS failure, rejected hello, timeout).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Refusal {
    /// The other side's address.
    pub remote: SocketAddr,
    /// True when we dialled, false when the peer dialled us.
    pub outgoing: bool,
    /// Why.
    pub reason: String,
}

/// Bytes and frames actually written to and read from this node's QUIC data streams.
///
/// `bytes_sent = streams_opened × PREAMBLE_BYTES + frames_sent × FRAME_OVERHEAD +
/// payload_bytes_sent` (see [`WireStats::framing_bytes_sent`]), and `payload_bytes_sent` is
/// what the fabric counts as inter-server bytes sent by this server's ranks. Sent bytes are
/// counted once QUIC has taken them; received bytes before the envelope is handed to a rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct WireStats {
    /// Data streams opened (one per ordered remote pair that was used or closed).
    pub streams_opened: u64,
    /// Frames written.
    pub frames_sent: u64,
    /// Payload bytes inside the frames written.
    pub payload_bytes_sent: u64,
    /// All bytes written to data streams: preambles, frame heads, payloads.
    pub bytes_sent: u64,
    /// Data streams accepted from peers.
    pub streams_accepted: u64,
    /// Frames read and decoded.
    pub frames_received: u64,
    /// Payload bytes inside the frames read.
    pub payload_bytes_received: u64,
    /// All bytes read from data streams.
    pub bytes_received: u64,
}

impl WireStats {
    /// Sent bytes that are framing rather than payload.
    pub fn framing_bytes_sent(&self) -> u64 {
        self.streams_opened * PREAMBLE_BYTES as u64 + self.frames_sent * FRAME_OVERHEAD as u64
    }

    /// Received bytes that are framing rather than payload.
    pub fn framing_bytes_received(&self) -> u64 {
        self.streams_accepted * PREAMBLE_BYTES as u64 + self.frames_received * FRAME_OVERHEAD as u64
    }
}

#[derive(Default)]
struct Stats {
    streams_opened: AtomicU64,
    frames_sent: AtomicU64,
    payload_bytes_sent: AtomicU64,
    bytes_sent: AtomicU64,
    streams_accepted: AtomicU64,
    frames_received: AtomicU64,
    payload_bytes_received: AtomicU64,
    bytes_received: AtomicU64,
}

impl Stats {
    fn snapshot(&self) -> WireStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        WireStats {
            streams_opened: g(&self.streams_opened),
            frames_sent: g(&self.frames_sent),
            payload_bytes_sent: g(&self.payload_bytes_sent),
            bytes_sent: g(&self.bytes_sent),
            streams_accepted: g(&self.streams_accepted),
            frames_received: g(&self.frames_received),
            payload_bytes_received: g(&self.payload_bytes_received),
            bytes_received: g(&self.bytes_received),
        }
    }
}

fn add(a: &AtomicU64, n: usize) {
    a.fetch_add(n as u64, Ordering::Relaxed);
}

/// Queue ends of one peer server that wait for its connection.
struct Pending {
    /// Index `remote_device * G + local_device`: sender into the local rank's queue from the
    /// remote rank.
    inbound: Vec<Option<std_mpsc::Sender<Inbound>>>,
    /// Index `local_device * G + remote_device`: encoded frames from the local rank to the
    /// remote rank.
    outbound: Vec<Option<tokio_mpsc::UnboundedReceiver<Vec<u8>>>>,
}

enum PeerState {
    /// This node itself.
    Own,
    /// Not connected yet.
    Pending(Pending),
    /// Connected; the queue ends live in the connection's tasks.
    Connected {
        conn: quinn::Connection,
        addr: SocketAddr,
    },
    /// The connection ended; reconnecting is not supported (the queues are gone).
    Closed { reason: String },
}

pub(crate) struct Shared {
    pub(crate) topology: Topology,
    pub(crate) server: usize,
    pub(crate) roster: Vec<String>,
    pub(crate) max_frame_bytes: usize,
    hello: Hello,
    peers: Mutex<Vec<PeerState>>,
    changed: Condvar,
    /// Per server: why its connection failed, for errors that name the peer.
    failures: Vec<OnceLock<String>>,
    /// Per server: its connection has ended (sends to it fail from then on).
    closed: Vec<AtomicBool>,
    stats: Stats,
    refusals: Mutex<Vec<Refusal>>,
    /// Stream writer tasks, awaited by [`QuicNode::shutdown`].
    writers: Mutex<Vec<JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means a task panicked while holding it; the data is still consistent
    // enough to report errors, and panicking here too would hide the original problem.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    fn devices(&self) -> usize {
        self.topology.devices
    }

    /// "server 1 (b at 127.0.0.1:4433)", for messages.
    fn describe(&self, server: usize, addr: Option<SocketAddr>) -> String {
        let name = self.roster.get(server).map(String::as_str).unwrap_or("?");
        match addr {
            Some(a) => format!("server {server} ({name} at {a})"),
            None => format!("server {server} ({name})"),
        }
    }

    /// The reason recorded for a failed connection to `server`, if any.
    pub(crate) fn failure(&self, server: usize) -> Option<String> {
        self.failures.get(server).and_then(|f| f.get().cloned())
    }

    /// True once the connection to `server` has ended.
    pub(crate) fn is_closed(&self, server: usize) -> bool {
        self.closed
            .get(server)
            .is_some_and(|c| c.load(Ordering::Acquire))
    }

    fn record_failure(&self, server: usize, reason: String) {
        if let Some(slot) = self.failures.get(server) {
            let _ = slot.set(reason);
        }
    }

    fn refuse(&self, remote: SocketAddr, outgoing: bool, reason: String) {
        tracing::warn!(
            remote = %remote,
            direction = if outgoing { "outgoing" } else { "incoming" },
            reason = %reason,
            "refused QUIC connection"
        );
        let mut r = lock(&self.refusals);
        if r.len() < MAX_REFUSALS {
            r.push(Refusal {
                remote,
                outgoing,
                reason,
            });
        }
    }

    /// Checks a peer's hello against ours; returns its server index.
    fn check_hello(&self, remote: &Hello, expected_server: Option<usize>) -> Result<usize, String> {
        check_hello(&self.hello, &self.roster, remote, expected_server)
    }
}

/// Validates `remote` against `own` (see [`Shared::check_hello`]); public to the crate for
/// unit tests.
pub(crate) fn check_hello(
    own: &Hello,
    roster: &[String],
    remote: &Hello,
    expected_server: Option<usize>,
) -> Result<usize, String> {
    if remote.magic != HELLO_MAGIC {
        return Err("peer is not a grandis node (bad hello magic)".into());
    }
    if remote.version != own.version {
        return Err(format!(
            "protocol version mismatch: peer speaks version {}, this node version {}",
            remote.version, own.version
        ));
    }
    if (remote.servers, remote.devices) != (own.servers, own.devices) {
        return Err(format!(
            "cluster shape mismatch: peer has {} servers × {} devices, this node {} × {}",
            remote.servers, remote.devices, own.servers, own.devices
        ));
    }
    let s = remote.server as usize;
    if s >= roster.len() {
        return Err(format!(
            "peer claims server {s}, outside the {} servers",
            roster.len()
        ));
    }
    if s == own.server as usize {
        return Err(format!("peer claims this node's own server index {s}"));
    }
    if let Some(e) = expected_server {
        if s != e {
            return Err(format!("expected server {e}, peer says it is server {s}"));
        }
    }
    if remote.name != roster[s] {
        return Err(format!(
            "peer says it is {:?} but the roster names server {s} {:?}",
            remote.name, roster[s]
        ));
    }
    if remote.first_rank != remote.server * remote.devices || remote.ranks != remote.devices {
        return Err(format!(
            "peer's ranks {}..{} do not match server {s} of a {} × {} cluster",
            remote.first_rank,
            u64::from(remote.first_rank) + u64::from(remote.ranks),
            remote.servers,
            remote.devices
        ));
    }
    Ok(s)
}

/// One server's QUIC endpoint. See the crate documentation.
///
/// Blocking methods ([`QuicNode::connect`], [`QuicNode::establish`], ...) must be called from
/// ordinary threads, not from inside an async runtime.
pub struct QuicNode {
    runtime: Option<tokio::runtime::Runtime>,
    endpoint: quinn::Endpoint,
    client: quinn::ClientConfig,
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    handshake_timeout: Duration,
    /// Ends of the ranks' queues, handed out once by [`QuicNode::take_transports`].
    transports: Mutex<Option<Vec<NodeTransport>>>,
}

impl std::fmt::Debug for QuicNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicNode")
            .field("server", &self.shared.server)
            .field("name", &self.shared.roster[self.shared.server])
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

impl QuicNode {
    /// Validates `config`, starts the node's runtime, binds the UDP socket and starts
    /// accepting peers.
    pub fn bind(config: NodeConfig) -> Result<QuicNode> {
        config.validate()?;
        let t = config.topology;
        let g = t.devices;
        let bind_err = |m: String| QuicError::Bind {
            addr: config.listen,
            message: m,
        };
        // Streams per connection: one per ordered pair in each direction, plus a margin.
        let max_streams = u32::try_from(g * g + 16)
            .map_err(|_| QuicError::Config(format!("{g} devices per server is too many")))?;
        let transport = tls::transport_config(max_streams, config.idle_timeout, config.keep_alive)?;
        let server_cfg = tls::server_config(&config.identity, transport.clone())?;
        let client = tls::client_config(&config.identity, transport)?;

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.worker_threads)
            .thread_name(format!("grandis-quic-{}", config.server))
            .enable_all()
            .build()
            .map_err(|e| bind_err(format!("cannot start the tokio runtime: {e}")))?;
        let endpoint = {
            let _guard = runtime.enter();
            quinn::Endpoint::server(server_cfg, config.listen)
                .map_err(|e| bind_err(e.to_string()))?
        };
        let local_addr = endpoint
            .local_addr()
            .map_err(|e| bind_err(format!("cannot read the bound address: {e}")))?;

        // All queues, created now (see the module docs).
        let mut peers = Vec::with_capacity(t.servers);
        let mut out_tx: Vec<Vec<Option<tokio_mpsc::UnboundedSender<Vec<u8>>>>> = (0..g)
            .map(|_| (0..t.world()).map(|_| None).collect())
            .collect();
        let mut in_rx: Vec<Vec<Option<std_mpsc::Receiver<Inbound>>>> = (0..g)
            .map(|_| (0..t.world()).map(|_| None).collect())
            .collect();
        for s in 0..t.servers {
            if s == config.server {
                peers.push(PeerState::Own);
                continue;
            }
            let mut pending = Pending {
                inbound: (0..g * g).map(|_| None).collect(),
                outbound: (0..g * g).map(|_| None).collect(),
            };
            for local in 0..g {
                for remote in 0..g {
                    let remote_rank = t.rank_of(s, remote);
                    let (tx, rx) = std_mpsc::channel();
                    pending.inbound[remote * g + local] = Some(tx);
                    in_rx[local][remote_rank] = Some(rx);
                    let (tx, rx) = tokio_mpsc::unbounded_channel();
                    pending.outbound[local * g + remote] = Some(rx);
                    out_tx[local][remote_rank] = Some(tx);
                }
            }
            peers.push(PeerState::Pending(pending));
        }
        let hello = Hello {
            magic: HELLO_MAGIC,
            version: PROTOCOL_VERSION,
            servers: t.servers as u32,
            devices: g as u32,
            server: config.server as u32,
            first_rank: (config.server * g) as u32,
            ranks: g as u32,
            name: config.roster[config.server].clone(),
        };
        let shared = Arc::new(Shared {
            topology: t,
            server: config.server,
            roster: config.roster.clone(),
            max_frame_bytes: config.max_frame_bytes,
            hello,
            peers: Mutex::new(peers),
            changed: Condvar::new(),
            failures: (0..t.servers).map(|_| OnceLock::new()).collect(),
            closed: (0..t.servers).map(|_| AtomicBool::new(false)).collect(),
            stats: Stats::default(),
            refusals: Mutex::new(Vec::new()),
            writers: Mutex::new(Vec::new()),
        });
        let locals = grandis_fabric::ChannelTransport::mesh(
            Topology {
                servers: 1,
                devices: g,
            },
            None,
        );
        let transports = locals
            .into_iter()
            .zip(out_tx)
            .zip(in_rx)
            .enumerate()
            .map(|(device, ((local, out), inbound))| {
                NodeTransport::new(
                    t.rank_of(config.server, device),
                    local,
                    out,
                    inbound,
                    shared.clone(),
                )
            })
            .collect();

        runtime.spawn(accept_loop(
            shared.clone(),
            endpoint.clone(),
            config.handshake_timeout,
        ));
        tracing::info!(
            node = %config.roster[config.server],
            server = config.server,
            addr = %local_addr,
            "QUIC node listening"
        );
        Ok(QuicNode {
            runtime: Some(runtime),
            endpoint,
            client,
            shared,
            local_addr,
            handshake_timeout: config.handshake_timeout,
            transports: Mutex::new(Some(transports)),
        })
    }

    /// The bound UDP address (with the actual port when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// This node's server index.
    pub fn server(&self) -> usize {
        self.shared.server
    }

    /// This node's name.
    pub fn name(&self) -> &str {
        &self.shared.roster[self.shared.server]
    }

    /// The cluster shape.
    pub fn topology(&self) -> Topology {
        self.shared.topology
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        // Only `Drop`/`shutdown` take the runtime, and they consume the node.
        self.runtime
            .as_ref()
            .expect("the runtime lives as long as the node")
    }

    /// The transports of this server's G ranks, index = device (rank = server·G + device),
    /// to be boxed into [`grandis_fabric::Endpoint::with_transport`]. They can be taken before
    /// the peers are connected (sends wait in queues). Only the first call succeeds.
    pub fn take_transports(&self) -> Result<Vec<NodeTransport>> {
        lock(&self.transports).take().ok_or_else(|| {
            QuicError::Config("the transports of this node were already taken".into())
        })
    }

    /// Dials server `server` at `addr`, checks its certificate (cluster CA, node name
    /// `roster[server]`), exchanges hellos and installs the connection. Each pair of servers
    /// needs exactly one connection; [`QuicNode::establish`] applies the convention that the
    /// higher server index dials the lower one.
    pub fn connect(&self, server: usize, addr: SocketAddr) -> Result<()> {
        self.connect_with_timeout(server, addr, self.handshake_timeout)
    }

    fn connect_with_timeout(
        &self,
        server: usize,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<()> {
        let s = &self.shared;
        if server >= s.topology.servers || server == s.server {
            return Err(QuicError::Config(format!(
                "cannot dial server {server}: this is server {} of {}",
                s.server, s.topology.servers
            )));
        }
        let name = s.roster[server].clone();
        let err = |reason: String| QuicError::Connect {
            server,
            name: name.clone(),
            addr,
            reason,
        };
        {
            let peers = lock(&s.peers);
            match &peers[server] {
                PeerState::Pending(_) => {}
                PeerState::Connected { .. } => return Err(err("already connected".into())),
                PeerState::Closed { reason } => {
                    return Err(err(format!(
                        "an earlier connection was lost ({reason}); reconnecting is not supported"
                    )))
                }
                PeerState::Own => unreachable!("checked above"),
            }
        }
        self.runtime()
            .block_on(dial(
                s.clone(),
                self.endpoint.clone(),
                self.client.clone(),
                server,
                addr,
                timeout,
            ))
            .map_err(err)
    }

    /// Connects the full mesh: dials every server with a lower index (retrying until
    /// `timeout` while it does not answer, since daemons start in any order), then waits until
    /// every server with a higher index has dialled in. `addrs[s]` is server `s`'s address
    /// (this node's own entry is ignored).
    pub fn establish(&self, addrs: &[SocketAddr], timeout: Duration) -> Result<()> {
        let t = self.shared.topology;
        if addrs.len() != t.servers {
            return Err(QuicError::Config(format!(
                "establish needs {} addresses (one per server), got {}",
                t.servers,
                addrs.len()
            )));
        }
        let deadline = Instant::now() + timeout;
        for (s, &addr) in addrs.iter().enumerate().take(self.shared.server) {
            if self.is_connected(s) {
                continue;
            }
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let attempt = left.min(self.handshake_timeout);
                match self.connect_with_timeout(s, addr, attempt) {
                    Ok(()) => break,
                    Err(QuicError::Connect { reason, .. })
                        if reason.starts_with(NO_ANSWER) && !left.is_zero() =>
                    {
                        tracing::debug!("server {s} at {addr} does not answer yet; retrying");
                        std::thread::sleep(Duration::from_millis(200).min(left));
                        if Instant::now() >= deadline {
                            return Err(QuicError::NotConnected(format!(
                                "server {s} ({}) at {addr} did not answer within {timeout:?}",
                                self.shared.roster[s]
                            )));
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        self.wait_connected(deadline.saturating_duration_since(Instant::now()))
    }

    /// True when the connection to `server` is up.
    pub fn is_connected(&self, server: usize) -> bool {
        matches!(
            lock(&self.shared.peers).get(server),
            Some(PeerState::Connected { .. })
        )
    }

    /// Waits until every other server is connected. Fails at the timeout (naming the missing
    /// servers) or as soon as a connection has been lost.
    pub fn wait_connected(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut peers = lock(&self.shared.peers);
        loop {
            let mut missing = Vec::new();
            for (s, p) in peers.iter().enumerate() {
                match p {
                    PeerState::Own | PeerState::Connected { .. } => {}
                    PeerState::Pending(_) => missing.push(self.shared.describe(s, None)),
                    PeerState::Closed { reason } => {
                        return Err(QuicError::NotConnected(format!(
                            "connection to {} was lost: {reason}",
                            self.shared.describe(s, None)
                        )))
                    }
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(QuicError::NotConnected(format!(
                    "not connected to {} after {timeout:?}",
                    missing.join(", ")
                )));
            }
            peers = self
                .shared
                .changed
                .wait_timeout(peers, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Snapshot of the wire statistics.
    pub fn stats(&self) -> WireStats {
        self.shared.stats.snapshot()
    }

    /// Connection attempts refused so far (at most the first 256).
    pub fn refusals(&self) -> Vec<Refusal> {
        lock(&self.shared.refusals).clone()
    }

    /// Orderly shutdown: waits (at most `timeout`) until every stream writer has delivered its
    /// frames — which happens once the ranks' transports are dropped — then closes all
    /// connections (peers see `Disconnected`) and returns the final statistics. Dropping the
    /// node instead closes at once, possibly losing frames still in flight.
    pub fn shutdown(mut self, timeout: Duration) -> WireStats {
        let writers = std::mem::take(&mut *lock(&self.shared.writers));
        let pending = writers.len();
        let done = self.runtime().block_on(async {
            tokio::time::timeout(timeout, async {
                for w in writers {
                    let _ = w.await;
                }
            })
            .await
            .is_ok()
        });
        if !done {
            tracing::warn!(
                "shutdown of {}: not all of {pending} stream writers finished within {timeout:?} \
                 (are the ranks' transports still alive?)",
                self.name()
            );
        }
        self.close();
        self.shared.stats.snapshot()
    }

    fn close(&mut self) {
        let Some(runtime) = self.runtime.take() else {
            return;
        };
        self.endpoint
            .close(VarInt::from_u32(CLOSE_SHUTDOWN), b"node shut down");
        // Let the endpoint send the close frames, so peers learn at once instead of after the
        // idle timeout. `block_on` would panic inside a runtime, hence the check.
        if tokio::runtime::Handle::try_current().is_err() {
            let endpoint = self.endpoint.clone();
            runtime.block_on(async move {
                let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
            });
        }
        // Dropping the tasks drops the queue ends they hold, which wakes local ranks.
        runtime.shutdown_timeout(Duration::from_secs(1));
    }

    /// Test hook: opens a data stream to `server` and writes `bytes` on it verbatim (a
    /// misbehaving peer). Not for production use.
    #[doc(hidden)]
    pub fn send_raw_stream_for_tests(&self, server: usize, bytes: &[u8]) -> Result<()> {
        let conn = match lock(&self.shared.peers).get(server) {
            Some(PeerState::Connected { conn, .. }) => conn.clone(),
            _ => {
                return Err(QuicError::NotConnected(format!(
                    "not connected to server {server}"
                )))
            }
        };
        let bytes = bytes.to_vec();
        self.runtime()
            .block_on(async move {
                let mut s = conn.open_uni().await.map_err(|e| e.to_string())?;
                s.write_all(&bytes).await.map_err(|e| e.to_string())?;
                s.finish().map_err(|e| e.to_string())?;
                let _ = s.stopped().await;
                Ok::<(), String>(())
            })
            .map_err(QuicError::NotConnected)
    }
}

impl Drop for QuicNode {
    fn drop(&mut self) {
        self.close();
    }
}

/// Prefix of the reason when a peer does not answer in time (retried by `establish`).
const NO_ANSWER: &str = "no answer within";

fn close_reason(e: &ConnectionError) -> String {
    match e {
        ConnectionError::ApplicationClosed(c) => {
            let reason = String::from_utf8_lossy(&c.reason);
            match c.error_code.into_inner() {
                x if x == u64::from(CLOSE_HANDSHAKE_REJECTED) => {
                    format!("peer rejected the handshake: {reason}")
                }
                x if x == u64::from(CLOSE_PROTOCOL_VIOLATION) => {
                    format!("peer closed the connection because of a protocol violation: {reason}")
                }
                x if x == u64::from(CLOSE_SHUTDOWN) => format!("peer shut down: {reason}"),
                code => format!("peer closed the connection with code {code}: {reason}"),
            }
        }
        other => other.to_string(),
    }
}

/// Truncates a reason so that it fits into a CONNECTION_CLOSE frame.
fn short(reason: &str) -> &[u8] {
    let mut end = reason.len().min(400);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason.as_bytes()[..end]
}

async fn dial(
    shared: Arc<Shared>,
    endpoint: quinn::Endpoint,
    client: quinn::ClientConfig,
    server: usize,
    addr: SocketAddr,
    timeout: Duration,
) -> std::result::Result<(), String> {
    let name = shared.roster[server].clone();
    let work = async {
        let connecting = endpoint
            .connect_with(client, addr, &name)
            .map_err(|e| format!("cannot start connecting: {e}"))?;
        let conn = connecting.await.map_err(|e| {
            if matches!(e, ConnectionError::TimedOut) {
                // Nobody answered (the peer's daemon may not be up yet): retryable.
                return format!("{NO_ANSWER} the QUIC idle timeout");
            }
            let reason = format!("TLS/QUIC handshake failed: {}", close_reason(&e));
            shared.refuse(addr, true, reason.clone());
            reason
        })?;
        let reply = async {
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| close_reason(&e))?;
            let hello = shared.hello.encode().map_err(|e| e.to_string())?;
            send.write_all(&hello).await.map_err(|e| e.to_string())?;
            send.finish().map_err(|e| e.to_string())?;
            recv.read_to_end(4 + MAX_HELLO_BYTES)
                .await
                .map_err(|e| match e {
                    quinn::ReadToEndError::Read(ReadError::ConnectionLost(c)) => close_reason(&c),
                    other => other.to_string(),
                })
        }
        .await;
        let checked = reply.and_then(|bytes| {
            let hello = Hello::decode(&bytes).map_err(|e| e.to_string())?;
            shared.check_hello(&hello, Some(server))
        });
        if let Err(reason) = checked {
            conn.close(VarInt::from_u32(CLOSE_HANDSHAKE_REJECTED), short(&reason));
            shared.refuse(addr, true, reason.clone());
            return Err(reason);
        }
        install(&shared, server, conn, addr)
            .inspect_err(|reason| shared.refuse(addr, true, reason.clone()))
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(format!("{NO_ANSWER} {timeout:?}")),
    }
}

async fn accept_loop(shared: Arc<Shared>, endpoint: quinn::Endpoint, timeout: Duration) {
    while let Some(incoming) = endpoint.accept().await {
        let shared = shared.clone();
        tokio::spawn(async move {
            let addr = incoming.remote_address();
            match tokio::time::timeout(timeout, answer(&shared, incoming)).await {
                Ok(Ok(())) => {}
                Ok(Err(reason)) => shared.refuse(addr, false, reason),
                Err(_) => shared.refuse(
                    addr,
                    false,
                    format!("handshake did not complete within {timeout:?}"),
                ),
            }
        });
    }
}

/// Accepts one incoming connection: TLS (the verifier checks the client certificate against
/// the cluster CA), then the peer's hello, the binding of its certificate to the name it
/// claims, and our hello in reply.
async fn answer(
    shared: &Arc<Shared>,
    incoming: quinn::Incoming,
) -> std::result::Result<(), String> {
    let addr = incoming.remote_address();
    let conn = incoming
        .await
        .map_err(|e| format!("TLS/QUIC handshake failed: {}", close_reason(&e)))?;
    let reject = |reason: String| {
        conn.close(VarInt::from_u32(CLOSE_HANDSHAKE_REJECTED), short(&reason));
        reason
    };
    let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| close_reason(&e))?;
    let bytes = recv
        .read_to_end(4 + MAX_HELLO_BYTES)
        .await
        .map_err(|e| reject(format!("cannot read the hello: {e}")))?;
    let hello = Hello::decode(&bytes).map_err(|e| reject(e.to_string()))?;
    let server = shared.check_hello(&hello, None).map_err(&reject)?;
    let certs = conn
        .peer_identity()
        .and_then(|id| {
            id.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .ok_or_else(|| reject("the peer presented no certificate".into()))?;
    let leaf = certs
        .first()
        .ok_or_else(|| reject("the peer presented an empty certificate chain".into()))?;
    tls::cert_matches_name(leaf, &shared.roster[server]).map_err(&reject)?;
    // Install before replying, so that a duplicate connection is rejected before the dialer
    // installs it. Streams our writers open now are buffered by QUIC until the dialer, which
    // installs on our hello, accepts them.
    install(shared, server, conn.clone(), addr).map_err(&reject)?;
    let own = shared.hello.encode().map_err(|e| reject(e.to_string()))?;
    send.write_all(&own)
        .await
        .map_err(|e| reject(format!("cannot send the hello: {e}")))?;
    send.finish().map_err(|e| reject(e.to_string()))?;
    Ok(())
}

/// Makes `conn` the connection to `server`: moves that server's queue ends into a writer task
/// per outbound pair and a stream acceptor, and watches for the end of the connection.
fn install(
    shared: &Arc<Shared>,
    server: usize,
    conn: quinn::Connection,
    addr: SocketAddr,
) -> std::result::Result<(), String> {
    let pending = {
        let mut peers = lock(&shared.peers);
        let slot = &mut peers[server];
        match slot {
            PeerState::Pending(_) => {}
            PeerState::Connected { addr: a, .. } => {
                return Err(format!(
                    "{} is already connected from {a}",
                    shared.describe(server, None)
                ))
            }
            PeerState::Closed { reason } => {
                return Err(format!(
                "an earlier connection to {} was lost ({reason}); reconnecting is not supported",
                shared.describe(server, None)
            ))
            }
            PeerState::Own => return Err("a node cannot connect to itself".into()),
        }
        let old = std::mem::replace(
            slot,
            PeerState::Connected {
                conn: conn.clone(),
                addr,
            },
        );
        match old {
            PeerState::Pending(p) => p,
            _ => unreachable!("checked above"),
        }
    };
    shared.changed.notify_all();
    tracing::info!(peer = %shared.describe(server, Some(addr)), "QUIC peer connected");

    let g = shared.devices();
    let t = shared.topology;
    let mut writers = Vec::new();
    for (i, rx) in pending.outbound.into_iter().enumerate() {
        if let Some(rx) = rx {
            let pair = Preamble {
                src: t.rank_of(shared.server, i / g) as u32,
                dst: t.rank_of(server, i % g) as u32,
            };
            writers.push(tokio::spawn(write_pair(
                shared.clone(),
                conn.clone(),
                pair,
                rx,
            )));
        }
    }
    lock(&shared.writers).extend(writers);
    let table = Arc::new(Mutex::new(pending.inbound));
    tokio::spawn(accept_streams(
        shared.clone(),
        server,
        addr,
        conn.clone(),
        table,
    ));
    let shared = shared.clone();
    tokio::spawn(async move {
        let e = conn.closed().await;
        connection_ended(&shared, server, &e);
        let who = shared.describe(server, Some(addr));
        let reason = close_reason(&e);
        if shared.failure(server).is_some() {
            tracing::warn!(peer = %who, "QUIC connection lost: {reason}");
        } else {
            tracing::info!(peer = %who, "QUIC connection closed: {reason}");
        }
        lock(&shared.peers)[server] = PeerState::Closed { reason };
        shared.changed.notify_all();
    });
    Ok(())
}

/// Records that the connection to `server` ended with `e`: marks it closed and, unless it was
/// an orderly shutdown (ours or the peer's), records the reason for the ranks. Called by every
/// task that observes the end *before* it drops its queue ends, so that a rank woken up by a
/// dropped queue always finds the reason.
fn connection_ended(shared: &Shared, server: usize, e: &ConnectionError) {
    let clean = matches!(
        e,
        ConnectionError::ApplicationClosed(c) if c.error_code.into_inner() == u64::from(CLOSE_SHUTDOWN)
    ) || matches!(e, ConnectionError::LocallyClosed);
    if !clean {
        let who = shared.describe(server, None);
        shared.record_failure(
            server,
            format!("connection to {who} lost: {}", close_reason(e)),
        );
    }
    if let Some(c) = shared.closed.get(server) {
        c.store(true, Ordering::Release);
    }
}

/// Writes the frames of one (local rank → remote rank) pair on its own stream. The stream is
/// opened on the first frame, or when the local rank's transport is dropped without having
/// sent anything (an empty stream tells the receiver that this rank is gone).
async fn write_pair(
    shared: Arc<Shared>,
    conn: quinn::Connection,
    pair: Preamble,
    mut rx: tokio_mpsc::UnboundedReceiver<Vec<u8>>,
) {
    let first = tokio::select! {
        f = rx.recv() => f,
        _ = conn.closed() => return,
    };
    let result: std::result::Result<(), String> = async {
        let mut stream = conn.open_uni().await.map_err(|e| close_reason(&e))?;
        stream
            .write_all(&pair.encode())
            .await
            .map_err(|e| e.to_string())?;
        add(&shared.stats.streams_opened, 1);
        add(&shared.stats.bytes_sent, PREAMBLE_BYTES);
        let mut next = first;
        while let Some(frame) = next {
            stream.write_all(&frame).await.map_err(|e| e.to_string())?;
            add(&shared.stats.frames_sent, 1);
            add(
                &shared.stats.payload_bytes_sent,
                frame.len() - FRAME_OVERHEAD,
            );
            add(&shared.stats.bytes_sent, frame.len());
            // Also wake up when the connection ends, so that the queue is dropped and later
            // sends of the rank fail instead of piling up.
            next = tokio::select! {
                f = rx.recv() => f,
                e = conn.closed() => return Err(close_reason(&e)),
            };
        }
        stream.finish().map_err(|e| e.to_string())?;
        // Returns once the peer has received everything (or stopped / lost the connection).
        let _ = stream.stopped().await;
        Ok(())
    }
    .await;
    if let Err(e) = result {
        tracing::debug!("stream {}→{} ended: {e}", pair.src, pair.dst);
    }
}

/// Accepts the data streams of one connection and starts a reader per stream.
async fn accept_streams(
    shared: Arc<Shared>,
    server: usize,
    addr: SocketAddr,
    conn: quinn::Connection,
    table: Arc<Mutex<Vec<Option<std_mpsc::Sender<Inbound>>>>>,
) {
    loop {
        match conn.accept_uni().await {
            Ok(stream) => {
                tokio::spawn(read_pair(
                    shared.clone(),
                    server,
                    addr,
                    conn.clone(),
                    stream,
                    table.clone(),
                ));
            }
            Err(e) => {
                connection_ended(&shared, server, &e);
                break;
            }
        }
    }
    // The connection is over: dropping `table` drops the senders of pairs whose stream never
    // arrived, so their receivers see `Disconnected`.
}

/// A protocol violation by the peer: recorded (so every rank waiting on this server gets the
/// reason), reported on the pair's queue, logged, and the connection is closed.
fn violation(
    shared: &Shared,
    server: usize,
    addr: SocketAddr,
    conn: &quinn::Connection,
    tx: Option<&std_mpsc::Sender<Inbound>>,
    what: String,
) {
    let who = shared.describe(server, Some(addr));
    let message = format!("malformed data from {who}: {what}");
    tracing::warn!(peer = %who, "{message}; closing the connection");
    shared.record_failure(server, message.clone());
    if let Some(tx) = tx {
        let _ = tx.send(Err(message));
    }
    conn.close(VarInt::from_u32(CLOSE_PROTOCOL_VIOLATION), short(&what));
}

/// A read failed: if the connection is gone, record it before the reader drops its queue.
fn lost(shared: &Shared, server: usize, e: ReadError) {
    if let ReadError::ConnectionLost(e) = e {
        connection_ended(shared, server, &e);
    }
}

async fn read_pair(
    shared: Arc<Shared>,
    server: usize,
    addr: SocketAddr,
    conn: quinn::Connection,
    mut stream: quinn::RecvStream,
    table: Arc<Mutex<Vec<Option<std_mpsc::Sender<Inbound>>>>>,
) {
    let t = shared.topology;
    let g = t.devices;
    let mut pre = [0u8; PREAMBLE_BYTES];
    match stream.read_exact(&mut pre).await {
        Ok(()) => {}
        Err(ReadExactError::FinishedEarly(n)) => {
            let what =
                format!("data stream ended after {n} of the {PREAMBLE_BYTES} preamble bytes");
            return violation(&shared, server, addr, &conn, None, what);
        }
        Err(ReadExactError::ReadError(e)) => return lost(&shared, server, e),
    }
    let pair = Preamble::decode(pre);
    let (src, dst) = (pair.src as usize, pair.dst as usize);
    if src >= t.world()
        || t.server_of(src) != server
        || dst >= t.world()
        || t.server_of(dst) != shared.server
    {
        let what = format!(
            "data stream for ranks {src}→{dst}, but the peer hosts ranks {}..{} and this node {}..{}",
            server * g,
            (server + 1) * g,
            shared.server * g,
            (shared.server + 1) * g
        );
        return violation(&shared, server, addr, &conn, None, what);
    }
    let tx = lock(&table)[t.device_of(src) * g + t.device_of(dst)].take();
    drop(table);
    let Some(tx) = tx else {
        let what = format!("second data stream for ranks {src}→{dst}");
        return violation(&shared, server, addr, &conn, None, what);
    };
    add(&shared.stats.streams_accepted, 1);
    add(&shared.stats.bytes_received, PREAMBLE_BYTES);
    let max = shared.max_frame_bytes;
    loop {
        let mut prefix = [0u8; 4];
        match stream.read_exact(&mut prefix).await {
            Ok(()) => {}
            // The sending rank's transport was dropped: dropping `tx` tells the receiver.
            Err(ReadExactError::FinishedEarly(0)) => return,
            Err(ReadExactError::FinishedEarly(n)) => {
                let what =
                    format!("stream {src}→{dst} ended inside a frame length ({n} of 4 bytes)");
                return violation(&shared, server, addr, &conn, Some(&tx), what);
            }
            Err(ReadExactError::ReadError(ReadError::Reset(code))) => {
                let what = format!("stream {src}→{dst} was reset with code {code}");
                return violation(&shared, server, addr, &conn, Some(&tx), what);
            }
            Err(ReadExactError::ReadError(e)) => return lost(&shared, server, e),
        }
        let len = match check_frame_len(prefix, max) {
            Ok(len) => len,
            Err(e) => {
                let what = format!("stream {src}→{dst}: {e}");
                return violation(&shared, server, addr, &conn, Some(&tx), what);
            }
        };
        let mut body = vec![0u8; len];
        match stream.read_exact(&mut body).await {
            Ok(()) => {}
            Err(ReadExactError::FinishedEarly(n)) => {
                let what = format!("stream {src}→{dst} ended inside a frame ({n} of {len} bytes)");
                return violation(&shared, server, addr, &conn, Some(&tx), what);
            }
            Err(ReadExactError::ReadError(ReadError::Reset(code))) => {
                let what = format!("stream {src}→{dst} was reset with code {code}");
                return violation(&shared, server, addr, &conn, Some(&tx), what);
            }
            Err(ReadExactError::ReadError(e)) => return lost(&shared, server, e),
        }
        let envelope = match decode_frame_body(&body) {
            Ok(e) => e,
            Err(e) => {
                let what = format!("stream {src}→{dst}: {e}");
                return violation(&shared, server, addr, &conn, Some(&tx), what);
            }
        };
        add(&shared.stats.frames_received, 1);
        add(
            &shared.stats.payload_bytes_received,
            len - frame::FRAME_HEAD_BYTES,
        );
        add(&shared.stats.bytes_received, 4 + len);
        // A dropped receiver (the local rank finished) is not the peer's fault: keep reading so
        // that the stream and the connection's flow control stay healthy.
        let _ = tx.send(Ok(envelope));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(server: u32, name: &str) -> Hello {
        Hello {
            magic: HELLO_MAGIC,
            version: PROTOCOL_VERSION,
            servers: 3,
            devices: 2,
            server,
            first_rank: server * 2,
            ranks: 2,
            name: name.into(),
        }
    }

    #[test]
    fn hello_checks_name_every_mismatch() {
        let roster: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let own = hello(0, "a");
        assert_eq!(check_hello(&own, &roster, &hello(2, "c"), None), Ok(2));
        assert_eq!(check_hello(&own, &roster, &hello(1, "b"), Some(1)), Ok(1));
        let cases: Vec<(Hello, Option<usize>, &str)> = vec![
            (
                Hello {
                    version: 99,
                    ..hello(1, "b")
                },
                None,
                "protocol version mismatch: peer speaks version 99",
            ),
            (
                Hello {
                    devices: 4,
                    first_rank: 4,
                    ranks: 4,
                    ..hello(1, "b")
                },
                None,
                "cluster shape mismatch",
            ),
            (hello(5, "b"), None, "outside the 3 servers"),
            (hello(0, "a"), None, "own server index"),
            (hello(2, "c"), Some(1), "expected server 1"),
            (hello(1, "c"), None, "roster names server 1 \"b\""),
            (
                Hello {
                    first_rank: 0,
                    ..hello(1, "b")
                },
                None,
                "do not match server 1",
            ),
        ];
        for (h, expected, msg) in cases {
            let err = check_hello(&own, &roster, &h, expected).unwrap_err();
            assert!(err.contains(msg), "{err:?} should contain {msg:?}");
        }
    }

    #[test]
    fn reasons_are_truncated_on_char_boundaries() {
        let long = "é".repeat(300);
        let s = short(&long);
        assert!(s.len() <= 400);
        assert!(std::str::from_utf8(s).is_ok());
    }
}
