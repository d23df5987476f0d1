//! Plan statistics and exchange-volume predictions the trainer checks its counters against.

use crate::flx::{FbPlan, FlxPlan, PreloadPlan};
use crate::memory::ModelDims;
use crate::plan::DevicePlan;
use grandis_wire::{LinkClass, PerLink};

/// Halo rows one device receives from one peer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PeerHalo {
    pub peer: usize,
    pub rows: usize,
    pub class: LinkClass,
}

/// Sizes of one device's plan.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceStats {
    pub rank: usize,
    pub n_inner: usize,
    pub n_owned: usize,
    pub n_halo: usize,
    pub n_local: usize,
    pub edges: usize,
    pub halo: Vec<PeerHalo>,
    /// Halo rows by link class (all layers' upper bound; masks may exchange fewer).
    pub halo_rows: PerLink,
    /// Rows this device sends per full exchange, by link class.
    pub send_rows: PerLink,
}

/// Sizes of a whole plan.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PlanStats {
    pub devices: Vec<DeviceStats>,
    /// Replicated vertices per server (all zero for the FB plan).
    pub replicated_per_server: Vec<usize>,
    /// Halo rows over all devices by link class.
    pub halo_rows: PerLink,
    pub max_n_local: usize,
}

fn class_of(devices: &[DevicePlan], a: usize, b: usize) -> LinkClass {
    if devices[a].server == devices[b].server {
        LinkClass::IntraServer
    } else {
        LinkClass::InterServer
    }
}

fn device_stats(devices: &[DevicePlan], d: &DevicePlan) -> DeviceStats {
    let mut halo_rows = PerLink::default();
    let halo = d
        .halo
        .iter()
        .map(|g| {
            let class = class_of(devices, d.rank, g.peer);
            let rows = g.rows.len();
            halo_rows.add_to(class, rows as u64);
            PeerHalo {
                peer: g.peer,
                rows,
                class,
            }
        })
        .collect();
    let mut send_rows = PerLink::default();
    for s in &d.sends {
        send_rows.add_to(class_of(devices, d.rank, s.peer), s.rows.len() as u64);
    }
    DeviceStats {
        rank: d.rank,
        n_inner: d.n_inner,
        n_owned: d.n_owned,
        n_halo: d.n_halo(),
        n_local: d.n_local(),
        edges: d.num_edges(),
        halo,
        halo_rows,
        send_rows,
    }
}

fn plan_stats(devices: &[DevicePlan], replicated_per_server: Vec<usize>) -> PlanStats {
    let per: Vec<DeviceStats> = devices.iter().map(|d| device_stats(devices, d)).collect();
    let mut halo_rows = PerLink::default();
    for s in &per {
        halo_rows.add(&s.halo_rows);
    }
    PlanStats {
        max_n_local: per.iter().map(|s| s.n_local).max().unwrap_or(0),
        devices: per,
        replicated_per_server,
        halo_rows,
    }
}

/// Rows received over all devices in the exchange feeding `layer`, by link class (`devices`
/// indexed by rank; masked layers count only their prefixes).
pub fn exchange_rows(devices: &[DevicePlan], layer: usize) -> PerLink {
    let mut rows = PerLink::default();
    for d in devices {
        for (gi, g) in d.halo.iter().enumerate() {
            rows.add_to(
                class_of(devices, d.rank, g.peer),
                d.recv_rows(layer, gi).len() as u64,
            );
        }
    }
    rows
}

/// Bytes (f32 rows of `width`) moved in the exchange feeding `layer`, by link class. The
/// backward exchange of a layer moves the same rows (gradients, back to their owners).
pub fn exchange_bytes(devices: &[DevicePlan], layer: usize, width: usize) -> PerLink {
    let rows = exchange_rows(devices, layer);
    let per_row = width as u64 * 4;
    PerLink {
        intra_server: rows.intra_server * per_row,
        inter_server: rows.inter_server * per_row,
    }
}

impl FbPlan {
    pub fn stats(&self) -> PlanStats {
        let servers = self.devices.iter().map(|d| d.server + 1).max().unwrap_or(0);
        plan_stats(&self.devices, vec![0; servers])
    }
}

impl FlxPlan {
    pub fn stats(&self) -> PlanStats {
        plan_stats(
            &self.devices,
            self.servers.iter().map(|s| s.replicated).collect(),
        )
    }
}

impl PreloadPlan {
    /// Predicted bytes of the FORWARD exchange feeding `layer` (width = the layer's input
    /// width). Layer 0's exchange carries raw features; a trainer that loads halo features
    /// from the dataset instead skips it. The backward exchange of layer `l >= 1` moves the
    /// same number of bytes; layer 0 has none (features need no gradient).
    pub fn forward_exchange_bytes(&self, layer: usize, dims: &ModelDims) -> PerLink {
        exchange_bytes(self.layer_plans(layer), layer, dims.in_width(layer))
    }
}
