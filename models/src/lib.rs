//! GNN models of grandis (GraphSAGE with the mean aggregator, GCN, GAT, ResSAGE+ = DeeperGCN
//! `res+` blocks over SAGE convolutions, and a features-only MLP baseline) written against
//! [`grandis_engine::Backend`] with hand-derived backward passes.
//!
//! A model is a sequence of **stages**, each with its own forward and backward
//! ([`Model::forward_stage`], [`Model::backward_stage`]). A *conv* stage reads the `n_src`
//! rows of its input (the device's own vertices first, then halo vertices) and writes `n_dst`
//! output rows (own vertices only); a *row-local* stage (ResSAGE+ encoder and head) maps rows
//! to rows. A distributed runner therefore calls "stage s forward on this block", appends the
//! halo rows it received to the output, and calls stage s+1; in backward it gets the gradient
//! of all `n_src` input rows, sends the halo part to the owners and adds what it receives
//! ([`grandis_engine::Backend::scatter_add_rows`]) before calling stage s-1. Everything inside a
//! stage before the convolution (LayerNorm, ReLU, dropout) is row-local and its dropout mask is
//! keyed by global vertex id, so recomputing it on halo rows gives the owner's values.
//! Weight gradients are plain buffers ([`Param::grad`]) to be all-reduced before
//! [`Model::adam_step`]. The single-process trainer calls [`Model::forward`] /
//! [`Model::backward`], which run all stages on one block.
//!
//! Memory: a conv stage keeps only what its backward cannot recompute (the aggregated input
//! when it aggregates before transforming, post-norm values and statistics). What runs on its
//! input before the convolution (pre-norm, ReLU, dropout) is recomputed in backward from the
//! input, which the runner keeps anyway: every step is deterministic and dropout masks are a
//! pure function of their key, so this is bit-identical and saves one input-sized tensor per
//! layer, the largest one when halos are large.//!
//! Files: `config` (what fixes a model), `param` (parameters, their layout and creation), `arch` (one
//! file per architecture's stage layout), `stage` (stage forward and backward), `optim`
//! (gradients, clipping, Adam); this file holds [`Model`] and the whole-model passes.

mod arch;
mod config;
mod optim;
mod param;
mod relation;
mod stage;

use grandis_engine::{Backend, Result};

pub use config::{aggregation, ModelConfig, ModelRelation, RelationWork, StageLayout, StageWork};
/// Which architecture: the job spec's own enum (one definition, in `grandis-wire`).
pub use grandis_wire::ModelKind;
pub use param::Param;
pub use relation::{split_block, PreparedRelations, RelationGraphs};
pub use stage::{StageCache, StageCtx};

use param::ParamLayout;
use stage::Stage;

/// A model: configuration, parameters, stages.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    pub params: Vec<Param<B>>,
    stages: Vec<Stage>,
    /// Per stage, for attention stages: where the attention vectors go in the block-diagonal
    /// score matrix ([`stage::AttentionLayer::positions`]), uploaded once.
    att_positions: Vec<Option<[B::Index; 2]>>,
}

impl<B: Backend> Model<B> {
    /// Builds the model with PyG's initial weights drawn from `config.seed`: `Linear`-style
    /// U(±1/√fan_in) weights and biases, GCN's Glorot with zero biases, unit LayerNorm gains.
    pub fn new(b: &B, config: ModelConfig) -> anyhow::Result<Model<B>> {
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid model configuration: {e}"))?;
        let mut layout = ParamLayout::new(config.layer_norm);
        let stages = arch::stages(&mut layout, &config);
        let params = layout.materialize(b, config.seed)?;
        let att_positions = stages
            .iter()
            .map(|st| {
                st.attention_shape()
                    .map(|at| {
                        let [src, dst] = at.positions();
                        Ok::<_, grandis_engine::EngineError>([
                            b.upload_index(&src)?,
                            b.upload_index(&dst)?,
                        ])
                    })
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Model {
            config,
            params,
            stages,
            att_positions,
        })
    }

    pub fn num_stages(&self) -> usize {
        self.stages.len()
    }

    /// True for stages that read neighbour rows (the runner must supply halo rows first).
    pub fn stage_reads_neighbors(&self, s: usize) -> bool {
        self.stages[s].reads_neighbours()
    }

    /// `(d_in, d_out)` of stage `s`.
    pub fn stage_dims(&self, s: usize) -> (usize, usize) {
        (self.stages[s].d_in, self.stages[s].d_out)
    }

    /// How much each input feature column weighs in the first stage: the L2 norm of its row
    /// in the stage's weights (`d_in x d_out`, self and neighbour weights together). A column
    /// the model multiplies by small weights contributes little to any prediction, which is
    /// what DGS's feature sampling ranks by (a cheap stand-in for its explanation step).
    pub fn input_importance(&self, b: &B) -> Result<Vec<f64>> {
        let st = &self.stages[0];
        let mut norm = vec![0f64; st.d_in];
        let relations = st.relations.iter().flat_map(|r| [r.w_neigh, r.w_self]);
        for w in [st.w_self, st.w_neigh]
            .into_iter()
            .chain(relations)
            .flatten()
        {
            let p = &self.params[w];
            let mut host = vec![0f32; p.len()];
            b.download(&p.value, 0, &mut host)?;
            let cols = p.shape.get(1).copied().unwrap_or(1).max(1);
            for (row, n) in host.chunks_exact(cols).zip(norm.iter_mut()) {
                *n += row
                    .iter()
                    .map(|&x| f64::from(x) * f64::from(x))
                    .sum::<f64>();
            }
        }
        Ok(norm.into_iter().map(f64::sqrt).collect())
    }

    pub fn num_parameters(&self) -> usize {
        self.params.iter().map(|p| p.len()).sum()
    }

    /// Runs every stage on one block (`n_dst == n_src`, the single-process case). Returns
    /// the logits and what [`Self::backward`] needs; pass `keep = false` to drop the caches
    /// (evaluation).
    pub fn forward(
        &self,
        b: &B,
        ctx: &StageCtx<'_, B>,
        features: &B::Buf,
        keep: bool,
    ) -> Result<(B::Buf, Tape<B>)> {
        let mut tape = Tape {
            outputs: Vec::new(),
            caches: Vec::new(),
        };
        let mut current: Option<B::Buf> = None;
        for s in 0..self.stages.len() {
            let input = current.as_ref().unwrap_or(features);
            let (out, cache) = self.forward_stage(b, s, ctx, input)?;
            if keep {
                if let Some(prev) = current.take() {
                    tape.outputs.push(prev);
                }
                tape.caches.push(cache);
            }
            current = Some(out);
        }
        Ok((current.expect("a model has at least one stage"), tape))
    }

    /// Backward through every stage given the gradient of the logits; parameter gradients
    /// are accumulated into [`Param::grad`] (call [`Self::zero_grads`] first). With
    /// `input_grad`, returns the gradient of the input (`n x in_dim`: learnable input
    /// columns need it); otherwise the first stage skips computing it and returns None.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &mut self,
        b: &B,
        ctx: &StageCtx<'_, B>,
        features: &B::Buf,
        logits: &B::Buf,
        tape: Tape<B>,
        grad_logits: B::Buf,
        input_grad: bool,
    ) -> Result<Option<B::Buf>> {
        let Tape {
            mut outputs,
            mut caches,
        } = tape;
        let mut grad = grad_logits;
        let mut output_owned: Option<B::Buf> = None;
        for s in (0..self.stages.len()).rev() {
            let cache = caches.pop().expect("tape has one cache per stage");
            let input_owned = if s > 0 { outputs.pop() } else { None };
            let input = input_owned.as_ref().unwrap_or(features);
            let output = output_owned.as_ref().unwrap_or(logits);
            let g =
                self.backward_stage(b, s, ctx, input, output, cache, grad, s > 0 || input_grad)?;
            output_owned = input_owned;
            match g {
                Some(g) => grad = g,
                None => return Ok(None),
            }
        }
        Ok(Some(grad))
    }
}

/// Saved stage outputs (inputs of the next stage) and caches of one forward pass.
pub struct Tape<B: Backend> {
    outputs: Vec<B::Buf>,
    caches: Vec<StageCache<B>>,
}
