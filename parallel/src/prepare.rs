//! A rank's share of a step built on the host ([`HostInput`]): the compact layer spaces as
//! engine blocks, the layer-0 features its server holds and its loss rows, with no device
//! and no peer involved. Producers prepare it beside the step's plans (the fetch stage after
//! sampling and planning), so that a rank's load is the replicated-row fetch and the uploads
//! (`crate::runtime`); the feature matrices cycle through a [`BufferPool`].

use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use grandis_engine::norm::{Aggregation, GlobalScales};
use grandis_engine::{BlockGraph, HostAllocator, HostBuffer, PlainAllocator, PreparedGraph};
use grandis_masking::{layer_spaces, DevicePlan, LayerRows, SPLIT_TRAIN};
use grandis_store::CsrGraph;

use crate::fetch::{FeatureSource, LocalFeatures};

/// What preparing a rank's input reads: the run's features, normalisation and labels.
#[derive(Clone, Copy)]
pub(crate) struct Preparer<'a> {
    pub features: FeatureSource<'a>,
    /// The model's kind (a typed one reads each block split by relation).
    pub kind: grandis_models::ModelKind,
    pub scales: &'a GlobalScales,
    pub agg: Aggregation,
    /// Conv layers of the model.
    pub layers: usize,
    /// The model reads only the layer-0 plan's owned rows (ResSAGE+'s row-local encoder),
    /// not its halo rows too.
    pub owned_input_only: bool,
    /// `SPLIT_*` flags by NEW id, only for vertices with a valid label.
    pub labelled_flags: &'a [u8],
    /// Where feature matrices come from and go back to.
    pub buffers: &'a BufferPool,
}

impl<'a> Preparer<'a> {
    /// The preparer of `config`'s inputs: what it reads of the model (its aggregation, its
    /// conv layers, whether its first layer reads owned rows only) comes from the config.
    pub fn for_model(
        features: FeatureSource<'a>,
        config: &grandis_models::ModelConfig,
        scales: &'a GlobalScales,
        labelled_flags: &'a [u8],
        buffers: &'a BufferPool,
    ) -> Preparer<'a> {
        Preparer {
            features,
            kind: config.kind,
            scales,
            agg: grandis_models::aggregation(config.kind),
            layers: config.layers,
            owned_input_only: config.stage_layout().first_conv > 0,
            labelled_flags,
            buffers,
        }
    }
}

/// Feature matrices handed back by the ranks after their upload, for the producers to fill
/// again: a step's matrix is tens to hundreds of MB, and a fresh one per step is as many page
/// faults and page clears (and, page-locked for a CUDA device, as many page-lockings). Holds
/// at most [`BufferPool::KEEP`].
pub(crate) struct BufferPool {
    kept: Mutex<Vec<HostBuffer>>,
    allocator: Box<dyn HostAllocator>,
}

impl Default for BufferPool {
    fn default() -> BufferPool {
        BufferPool::new(Box::new(PlainAllocator))
    }
}

impl BufferPool {
    /// Matrices kept: one per step a window of producers holds is plenty.
    const KEEP: usize = 8;

    pub fn new(allocator: Box<dyn HostAllocator>) -> BufferPool {
        BufferPool {
            kept: Mutex::default(),
            allocator,
        }
    }

    /// A buffer of `len` elements (contents unspecified): a kept one that is big enough, or a
    /// new one with a quarter to spare (steps differ in size; page-locked memory never grows).
    pub fn take(&self, len: usize) -> anyhow::Result<HostBuffer> {
        let kept = self.kept.lock().ok().and_then(|mut v| {
            let i = v
                .iter()
                .position(|b| b.capacity() >= len || !b.is_pinned())?;
            Some(v.swap_remove(i))
        });
        let mut buf = match kept {
            Some(buf) => buf,
            None => self
                .allocator
                .alloc(len + len / 4)
                .context("allocating a step's feature buffer")?,
        };
        buf.set_len(len)?;
        Ok(buf)
    }

    /// Hands `buf` back. A full pool keeps the larger of `buf` and its smallest buffer, so
    /// page-locked buffers too small for the steps cannot hold every place in it.
    pub fn put(&self, buf: HostBuffer) {
        let Ok(mut v) = self.kept.lock() else {
            return;
        };
        if buf.capacity() == 0 {
            return;
        }
        if v.len() < Self::KEEP {
            v.push(buf);
        } else if let Some(smallest) = v.iter_mut().min_by_key(|b| b.capacity()) {
            if smallest.capacity() < buf.capacity() {
                *smallest = buf;
            }
        }
    }
}

/// One compact layer space built on the host: what `crate::runtime::BlockRt` uploads.
pub(crate) struct HostBlock {
    pub(crate) rows: LayerRows,
    /// Checked and transposed here, so the rank only copies it.
    pub(crate) graph: PreparedGraph,
    /// Typed models: `graph` split by relation, and each type's rows
    /// (`grandis_models::split_block`).
    pub(crate) relations: Option<grandis_models::PreparedRelations>,
    /// Original ids of the `rows.n_src` compact input rows.
    pub(crate) ids: Vec<u32>,
}

/// A rank's share of one step built on the host, with no device and no peer: its distinct
/// plans, the engine blocks of its compact layer spaces, the layer-0 features its server
/// holds and its loss rows. A step's producer prepares it (`crate::feed`) so that a rank's
/// load is the replicated-row fetch and the uploads; `crate::runtime::Rt::upload` finishes it.
pub(crate) struct HostInput {
    pub(crate) plans: Vec<Arc<DevicePlan>>,
    pub(crate) blocks: Vec<HostBlock>,
    /// Per conv layer: (index into `plans`, index into `blocks`).
    pub(crate) layers: Vec<(usize, usize)>,
    pub(crate) features: LocalFeatures,
    pub(crate) loss_rows: Vec<u32>,
    pub(crate) loss_labels: Vec<u32>,
}

/// A rank's input but its features: the step's graphs, layers and loss rows, small beside the
/// feature rows, so producers build them as soon as a step's plans exist and read the rows
/// only when the ranks are near ([`Staged::read`]).
pub(crate) struct Staged {
    plans: Vec<Arc<DevicePlan>>,
    blocks: Vec<HostBlock>,
    layers: Vec<(usize, usize)>,
    /// Feature rows of the layer-0 input this rank reads locally.
    rows: usize,
    loss_rows: Vec<u32>,
    loss_labels: Vec<u32>,
}

impl Staged {
    /// The feature rows of `rank`'s layer-0 input (`step_plans` as given to
    /// [`HostInput::stage`]) into a matrix of the preparer's pool: the input complete.
    pub(crate) fn read(
        self,
        preparer: &Preparer<'_>,
        step_plans: &[Vec<Arc<DevicePlan>>],
        rank: usize,
    ) -> anyhow::Result<HostInput> {
        let buf = preparer
            .buffers
            .take(self.rows * preparer.features.view.feature_dim)?;
        let features = preparer
            .features
            .read_local(step_plans, rank, self.rows, buf)?;
        Ok(HostInput {
            plans: self.plans,
            blocks: self.blocks,
            layers: self.layers,
            features,
            loss_rows: self.loss_rows,
            loss_labels: self.loss_labels,
        })
    }
}

impl HostInput {
    /// Rank `rank`'s input of `step_plans` (`[rank][layer]`, all ranks): [`HostInput::stage`],
    /// then [`Staged::read`].
    pub(crate) fn prepare(
        preparer: &Preparer<'_>,
        step_plans: &[Vec<Arc<DevicePlan>>],
        rank: usize,
    ) -> anyhow::Result<HostInput> {
        Self::stage(preparer, step_plans, rank)?.read(preparer, step_plans, rank)
    }

    /// Rank `rank`'s input of `step_plans` but its features, checking the invariant the
    /// worker relies on: a layer's output rows are exactly the owned part of the next layer's
    /// input.
    pub(crate) fn stage(
        preparer: &Preparer<'_>,
        step_plans: &[Vec<Arc<DevicePlan>>],
        rank: usize,
    ) -> anyhow::Result<Staged> {
        let per_layer = plans_of(step_plans, rank)?;
        if per_layer.len() != preparer.layers {
            bail!(
                "internal: a step has {} layer plans for a {}-layer model",
                per_layer.len(),
                preparer.layers
            );
        }
        // Distinct plans: FLX (layers < k) and FB (layers >= k), or one.
        let mut plans: Vec<Arc<DevicePlan>> = Vec::new();
        let mut blocks: Vec<HostBlock> = Vec::new();
        let mut layers: Vec<(usize, usize)> = Vec::with_capacity(per_layer.len());
        // Each layer runs in its compact row space: its valid prefix and the rows it reads.
        let spaces = layer_spaces(per_layer.len(), |l| per_layer[l].as_ref());
        for (l, (p, (rows, first))) in per_layer.iter().zip(spaces).enumerate() {
            let pi = match plans.iter().position(|q| Arc::ptr_eq(q, p)) {
                Some(i) => i,
                None => {
                    plans.push(p.clone());
                    plans.len() - 1
                }
            };
            p.check_sends(l, &rows)?;
            if let Some(&(_, prev)) = layers.last() {
                // A layer's output must be exactly the owned part of the next layer's input
                // (also at the FLX -> FB reshape, where both are the inner rows).
                let prev_dst = blocks[prev].rows.n_dst;
                if prev_dst != rows.owned_src {
                    bail!(
                        "internal: layer {} outputs {prev_dst} rows but layer {l} reads {} owned \
                         rows",
                        l - 1,
                        rows.owned_src
                    );
                }
            }
            let bi = if first < l {
                layers[first].1
            } else {
                let src_ids = p.compact_global_ids(&rows);
                let compact = p.compact_graph(&rows)?;
                let graph = block(p, &rows, compact, &src_ids, preparer.scales, preparer.agg);
                let ids: Vec<u32> = src_ids
                    .iter()
                    .map(|&g| preparer.features.new_to_old[g as usize])
                    .collect();
                let types = preparer.features.view.types;
                let relations = grandis_models::split_block(preparer.kind, &graph, types, &ids)?
                    .map(grandis_models::PreparedRelations::new)
                    .transpose()?;
                let graph = PreparedGraph::new(graph)?;
                blocks.push(HostBlock {
                    rows,
                    graph,
                    relations,
                    ids,
                });
                blocks.len() - 1
            };
            layers.push((pi, bi));
        }
        // Features of the owned rows of the layer-0 plan (halo rows arrive by exchange).
        let (p0, b0) = layers[0];
        let rows = if preparer.owned_input_only {
            plans[p0].n_owned
        } else {
            blocks[b0].rows.n_src
        };
        // Loss rows: inner rows of the last layer's plan that are labelled train vertices.
        let last = &plans[layers[per_layer.len() - 1].0];
        let (mut loss_rows, mut loss_labels) = (Vec::new(), Vec::new());
        for i in 0..last.n_inner {
            let g = last.global_ids[i] as usize;
            if preparer.labelled_flags[g] & SPLIT_TRAIN != 0 {
                loss_rows.push(i as u32);
                loss_labels.push(
                    preparer.features.view.labels[preparer.features.new_to_old[g] as usize] as u32,
                );
            }
        }
        Ok(Staged {
            plans,
            blocks,
            layers,
            rows,
            loss_rows,
            loss_labels,
        })
    }
}

/// One layer's compact graph (`plan.compact_graph(rows)`) as an engine block; `src_ids` are
/// the global ids of its input rows. Normalisation is GLOBAL (picked by new id) for every row
/// that aggregates over all its in-edges, so exact plans reproduce the full-graph scales bit
/// for bit; a row that aggregates over `m < d` kept edges follows masking's contract: mean
/// divides by `m`, sum is unscaled, GCN keeps its global source and self-loop scales and
/// multiplies the neighbour sum by `d / m`.
fn block(
    plan: &DevicePlan,
    rows: &LayerRows,
    compact: CsrGraph,
    src_ids: &[u32],
    scales: &GlobalScales,
    agg: Aggregation,
) -> BlockGraph {
    let pick = |s: &Vec<f32>, ids: &[u32]| ids.iter().map(|&g| s[g as usize]).collect();
    let dst = &plan.global_ids[..rows.n_dst];
    let dst_scale = dst
        .iter()
        .enumerate()
        .map(|(i, &gid)| {
            let d = plan.in_degree[i];
            let m = plan.rows_agg_degree(rows, i as u32);
            let global = scales.dst[gid as usize];
            if m == d {
                return global;
            }
            match agg {
                Aggregation::Sum => global,
                _ if m == 0 => 0.0,
                Aggregation::Mean => (1.0 / m as f64) as f32,
                Aggregation::Gcn => (global as f64 * d as f64 / m as f64) as f32,
            }
        })
        .collect();
    BlockGraph {
        n_dst: rows.n_dst,
        n_src: rows.n_src,
        offsets: compact.offsets,
        indices: compact.indices,
        dst_scale,
        src_scale: scales.src.as_ref().map(|s| pick(s, src_ids)),
        self_scale: scales.self_loop.as_ref().map(|s| pick(s, dst)),
    }
}

/// Rank `rank`'s per-layer plans of a step's (or the evaluation) plans.
pub(crate) fn plans_of(
    plans: &[Vec<Arc<DevicePlan>>],
    rank: usize,
) -> anyhow::Result<&[Arc<DevicePlan>]> {
    plans
        .get(rank)
        .map(Vec::as_slice)
        .with_context(|| format!("internal: the step has no plans for rank {rank}"))
}
