//! The inter-server data plane of grandis: one daemon process per server talks to the others
//! over QUIC ([`quinn`]) with mutual TLS, and the fabric's ranks use it through a
//! [`grandis_fabric::Transport`]. [`certs`] creates a cluster CA and one certificate per node
//! (`grandis certs init`) and loads them back with errors that name the file. A [`QuicNode`]
//! binds a UDP address, accepts and dials peer servers — both sides present certificates
//! signed by the cluster CA, the dialer checks the server's node name, the acceptor checks
//! that the client's certificate is valid for the node name it claims — and then exchanges a
//! [`frame::Hello`] that pins protocol version, cluster shape and server index; anything else
//! is refused, logged with `tracing::warn!` and recorded ([`QuicNode::refusals`]). Each ordered
//! (source rank, destination rank) pair gets one unidirectional QUIC stream of length-prefixed
//! bincode frames ([`frame`]), which preserves per-pair order; sends go into unbounded queues
//! drained by tasks of the node's internal tokio runtime, so [`grandis_fabric::Transport::send`]
//! never waits for the receiver. [`NodeTransport`] is the hybrid transport of one rank: peers on
//! the same server go over the fabric's in-process [`grandis_fabric::ChannelTransport`], peers
//! on other servers over QUIC, so one daemon hosts all G device ranks of its server
//! ([`QuicNode::take_transports`]). [`WireStats`] counts the bytes actually written to and read
//! from QUIC streams (payload + [`frame::FRAME_OVERHEAD`] per message + [`frame::PREAMBLE_BYTES`]
//! per stream), to compare with the fabric's payload counters. A malformed frame closes the
//! connection and surfaces as an error naming the peer; a vanished peer as `Disconnected`.

pub mod certs;
pub mod frame;
mod node;
mod tls;
mod transport;

use std::net::SocketAddr;
use std::path::PathBuf;

pub use certs::{init_cluster, init_cluster_with, run_init, InitOptions, NodeIdentity};
pub use node::{Framing, NodeConfig, QuicNode, Refusal, WireStats};
pub use tls::install_crypto_provider;
pub use transport::NodeTransport;

/// Errors of this crate; each names the file, the peer or the setting concerned.
#[derive(Debug, thiserror::Error)]
pub enum QuicError {
    /// A certificate or key file is missing, unreadable, malformed or inconsistent.
    #[error("{}: {message}", path.display())]
    File {
        /// The file concerned.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// Certificate generation failed.
    #[error("cannot generate {what}: {message}")]
    CertGen {
        /// What was being generated.
        what: String,
        /// rcgen's description.
        message: String,
    },
    /// A [`NodeConfig`] or argument is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Building the TLS or QUIC configuration failed.
    #[error("TLS setup failed: {0}")]
    Tls(String),
    /// The UDP socket or the runtime could not be set up.
    #[error("cannot start QUIC node on {addr}: {message}")]
    Bind {
        /// Requested address.
        addr: SocketAddr,
        /// What failed.
        message: String,
    },
    /// Dialling a peer failed (unreachable, TLS refusal, handshake rejected).
    #[error("connection to server {server} ({name} at {addr}) failed: {reason}")]
    Connect {
        /// The peer's server index.
        server: usize,
        /// The peer's node name.
        name: String,
        /// Its address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// Waiting for peers took too long, or a peer connection was lost while waiting.
    #[error("{0}")]
    NotConnected(String),
    /// The caller gave up (its job was cancelled) while connecting.
    #[error("cancelled while connecting to the other servers")]
    Cancelled,
}

/// Result alias of this crate.
pub type Result<T, E = QuicError> = std::result::Result<T, E>;
