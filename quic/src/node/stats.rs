//! [`WireStats`]: the bytes and frames a node writes to and reads from its QUIC data streams.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::frame::{FRAME_OVERHEAD, PREAMBLE_BYTES};

/// The counts (one definition, in `grandis-wire`, so job reports carry them typed).
pub use grandis_wire::WireStats;

/// The framing part of [`WireStats`]' byte counts (this crate's frame format).
pub trait Framing {
    /// Sent bytes that are framing rather than payload.
    fn framing_bytes_sent(&self) -> u64;
    /// Received bytes that are framing rather than payload.
    fn framing_bytes_received(&self) -> u64;
}

impl Framing for WireStats {
    fn framing_bytes_sent(&self) -> u64 {
        self.streams_opened * PREAMBLE_BYTES as u64 + self.frames_sent * FRAME_OVERHEAD as u64
    }

    fn framing_bytes_received(&self) -> u64 {
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
