//! The link classes traffic is counted by: between the devices of one server and between
//! servers.

use serde::{Deserialize, Serialize};

/// The two kinds of links of the modelled cluster: the one vocabulary of the fabric's
/// counters, the plans' halo statistics and the summaries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum LinkClass {
    /// Between two devices of the same server (NVLink/PCIe, NCCL, in-process copies).
    #[serde(rename = "intra_server")]
    IntraServer,
    /// Between devices of different servers (Ethernet/InfiniBand: QUIC or NCCL).
    #[serde(rename = "inter_server")]
    InterServer,
}

/// A count per link class: bytes in summaries ([`LinkBytes`]), rows or bytes in a plan's
/// statistics (as the field holding it says).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PerLink {
    /// Between devices of the same server.
    pub intra_server: u64,
    /// Between servers (the QUIC data plane).
    pub inter_server: u64,
}

/// Bytes moved per link class (as in `grandis-fabric`'s accounting).
pub type LinkBytes = PerLink;

impl PerLink {
    /// Adds `other` class by class (saturating).
    pub fn add(&mut self, other: &PerLink) {
        self.intra_server = self.intra_server.saturating_add(other.intra_server);
        self.inter_server = self.inter_server.saturating_add(other.inter_server);
    }
    /// Adds `n` to `class`'s count (saturating).
    pub fn add_to(&mut self, class: LinkClass, n: u64) {
        let c = match class {
            LinkClass::IntraServer => &mut self.intra_server,
            LinkClass::InterServer => &mut self.inter_server,
        };
        *c = c.saturating_add(n);
    }
    /// The count of `class`.
    pub fn get(&self, class: LinkClass) -> u64 {
        match class {
            LinkClass::IntraServer => self.intra_server,
            LinkClass::InterServer => self.inter_server,
        }
    }
    /// Both classes together.
    pub fn total(&self) -> u64 {
        self.intra_server.saturating_add(self.inter_server)
    }
}
