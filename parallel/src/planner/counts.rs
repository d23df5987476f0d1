//! What one step of a plan does, in counts: every rank's rows, input rows and edges per conv
//! layer (from the runner's own plans), the halo rows each exchange moves between ranks, the
//! replicated features fetched and the learnable embeddings' traffic; and a model's per-row
//! work constants. No rates and no seconds here.

use std::sync::Arc;

use grandis_masking::{DevicePlan, Layout, ModelDims};
use grandis_models::ModelConfig;
use grandis_wire::LinkBytes;
use serde::Serialize;

use crate::steps::Step;

/// Bytes a rank sends to another in one exchange (only pairs with traffic).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Traffic {
    /// (from rank, to rank, bytes).
    pub pairs: Vec<(usize, usize, u64)>,
}

impl Traffic {
    fn add(&mut self, from: usize, to: usize, bytes: u64) {
        if bytes > 0 {
            self.pairs.push((from, to, bytes));
        }
    }

    pub(crate) fn scaled(&self, f: f64) -> Traffic {
        Traffic {
            pairs: self
                .pairs
                .iter()
                .map(|&(a, b, x)| (a, b, (x as f64 * f).round() as u64))
                .collect(),
        }
    }

    /// Bytes by link class.
    pub fn bytes(&self, layout: &Layout) -> LinkBytes {
        let mut out = LinkBytes::default();
        for &(a, b, x) in &self.pairs {
            if layout.same_server(a, b) {
                out.intra_server += x;
            } else {
                out.inter_server += x;
            }
        }
        out
    }
}

/// What one step does, in counts.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StepCounts {
    /// `[rank][layer]` rows computed (valid owned rows) and edges aggregated.
    pub rows: Vec<Vec<u64>>,
    pub edges: Vec<Vec<u64>>,
    /// `[rank][layer]` the layer's input rows (its compact space's `n_src`): the rows its
    /// input-row products run on and its aggregation reads from.
    pub inputs: Vec<Vec<u64>>,
    /// `[layer]` the forward halo exchange feeding the layer, and its backward (empty for
    /// layers without one).
    pub forward: Vec<Traffic>,
    pub backward: Vec<Traffic>,
    /// Replicated features fetched from their home server for this step (see
    /// [`EpochCounts::setup_fetch`] for plans that serve the whole run).
    pub fetch: Traffic,
    /// Learnable node embeddings' asks, rows and gradients (`crate::embedding_shard`).
    pub embeddings: Traffic,
    /// `[rank][layer]` a typed model's rows by vertex type (empty for untyped models).
    pub type_rows: Vec<Vec<TypeRows>>,
}

/// One layer's output and input rows by vertex type (`[type]`), for pricing a typed model's
/// relations ([`LayerWork::relations`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TypeRows {
    pub rows: Vec<u64>,
    pub inputs: Vec<u64>,
}

impl TypeRows {
    /// The rows of `ids` by type: the first `n_dst` are the outputs, all of them the inputs.
    fn of(ids: &[u32], n_dst: usize, types: &TypeLookup<'_>) -> TypeRows {
        let mut out = TypeRows {
            rows: vec![0; types.types.num_types()],
            inputs: vec![0; types.types.num_types()],
        };
        for (i, &g) in ids.iter().enumerate() {
            let t = types.types.type_of(types.new_to_old[g as usize]);
            out.inputs[t] += 1;
            if i < n_dst {
                out.rows[t] += 1;
            }
        }
        out
    }

    /// A square layer over a typed dataset's whole vertex set (the calibration's sample).
    pub(super) fn whole(types: &grandis_store::Types) -> TypeRows {
        let counts: Vec<u64> = (0..types.num_types())
            .map(|t| types.range(t).len() as u64)
            .collect();
        TypeRows {
            rows: counts.clone(),
            inputs: counts,
        }
    }
}

/// The vertex type of a plan's (new) vertex id: the dataset's types and the ids' dataset ids.
#[derive(Clone, Copy)]
pub(crate) struct TypeLookup<'a> {
    pub types: &'a grandis_store::Types,
    pub new_to_old: &'a [u32],
}

/// What one epoch of a candidate does, in counts.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EpochCounts {
    pub iterations: usize,
    /// The counted steps (each standing for [`Self::scale`] iterations).
    pub steps: Vec<StepCounts>,
    /// Fetched once before the first epoch (static plans), not per epoch.
    pub setup_fetch: Traffic,
    /// Iterations per counted step (1 when every step was counted).
    pub scale: f64,
    /// Parameters the all-reduce sums every iteration.
    pub parameters: usize,
    /// The memory model's peak over the counted steps, per rank.
    pub model_bytes: Vec<u64>,
    /// Host seconds building the epoch's steps (sampling, extraction, and preparing the
    /// ranks' inputs; per-iteration schedules only, scaled like the steps): CPU work that
    /// competes with CPU ranks. Sampled FLX's redraw once an epoch is left out: a 200k graph's
    /// flx-eas epochs (0.33-0.47 s of builder time each) measured what their ranks' compute
    /// alone predicts, and counting it put them at 1.12x.
    pub build_seconds: f64,
    /// A link job's decoder, every iteration on every rank (none for node classification).
    pub decoder: DecoderWork,
}

/// What a link job's decoder does on each rank each iteration (`link_task`): score
/// `pairs_per_rank` pairs of `cols`-wide embeddings out of a matrix of `rows` rows and add
/// their gradients, with the MLP's per-pair products when `mlp`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DecoderWork {
    pub pairs_per_rank: f64,
    pub cols: usize,
    pub rows: f64,
    pub mlp: bool,
}

/// The per-layer constants of a model that turn rows and edges into work.
#[derive(Debug, Clone, Serialize)]
pub struct LayerWork {
    /// Dense flops of one row's forward pass at this layer (its weights; the encoder of
    /// ResSAGE+ on its first layer, its head on its last), `input_flops_per_row` of them
    /// per input row rather than per output row.
    pub flops_per_row: f64,
    /// [`grandis_models::StageWork::input_flops_per_row`] of the layer's convolution.
    pub input_flops_per_row: f64,
    /// Columns the layer aggregates per edge.
    pub aggregated_cols: usize,
    /// Columns of a halo row in its exchange (the layer's input width).
    pub exchanged_cols: usize,
    /// Whether the layer's input gets a gradient (all but layer 0 of a plain stack, whose
    /// input is the features): backward then runs the input's products too, and the halo
    /// rows' gradients go back to their owners.
    pub input_gradient: bool,
    /// Whether the backward pass aggregates: always for a layer that maps before it
    /// aggregates, otherwise only for the input's gradient
    /// ([`grandis_models::StageWork::backward_aggregates`]).
    pub backward_aggregates: bool,
    /// A typed convolution's relations ([`grandis_models::StageWork::relations`]), priced
    /// on the layer's rows of their types ([`StepCounts::type_rows`]).
    pub relations: Vec<grandis_models::RelationWork>,
}

/// The work constants of every conv layer of `config`.
pub fn layer_work(config: &ModelConfig, dims: &ModelDims) -> anyhow::Result<Vec<LayerWork>> {
    let work = config
        .stage_work()
        .map_err(|e| anyhow::anyhow!("invalid model configuration: {e}"))?;
    let stage_flops = |s: usize| work[s].flops_per_row;
    let stages = work.len();
    let first_conv = config.stage_layout().first_conv;
    Ok((0..config.layers)
        .map(|l| {
            let s = l + first_conv;
            // Layer 0's input gradient goes only to a stage before it.
            let input_gradient = l > 0 || first_conv > 0;
            let mut flops = stage_flops(s);
            // Row-local stages before the first convolution and after the last are priced
            // with them (an encoder, a head).
            if l == 0 {
                flops += (0..first_conv).map(stage_flops).sum::<f64>();
            }
            if l + 1 == config.layers {
                flops += (s + 1..stages).map(stage_flops).sum::<f64>();
            }
            LayerWork {
                flops_per_row: flops,
                input_flops_per_row: work[s].input_flops_per_row,
                aggregated_cols: work[s].aggregated_cols.unwrap_or(work[s].d_in),
                exchanged_cols: dims.in_width(l),
                input_gradient,
                backward_aggregates: work[s].backward_aggregates || input_gradient,
                relations: work[s].relations.clone(),
            }
        })
        .collect())
}

/// Counts of one step: every rank's rows and edges per layer, its exchanges and fetch, and
/// (a typed model, with `types`) its rows by type.
pub(crate) fn count_step(
    step: &Step,
    layout: &Layout,
    work: &[LayerWork],
    (features, embedding_dim): (usize, usize),
    types: Option<TypeLookup<'_>>,
) -> StepCounts {
    let typed = work.iter().any(|w| !w.relations.is_empty());
    let types = types.filter(|_| typed);
    let layers = work.len();
    let mut rows = vec![vec![0u64; layers]; step.plans.len()];
    let mut edges = vec![vec![0u64; layers]; step.plans.len()];
    let mut inputs = vec![vec![0u64; layers]; step.plans.len()];
    let mut forward = vec![Traffic::default(); layers];
    let mut backward = vec![Traffic::default(); layers];
    let mut fetch = Traffic::default();
    let mut embeddings = Traffic::default();
    let mut type_rows = match types {
        Some(_) => vec![vec![TypeRows::default(); layers]; step.plans.len()],
        None => Vec::new(),
    };
    for (r, plans) in step.plans.iter().enumerate() {
        for (l, p) in plans.iter().enumerate().take(layers) {
            let w = p.work_at(l);
            let space = p.layer_rows(l);
            rows[r][l] = w.rows;
            inputs[r][l] = space.n_src as u64;
            edges[r][l] = w.edges;
            if let Some(types) = &types {
                let ids = p.compact_global_ids(&space);
                type_rows[r][l] = TypeRows::of(&ids, space.n_dst, types);
            }
            let row_bytes = (work[l].exchanged_cols * 4) as u64;
            for (gi, g) in p.halo.iter().enumerate() {
                let n = p.recv_rows(l, gi).len() as u64;
                forward[l].add(g.peer, r, n * row_bytes);
                if work[l].input_gradient {
                    backward[l].add(r, g.peer, n * row_bytes);
                }
            }
        }
        if let Some(p) = plans.first() {
            fetch_of(p, r, layout, features, &mut fetch);
            if embedding_dim > 0 {
                embeddings_of(p, r, layout, embedding_dim, &mut embeddings);
            }
        }
    }
    StepCounts {
        rows,
        edges,
        inputs,
        forward,
        backward,
        fetch,
        embeddings,
        type_rows,
    }
}

/// What rank `r`'s layer-0 plan `p` moves for learnable embeddings of `dim` columns
/// (`crate::embedding_shard`): its ask to every other rank (a count, then an id for each of
/// its rows homed there), the asked rows' values back (its owned rows homed elsewhere: FLX's
/// replicated ones), and each borrowed row's gradient home (the halo's too).
fn embeddings_of(p: &DevicePlan, r: usize, layout: &Layout, dim: usize, out: &mut Traffic) {
    let (id, row) = (4u64, 4 * dim as u64);
    for peer in (0..layout.num_ranks()).filter(|&o| o != r) {
        out.add(r, peer, id);
    }
    let halo = (0..p.halo.len()).flat_map(|gi| p.recv_rows(0, gi));
    for (i, asked) in (0..p.n_owned as u32)
        .map(|i| (i, true))
        .chain(halo.map(|i| (i, false)))
    {
        let home = layout.owner(p.global_ids[i as usize]);
        if home != r {
            out.add(r, home, id + row);
            if asked {
                out.add(home, r, row);
            }
        }
    }
}

/// The features rank `r`'s layer-0 plan `p` owns but whose home is another server.
fn fetch_of(p: &Arc<DevicePlan>, r: usize, layout: &Layout, features: usize, out: &mut Traffic) {
    let server = layout.server_of_rank(r);
    let mut from: std::collections::BTreeMap<usize, u64> = Default::default();
    for &g in &p.global_ids[..p.n_owned] {
        if layout.server_of(g) != server {
            *from.entry(layout.owner(g)).or_default() += (features * 4) as u64;
        }
    }
    for (home, bytes) in from {
        out.add(home, r, bytes);
    }
}
