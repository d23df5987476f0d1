//! Installing an accepted or dialled connection, noticing its end, and close codes and reasons.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use quinn::ConnectionError;

use super::state::{lock, PeerState, Shared};
use super::streams::{accept_streams, write_pair};
use crate::frame::Preamble;

/// Application close code: orderly shutdown of a node (peers see a plain `Disconnected`).
pub(super) const CLOSE_SHUTDOWN: u32 = 0;
/// Application close code: the hello handshake was rejected.
pub(super) const CLOSE_HANDSHAKE_REJECTED: u32 = 1;
/// Application close code: the peer sent malformed data.
pub(super) const CLOSE_PROTOCOL_VIOLATION: u32 = 2;

pub(super) fn close_reason(e: &ConnectionError) -> String {
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
pub(super) fn short(reason: &str) -> &[u8] {
    let mut end = reason.len().min(400);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason.as_bytes()[..end]
}

/// Makes `conn` the connection to `server`: moves that server's queue ends into a writer task
/// per outbound pair and a stream acceptor, and watches for the end of the connection.
pub(super) fn install(
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
pub(super) fn connection_ended(shared: &Shared, server: usize, e: &ConnectionError) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_truncated_on_char_boundaries() {
        let long = "é".repeat(300);
        let s = short(&long);
        assert!(s.len() <= 400);
        assert!(std::str::from_utf8(s).is_ok());
    }
}
