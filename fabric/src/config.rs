//! Cluster shape ([`Topology`]), link models ([`LinkModel`]) and [`FabricConfig`].

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::counters::LinkClass;
use crate::error::{FabricError, Result};

/// Shape of the cluster: `servers` × `devices` ranks, rank = server * devices + device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Topology {
    /// Number of servers S (≥ 1).
    pub servers: usize,
    /// Number of devices per server G (≥ 1).
    pub devices: usize,
}

impl Topology {
    /// Total number of ranks, S × G.
    pub fn world(&self) -> usize {
        self.servers * self.devices
    }

    /// Server of `rank`.
    pub fn server_of(&self, rank: usize) -> usize {
        rank / self.devices
    }

    /// Device index of `rank` within its server.
    pub fn device_of(&self, rank: usize) -> usize {
        rank % self.devices
    }

    /// Rank of device `device` on server `server`.
    pub fn rank_of(&self, server: usize, device: usize) -> usize {
        server * self.devices + device
    }

    /// The ranks of `server`, its head first.
    pub fn ranks_of(&self, server: usize) -> std::ops::Range<usize> {
        self.rank_of(server, 0)..self.rank_of(server + 1, 0)
    }

    /// Head of `server` (its device 0), which talks to other servers in collectives.
    pub fn head_of(&self, server: usize) -> usize {
        self.rank_of(server, 0)
    }

    /// Link class between two ranks: inter-server iff they sit on different servers.
    pub fn class(&self, a: usize, b: usize) -> LinkClass {
        if self.server_of(a) == self.server_of(b) {
            LinkClass::IntraServer
        } else {
            LinkClass::InterServer
        }
    }
}

/// Emulated behaviour of one link class. See the crate documentation for the exact model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkModel {
    /// Bandwidth in payload bytes per second; `None` = unlimited (no bandwidth delay).
    pub bandwidth_bytes_per_s: Option<f64>,
    /// Added to every message after its last byte left the bucket; zero = none.
    pub latency: Duration,
}

impl LinkModel {
    /// Unlimited bandwidth, zero latency: messages are delivered as soon as they are sent.
    pub fn unlimited() -> Self {
        LinkModel::default()
    }

    /// A link of `bandwidth_bytes_per_s` and `latency`.
    pub fn new(bandwidth_bytes_per_s: f64, latency: Duration) -> Self {
        LinkModel {
            bandwidth_bytes_per_s: Some(bandwidth_bytes_per_s),
            latency,
        }
    }

    /// True when this model never delays a message.
    pub fn is_unlimited(&self) -> bool {
        self.bandwidth_bytes_per_s.is_none() && self.latency.is_zero()
    }

    fn validate(&self, what: &str) -> Result<()> {
        if let Some(bw) = self.bandwidth_bytes_per_s {
            if !(bw.is_finite() && bw > 0.0) {
                return Err(FabricError::Config(format!(
                    "{what}.bandwidth_bytes_per_s must be a positive finite number of bytes \
                     per second (or None for unlimited), got {bw}"
                )));
            }
        }
        Ok(())
    }
}

/// Default receive timeout: generous, so that slow epochs never trip it, yet finite, so that a
/// wedged run ends with an error naming the peer instead of hanging forever.
pub const DEFAULT_RECV_TIMEOUT: Duration = Duration::from_secs(300);

/// Everything [`crate::Fabric::new`] needs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct FabricConfig {
    /// Number of servers S (≥ 1).
    pub servers: usize,
    /// Devices per server G (≥ 1).
    pub devices: usize,
    /// Model of intra-server links (one per device per direction).
    pub intra: LinkModel,
    /// Model of inter-server links (one NIC per server per direction, shared by its devices).
    pub inter: LinkModel,
    /// How long a receive waits for a message before failing with [`FabricError::Timeout`].
    pub recv_timeout: Duration,
}

impl Default for FabricConfig {
    fn default() -> Self {
        FabricConfig {
            servers: 1,
            devices: 1,
            intra: LinkModel::unlimited(),
            inter: LinkModel::unlimited(),
            recv_timeout: DEFAULT_RECV_TIMEOUT,
        }
    }
}

impl FabricConfig {
    /// `servers` × `devices` with unlimited links and the default timeout.
    pub fn new(servers: usize, devices: usize) -> Self {
        FabricConfig {
            servers,
            devices,
            ..Default::default()
        }
    }

    /// The cluster shape.
    pub fn topology(&self) -> Topology {
        Topology {
            servers: self.servers,
            devices: self.devices,
        }
    }

    /// Checks every field; errors name the field and the problem.
    pub fn validate(&self) -> Result<()> {
        if self.servers == 0 {
            return Err(FabricError::Config(
                "servers must be at least 1, got 0".into(),
            ));
        }
        if self.devices == 0 {
            return Err(FabricError::Config(
                "devices must be at least 1, got 0".into(),
            ));
        }
        if self.servers.checked_mul(self.devices).is_none() {
            return Err(FabricError::Config(format!(
                "servers × devices overflows: {} × {}",
                self.servers, self.devices
            )));
        }
        self.intra.validate("intra")?;
        self.inter.validate("inter")?;
        if self.recv_timeout.is_zero() {
            return Err(FabricError::Config(
                "recv_timeout must be positive, got 0".into(),
            ));
        }
        Ok(())
    }
}
