//! Errors of the fabric. Every variant names the rank that saw it and, where there is one, the
//! peer and the tag, because in a run of many worker threads "receive failed" alone is useless.

use std::time::Duration;

use crate::tag::{Op, Tag};

/// Result alias of this crate.
pub type Result<T, E = FabricError> = std::result::Result<T, E>;

/// Everything that can go wrong in the fabric. None of these is a panic.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    /// The [`crate::FabricConfig`] is unusable.
    #[error("invalid fabric configuration: {0}")]
    Config(String),

    /// The peer's endpoint was dropped (its worker finished, returned an error or panicked)
    /// before the expected message arrived, or before a message to it could be delivered.
    #[error(
        "rank {rank}: peer rank {peer} is gone (its endpoint was dropped: the worker finished, \
         failed or panicked) during {op} {tag}"
    )]
    PeerGone {
        /// Rank that observed the failure.
        rank: usize,
        /// Rank that is gone.
        peer: usize,
        /// Tag of the operation in progress.
        tag: Tag,
        /// Operation in progress.
        op: Op,
    },

    /// No message arrived from `peer` within the receive timeout.
    #[error("rank {rank}: timed out after {waited:?} waiting for {op} {tag} from rank {peer}")]
    Timeout {
        /// Rank that waited.
        rank: usize,
        /// Rank it waited for.
        peer: usize,
        /// Tag it waited for.
        tag: Tag,
        /// Operation it waited for.
        op: Op,
        /// How long it waited.
        waited: Duration,
    },

    /// The next message from `peer` belongs to another tag or operation than the one expected.
    /// Messages between two ranks are received in the order they were sent, so this means the
    /// two ranks disagree about the sequence of transfers (e.g. inconsistent `expect_from`).
    #[error(
        "rank {rank}: expected {expected_op} {expected} from rank {peer}, but its next message \
         is {got_op} {got} (messages from a peer must be received in the order they were sent)"
    )]
    TagMismatch {
        /// Receiving rank.
        rank: usize,
        /// Sending rank.
        peer: usize,
        /// Tag the receiver expected.
        expected: Tag,
        /// Operation the receiver expected.
        expected_op: Op,
        /// Tag of the message that arrived.
        got: Tag,
        /// Operation of the message that arrived.
        got_op: Op,
    },

    /// A message has another length than the receiver expected.
    #[error(
        "rank {rank}: {op} {tag} from rank {peer} has {got} {unit}, expected {expected} {unit}"
    )]
    SizeMismatch {
        /// Receiving rank.
        rank: usize,
        /// Sending rank.
        peer: usize,
        /// Tag of the message.
        tag: Tag,
        /// Operation of the message.
        op: Op,
        /// Expected length in `unit`s.
        expected: usize,
        /// Actual length in `unit`s.
        got: usize,
        /// "f32 values" or "bytes".
        unit: &'static str,
    },

    /// A message carries bytes where `f32` values were expected, or the other way round.
    #[error("rank {rank}: {op} {tag} from rank {peer} carries {got}, expected {expected}")]
    PayloadKind {
        /// Receiving rank.
        rank: usize,
        /// Sending rank.
        peer: usize,
        /// Tag of the message.
        tag: Tag,
        /// Operation of the message.
        op: Op,
        /// Expected payload kind.
        expected: &'static str,
        /// Payload kind that arrived.
        got: &'static str,
    },

    /// A caller named an invalid peer (out of range, itself, or twice in one call).
    #[error("rank {rank}: invalid peer {peer} in {op} {tag}: {reason}")]
    InvalidPeer {
        /// Calling rank.
        rank: usize,
        /// The offending peer id.
        peer: usize,
        /// Tag of the call.
        tag: Tag,
        /// Operation of the call.
        op: Op,
        /// What is wrong with it.
        reason: String,
    },

    /// The caller's buffer does not fit the operation (e.g. broadcast lengths differ).
    #[error("rank {rank}: bad buffer in {op} {tag}: {reason}")]
    BadBuffer {
        /// Calling rank.
        rank: usize,
        /// Tag of the call.
        tag: Tag,
        /// Operation of the call.
        op: Op,
        /// What is wrong.
        reason: String,
    },

    /// The transport failed for another reason (e.g. a network error in a real transport).
    #[error("rank {rank}: transport failure with rank {peer} during {op} {tag}: {message}")]
    Transport {
        /// Rank that observed the failure.
        rank: usize,
        /// Peer involved.
        peer: usize,
        /// Tag of the operation in progress.
        tag: Tag,
        /// Operation in progress.
        op: Op,
        /// Transport's description.
        message: String,
    },
}

impl FabricError {
    /// True for errors that are normally a *consequence* of another rank's failure (a peer
    /// went away). [`crate::Fabric::run`] uses this to report the root cause first.
    pub fn is_peer_gone(&self) -> bool {
        matches!(self, FabricError::PeerGone { .. })
    }
}
