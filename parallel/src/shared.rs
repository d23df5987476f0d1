//! What every rank of a process reads and no rank changes: the dataset and its id map, the
//! layout, the model and training options, the feed of steps, what evaluation runs on, and
//! the buffers the ranks hand back. The worker and a step's runtime both read it.

use std::sync::Arc;

use grandis_engine::norm::GlobalScales;
use grandis_masking::{DevicePlan, Layout};
use grandis_models::ModelConfig;
use grandis_store::DatasetView;
use grandis_trainer::{Checkpoint, CheckpointOptions, TrainOptions};

use crate::feed::{Feed, StepCounts};
use crate::fetch::{Answerer, FeatureSource, Prefetcher};
use crate::prepare::{BufferPool, Preparer};

/// Read-only state shared by all ranks.
pub(crate) struct Shared<'a> {
    pub view: DatasetView<'a>,
    pub new_to_old: &'a [u32],
    /// Home rank of every new id (replicated rows' features are fetched from it).
    pub layout: &'a Layout,
    pub scales: &'a GlobalScales,
    pub config: &'a ModelConfig,
    pub opts: &'a TrainOptions,
    /// Link prediction's split and negatives, when the run trains for it (fb, flx).
    pub link: Option<crate::link_task::LinkTask<'a>>,
    /// `SPLIT_*` flags by NEW id, only for vertices with a valid label.
    pub labelled_flags: &'a [u8],
    /// Labelled train / val / test vertices in the whole graph.
    pub totals: [usize; 3],
    pub collect_logits: bool,
    /// Training steps, in order (`iterations` per epoch).
    pub feed: &'a Feed,
    /// Reads each rank's next step's feature rows ahead (runs with per-step plans).
    pub prefetch: Option<&'a Prefetcher>,
    /// Reads the rows other servers' ranks asked for ahead (runs with per-step plans).
    pub answerer: Option<&'a Answerer>,
    pub iterations: usize,
    /// What evaluation runs on.
    pub eval: EvalOn<'a>,
    /// Host weights (model parameter order) replacing the seeded initialisation.
    pub weights: Option<&'a [Vec<f32>]>,
    /// A checkpoint to continue from: weights, Adam moments and the epochs it holds.
    pub resume: Option<&'a Checkpoint>,
    /// Where and when global rank 0 writes checkpoints.
    pub checkpoint: &'a CheckpointOptions,
    /// Layer-wise inference after training.
    pub infer: Option<crate::infer::InferShared<'a>>,
    /// SANCUS's bounded staleness between servers (fb, flx).
    pub staleness: Option<grandis_wire::Staleness>,
    /// DGS's fraction of feature columns fetched from other servers (cob, mb).
    pub remote_features: Option<f64>,
    /// Feature matrices the ranks hand back after uploading, for the next steps.
    pub buffers: &'a BufferPool,
    /// What this server's part of the steps computed, when the other servers' parts are
    /// counted by their own processes (`crate::steps::StepPart::Server`, several servers): the
    /// ranks add every server's up at the end of the run. None when the counts here are the
    /// run's.
    pub server_counts: Option<&'a StepCounts>,
    /// Every training step reads every vertex (fb, flx): learnable node embeddings step every
    /// row each step, as mode single does ([`crate::embedding_shard`]).
    pub steps_read_every_vertex: bool,
}

impl<'a> Shared<'a> {
    /// Where the ranks' layer-0 features come from.
    pub fn features(&self) -> FeatureSource<'a> {
        FeatureSource {
            view: self.view,
            new_to_old: self.new_to_old,
            layout: self.layout,
        }
    }

    /// What preparing a rank's step input reads (the producers' fetch stage too).
    pub fn preparer(&self) -> Preparer<'a> {
        Preparer::for_model(
            self.features(),
            self.config,
            self.scales,
            self.labelled_flags,
            self.buffers,
        )
    }

    /// Epochs the resumed checkpoint holds (0 for a fresh run).
    pub fn epochs_done(&self) -> usize {
        self.resume.map_or(0, |ck| ck.epochs_done)
    }

    /// The global index of the first step trained here.
    pub fn first_step(&self) -> u64 {
        (self.epochs_done() * self.iterations) as u64
    }
}

/// What the ranks evaluate on ([`crate::decide::Eval`], with the feed of its batches).
pub(crate) enum EvalOn<'a> {
    /// The training plans (FB, exact FLX).
    TrainingPlans,
    /// Exact plans of every rank's whole partition (`[rank][layer]`).
    Plans(&'a [Vec<Arc<DevicePlan>>]),
    /// The whole graph's forward pass, layer by layer across the ranks (cob, mb, cluster).
    Layerwise(&'a crate::infer::PassInputs<'a>),
}
