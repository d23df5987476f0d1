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

mod close;
mod connection;
mod handshake;
pub(crate) mod state;
mod stats;
mod streams;

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use grandis_fabric::Topology;
use quinn::VarInt;
use tokio::sync::mpsc as tokio_mpsc;

use crate::certs::{validate_node_name, NodeIdentity};
use crate::error::{QuicError, Result};
use crate::frame::{self, Hello, HELLO_MAGIC, PROTOCOL_VERSION};
use crate::tls;
use crate::transport::NodeTransport;

use close::CLOSE_SHUTDOWN;
use handshake::{accept_loop, dial, NO_ANSWER};
use state::{lock, PeerState, Pending};
use stats::Stats;

pub use state::Refusal;
pub(crate) use state::{Inbound, Shared};
pub use stats::{Framing, WireStats};

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
    /// What this mesh is for, the same on every node of it (a daemon's job id; 0 by
    /// default): a peer in another session is refused at the hello.
    pub session: u64,
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
            session: 0,
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
            session: config.session,
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
        self.connect_with_timeout(server, addr, self.handshake_timeout, &|| false)
    }

    fn connect_with_timeout(
        &self,
        server: usize,
        addr: SocketAddr,
        timeout: Duration,
        cancelled: &dyn Fn() -> bool,
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
        let dialled = dial(
            s.clone(),
            self.endpoint.clone(),
            self.client.clone(),
            server,
            addr,
            timeout,
        );
        self.runtime().block_on(async {
            tokio::select! {
                r = dialled => r.map_err(err),
                _ = until(cancelled) => Err(QuicError::Cancelled),
            }
        })
    }

    /// Connects the full mesh: dials every server with a lower index (retrying until
    /// `timeout` while it does not answer, since daemons start in any order), then waits until
    /// every server with a higher index has dialled in. `addrs[s]` is server `s`'s address
    /// (this node's own entry is ignored). Gives up with [`QuicError::Cancelled`] within
    /// [`CANCEL_CHECK`] of `cancelled()` turning true (a job cancelled while its peers are
    /// still missing must not wait out the timeout).
    pub fn establish(
        &self,
        addrs: &[SocketAddr],
        timeout: Duration,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<()> {
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
                match self.connect_with_timeout(s, addr, attempt, cancelled) {
                    Ok(()) => break,
                    Err(QuicError::Connect { reason, .. })
                        if reason.starts_with(NO_ANSWER) && !left.is_zero() =>
                    {
                        tracing::debug!("server {s} at {addr} does not answer yet; retrying");
                        std::thread::sleep(Duration::from_millis(200).min(left));
                        if cancelled() {
                            return Err(QuicError::Cancelled);
                        }
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
        self.wait_connected_until(
            deadline.saturating_duration_since(Instant::now()),
            cancelled,
        )
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
        self.wait_connected_until(timeout, &|| false)
    }

    fn wait_connected_until(&self, timeout: Duration, cancelled: &dyn Fn() -> bool) -> Result<()> {
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
            if cancelled() {
                return Err(QuicError::Cancelled);
            }
            peers = self
                .shared
                .changed
                .wait_timeout(peers, (deadline - now).min(CANCEL_CHECK))
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

/// How often a connection set-up checks whether its caller gave up.
pub const CANCEL_CHECK: Duration = Duration::from_millis(100);

/// Resolves once `cancelled()` is true (checked every [`CANCEL_CHECK`]).
async fn until(cancelled: &dyn Fn() -> bool) {
    while !cancelled() {
        tokio::time::sleep(CANCEL_CHECK).await;
    }
}
