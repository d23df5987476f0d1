//! [`WireStats`]: the bytes and frames a node writes to and reads from its QUIC data streams.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use crate::frame::{FRAME_OVERHEAD, PREAMBLE_BYTES};

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
pub(super) struct Stats {
    pub(super) streams_opened: AtomicU64,
    pub(super) frames_sent: AtomicU64,
    pub(super) payload_bytes_sent: AtomicU64,
    pub(super) bytes_sent: AtomicU64,
    pub(super) streams_accepted: AtomicU64,
    pub(super) frames_received: AtomicU64,
    pub(super) payload_bytes_received: AtomicU64,
    pub(super) bytes_received: AtomicU64,
}

impl Stats {
    pub(super) fn snapshot(&self) -> WireStats {
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

pub(super) fn add(a: &AtomicU64, n: usize) {
    a.fetch_add(n as u64, Ordering::Relaxed);
}
