//! Per-server extraction specs: which vertices a server computes (its *targets*) and which of
//! their dependencies (vertices and in-edges) its one-hop graph includes.
//!
//! The FLX plan is the special case "targets = the server's layout range, exact k-hop
//! closure" ([`ExtractionSpec::flx`]); cooperative batching uses "targets = a co-batch", and
//! samplers give the kept in-edges explicitly ([`SampledEdges`]).
//!
//! Levels and masks. Level 0 = the targets; a vertex gets level d when it is first reached, in
//! hop d, as the source of a kept in-edge of a row of level d - 1 (BFS over kept edges). A row
//! is complete (has its kept in-edges in the one-hop graph) iff its level is `< hops`, and it is
//! valid at layer l iff its level is `<= hops - 1 - l`. Every kept in-edge of a valid row then
//! comes from a row of level `<= level + 1`, valid at layer `l - 1`: the level rule of the
//! exact plan, applied to the sampled graph.
//!
//! Per-layer edges (layer-wise sampling, GraphSAGE): when the edges carry per-layer flags ([`SampledEdges::from_layer_rows`]),
//! kept edge e is used at layer l only if `layers[l][e]`. Levels then follow the per-layer
//! sets: `V_{L-1}` = targets, `V_{l-1}` = `V_l` plus the sources of the layer-l edges of rows
//! in `V_l`, and level(v) = `hops - 1 - max{l : v in V_l}` (the hop at which the sampler
//! reached v). The one-hop graph holds the union of the edges a row uses at a layer where it
//! is valid; [`crate::DevicePlan::layer_graphs`] holds each layer's subset.
//!
//! Normalisation contract for a runner (per device plan, owned row `i` at layer `l`; the
//! aggregation reads `plan.layer_graph(l)` and `m = plan.agg_degree_at(l, i)`,
//! `d = plan.in_degree[i]`; for exact rows `m == d`, so every formula below reduces bit for
//! bit to the full-graph scales and FB/FLX plans are unaffected):
//! - Mean (GraphSAGE): divide by `m` (0 when `m == 0`): the mean over the KEPT in-edges,
//!   i.e. the sampled estimate of the full mean.
//! - Sum: plain sum over the kept edges (no rescaling).
//! - GCN (`D^-1/2 (A + I) D^-1/2`): source scales and the self-loop weight stay GLOBAL
//!   (`1/sqrt(d_u + 1)`, `1/(d + 1)`, from `in_degree`), and the destination scale of the
//!   neighbour sum is multiplied by `d / m` (0 when `m == 0`): the kept neighbour sum is
//!   scaled up to an unbiased estimate of the full one (the VR-GCN/GraphSAGE estimator),
//!   while the self term is exact. Samplers here never drop a self-loop edge except the
//!   layer-wise fanout sampler, where a dropped loop is simply a dropped neighbour.

use crate::error::{MaskingError, Result};
use crate::idmap::IdMap;

/// The in-edges kept by a sampler, as a sparse CSR over the vertices that have a kept row.
pub struct SampledEdges {
    /// Sorted, distinct global ids of the vertices with a kept row.
    rows: Vec<u32>,
    /// `rows.len() + 1` offsets into `indices`.
    offsets: Vec<u64>,
    /// Kept sources of every row, sorted and distinct within a row.
    indices: Vec<u32>,
    /// Optional per-layer edge flags: bit `l` of `layers[e]` says kept edge `e` (index into
    /// `indices`) is used at layer `l`. None: every kept edge is used at every layer.
    layers: Option<Vec<u64>>,
    /// Number of per-layer flag sets (0 without them).
    num_layers: usize,
    /// Row position of every vertex in `rows`: a row is found in O(1), so walking a sample
    /// costs what the sample holds, not a search through it per vertex. Derived from `rows`.
    position: IdMap,
}

impl Clone for SampledEdges {
    fn clone(&self) -> SampledEdges {
        SampledEdges::assemble(
            self.rows.clone(),
            self.offsets.clone(),
            self.indices.clone(),
            self.layers.clone(),
            self.num_layers,
        )
    }
}

/// Equal kept edges (the position index follows from them).
impl PartialEq for SampledEdges {
    fn eq(&self, other: &SampledEdges) -> bool {
        (
            &self.rows,
            &self.offsets,
            &self.indices,
            &self.layers,
            self.num_layers,
        ) == (
            &other.rows,
            &other.offsets,
            &other.indices,
            &other.layers,
            other.num_layers,
        )
    }
}

impl Eq for SampledEdges {}

impl Default for SampledEdges {
    fn default() -> SampledEdges {
        SampledEdges::assemble(Vec::new(), vec![0], Vec::new(), None, 0)
    }
}

impl std::fmt::Debug for SampledEdges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SampledEdges")
            .field("rows", &self.rows)
            .field("offsets", &self.offsets)
            .field("indices", &self.indices)
            .field("layers", &self.layers)
            .field("num_layers", &self.num_layers)
            .finish_non_exhaustive()
    }
}

impl SampledEdges {
    /// From `(destination, kept sources)` pairs, in any order; sources are sorted and
    /// deduplicated. A destination listed twice is an error.
    pub fn from_rows(rows: impl IntoIterator<Item = (u32, Vec<u32>)>) -> Result<SampledEdges> {
        let mut rows: Vec<(u32, Vec<u32>)> = rows.into_iter().collect();
        rows.sort_unstable_by_key(|r| r.0);
        if let Some(w) = rows.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(MaskingError::Spec(format!(
                "sampled edges list vertex {} twice as a destination",
                w[0].0
            )));
        }
        let mut ids = Vec::with_capacity(rows.len());
        let mut offsets = Vec::with_capacity(rows.len() + 1);
        let mut indices = Vec::new();
        offsets.push(0);
        for (v, mut srcs) in rows {
            srcs.sort_unstable();
            srcs.dedup();
            ids.push(v);
            indices.extend(srcs);
            offsets.push(indices.len() as u64);
        }
        Ok(SampledEdges::assemble(ids, offsets, indices, None, 0))
    }

    /// Per-layer sampled edges: `per_layer[l]` lists `(destination, sources used at layer l)`.
    /// The kept graph is the union over layers, with one flag per layer and edge.
    pub fn from_layer_rows(per_layer: Vec<Vec<(u32, Vec<u32>)>>) -> Result<SampledEdges> {
        let n_layers = per_layer.len();
        check_layer_count(n_layers)?;
        // (dst, src, layer bits), merged.
        let mut all: Vec<(u32, u32, u64)> = Vec::new();
        for (l, rows) in per_layer.into_iter().enumerate() {
            for (v, srcs) in rows {
                all.extend(srcs.into_iter().map(|u| (v, u, 1u64 << l)));
            }
        }
        all.sort_unstable_by_key(|&(v, u, _)| (v, u));
        let mut rows = Vec::new();
        let mut offsets = vec![0u64];
        let mut indices: Vec<u32> = Vec::with_capacity(all.len());
        let mut bits: Vec<u64> = Vec::with_capacity(all.len());
        for (v, u, b) in all {
            if rows.last() == Some(&v) && indices.last() == Some(&u) {
                *bits.last_mut().expect("an edge was pushed") |= b;
                continue;
            }
            if rows.last() != Some(&v) {
                if !rows.is_empty() {
                    offsets.push(indices.len() as u64);
                }
                rows.push(v);
            }
            indices.push(u);
            bits.push(b);
        }
        if !rows.is_empty() {
            offsets.push(indices.len() as u64);
        }
        Ok(SampledEdges::assemble(
            rows,
            offsets,
            indices,
            Some(bits),
            n_layers,
        ))
    }

    /// Straight from a CSR a sampler built: `rows` ascending and distinct, `offsets` of
    /// `rows.len() + 1` entries from 0 to `indices.len()`, each row's sources ascending and
    /// distinct, and with `layers = Some((n, bits))` one bit set of `n` layers per edge (bit l:
    /// used at layer l). Checked in one pass over the edges.
    pub fn from_csr(
        rows: Vec<u32>,
        offsets: Vec<u64>,
        indices: Vec<u32>,
        layers: Option<(usize, Vec<u64>)>,
    ) -> Result<SampledEdges> {
        let bad = |what: String| Err(MaskingError::Spec(format!("sampled edges: {what}")));
        if offsets.len() != rows.len() + 1
            || offsets.first() != Some(&0)
            || offsets.last() != Some(&(indices.len() as u64))
        {
            return bad(format!(
                "{} offsets for {} rows and {} edges",
                offsets.len(),
                rows.len(),
                indices.len()
            ));
        }
        if let Some(w) = rows.windows(2).find(|w| w[0] >= w[1]) {
            return bad(format!("rows {} then {} are not ascending", w[0], w[1]));
        }
        for (i, w) in offsets.windows(2).enumerate() {
            let Some(row) = indices.get(w[0] as usize..w[1] as usize) else {
                return bad(format!(
                    "row of vertex {} has offsets {}..{}",
                    rows[i], w[0], w[1]
                ));
            };
            if let Some(p) = row.windows(2).find(|p| p[0] >= p[1]) {
                return bad(format!(
                    "sources {} then {} of vertex {} are not ascending",
                    p[0], p[1], rows[i]
                ));
            }
        }
        let (n_layers, bits) = match layers {
            None => (0, None),
            Some((n, bits)) => {
                check_layer_count(n)?;
                if bits.len() != indices.len() {
                    return bad(format!(
                        "{} layer flags for {} edges",
                        bits.len(),
                        indices.len()
                    ));
                }
                if n < 64 && bits.iter().any(|&b| b >> n != 0) {
                    return bad(format!("a layer flag past the {n} layers"));
                }
                (n, Some(bits))
            }
        };
        Ok(SampledEdges::assemble(
            rows, offsets, indices, bits, n_layers,
        ))
    }

    fn assemble(
        rows: Vec<u32>,
        offsets: Vec<u64>,
        indices: Vec<u32>,
        layers: Option<Vec<u64>>,
        num_layers: usize,
    ) -> SampledEdges {
        // Rows are sorted: the last bounds the ids the index covers.
        let span = rows.last().map_or(0, |&v| v as usize + 1);
        let mut position = IdMap::for_size(rows.len(), span);
        for (i, &v) in rows.iter().enumerate() {
            position.insert_new(v, i as u32);
        }
        SampledEdges {
            rows,
            offsets,
            indices,
            layers,
            num_layers,
            position,
        }
    }

    /// Vertices with a kept row (sorted).
    pub fn rows(&self) -> &[u32] {
        &self.rows
    }
    /// Every kept row in order: (vertex, index of its first edge, its kept sources).
    pub fn iter_rows(&self) -> impl Iterator<Item = (u32, usize, &[u32])> + '_ {
        self.rows
            .iter()
            .zip(self.offsets.windows(2))
            .map(|(&v, w)| {
                let (a, b) = (w[0] as usize, w[1] as usize);
                (v, a, &self.indices[a..b])
            })
    }
    /// Number of kept edges (the union over layers).
    pub fn num_edges(&self) -> usize {
        self.indices.len()
    }
    /// Number of per-layer flag sets (0 when every edge is used at every layer).
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }
    /// Whether edges carry per-layer flags.
    pub fn is_per_layer(&self) -> bool {
        self.layers.is_some()
    }
    /// Kept sources of `v` and the index of its first edge; empty when `v` has no kept row.
    pub fn row(&self, v: u32) -> (usize, &[u32]) {
        match self.position.get(v) {
            Some(i) => {
                let i = i as usize;
                let (a, b) = (self.offsets[i] as usize, self.offsets[i + 1] as usize);
                (a, &self.indices[a..b])
            }
            None => (0, &[]),
        }
    }
    /// Whether kept edge `e` is used at layer `layer` (always true without per-layer flags).
    pub fn used_at(&self, e: usize, layer: usize) -> bool {
        match &self.layers {
            Some(bits) => bits[e] >> layer & 1 == 1,
            None => true,
        }
    }
    /// Kept edges used at `layer` (all kept edges without per-layer flags).
    pub fn edges_at(&self, layer: usize) -> usize {
        match &self.layers {
            Some(bits) => bits.iter().filter(|&&b| b >> layer & 1 == 1).count(),
            None => self.indices.len(),
        }
    }
}

fn check_layer_count(n_layers: usize) -> Result<()> {
    if n_layers == 0 {
        return Err(MaskingError::Spec(
            "per-layer sampled edges need at least one layer".into(),
        ));
    }
    if n_layers > 64 {
        return Err(MaskingError::Spec(format!(
            "{n_layers} sampled layers is more than the supported 64"
        )));
    }
    Ok(())
}

/// Which in-edges of the extracted rows are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Edges {
    /// Every in-edge (the exact k-hop in-closure of the targets).
    Exact,
    /// Only the given edges; a vertex without a kept row aggregates nothing.
    Sampled(SampledEdges),
}

/// What one server extracts: its targets and their dependencies over `hops` hops (the number
/// of masked layers of the resulting plan).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtractionSpec {
    pub server: usize,
    /// Sorted, distinct; every target is owned by `server` in the layout (it stays on its
    /// layout device and is an inner row there).
    pub targets: Vec<u32>,
    pub hops: usize,
    pub edges: Edges,
}

impl ExtractionSpec {
    /// The FLX extraction of `server`: every vertex of its range, exact `k`-hop closure.
    pub fn flx(layout: &crate::Layout, server: usize, k: usize) -> ExtractionSpec {
        ExtractionSpec {
            server,
            targets: layout.server_range(server).collect(),
            hops: k,
            edges: Edges::Exact,
        }
    }

    /// Exact `hops`-hop closure of arbitrary targets (e.g. a co-batch).
    pub fn exact(server: usize, targets: Vec<u32>, hops: usize) -> ExtractionSpec {
        ExtractionSpec {
            server,
            targets,
            hops,
            edges: Edges::Exact,
        }
    }

    /// Whether the spec keeps every in-edge.
    pub fn is_exact(&self) -> bool {
        matches!(self.edges, Edges::Exact)
    }
}

/// Read access to the kept rows of a spec, exact or sampled, used by the builder.
pub(crate) enum RowSource<'s, 'g> {
    Exact(grandis_store::CsrView<'g>),
    Sampled(&'s SampledEdges),
}

impl<'g> RowSource<'_, 'g> {
    /// Index of the first kept edge of `v` and its kept sources.
    pub fn row(&self, v: u32) -> (usize, &[u32]) {
        match self {
            RowSource::Exact(g) => (0, g.neighbors(v)),
            RowSource::Sampled(s) => s.row(v),
        }
    }
    pub fn per_layer(&self) -> bool {
        matches!(self, RowSource::Sampled(s) if s.is_per_layer())
    }
    pub fn used_at(&self, e: usize, layer: usize) -> bool {
        match self {
            RowSource::Exact(_) => true,
            RowSource::Sampled(s) => s.used_at(e, layer),
        }
    }
    /// The need level a kept edge `e` of a row at level `lv` contributes in a plan with `k`
    /// masked layers: the row's level without per-layer flags; with them `k - 1 - l` for the
    /// LAST layer `l` at which the row is valid and uses the edge (None: never used).
    pub fn edge_need(&self, e: usize, lv: u8, k: usize) -> Option<u8> {
        if !self.per_layer() {
            return Some(lv);
        }
        let top = k.checked_sub(1 + lv as usize)?;
        (0..=top)
            .rev()
            .find(|&l| self.used_at(e, l))
            .map(|l| (k - 1 - l) as u8)
    }
}
