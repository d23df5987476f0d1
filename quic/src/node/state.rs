//! The state shared by a node and its tasks: per-peer connection state, failures, refusals.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};

use grandis_fabric::Topology;
use tokio::sync::mpsc as tokio_mpsc;
use tokio::task::JoinHandle;

use super::stats::Stats;
use crate::frame::{check_hello, Hello};

/// What arrives for a rank from a remote rank: an envelope, or the description of a malformed
/// frame on that pair's stream.
pub(crate) type Inbound = std::result::Result<grandis_fabric::Envelope, String>;

/// A connection attempt that was refused (TLS failure, rejected hello, timeout).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Refusal {
    /// The other side's address.
    pub remote: SocketAddr,
    /// True when we dialled, false when the peer dialled us.
    pub outgoing: bool,
    /// Why.
    pub reason: String,
}

/// At most this many refusals are kept (a misconfigured peer retrying must not grow memory).
pub(super) const MAX_REFUSALS: usize = 256;

/// Queue ends of one peer server that wait for its connection.
pub(super) struct Pending {
    /// Index `remote_device * G + local_device`: sender into the local rank's queue from the
    /// remote rank.
    pub(super) inbound: Vec<Option<std_mpsc::Sender<Inbound>>>,
    /// Index `local_device * G + remote_device`: encoded frames from the local rank to the
    /// remote rank.
    pub(super) outbound: Vec<Option<tokio_mpsc::UnboundedReceiver<Vec<u8>>>>,
}

pub(super) enum PeerState {
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
    pub(super) hello: Hello,
    pub(super) peers: Mutex<Vec<PeerState>>,
    pub(super) changed: Condvar,
    /// Per server: why its connection failed, for errors that name the peer.
    pub(super) failures: Vec<OnceLock<String>>,
    /// Per server: its connection has ended (sends to it fail from then on).
    pub(super) closed: Vec<AtomicBool>,
    pub(super) stats: Stats,
    pub(super) refusals: Mutex<Vec<Refusal>>,
    /// Stream writer tasks, awaited by [`QuicNode::shutdown`](super::QuicNode::shutdown).
    pub(super) writers: Mutex<Vec<JoinHandle<()>>>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means a task panicked while holding it; the data is still consistent
    // enough to report errors, and panicking here too would hide the original problem.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    pub(super) fn devices(&self) -> usize {
        self.topology.devices
    }

    /// "server 1 (b at 127.0.0.1:4433)", for messages.
    pub(super) fn describe(&self, server: usize, addr: Option<SocketAddr>) -> String {
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

    pub(super) fn record_failure(&self, server: usize, reason: String) {
        if let Some(slot) = self.failures.get(server) {
            let _ = slot.set(reason);
        }
    }

    pub(super) fn refuse(&self, remote: SocketAddr, outgoing: bool, reason: String) {
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
    pub(super) fn check_hello(
        &self,
        remote: &Hello,
        expected_server: Option<usize>,
    ) -> Result<usize, String> {
        check_hello(&self.hello, &self.roster, remote, expected_server)
    }
}
