//! Graph blocks on the host: [`BlockGraph`] (what a model uploads), its transpose
//! ([`ScaledCsr`], what backward aggregation runs over) and [`PreparedGraph`] (both, checked and
//! built ahead of the upload by any thread).

use crate::error::{EngineError, Result};

/// A graph block on the host, ready to be uploaded with [`crate::Backend::upload_graph`].
///
/// Destination rows `0..n_dst` aggregate from source rows `0..n_src` of the input matrix
/// (`n_src >= n_dst`; a device holds its own vertices first and halo vertices after, so the
/// destinations are a prefix of the sources). Row `v` of the CSR lists the *local* source ids
/// of the edges into `v` (same convention as `grandis_store::CsrView`).
///
/// The aggregation computed is
///
/// ```text
/// out[v] = dst_scale[v] * sum_{u in row v} src_scale[u] * x[u]  +  self_scale[v] * x[v]
/// ```
///
/// with `src_scale = None` meaning all ones and `self_scale = None` meaning no self term.
/// The scales are NOT derived from the local CSR: the caller passes global quantities
/// (global in-degree for mean, global degrees for GCN) so a partitioned run equals the full
/// graph exactly. [`crate::norm`] builds them for the single-process case.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BlockGraph {
    pub n_dst: usize,
    pub n_src: usize,
    /// `n_dst + 1` offsets into `indices`.
    pub offsets: Vec<u64>,
    /// Local source ids, each `< n_src`.
    pub indices: Vec<u32>,
    /// Length `n_dst`.
    pub dst_scale: Vec<f32>,
    /// Length `n_src` when present.
    pub src_scale: Option<Vec<f32>>,
    /// Length `n_dst` when present.
    pub self_scale: Option<Vec<f32>>,
}

impl BlockGraph {
    pub fn num_edges(&self) -> usize {
        self.indices.len()
    }

    /// Checks every invariant listed on the type; [`crate::Backend::upload_graph`] calls this.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::Graph(m));
        if self.n_src < self.n_dst {
            return bad(format!(
                "n_src ({}) must be >= n_dst ({})",
                self.n_src, self.n_dst
            ));
        }
        if self.offsets.len() != self.n_dst + 1 {
            return bad(format!(
                "offsets has {} entries, expected n_dst + 1 = {}",
                self.offsets.len(),
                self.n_dst + 1
            ));
        }
        if self.offsets[0] != 0 || *self.offsets.last().unwrap() as usize != self.indices.len() {
            return bad(format!(
                "offsets must start at 0 and end at the number of indices ({})",
                self.indices.len()
            ));
        }
        if let Some(i) = self.offsets.windows(2).position(|w| w[0] > w[1]) {
            return bad(format!("offsets decrease at row {i}"));
        }
        if let Some(&u) = self.indices.iter().find(|&&u| u as usize >= self.n_src) {
            return bad(format!(
                "source id {u} out of range (n_src = {})",
                self.n_src
            ));
        }
        if self.dst_scale.len() != self.n_dst {
            return bad(format!(
                "dst_scale has {} entries, expected n_dst = {}",
                self.dst_scale.len(),
                self.n_dst
            ));
        }
        if let Some(s) = &self.src_scale {
            if s.len() != self.n_src {
                return bad(format!(
                    "src_scale has {} entries, expected n_src = {}",
                    s.len(),
                    self.n_src
                ));
            }
        }
        if let Some(s) = &self.self_scale {
            if s.len() != self.n_dst {
                return bad(format!(
                    "self_scale has {} entries, expected n_dst = {}",
                    s.len(),
                    self.n_dst
                ));
            }
        }
        Ok(())
    }
}

/// A CSR and its scale vectors as the kernels take them: above all the transpose of a
/// [`BlockGraph`] (row `u < n_src` lists the destinations whose rows contain `u`), which
/// backward aggregation runs over.
#[derive(Debug, Clone, PartialEq)]
pub struct ScaledCsr {
    pub(crate) offsets: Vec<u64>,
    pub(crate) indices: Vec<u32>,
    pub(crate) dst: Vec<f32>,
    pub(crate) src: Option<Vec<f32>>,
    pub(crate) self_: Option<Vec<f32>>,
}

/// `A^T` of a validated block, as every backend builds it: row `u < n_src` lists the
/// destinations `v` whose rows contain `u`, in increasing `v` (so sums run in the same
/// order everywhere); the scales swap roles and the self term exists only for `u < n_dst`.
pub(crate) fn transpose(g: &BlockGraph) -> ScaledCsr {
    let mut offsets = vec![0u64; g.n_src + 1];
    for &u in &g.indices {
        offsets[u as usize + 1] += 1;
    }
    for i in 0..g.n_src {
        offsets[i + 1] += offsets[i];
    }
    let mut cursor = offsets.clone();
    let mut indices = vec![0u32; g.indices.len()];
    for v in 0..g.n_dst {
        for &u in &g.indices[g.offsets[v] as usize..g.offsets[v + 1] as usize] {
            let slot = &mut cursor[u as usize];
            indices[*slot as usize] = v as u32;
            *slot += 1;
        }
    }
    ScaledCsr {
        offsets,
        indices,
        dst: g.src_scale.clone().unwrap_or_else(|| vec![1.0; g.n_src]),
        src: Some(g.dst_scale.clone()),
        self_: g.self_scale.as_ref().map(|s| {
            let mut full = s.clone();
            full.resize(g.n_src, 0.0);
            full
        }),
    }
}

/// A validated block and its transpose, both built on the host by any thread, before the
/// upload ([`crate::Backend::upload_prepared`]): what lets a step's producer, not the rank that
/// runs it, pay for checking and transposing its blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedGraph {
    graph: BlockGraph,
    transpose: ScaledCsr,
}

impl PreparedGraph {
    /// Checks `graph` ([`BlockGraph::validate`]) and builds its transpose.
    pub fn new(graph: BlockGraph) -> Result<PreparedGraph> {
        graph.validate()?;
        let transpose = transpose(&graph);
        Ok(PreparedGraph { graph, transpose })
    }

    pub fn graph(&self) -> &BlockGraph {
        &self.graph
    }

    pub fn transpose(&self) -> &ScaledCsr {
        &self.transpose
    }
}
