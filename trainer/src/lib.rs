//! The exact single-process full-batch trainer of grandis: builds a model from
//! `grandis-models` on any engine backend (the CPU one by default; [`train_on`] and
//! [`Prepared::with_backend`] take e.g. the CUDA backend), runs full-graph forward/backward every epoch (dropout
//! masks keyed by `(seed, epoch, stage, vertex, column)`, loss normalised by the number of
//! labelled train vertices), evaluates with dropout off, and saves/resumes safetensors
//! checkpoints that carry the model configuration, optimiser state and epoch count. It is the
//! reference every distributed mode must reproduce, so it is deterministic for a seed: two runs
//! with the same options produce bit-identical losses, and a resumed run continues exactly
//! like an uninterrupted one. [`layerwise`] predicts with a checkpoint on graphs larger than
//! memory, one stage at a time.

pub mod checkpoint;
pub mod decoder;
pub mod embedding;
pub mod layerwise;
pub mod link;

use anyhow::{bail, Context};
use grandis_engine::norm::full_block;
use grandis_engine::{AdamStep, Backend, CpuBackend};
use grandis_models::{Model, ModelConfig, ModelKind, RelationGraphs, StageCtx};
use grandis_store::{DatasetView, LinkSplitView};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;

pub use checkpoint::{load_checkpoint, save_checkpoint, save_checkpoint_with, Checkpoint, Learnt};
pub use decoder::{Decoder, LinkDecoder};
pub use embedding::NodeEmbeddings;

/// Objective, optimiser and schedule options (the model's shape lives in [`ModelConfig`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainOptions {
    /// What the model is trained for. Part of a checkpoint: a run resumes only the objective
    /// it was written with (absent in checkpoints older than link prediction: node).
    #[serde(default)]
    pub objective: Objective,
    pub epochs: usize,
    pub lr: f32,
    pub weight_decay: f32,
    /// AdamW (decoupled weight decay) instead of Adam with an L2 penalty.
    pub adamw: bool,
    /// Global-norm gradient clipping.
    pub grad_clip: Option<f32>,
    /// Seed of the dropout masks (the weight init uses `ModelConfig::seed`).
    pub seed: u64,
    /// When the run measures its accuracies (dropout off). Not part of the optimisation:
    /// a resumed run may change it.
    #[serde(default)]
    pub eval: EvalSchedule,
    /// Columns of learnable node embeddings after the features in the model's input
    /// ([`NodeEmbeddings`]); 0 = none (absent in older checkpoints).
    #[serde(default)]
    pub embedding_dim: usize,
}

/// When a run evaluates its model (dropout off): the per-epoch train / val accuracies and the
/// final train / val / test accuracies. Evaluation reads the graph that training samples from
/// in full (exact), which on a billion-edge graph costs far more than an epoch: such runs
/// evaluate rarely or never, and `grandis predict` scores the checkpoint layer-wise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvalSchedule {
    /// After every n-th epoch (n ≥ 1) and after the last one.
    Every(usize),
    /// After the last epoch only.
    End,
    /// Never: every accuracy is NaN (absent in JSON).
    Never,
}

impl Default for EvalSchedule {
    fn default() -> Self {
        EvalSchedule::Every(1)
    }
}

impl EvalSchedule {
    /// A job's `eval_every` (0: at the end only) and `evaluate` (false: never).
    pub fn for_job(eval_every: u32, evaluate: bool) -> EvalSchedule {
        match (evaluate, eval_every) {
            (false, _) => EvalSchedule::Never,
            (true, 0) => EvalSchedule::End,
            (true, n) => EvalSchedule::Every(n as usize),
        }
    }

    /// Whether the model is evaluated after `epoch` of `epochs` (1-based). The last epoch's
    /// evaluation is the final one: both come from one pass.
    pub fn after(self, epoch: usize, epochs: usize) -> bool {
        match self {
            EvalSchedule::Every(n) => epoch == epochs || (n > 0 && epoch.is_multiple_of(n)),
            EvalSchedule::End => epoch == epochs,
            EvalSchedule::Never => false,
        }
    }

    /// Whether the run ends with an evaluation.
    pub fn at_end(self) -> bool {
        self != EvalSchedule::Never
    }

    /// How many evaluation passes a run makes that trains epochs `done + 1..=epochs`: the
    /// epochs [`after`](Self::after) names (the last one's being the final), or the final
    /// alone when nothing is left to train.
    pub fn passes(self, done: usize, epochs: usize) -> usize {
        let trained = done + 1..=epochs;
        if trained.is_empty() {
            usize::from(self.at_end())
        } else {
            trained.filter(|&e| self.after(e, epochs)).count()
        }
    }
}

impl TrainOptions {
    /// The Adam update of optimiser step `step` (from 1) with these options, the gradient
    /// scaled by `grad_scale` (global-norm clipping's factor; 1 for what is not clipped).
    pub fn adam(&self, step: u64, grad_scale: f32) -> AdamStep {
        AdamStep {
            weight_decay: self.weight_decay,
            decoupled: self.adamw,
            grad_scale,
            ..AdamStep::new(self.lr, step)
        }
    }

    /// The optimiser options of a job.
    pub fn for_job(spec: &grandis_wire::JobSpec) -> TrainOptions {
        TrainOptions {
            objective: Objective::for_job(spec),
            epochs: spec.epochs as usize,
            lr: spec.lr as f32,
            weight_decay: spec.weight_decay as f32,
            adamw: spec.adamw,
            grad_clip: spec.grad_clip.map(|c| c as f32),
            seed: spec.seed,
            eval: EvalSchedule::for_job(spec.eval_every, spec.evaluate),
            embedding_dim: spec.embedding_dim as usize,
        }
    }
}

/// Where the trainer saves and resumes.
#[derive(Debug, Clone, Default)]
pub struct CheckpointOptions {
    pub path: Option<PathBuf>,
    /// Continue from `path` when it exists.
    pub resume: bool,
    /// Also write `path` after every N-th epoch (it is always written after the last one).
    pub every: Option<usize>,
}

impl CheckpointOptions {
    /// Whether the checkpoint is written after `epoch` of `epochs`.
    pub fn due(&self, epoch: usize, epochs: usize) -> bool {
        self.path.is_some()
            && (epoch == epochs || self.every.is_some_and(|n| n > 0 && epoch.is_multiple_of(n)))
    }

    /// The checkpoint to resume from: `None` without `resume`, or when `path` does not exist
    /// yet (a first run); an error when it exists but was written for another model or other
    /// training options (only `epochs` may change).
    pub fn resume_from(
        &self,
        config: &ModelConfig,
        opts: &TrainOptions,
    ) -> anyhow::Result<Option<Checkpoint>> {
        if !self.resume {
            return Ok(None);
        }
        let path = self
            .path
            .as_ref()
            .context("--resume needs --checkpoint PATH")?;
        if !path.exists() {
            tracing::warn!(
                "checkpoint {} does not exist yet; starting from scratch",
                path.display()
            );
            return Ok(None);
        }
        let ck = load_checkpoint(path)?;
        if ck.model != *config {
            bail!(
                "checkpoint {} was written for model {:?}, this run asks for {:?}",
                path.display(),
                ck.model,
                config
            );
        }
        let same = ck.train.as_ref().is_some_and(|t| {
            TrainOptions {
                epochs: opts.epochs,
                eval: opts.eval,
                ..t.clone()
            } == *opts
        });
        if !same {
            bail!(
                "checkpoint {} was written with training options {:?}, this run asks for {:?} \
                 (only --epochs may change on --resume)",
                path.display(),
                ck.train,
                opts
            );
        }
        tracing::info!(
            "resuming from {} after epoch {}",
            path.display(),
            ck.epochs_done
        );
        Ok(Some(ck))
    }
}

/// One epoch's report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochStats {
    /// 1-based.
    pub epoch: usize,
    pub loss: f64,
    /// NaN (absent in JSON) after an epoch the [`EvalSchedule`] does not evaluate.
    #[serde(with = "grandis_wire::nan")]
    pub train_acc: f64,
    #[serde(with = "grandis_wire::nan")]
    pub val_acc: f64,
    /// Link prediction: the validation AUC after this epoch (NaN, absent, otherwise).
    #[serde(default = "nan", with = "grandis_wire::nan")]
    pub val_auc: f64,
    /// Wall time of the training step (forward, backward, optimiser), without evaluation.
    pub seconds: f64,
}

fn nan() -> f64 {
    f64::NAN
}

/// An epoch's loss that is not a number ends the run, naming the usual remedies: every
/// trainer (single and distributed) checks it the same way.
pub fn check_loss(loss: f64, epoch: usize) -> anyhow::Result<()> {
    if !loss.is_finite() {
        bail!("loss became {loss} at epoch {epoch}; try a lower --lr or --grad-clip");
    }
    Ok(())
}

/// What a training run reports at the end.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainReport {
    pub epochs: Vec<EpochStats>,
    #[serde(with = "grandis_wire::nan")]
    pub final_loss: f64,
    /// NaN (absent in JSON) when the run did not evaluate or the split is empty.
    #[serde(with = "grandis_wire::nan")]
    pub train_acc: f64,
    #[serde(with = "grandis_wire::nan")]
    pub val_acc: f64,
    #[serde(with = "grandis_wire::nan")]
    pub test_acc: f64,
    #[serde(with = "grandis_wire::nan")]
    pub median_epoch_s: f64,
    /// First epoch of this invocation (1 unless resumed).
    pub first_epoch: usize,
    pub num_parameters: usize,
    /// Link prediction: the final model's validation and test scores (None for node
    /// classification, or when the run did not evaluate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<grandis_wire::LinkSummary>,
}

impl TrainReport {
    /// The run's [`grandis_wire::RunSummary`] (`job`: the spec it ran; `device`: where it
    /// computed), as a single-process run: one server, one device, no traffic.
    pub fn summary(&self, job: &grandis_wire::JobSpec, device: String) -> grandis_wire::RunSummary {
        grandis_wire::RunSummary {
            job: job.clone(),
            device,
            num_parameters: self.num_parameters,
            first_epoch: self.first_epoch,
            losses: self.epochs.iter().map(|e| e.loss).collect(),
            epoch_seconds: self.epochs.iter().map(|e| e.seconds).collect(),
            final_loss: self.final_loss,
            train_acc: self.train_acc,
            val_acc: self.val_acc,
            test_acc: self.test_acc,
            median_epoch_s: self.median_epoch_s,
            peak_rss_bytes: grandis_telemetry::peak_rss_bytes(),
            execution: grandis_wire::Execution {
                mode: grandis_wire::Mode::Single,
                servers: 1,
                devices: 1,
                iterations_per_epoch: 1,
                sampling: "exact".into(),
                ..grandis_wire::Execution::default()
            },
            server: None,
            link: self.link.clone(),
        }
    }
}

/// One step of [`Prepared::timed_train_step`].
#[derive(Debug, Clone, Copy)]
pub struct TimedStep {
    pub loss: f64,
    /// Wall seconds to the end of the step's device work.
    pub seconds: f64,
    /// The backend's operation timers over the step.
    pub ops: grandis_engine::OpTimes,
}

/// A dataset view prepared for training on backend `B` (the CPU backend unless told
/// otherwise): uploaded graph, features, labelled train rows. Host-side copies of the split
/// stay in `view`, so accuracy is computed on downloaded logits whatever the backend.
pub struct Prepared<'a, B: Backend = CpuBackend> {
    pub view: DatasetView<'a>,
    pub backend: B,
    graph: B::Graph,
    /// Typed models: the graph split by relation.
    relations: Option<RelationGraphs<B>>,
    features: B::Buf,
    ids: B::Index,
    train_rows: B::Index,
    train_labels: B::Index,
    /// Host count of `train_rows` (the loss normaliser), so no device query is needed.
    num_train: usize,
}

/// Labelled vertices of `ids` (label in `0..classes`), with their labels.
fn labelled(view: &DatasetView<'_>, ids: &[u32]) -> (Vec<u32>, Vec<u32>) {
    ids.iter()
        .filter_map(|&v| {
            let l = *view.labels.get(v as usize)?;
            (l >= 0 && (l as usize) < view.num_classes).then_some((v, l as u32))
        })
        .unzip()
}

/// Checks that the features and labels of `view` match its vertex count.
fn check_view(view: &DatasetView<'_>) -> anyhow::Result<()> {
    let n = view.num_vertices();
    if view.features.len() != n * view.feature_dim {
        bail!(
            "dataset features hold {} values, expected {} vertices x {} = {}",
            view.features.len(),
            n,
            view.feature_dim,
            n * view.feature_dim
        );
    }
    if view.labels.len() != n {
        bail!(
            "dataset has {} labels for {} vertices",
            view.labels.len(),
            n
        );
    }
    Ok(())
}

impl<'a> Prepared<'a, CpuBackend> {
    /// Uploads the whole graph as one block with the normalisation `kind` needs, on a CPU
    /// backend with `threads` workers (default: one per core).
    pub fn new(
        view: DatasetView<'a>,
        kind: ModelKind,
        threads: Option<usize>,
    ) -> anyhow::Result<Self> {
        let backend = CpuBackend::new(threads)?;
        check_view(&view)?;
        // Build the normalised block inside the backend's own thread pool so `--threads`
        // bounds this step too.
        let block = backend.install(|| full_block(view.graph, grandis_models::aggregation(kind)));
        Self::from_block(backend, view, kind, block)
    }
}

impl<'a, B: Backend> Prepared<'a, B> {
    /// Uploads the whole graph as one block with the normalisation `kind` needs onto
    /// `backend` (any engine backend, e.g. CUDA).
    pub fn with_backend(
        backend: B,
        view: DatasetView<'a>,
        kind: ModelKind,
    ) -> anyhow::Result<Self> {
        check_view(&view)?;
        let block = full_block(view.graph, grandis_models::aggregation(kind));
        Self::from_block(backend, view, kind, block)
    }

    fn from_block(
        backend: B,
        view: DatasetView<'a>,
        kind: ModelKind,
        block: grandis_engine::BlockGraph,
    ) -> anyhow::Result<Self> {
        let n = view.num_vertices();
        let ids: Vec<u32> = (0..n as u32).collect();
        let split = grandis_models::split_block(kind, &block, view.types, &ids)?;
        let relations = RelationGraphs::upload(&backend, split.as_ref())?;
        drop(split);
        let graph = backend.upload_graph(&block)?;
        drop(block);
        let (train_rows, train_labels) = labelled(&view, view.train);
        Ok(Prepared {
            view,
            // One copy of the features onto the backend keeps the trait simple (a copy-free
            // CPU upload would need a borrowed buffer type).
            features: backend.upload(view.features)?,
            graph,
            relations,
            ids: backend.upload_index(&ids)?,
            num_train: train_rows.len(),
            train_rows: backend.upload_index(&train_rows)?,
            train_labels: backend.upload_index(&train_labels)?,
            backend,
        })
    }

    fn ctx(&self, train: Option<(u64, u64)>) -> StageCtx<'_, B> {
        let n = self.view.num_vertices();
        StageCtx {
            graph: &self.graph,
            typed: self.relations.as_ref(),
            n_dst: n,
            n_src: n,
            global_ids: &self.ids,
            train,
        }
    }

    /// The model's outputs for every vertex with dropout off (`n x classes`: the logits, or
    /// for link prediction the embeddings).
    pub fn logits(
        &self,
        model: &Model<B>,
        emb: Option<&NodeEmbeddings>,
    ) -> anyhow::Result<Vec<f32>> {
        let input = self.input(emb)?;
        let input = input.as_ref().unwrap_or(&self.features);
        let (logits, _) = model.forward(&self.backend, &self.ctx(None), input, false)?;
        let mut host = vec![0.0f32; self.view.num_vertices() * model.config.classes];
        self.backend.download(&logits, 0, &mut host)?;
        Ok(host)
    }

    /// Fraction of labelled vertices of `ids` whose argmax logit is their label.
    pub fn accuracy(&self, logits: &[f32], ids: &[u32]) -> f64 {
        let c = self.view.num_classes;
        let (rows, labels) = labelled(&self.view, ids);
        if rows.is_empty() {
            return f64::NAN;
        }
        let correct = rows
            .iter()
            .zip(&labels)
            .filter(|(&v, &l)| argmax(&logits[v as usize * c..(v as usize + 1) * c]) == l as usize)
            .count();
        correct as f64 / rows.len() as f64
    }

    /// One training step; returns the loss (mean over labelled train vertices).
    pub fn train_step(
        &self,
        model: &mut Model<B>,
        emb: Option<&mut NodeEmbeddings>,
        opts: &TrainOptions,
        epoch: usize,
    ) -> anyhow::Result<f64> {
        if self.num_train == 0 {
            bail!("the dataset's train split has no labelled vertices");
        }
        let (n, c) = (self.view.num_vertices(), self.view.num_classes);
        self.step(model, emb, opts, epoch, |b, logits, grad| {
            let normalizer = self.num_train as f32;
            let loss_sum = b.cross_entropy(
                logits,
                n,
                c,
                &self.train_rows,
                &self.train_labels,
                normalizer,
                grad,
            )?;
            Ok(loss_sum / normalizer as f64)
        })
    }

    /// [`Self::train_step`] timed to the end of its device work, with what `profile` (the
    /// backend's operation timers, reset first) saw of it: what a benchmark reports of an
    /// epoch and the planner's calibration prices its kernels from.
    pub fn timed_train_step(
        &self,
        model: &mut Model<B>,
        opts: &TrainOptions,
        epoch: usize,
        profile: &dyn grandis_engine::OpProfile,
    ) -> anyhow::Result<TimedStep> {
        profile.reset_op_times();
        let start = Instant::now();
        let loss = self.train_step(model, None, opts, epoch)?;
        self.backend.synchronize()?;
        Ok(TimedStep {
            loss,
            seconds: start.elapsed().as_secs_f64(),
            ops: profile.op_times(),
        })
    }

    /// One link-prediction step: binary cross-entropy of `decoder` over the split's
    /// supervision positives and `negatives` corrupted destinations per positive (see
    /// [`link`]), then Adam on the decoder's own parameters; returns the loss (mean over
    /// those pairs).
    #[allow(clippy::too_many_arguments)]
    pub fn link_step(
        &self,
        model: &mut Model<B>,
        emb: Option<&mut NodeEmbeddings>,
        decoder: &mut Decoder,
        opts: &TrainOptions,
        epoch: usize,
        split: &LinkSplitView<'_>,
        negatives: u32,
    ) -> anyhow::Result<f64> {
        let n = self.view.num_vertices();
        let d = model.config.classes;
        let neg = link::Negatives::new(
            negatives,
            split.negative_destinations(n as u32),
            opts.seed,
            epoch as u64,
        )
        .all(split.train);
        let mut dparams = vec![0f32; decoder.num_params()];
        let dec = &*decoder;
        let loss = self.step(model, emb, opts, epoch, |b, z, grad| {
            let mut host = vec![0.0f32; n * d];
            b.download(z, 0, &mut host)?;
            let mut dz = vec![0.0f32; n * d];
            let loss = dec.bce(&host, split.train, &neg, &mut dz, &mut dparams);
            *grad = b.upload(&dz)?;
            Ok(loss)
        })?;
        // Not clipped: the clipping factor is the model's parameters' alone.
        decoder.adam_step(&dparams, &opts.adam(epoch as u64, 1.0));
        Ok(loss)
    }

    /// The model's input when it has learnable embeddings (the features, then each
    /// vertex's embedding row), uploaded; None: the features alone.
    fn input(&self, emb: Option<&NodeEmbeddings>) -> anyhow::Result<Option<B::Buf>> {
        emb.map(|e| {
            let host = e.input(self.view.features, self.view.feature_dim);
            Ok(self.backend.upload(&host)?)
        })
        .transpose()
    }

    /// A training step whose loss `loss` computes from the model's outputs, writing their
    /// gradient into its third argument (allocated `n x outputs`): forward with dropout,
    /// backward, clipping, Adam; with learnable embeddings, their sparse Adam step over every
    /// row (a full-batch step reads them all). Returns the loss.
    fn step(
        &self,
        model: &mut Model<B>,
        emb: Option<&mut NodeEmbeddings>,
        opts: &TrainOptions,
        epoch: usize,
        loss: impl FnOnce(&B, &B::Buf, &mut B::Buf) -> anyhow::Result<f64>,
    ) -> anyhow::Result<f64> {
        let b = &self.backend;
        let n = self.view.num_vertices();
        let ctx = self.ctx(Some((opts.seed, epoch as u64)));
        let input = self.input(emb.as_deref())?;
        let x = input.as_ref().unwrap_or(&self.features);
        model.zero_grads(b)?;
        let (logits, tape) = model.forward(b, &ctx, x, true)?;
        let mut grad = b.alloc(n * model.config.classes)?;
        let loss = loss(b, &logits, &mut grad)?;
        let grad_input = model.backward(b, &ctx, x, &logits, tape, grad, emb.is_some())?;
        if let Some(emb) = emb {
            let gx = grad_input.context("internal: the model computed no input gradient")?;
            let mut host = vec![0f32; n * model.config.in_dim];
            b.download(&gx, 0, &mut host)?;
            let rows: Vec<u32> = (0..n as u32).collect();
            emb.adam_step(&rows, &host, self.view.feature_dim, &opts.adam(1, 1.0));
        }
        let grad_scale = model.clip_factor(b, opts.grad_clip)?;
        model.adam_step(b, &opts.adam(epoch as u64, grad_scale))?;
        Ok(loss)
    }
}

pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// What a run trains its model for, and with what.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "task")]
pub enum Objective {
    /// Node classification on the dataset's labels and vertex splits.
    #[default]
    Node,
    /// Link prediction on the dataset's link split (`ModelConfig::classes` is the embedding
    /// width): [`link`].
    Link {
        /// Corrupted-destination negatives per supervision edge each epoch.
        negatives: u32,
        /// How a pair is scored (absent in checkpoints from before the MLP decoder: dot).
        #[serde(default)]
        decoder: grandis_wire::LinkDecoder,
    },
}

impl Objective {
    /// A job's objective.
    pub fn for_job(spec: &grandis_wire::JobSpec) -> Objective {
        match spec.task {
            grandis_wire::Task::Node => Objective::Node,
            grandis_wire::Task::Link => {
                let link = spec.link.unwrap_or_default();
                Objective::Link {
                    negatives: link.negatives,
                    decoder: link.decoder,
                }
            }
        }
    }

    /// The job task this objective trains ([`Objective::for_job`]'s inverse, up to the link
    /// options).
    pub fn task(&self) -> grandis_wire::Task {
        match self {
            Objective::Node => grandis_wire::Task::Node,
            Objective::Link { .. } => grandis_wire::Task::Link,
        }
    }

    /// A fresh link decoder for embeddings of `d` columns (None for node classification).
    pub fn decoder(&self, d: usize, seed: u64) -> Option<Decoder> {
        match *self {
            Objective::Node => None,
            Objective::Link { decoder, .. } => Some(Decoder::new(decoder, d, seed)),
        }
    }
}

/// Trains `config` on `view` for `opts.epochs` epochs (or the remaining ones when resuming)
/// on a CPU backend with `threads` workers, calling `on_epoch` after each. Saves a
/// checkpoint at the end when a path is given. See [`train_on`] for other backends.
pub fn train(
    view: DatasetView<'_>,
    config: ModelConfig,
    opts: &TrainOptions,
    ckpt: &CheckpointOptions,
    threads: Option<usize>,
    on_epoch: impl FnMut(&EpochStats) + Send,
) -> anyhow::Result<TrainReport> {
    let links = check_config(&view, &config, opts.objective, opts.embedding_dim)?;
    let prepared = Prepared::new(view, config.kind, threads)?;
    // On one of the backend's own threads, so each kernel runs in place rather than being
    // handed to the pool and waited for (as the distributed modes' CPU ranks run).
    let prepared = &prepared;
    prepared
        .backend
        .install(move || train_prepared(prepared, config, links, opts, ckpt, on_epoch))
}

/// [`train`] on any engine backend (e.g. `grandis_engine::cuda::CudaBackend`). The
/// checkpoint format does not depend on the backend, so a run may resume on another one.
pub fn train_on<B: Backend>(
    backend: B,
    view: DatasetView<'_>,
    config: ModelConfig,
    opts: &TrainOptions,
    ckpt: &CheckpointOptions,
    on_epoch: impl FnMut(&EpochStats),
) -> anyhow::Result<TrainReport> {
    let links = check_config(&view, &config, opts.objective, opts.embedding_dim)?;
    let prepared = Prepared::with_backend(backend, view, config.kind)?;
    train_prepared(&prepared, config, links, opts, ckpt, on_epoch)
}

/// That `config` fits `view` for `objective`: the model reads the dataset's features and
/// `embedding_dim` learnable columns ([`TrainOptions::embedding_dim`]), and predicts the dataset's
/// classes (node classification) or embeddings of any width (link prediction, whose split
/// is returned, checked: ids in range, the parts disjoint, no negative a positive).
pub fn check_config<'v>(
    view: &DatasetView<'v>,
    config: &ModelConfig,
    objective: Objective,
    embedding_dim: usize,
) -> anyhow::Result<Option<LinkSplitView<'v>>> {
    if config.in_dim != view.feature_dim + embedding_dim {
        bail!(
            "model expects {} input columns, the dataset has {} features{}",
            config.in_dim,
            view.feature_dim,
            if embedding_dim > 0 {
                format!(" and the run {embedding_dim} embedding columns")
            } else {
                String::new()
            }
        );
    }
    if config.in_dim == 0 {
        bail!("the dataset has no features: give the model learnable ones (--embedding-dim)");
    }
    match objective {
        Objective::Node => {
            if config.classes != view.num_classes {
                bail!(
                    "model expects {} classes, dataset has {}",
                    config.classes,
                    view.num_classes
                );
            }
            Ok(None)
        }
        Objective::Link { negatives, .. } => {
            if negatives == 0 {
                bail!("link prediction needs at least one negative per supervision edge");
            }
            let links = view.links.context(
                "link prediction needs a dataset with a link split: make one with \
                 `grandis data split-edges`",
            )?;
            links
                .check(view.num_vertices() as u64, view.graph.is_symmetric())
                .map_err(|(part, msg)| anyhow::anyhow!("link split {}: {msg}", part.file()))?;
            Ok(Some(links))
        }
    }
}

fn train_prepared<B: Backend>(
    prepared: &Prepared<'_, B>,
    config: ModelConfig,
    links: Option<LinkSplitView<'_>>,
    opts: &TrainOptions,
    ckpt: &CheckpointOptions,
    mut on_epoch: impl FnMut(&EpochStats),
) -> anyhow::Result<TrainReport> {
    let view = prepared.view;
    let b = &prepared.backend;
    let mut model = Model::new(b, config.clone())?;
    let n = view.num_vertices();
    let mut emb =
        (opts.embedding_dim > 0).then(|| NodeEmbeddings::new(n, opts.embedding_dim, config.seed));
    let mut decoder = opts.objective.decoder(config.classes, config.seed);
    let mut first_epoch = 1;
    if let Some(ck) = ckpt.resume_from(&config, opts)? {
        ck.check_epochs_left(opts.epochs)?;
        ck.restore(b, &mut model, true)?;
        // The same options, so the same embedding width and decoder (none or both).
        emb = ck.node_embeddings(n, true)?;
        decoder = ck.link_decoder(true)?;
        first_epoch = ck.epochs_done + 1;
    }
    let mut stats = Vec::new();
    let mut last_logits = None;
    for epoch in first_epoch..=opts.epochs {
        let start = Instant::now();
        let loss = match (opts.objective, &links, decoder.as_mut()) {
            (Objective::Link { negatives, .. }, Some(split), Some(dec)) => {
                prepared.link_step(&mut model, emb.as_mut(), dec, opts, epoch, split, negatives)?
            }
            _ => prepared.train_step(&mut model, emb.as_mut(), opts, epoch)?,
        };
        let seconds = start.elapsed().as_secs_f64();
        check_loss(loss, epoch)?;
        let (mut train_acc, mut val_acc, mut val_auc) = (f64::NAN, f64::NAN, f64::NAN);
        if opts.eval.after(epoch, opts.epochs) {
            let logits = prepared.logits(&model, emb.as_ref())?;
            match (&links, &decoder) {
                (Some(split), Some(dec)) => {
                    val_auc =
                        link::scores_of(dec, &logits, split, grandis_store::LinkPart::ValPos).auc
                }
                _ => {
                    train_acc = prepared.accuracy(&logits, view.train);
                    val_acc = prepared.accuracy(&logits, view.val);
                }
            }
            // The last epoch's evaluation is the final one.
            last_logits = (epoch == opts.epochs).then_some(logits);
        }
        let s = EpochStats {
            epoch,
            loss,
            train_acc,
            val_acc,
            val_auc,
            seconds,
        };
        on_epoch(&s);
        stats.push(s);
        if ckpt.due(epoch, opts.epochs) {
            if let Some(path) = &ckpt.path {
                let learnt = Learnt {
                    embeddings: emb.as_ref(),
                    decoder: decoder.as_ref(),
                };
                save_checkpoint_with(path, b, &model, learnt, Some(opts), epoch, true)?;
            }
        }
    }
    let logits = match last_logits {
        None if opts.eval.at_end() => Some(prepared.logits(&model, emb.as_ref())?),
        evaluated => evaluated,
    };
    let accuracy = |split| match (&logits, &links) {
        (Some(l), None) => prepared.accuracy(l, split),
        _ => f64::NAN,
    };
    let link = match (&logits, &links, &decoder) {
        (Some(z), Some(split), Some(dec)) => Some(link::summary_of(dec, z, split)),
        _ => None,
    };
    if first_epoch > opts.epochs {
        if let Some(path) = &ckpt.path {
            // Nothing trained (the checkpoint is already past --epochs): keep it as it is.
            tracing::info!(
                "{} already holds {} epochs",
                path.display(),
                first_epoch - 1
            );
        }
    }
    Ok(TrainReport {
        final_loss: stats.last().map_or(f64::NAN, |s| s.loss),
        train_acc: accuracy(view.train),
        val_acc: accuracy(view.val),
        test_acc: accuracy(view.test),
        median_epoch_s: grandis_telemetry::median(
            &stats.iter().map(|s| s.seconds).collect::<Vec<_>>(),
        ),
        first_epoch,
        num_parameters: model.num_parameters(),
        epochs: stats,
        link,
    })
}

/// Logits (`n x classes`, dropout off) of the model stored in a checkpoint, computed on a
/// CPU backend with `threads` workers.
pub fn predict_logits(
    view: DatasetView<'_>,
    checkpoint: &std::path::Path,
    threads: Option<usize>,
) -> anyhow::Result<Vec<f32>> {
    let ck = load_checked(&view, checkpoint)?;
    let prepared = Prepared::new(view, ck.model.kind, threads)?;
    logits_of(&prepared, &ck)
}

/// [`predict_logits`] on any engine backend.
pub fn predict_logits_on<B: Backend>(
    backend: B,
    view: DatasetView<'_>,
    checkpoint: &std::path::Path,
) -> anyhow::Result<Vec<f32>> {
    let ck = load_checked(&view, checkpoint)?;
    let prepared = Prepared::with_backend(backend, view, ck.model.kind)?;
    logits_of(&prepared, &ck)
}

fn load_checked(
    view: &DatasetView<'_>,
    checkpoint: &std::path::Path,
) -> anyhow::Result<Checkpoint> {
    let ck = load_checkpoint(checkpoint)?;
    // A link-prediction model outputs embeddings of its own width, not the dataset's classes.
    let classes_match = match ck.objective() {
        Objective::Node => ck.model.classes == view.num_classes,
        Objective::Link { .. } => true,
    };
    let learnt = ck.train.as_ref().map_or(0, |t| t.embedding_dim);
    if ck.model.in_dim != view.feature_dim + learnt || !classes_match {
        bail!(
            "checkpoint {} expects {} features and {} classes, dataset has {} and {}",
            checkpoint.display(),
            ck.model.in_dim - learnt,
            ck.model.classes,
            view.feature_dim,
            view.num_classes
        );
    }
    Ok(ck)
}

fn logits_of<B: Backend>(prepared: &Prepared<'_, B>, ck: &Checkpoint) -> anyhow::Result<Vec<f32>> {
    let mut model = Model::new(&prepared.backend, ck.model.clone())?;
    ck.restore(&prepared.backend, &mut model, false)?;
    let emb = ck.node_embeddings(prepared.view.num_vertices(), false)?;
    prepared.logits(&model, emb.as_ref())
}

#[cfg(test)]
mod tests {
    use super::EvalSchedule;

    #[test]
    fn evaluation_passes_count_the_epochs_the_schedule_names() {
        assert_eq!(EvalSchedule::Every(1).passes(0, 5), 5);
        assert_eq!(EvalSchedule::Every(2).passes(0, 5), 3); // 2, 4, 5
        assert_eq!(EvalSchedule::Every(2).passes(3, 5), 2); // resumed: 4, 5
        assert_eq!(EvalSchedule::End.passes(0, 5), 1);
        assert_eq!(EvalSchedule::Never.passes(0, 5), 0);
        // Nothing left to train: the final evaluation alone, unless there is none.
        assert_eq!(EvalSchedule::Every(1).passes(5, 5), 1);
        assert_eq!(EvalSchedule::Never.passes(5, 5), 0);
    }
}
