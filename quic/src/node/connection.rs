//! Installing an accepted or dialled connection, noticing its end, and close codes and reasons.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use super::close::{close_reason, connection_ended};
use super::state::{lock, PeerState, Shared};
use super::streams::{accept_streams, write_pair};
use crate::frame::Preamble;

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
