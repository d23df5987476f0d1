//! What a rank uploads for one step: the step's distinct plans, one engine block per distinct
//! compact layer space (`grandis_masking::LayerRows`), per-layer send indices, the layer-0
//! input features (replicated rows fetched from their home server, `crate::fetch`) and the
//! loss rows. The host side is prepared first (`crate::prepare`, usually by the step's
//! producer); [`Rt::upload`] fetches the replicated rows and uploads.

use std::sync::Arc;

use grandis_engine::{Backend, HostBuffer};
use grandis_fabric::{Endpoint, Tag};
use grandis_masking::{DevicePlan, LayerRows};
use grandis_models::{RelationGraphs, StageCtx};

use crate::fetch::Ahead;
use crate::prepare::{HostBlock, HostInput};
use crate::shared::Shared;
use crate::steps::Step;

/// One uploaded compact layer space (see `grandis_masking::LayerRows`): the graph block a
/// layer aggregates over and the dropout ids of its input rows. Layers of one plan with equal
/// spaces (every FB layer, the saturated layers of a deep masked plan) share one.
pub(crate) struct BlockRt<B: Backend> {
    pub(crate) rows: LayerRows,
    pub(crate) graph: B::Graph,
    /// Typed models: the block split by relation.
    pub(crate) relations: Option<RelationGraphs<B>>,
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
    /// With learnable node embeddings: the features as read (rows x F), kept on the host
    /// because `features` (rows x (F + embedding columns)) is filled anew before every forward
    /// pass (`crate::embedding_shard`); the pool's buffer, handed back to it when the rank
    /// loads its next step. None otherwise.
    pub(crate) host_features: Option<HostBuffer>,
    pub(crate) loss_rows: B::Index,
    pub(crate) loss_labels: B::Index,
}

pub(crate) fn ctx<B: Backend>(blk: &BlockRt<B>, train: Option<(u64, u64)>) -> StageCtx<'_, B> {
    StageCtx {
        graph: &blk.graph,
        typed: blk.relations.as_ref(),
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

impl<B: Backend> Rt<B> {
    /// Uploads this rank's plan of every layer of `step_plans` (`[rank][layer]`, all ranks):
    /// [`HostInput::prepare`] then [`Rt::upload`].
    pub(crate) fn build(
        sh: &Shared<'_>,
        b: &B,
        step_plans: &[Vec<Arc<DevicePlan>>],
        ep: &mut Endpoint,
        fetch: (Tag, Option<&[u32]>),
    ) -> anyhow::Result<Rt<B>> {
        let input = HostInput::prepare(&sh.preparer(), step_plans, ep.rank())?;
        Rt::upload(sh, b, input, ep, fetch, None)
    }

    /// Uploads rank `ep.rank()`'s input of `step`: the one its producer prepared, or one
    /// prepared here when none was.
    /// `ahead`: what the training loads ask ahead (`crate::fetch::AsksAhead`).
    pub(crate) fn load(
        sh: &Shared<'_>,
        b: &B,
        step: &Step,
        ep: &mut Endpoint,
        fetch: (Tag, Option<&[u32]>),
        ahead: Ahead<'_>,
    ) -> anyhow::Result<Rt<B>> {
        let input = match step.take_prepared(ep.rank()) {
            Some(input) => input,
            None => HostInput::prepare(&sh.preparer(), &step.plans, ep.rank())?,
        };
        Rt::upload(sh, b, input, ep, fetch, Some(ahead))
    }

    /// Uploads a prepared input: its replicated feature rows fetched under `fetch_tag` (only
    /// `columns` of them when given: every rank must load the same steps in the same order,
    /// with the same columns), then the blocks, send indices, features and loss rows. A feature
    /// matrix the backend copied goes back to `sh`'s pool for the producers to reuse.
    pub(crate) fn upload(
        sh: &Shared<'_>,
        b: &B,
        input: HostInput,
        ep: &mut Endpoint,
        (fetch_tag, columns): (Tag, Option<&[u32]>),
        ahead: Option<Ahead<'_>>,
    ) -> anyhow::Result<Rt<B>> {
        let HostInput {
            plans,
            blocks: host_blocks,
            layers: host_layers,
            features,
            loss_rows,
            loss_labels,
        } = input;
        let started = std::time::Instant::now();
        let host = features.complete(&sh.features(), ep, fetch_tag, columns, ahead)?;
        let fetched = started.elapsed();
        let mut blocks = Vec::with_capacity(host_blocks.len());
        for hb in host_blocks {
            let HostBlock {
                rows,
                graph,
                relations,
                ids,
            } = hb;
            blocks.push(BlockRt {
                graph: b.upload_prepared(&graph)?,
                relations: relations
                    .as_ref()
                    .map(|r| RelationGraphs::upload_prepared(b, r))
                    .transpose()?,
                ids: b.upload_index(&ids)?,
                rows,
            });
        }
        let mut layers = Vec::with_capacity(host_layers.len());
        for (l, (plan, block)) in host_layers.into_iter().enumerate() {
            let p = &plans[plan];
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
                plan,
                block,
                send_idx,
            });
        }
        let structure = started.elapsed();
        let rows = host.len();
        let (features, host_features) = match sh.opts.embedding_dim {
            0 => {
                let (features, host) = b.upload_host(host)?;
                sh.buffers.put(host);
                (features, None)
            }
            d => {
                let n_rows = layers.first().map_or(0, |l| blocks[l.block].rows.n_src);
                (b.alloc(n_rows * (sh.view.feature_dim + d))?, Some(host))
            }
        };
        tracing::debug!(
            "rank {} load: replicated rows {:.1} ms, blocks and indices {:.1} ms, {rows} feature \
             values {:.1} ms",
            ep.rank(),
            fetched.as_secs_f64() * 1e3,
            (structure - fetched).as_secs_f64() * 1e3,
            (started.elapsed() - structure).as_secs_f64() * 1e3
        );
        Ok(Rt {
            plans,
            blocks,
            layers,
            features,
            host_features,
            loss_rows: b.upload_index(&loss_rows)?,
            loss_labels: b.upload_index(&loss_labels)?,
        })
    }
}
