//! How a connection ends: the application close codes, the reason a peer or the transport
//! gave, and recording the end for the ranks.

use std::sync::atomic::Ordering;

use quinn::ConnectionError;

use super::state::Shared;

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
