//! The compact row space of one layer: only the rows a layer reads and writes.
//!
//! A masked layer is exact on a prefix of the owned block and reads the owned rows valid at
//! the previous layer plus a prefix of every halo group (see [`crate::LayerMask`]). Running
//! and storing the layer over all `n_owned` / `n_local` rows and zero-filling the rest wastes
//! compute and, for deep models, most of the activation memory: a 56-layer co-batch plan
//! computes only its targets at the last layer, yet the plan holds the whole closure. So the
//! runner works in a per-layer COMPACT space instead ([`DevicePlan::layer_rows`]):
//!
//! - output (dst) rows `0..n_dst`: the layer's valid owned prefix, same ids as the plan;
//! - input (src) rows: owned rows `0..owned_src` (same ids), then the received prefix of each
//!   halo group, packed back to back in group order (`halo[i].compact_start`).
//!
//! Because owned ids are unchanged, a layer's output IS the owned part of the next layer's
//! input (`n_dst(l) == owned_src(l + 1)` on the same plan), and send lists (owned ids) index
//! both directly. For an unmasked plan, and at layer 0 of every plan built here, the compact
//! space equals the local space. The price is one CSR per distinct compact space
//! ([`DevicePlan::compact_graph`]); layers whose spaces are equal (every FB layer, the
//! saturated layers of a deep model) share one, as [`layer_spaces`] decides for the runner and
//! the memory model alike.

use grandis_store::{CsrGraph, CsrView};

use crate::error::{MaskingError, Result};
use crate::plan::DevicePlan;

/// The received prefix of one halo group in a layer's compact input space.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize)]
pub struct CompactHalo {
    /// First local row of the group (`DevicePlan::halo[i].rows.start`).
    pub local_start: u32,
    /// Rows of the group received for this layer (a prefix of the group).
    pub len: u32,
    /// Where those rows start in the compact input space.
    pub compact_start: u32,
}

/// What one layer of one plan reads and writes (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize)]
pub struct LayerRows {
    /// Output rows `0..n_dst` (owned, exact at this layer).
    pub n_dst: usize,
    /// Input rows `0..owned_src` are owned rows (valid at the previous layer; all owned rows
    /// at layer 0 and on unmasked plans).
    pub owned_src: usize,
    /// One entry per halo group of the plan (same index as `DevicePlan::halo`).
    pub halo: Vec<CompactHalo>,
    /// Input rows in all: `owned_src` plus every group's `len`.
    pub n_src: usize,
    /// The plan's per-layer graph this layer aggregates over (layer-wise sampling), if any.
    pub graph_layer: Option<usize>,
}

impl LayerRows {
    /// Whether the compact input space is the plan's whole local space (nothing to remap).
    pub fn is_identity(&self, plan: &DevicePlan) -> bool {
        self.n_dst == plan.n_owned && self.n_src == plan.n_local()
    }
}

/// The compact spaces of a run of `layers` layers, layer `l` running on `plan_at(l)`: per
/// layer, its space and the first layer whose block it shares (itself when it is the first).
/// Layers of the same plan (same address) with equal spaces share one uploaded block; the
/// runner and the memory model both decide sharing here, so they cannot disagree.
pub fn layer_spaces<'p>(
    layers: usize,
    plan_at: impl Fn(usize) -> &'p DevicePlan,
) -> Vec<(LayerRows, usize)> {
    let mut out: Vec<(LayerRows, usize)> = Vec::with_capacity(layers);
    for l in 0..layers {
        let p = plan_at(l);
        let rows = p.layer_rows(l);
        let first = (0..l)
            .find(|&e| std::ptr::eq(plan_at(e), p) && out[e].0 == rows)
            .unwrap_or(l);
        out.push((rows, first));
    }
    out
}

impl DevicePlan {
    /// The compact row space of `layer` (see the module doc).
    pub fn layer_rows(&self, layer: usize) -> LayerRows {
        let owned_src = if layer == 0 || !self.is_masked(layer - 1) {
            self.n_owned
        } else {
            self.valid_owned(layer - 1).end as usize
        };
        let mut at = owned_src as u32;
        let halo = (0..self.halo.len())
            .map(|gi| {
                let r = self.recv_rows(layer, gi);
                let h = CompactHalo {
                    local_start: r.start,
                    len: r.len() as u32,
                    compact_start: at,
                };
                at += h.len;
                h
            })
            .collect();
        LayerRows {
            n_dst: self.valid_owned(layer).end as usize,
            owned_src,
            halo,
            n_src: at as usize,
            graph_layer: (!self.layer_graphs.is_empty())
                .then(|| layer.min(self.layer_graphs.len() - 1)),
        }
    }

    /// The graph the layer of `rows` aggregates over, in LOCAL ids: its per-layer graph under
    /// layer-wise sampling, else the plan's one-hop graph.
    pub fn rows_graph(&self, rows: &LayerRows) -> CsrView<'_> {
        match rows.graph_layer {
            Some(l) => self.layer_graph(l),
            None => self.graph.view(),
        }
    }

    /// In-edges owned row `row` aggregates over in the layer of `rows` (the divisor of mean
    /// aggregation, see [`DevicePlan::agg_degree_at`]).
    pub fn rows_agg_degree(&self, rows: &LayerRows, row: u32) -> u32 {
        match rows.graph_layer {
            Some(l) => self.agg_degree_at(l, row),
            None => self.agg_degree[row as usize],
        }
    }

    /// The graph `layer` aggregates over, in its compact space: `rows.n_dst` rows whose
    /// column indices are compact input rows. Fails if a valid row reads a row the layer does
    /// not hold, which would mean the plan broke its prefix invariant.
    pub fn compact_graph(&self, rows: &LayerRows) -> Result<CsrGraph> {
        let g = self.rows_graph(rows);
        let end = g.offsets[rows.n_dst] as usize;
        let src = &g.indices[..end];
        let offsets = g.offsets[..=rows.n_dst].to_vec();
        if rows.is_identity(self) {
            return Ok(CsrGraph {
                offsets,
                indices: src.to_vec(),
            });
        }
        // Halo local row -> compact row (u32::MAX: not received at this layer).
        let mut halo_map = vec![u32::MAX; self.n_halo()];
        for h in &rows.halo {
            let base = h.local_start as usize - self.n_owned;
            for j in 0..h.len {
                halo_map[base + j as usize] = h.compact_start + j;
            }
        }
        let indices = src
            .iter()
            .map(|&u| {
                let c = if (u as usize) < self.n_owned {
                    if (u as usize) < rows.owned_src {
                        u
                    } else {
                        u32::MAX
                    }
                } else {
                    halo_map[u as usize - self.n_owned]
                };
                if c == u32::MAX {
                    Err(MaskingError::Internal(format!(
                        "rank {}: a valid row reads local row {u} (vertex {}), which this \
                         layer neither computed nor received",
                        self.rank, self.global_ids[u as usize]
                    )))
                } else {
                    Ok(c)
                }
            })
            .collect::<Result<Vec<u32>>>()?;
        Ok(CsrGraph { offsets, indices })
    }

    /// Checks that every row sent before `layer` is an input row of the layer on this side
    /// (owned and valid at the previous layer), so senders gather from, and backward adds
    /// received gradients into, rows the compact buffers actually hold.
    pub fn check_sends(&self, layer: usize, rows: &LayerRows) -> Result<()> {
        for list in 0..self.sends.len() {
            if let Some(&r) = self
                .send_rows(layer, list)
                .iter()
                .find(|&&r| r as usize >= rows.owned_src)
            {
                return Err(MaskingError::Internal(format!(
                    "rank {}: layer {layer} sends owned row {r} to rank {}, but only rows \
                     below {} are inputs of that layer",
                    self.rank, self.sends[list].peer, rows.owned_src
                )));
            }
        }
        Ok(())
    }

    /// Global id of every compact input row of `rows`.
    pub fn compact_global_ids(&self, rows: &LayerRows) -> Vec<u32> {
        let mut ids = Vec::with_capacity(rows.n_src);
        ids.extend_from_slice(&self.global_ids[..rows.owned_src]);
        for h in &rows.halo {
            let s = h.local_start as usize;
            ids.extend_from_slice(&self.global_ids[s..s + h.len as usize]);
        }
        ids
    }
}
