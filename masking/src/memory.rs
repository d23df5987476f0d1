//! Per-device memory model of a plan and the automatic choice of k (paper §5.1: "we choose the
//! largest k to make the GNN fit on the available memory").
//!
//! Every term is public and explicit so the trainer can compare it with measured usage. All
//! tensors are f32 ([`F32_BYTES`]). Layer `l` reads width `in_width(l)` (F for layer 0, else H)
//! and writes `out_width(l)` (C for the last layer, else H). Layer `l` runs on the FLX device
//! plan when `l < k`, otherwise on the FB device plan, in that plan's compact row space for the
//! layer ([`crate::LayerRows`]): "src"/"dst" below are its `n_src` (input rows: valid owned
//! rows of the previous layer plus received halo rows) and `n_dst` (valid owned rows). For an
//! unmasked layer they are the plan's `n_local`/`n_owned`. Per device:
//!
//! - `features` = src(layer 0) x F x 4: raw features of every local row (halo included: they
//!   are loaded or exchanged once and kept).
//! - per layer ([`LayerMemory`]), [`SAVED_TENSORS_PER_LAYER`] = 3 tensors kept for backward:
//!   `input` (layers >= 1: the layer's input incl. halo rows, src x in_width; layer 0's input
//!   is `features`), `aggregated` (dst x in_width, needed for the weight gradient; only
//!   layers with out_width > in_width aggregate first and keep it) and
//!   `pre_activation` (dst x out_width, needed for the activation derivative; it is the logits
//!   at the last layer). What runs on the input before the convolution (pre-ops, dropout) is
//!   recomputed in backward, not kept ([`InputCopy`]).
//! - `backward_scratch` = 2 x max over layers of src x max(in_width, out_width) x 4: the
//!   gradient flowing in and the gradient flowing out of the layer being differentiated (3 x
//!   with [`InputCopy::Recomputed`]: the recomputed dropout output).
//! - `halo_buffers` = 2 x max over the plans in use of (rows sent per exchange) x max width x 4:
//!   a send staging buffer (forward) and a gradient receive staging buffer (backward);
//!   received forward rows land directly in the input buffer.
//! - `graph` = for every distinct compact layer graph the runner uploads (layers of one plan
//!   with equal row spaces share one): (dst + 1) x [`OFFSET_BYTES`] + edges x
//!   ([`INDEX_BYTES`] + [`VALUE_BYTES`]) (column indices and a normalised edge value). A typed
//!   model's layer graph is uploaded again split by relation: per relation a CSR and its
//!   transpose (offsets over destinations and sources, a mean per destination in each) over
//!   its share of the edges, and each row's index among its type's rows.
//!   Per-layer graphs of layer-wise sampling are distinct per layer.
//! - `metadata` = for every plan held: n_local x [`METADATA_BYTES_PER_ROW`] (global id,
//!   in-degree, out-degree, global-to-local pair).
//! - `params` = [`PARAM_COPIES`] x parameters x 4 (weights, gradients, Adam m and v).
//!
//! A plan that runs every layer on one masked plan (cooperative batching, per-GPU mini-batch)
//! is priced by [`estimate_masked_device`]: the same terms with that plan at every layer and
//! only it held.
//!
//! Plans held: the FB plan always (a [`crate::PreloadPlan`] keeps it), plus the FLX plan when
//! k >= 1. With the FLX placement rule the FLX plan for k is contained in the one for k + 1 and
//! contains the FB rows of each device, so `features` and `metadata` are non-decreasing in k.
//! The total is not (the plan for k + 1 may run a layer on a smaller valid prefix than the
//! FB plan runs it for k), which is why [`PlanContext::choose_k`] prices every k.

use grandis_store::CsrView;

use crate::context::{PlanContext, SplitMembership};
use crate::error::{MaskingError, Result};
use crate::flx::{FbPlan, FlxPlan, PreloadPlan};
use crate::layout::Layout;
use crate::plan::DevicePlan;
use crate::rows::{layer_spaces, LayerRows};

pub const F32_BYTES: u64 = 4;
pub const OFFSET_BYTES: u64 = 8;
pub const INDEX_BYTES: u64 = 4;
pub const VALUE_BYTES: u64 = 4;
pub const METADATA_BYTES_PER_ROW: u64 = 4 + 4 + 4 + 8;
pub const PARAM_COPIES: u64 = 4;
pub const SAVED_TENSORS_PER_LAYER: u64 = 3;

/// Shape of the GNN: `layers` layers, F input features, H hidden units, C classes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelDims {
    pub layers: usize,
    pub features: usize,
    pub hidden: usize,
    pub classes: usize,
    /// Whether something runs on a layer's WHOLE input (src rows, halo included) before the
    /// convolution, whose result backward recomputes.
    #[serde(default)]
    pub input_copy: InputCopy,
    /// GAT's attention, if the model attends.
    #[serde(default)]
    pub attention: Option<AttentionDims>,
    /// Link prediction: the values of the whole graph's output embeddings (vertices x output
    /// width) that every rank gathers for the decoder, which holds them and their gradient
    /// beside the plan's buffers. 0 for node classification.
    #[serde(default)]
    pub link_embedding_values: u64,
    /// Typed models (RGCN, hetero-SAGE): the relations each layer graph is split into, which
    /// the runner uploads beside it (see `graph` in the module doc). 0 for the others.
    #[serde(default)]
    pub relations: usize,
}

/// What attention adds to a GAT layer: it maps all `n_src` input rows to `heads x head_dim`
/// columns (`t = z W`, the attention vectors score them) and its backward holds `t` and its
/// gradient at once; hidden layers concatenate their heads (`t` as wide as the output), the
/// last averages `output_heads` heads of `classes` columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AttentionDims {
    pub output_heads: usize,
}

/// See [`ModelDims::input_copy`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputCopy {
    /// The convolution reads its input as is.
    #[default]
    None,
    /// Pre-ops (ResSAGE+'s norm and ReLU) or dropout run first. Their result is not kept but
    /// recomputed in backward (every step is deterministic, dropout masks a pure function of
    /// their key), so it adds one transient buffer to the backward scratch, not a tensor per
    /// layer.
    Recomputed,
}

impl ModelDims {
    pub fn validate(&self) -> Result<()> {
        if self.layers == 0 || self.features == 0 || self.classes == 0 {
            return Err(MaskingError::Dims(format!(
                "layers ({}), features ({}) and classes ({}) must be at least 1",
                self.layers, self.features, self.classes
            )));
        }
        if self.layers > 1 && self.hidden == 0 {
            return Err(MaskingError::Dims(
                "hidden width must be at least 1 for a model with more than one layer".into(),
            ));
        }
        Ok(())
    }
    pub fn in_width(&self, layer: usize) -> usize {
        if layer == 0 {
            self.features
        } else {
            self.hidden
        }
    }
    pub fn out_width(&self, layer: usize) -> usize {
        if layer + 1 == self.layers {
            self.classes
        } else {
            self.hidden
        }
    }
    /// Widest tensor row of the model.
    pub fn max_width(&self) -> usize {
        (0..self.layers)
            .map(|l| self.in_width(l).max(self.out_width(l)))
            .max()
            .unwrap_or(0)
    }
    /// Columns of the rows layer `l` attends over (`t = z W`), for attention models.
    pub fn attention_width(&self, layer: usize) -> Option<usize> {
        let a = self.attention?;
        Some(if layer + 1 == self.layers {
            a.output_heads * self.classes
        } else {
            self.hidden
        })
    }
    /// Weights plus biases of all layers (one linear map per layer; attention layers map to
    /// their attended width and add two attention vectors as wide).
    pub fn param_count(&self) -> u64 {
        (0..self.layers)
            .map(|l| {
                let (i, o) = (self.in_width(l) as u64, self.out_width(l) as u64);
                match self.attention_width(l) {
                    Some(t) => (i + 2) * t as u64 + o,
                    None => (i + 1) * o,
                }
            })
            .sum()
    }
}

/// Saved-for-backward tensors of one layer on one device, in bytes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LayerMemory {
    pub layer: usize,
    /// Whether the layer runs on the FLX plan (else FB).
    pub flx: bool,
    pub rows_local: u64,
    pub rows_owned: u64,
    pub input: u64,
    pub aggregated: u64,
    pub pre_activation: u64,
}

impl LayerMemory {
    pub fn total(&self) -> u64 {
        self.input + self.aggregated + self.pre_activation
    }
}

/// The estimate for one device, term by term (bytes).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MemoryTerms {
    pub rank: usize,
    pub features: u64,
    pub layers: Vec<LayerMemory>,
    /// Sum of `layers[..].total()`.
    pub activations: u64,
    pub backward_scratch: u64,
    pub halo_buffers: u64,
    pub graph: u64,
    pub metadata: u64,
    pub params: u64,
    /// Link prediction's gathered output embeddings and their gradient
    /// ([`ModelDims::link_embedding_values`], twice); 0 for node classification.
    pub link_decoder: u64,
    pub total: u64,
}

impl MemoryTerms {
    /// The sum of every term but the per-layer breakdown (which `activations` sums).
    fn sum(&self) -> u64 {
        self.features
            + self.activations
            + self.backward_scratch
            + self.halo_buffers
            + self.graph
            + self.metadata
            + self.params
            + self.link_decoder
    }
}

/// Memory of one plan for one model: every device, and the worst one.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct KEstimate {
    pub k: usize,
    pub max_bytes: u64,
    pub worst_rank: usize,
    pub devices: Vec<MemoryTerms>,
}

/// Result of [`choose_k`]: the chosen k, the estimates it computed (`estimates[k]` for k = 0
/// upwards, see [`PlanContext::choose_k`] for where it stops) and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct KChoice {
    pub k: usize,
    pub estimates: Vec<KEstimate>,
    pub reason: String,
}

/// CSR bytes of one uploaded compact layer graph (see [`crate::LayerRows`]), with its split
/// into `relations` relation graphs for a typed model.
fn compact_graph_bytes(p: &DevicePlan, rows: &LayerRows, relations: usize) -> u64 {
    let edges = p.rows_graph(rows).offsets[rows.n_dst];
    let graph = (rows.n_dst as u64 + 1) * OFFSET_BYTES + edges * (INDEX_BYTES + VALUE_BYTES);
    if relations == 0 {
        return graph;
    }
    // Each relation's graph is a whole block's CSR and its transpose (offsets over the
    // destinations and over the sources, a mean per destination in each) over its share of
    // the edges; the types' rows index the sources and destinations once.
    let r = relations as u64;
    let (src, dst) = (rows.n_src as u64, rows.n_dst as u64);
    graph
        + r * (dst + 1 + src + 1) * OFFSET_BYTES
        + r * 2 * dst * VALUE_BYTES
        + 2 * edges * INDEX_BYTES
        + (src + dst) * INDEX_BYTES
}

fn send_rows(p: &DevicePlan) -> u64 {
    p.sends.iter().map(|s| s.rows.len() as u64).sum()
}

/// Estimate for one device: `fb` is its FB plan, `flx` its FLX plan when `k >= 1`.
pub fn estimate_device(
    dims: &ModelDims,
    k: usize,
    fb: &DevicePlan,
    flx: Option<&DevicePlan>,
) -> MemoryTerms {
    let plan_at = |l: usize| match flx {
        Some(f) if l < k => f,
        _ => fb,
    };
    let held: Vec<&DevicePlan> = std::iter::once(fb).chain(flx).collect();
    terms(dims, fb.rank, plan_at, |l| flx.is_some() && l < k, &held)
}

/// Estimate for one device that runs EVERY layer on one masked plan and holds nothing else
/// (a co-batch plan of cooperative batching, or a per-GPU mini-batch plan): the same terms as
/// [`estimate_device`] with that plan at every layer and only its graph and metadata held.
pub fn estimate_masked_device(dims: &ModelDims, plan: &DevicePlan) -> MemoryTerms {
    terms(dims, plan.rank, |_| plan, |_| true, &[plan])
}

/// [`estimate_masked_device`] for an inference pass (evaluation) on the plan: nothing is kept
/// for backward, so only one layer's input, its temporary (the aggregate, or the transformed
/// rows of a layer that transforms first: at most src x the wider width), its attention
/// rows and its output are live at once, and there is no backward scratch. Features, graphs,
/// halo buffers, metadata and parameters are as in training (the model's optimiser state
/// stays allocated).
pub fn estimate_masked_inference(dims: &ModelDims, plan: &DevicePlan) -> MemoryTerms {
    let mut t = estimate_masked_device(dims, plan);
    t.activations = t
        .layers
        .iter()
        .map(|m| {
            let l = m.layer;
            let widest = dims.in_width(l).max(dims.out_width(l)) as u64;
            let attended = dims.attention_width(l).unwrap_or(0) as u64;
            m.input + m.rows_local * (widest + attended) * F32_BYTES + m.pre_activation
        })
        .max()
        .unwrap_or(0);
    t.backward_scratch = 0;
    t.total = t.sum();
    t
}

/// [`estimate_masked_device`] for every device of a masked plan (`k` of the result is the
/// plan's `k`).
pub fn estimate_masked(dims: &ModelDims, plan: &FlxPlan) -> KEstimate {
    let devices: Vec<MemoryTerms> = plan
        .devices
        .iter()
        .map(|d| estimate_masked_device(dims, d))
        .collect();
    worst(plan.k, devices)
}

fn worst(k: usize, devices: Vec<MemoryTerms>) -> KEstimate {
    let (worst_rank, max_bytes) = devices
        .iter()
        .map(|t| (t.rank, t.total))
        .max_by_key(|&(r, t)| (t, std::cmp::Reverse(r)))
        .unwrap_or((0, 0));
    KEstimate {
        k,
        max_bytes,
        worst_rank,
        devices,
    }
}

fn terms<'p>(
    dims: &ModelDims,
    rank: usize,
    plan_at: impl Fn(usize) -> &'p DevicePlan,
    masked_at: impl Fn(usize) -> bool,
    held: &[&DevicePlan],
) -> MemoryTerms {
    // Every layer runs in its compact row space; layers with equal spaces on the same plan
    // share one uploaded graph, exactly as the runner does.
    let spaces = layer_spaces(dims.layers, &plan_at);
    let rows: Vec<(u64, u64)> = spaces
        .iter()
        .map(|(r, _)| (r.n_src as u64, r.n_dst as u64))
        .collect();
    let mut t = row_terms(dims, rank, &rows, masked_at);
    t.graph = spaces
        .iter()
        .enumerate()
        .filter(|&(l, &(_, first))| first == l)
        .map(|(l, (r, _))| compact_graph_bytes(plan_at(l), r, dims.relations))
        .sum();
    t.halo_buffers = 2
        * held.iter().map(|p| send_rows(p)).max().unwrap_or(0)
        * dims.max_width() as u64
        * F32_BYTES;
    t.metadata = held
        .iter()
        .map(|p| p.n_local() as u64 * METADATA_BYTES_PER_ROW)
        .sum();
    t.total = t.sum();
    t
}

/// The terms that depend only on each layer's `(source rows, computed rows)`: features,
/// saved tensors, backward scratch and parameters (graph, halo buffers and metadata 0, and
/// `total` their sum).
fn row_terms(
    dims: &ModelDims,
    rank: usize,
    rows: &[(u64, u64)],
    masked_at: impl Fn(usize) -> bool,
) -> MemoryTerms {
    let features = rows.first().map_or(0, |r| r.0) * dims.features as u64 * F32_BYTES;
    let layers: Vec<LayerMemory> = rows
        .iter()
        .enumerate()
        .map(|(l, &(src, dst))| {
            let (iw, ow) = (dims.in_width(l) as u64, dims.out_width(l) as u64);
            LayerMemory {
                layer: l,
                flx: masked_at(l),
                rows_local: src,
                rows_owned: dst,
                input: if l == 0 { 0 } else { src * iw * F32_BYTES },
                // Kept only by aggregate-then-transform layers (widening ones); a layer that
                // does not widen transforms first and aggregates a temporary.
                aggregated: if ow > iw { dst * iw * F32_BYTES } else { 0 },
                pre_activation: dst * ow * F32_BYTES,
            }
        })
        .collect();
    let activations = layers.iter().map(LayerMemory::total).sum();
    // The gradient flowing in and the one flowing out, plus a recomputed input copy.
    let scratch_buffers = if dims.input_copy == InputCopy::Recomputed {
        3
    } else {
        2
    };
    // Attention layers also hold `t` and its gradient (recomputed, not kept).
    let backward_scratch = rows
        .iter()
        .enumerate()
        .map(|(l, &(src, _))| {
            let widest = dims.in_width(l).max(dims.out_width(l)) as u64;
            let attended = 2 * dims.attention_width(l).unwrap_or(0) as u64;
            src * (scratch_buffers * widest + attended) * F32_BYTES
        })
        .max()
        .unwrap_or(0);
    let params = PARAM_COPIES * dims.param_count() * F32_BYTES;
    let mut t = MemoryTerms {
        rank,
        features,
        layers,
        activations,
        backward_scratch,
        halo_buffers: 0,
        graph: 0,
        metadata: 0,
        params,
        link_decoder: 2 * dims.link_embedding_values * F32_BYTES,
        total: 0,
    };
    t.total = t.sum();
    t
}

/// The least the estimate of any FB or FLX plan (exact or sampled) can be on a device whose
/// layout range holds `owned` vertices: every layer of those plans computes at least these
/// rows from at least these sources, and holds their metadata; the floor counts no edge, no
/// halo row and no replica. Lets a planner rule a static plan out without building it.
pub fn owned_rows_floor(dims: &ModelDims, owned: u64) -> u64 {
    let t = row_terms(dims, 0, &vec![(owned, owned); dims.layers], |_| false);
    t.total + owned * METADATA_BYTES_PER_ROW
}

/// Estimate of every device for `k` preloaded hops (`flx` must be the k-hop plan, None for 0).
pub fn estimate(dims: &ModelDims, fb: &FbPlan, flx: Option<&FlxPlan>) -> KEstimate {
    let k = flx.map_or(0, |f| f.k);
    let devices: Vec<MemoryTerms> = fb
        .devices
        .iter()
        .enumerate()
        .map(|(r, d)| estimate_device(dims, k, d, flx.map(|f| &f.devices[r])))
        .collect();
    worst(k, devices)
}

impl PreloadPlan {
    /// The memory estimate of this plan for `dims`.
    pub fn estimate(&self, dims: &ModelDims) -> KEstimate {
        estimate(dims, &self.fb, self.flx.as_ref())
    }
}

impl<'a> PlanContext<'a> {
    /// The largest k in `0..=dims.layers` whose worst-device estimate fits `budget` bytes.
    ///
    /// Totals are NOT monotone in k (a masked layer costs only its valid prefix, so the FLX
    /// plan for k + 1 can need less than the one for k), so every k is priced, except that
    /// the search stops at the first k whose monotone floor (features, metadata and
    /// parameters: the held rows only grow with k) is already over budget, since no larger
    /// k can fit then. The FLX plans of large k are the expensive ones to build.
    pub fn choose_k(&self, dims: &ModelDims, budget: u64) -> Result<KChoice> {
        dims.validate()?;
        let fb = self.fb_plan()?;
        let base = estimate(dims, &fb, None);
        if base.max_bytes > budget {
            return Err(MaskingError::BudgetTooSmall {
                budget,
                needed: base.max_bytes,
                rank: base.worst_rank,
            });
        }
        let mut estimates = vec![base];
        let mut k = 0;
        for candidate in 1..=dims.layers {
            let flx = self.flx_plan(candidate)?;
            let e = estimate(dims, &fb, Some(&flx));
            let floor = e
                .devices
                .iter()
                .map(|t| t.features + t.metadata + t.params)
                .max()
                .unwrap_or(0);
            if e.max_bytes <= budget {
                k = candidate;
            }
            estimates.push(e);
            if floor > budget {
                break;
            }
        }
        let chosen = &estimates[k];
        let mut reason = format!(
            "k = {k}: worst device (rank {}) needs {} bytes of the {budget}-byte budget",
            chosen.worst_rank, chosen.max_bytes
        );
        match estimates.get(k + 1) {
            Some(e) => reason.push_str(&format!(
                "; k = {} would need {} bytes on rank {}, over budget",
                k + 1,
                e.max_bytes,
                e.worst_rank
            )),
            None if k == dims.layers => reason.push_str(&format!(
                "; k = L = {} preloads every hop: no inter-server feature traffic after setup, \
                 where the replicated features are fetched once",
                dims.layers
            )),
            None => {}
        }
        tracing::info!(k, budget, %reason, "chose k");
        Ok(KChoice {
            k,
            estimates,
            reason,
        })
    }
}

/// [`PlanContext::choose_k`] for a graph and layout without split information.
pub fn choose_k(
    graph: CsrView<'_>,
    layout: &Layout,
    dims: &ModelDims,
    budget_bytes: u64,
) -> Result<KChoice> {
    let ctx = PlanContext::new(
        graph,
        layout.clone(),
        SplitMembership::none(graph.num_vertices()),
    )?;
    ctx.choose_k(dims, budget_bytes)
}
