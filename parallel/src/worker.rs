//! One rank's training loop: per optimiser step, the step's runtime (`crate::runtime`: one
//! block per compact layer space, so each layer computes and stores only the rows its mask
//! makes exact and the rows they read), forward with per-layer halo exchanges, loss on its
//! inner train rows normalised by the step's GLOBAL loss-row count, backward with
//! halo-gradient exchanges (both in `exchange`), hierarchical all-reduce of the weight gradients, Adam. Full-batch
//! modes take one step per epoch on a plan that never (FB, FLX) or rarely (FLX-EAS) changes;
//! cooperative batching and the mini-batch baseline take one step per iteration on fresh
//! plans from the producer (`steps`). Every step returns errors (never panics) so a failing
//! rank drops its endpoint and the fabric wakes its peers with `PeerGone` instead of letting
//! them hang.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context};
use grandis_engine::Backend;
use grandis_fabric::{Endpoint, Expected, Tag};
use grandis_masking::{DevicePlan, SPLIT_TEST, SPLIT_TRAIN, SPLIT_VAL};
use grandis_models::{Model, StageCache};
use grandis_trainer::{Decoder, EpochStats};
use grandis_wire::LinkSummary;

use crate::embedding_shard::EmbeddingShard;
use crate::feed::Feed;
use crate::fetch::{Ahead, AsksAhead, SETUP_EPOCH};
use crate::link_task::{cobatch_loss, CobatchSeat, LinkTask};
use crate::links::{Arrived, RankLinks};
use crate::metered::Meter;
use crate::runtime::{ctx, encoder_ctx, BlockRt, Rt};
use crate::shared::{EvalOn, Shared};
use crate::stale::{StaleCounts, StaleHalo};
use crate::steps::{RunStats, Step, StepPairs};

mod exchange;

/// The `ceil(fraction · F)` most important columns (at least one), ascending; ties go to the
/// lower column.
fn top_columns(importance: &[f64], fraction: f64) -> Vec<u32> {
    if importance.is_empty() {
        return Vec::new();
    }
    let k = ((fraction * importance.len() as f64).ceil() as usize).clamp(1, importance.len());
    let mut order: Vec<u32> = (0..importance.len() as u32).collect();
    order.sort_by(|&a, &b| {
        importance[b as usize]
            .total_cmp(&importance[a as usize])
            .then(a.cmp(&b))
    });
    order.truncate(k);
    order.sort_unstable();
    order
}

/// How often global rank 0 logs its step within a long epoch.
const STEP_LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);

/// Tags of evaluation traffic carry this bit in their epoch, so evaluation never mixes with
/// the training bytes and seconds of the same epoch in the fabric counters.
pub const EVAL_EPOCH_BIT: u32 = 1 << 31;

/// Tag epoch of the servers' step counts added up at the end of a run: an evaluation epoch
/// no run reaches, so the reports leave its bytes out of the training epochs'.
const COUNTS_EPOCH: u32 = u32::MAX;

/// The per-epoch callback; only rank 0 calls it.
pub(crate) type EpochCallback<'c> = Mutex<&'c mut (dyn FnMut(&EpochStats) + Send)>;

/// What one rank hands back.
pub(crate) struct RankResult {
    pub rank: usize,
    pub epochs: Vec<EpochStats>,
    /// Train / val / test accuracy after the last epoch.
    pub final_acc: [f64; 3],
    /// Link prediction's validation and test scores after the last epoch.
    pub link: Option<LinkSummary>,
    pub num_parameters: usize,
    /// (original id, logits row) of every inner vertex, when asked for.
    pub logits: Vec<(u32, Vec<f32>)>,
    pub counters: grandis_fabric::Counters,
    /// Where each epoch's wall time went outside the steps' compute and fabric calls.
    pub epoch_times: Vec<EpochTimes>,
    /// Peak live bytes during training steps (evaluation excluded).
    pub peak_bytes: u64,
    /// Live bytes after setup (features, graphs, parameters) before the first epoch.
    pub setup_bytes: u64,
    /// What layer-wise inference after training did on this rank.
    pub inference: Option<crate::infer::RankInference>,
    /// What the stale exchange skipped (zeros without `--staleness`).
    pub stale: StaleCounts,
    /// Every server's step counts added up, where each server counted only its part
    /// ([`Shared::server_counts`]).
    pub cluster_counts: Option<RunStats>,
}

/// One training epoch's wall seconds on one rank, and the parts of it spent getting steps.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct EpochTimes {
    pub wall_s: f64,
    /// Blocked on the step producer ([`crate::feed::Feed::take`]).
    pub plan_wait_s: f64,
    /// Switching to a step's plans ([`Worker::switch_to`]), its feature fetch included.
    pub plan_load_s: f64,
}

/// A training step's loss.
struct StepLoss {
    /// This rank's loss summed over its targets in the step.
    local: f64,
    /// The targets the step's loss is normalised by.
    targets: usize,
    /// On the epoch's last step: the epoch's loss summed over every rank and step.
    epoch: Option<f64>,
}

struct LayerTape<B: Backend> {
    /// None: the stage read the features buffer.
    input: Option<B::Buf>,
    cache: Option<StageCache<B>>,
    /// Kept only where the next layer's input cannot stand in for it (last layer, reshape).
    output: Option<B::Buf>,
}

struct Tape<B: Backend> {
    encoder: Option<StageCache<B>>,
    layers: Vec<LayerTape<B>>,
    head: Option<StageCache<B>>,
}

pub(crate) struct Worker<'w, B: Backend> {
    sh: &'w Shared<'w>,
    b: &'w B,
    ep: Endpoint,
    /// The device transports of halo rows and weight gradients (none: all over `ep`).
    links: RankLinks<B>,
    model: Model<B>,
    rt: Rt<B>,
    /// The step `rt` was built for (a new step with other plans rebuilds it).
    step: Arc<Step>,
    /// Stage index of conv layer 0 (1 for ressage: the encoder comes first).
    first_conv: usize,
    has_head: bool,
    /// When set, the forward pass stores every conv layer's inner-row outputs here.
    capture: Option<Vec<Vec<f32>>>,
    /// SANCUS's cached boundary rows, with `--staleness`.
    stale: Option<StaleHalo>,
    /// DGS: the feature columns fetched for other servers' vertices this epoch (ascending),
    /// with `--remote-features`; None = whole rows.
    remote_columns: Option<Vec<u32>>,
    /// The replicated rows this rank and its peers asked for ahead (steps built per server).
    asks_ahead: AsksAhead,
    /// Link prediction's decoder (every rank's copy the same).
    decoder: Option<Decoder>,
    /// This rank's rows of the learnable node embeddings, when the run has them.
    embeddings: Option<EmbeddingShard>,
}

impl<'w, B: Backend> Worker<'w, B> {
    pub fn new(
        sh: &'w Shared<'w>,
        b: &'w B,
        mut ep: Endpoint,
        links: RankLinks<B>,
    ) -> anyhow::Result<Self> {
        let mut model = Model::new(b, sh.config.clone())?;
        if let Some(w) = sh.weights {
            if w.len() != model.params.len() {
                bail!(
                    "{} weight tensors given for a model with {} parameters tensors",
                    w.len(),
                    model.params.len()
                );
            }
            for (p, host) in model.params.iter_mut().zip(w) {
                if host.len() != p.len() {
                    bail!(
                        "weight tensor {} has {} values, the model expects {}",
                        p.name,
                        host.len(),
                        p.len()
                    );
                }
                b.upload_into(&mut p.value, 0, host)?;
            }
        }
        let layout = sh.config.stage_layout();
        let (first_conv, has_head) = (layout.first_conv, layout.has_head);
        if (0..model.num_stages()).any(|s| {
            let conv = s >= first_conv && s < first_conv + sh.config.layers;
            conv != model.stage_reads_neighbors(s)
        }) {
            bail!(
                "model {} does not have the stage layout the parallel runner expects",
                sh.config.kind.name()
            );
        }
        let mut decoder = sh.opts.objective.decoder(sh.config.classes, sh.config.seed);
        let mut resumed_embeddings = None;
        if let Some(ck) = sh.resume {
            ck.restore(b, &mut model, true)
                .context("restoring the checkpoint")?;
            decoder = ck.link_decoder(true)?;
            resumed_embeddings = ck.node_embeddings(sh.new_to_old.len(), true)?;
        }
        let embeddings = match sh.opts.embedding_dim {
            0 => None,
            d => Some(EmbeddingShard::new(
                sh.layout,
                ep.rank(),
                sh.new_to_old,
                (d, sh.config.seed),
                resumed_embeddings.as_ref(),
                sh.steps_read_every_vertex,
            )?),
        };
        let first = sh.first_step();
        let step = sh.feed.take(first)?;
        let mut asks_ahead = AsksAhead::default();
        let next = sh.feed.peek_plans(first + 1);
        let ahead = Ahead {
            state: &mut asks_ahead,
            index: first,
            next: next.as_deref().map(|s| s.plans.as_slice()),
            answerer: sh.answerer,
        };
        // The first step's features are whole: no weights to rank the columns by yet.
        let rt = Rt::load(
            sh,
            b,
            &step,
            &mut ep,
            (Tag::fetch(SETUP_EPOCH), None),
            ahead,
        )?;
        Ok(Worker {
            sh,
            b,
            ep,
            links,
            model,
            rt,
            step,
            first_conv,
            has_head,
            capture: None,
            stale: sh.staleness.map(StaleHalo::new),
            remote_columns: None,
            asks_ahead,
            decoder,
            embeddings,
        })
    }

    /// The layer-0 input's embedding columns for this forward pass: the rows this rank
    /// reads locally filled from the shards of their home ranks (a collective: every rank's
    /// forward passes fill in the same order), the halo rows left to the layer's exchange.
    fn fill_embeddings(&mut self, epoch_tag: u32) -> anyhow::Result<()> {
        let Some(shard) = self.embeddings.as_mut() else {
            return Ok(());
        };
        let first = &self.rt.layers[0];
        let plan = &self.rt.plans[first.plan];
        let rows = &self.rt.blocks[first.block].rows;
        let features = self
            .rt
            .host_features
            .as_ref()
            .context("internal: a step with learnable embeddings kept no host features")?
            .as_slice();
        let input = shard.fill(
            &mut self.ep,
            self.sh.layout,
            (&plan.compact_global_ids(rows), rows.owned_src),
            features,
            epoch_tag,
        )?;
        self.b.upload_into(&mut self.rt.features, 0, &input)?;
        Ok(())
    }

    fn plan(&self, l: usize) -> &Arc<DevicePlan> {
        &self.rt.plans[self.rt.layers[l].plan]
    }

    /// The compact block layer `l` runs on.
    fn blk(&self, l: usize) -> &BlockRt<B> {
        &self.rt.blocks[self.rt.layers[l].block]
    }

    /// Forward through every stage. `epoch_tag` is the epoch number the exchange tags carry;
    /// `train` enables dropout. Returns the logits (`n_owned(last plan) x C`) and, when
    /// `keep`, the tape for [`Self::backward`].
    fn forward(
        &mut self,
        epoch_tag: u32,
        train: Option<(u64, u64)>,
        keep: bool,
    ) -> anyhow::Result<(B::Buf, Option<Tape<B>>)> {
        let b = self.b;
        let n_layers = self.rt.layers.len();
        let mut tape = Tape {
            encoder: None,
            layers: Vec::with_capacity(n_layers),
            head: None,
        };
        self.fill_embeddings(epoch_tag)?;
        let mut act: Option<B::Buf> = None;
        if self.has_head {
            let c = encoder_ctx(&self.rt, train);
            let (y, cache) = self.model.forward_stage(b, 0, &c, &self.rt.features)?;
            if keep {
                tape.encoder = Some(cache);
            }
            act = Some(y);
        }
        for l in 0..n_layers {
            let s = self.first_conv + l;
            let (d_in, d_out) = self.model.stage_dims(s);
            let tag = Tag::forward(epoch_tag, l as u32);
            let input = match act.take() {
                None => {
                    // Layer 0 of sage/gcn: halo rows of the features buffer, in place.
                    self.exchange_forward(l, None, d_in, tag, keep)?;
                    None
                }
                Some(prev) => {
                    // The previous output is the owned part of this layer's input (checked
                    // when the step was built); the halo part arrives by exchange.
                    let rows = &self.blk(l).rows;
                    let (owned, n_src) = (rows.owned_src, rows.n_src);
                    let mut inp = b.alloc(n_src * d_in)?;
                    b.copy(&prev, &mut inp, owned * d_in)?;
                    drop(prev);
                    self.exchange_forward(l, Some(&mut inp), d_in, tag, keep)?;
                    Some(inp)
                }
            };
            // One-hop graph masking: the block holds only the rows exact at this layer, so
            // nothing is computed (or stored) for the rest.
            let (out, cache) = self.model.forward_stage(
                b,
                s,
                &ctx(self.blk(l), train),
                input.as_ref().unwrap_or(&self.rt.features),
            )?;
            if self.capture.is_some() {
                let n_inner = self.plan(l).n_inner;
                let mut host = vec![0f32; n_inner * d_out];
                b.download(&out, 0, &mut host)?;
                if let Some(c) = self.capture.as_mut() {
                    c.push(host);
                }
            }
            let last = l + 1 == n_layers;
            // The output must outlive this layer where the next input cannot stand in for it:
            // at the reshape (fewer rows next) and before the ResSAGE+ head.
            let keep_output = if last {
                self.has_head
            } else {
                self.blk(l + 1).rows.owned_src != self.blk(l).rows.n_dst
            };
            if keep {
                tape.layers.push(LayerTape {
                    input,
                    cache: Some(cache),
                    // Kept only where the next layer's input cannot stand in for it.
                    output: None,
                });
            }
            if keep && keep_output {
                // Copy: `out` also moves on as the next activation.
                let mut kept = b.alloc(b.len(&out))?;
                b.copy(&out, &mut kept, b.len(&out))?;
                tape.layers[l].output = Some(kept);
            }
            act = Some(out);
        }
        let mut logits = act.context("a model has at least one layer")?;
        if self.has_head {
            let s = self.first_conv + n_layers;
            let (y, cache) =
                self.model
                    .forward_stage(b, s, &ctx(self.blk(n_layers - 1), train), &logits)?;
            if keep {
                tape.head = Some(cache);
            }
            logits = y;
        }
        Ok((logits, keep.then_some(tape)))
    }

    fn backward(
        &mut self,
        epoch: u32,
        train: Option<(u64, u64)>,
        logits: &B::Buf,
        mut tape: Tape<B>,
        grad_logits: B::Buf,
    ) -> anyhow::Result<()> {
        let b = self.b;
        let n_layers = self.rt.layers.len();
        let mut g = grad_logits;
        if self.has_head {
            let s = self.first_conv + n_layers;
            let p = &self.rt.blocks[self.rt.layers[n_layers - 1].block];
            let input = tape.layers[n_layers - 1]
                .output
                .as_ref()
                .context("last layer output kept")?;
            let cache = tape.head.take().context("head cache")?;
            g = self
                .model
                .backward_stage(b, s, &ctx(p, train), input, logits, cache, g, true)?
                .context("head returns an input gradient")?;
        }
        for l in (0..n_layers).rev() {
            let s = self.first_conv + l;
            let (d_in, _) = self.model.stage_dims(s);
            let blk = &self.rt.blocks[self.rt.layers[l].block];
            let cache = tape.layers[l].cache.take().context("layer cache")?;
            let need_input_grad = l > 0 || self.has_head || self.embeddings.is_some();
            let gx = {
                let (head, tail) = tape.layers.split_at_mut(l + 1);
                let me = &head[l];
                let input = me.input.as_ref().unwrap_or(&self.rt.features);
                let output = match (&me.output, tail.first()) {
                    (Some(o), _) => o,
                    (None, Some(next)) => next.input.as_ref().context("next layer input")?,
                    (None, None) => logits,
                };
                self.model.backward_stage(
                    b,
                    s,
                    &ctx(blk, train),
                    input,
                    output,
                    cache,
                    g,
                    need_input_grad,
                )?
            };
            // The next layer's input served as this layer's output; free it now.
            if let Some(next) = tape.layers.get_mut(l + 1) {
                next.input = None;
            }
            let Some(mut gx) = gx else { break };
            if let (0, Some(shard)) = (l, self.embeddings.as_mut()) {
                // The input's gradient: only its embedding columns have a use, and the
                // embeddings' step sends every borrowed row's home just those (the halo rows'
                // too, which the layer-0 exchange would send whole).
                let rows = self.rt.blocks[self.rt.layers[0].block].rows.n_src;
                let mut host = vec![0f32; rows * d_in];
                b.download(&gx, 0, &mut host)?;
                shard.step(&mut self.ep, &host, d_in, &self.sh.opts.adam(1, 1.0), epoch)?;
                break;
            }
            self.exchange_backward(l, &mut gx, d_in, Tag::backward(epoch, l as u32))?;
            if l > 0 {
                // The owned rows of this layer's input are the previous layer's outputs (same
                // ids and count, checked when the step was built): their gradient is the
                // first rows of `gx`, and the stages read only those.
                g = gx;
            } else {
                // ResSAGE+ encoder (row-local; its input gradient is not needed).
                let c = encoder_ctx(&self.rt, train);
                let cache = tape.encoder.take().context("encoder cache")?;
                self.model.backward_stage(
                    b,
                    0,
                    &c,
                    &self.rt.features,
                    &self.rt.features,
                    cache,
                    gx,
                    false,
                )?;
                break;
            }
        }
        Ok(())
    }

    /// One optimiser step (`step` counts from 1 over the whole run; it keys dropout and
    /// Adam's bias correction, and equals the epoch in full-batch modes); the loss is
    /// normalised by `targets`, the step's global loss-row count. Returns this rank's loss sum
    /// (not normalised). On the epoch's last step, `earlier_loss` is this rank's loss summed
    /// over the epoch's earlier steps, and the step also returns the epoch's loss summed over
    /// every rank: it travels in the weight gradients' all-reduce, so an epoch needs no
    /// collective of its own to learn its loss (on a slow link two rounds of latency and a
    /// rank's wait, a fifth of a millisecond-epoch's time).
    fn train_step(
        &mut self,
        epoch: usize,
        step: u64,
        targets: usize,
        earlier_loss: Option<f64>,
    ) -> anyhow::Result<StepLoss> {
        let b = self.b;
        let sh = self.sh;
        let e = epoch as u32;
        let train = Some((sh.opts.seed, step));
        if let Some(st) = self.stale.as_mut() {
            st.follow(&self.step);
        }
        self.model.zero_grads(b)?;
        let (logits, tape) = self.forward(e, train, true)?;
        let tape = tape.context("forward keeps a tape in training")?;
        let classes = sh.config.classes;
        // Logits exist for the last layer's valid rows only (the inner rows come first).
        let n = self.blk(self.rt.layers.len() - 1).rows.n_dst;
        let mut grad = b.alloc(n * classes)?;
        let current = self.step.clone();
        let (loss_sum, targets) = match (&sh.link, &current.link) {
            (None, _) => {
                // A step whose co-batches hold no labelled vertex has no loss; avoid 0 / 0.
                let normalizer = targets.max(1) as f32;
                let loss_sum = b.cross_entropy(
                    &logits,
                    n,
                    classes,
                    &self.rt.loss_rows,
                    &self.rt.loss_labels,
                    normalizer,
                    &mut grad,
                )?;
                (loss_sum, targets)
            }
            (Some(task), pairs) => {
                // This rank's targets' embeddings (its plan's inner rows; the rows past them,
                // other ranks' vertices, carry no loss here: their owners back-propagate them),
                // scored over its share of the step's pairs.
                let last = self.plan(self.rt.layers.len() - 1).clone();
                let mut mine = vec![0f32; last.n_inner * classes];
                b.download(&logits, 0, &mut mine)?;
                let ids = &last.global_ids[..last.n_inner];
                let decoder = self
                    .decoder
                    .as_ref()
                    .context("internal: link prediction without a decoder")?;
                let (loss_sum, dz, mut decoder_grad, pairs) = match pairs {
                    // A batch of supervision edges (mb: the rank's own; cob: its server's).
                    StepPairs::Servers(batches) => {
                        let layout = sh.layout;
                        let rank = self.ep.rank();
                        let seat = CobatchSeat {
                            server: layout.server_of_rank(rank),
                            device: layout.device_of_rank(rank),
                            devices: layout.devices(),
                        };
                        let (loss, dz, dg) =
                            cobatch_loss(&mut self.ep, batches, seat, (ids, &mine), decoder, e)?;
                        (loss, dz, dg, targets)
                    }
                    StepPairs::Ranks(batches) => {
                        let (loss, dz, dg) = batches
                            .get(self.ep.rank())
                            .context("internal: a link step without this rank's pairs")?
                            .loss((ids, &mine), decoder, targets)?;
                        (loss, dz, dg, targets)
                    }
                    // The exact modes: every supervision edge, over the whole matrix.
                    StepPairs::None => {
                        let link = task.loss(
                            &mut self.ep,
                            sh.new_to_old,
                            (ids, &mine),
                            decoder,
                            (sh.opts.seed, epoch),
                        )?;
                        (link.loss_sum, link.grad, link.decoder_grad, link.pairs)
                    }
                };
                // Each rank scored other pairs: the decoder's gradient is their sum.
                if !decoder_grad.is_empty() {
                    self.ep
                        .all_reduce_sum(
                            &mut decoder_grad,
                            Tag::other(e, crate::link_task::DECODER_LAYER),
                        )
                        .context("the link decoder's gradient all-reduce")?;
                }
                let decoder = self
                    .decoder
                    .as_mut()
                    .context("internal: link prediction without a decoder")?;
                // Not clipped, as in mode single.
                decoder.adam_step(&decoder_grad, &sh.opts.adam(step, 1.0));
                b.upload_into(&mut grad, 0, &dz)?;
                (loss_sum, pairs)
            }
        };
        self.backward(e, train, &logits, tape, grad)?;
        drop(logits);
        // The epoch's loss in two f32 halves, so that the all-reduced sum keeps ~f64 precision.
        let mut epoch_loss = earlier_loss
            .map(|earlier| {
                let local = earlier + loss_sum;
                let hi = local as f32;
                b.upload(&[hi, (local - hi as f64) as f32])
            })
            .transpose()?;
        // Weight gradients (and the epoch's loss): one fused buffer, hierarchical
        // bit-identical all-reduce.
        let mut grads: Vec<_> = self
            .model
            .params
            .iter_mut()
            .map(|p| {
                let n = p.len();
                (&mut p.grad, n)
            })
            .chain(epoch_loss.as_mut().map(|buf| (buf, 2)))
            .collect();
        self.links
            .all_reduce_sum(b, &mut self.ep, &mut grads, Tag::all_reduce(e, 0))
            .context("weight-gradient all-reduce")?;
        drop(grads);
        let epoch_loss = match epoch_loss {
            Some(buf) => {
                let mut sum = [0f32; 2];
                b.download(&buf, 0, &mut sum)?;
                Some(sum[0] as f64 + sum[1] as f64)
            }
            None => None,
        };
        // Every rank now holds the global gradient, so clipping and Adam need no more traffic
        // and the weights stay identical on all ranks.
        let grad_scale = self.model.clip_factor(b, sh.opts.grad_clip)?;
        self.model.adam_step(b, &sh.opts.adam(step, grad_scale))?;
        Ok(StepLoss {
            local: loss_sum,
            targets,
            epoch: epoch_loss,
        })
    }

    /// Evaluation forward (dropout off) on the current plans: scores the inner rows.
    fn evaluate_plans(&mut self, epoch: usize, score: &mut Score<'_>) -> anyhow::Result<()> {
        let (out, _) = self.forward(epoch as u32 | EVAL_EPOCH_BIT, None, false)?;
        let last = self.plan(self.rt.layers.len() - 1).clone();
        let mut host = vec![0f32; last.n_inner * self.sh.config.classes];
        self.b.download(&out, 0, &mut host)?;
        score.rows(last.global_ids[..last.n_inner].iter().copied(), &host);
        Ok(())
    }

    /// Evaluates the model as it stands (dropout off, exact): accuracy over every labelled
    /// vertex of the graph and, when asked, the logits of this rank's vertices. Runs on what
    /// [`Shared::eval`] says.
    fn evaluate(&mut self, epoch: usize, with_logits: bool) -> anyhow::Result<EvalOut> {
        let sh = self.sh;
        if let Some(task) = &sh.link {
            return self.evaluate_link(epoch, with_logits, task);
        }
        let mut score = Score::new(sh, with_logits);
        match sh.eval {
            EvalOn::TrainingPlans => self.evaluate_plans(epoch, &mut score)?,
            EvalOn::Plans(plans) => {
                let tag = Tag::fetch(epoch as u32 | EVAL_EPOCH_BIT);
                let eval_rt = Rt::build(sh, self.b, plans, &mut self.ep, (tag, None))?;
                let train_rt = std::mem::replace(&mut self.rt, eval_rt);
                let out = self.evaluate_plans(epoch, &mut score);
                self.rt = train_rt;
                out?;
            }
            EvalOn::Layerwise(inputs) => {
                // The rows come in this rank's vertex order, in blocks.
                let own = sh.layout.range(self.ep.rank());
                let mut next = own.start;
                let c = sh.config.classes;
                let mut rows = |host: &[f32]| -> std::io::Result<()> {
                    let n = (host.len() / c.max(1)) as u32;
                    score.rows(next..next + n, host);
                    next += n;
                    Ok(())
                };
                crate::infer::forward_rank(
                    self.b,
                    (&self.model, self.embeddings.as_ref()),
                    &mut self.ep,
                    inputs,
                    epoch as u32 | EVAL_EPOCH_BIT,
                    &mut rows,
                )
                .context("the layer-wise evaluation")?;
                if next != own.end {
                    bail!(
                        "internal: the layer-wise evaluation scored vertices {:?} of rank {}'s {:?}",
                        own.start..next,
                        self.ep.rank(),
                        own
                    );
                }
            }
        }
        let Score {
            correct, logits, ..
        } = score;
        let mut counts = correct.to_vec();
        self.ep
            .all_reduce_sum(&mut counts, Tag::other(epoch as u32 | EVAL_EPOCH_BIT, 0))
            .context("accuracy all-reduce")?;
        let totals = self.sh.totals;
        let acc = |j: usize| {
            if totals[j] == 0 {
                f64::NAN
            } else {
                counts[j] as f64 / totals[j] as f64
            }
        };
        Ok(EvalOut {
            acc: [acc(0), acc(1), acc(2)],
            logits,
            link: None,
        })
    }

    /// [`Self::evaluate`] for link prediction: the validation and test scores of the
    /// embeddings of the training plans (the exact modes' whole graph) and, when asked, this
    /// rank's embeddings; no accuracies.
    fn evaluate_link(
        &mut self,
        epoch: usize,
        with_logits: bool,
        task: &LinkTask<'_>,
    ) -> anyhow::Result<EvalOut> {
        let sh = self.sh;
        let tag_epoch = epoch as u32 | EVAL_EPOCH_BIT;
        let d = sh.config.classes;
        // This rank's vertices' embeddings: off the training plans (fb, flx: the whole graph),
        // or one exact layer-wise pass (mb trains on batches).
        let (ids, host): (Vec<u32>, Vec<f32>) = match sh.eval {
            EvalOn::TrainingPlans => {
                let (out, _) = self.forward(tag_epoch, None, false)?;
                let last = self.plan(self.rt.layers.len() - 1).clone();
                let mut host = vec![0f32; last.n_inner * d];
                self.b.download(&out, 0, &mut host)?;
                (last.global_ids[..last.n_inner].to_vec(), host)
            }
            EvalOn::Layerwise(inputs) => {
                let own = sh.layout.range(self.ep.rank());
                let mut host = Vec::with_capacity(own.len() * d);
                crate::infer::forward_rank(
                    self.b,
                    (&self.model, self.embeddings.as_ref()),
                    &mut self.ep,
                    inputs,
                    tag_epoch,
                    &mut |rows: &[f32]| -> std::io::Result<()> {
                        host.extend_from_slice(rows);
                        Ok(())
                    },
                )
                .context("the layer-wise evaluation")?;
                if host.len() != own.len() * d {
                    bail!(
                        "internal: the layer-wise evaluation gave {} values for rank {}'s {} \
                         vertices of {d}",
                        host.len(),
                        self.ep.rank(),
                        own.len()
                    );
                }
                (own.collect(), host)
            }
            EvalOn::Plans(_) => {
                bail!("internal: link prediction evaluates on training plans or layer-wise")
            }
        };
        let ids = &ids[..];
        let decoder = self
            .decoder
            .as_ref()
            .context("internal: link prediction without a decoder")?;
        let summary = task.scores(
            &mut self.ep,
            sh.new_to_old,
            (ids, &host),
            decoder,
            tag_epoch,
        )?;
        let logits = if with_logits {
            ids.iter()
                .zip(host.chunks_exact(d.max(1)))
                .map(|(&g, row)| (sh.new_to_old[g as usize], row.to_vec()))
                .collect()
        } else {
            Vec::new()
        };
        Ok(EvalOut {
            acc: [f64::NAN; 3],
            logits,
            link: Some(summary),
        })
    }

    /// Asks for this rank's feature rows of step `index` of `feed` to be read ahead, while
    /// it computes the step it holds, if that step is built already (and its producer did
    /// not read them already).
    fn prefetch(&self, feed: &Feed, index: u64) {
        let rank = self.ep.rank();
        if let (Some(prefetcher), Some(step)) = (self.sh.prefetch, feed.peek(index)) {
            if !step.is_prepared(rank) {
                prefetcher.request(step.plans.clone(), rank);
            }
        }
    }

    /// Switches to the plans of `step`, step `index` of the run, in training epoch `epoch`.
    fn switch_to(&mut self, step: Arc<Step>, index: u64, epoch: usize) -> anyhow::Result<()> {
        if Arc::ptr_eq(&step, &self.step) {
            return Ok(());
        }
        let columns = self.remote_columns.take();
        let loaded = self.load(step, index, epoch as u32, columns.as_deref());
        self.remote_columns = columns;
        loaded
    }

    /// Builds the runtime of `step` (its feature fetch tagged with `epoch`, only `columns` of
    /// rows from other servers when given), freeing the current step's buffers first so a
    /// rank never holds two steps at once.
    fn load(
        &mut self,
        step: Arc<Step>,
        index: u64,
        epoch: u32,
        columns: Option<&[u32]>,
    ) -> anyhow::Result<()> {
        let b = self.b;
        self.rt.plans.clear();
        self.rt.blocks.clear();
        self.rt.layers.clear();
        self.rt.features = b.alloc(0)?;
        if let Some(host) = self.rt.host_features.take() {
            self.sh.buffers.put(host);
        }
        self.rt.loss_rows = b.upload_index(&[])?;
        self.rt.loss_labels = b.upload_index(&[])?;
        let next = self.sh.feed.peek_plans(index + 1);
        let ahead = Ahead {
            state: &mut self.asks_ahead,
            index,
            next: next.as_deref().map(|s| s.plans.as_slice()),
            answerer: self.sh.answerer,
        };
        self.rt = Rt::load(
            self.sh,
            b,
            &step,
            &mut self.ep,
            (Tag::fetch(epoch), columns),
            ahead,
        )?;
        self.step = step;
        Ok(())
    }

    pub fn run(
        mut self,
        meter: &Meter,
        on_epoch: Option<&EpochCallback<'_>>,
    ) -> anyhow::Result<RankResult> {
        let sh = self.sh;
        let rank = self.ep.rank();
        let setup_bytes = meter.live();
        let mut train_peak = meter.peak();
        let mut epochs = Vec::new();
        let mut epoch_times = Vec::new();
        let first = sh.first_step();
        let mut index = first;
        let mut last_eval = None;
        for epoch in sh.epochs_done() + 1..=sh.opts.epochs {
            let start = Instant::now();
            if let (Some(fraction), true) = (sh.remote_features, epoch > 1) {
                // Every rank ranks the same (all-reduced) weights: the same columns.
                let importance = self.model.input_importance(self.b)?;
                self.remote_columns = Some(top_columns(&importance, fraction));
            }
            let mut times = EpochTimes::default();
            let mut local = 0f64;
            let mut targets = 0usize;
            let mut summed = None;
            let mut logged = Instant::now();
            for it in 0..sh.iterations {
                // An epoch of a big graph is many minutes of steps: show life between the
                // per-epoch lines (global rank 0 only, at most one line per interval).
                if rank == 0 && it > 0 && logged.elapsed() >= STEP_LOG_INTERVAL {
                    logged = Instant::now();
                    tracing::info!(
                        "epoch {epoch}: step {it}/{} after {:.0}s",
                        sh.iterations,
                        start.elapsed().as_secs_f64()
                    );
                }
                if index > first {
                    let waiting = Instant::now();
                    let step = sh.feed.take(index)?;
                    let loading = Instant::now();
                    self.switch_to(step, index, epoch)?;
                    times.plan_wait_s += (loading - waiting).as_secs_f64();
                    times.plan_load_s += loading.elapsed().as_secs_f64();
                }
                index += 1;
                self.prefetch(sh.feed, index);
                let last = it + 1 == sh.iterations;
                let step =
                    self.train_step(epoch, index, self.step.targets, last.then_some(local))?;
                local += step.local;
                targets += step.targets;
                summed = step.epoch;
            }
            let seconds = start.elapsed().as_secs_f64();
            times.wall_s = seconds;
            let summed = summed.context("internal: an epoch without steps")?;
            let loss = summed / targets.max(1) as f64;
            grandis_trainer::check_loss(loss, epoch)?;
            train_peak = train_peak.max(meter.peak());
            let (train_acc, val_acc, val_auc) = if sh.opts.eval.after(epoch, sh.opts.epochs) {
                // The last epoch's evaluation is the final one (logits included).
                let last = epoch == sh.opts.epochs;
                let ev = self.evaluate(epoch, last && sh.collect_logits)?;
                let val_auc = ev.link.as_ref().map_or(f64::NAN, |l| l.val.auc);
                let scores = (ev.acc[0], ev.acc[1], val_auc);
                last_eval = last.then_some(ev);
                scores
            } else {
                (f64::NAN, f64::NAN, f64::NAN)
            };
            meter.reset_peak();
            let stats = EpochStats {
                epoch,
                loss,
                train_acc,
                val_acc,
                val_auc,
                seconds,
            };
            let saving = sh.checkpoint.due(epoch, sh.opts.epochs) && sh.checkpoint.path.is_some();
            // Every rank's rows of the embeddings go to rank 0 for the checkpoint.
            let table = match (&self.embeddings, saving) {
                (Some(shard), true) => {
                    shard.gather(&mut self.ep, sh.layout, sh.new_to_old, epoch as u32)?
                }
                _ => None,
            };
            if rank == 0 && saving {
                if let Some(path) = &sh.checkpoint.path {
                    // Weights and moments are identical on every rank after the all-reduce,
                    // so one rank's copy is the whole model (written atomically).
                    let learnt = grandis_trainer::Learnt {
                        embeddings: table.as_ref(),
                        decoder: self.decoder.as_ref(),
                    };
                    grandis_trainer::save_checkpoint_with(
                        path,
                        self.b,
                        &self.model,
                        learnt,
                        Some(sh.opts),
                        epoch,
                        true,
                    )
                    .with_context(|| format!("writing checkpoint {}", path.display()))?;
                }
            }
            if let Some(cb) = on_epoch {
                let mut cb = cb
                    .lock()
                    .map_err(|_| anyhow::anyhow!("epoch callback poisoned"))?;
                (*cb)(&stats);
            }
            epochs.push(stats);
            epoch_times.push(times);
        }
        let peak_bytes = train_peak.max(meter.peak());
        let ev = match last_eval {
            Some(ev) => ev,
            None if sh.opts.eval.at_end() => {
                self.evaluate(sh.opts.epochs + 1, sh.collect_logits)?
            }
            None => EvalOut {
                acc: [f64::NAN; 3],
                logits: Vec::new(),
                link: None,
            },
        };
        let num_parameters = self.model.num_parameters();
        let stale_counts = self.stale.as_ref().map(|s| s.counts).unwrap_or_default();
        let cluster_counts = match sh.server_counts {
            Some(counts) => Some(add_up_servers(&mut self.ep, counts.sums())?),
            None => None,
        };
        let (inference, counters) = match &sh.infer {
            Some(infer) => {
                // The training step's buffers go first: inference sizes its blocks to the
                // budget the training used.
                let Worker {
                    b,
                    mut ep,
                    model,
                    rt,
                    step,
                    embeddings,
                    ..
                } = self;
                drop((rt, step));
                let inference =
                    crate::infer::infer_rank(b, &model, &mut ep, infer, embeddings.as_ref())
                        .context("layer-wise inference after training")?;
                // Its traffic too (under its own epoch): the wire carried it.
                (Some(inference), ep.counters())
            }
            None => (None, self.ep.counters()),
        };
        Ok(RankResult {
            rank,
            epochs,
            final_acc: ev.acc,
            link: ev.link,
            num_parameters,
            logits: ev.logits,
            counters,
            epoch_times,
            peak_bytes,
            setup_bytes,
            inference,
            stale: stale_counts,
            cluster_counts,
        })
    }

    /// One forward pass (dropout off) on the first step's plans: every conv layer's output
    /// and the final output of this rank's inner rows, with their original ids.
    pub fn embed(mut self) -> anyhow::Result<Embedded> {
        self.capture = Some(Vec::new());
        let (logits, _) = self.forward(EVAL_EPOCH_BIT, None, false)?;
        let last = self.plan(self.rt.layers.len() - 1).clone();
        let c = self.sh.config.classes;
        let mut out = vec![0f32; last.n_inner * c];
        self.b.download(&logits, 0, &mut out)?;
        let ids = last.global_ids[..last.n_inner]
            .iter()
            .map(|&g| self.sh.new_to_old[g as usize])
            .collect();
        Ok(Embedded {
            ids,
            layers: self.capture.take().unwrap_or_default(),
            logits: out,
        })
    }
}

/// What [`Worker::embed`] returns for one rank.
pub(crate) struct Embedded {
    /// Original ids of the inner rows.
    pub ids: Vec<u32>,
    /// Per conv layer, `ids.len() x width` outputs.
    pub layers: Vec<Vec<f32>>,
    /// `ids.len() x classes`.
    pub logits: Vec<f32>,
}

/// One evaluation's tally on a rank: correct train / val / test predictions among the rows
/// scored and, when asked, their logits by original id.
struct Score<'s> {
    sh: &'s Shared<'s>,
    correct: [f32; 3],
    with_logits: bool,
    logits: Vec<(u32, Vec<f32>)>,
}

impl<'s> Score<'s> {
    fn new(sh: &'s Shared<'s>, with_logits: bool) -> Self {
        Score {
            sh,
            correct: [0.0; 3],
            with_logits,
            logits: Vec::new(),
        }
    }

    /// Scores the logits `host` (one row of `classes` per id) of the vertices `ids` (new ids).
    fn rows(&mut self, ids: impl IntoIterator<Item = u32>, host: &[f32]) {
        let sh = self.sh;
        let c = sh.config.classes;
        for (g, row) in ids.into_iter().zip(host.chunks_exact(c.max(1))) {
            let o = sh.new_to_old[g as usize];
            let flags = sh.labelled_flags[g as usize];
            if flags != 0 && grandis_trainer::argmax(row) as i32 == sh.view.labels[o as usize] {
                for (j, bit) in [SPLIT_TRAIN, SPLIT_VAL, SPLIT_TEST].into_iter().enumerate() {
                    if flags & bit != 0 {
                        self.correct[j] += 1.0;
                    }
                }
            }
            if self.with_logits {
                self.logits.push((o, row.to_vec()));
            }
        }
    }
}

struct EvalOut {
    /// Global train / val / test accuracies (after the all-reduce).
    acc: [f64; 3],
    logits: Vec<(u32, Vec<f32>)>,
    /// Link prediction's validation and test scores (the same on every rank).
    link: Option<LinkSummary>,
}

/// Every server's step counts added up ([`RunStats::merge_servers`]) from `mine`, this
/// server's: each server's first device broadcasts its server's counts to every rank (one
/// broadcast per server, all ranks taking part). Called once by every rank after the last
/// epoch, when every step's counts are in (a step's are recorded before any rank takes it).
fn add_up_servers(ep: &mut Endpoint, mine: RunStats) -> anyhow::Result<RunStats> {
    let topology = ep.topology();
    let mine = serde_json::to_vec(&mine).context("encoding this server's step counts")?;
    let mut servers = Vec::with_capacity(topology.servers);
    for s in 0..topology.servers {
        let root = topology.head_of(s);
        let data = if ep.rank() == root {
            mine.clone()
        } else {
            Vec::new()
        };
        let got = ep
            .broadcast_bytes(data, root, Tag::other(COUNTS_EPOCH, s as u32))
            .with_context(|| format!("adding up the servers' step counts (server {s})"))?;
        let counts: RunStats = serde_json::from_slice(&got)
            .with_context(|| format!("server {s}'s step counts are not readable"))?;
        servers.push(counts);
    }
    Ok(RunStats::merge_servers(&servers))
}
