//! The errors of this crate.

use std::net::SocketAddr;
use std::path::PathBuf;

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
