//! The link classes traffic is counted by: between the devices of one server and between
//! servers.

use serde::{Deserialize, Serialize};

/// Bytes moved per link class (as in `grandis-fabric`'s accounting).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkBytes {
    /// Between devices of the same server.
    pub intra_server: u64,
    /// Between servers (the QUIC data plane).
    pub inter_server: u64,
}

impl LinkBytes {
    pub fn add(&mut self, other: &LinkBytes) {
        self.intra_server = self.intra_server.saturating_add(other.intra_server);
        self.inter_server = self.inter_server.saturating_add(other.inter_server);
    }
}
