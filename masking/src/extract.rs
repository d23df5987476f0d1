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

/// The in-edges kept by a sampler, in the sample's own vertex ids (as a DGL block numbers its
/// nodes): `vertices[i]` is the global id of sample vertex `i`; the first `num_rows` of them
/// have a kept row, and every kept edge names its source by its sample index. A plan is then
/// built from the sample by array indexing, with no map from global ids on the way
/// (the layer-wise sampler hands over its vertices in plan order, level by level).
pub struct SampledEdges {
    /// Distinct global ids: the rows first (in row order), then the other sources.
    vertices: Vec<u32>,
    /// Vertices `0..num_rows` have a kept row (possibly empty).
    num_rows: usize,
    /// `num_rows + 1` offsets into `sources`.
    offsets: Vec<u64>,
    /// Kept sources of every row as sample indices, ascending (so distinct) within a row.
    sources: Vec<u32>,
    /// Optional per-layer edge flags: bit `l` of `layers[e]` says kept edge `e` (index into
    /// `sources`) is used at layer `l`. None: every kept edge is used at every layer.
    layers: Option<Vec<u64>>,
    /// Number of per-layer flag sets (0 without them).
    num_layers: usize,
    /// Sample index of every global id, built on first use: a plan built from a sample whose
    /// targets lead its vertices never needs it.
    position: std::sync::OnceLock<IdMap>,
    /// Where each level starts, when the sampler numbered its vertices level by level as an
    /// extraction levels them, by global id within a level (see
    /// [`SampledEdges::with_levels`]); None: levels are found by scanning the kept rows.
    level_starts: Option<Vec<usize>>,
}

impl Clone for SampledEdges {
    fn clone(&self) -> SampledEdges {
        SampledEdges {
            vertices: self.vertices.clone(),
            num_rows: self.num_rows,
            offsets: self.offsets.clone(),
            sources: self.sources.clone(),
            layers: self.layers.clone(),
            num_layers: self.num_layers,
            position: std::sync::OnceLock::new(),
            level_starts: self.level_starts.clone(),
        }
    }
}

/// Equal vertices and kept edges (the position index and the levels follow from them).
impl PartialEq for SampledEdges {
    fn eq(&self, other: &SampledEdges) -> bool {
        (
            &self.vertices,
            self.num_rows,
            &self.offsets,
            &self.sources,
            &self.layers,
            self.num_layers,
        ) == (
            &other.vertices,
            other.num_rows,
            &other.offsets,
            &other.sources,
            &other.layers,
            other.num_layers,
        )
    }
}

impl Eq for SampledEdges {}

impl Default for SampledEdges {
    fn default() -> SampledEdges {
        SampledEdges {
            vertices: Vec::new(),
            num_rows: 0,
            offsets: vec![0],
            sources: Vec::new(),
            layers: None,
            num_layers: 0,
            position: std::sync::OnceLock::new(),
            level_starts: None,
        }
    }
}

impl std::fmt::Debug for SampledEdges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SampledEdges")
            .field("vertices", &self.vertices)
            .field("num_rows", &self.num_rows)
            .field("offsets", &self.offsets)
            .field("sources", &self.sources)
            .field("layers", &self.layers)
            .field("num_layers", &self.num_layers)
            .field("level_starts", &self.level_starts)
            .finish_non_exhaustive()
    }
}

impl SampledEdges {
    /// From `(destination, kept sources)` pairs, in any order; sources are deduplicated. A
    /// destination listed twice is an error. Rows are numbered by ascending global id.
    pub fn from_rows(rows: impl IntoIterator<Item = (u32, Vec<u32>)>) -> Result<SampledEdges> {
        let mut rows: Vec<(u32, Vec<u32>)> = rows.into_iter().collect();
        rows.sort_unstable_by_key(|r| r.0);
        if let Some(w) = rows.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(MaskingError::Spec(format!(
                "sampled edges list vertex {} twice as a destination",
                w[0].0
            )));
        }
        let edges = rows
            .into_iter()
            .map(|(v, srcs)| (v, srcs.into_iter().map(|u| (u, 0)).collect()))
            .collect();
        Ok(SampledEdges::numbered(edges, 0))
    }

    /// Per-layer sampled edges: `per_layer[l]` lists `(destination, sources used at layer l)`.
    /// The kept graph is the union over layers, with one flag per layer and edge; every
    /// destination listed at some layer has a row.
    pub fn from_layer_rows(per_layer: Vec<Vec<(u32, Vec<u32>)>>) -> Result<SampledEdges> {
        let n_layers = per_layer.len();
        check_layer_count(n_layers)?;
        let mut all: std::collections::BTreeMap<u32, Vec<(u32, u64)>> = Default::default();
        for (l, rows) in per_layer.into_iter().enumerate() {
            for (v, srcs) in rows {
                all.entry(v)
                    .or_default()
                    .extend(srcs.into_iter().map(|u| (u, 1u64 << l)));
            }
        }
        Ok(SampledEdges::numbered(all.into_iter().collect(), n_layers))
    }

    /// Numbers rows (ascending global id, given so) and then the other sources (ascending),
    /// merging an edge listed twice into one with the union of its layer bits.
    fn numbered(rows: Vec<(u32, Vec<(u32, u64)>)>, n_layers: usize) -> SampledEdges {
        let mut vertices: Vec<u32> = rows.iter().map(|r| r.0).collect();
        let num_rows = vertices.len();
        let mut others: Vec<u32> = rows
            .iter()
            .flat_map(|r| r.1.iter().map(|e| e.0))
            .filter(|u| vertices.binary_search(u).is_err())
            .collect();
        others.sort_unstable();
        others.dedup();
        vertices.extend(others);
        let position = position_of(&vertices);
        let mut offsets = Vec::with_capacity(num_rows + 1);
        offsets.push(0u64);
        let mut sources = Vec::new();
        let mut bits = Vec::new();
        let mut row: Vec<(u32, u64)> = Vec::new();
        for (_, edges) in rows {
            row.clear();
            row.extend(
                edges
                    .into_iter()
                    .map(|(u, b)| (position.get(u).expect("numbered above"), b)),
            );
            SampledEdges::append_row(&mut row, &mut sources, &mut bits);
            offsets.push(sources.len() as u64);
        }
        SampledEdges {
            vertices,
            num_rows,
            offsets,
            sources,
            layers: (n_layers > 0).then_some(bits),
            num_layers: n_layers,
            position: std::sync::OnceLock::from(position),
            level_starts: None,
        }
    }

    /// Appends one row's kept edges, `(source, layer bits)` in any order, to a CSR being
    /// built for [`SampledEdges::from_blocks`]: sorted by source, an edge listed twice merged
    /// into one with the union of its bits.
    pub fn append_row(row: &mut [(u32, u64)], sources: &mut Vec<u32>, bits: &mut Vec<u64>) {
        row.sort_unstable_by_key(|e| e.0);
        let start = sources.len();
        for &(u, b) in row.iter() {
            if sources.len() > start && sources.last() == Some(&u) {
                *bits.last_mut().expect("an edge of this row") |= b;
            } else {
                sources.push(u);
                bits.push(b);
            }
        }
    }

    /// Straight from the blocks a sampler built: `vertices` distinct, rows first;
    /// `offsets` of `num_rows + 1` entries from 0 to `sources.len()`; each row's sources
    /// sample indices below `vertices.len()`, ascending; with `layers = Some((n, bits))` one
    /// bit set of `n` layers per edge (bit l: used at layer l). Checked in one pass over the
    /// edges; that the vertices are distinct only in debug builds (it needs a map over them,
    /// which a plan built from the sample never does).
    pub fn from_blocks(
        vertices: Vec<u32>,
        num_rows: usize,
        offsets: Vec<u64>,
        sources: Vec<u32>,
        layers: Option<(usize, Vec<u64>)>,
    ) -> Result<SampledEdges> {
        let bad = |what: String| Err(MaskingError::Spec(format!("sampled edges: {what}")));
        if num_rows > vertices.len()
            || offsets.len() != num_rows + 1
            || offsets.first() != Some(&0)
            || offsets.last() != Some(&(sources.len() as u64))
        {
            return bad(format!(
                "{} offsets for {num_rows} rows of {} vertices and {} edges",
                offsets.len(),
                vertices.len(),
                sources.len()
            ));
        }
        for (i, w) in offsets.windows(2).enumerate() {
            let Some(row) = sources.get(w[0] as usize..w[1] as usize) else {
                return bad(format!(
                    "row of vertex {} has offsets {}..{}",
                    vertices[i], w[0], w[1]
                ));
            };
            if let Some(p) = row.windows(2).find(|p| p[0] >= p[1]) {
                return bad(format!(
                    "sources {} then {} of vertex {} are not ascending",
                    p[0], p[1], vertices[i]
                ));
            }
            if let Some(&u) = row.last().filter(|&&u| u as usize >= vertices.len()) {
                return bad(format!(
                    "vertex {} reads sample vertex {u} of {}",
                    vertices[i],
                    vertices.len()
                ));
            }
        }
        let (num_layers, bits) = match layers {
            None => (0, None),
            Some((n, bits)) => {
                check_layer_count(n)?;
                if bits.len() != sources.len() {
                    return bad(format!(
                        "{} layer flags for {} edges",
                        bits.len(),
                        sources.len()
                    ));
                }
                if n < 64 && bits.iter().any(|&b| b >> n != 0) {
                    return bad(format!("a layer flag past the {n} layers"));
                }
                (n, Some(bits))
            }
        };
        let sample = SampledEdges {
            vertices,
            num_rows,
            offsets,
            sources,
            layers: bits,
            num_layers,
            position: std::sync::OnceLock::new(),
            level_starts: None,
        };
        if cfg!(debug_assertions) {
            let mut sorted = sample.vertices.clone();
            sorted.sort_unstable();
            if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                return bad(format!("vertex {} is listed twice", w[0]));
            }
        }
        Ok(sample)
    }

    /// Declares the sample numbered level by level: level `d` (the targets are level 0; a
    /// vertex's level is the hop that first reached it, as the module doc defines it) holds
    /// the vertices `starts[d]..starts[d + 1]`, by ascending global id, as the layer-wise
    /// sampler numbers them. An extraction then reads the levels instead of scanning the
    /// kept rows for them. The ranges and the order are checked here; that they are the
    /// levels the kept edges imply is checked against a scan in debug builds.
    pub fn with_levels(mut self, starts: Vec<usize>) -> Result<SampledEdges> {
        let bad = |what: String| Err(MaskingError::Spec(format!("sample levels: {what}")));
        if starts.first() != Some(&0)
            || starts.last() != Some(&self.vertices.len())
            || starts.windows(2).any(|w| w[0] > w[1])
        {
            return bad(format!(
                "starts {starts:?} do not cut {} vertices in order",
                self.vertices.len()
            ));
        }
        for (d, w) in starts.windows(2).enumerate() {
            if let Some(p) = self.vertices[w[0]..w[1]].windows(2).find(|p| p[0] >= p[1]) {
                return bad(format!(
                    "level {d} lists vertex {} before {}: not by ascending global id",
                    p[0], p[1]
                ));
            }
        }
        self.level_starts = Some(starts);
        Ok(self)
    }
    /// Where each level starts, when declared (see [`SampledEdges::with_levels`]).
    pub fn level_starts(&self) -> Option<&[usize]> {
        self.level_starts.as_deref()
    }
    /// Layer flags of kept edge `e` (bit l: used at layer l); every bit set without
    /// per-layer flags.
    pub fn layer_bits(&self, e: usize) -> u64 {
        match &self.layers {
            Some(bits) => bits[e],
            None => u64::MAX,
        }
    }
    /// Global id of every sample vertex (rows first).
    pub fn vertices(&self) -> &[u32] {
        &self.vertices
    }
    /// Global ids of the vertices with a kept row, in row order.
    pub fn row_vertices(&self) -> &[u32] {
        &self.vertices[..self.num_rows]
    }
    /// Sample index of global vertex `v`, if the sample holds it.
    pub fn index_of(&self, v: u32) -> Option<u32> {
        self.position
            .get_or_init(|| position_of(&self.vertices))
            .get(v)
    }
    /// Every kept row in order: (global id, index of its first edge, its kept sources as
    /// sample indices).
    pub fn iter_rows(&self) -> impl Iterator<Item = (u32, usize, &[u32])> + '_ {
        self.row_vertices()
            .iter()
            .zip(self.offsets.windows(2))
            .map(|(&v, w)| {
                let (a, b) = (w[0] as usize, w[1] as usize);
                (v, a, &self.sources[a..b])
            })
    }
    /// Number of kept edges (the union over layers).
    pub fn num_edges(&self) -> usize {
        self.sources.len()
    }
    /// Number of per-layer flag sets (0 when every edge is used at every layer).
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }
    /// Whether edges carry per-layer flags.
    pub fn is_per_layer(&self) -> bool {
        self.layers.is_some()
    }
    /// Kept edges of sample vertex `i` (its first edge's index and its sources as sample
    /// indices); empty for a vertex without a row.
    pub fn row_at(&self, i: u32) -> (usize, &[u32]) {
        let i = i as usize;
        if i >= self.num_rows {
            return (0, &[]);
        }
        let (a, b) = (self.offsets[i] as usize, self.offsets[i + 1] as usize);
        (a, &self.sources[a..b])
    }
    /// Global ids of the kept sources of global vertex `v`, ascending; empty when `v` has no
    /// kept row.
    pub fn kept_sources(&self, v: u32) -> Vec<u32> {
        let mut out: Vec<u32> = match self.index_of(v) {
            Some(i) => self
                .row_at(i)
                .1
                .iter()
                .map(|&u| self.vertices[u as usize])
                .collect(),
            None => Vec::new(),
        };
        out.sort_unstable();
        out
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
            None => self.sources.len(),
        }
    }
}

/// The sample index of every vertex of `vertices` (distinct global ids).
fn position_of(vertices: &[u32]) -> IdMap {
    let span = vertices.iter().max().map_or(0, |&v| v as usize + 1);
    let mut position = IdMap::for_size(vertices.len(), span);
    for (i, &v) in vertices.iter().enumerate() {
        position.insert_new(v, i as u32);
    }
    position
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
    /// Sorted, distinct; in a server's masked plan every target is owned by `server` in the
    /// layout (it stays on its layout device and is an inner row there); a standalone device
    /// plan's (it owns all it reads) and co-batches seeded by edges
    /// (`PlanContext::extract_pairs_plan`) may be any vertices.
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

/// Read access to the kept rows of a spec, exact or sampled, used by the builder. Vertices
/// are named by KEYS: global ids for the exact closure, sample indices for a sample (so a
/// plan built from a sample indexes arrays sized to the sample, never maps global ids).
pub(crate) enum RowSource<'s, 'g> {
    Exact(grandis_store::CsrView<'g>),
    Sampled(&'s SampledEdges),
}

impl<'g> RowSource<'_, 'g> {
    /// Index of the first kept edge of key `v` and the keys of its kept sources.
    pub fn row(&self, v: u32) -> (usize, &[u32]) {
        match self {
            RowSource::Exact(g) => (0, g.neighbors(v)),
            RowSource::Sampled(s) => s.row_at(v),
        }
    }
    /// Global id of key `v`.
    pub fn global(&self, v: u32) -> u32 {
        match self {
            RowSource::Exact(_) => v,
            RowSource::Sampled(s) => s.vertices[v as usize],
        }
    }
    /// Keys lie below this.
    pub fn key_span(&self) -> usize {
        match self {
            RowSource::Exact(g) => g.num_vertices(),
            RowSource::Sampled(s) => s.vertices.len(),
        }
    }
    /// The keys of `targets` (global ids), each of which must have a row: a sampler gives
    /// every target one (empty when it keeps no in-edge), as every destination of a DGL
    /// block is a row. A sample that lists the targets first costs no lookup.
    pub fn target_keys(&self, targets: &[u32]) -> Result<Vec<u32>> {
        match self {
            RowSource::Exact(_) => Ok(targets.to_vec()),
            RowSource::Sampled(s) if s.vertices.get(..targets.len()) == Some(targets) => {
                Ok((0..targets.len() as u32).collect())
            }
            RowSource::Sampled(s) => targets
                .iter()
                .map(|&t| {
                    s.index_of(t)
                        .filter(|&i| (i as usize) < s.num_rows)
                        .ok_or_else(|| {
                            MaskingError::Spec(format!(
                                "target {t} has no row in the sampled edges (a sampler gives \
                                 every target one, empty when it keeps no in-edge)"
                            ))
                        })
                })
                .collect(),
        }
    }
    pub fn per_layer(&self) -> bool {
        matches!(self, RowSource::Sampled(s) if s.is_per_layer())
    }
    /// The layers (bit l: layer l) at which a row of level `lv` in a plan with `k` masked
    /// layers reads its kept edge `e`: those where the row is valid (l < k - lv) and the edge
    /// is flagged; every bit without per-layer flags (the row reads the edge whenever it is
    /// computed). Zero: the edge is never read, and the plan leaves it out.
    pub fn layers_reading(&self, e: usize, lv: u8, k: usize) -> u64 {
        match self {
            RowSource::Sampled(s) if s.is_per_layer() => {
                s.layer_bits(e) & low_bits(k.saturating_sub(lv as usize))
            }
            _ => u64::MAX,
        }
    }
    /// The need level a kept edge `e` of a row at level `lv` contributes in a plan with `k`
    /// masked layers: the row's level without per-layer flags; with them `k - 1 - l` for the
    /// LAST layer `l` at which the row is valid and uses the edge (None: never used).
    pub fn edge_need(&self, e: usize, lv: u8, k: usize) -> Option<u8> {
        if !self.per_layer() {
            return Some(lv);
        }
        let layers = self.layers_reading(e, lv, k);
        let last = (u64::BITS - 1).checked_sub(layers.leading_zeros())? as usize;
        Some((k - 1 - last) as u8)
    }
}

/// A mask of the `n` lowest bits.
fn low_bits(n: usize) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1 << n) - 1
    }
}
