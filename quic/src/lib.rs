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
mod error;
pub mod frame;
mod node;
pub mod proof;
mod tls;
mod transport;

pub use certs::{init_cluster, init_cluster_with, run_init, InitOptions, NodeIdentity};
pub use error::{QuicError, Result};
pub use node::{Framing, NodeConfig, QuicNode, Refusal, WireStats};
pub use proof::{ClusterCa, Signed};
pub use tls::install_crypto_provider;
pub use transport::NodeTransport;
