//! One device's one-hop graph in its local id space, and the generic builder shared by the FB
//! and FLX plans.
//!
//! Local row order (the invariant everything else relies on):
//! - rows `0..n_owned` are the device's OWNED rows, sorted by (hop level, global id). Level 0
//!   rows are the device's inner vertices (its layout range, or its targets in an extraction
//!   plan, see [`crate::extract`]), so they come first:
//!   `0..n_inner` is exactly the FB plan's owned block (the reshape is an identity prefix).
//! - rows `n_owned..n_local` are HALO rows, one contiguous group per peer rank (ascending
//!   rank), each sorted by (need level, global id), where a halo row's need level is the
//!   smallest level of the owned rows that read it. In the FB plan every level is 0, so groups
//!   are simply sorted by global id.
//!
//! Because of this order, the rows valid at a layer are a prefix of the owned block and the rows
//! exchanged at a layer are a prefix of every halo group and send list ([`LayerMask`]).

use std::ops::Range;

use grandis_store::{CsrGraph, CsrView};
use rayon::prelude::*;

use crate::context::{PlanContext, SPLIT_TRAIN};
use crate::error::{MaskingError, Result};
use crate::extract::RowSource;
use crate::idmap::IdMap;

/// Halo rows received from one peer: a contiguous block of local rows.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HaloGroup {
    /// Rank of the device that owns these vertices.
    pub peer: usize,
    /// Local rows `rows.start..rows.end` (all `>= n_owned`).
    pub rows: Range<u32>,
}

/// Owned rows sent to one peer, in the order of that peer's halo group for this device, so
/// a received buffer lands contiguously in the peer's halo block. In backward the peer sends
/// gradients of those halo rows back in the same order and the owner ADDS them into these rows.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SendList {
    /// Rank receiving these rows.
    pub peer: usize,
    /// Local owned rows of this device (all `< n_owned`).
    pub rows: Vec<u32>,
}

/// What is exact at one masked layer (FLX layers `0..k`), all as prefix lengths.
///
/// At layer `l` of a k-hop plan an owned row is computed (exact) iff its level is
/// `<= k - 1 - l`; the rest is masked (the runner does not even hold those rows: each layer
/// runs in its compact row space, see [`crate::LayerRows`]). The exchange feeding layer `l` moves
/// only the halo rows some valid output row reads: need level `<= k - 1 - l`. Such rows are
/// always exact inputs (level <= need + 1 <= k - l, i.e. valid at layer `l - 1` on their owner,
/// or raw features at layer 0).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LayerMask {
    /// Owned rows `0..valid_owned` are valid outputs of this layer.
    pub valid_owned: u32,
    /// Per halo group (same index as `DevicePlan::halo`): the first `recv[i]` rows are received.
    pub recv: Vec<u32>,
    /// Per send list (same index as `DevicePlan::sends`): the first `send[i]` rows are sent.
    pub send: Vec<u32>,
}

/// One device's plan for a run of layers: one-hop graph, exchanges, masks and row metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicePlan {
    /// Global rank `server * devices + device`.
    pub rank: usize,
    pub server: usize,
    /// Device index within the server.
    pub device: usize,
    /// Rows `0..n_inner` are the device's inner vertices: its targets (for FB/FLX plans its
    /// whole layout range; for a co-batch plan the co-batch vertices it owns), ascending.
    pub n_inner: usize,
    /// Rows `0..n_owned` are computed here (inner, then replicated vertices by level).
    pub n_owned: usize,
    /// Global id of every local row (`n_local` entries). Dropout masks key on this.
    pub global_ids: Vec<u32>,
    /// Hop level of every local row's vertex from the server's inner set (0 in the FB plan).
    pub level: Vec<u8>,
    /// Need level of every halo row (index `local - n_owned`).
    pub halo_need: Vec<u8>,
    /// `n_owned` rows; row i lists the LOCAL rows of the KEPT in-neighbours of owned row i,
    /// sorted (all in-neighbours for exact plans). Rows whose level is too deep to ever be
    /// valid are empty (see the FLX builder). With per-layer sampling this is the union of
    /// the per-layer graphs, see [`DevicePlan::layer_graphs`].
    pub graph: CsrGraph,
    /// Halo groups, ascending peer rank, contiguous and covering `n_owned..n_local`.
    pub halo: Vec<HaloGroup>,
    /// Send lists, ascending peer rank.
    pub sends: Vec<SendList>,
    /// One mask per masked layer; empty for an unmasked (FB) plan.
    pub masks: Vec<LayerMask>,
    /// FULL-graph in-degree of every local row's vertex (normalisation on a partial graph).
    pub in_degree: Vec<u32>,
    /// The number of in-edges each local row aggregates over: for a complete owned row the
    /// length of its row in `graph` (equal to `in_degree` when the row is exact, the kept
    /// count when sampled); `in_degree` for every other row (halo rows and rows never
    /// computed). Mean aggregation divides by THIS, not by `in_degree`; with per-layer graphs
    /// use [`DevicePlan::agg_degree_at`]. Equal to `in_degree` everywhere in FB/FLX plans.
    pub agg_degree: Vec<u32>,
    /// Per-layer graphs (layer-wise sampling only; empty otherwise): `layer_graphs[l]` has
    /// `n_owned` rows in the same local ids as `graph`, row i = the in-edges row i aggregates
    /// at layer l (empty for rows not valid at l). Each is a subset of `graph`.
    pub layer_graphs: Vec<CsrGraph>,
    /// Split flags (`SPLIT_*` bits) of every owned row.
    pub split: Vec<u8>,
    /// The global-to-local map, derived from `global_ids` on first use.
    lookup: GlobalIndex,
}

/// (global id, local row) of every local row, sorted by global id: a plan's global-to-local
/// map, built on first use (a mini-batch plan is trained without ever needing it). Derived
/// from `global_ids`, so it never makes two plans unequal.
#[derive(Debug, Clone, Default)]
struct GlobalIndex(std::sync::OnceLock<Vec<(u32, u32)>>);

impl PartialEq for GlobalIndex {
    fn eq(&self, _: &GlobalIndex) -> bool {
        true
    }
}

impl Eq for GlobalIndex {}

impl DevicePlan {
    pub fn n_local(&self) -> usize {
        self.global_ids.len()
    }
    pub fn n_halo(&self) -> usize {
        self.n_local() - self.n_owned
    }
    pub fn num_edges(&self) -> usize {
        self.graph.indices.len()
    }
    /// Local row of a global vertex, if this device holds it.
    pub fn local_of(&self, global: u32) -> Option<u32> {
        let lookup = self.lookup.0.get_or_init(|| {
            let mut lookup: Vec<(u32, u32)> = self
                .global_ids
                .iter()
                .enumerate()
                .map(|(i, &g)| (g, i as u32))
                .collect();
            lookup.sort_unstable();
            lookup
        });
        lookup
            .binary_search_by_key(&global, |&(g, _)| g)
            .ok()
            .map(|i| lookup[i].1)
    }
    /// Local in-neighbour rows of owned row `row`.
    pub fn row(&self, row: u32) -> &[u32] {
        self.graph.view().neighbors(row)
    }
    /// The graph layer `layer` aggregates over: its per-layer graph when the plan has them,
    /// otherwise `graph`.
    pub fn layer_graph(&self, layer: usize) -> CsrView<'_> {
        match self.layer_graphs.get(layer) {
            Some(g) => g.view(),
            None => self.graph.view(),
        }
    }
    /// In-edges owned row `row` aggregates over at `layer` (the divisor of mean aggregation).
    pub fn agg_degree_at(&self, layer: usize, row: u32) -> u32 {
        match self.layer_graphs.get(layer) {
            Some(g) => g.view().degree(row) as u32,
            None => self.agg_degree[row as usize],
        }
    }
    /// Whether any row of this plan aggregates over a sampled (strict) subset of its
    /// in-edges, or the plan has per-layer graphs.
    pub fn is_sampled(&self) -> bool {
        !self.layer_graphs.is_empty() || self.agg_degree != self.in_degree
    }
    /// Number of owned rows computed (valid) at the output of each masked layer (for an
    /// unmasked plan, one entry per call is `n_owned`; see [`DevicePlan::valid_owned`]).
    pub fn computed_rows(&self, layers: usize) -> Vec<u64> {
        (0..layers)
            .map(|l| self.valid_owned(l).len() as u64)
            .collect()
    }
    /// What `layer` of this plan computes: its valid output rows and the in-edges they
    /// aggregate there (kept edges under sampling). The one count of a plan's work that
    /// step statistics, the planner and sampling statistics all read.
    pub fn work_at(&self, layer: usize) -> PlanWork {
        let rows = self.valid_owned(layer);
        PlanWork {
            rows: rows.len() as u64,
            edges: rows.map(|r| self.agg_degree_at(layer, r) as u64).sum(),
        }
    }
    /// Whether layer `layer` of this plan is masked (FLX layers `0..k`).
    pub fn is_masked(&self, layer: usize) -> bool {
        layer < self.masks.len()
    }
    /// Owned rows valid (exact) at the output of `layer`: a prefix of the owned block.
    pub fn valid_owned(&self, layer: usize) -> Range<u32> {
        match self.masks.get(layer) {
            Some(m) => 0..m.valid_owned,
            None => 0..self.n_owned as u32,
        }
    }
    /// The explicit list of valid output rows at `layer`.
    pub fn valid_output_rows(&self, layer: usize) -> Vec<u32> {
        self.valid_owned(layer).collect()
    }
    /// `n_owned` flags: is owned row i a valid output of `layer`.
    pub fn output_bitmap(&self, layer: usize) -> Vec<bool> {
        let valid = self.valid_owned(layer).end as usize;
        (0..self.n_owned).map(|i| i < valid).collect()
    }
    /// `n_local` flags: which rows hold exact INPUTS of `layer` once its exchange is done
    /// (owned rows valid at `layer - 1`, or all owned rows at layer 0 where inputs are raw
    /// features; plus the received prefix of every halo group).
    pub fn input_bitmap(&self, layer: usize) -> Vec<bool> {
        let owned_valid = if layer == 0 || !self.is_masked(layer - 1) {
            self.n_owned as u32
        } else {
            self.valid_owned(layer - 1).end
        };
        let mut bits = vec![false; self.n_local()];
        for b in bits.iter_mut().take(owned_valid as usize) {
            *b = true;
        }
        for gi in 0..self.halo.len() {
            for r in self.recv_rows(layer, gi) {
                bits[r as usize] = true;
            }
        }
        bits
    }
    /// Local rows of halo group `group` received before `layer` (a prefix of the group).
    pub fn recv_rows(&self, layer: usize, group: usize) -> Range<u32> {
        let g = &self.halo[group];
        match self.masks.get(layer) {
            Some(m) => g.rows.start..g.rows.start + m.recv[group],
            None => g.rows.clone(),
        }
    }
    /// Owned rows sent through send list `list` before `layer` (a prefix of the list).
    pub fn send_rows(&self, layer: usize, list: usize) -> &[u32] {
        let s = &self.sends[list];
        match self.masks.get(layer) {
            Some(m) => &s.rows[..m.send[list] as usize],
            None => &s.rows,
        }
    }
    /// The halo group received from `peer`, if any.
    pub fn halo_from(&self, peer: usize) -> Option<&HaloGroup> {
        self.halo.iter().find(|g| g.peer == peer)
    }
    /// Loss rows: inner rows that are training vertices. Inner sets partition the graph, so
    /// every training vertex is a loss row of exactly one device.
    pub fn loss_rows(&self) -> Vec<u32> {
        self.inner_rows_with(SPLIT_TRAIN)
    }
    /// Inner rows whose split flags contain `flag` (e.g. `SPLIT_VAL` for evaluation).
    pub fn inner_rows_with(&self, flag: u8) -> Vec<u32> {
        (0..self.n_inner as u32)
            .filter(|&r| self.split[r as usize] & flag != 0)
            .collect()
    }
}

/// The work of one layer of one plan ([`DevicePlan::work_at`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PlanWork {
    /// Output rows computed (valid owned rows).
    pub rows: u64,
    /// In-edges those rows aggregate.
    pub edges: u64,
}

/// What the generic builder needs to know about one device.
pub(crate) struct DeviceSpec {
    pub rank: usize,
    pub server: usize,
    pub device: usize,
    pub n_inner: usize,
    /// Owned vertices in local order: sorted by (level, global id).
    pub owned: Vec<u32>,
    pub owned_level: Vec<u8>,
    /// Rows with level `< complete_below` get their full in-neighbourhood; deeper rows stay
    /// empty because no mask ever makes them valid.
    pub complete_below: u8,
    /// Number of masked layers (k), 0 for an unmasked plan.
    pub masked_layers: usize,
    /// Every vertex the plan reads is owned here (a standalone mini-batch plan): no halo.
    pub sole: bool,
}

/// Rows a plan's graph builder hands one task when the pool has several threads: enough
/// that joining the parts costs little beside building them.
const ROWS_PER_TASK: usize = 16384;

/// A run of consecutive rows' kept edges as local ids: the union CSR and one per layer, each
/// with offsets from 0.
struct RowsPart {
    union: CsrGraph,
    layers: Vec<CsrGraph>,
}

impl RowsPart {
    fn new(layers: usize, rows: usize) -> RowsPart {
        let csr = || {
            let mut offsets = Vec::with_capacity(rows + 1);
            offsets.push(0u64);
            CsrGraph {
                offsets,
                indices: Vec::new(),
            }
        };
        RowsPart {
            union: csr(),
            layers: (0..layers).map(|_| csr()).collect(),
        }
    }

    /// Closes the current row of every CSR.
    fn end_row(&mut self) {
        for g in std::iter::once(&mut self.union).chain(&mut self.layers) {
            g.offsets.push(g.indices.len() as u64);
        }
    }

    /// The parts' rows in order, every CSR joined on the thread pool.
    fn join(parts: Vec<RowsPart>, layers: usize) -> RowsPart {
        let mut unions = Vec::with_capacity(parts.len());
        let mut per_layer: Vec<Vec<CsrGraph>> = (0..layers).map(|_| Vec::new()).collect();
        for part in parts {
            unions.push(part.union);
            for (l, g) in part.layers.into_iter().enumerate() {
                per_layer[l].push(g);
            }
        }
        RowsPart {
            union: CsrGraph::join(unions),
            layers: per_layer.into_iter().map(CsrGraph::join).collect(),
        }
    }
}

/// Builds a device plan except its send lists (see [`fill_sends`]). Vertices are named by
/// `rows`' keys (global ids, or a sample's indices): `spec.owned` lists keys, `owner_of(u)` is
/// the rank that owns key `u` in this plan (None: not part of the plan), `level_of(u)` its
/// hop level; `rows` gives every row's kept in-edges (all of them for exact plans).
pub(crate) fn build_device(
    ctx: &PlanContext<'_>,
    rows: &RowSource<'_, '_>,
    spec: DeviceSpec,
    owner_of: impl Fn(u32) -> Option<usize>,
    level_of: impl Fn(u32) -> u8,
) -> Result<DevicePlan> {
    let DeviceSpec {
        rank,
        server,
        device,
        n_inner,
        owned,
        owned_level,
        complete_below,
        masked_layers,
        sole,
    } = spec;
    let n_owned = owned.len();
    let global = |u: u32| rows.global(u);
    if !owned
        .iter()
        .zip(&owned_level)
        .zip(owned.iter().zip(&owned_level).skip(1))
        .all(|((&a, la), (&b, lb))| (la, global(a)) < (lb, global(b)))
    {
        return Err(MaskingError::Internal(format!(
            "rank {rank}: owned rows are not sorted by (level, global id)"
        )));
    }

    // Halo candidates: (peer, key, need level) for every used in-edge of a complete row
    // that comes from another device; duplicates keep the smallest need level. A standalone
    // plan owns every vertex it reads, so it has none (a missing one is caught below).
    let mut cand: Vec<(usize, u32, u8)> = Vec::new();
    for (i, &v) in owned
        .iter()
        .enumerate()
        .take(if sole { 0 } else { n_owned })
    {
        let lv = owned_level[i];
        if lv >= complete_below {
            continue;
        }
        let (base, srcs) = rows.row(v);
        for (j, &u) in srcs.iter().enumerate() {
            let Some(need) = rows.edge_need(base + j, lv, masked_layers) else {
                continue;
            };
            match owner_of(u) {
                Some(r) if r == rank => {}
                Some(r) => cand.push((r, u, need)),
                None => {
                    return Err(MaskingError::Internal(format!(
                        "rank {rank}: in-neighbour {} of complete row {} (level {lv}) is not \
                         in the plan",
                        global(u),
                        global(v)
                    )))
                }
            }
        }
    }
    cand.sort_unstable();
    cand.dedup_by(|later, first| later.0 == first.0 && later.1 == first.1);
    cand.sort_unstable_by_key(|&(peer, u, need)| (peer, need, global(u)));

    let mut keys = owned;
    let mut level = owned_level;
    let mut halo_need = Vec::with_capacity(cand.len());
    let mut halo: Vec<HaloGroup> = Vec::new();
    for &(peer, u, need) in &cand {
        let local = keys.len() as u32;
        match halo.last_mut() {
            Some(g) if g.peer == peer => g.rows.end = local + 1,
            _ => halo.push(HaloGroup {
                peer,
                rows: local..local + 1,
            }),
        }
        keys.push(u);
        level.push(level_of(u));
        halo_need.push(need);
    }
    let global_ids: Vec<u32> = match rows {
        RowSource::Exact(_) => keys.clone(),
        RowSource::Sampled(_) => keys.iter().map(|&u| global(u)).collect(),
    };

    // Every in-neighbour of a complete row is a row of the plan (owned, or added above as
    // halo). A plan whose keys are its local rows (a standalone plan of a sample numbered in
    // plan order, as the layer-wise sampler numbers it) needs no map at all; otherwise a map
    // over the keys, built once and read once per kept edge.
    let identity = keys.iter().enumerate().all(|(i, &u)| u == i as u32);
    let local = if identity {
        None
    } else {
        let mut local = IdMap::for_size(keys.len(), rows.key_span());
        for (l, &u) in keys.iter().enumerate() {
            if !local.insert_new(u, l as u32) {
                return Err(MaskingError::Internal(format!(
                    "rank {rank}: vertex {} is two rows of the plan (owned and halo)",
                    global(u)
                )));
            }
        }
        Some(local)
    };
    let n_local = keys.len();
    let local_of = |u: u32, v: u32| -> Result<u32> {
        let found = match &local {
            None => ((u as usize) < n_local).then_some(u),
            Some(local) => local.get(u),
        };
        found.ok_or_else(|| {
            MaskingError::Internal(format!(
                "rank {rank}: in-neighbour {} of complete row {} is not in the plan",
                global(u),
                global(v)
            ))
        })
    };

    // The union graph and, with per-layer sampling, every layer's graph, in one pass over
    // each row's kept edges (each edge mapped to its local row once). Layer l holds the rows
    // valid at l (level <= k - 1 - l) and their edges flagged for l.
    let per_layer = if rows.per_layer() { masked_layers } else { 0 };
    // Rows in chunks on the thread pool, each chunk a CSR of its own (offsets from 0), then
    // joined in row order: the same graphs whatever the number of threads.
    // Local ids rise with keys when the keys are the local rows, so a sorted source row
    // stays sorted; only a mapped plan sorts its rows.
    let sort_rows = local.is_some();
    let build_rows = |range: Range<usize>| -> Result<RowsPart> {
        let mut part = RowsPart::new(per_layer, range.len());
        for i in range {
            let lv = level[i];
            if lv < complete_below {
                let start = part.union.indices.len();
                let v = keys[i];
                let (base, srcs) = rows.row(v);
                for (j, &u) in srcs.iter().enumerate() {
                    // Kept if some layer reads it; into those layers' graphs (there are none
                    // without per-layer flags).
                    let used = rows.layers_reading(base + j, lv, masked_layers);
                    if used == 0 {
                        continue;
                    }
                    let loc = local_of(u, v)?;
                    part.union.indices.push(loc);
                    let mut layers = if per_layer == 0 { 0 } else { used };
                    while layers != 0 {
                        part.layers[layers.trailing_zeros() as usize]
                            .indices
                            .push(loc);
                        layers &= layers - 1;
                    }
                }
                if sort_rows {
                    part.union.indices[start..].sort_unstable();
                    for layer in &mut part.layers {
                        // This row's segment starts at the layer's last offset.
                        let s = *layer.offsets.last().expect("starts with 0") as usize;
                        layer.indices[s..].sort_unstable();
                    }
                }
            }
            part.end_row();
        }
        Ok(part)
    };
    let parts = grandis_store::csr::row_runs(n_owned, ROWS_PER_TASK)
        .into_par_iter()
        .map(build_rows)
        .collect::<Result<Vec<RowsPart>>>()?;
    let RowsPart {
        union: CsrGraph { offsets, indices },
        layers: layer_graphs,
    } = RowsPart::join(parts, per_layer);

    // Per-row reads of graph-sized arrays at scattered ids: on the thread pool too.
    let in_degree: Vec<u32> = global_ids.par_iter().map(|&g| ctx.in_degree(g)).collect();
    let agg_degree = (0..global_ids.len())
        .map(|i| {
            if i < n_owned && level[i] < complete_below {
                (offsets[i + 1] - offsets[i]) as u32
            } else {
                in_degree[i]
            }
        })
        .collect();
    let split = global_ids[..n_owned]
        .par_iter()
        .map(|&g| ctx.splits().flags(g))
        .collect();

    let masks = (0..masked_layers)
        .map(|l| {
            let thr = (masked_layers - 1 - l) as u8;
            let valid_owned = level[..n_owned].partition_point(|&x| x <= thr) as u32;
            let recv = halo
                .iter()
                .map(|g| {
                    let needs =
                        &halo_need[g.rows.start as usize - n_owned..g.rows.end as usize - n_owned];
                    needs.partition_point(|&x| x <= thr) as u32
                })
                .collect();
            LayerMask {
                valid_owned,
                recv,
                send: Vec::new(),
            }
        })
        .collect();

    Ok(DevicePlan {
        rank,
        server,
        device,
        n_inner,
        n_owned,
        global_ids,
        level,
        halo_need,
        graph: CsrGraph { offsets, indices },
        halo,
        sends: Vec::new(),
        masks,
        in_degree,
        agg_degree,
        layer_graphs,
        split,
        lookup: GlobalIndex::default(),
    })
}

/// Derives every device's send lists (and their per-layer prefixes) from the receivers' halo
/// groups, so the two sides match by construction. `plans[r]` must be rank r's plan.
pub(crate) fn fill_sends(plans: &mut [DevicePlan]) -> Result<()> {
    let mut incoming: Vec<Vec<(SendList, Vec<u32>)>> = vec![Vec::new(); plans.len()];
    for d in plans.iter() {
        for (gi, g) in d.halo.iter().enumerate() {
            let owner = plans.get(g.peer).ok_or_else(|| {
                MaskingError::Internal(format!("rank {}: halo peer {} unknown", d.rank, g.peer))
            })?;
            let rows = d.global_ids[g.rows.start as usize..g.rows.end as usize]
                .iter()
                .map(|&v| match owner.local_of(v) {
                    Some(r) if (r as usize) < owner.n_owned => Ok(r),
                    _ => Err(MaskingError::Internal(format!(
                        "rank {} expects vertex {v} from rank {}, which does not own it",
                        d.rank, g.peer
                    ))),
                })
                .collect::<Result<Vec<u32>>>()?;
            let prefixes = d.masks.iter().map(|m| m.recv[gi]).collect();
            incoming[g.peer].push((SendList { peer: d.rank, rows }, prefixes));
        }
    }
    for (p, mut lists) in incoming.into_iter().enumerate() {
        lists.sort_by_key(|(s, _)| s.peer);
        let plan = &mut plans[p];
        for (l, mask) in plan.masks.iter_mut().enumerate() {
            // A receiver with fewer masked layers than the sender cannot exist: both come
            // from the same k, but stay defensive and send everything in that case.
            mask.send = lists
                .iter()
                .map(|(s, pre)| pre.get(l).copied().unwrap_or(s.rows.len() as u32))
                .collect();
        }
        plan.sends = lists.into_iter().map(|(s, _)| s).collect();
    }
    Ok(())
}
