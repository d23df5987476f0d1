//! One rank's training loop: forward with per-layer halo exchanges (and FLX masks), loss on its
//! inner train rows, backward with halo-gradient exchanges, hierarchical all-reduce of the
//! weight gradients, Adam. Every step returns errors (never panics) so a failing rank drops its
//! endpoint and the fabric wakes its peers with `PeerGone` instead of letting them hang.

use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context};
use grandis_engine::norm::GlobalScales;
use grandis_engine::{AdamStep, Backend, BlockGraph};
use grandis_fabric::{Endpoint, Tag};
use grandis_masking::{DevicePlan, PreloadPlan, SPLIT_TEST, SPLIT_TRAIN, SPLIT_VAL};
use grandis_models::{Model, ModelConfig, ModelKind, StageCache, StageCtx};
use grandis_store::DatasetView;
use grandis_trainer::{EpochStats, TrainOptions};

use crate::metered::Meter;

/// Tags of evaluation traffic carry this bit in their epoch, so evaluation never mixes with
/// the training bytes and seconds of the same epoch in the fabric counters.
pub const EVAL_EPOCH_BIT: u32 = 1 << 31;

/// Read-only state shared by all ranks.
pub(crate) struct Shared<'a> {
    pub view: DatasetView<'a>,
    pub new_to_old: &'a [u32],
    pub plan: &'a PreloadPlan,
    pub scales: &'a GlobalScales,
    pub config: &'a ModelConfig,
    pub opts: &'a TrainOptions,
    /// `SPLIT_*` flags by NEW id, only for vertices with a valid label.
    pub labelled_flags: &'a [u8],
    /// Labelled train / val / test vertices in the whole graph.
    pub totals: [usize; 3],
    pub eval_every_epoch: bool,
    pub collect_logits: bool,
    /// Scale each feature row to sum 1, exactly as the single-process trainer does.
    pub row_normalize: bool,
}

/// The per-epoch callback; only rank 0 calls it.
pub(crate) type EpochCallback<'c> = Mutex<&'c mut (dyn FnMut(&EpochStats) + Send)>;

/// What one rank hands back.
pub(crate) struct RankResult {
    pub rank: usize,
    pub epochs: Vec<EpochStats>,
    /// Train / val / test accuracy after the last epoch.
    pub final_acc: [f64; 3],
    pub num_parameters: usize,
    /// (original id, logits row) of every inner vertex, when asked for.
    pub logits: Vec<(u32, Vec<f32>)>,
    pub counters: grandis_fabric::Counters,
    /// Train-step wall seconds per epoch.
    pub step_seconds: Vec<f64>,
    pub peak_bytes: u64,
    /// Live bytes after setup (features, graphs, parameters) before the first epoch.
    pub setup_bytes: u64,
}

/// Per distinct plan (FLX and/or FB): its uploaded graph block and dropout ids.
struct PlanRt<'p, B: Backend> {
    plan: &'p DevicePlan,
    graph: B::Graph,
    /// Original ids of the `n_local` rows (dropout masks key on them).
    ids: B::Index,
}

/// Per conv layer: which plan, and the send index buffers of its exchange prefixes.
struct LayerRt<B: Backend> {
    plan: usize,
    /// Per send list of the plan: the rows sent before this layer (None when empty).
    send_idx: Vec<Option<B::Index>>,
    /// Number of valid owned rows when the layer is masked.
    valid: Option<usize>,
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
    model: Model<B>,
    plans: Vec<PlanRt<'w, B>>,
    layers: Vec<LayerRt<B>>,
    /// `n_local(layer-0 plan) x F`: owned rows loaded once, halo rows filled by exchange
    /// (sage/gcn), or just the owned rows' input of the encoder (ressage).
    features: B::Buf,
    /// Stage index of conv layer 0 (1 for ressage: the encoder comes first).
    first_conv: usize,
    has_head: bool,
    loss_rows: B::Index,
    loss_labels: B::Index,
}

fn ctx<'x, B: Backend>(p: &'x PlanRt<'x, B>, train: Option<(u64, u64)>) -> StageCtx<'x, B> {
    StageCtx {
        graph: &p.graph,
        n_dst: p.plan.n_owned,
        n_src: p.plan.n_local(),
        global_ids: &p.ids,
        train,
    }
}

/// The plan's one-hop graph as an engine block with GLOBAL normalisation picked by new id.
fn block(plan: &DevicePlan, scales: &GlobalScales) -> BlockGraph {
    let pick = |s: &Vec<f32>, ids: &[u32]| ids.iter().map(|&g| s[g as usize]).collect();
    let owned = &plan.global_ids[..plan.n_owned];
    BlockGraph {
        n_dst: plan.n_owned,
        n_src: plan.n_local(),
        offsets: plan.graph.offsets.clone(),
        indices: plan.graph.indices.clone(),
        dst_scale: pick(&scales.dst, owned),
        src_scale: scales.src.as_ref().map(|s| pick(s, &plan.global_ids)),
        self_scale: scales.self_loop.as_ref().map(|s| pick(s, owned)),
    }
}

impl<'w, B: Backend> Worker<'w, B> {
    pub fn new(sh: &'w Shared<'w>, b: &'w B, ep: Endpoint) -> anyhow::Result<Self> {
        let rank = ep.rank();
        let pre = sh.plan;
        let model = Model::new(b, sh.config.clone())?;
        let first_conv = usize::from(sh.config.kind == ModelKind::ResSage);
        let has_head = sh.config.kind == ModelKind::ResSage;
        if (0..model.num_stages()).any(|s| {
            let conv = s >= first_conv && s < first_conv + pre.layers;
            conv != model.stage_reads_neighbors(s)
        }) {
            bail!(
                "model {} does not have the stage layout the parallel runner expects",
                sh.config.kind.name()
            );
        }
        // One runtime per distinct plan: FLX (layers < k) and FB (layers >= k).
        let mut plans: Vec<PlanRt<'w, B>> = Vec::new();
        let mut plan_of_layer = Vec::with_capacity(pre.layers);
        for l in 0..pre.layers {
            let p = pre.device_plan(l, rank);
            let idx = match plans.iter().position(|r| std::ptr::eq(r.plan, p)) {
                Some(i) => i,
                None => {
                    let graph = b.upload_graph(&block(p, sh.scales))?;
                    let orig: Vec<u32> = p
                        .global_ids
                        .iter()
                        .map(|&g| sh.new_to_old[g as usize])
                        .collect();
                    plans.push(PlanRt {
                        plan: p,
                        graph,
                        ids: b.upload_index(&orig)?,
                    });
                    plans.len() - 1
                }
            };
            plan_of_layer.push(idx);
        }
        let mut layers = Vec::with_capacity(pre.layers);
        for (l, &pi) in plan_of_layer.iter().enumerate() {
            let p = plans[pi].plan;
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
                send_idx,
                valid: p.is_masked(l).then(|| p.valid_owned(l).end as usize),
            });
        }
        // Features of the owned rows of the layer-0 plan (halo rows arrive by exchange).
        let p0 = plans[layers[0].plan].plan;
        let f = sh.view.feature_dim;
        let rows = if has_head { p0.n_owned } else { p0.n_local() };
        let mut host = vec![0f32; rows * f];
        for (i, &g) in p0.global_ids[..p0.n_owned].iter().enumerate() {
            let o = sh.new_to_old[g as usize];
            let row = &mut host[i * f..(i + 1) * f];
            row.copy_from_slice(sh.view.feature_row(o));
            if sh.row_normalize {
                // Same arithmetic as the trainer (f64 sum, f32 inverse), so bit-identical.
                let sum: f64 = row.iter().map(|&v| v as f64).sum();
                if sum != 0.0 {
                    let inv = (1.0 / sum) as f32;
                    row.iter_mut().for_each(|v| *v *= inv);
                }
            }
        }
        let features = b.upload(&host)?;
        drop(host);
        // Loss rows: inner rows of the last layer's plan that are labelled train vertices.
        let last = plans[layers[pre.layers - 1].plan].plan;
        let (mut rows, mut labels) = (Vec::new(), Vec::new());
        for i in 0..last.n_inner {
            let g = last.global_ids[i] as usize;
            if sh.labelled_flags[g] & SPLIT_TRAIN != 0 {
                rows.push(i as u32);
                labels.push(sh.view.labels[sh.new_to_old[g] as usize] as u32);
            }
        }
        Ok(Worker {
            sh,
            b,
            ep,
            model,
            plans,
            layers,
            features,
            first_conv,
            has_head,
            loss_rows: b.upload_index(&rows)?,
            loss_labels: b.upload_index(&labels)?,
        })
    }

    fn plan(&self, l: usize) -> &PlanRt<'w, B> {
        &self.plans[self.layers[l].plan]
    }

    fn zero_rows(&self, buf: &mut B::Buf, from: usize, to: usize, d: usize) -> anyhow::Result<()> {
        if to > from {
            self.b
                .upload_into(buf, from * d, &vec![0.0; (to - from) * d])?;
        }
        Ok(())
    }

    /// Sends the owned rows peers need for layer `l` (gathered from `src`) and writes the
    /// received halo rows into `inp` (`n_local x d`).
    fn exchange_forward(
        &mut self,
        l: usize,
        src: Option<&B::Buf>,
        d: usize,
        tag: Tag,
    ) -> anyhow::Result<Vec<(std::ops::Range<u32>, Vec<f32>)>> {
        let b = self.b;
        let lr = &self.layers[l];
        let plan = self.plans[lr.plan].plan;
        let src = src.unwrap_or(&self.features);
        let mut sends = Vec::new();
        for (i, s) in plan.sends.iter().enumerate() {
            if let Some(idx) = &lr.send_idx[i] {
                let n = b.index_len(idx);
                let mut packed = b.alloc(n * d)?;
                b.gather_rows(src, d, idx, &mut packed)?;
                let mut host = vec![0f32; n * d];
                b.download(&packed, 0, &mut host)?;
                sends.push((s.peer, host));
            }
        }
        let mut expect = Vec::new();
        let mut ranges = Vec::new();
        for (gi, g) in plan.halo.iter().enumerate() {
            let r = plan.recv_rows(l, gi);
            if !r.is_empty() {
                expect.push((g.peer, r.len() * d));
                ranges.push(r);
            }
        }
        let got = self
            .ep
            .exchange_sized(sends, &expect, tag)
            .with_context(|| format!("forward halo exchange of layer {l}"))?;
        Ok(ranges
            .into_iter()
            .zip(got)
            .map(|(r, (_, data))| (r, data))
            .collect())
    }

    /// Sends the gradients of the halo rows of `gx` back to their owners and adds the
    /// gradients received for this rank's owned rows into `gx`.
    fn exchange_backward(
        &mut self,
        l: usize,
        gx: &mut B::Buf,
        d: usize,
        tag: Tag,
    ) -> anyhow::Result<()> {
        let b = self.b;
        let lr = &self.layers[l];
        let plan = self.plans[lr.plan].plan;
        let mut sends = Vec::new();
        for (gi, g) in plan.halo.iter().enumerate() {
            let r = plan.recv_rows(l, gi);
            if !r.is_empty() {
                let mut host = vec![0f32; r.len() * d];
                b.download(gx, r.start as usize * d, &mut host)?;
                sends.push((g.peer, host));
            }
        }
        let mut expect = Vec::new();
        let mut lists = Vec::new();
        for (i, s) in plan.sends.iter().enumerate() {
            if let Some(idx) = &lr.send_idx[i] {
                expect.push((s.peer, b.index_len(idx) * d));
                lists.push(i);
            }
        }
        let got = self
            .ep
            .exchange_sized(sends, &expect, tag)
            .with_context(|| format!("backward halo exchange of layer {l}"))?;
        let lr = &self.layers[l];
        for (i, (_, data)) in lists.into_iter().zip(got) {
            let idx = lr.send_idx[i].as_ref().context("send index")?;
            let tmp = b.upload(&data)?;
            b.scatter_add_rows(&tmp, d, idx, gx)?;
        }
        Ok(())
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
        let n_layers = self.layers.len();
        let mut tape = Tape {
            encoder: None,
            layers: Vec::with_capacity(n_layers),
            head: None,
        };
        let mut act: Option<B::Buf> = None;
        if self.has_head {
            let p = self.plan(0);
            let c = StageCtx {
                n_src: p.plan.n_owned,
                ..ctx(p, train)
            };
            let (y, cache) = self.model.forward_stage(b, 0, &c, &self.features)?;
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
                    let got = self.exchange_forward(l, None, d_in, tag)?;
                    for (r, data) in got {
                        b.upload_into(&mut self.features, r.start as usize * d_in, &data)?;
                    }
                    None
                }
                Some(prev) => {
                    let p = self.plan(l).plan;
                    let mut inp = b.alloc(p.n_local() * d_in)?;
                    b.copy(&prev, &mut inp, p.n_owned * d_in)?;
                    drop(prev);
                    let got = self.exchange_forward(l, Some(&inp), d_in, tag)?;
                    for (r, data) in got {
                        b.upload_into(&mut inp, r.start as usize * d_in, &data)?;
                    }
                    Some(inp)
                }
            };
            let p = self.plan(l);
            let (mut out, cache) = self.model.forward_stage(
                b,
                s,
                &ctx(p, train),
                input.as_ref().unwrap_or(&self.features),
            )?;
            if let Some(valid) = self.layers[l].valid {
                // One-hop graph masking: rows not exact at this layer are zero-filled.
                self.zero_rows(&mut out, valid, p.plan.n_owned, d_out)?;
            }
            let last = l + 1 == n_layers;
            // The output must outlive this layer where the next input cannot stand in for it:
            // at the reshape (fewer rows next) and before the ResSAGE+ head.
            let keep_output = if last {
                self.has_head
            } else {
                self.layers[l + 1].plan != self.layers[l].plan
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
            let p = self.plan(n_layers - 1);
            let (y, cache) = self.model.forward_stage(b, s, &ctx(p, train), &logits)?;
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
        let n_layers = self.layers.len();
        let mut g = grad_logits;
        if self.has_head {
            let s = self.first_conv + n_layers;
            let p = &self.plans[self.layers[n_layers - 1].plan];
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
            let (d_in, d_out) = self.model.stage_dims(s);
            let pr = &self.plans[self.layers[l].plan];
            let n_owned = pr.plan.n_owned;
            if let Some(valid) = self.layers[l].valid {
                self.zero_rows(&mut g, valid, n_owned, d_out)?;
            }
            let cache = tape.layers[l].cache.take().context("layer cache")?;
            let need_input_grad = l > 0 || self.has_head;
            let gx = {
                let (head, tail) = tape.layers.split_at_mut(l + 1);
                let me = &head[l];
                let input = me.input.as_ref().unwrap_or(&self.features);
                let output = match (&me.output, tail.first()) {
                    (Some(o), _) => o,
                    (None, Some(next)) => next.input.as_ref().context("next layer input")?,
                    (None, None) => logits,
                };
                self.model.backward_stage(
                    b,
                    s,
                    &ctx(pr, train),
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
            self.exchange_backward(l, &mut gx, d_in, Tag::backward(epoch, l as u32))?;
            if l > 0 {
                let prev_owned = self.plan(l - 1).plan.n_owned;
                if prev_owned > n_owned {
                    // Reshape: the FLX plan's owned block extends the FB one (identity prefix).
                    let mut gp = b.alloc(prev_owned * d_in)?;
                    b.copy(&gx, &mut gp, n_owned * d_in)?;
                    g = gp;
                } else {
                    g = gx;
                }
            } else {
                // ResSAGE+ encoder (row-local; its input gradient is not needed).
                let p = &self.plans[self.layers[0].plan];
                let c = StageCtx {
                    n_src: p.plan.n_owned,
                    ..ctx(p, train)
                };
                let cache = tape.encoder.take().context("encoder cache")?;
                self.model.backward_stage(
                    b,
                    0,
                    &c,
                    &self.features,
                    &self.features,
                    cache,
                    gx,
                    false,
                )?;
                break;
            }
        }
        Ok(())
    }

    /// One training step; returns this rank's loss sum (not normalised).
    fn train_step(&mut self, epoch: usize) -> anyhow::Result<f64> {
        let b = self.b;
        let sh = self.sh;
        let e = epoch as u32;
        let train = Some((sh.opts.seed, epoch as u64));
        self.model.zero_grads(b)?;
        let (logits, tape) = self.forward(e, train, true)?;
        let tape = tape.context("forward keeps a tape in training")?;
        let classes = sh.config.classes;
        let n = self.plan(self.layers.len() - 1).plan.n_owned;
        let mut grad = b.alloc(n * classes)?;
        let normalizer = sh.totals[0] as f32;
        let loss_sum = b.cross_entropy(
            &logits,
            n,
            classes,
            &self.loss_rows,
            &self.loss_labels,
            normalizer,
            &mut grad,
        )?;
        self.backward(e, train, &logits, tape, grad)?;
        drop(logits);
        // Weight gradients: one fused buffer, hierarchical bit-identical all-reduce.
        let total: usize = self.model.params.iter().map(|p| p.len()).sum();
        let mut flat = vec![0f32; total];
        let mut at = 0;
        for p in &self.model.params {
            b.download(&p.grad, 0, &mut flat[at..at + p.len()])?;
            at += p.len();
        }
        self.ep
            .all_reduce_sum(&mut flat, Tag::all_reduce(e, 0))
            .context("weight-gradient all-reduce")?;
        let mut at = 0;
        for p in &mut self.model.params {
            let n = p.len();
            b.upload_into(&mut p.grad, 0, &flat[at..at + n])?;
            at += n;
        }
        drop(flat);
        // Every rank now holds the global gradient, so clipping and Adam need no more traffic
        // and the weights stay identical on all ranks.
        let grad_scale = self.model.clip_factor(b, sh.opts.grad_clip)?;
        self.model.adam_step(
            b,
            &AdamStep {
                lr: sh.opts.lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: sh.opts.weight_decay,
                decoupled: sh.opts.adamw,
                step: epoch as u64,
                grad_scale,
            },
        )?;
        Ok(loss_sum)
    }

    /// Evaluation forward (dropout off): correct counts of train/val/test inner rows and, when
    /// asked, the logits of the inner rows.
    fn evaluate(&mut self, epoch: usize, with_logits: bool) -> anyhow::Result<EvalOut> {
        let b = self.b;
        let sh = self.sh;
        let (logits, _) = self.forward(epoch as u32 | EVAL_EPOCH_BIT, None, false)?;
        let last = self.plan(self.layers.len() - 1).plan;
        let c = sh.config.classes;
        let mut host = vec![0f32; last.n_inner * c];
        b.download(&logits, 0, &mut host)?;
        let mut correct = [0f32; 3];
        let mut rows = Vec::new();
        for i in 0..last.n_inner {
            let g = last.global_ids[i] as usize;
            let o = sh.new_to_old[g];
            let row = &host[i * c..(i + 1) * c];
            let flags = sh.labelled_flags[g];
            if flags != 0 {
                let hit = grandis_trainer::argmax(row) as i32 == sh.view.labels[o as usize];
                for (j, bit) in [SPLIT_TRAIN, SPLIT_VAL, SPLIT_TEST].into_iter().enumerate() {
                    if hit && flags & bit != 0 {
                        correct[j] += 1.0;
                    }
                }
            }
            if with_logits {
                rows.push((o, row.to_vec()));
            }
        }
        let mut counts = correct.to_vec();
        self.ep
            .all_reduce_sum(&mut counts, Tag::other(epoch as u32 | EVAL_EPOCH_BIT, 0))
            .context("accuracy all-reduce")?;
        let acc = |j: usize| {
            if sh.totals[j] == 0 {
                f64::NAN
            } else {
                counts[j] as f64 / sh.totals[j] as f64
            }
        };
        Ok(EvalOut {
            acc: [acc(0), acc(1), acc(2)],
            logits: rows,
        })
    }

    pub fn run(
        mut self,
        meter: &Meter,
        on_epoch: Option<&EpochCallback<'_>>,
    ) -> anyhow::Result<RankResult> {
        let sh = self.sh;
        let rank = self.ep.rank();
        let setup_bytes = meter.live();
        let mut epochs = Vec::new();
        let mut step_seconds = Vec::new();
        for epoch in 1..=sh.opts.epochs {
            let start = Instant::now();
            let local = self.train_step(epoch)?;
            let seconds = start.elapsed().as_secs_f64();
            // The loss in two f32 halves so the all-reduced sum keeps ~f64 precision.
            let hi = local as f32;
            let lo = (local - hi as f64) as f32;
            let mut buf = [hi, lo];
            self.ep
                .all_reduce_sum(&mut buf, Tag::other(epoch as u32, 0))
                .context("loss all-reduce")?;
            let loss = (buf[0] as f64 + buf[1] as f64) / sh.totals[0] as f64;
            if !loss.is_finite() {
                bail!("loss became {loss} at epoch {epoch}; try a lower --lr or --grad-clip");
            }
            let (train_acc, val_acc) = if sh.eval_every_epoch {
                let ev = self.evaluate(epoch, false)?;
                (ev.acc[0], ev.acc[1])
            } else {
                (f64::NAN, f64::NAN)
            };
            let stats = EpochStats {
                epoch,
                loss,
                train_acc,
                val_acc,
                seconds,
            };
            if let Some(cb) = on_epoch {
                let mut cb = cb
                    .lock()
                    .map_err(|_| anyhow::anyhow!("epoch callback poisoned"))?;
                (*cb)(&stats);
            }
            epochs.push(stats);
            step_seconds.push(seconds);
        }
        let peak_bytes = meter.peak();
        let ev = self.evaluate(sh.opts.epochs + 1, sh.collect_logits)?;
        Ok(RankResult {
            rank,
            epochs,
            final_acc: ev.acc,
            num_parameters: self.model.num_parameters(),
            logits: ev.logits,
            counters: self.ep.counters(),
            step_seconds,
            peak_bytes,
            setup_bytes,
        })
    }
}

struct EvalOut {
    acc: [f64; 3],
    logits: Vec<(u32, Vec<f32>)>,
}
