//! Set-ups the crate's unit tests share: a synthetic dataset, a random layout of it, a small
//! SAGE model and its training options (the integration tests have their own, in
//! `tests/common`, over the public API).

use grandis_models::{ModelConfig, ModelKind};
use grandis_store::{DatasetView, InMemoryDataset};
use grandis_synth::SynthConfig;
use grandis_trainer::TrainOptions;

use crate::PartitionedGraph;

/// The default synthetic graph with `nodes` vertices from `seed`.
pub(crate) fn synth(nodes: u64, seed: u64) -> InMemoryDataset {
    grandis_synth::generate_in_memory(&SynthConfig {
        nodes,
        seed,
        ..SynthConfig::default()
    })
    .expect("a synthetic dataset")
}

/// `view` on 2 servers x 2 devices, randomly partitioned from `seed`.
pub(crate) fn random_2x2(view: &DatasetView<'_>, seed: u64) -> PartitionedGraph {
    PartitionedGraph::partition(
        view,
        true,
        2,
        2,
        grandis_partition::PartitionMethod::Random,
        seed,
    )
    .expect("a random 2 x 2 partition")
}

/// A 2-layer SAGE model of `hidden` columns for `view`.
pub(crate) fn sage(view: &DatasetView<'_>, hidden: usize, dropout: f32, seed: u64) -> ModelConfig {
    ModelConfig {
        heads: 2,
        dropout,
        seed,
        ..ModelConfig::new(
            ModelKind::Sage,
            2,
            view.feature_dim,
            hidden,
            view.num_classes,
        )
    }
}

/// Adam at 0.01 for `epochs` epochs, no clipping, node classification.
pub(crate) fn train_opts(epochs: usize, weight_decay: f32, seed: u64) -> TrainOptions {
    TrainOptions {
        objective: Default::default(),
        epochs,
        lr: 0.01,
        weight_decay,
        adamw: false,
        grad_clip: None,
        seed,
        eval: Default::default(),
        embedding_dim: 0,
    }
}
