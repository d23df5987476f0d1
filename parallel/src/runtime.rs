//! What a rank uploads for one step: the step's distinct plans, one engine block per distinct
//! compact layer space (`grandis_masking::LayerRows`), per-layer send indices, the layer-0
//! input features (replicated rows fetched from their home server, `crate::fetch`) and the
//! loss rows. [`Rt::build`] checks the invariant the worker relies on: a layer's output rows
//! are exactly the owned part of the next layer's input.

use std::sync::Arc;

use anyhow::{bail, Context};
use grandis_engine::norm::{Aggregation, GlobalScales};
use grandis_engine::{Backend, BlockGraph};
use grandis_fabric::{Endpoint, Tag};
use grandis_masking::{layer_spaces, DevicePlan, LayerRows, SPLIT_TRAIN};
use grandis_models::StageCtx;
use grandis_store::CsrGraph;

use crate::worker::Shared;

/// One uploaded compact layer space (see `grandis_masking::LayerRows`): the graph block a
/// layer aggregates over and the dropout ids of its input rows. Layers of one plan with equal
/// spaces (every FB layer, the saturated layers of a deep masked plan) share one.
pub(crate) struct BlockRt<B: Backend> {
    pub(crate) rows: LayerRows,
    pub(crate) graph: B::Graph,
    /// Original ids of the `rows.n_src` compact input rows (dropout masks key on them).
    pub(crate) ids: B::Index,
}

/// Per conv layer: which plan and block, and the send index buffers of its exchange prefixes.
pub(crate) struct LayerRt<B: Backend> {
    pub(crate) plan: usize,
    /// Index into `Rt::blocks`.
    pub(crate) block: usize,
    /// Per send list of the plan: the rows sent before this layer (None when empty).
    pub(crate) send_idx: Vec<Option<B::Index>>,
}

/// Everything a rank uploads for one step's plans.
pub(crate) struct Rt<B: Backend> {
    /// The step's distinct plans (FLX for layers < k and FB for the rest, or one).
    pub(crate) plans: Vec<Arc<DevicePlan>>,
    pub(crate) blocks: Vec<BlockRt<B>>,
    pub(crate) layers: Vec<LayerRt<B>>,
    /// Layer 0's input rows x F (the layer-0 plan's local rows): owned rows loaded once, halo
    /// rows filled by exchange (sage/gcn), or just the owned rows' input of the encoder
    /// (ressage).
    pub(crate) features: B::Buf,
    pub(crate) loss_rows: B::Index,
    pub(crate) loss_labels: B::Index,
}

pub(crate) fn ctx<B: Backend>(blk: &BlockRt<B>, train: Option<(u64, u64)>) -> StageCtx<'_, B> {
    StageCtx {
        graph: &blk.graph,
        n_dst: blk.rows.n_dst,
        n_src: blk.rows.n_src,
        global_ids: &blk.ids,
        train,
    }
}

/// The ResSAGE+ encoder: row-local over every owned row of the layer-0 plan (all of them are
/// layer 0's owned inputs; the layer-0 block's ids start with exactly those rows).
pub(crate) fn encoder_ctx<B: Backend>(rt: &Rt<B>, train: Option<(u64, u64)>) -> StageCtx<'_, B> {
    let blk = &rt.blocks[rt.layers[0].block];
    StageCtx {
        n_dst: blk.rows.owned_src,
        n_src: blk.rows.owned_src,
        ..ctx(blk, train)
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

impl<B: Backend> Rt<B> {
    /// Uploads this rank's plan of every layer of `step_plans` (`[rank][layer]`, all ranks)
    /// with the features of the layer-0 plan's owned rows (replicated ones fetched under
    /// `fetch_tag`, only `columns` of them when given: every rank must build the same steps in
    /// the same order, with the same columns) and the loss rows of the last layer's plan.
    pub(crate) fn build(
        sh: &Shared<'_>,
        b: &B,
        step_plans: &[Vec<Arc<DevicePlan>>],
        ep: &mut Endpoint,
        (fetch_tag, columns): (Tag, Option<&[u32]>),
        has_head: bool,
    ) -> anyhow::Result<Rt<B>> {
        let per_layer = plans_of(step_plans, ep.rank())?;
        if per_layer.len() != sh.config.layers {
            bail!(
                "internal: a step has {} layer plans for a {}-layer model",
                per_layer.len(),
                sh.config.layers
            );
        }
        // Distinct plans: FLX (layers < k) and FB (layers >= k), or one.
        let mut plans: Vec<Arc<DevicePlan>> = Vec::new();
        let mut blocks: Vec<BlockRt<B>> = Vec::new();
        let mut layers: Vec<LayerRt<B>> = Vec::with_capacity(per_layer.len());
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
            if let Some(prev) = layers.last() {
                // A layer's output must be exactly the owned part of the next layer's input
                // (also at the FLX -> FB reshape, where both are the inner rows).
                let prev_dst = blocks[prev.block].rows.n_dst;
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
                layers[first].block
            } else {
                let src_ids = p.compact_global_ids(&rows);
                let compact = p.compact_graph(&rows)?;
                let graph =
                    b.upload_graph(&block(p, &rows, compact, &src_ids, sh.scales, sh.agg))?;
                let orig: Vec<u32> = src_ids.iter().map(|&g| sh.new_to_old[g as usize]).collect();
                blocks.push(BlockRt {
                    rows,
                    graph,
                    ids: b.upload_index(&orig)?,
                });
                blocks.len() - 1
            };
            let send_idx = (0..p.sends.len())
                .map(|i| {
                    let rows = p.send_rows(l, i);
                    if rows.is_empty() {
                        Ok(None)
                    } else {
                        b.upload_index(rows).map(Some)
                    }
                })
                .collect::<grandis_engine::Result<Vec<_>>>()?;
            layers.push(LayerRt {
                plan: pi,
                block: bi,
                send_idx,
            });
        }
        // Features of the owned rows of the layer-0 plan (halo rows arrive by exchange).
        let p0 = &plans[layers[0].plan];
        let rows = if has_head {
            p0.n_owned
        } else {
            blocks[layers[0].block].rows.n_src
        };
        let host = sh
            .features()
            .layer0_features(step_plans, ep, fetch_tag, rows, columns)?;
        let features = b.upload(&host)?;
        drop(host);
        // Loss rows: inner rows of the last layer's plan that are labelled train vertices.
        let last = &plans[layers[per_layer.len() - 1].plan];
        let (mut rows, mut labels) = (Vec::new(), Vec::new());
        for i in 0..last.n_inner {
            let g = last.global_ids[i] as usize;
            if sh.labelled_flags[g] & SPLIT_TRAIN != 0 {
                rows.push(i as u32);
                labels.push(sh.view.labels[sh.new_to_old[g] as usize] as u32);
            }
        }
        Ok(Rt {
            plans,
            blocks,
            layers,
            features,
            loss_rows: b.upload_index(&rows)?,
            loss_labels: b.upload_index(&labels)?,
        })
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
