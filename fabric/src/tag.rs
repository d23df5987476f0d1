//! Message identity: the [`Tag`] a caller gives every transfer, and the internal [`Op`] that
//! tells apart the messages of different fabric operations carrying the same tag.

use std::fmt;

use serde::{Deserialize, Serialize};

/// What a transfer is for; the accounting key (together with epoch, layer and link class).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Halo features of a forward layer.
    Forward,
    /// Halo gradients of a backward layer.
    Backward,
    /// Parameter-gradient synchronisation and other collectives.
    AllReduce,
    /// Anything else (setup, metadata, evaluation, barriers).
    Other,
    /// Input features of replicated vertices, fetched from the rank whose partition holds
    /// them (masked plans own vertices whose home is another server). Declared last: a
    /// variant's position is its number in binary encodings (the QUIC frame head).
    Fetch,
}

impl Phase {
    /// Stable lower-case name (the serde name).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::AllReduce => "all_reduce",
            Phase::Other => "other",
            Phase::Fetch => "fetch",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Identity of one logical transfer: which epoch, which layer, which phase.
///
/// Tags serve two purposes: (1) every byte is accounted under its tag, and (2) a receiver
/// checks that the next message from a peer carries the tag (and operation) it expects, so
/// messages of different layers or phases can never be mixed up silently.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Tag {
    /// Training epoch (or any caller-chosen round number).
    pub epoch: u32,
    /// GNN layer index; use 0 (or any fixed value) where no layer applies.
    pub layer: u32,
    /// What the transfer is for.
    pub phase: Phase,
}

impl Tag {
    /// A tag with every field given.
    pub fn new(epoch: u32, layer: u32, phase: Phase) -> Self {
        Tag {
            epoch,
            layer,
            phase,
        }
    }

    /// Forward halo exchange of `layer` in `epoch`.
    pub fn forward(epoch: u32, layer: u32) -> Self {
        Tag::new(epoch, layer, Phase::Forward)
    }

    /// Backward halo exchange of `layer` in `epoch`.
    pub fn backward(epoch: u32, layer: u32) -> Self {
        Tag::new(epoch, layer, Phase::Backward)
    }

    /// Gradient all-reduce (of `layer`'s parameters, or layer 0 for one fused buffer).
    pub fn all_reduce(epoch: u32, layer: u32) -> Self {
        Tag::new(epoch, layer, Phase::AllReduce)
    }

    /// Any other transfer (setup, metadata, barriers).
    pub fn other(epoch: u32, layer: u32) -> Self {
        Tag::new(epoch, layer, Phase::Other)
    }

    /// Feature fetch of replicated vertices for a plan built in `epoch` (layer 0: the
    /// features are the first layer's input).
    pub fn fetch(epoch: u32) -> Self {
        Tag::new(epoch, 0, Phase::Fetch)
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[epoch {} layer {} {}]",
            self.epoch, self.layer, self.phase
        )
    }
}

/// Which fabric operation (and which step of it) a message belongs to. Part of every message
/// header so that, e.g., a point-to-point message and an exchange with the same tag, or the two
/// steps of an all-reduce, cannot be confused. Public because other transports must carry it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// [`crate::Endpoint::send`] / [`crate::Endpoint::recv`] and their byte variants.
    PointToPoint,
    /// [`crate::Endpoint::exchange`].
    Exchange,
    /// All-reduce step 1: device buffer to its server head.
    ReduceToHead,
    /// All-reduce step 2: head sends chunk `c` of its server sum to the head owning chunk `c`.
    HeadReduceScatter,
    /// All-reduce step 3: head sends its fully reduced chunk to every other head.
    HeadAllGather,
    /// All-reduce step 4: head sends the result to the devices of its server.
    HeadToDevices,
    /// Broadcast: from the root to heads and to its own server's devices.
    BroadcastFromRoot,
    /// Broadcast: from a head to the devices of its server.
    BroadcastFromHead,
}

impl Op {
    /// Human-readable name used in error messages.
    pub fn name(self) -> &'static str {
        match self {
            Op::PointToPoint => "point-to-point message",
            Op::Exchange => "exchange",
            Op::ReduceToHead => "all-reduce (device to head)",
            Op::HeadReduceScatter => "all-reduce (head reduce-scatter)",
            Op::HeadAllGather => "all-reduce (head all-gather)",
            Op::HeadToDevices => "all-reduce (head to devices)",
            Op::BroadcastFromRoot => "broadcast (from root)",
            Op::BroadcastFromHead => "broadcast (from head)",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names are public (JSON reports, the daemon's `phase` metric label): existing ones
    /// must never change, and `name` must be the serde name.
    #[test]
    fn phase_names_are_stable_serde_names() {
        for (phase, name) in [
            (Phase::Forward, "forward"),
            (Phase::Backward, "backward"),
            (Phase::AllReduce, "all_reduce"),
            (Phase::Other, "other"),
            (Phase::Fetch, "fetch"),
        ] {
            assert_eq!(phase.name(), name);
            assert_eq!(serde_json::to_value(phase).unwrap(), name);
            let back: Phase = serde_json::from_value(serde_json::json!(name)).unwrap();
            assert_eq!(back, phase);
        }
        assert_eq!(Tag::fetch(3), Tag::new(3, 0, Phase::Fetch));
    }
}
